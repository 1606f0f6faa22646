//! The engine's worker pool: low-latency fork-join for the hundreds of short parallel
//! steps of one decoded token, without collapsing when the machine is oversubscribed.
//!
//! Protocol (one job at a time, submitted by the thread that owns the pool):
//! 1. The submitter writes the job (a task function and a task count) into the shared
//!    state under its lock, bumps the generation, and wakes parked helpers.
//! 2. Helpers spin on the generation for a bounded time ([`SPIN_ROUNDS`]), then park.
//!    On a new generation they claim task indices under the lock, run each, and count
//!    it done.
//! 3. The submitter claims tasks the same way, then waits (spinning, then yielding)
//!    until every task is counted done, and clears the job.
//!
//! Invariant: a task index is claimed (under the lock) only while the job is in the
//! state, and the submitter removes the job only after every claimed task is done, so
//! the job's borrowed function outlives every call to it. Helpers that are slow to wake
//! simply find nothing left to claim: the submitter never waits for a helper that has
//! not claimed work, which is what keeps an oversubscribed machine from stalling.
//!
//! A task that panics is counted done all the same (its panic caught where it ran and
//! kept for [`Pool::take_panic`]), so a panic fails the work it belongs to and never
//! leaves the submitter waiting.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use astra_quant::matmul::Parallel;

/// Spin iterations (pause instructions) before a helper parks: meant to bridge the
/// short serial gaps between the parallel steps of a token without holding a core that
/// another process needs for long. Not tuned: decode speed with and without a
/// concurrent CPU hog is the measure to tune it by (docs/performance.md).
const SPIN_ROUNDS: u32 = 1 << 15;

type Task = dyn Fn(usize) + Sync;

struct Job {
    f: *const Task,
    next: usize,
    count: usize,
}

// SAFETY: the pointer is dereferenced only while the job is current (module invariant),
// and the function is Sync.
unsafe impl Send for Job {}

struct Shared {
    job: Mutex<Option<Job>>,
    wake: Condvar,
    generation: AtomicU64,
    done: AtomicUsize,
    parked: AtomicUsize,
    shutdown: AtomicU64,
    /// The message of the first task that panicked since [`Pool::take_panic`].
    panic: Mutex<Option<String>>,
}

pub struct Pool {
    shared: Arc<Shared>,
    helpers: Vec<JoinHandle<()>>,
    /// Serialises submitters (the pool runs one job at a time).
    submit: Mutex<()>,
}

impl Pool {
    /// A pool of `threads` threads: the submitting thread and `threads - 1` helpers.
    pub fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            wake: Condvar::new(),
            generation: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            shutdown: AtomicU64::new(0),
            panic: Mutex::new(None),
        });
        let helpers = (1..threads.max(1))
            .map(|i| {
                let s = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("astra-worker-{i}"))
                    .spawn(move || helper(&s))
                    .expect("spawn worker thread")
            })
            .collect();
        Pool {
            shared,
            helpers,
            submit: Mutex::new(()),
        }
    }
}

impl Shared {
    /// Runs `task`; a panic in it is kept (the first since the last
    /// [`Pool::take_panic`]) rather than unwinding into the pool.
    fn catching(&self, task: impl FnOnce()) {
        if let Err(payload) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(task)) {
            let message = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "(no message)".to_owned());
            let mut first = self.panic.lock().unwrap_or_else(|e| e.into_inner());
            first.get_or_insert(message);
        }
    }
}

impl Pool {
    /// The message of the first task that panicked since the last call, cleared. The
    /// job it belonged to ran to its end with that task's output unwritten.
    pub fn take_panic(&self) -> Option<String> {
        self.shared
            .panic
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }
}

/// Claims and runs tasks of the current job until none is left.
fn work(s: &Shared) {
    loop {
        let claimed = {
            let mut job = s.job.lock().expect("pool lock");
            match job.as_mut() {
                Some(j) if j.next < j.count => {
                    j.next += 1;
                    Some((j.f, j.next - 1))
                }
                _ => None,
            }
        };
        let Some((f, index)) = claimed else { return };
        // SAFETY: claimed while the job is current; it stays alive until this task is
        // counted done (module invariant).
        s.catching(|| unsafe { (*f)(index) });
        s.done.fetch_add(1, Ordering::Release);
    }
}

