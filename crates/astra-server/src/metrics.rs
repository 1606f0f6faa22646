//! The server's counters, gauges and latency histograms, rendered in the Prometheus
//! text exposition format for `GET /metrics`.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Request outcomes counted by `astra_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Completed and delivered.
    Ok,
    /// Rejected as invalid (4xx other than 429).
    Invalid,
    /// Turned away because the queue was full (429).
    Rejected,
    /// The client went away before the end.
    Cancelled,
    /// Failed inside the server.
    Error,
}

const OUTCOMES: [(Outcome, &str); 5] = [
    (Outcome::Ok, "ok"),
    (Outcome::Invalid, "invalid"),
    (Outcome::Rejected, "rejected"),
    (Outcome::Cancelled, "cancelled"),
    (Outcome::Error, "error"),
];

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

#[derive(Default)]
pub struct Histogram {
    inner: Mutex<HistogramData>,
}

#[derive(Default)]
struct HistogramData {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        let mut h = self.inner.lock().expect("histogram lock");
        if let Some(i) = BUCKETS.iter().position(|&b| seconds <= b) {
            h.counts[i] += 1;
        }
        h.count += 1;
        h.sum += seconds;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let h = self.inner.lock().expect("histogram lock");
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in BUCKETS.iter().zip(h.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            h.count, h.sum, h.count
        );
    }
}

