//! Keeping the host awake while requests are in flight: a reference count over a
//! platform sleep inhibitor (Linux: logind's `Inhibit` over the system D-Bus; macOS: an
//! IOKit power assertion), taken when the first request starts and let go when the
//! last one ends.
//!
//! Invariant: the count and the inhibitor change together under one lock, so the
//! inhibitor is held exactly while the count is above zero, whatever the interleaving
//! of requests starting and ending.

use std::sync::{Arc, Mutex};

/// A way to keep the host from sleeping.
pub trait Inhibitor: Send + Sync {
    /// Starts inhibiting sleep.
    fn acquire(&self) -> Result<(), String>;
    /// Stops inhibiting sleep.
    fn release(&self);
}

pub struct KeepAwake {
    /// Requests in flight.
    count: Mutex<usize>,
    inhibitor: Box<dyn Inhibitor>,
}

/// Held by one in-flight request; dropping it releases its share.
pub struct AwakeGuard {
    owner: Arc<KeepAwake>,
}

impl KeepAwake {
    pub fn new(inhibitor: Box<dyn Inhibitor>) -> KeepAwake {
        KeepAwake {
            count: Mutex::new(0),
            inhibitor,
        }
    }

    /// The platform's inhibitor (one that does nothing where there is none).
    pub fn for_host() -> KeepAwake {
        KeepAwake::new(platform_inhibitor())
    }

    pub fn acquire(this: &Arc<KeepAwake>) -> AwakeGuard {
        let mut count = this.count.lock().expect("keep-awake lock");
        if *count == 0 {
            if let Err(e) = this.inhibitor.acquire() {
                eprintln!("astra: WARN cannot keep the host awake while serving: {e}");
            }
        }
        *count += 1;
        AwakeGuard {
            owner: Arc::clone(this),
        }
    }

    /// Requests holding it now.
    pub fn holders(&self) -> usize {
        *self.count.lock().expect("keep-awake lock")
    }
}

impl Drop for AwakeGuard {
    fn drop(&mut self) {
        let mut count = self.owner.count.lock().expect("keep-awake lock");
        *count -= 1;
        if *count == 0 {
            self.owner.inhibitor.release();
        }
    }
}

/// Does nothing: for platforms without an inhibitor here.
pub struct NoInhibitor;

impl Inhibitor for NoInhibitor {
    fn acquire(&self) -> Result<(), String> {
        Ok(())
    }
    fn release(&self) {}
}

#[cfg(target_os = "linux")]
fn platform_inhibitor() -> Box<dyn Inhibitor> {
    Box::new(logind::Logind::default())
}

