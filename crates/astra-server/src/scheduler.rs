//! Continuous batching over a fixed number of slots, with the prompt cache.
//!
//! Protocol (one scheduler thread owns the model's sequences):
//! 1. Requests wait in a bounded queue; a request joins between steps when a slot is
//!    free.
//! 2. A joining request takes the idle sequence whose cached tokens share the longest
//!    prefix with its prompt (a finished request's sequence stays idle with its tokens:
//!    the prompt cache), rewinds it to that prefix, and feeds only the rest.
//! 3. Each step runs every active sequence together in one forward pass: one token per
//!    decoding sequence, and prompt chunks of prefilling ones in the room left in the
//!    batch. Each result goes to its client as it is sampled; finished or abandoned
//!    requests leave before the next step.
//!
//! Invariants: a sequence's logits do not depend on the others in the batch
//! ([`Model::forward_many`]), so a request's output is the same alone or under load;
//! idle sequences and active ones together stay within the memory budget, the least
//! recently used idle ones dropped first.

use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Instant;

use astra_engine::{Model, Session, Step, MAX_BATCH};
use astra_tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use crate::generation::{Emitted, FinishReason, GenParams, Generation};
use crate::metrics::Metrics;

/// One sequence to generate: a request's prompt (one per requested choice).
pub struct Job {
    pub prompt: Vec<u32>,
    pub params: GenParams,
    /// The choice index within the request.
    pub index: usize,
    pub events: UnboundedSender<Event>,
    pub received: Instant,
}

/// Token counts and timings of a finished sequence.
#[derive(Clone, Debug, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub prompt_ms: f64,
    pub predicted_ms: f64,
}

pub enum Event {
    Token { index: usize, emitted: Emitted },
    Done { index: usize, finish: FinishReason, usage: Usage },
    Failed { index: usize, message: String },
}

struct Idle {
    session: Session,
    tokens: Vec<u32>,
    used: u64,
}

struct Active {
    job: Job,
    session: Session,
    /// The tokens in the session's cache, in order.
    tokens: Vec<u32>,
    /// Prompt tokens already in the cache.
    fed: usize,
    /// The last sampled token, to feed next.
    next: [u32; 1],
    generation: Generation,
    cached: usize,
    prompt_done: Option<Instant>,
    last_token: Instant,
}