fn helper(s: &Shared) {
    let mut seen = 0u64;
    loop {
        let mut spins = 0;
        loop {
            if s.shutdown.load(Ordering::Acquire) != 0 {
                return;
            }
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            if spins < SPIN_ROUNDS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let guard = s.job.lock().expect("pool lock");
            s.parked.fetch_add(1, Ordering::SeqCst);
            // Re-check under the lock: a submitter bumps the generation under it.
            let guard = if s.generation.load(Ordering::SeqCst) == seen
                && s.shutdown.load(Ordering::SeqCst) == 0
            {
                s.wake.wait(guard).expect("pool lock")
            } else {
                guard
            };
            s.parked.fetch_sub(1, Ordering::SeqCst);
            drop(guard);
            spins = 0;
        }
        work(s);
    }
}

impl Parallel for Pool {
    fn threads(&self) -> usize {
        self.helpers.len() + 1
    }

    fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        if tasks == 0 {
            return;
        }
        if self.helpers.is_empty() || tasks == 1 {
            (0..tasks).for_each(|i| self.shared.catching(|| f(i)));
            return;
        }
        let _one_job = self.submit.lock().expect("pool submit lock");
        let s = &*self.shared;
        s.done.store(0, Ordering::Relaxed);
        {
            let mut job = s.job.lock().expect("pool lock");
            // SAFETY (lifetime erasure): the job is removed below, after every task has
            // been counted done, before `f` goes out of scope.
            let f: *const Task =
                unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Task>(f) };
            *job = Some(Job {
                f,
                next: 0,
                count: tasks,
            });
            s.generation.fetch_add(1, Ordering::SeqCst);
            if s.parked.load(Ordering::SeqCst) > 0 {
                s.wake.notify_all();
            }
        }
        work(s);
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) < tasks {
            if spins < SPIN_ROUNDS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        *s.job.lock().expect("pool lock") = None;
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        {
            let _guard = self.shared.job.lock().expect("pool lock");
            self.shared.shutdown.store(1, Ordering::SeqCst);
            self.shared.wake.notify_all();
        }
        for h in self.helpers.drain(..) {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    #[test]
    fn every_task_runs_exactly_once_across_many_jobs() {
        for threads in [1, 2, 3, 5] {
            let pool = Pool::new(threads);
            for n in [0usize, 1, 2, 7, 64, 1000] {
                let hits: Vec<AtomicU32> = (0..n).map(|_| AtomicU32::new(0)).collect();
                pool.run(n, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "{threads} threads, {n} tasks"
                );
            }
        }
    }

    #[test]
    fn helpers_that_parked_wake_for_later_jobs() {
        let pool = Pool::new(3);
        let sum = AtomicUsize::new(0);
        for round in 0..5 {
            // Long enough for the helpers to give up spinning and park.
            std::thread::sleep(std::time::Duration::from_millis(20));
            pool.run(100, &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), (round + 1) * 4950);
        }
    }

    /// A panicking task is counted done (the submitter does not wait forever), its
    /// message is kept for the caller, and the pool serves the next job.
    #[test]
    fn a_panicking_task_fails_its_call_and_the_pool_goes_on() {
        for threads in [1, 2, 3] {
            let pool = Pool::new(threads);
            let ran = AtomicUsize::new(0);
            pool.run(64, &|i| {
                if i == 17 {
                    panic!("task {i} fails");
                }
                ran.fetch_add(1, Ordering::Relaxed);
            });
            assert_eq!(ran.load(Ordering::Relaxed), 63, "{threads} threads");
            assert_eq!(pool.take_panic().as_deref(), Some("task 17 fails"));
            assert_eq!(pool.take_panic(), None, "cleared once taken");
            pool.run(1, &|_| panic!("a lone task"));
            assert_eq!(pool.take_panic().as_deref(), Some("a lone task"));
            let sum = AtomicUsize::new(0);
            pool.run(100, &|i| {
                sum.fetch_add(i, Ordering::Relaxed);
            });
            assert_eq!(sum.load(Ordering::Relaxed), 4950);
            assert_eq!(pool.take_panic(), None);
        }
    }
}