pub struct Metrics {
    requests: [AtomicU64; OUTCOMES.len()],
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub queue_depth: AtomicU64,
    pub slots_busy: AtomicU64,
    pub slots_total: AtomicU64,
    pub time_to_first_token: Histogram,
    pub inter_token_latency: Histogram,
    pub request_duration: Histogram,
    /// From the telemetry sampler: bytes.
    pub resident_memory: AtomicU64,
    /// From the telemetry sampler: bytes (`u64::MAX` until known).
    pub available_memory: AtomicU64,
    /// The sampler's own cost.
    pub telemetry_nanos: AtomicU64,
    pub telemetry_samples: AtomicU64,
    /// Requests holding the keep-awake inhibitor.
    pub keep_awake_holders: AtomicU64,
    /// Device memory in use, sampled by the scheduler (`u64::MAX`: no device).
    pub device_memory_in_use: AtomicU64,
    /// KV pages in existence, held by more than one sequence, and held only by
    /// finished sequences; their bytes (where the backend pages its caches).
    pub kv_pages: AtomicU64,
    pub kv_pages_shared: AtomicU64,
    pub kv_pages_cached: AtomicU64,
    pub kv_bytes: AtomicU64,
    /// Running requests paused for want of KV pages (resumed later from their tokens).
    pub preemptions: AtomicU64,
    /// Rows (tokens) in the last batch step.
    pub batch_rows: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            requests: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            queue_depth: AtomicU64::new(0),
            slots_busy: AtomicU64::new(0),
            slots_total: AtomicU64::new(0),
            time_to_first_token: Histogram::default(),
            inter_token_latency: Histogram::default(),
            request_duration: Histogram::default(),
            resident_memory: AtomicU64::new(0),
            available_memory: AtomicU64::new(u64::MAX),
            telemetry_nanos: AtomicU64::new(0),
            telemetry_samples: AtomicU64::new(0),
            keep_awake_holders: AtomicU64::new(0),
            device_memory_in_use: AtomicU64::new(u64::MAX),
            kv_pages: AtomicU64::new(0),
            kv_pages_shared: AtomicU64::new(0),
            kv_pages_cached: AtomicU64::new(0),
            kv_bytes: AtomicU64::new(0),
            preemptions: AtomicU64::new(0),
            batch_rows: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    pub fn request(&self, outcome: Outcome) {
        let i = OUTCOMES
            .iter()
            .position(|(o, _)| *o == outcome)
            .expect("every outcome is listed");
        self.requests[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn add(counter: &AtomicU64, n: usize) {
        counter.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        out.push_str("# HELP astra_requests_total Requests by outcome.\n# TYPE astra_requests_total counter\n");
        for ((_, label), c) in OUTCOMES.iter().zip(&self.requests) {
            let _ = writeln!(
                out,
                "astra_requests_total{{outcome=\"{label}\"}} {}",
                get(c)
            );
        }
        for (name, kind, help, c) in [
            (
                "astra_prompt_tokens_total",
                "counter",
                "Prompt tokens received.",
                &self.prompt_tokens,
            ),
            (
                "astra_generated_tokens_total",
                "counter",
                "Tokens generated.",
                &self.generated_tokens,
            ),
            (
                "astra_cached_tokens_total",
                "counter",
                "Prompt tokens served from the prompt cache.",
                &self.cached_tokens,
            ),
            (
                "astra_queue_depth",
                "gauge",
                "Requests waiting for a slot.",
                &self.queue_depth,
            ),
            (
                "astra_slots_busy",
                "gauge",
                "Slots generating.",
                &self.slots_busy,
            ),
            ("astra_slots_total", "gauge", "Slots.", &self.slots_total),
            (
                "astra_kv_pages",
                "gauge",
                "KV cache pages in memory (64 positions of every layer).",
                &self.kv_pages,
            ),
            (
                "astra_kv_pages_shared",
                "gauge",
                "KV cache pages held by more than one sequence.",
                &self.kv_pages_shared,
            ),
            (
                "astra_kv_pages_cached",
                "gauge",
                "KV cache pages held only by finished sequences (the prompt cache).",
                &self.kv_pages_cached,
            ),
            (
                "astra_kv_bytes",
                "gauge",
                "Bytes of the KV cache pages in memory.",
                &self.kv_bytes,
            ),
            (
                "astra_preemptions_total",
                "counter",
                "Running requests paused for want of KV cache pages, to resume from their tokens.",
                &self.preemptions,
            ),
            (
                "astra_batch_rows",
                "gauge",
                "Tokens in the last batch step (decoding rows and prompt tokens).",
                &self.batch_rows,
            ),
            (
                "astra_process_resident_memory_bytes",
                "gauge",
                "Resident memory of the server process (1 Hz sample).",
                &self.resident_memory,
            ),
            (
                "astra_keep_awake_requests",
                "gauge",
                "Requests in flight holding the host awake.",
                &self.keep_awake_holders,
            ),
            (
                "astra_telemetry_samples_total",
                "counter",
                "Telemetry samples taken.",
                &self.telemetry_samples,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {}",
                get(c)
            );
        }
        let avail = get(&self.available_memory);
        if avail != u64::MAX {
            let _ = writeln!(
                out,
                "# HELP astra_system_available_memory_bytes Memory the system can give without swapping (1 Hz sample).\n\
                 # TYPE astra_system_available_memory_bytes gauge\nastra_system_available_memory_bytes {avail}"
            );
        }
        let dev = get(&self.device_memory_in_use);
        if dev != u64::MAX {
            let _ = writeln!(
                out,
                "# HELP astra_device_memory_in_use_bytes GPU memory in use, by every process (1 Hz sample).\n\
                 # TYPE astra_device_memory_in_use_bytes gauge\nastra_device_memory_in_use_bytes {dev}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP astra_telemetry_seconds_total Time spent taking telemetry samples.\n\
             # TYPE astra_telemetry_seconds_total counter\nastra_telemetry_seconds_total {}",
            get(&self.telemetry_nanos) as f64 * 1e-9
        );
        self.time_to_first_token.render(
            "astra_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            &mut out,
        );
        self.inter_token_latency.render(
            "astra_inter_token_latency_seconds",
            "Between consecutive generated tokens.",
            &mut out,
        );
        self.request_duration.render(
            "astra_request_duration_seconds",
            "From a request's arrival to its end.",
            &mut out,
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let m = Metrics::default();
        for s in [0.001, 0.2, 0.2, 500.0] {
            m.request_duration.observe(s);
        }
        let text = m.render();
        assert!(text.contains("astra_request_duration_seconds_bucket{le=\"0.005\"} 1\n"));
        assert!(text.contains("astra_request_duration_seconds_bucket{le=\"0.25\"} 3\n"));
        assert!(text.contains("astra_request_duration_seconds_bucket{le=\"120\"} 3\n"));
        assert!(text.contains("astra_request_duration_seconds_bucket{le=\"+Inf\"} 4\n"));
        assert!(text.contains("astra_request_duration_seconds_count 4\n"));
    }
}