#[cfg(target_os = "macos")]
fn platform_inhibitor() -> Box<dyn Inhibitor> {
    Box::new(macos::PowerAssertion::default())
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
fn platform_inhibitor() -> Box<dyn Inhibitor> {
    Box::new(NoInhibitor)
}

#[cfg(target_os = "linux")]
mod logind {
    //! logind's sleep inhibitor: `org.freedesktop.login1.Manager.Inhibit("sleep", …,
    //! "block")` on the system bus returns a file descriptor; sleep is blocked until
    //! it is closed.

    use std::sync::Mutex;

    #[derive(Default)]
    pub struct Logind {
        state: Mutex<State>,
    }

    #[derive(Default)]
    struct State {
        conn: Option<zbus::blocking::Connection>,
        fd: Option<zbus::zvariant::OwnedFd>,
        /// Set after a failure: it was reported once; later acquires do nothing.
        unavailable: bool,
    }

    impl Logind {
        fn inhibit(state: &mut State) -> Result<zbus::zvariant::OwnedFd, String> {
            if state.conn.is_none() {
                state.conn = Some(
                    zbus::blocking::Connection::system()
                        .map_err(|e| format!("no system D-Bus ({e})"))?,
                );
            }
            let conn = state.conn.as_ref().expect("just connected");
            let reply = conn
                .call_method(
                    Some("org.freedesktop.login1"),
                    "/org/freedesktop/login1",
                    Some("org.freedesktop.login1.Manager"),
                    "Inhibit",
                    &("sleep", "astra", "serving inference requests", "block"),
                )
                .map_err(|e| format!("logind refused the sleep inhibitor ({e})"))?;
            reply
                .body()
                .deserialize()
                .map_err(|e| format!("unexpected reply from logind ({e})"))
        }
    }

    impl super::Inhibitor for Logind {
        fn acquire(&self) -> Result<(), String> {
            let mut state = self.state.lock().expect("inhibitor lock");
            if state.unavailable {
                return Ok(());
            }
            match Self::inhibit(&mut state) {
                Ok(fd) => {
                    state.fd = Some(fd);
                    Ok(())
                }
                Err(e) => {
                    state.unavailable = true;
                    Err(format!("{e}; serving continues without it"))
                }
            }
        }

        fn release(&self) {
            // Closing the descriptor ends the inhibition.
            self.state.lock().expect("inhibitor lock").fd.take();
        }
    }
}

#[cfg(target_os = "macos")]
mod macos {
    //! An IOKit power assertion (`PreventUserIdleSystemSleep`) held while serving.

    use std::ffi::c_void;
    use std::sync::Mutex;

    type CFStringRef = *const c_void;
    #[link(name = "IOKit", kind = "framework")]
    extern "C" {
        fn IOPMAssertionCreateWithName(
            kind: CFStringRef,
            level: u32,
            name: CFStringRef,
            id: *mut u32,
        ) -> i32;
        fn IOPMAssertionRelease(id: u32) -> i32;
    }
    #[link(name = "CoreFoundation", kind = "framework")]
    extern "C" {
        fn CFStringCreateWithCString(
            alloc: *const c_void,
            s: *const i8,
            encoding: u32,
        ) -> CFStringRef;
        fn CFRelease(cf: *const c_void);
    }
    const UTF8: u32 = 0x0800_0100;
    const ASSERTION_LEVEL_ON: u32 = 255;

    #[derive(Default)]
    pub struct PowerAssertion {
        id: Mutex<Option<u32>>,
    }

    impl super::Inhibitor for PowerAssertion {
        fn acquire(&self) -> Result<(), String> {
            // SAFETY: null-terminated literals; the strings are released after use.
            unsafe {
                let kind = CFStringCreateWithCString(
                    std::ptr::null(),
                    c"PreventUserIdleSystemSleep".as_ptr(),
                    UTF8,
                );
                let name = CFStringCreateWithCString(
                    std::ptr::null(),
                    c"astra: serving inference requests".as_ptr(),
                    UTF8,
                );
                let mut id = 0u32;
                let rc = IOPMAssertionCreateWithName(kind, ASSERTION_LEVEL_ON, name, &mut id);
                CFRelease(kind);
                CFRelease(name);
                if rc != 0 {
                    return Err(format!("IOPMAssertionCreateWithName failed ({rc})"));
                }
                *self.id.lock().expect("assertion lock") = Some(id);
            }
            Ok(())
        }

        fn release(&self) {
            if let Some(id) = self.id.lock().expect("assertion lock").take() {
                // SAFETY: an assertion this process created.
                unsafe { IOPMAssertionRelease(id) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    /// Records the inhibitor's state and fails on a double acquire or release.
    #[derive(Default)]
    struct Recording {
        held: AtomicBool,
        acquisitions: AtomicUsize,
    }

    impl Inhibitor for Arc<Recording> {
        fn acquire(&self) -> Result<(), String> {
            assert!(
                !self.held.swap(true, Ordering::SeqCst),
                "acquired while held"
            );
            self.acquisitions.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        fn release(&self) {
            assert!(
                self.held.swap(false, Ordering::SeqCst),
                "released while not held"
            );
        }
    }

    /// Many threads start and end requests in random interleavings: the inhibitor is
    /// held whenever any request is in flight, never acquired or released twice, and
    /// let go at the end.
    #[test]
    fn held_exactly_while_requests_are_in_flight() {
        let rec = Arc::new(Recording::default());
        let keep = Arc::new(KeepAwake::new(Box::new(Arc::clone(&rec))));
        let threads: Vec<_> = (0..16u64)
            .map(|t| {
                let (keep, rec) = (Arc::clone(&keep), Arc::clone(&rec));
                std::thread::spawn(move || {
                    let mut s = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                    for _ in 0..2000 {
                        s ^= s << 13;
                        s ^= s >> 7;
                        s ^= s << 17;
                        let guard = KeepAwake::acquire(&keep);
                        assert!(
                            rec.held.load(Ordering::SeqCst),
                            "a request runs while sleep is allowed"
                        );
                        for _ in 0..(s % 64) {
                            std::hint::spin_loop();
                        }
                        if s % 7 == 0 {
                            std::thread::yield_now();
                        }
                        assert!(
                            rec.held.load(Ordering::SeqCst),
                            "released under a running request"
                        );
                        drop(guard);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(keep.holders(), 0);
        assert!(
            !rec.held.load(Ordering::SeqCst),
            "still held after the last request"
        );
        assert!(rec.acquisitions.load(Ordering::SeqCst) >= 1);
    }
}
