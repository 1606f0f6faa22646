//! The 1 Hz telemetry sampler: the process's resident memory and the system's
//! available memory, published as gauges on `/metrics` (and read by the admission
//! gate), with the sampler's own cost counted beside them.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::metrics::Metrics;

/// A `kB` field of a `/proc` file such as `/proc/meminfo`, in bytes.
fn proc_kib_field(text: &str, field: &str) -> Option<u64> {
    let line = text
        .lines()
        .find(|l| l.starts_with(field) && l[field.len()..].starts_with(':'))?;
    let kib: u64 = line[field.len() + 1..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Resident memory of this process, in bytes (Linux; `None` elsewhere).
pub fn resident_memory() -> Option<u64> {
    proc_kib_field(&std::fs::read_to_string("/proc/self/status").ok()?, "VmRSS")
}

/// Memory the system can give without swapping, in bytes (Linux; `None` elsewhere).
pub fn available_memory() -> Option<u64> {
    proc_kib_field(
        &std::fs::read_to_string("/proc/meminfo").ok()?,
        "MemAvailable",
    )
}

/// Takes one sample into `metrics`.
pub fn sample(metrics: &Metrics) {
    let t0 = Instant::now();
    if let Some(rss) = resident_memory() {
        metrics.resident_memory.store(rss, Ordering::Relaxed);
    }
    if let Some(avail) = available_memory() {
        metrics.available_memory.store(avail, Ordering::Relaxed);
    }
    metrics
        .telemetry_nanos
        .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    metrics.telemetry_samples.fetch_add(1, Ordering::Relaxed);
}

/// Samples now, then once a second on a background thread for the life of the process.
pub fn start(metrics: Arc<Metrics>) {
    sample(&metrics);
    let spawned = std::thread::Builder::new()
        .name("astra-telemetry".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_secs(1));
            sample(&metrics);
        });
    if let Err(e) = spawned {
        eprintln!("astra: WARN telemetry sampler not started: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_proc_fields() {
        let meminfo =
            "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   12000000 kB\n";
        assert_eq!(
            proc_kib_field(meminfo, "MemAvailable"),
            Some(12_000_000 * 1024)
        );
        assert_eq!(proc_kib_field(meminfo, "MemFree"), Some(1000 * 1024));
        assert_eq!(proc_kib_field(meminfo, "Mem"), None);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn samples_this_process() {
        let m = Metrics::default();
        sample(&m);
        let rss = m.resident_memory.load(Ordering::Relaxed);
        let avail = m.available_memory.load(Ordering::Relaxed);
        // This test binary is resident; the machine has some memory free.
        assert!(rss > 1 << 20 && rss < 1 << 40, "rss {rss}");
        assert!(avail > 0 && avail < u64::MAX, "available {avail}");
    }
}