pub struct Scheduler {
    model: Arc<Model>,
    tok: Arc<Tokenizer>,
    jobs: Receiver<Job>,
    metrics: Arc<Metrics>,
    parallel: usize,
    ctx: usize,
    /// Bytes all sequences (active and idle) may take.
    budget: usize,
    idle: Vec<Idle>,
    active: Vec<Active>,
    clock: u64,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Scheduler {
    pub fn new(
        model: Arc<Model>,
        tok: Arc<Tokenizer>,
        jobs: Receiver<Job>,
        metrics: Arc<Metrics>,
        parallel: usize,
        ctx: usize,
        budget: usize,
    ) -> Scheduler {
        metrics.slots_total.store(parallel as u64, Ordering::Relaxed);
        Scheduler { model, tok, jobs, metrics, parallel, ctx, budget, idle: Vec::new(), active: Vec::new(), clock: 0 }
    }

    /// Serves jobs until the queue's senders are gone and every job has finished.
    pub fn run(mut self) {
        loop {
            if !self.admit() {
                return;
            }
            self.drop_abandoned();
            self.metrics.slots_busy.store(self.active.len() as u64, Ordering::Relaxed);
            if !self.active.is_empty() {
                self.step();
            }
        }
    }

    /// Moves queued jobs into free slots, waiting for one when nothing is active.
    /// Returns false when the queue is closed and nothing is left to do.
    fn admit(&mut self) -> bool {
        while self.active.len() < self.parallel {
            let job = if self.active.is_empty() {
                match self.jobs.recv() {
                    Ok(j) => j,
                    Err(_) => return false,
                }
            } else {
                match self.jobs.try_recv() {
                    Ok(j) => j,
                    Err(TryRecvError::Empty | TryRecvError::Disconnected) => break,
                }
            };
            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            if job.events.is_closed() {
                continue;
            }
            if let Err(message) = self.start(job) {
                eprintln!("astra: {message}");
            }
        }
        true
    }

    fn session_bytes(&self) -> usize {
        self.idle.iter().map(|i| i.session.kv_bytes()).chain(self.active.iter().map(|a| a.session.kv_bytes())).sum()
    }

    fn start(&mut self, job: Job) -> Result<(), String> {
        // The prompt's last token is always fed again: its logits start the generation.
        let reusable = |tokens: &[u32]| common_prefix(tokens, &job.prompt).min(job.prompt.len() - 1);
        let best = (0..self.idle.len()).max_by_key(|&i| (reusable(&self.idle[i].tokens), self.idle[i].used));
        let mut taken = match best {
            Some(i) if reusable(&self.idle[i].tokens) > 0 => Some(self.idle.swap_remove(i)),
            _ => None,
        };
        if taken.is_none() {
            let new_bytes = self.idle.first().map(|i| i.session.kv_bytes());
            let fits = new_bytes.is_none_or(|b| self.session_bytes() + b <= self.budget);
            if !fits {
                // Recycle the least recently used idle sequence.
                let lru = (0..self.idle.len()).min_by_key(|&i| self.idle[i].used).expect("an idle sequence exists");
                taken = Some(self.idle.swap_remove(lru));
            }
        }
        let (mut session, mut tokens) = match taken {
            Some(i) => (i.session, i.tokens),
            None => match self.model.session(self.ctx) {
                Ok(s) => (s, Vec::new()),
                Err(e) => {
                    let _ = job.events.send(Event::Failed { index: job.index, message: e.to_string() });
                    return Err(e.to_string());
                }
            },
        };
        let keep = session.rewind(reusable(&tokens));
        tokens.truncate(keep);
        Metrics::add(&self.metrics.prompt_tokens, job.prompt.len());
        Metrics::add(&self.metrics.cached_tokens, keep);
        let generation = Generation::new(job.params.clone(), &job.prompt);
        self.active.push(Active {
            job,
            session,
            tokens,
            fed: keep,
            next: [0],
            generation,
            cached: keep,
            prompt_done: None,
            last_token: Instant::now(),
        });
        Ok(())
    }

    /// Frees the slots of clients that went away.
    fn drop_abandoned(&mut self) {
        let mut i = 0;
        while i < self.active.len() {
            if self.active[i].job.events.is_closed() {
                let a = self.active.swap_remove(i);
                self.retire(a);
            } else {
                i += 1;
            }
        }
    }

    /// Returns a finished sequence to the idle set (the prompt cache).
    fn retire(&mut self, a: Active) {
        self.clock += 1;
        self.idle.push(Idle { session: a.session, tokens: a.tokens, used: self.clock });
        while self.session_bytes() > self.budget && !self.idle.is_empty() {
            let lru = (0..self.idle.len()).min_by_key(|&i| self.idle[i].used).expect("non-empty");
            self.idle.swap_remove(lru);
        }
    }

    fn step(&mut self) {
        // Decoding sequences first (one token each), prompt chunks in the room left.
        let mut room = MAX_BATCH;
        let mut plan: Vec<(usize, usize)> = Vec::with_capacity(self.active.len()); // (active index, tokens)
        for (i, a) in self.active.iter().enumerate() {
            if a.fed == a.job.prompt.len() {
                plan.push((i, 1));
                room -= 1;
            }
        }
        for (i, a) in self.active.iter().enumerate() {
            let left = a.job.prompt.len() - a.fed;
            if left > 0 && room > 0 {
                let n = left.min(room);
                plan.push((i, n));
                room -= n;
            }
        }
        plan.sort_unstable();
        let mut steps = Vec::with_capacity(plan.len());
        let mut planned = plan.iter().peekable();
        for (i, a) in self.active.iter_mut().enumerate() {
            let Some(&&(_, n)) = planned.peek().filter(|(j, _)| *j == i) else { continue };
            planned.next();
            let Active { session, job, fed, next, .. } = a;
            let (tokens, logits_from) = if *fed == job.prompt.len() {
                (&next[..], 0)
            } else {
                let chunk = &job.prompt[*fed..*fed + n];
                let last = *fed + n == job.prompt.len();
                (chunk, if last { n - 1 } else { n })
            };
            steps.push(Step { session, tokens, logits_from });
        }
        let result = self.model.forward_many(&mut steps);
        drop(steps);
        let logits = match result {
            Ok(l) => l,
            Err(e) => {
                for a in std::mem::take(&mut self.active) {
                    let _ = a.job.events.send(Event::Failed { index: a.job.index, message: e.to_string() });
                }
                return;
            }
        };
        let mut finished = Vec::new();
        for (&(i, n), mut logits) in plan.iter().zip(logits) {
            let a = &mut self.active[i];
            if a.fed == a.job.prompt.len() {
                a.tokens.push(a.next[0]);
            } else {
                a.tokens.extend_from_slice(&a.job.prompt[a.fed..a.fed + n]);
                a.fed += n;
            }
            if logits.is_empty() {
                continue;
            }
            let now = Instant::now();
            match a.prompt_done {
                None => {
                    a.prompt_done = Some(now);
                    self.metrics.time_to_first_token.observe((now - a.job.received).as_secs_f64());
                }
                Some(_) => self.metrics.inter_token_latency.observe((now - a.last_token).as_secs_f64()),
            }
            a.last_token = now;
            let room = self.ctx - a.session.n_past();
            let emitted = a.generation.step(&self.tok, &mut logits, room);
            if let Some(id) = emitted.id {
                a.next = [id];
                Metrics::add(&self.metrics.generated_tokens, 1);
            }
            let finish = emitted.finish;
            let _ = a.job.events.send(Event::Token { index: a.job.index, emitted });
            if let Some(finish) = finish {
                finished.push((i, finish));
            }
        }
        // Highest index first, so that swap_remove leaves the rest in place.
        finished.sort_unstable_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, finish) in finished {
            let a = self.active.swap_remove(i);
            let now = Instant::now();
            let prompt_done = a.prompt_done.unwrap_or(now);
            let usage = Usage {
                prompt_tokens: a.job.prompt.len(),
                cached_tokens: a.cached,
                completion_tokens: a.generation.generated.len(),
                prompt_ms: (prompt_done - a.job.received).as_secs_f64() * 1e3,
                predicted_ms: (now - prompt_done).as_secs_f64() * 1e3,
            };
            let _ = a.job.events.send(Event::Done { index: a.job.index, finish, usage });
            self.retire(a);
        }
    }
}
