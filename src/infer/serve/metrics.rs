//! The server's counters, in the Prometheus text format (`GET /metrics`).

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

/// A histogram of durations with fixed upper bounds, in seconds.
struct Histogram {
    bounds: &'static [f64],
    /// Observations at or below each bound (not cumulative), then above the last.
    counts: Vec<u64>,
    sum: f64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Mutex<Histogram> {
        Mutex::new(Histogram { bounds, counts: vec![0; bounds.len() + 1], sum: 0.0 })
    }

    fn observe(&mut self, seconds: f64) {
        let i = self.bounds.iter().position(|&b| seconds <= b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += seconds;
    }

    fn render(&self, o: &mut String, name: &str, help: &str) {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut total = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            total += c;
            let _ = writeln!(o, "{name}_bucket{{le=\"{b}\"}} {total}");
        }
        total += self.counts[self.bounds.len()];
        let _ = writeln!(
            o,
            "{name}_bucket{{le=\"+Inf\"}} {total}\n{name}_sum {}\n{name}_count {total}",
            self.sum
        );
    }
}

const LATENCY: &[f64] =
    &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];
const PER_TOKEN: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];

/// Outcomes a request is counted under.
const OUTCOMES: [&str; 5] = ["completed", "cancelled", "rejected", "invalid", "error"];

pub struct Metrics {
    requests: [AtomicU64; OUTCOMES.len()],
    prompt_tokens: AtomicU64,
    cached_prompt_tokens: AtomicU64,
    prefix_cache_bytes: AtomicUsize,
    generated_tokens: AtomicU64,
    connections_refused: AtomicU64,
    write_timeouts: AtomicU64,
    queued: AtomicUsize,
    running: AtomicUsize,
    max_batch: usize,
    ttft: Mutex<Histogram>,
    tpot: Mutex<Histogram>,
    duration: Mutex<Histogram>,
}

impl Metrics {
    pub fn new(max_batch: usize) -> Metrics {
        Metrics {
            requests: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            cached_prompt_tokens: AtomicU64::new(0),
            prefix_cache_bytes: AtomicUsize::new(0),
            generated_tokens: AtomicU64::new(0),
            connections_refused: AtomicU64::new(0),
            write_timeouts: AtomicU64::new(0),
            queued: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            max_batch,
            ttft: Histogram::new(LATENCY),
            tpot: Histogram::new(PER_TOKEN),
            duration: Histogram::new(LATENCY),
        }
    }

    /// Counts a request under `outcome` (one of [`OUTCOMES`]).
    pub fn finished(&self, outcome: &str) {
        let i = OUTCOMES.iter().position(|o| *o == outcome).expect("a known outcome");
        self.requests[i].fetch_add(1, Relaxed);
    }

    pub fn queued(&self) {
        self.queued.fetch_add(1, Relaxed);
    }

    pub fn dequeued(&self) {
        self.queued.fetch_sub(1, Relaxed);
    }

    pub fn set_running(&self, n: usize) {
        self.running.store(n, Relaxed);
    }

    /// Counts a prompt of `n` tokens, `cached` of which came from the prefix cache.
    pub fn add_prompt_tokens(&self, n: usize, cached: usize) {
        self.prompt_tokens.fetch_add(n as u64, Relaxed);
        self.cached_prompt_tokens.fetch_add(cached as u64, Relaxed);
    }

    pub fn set_prefix_cache_bytes(&self, n: usize) {
        self.prefix_cache_bytes.store(n, Relaxed);
    }

    pub fn add_generated_tokens(&self, n: usize) {
        self.generated_tokens.fetch_add(n as u64, Relaxed);
    }

    /// A connection refused for its address's limit.
    pub fn connection_refused(&self) {
        self.connections_refused.fetch_add(1, Relaxed);
    }

    /// A connection closed for a client that did not read its answer.
    pub fn write_timed_out(&self) {
        self.write_timeouts.fetch_add(1, Relaxed);
    }

    pub fn time_to_first_token(&self, d: Duration) {
        self.ttft.lock().unwrap().observe(d.as_secs_f64());
    }

    pub fn time_per_output_token(&self, d: Duration) {
        self.tpot.lock().unwrap().observe(d.as_secs_f64());
    }

    pub fn request_duration(&self, d: Duration) {
        self.duration.lock().unwrap().observe(d.as_secs_f64());
    }

    pub fn render(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "# HELP attnres_requests_total Requests by outcome.\n# TYPE attnres_requests_total counter");
        for (name, n) in OUTCOMES.iter().zip(&self.requests) {
            let _ = writeln!(o, "attnres_requests_total{{outcome=\"{name}\"}} {}", n.load(Relaxed));
        }
        let counters = [
            (
                "attnres_prompt_tokens_total",
                "Prompt tokens of the requests run (cached ones included).",
                self.prompt_tokens.load(Relaxed),
            ),
            (
                "attnres_prompt_tokens_cached_total",
                "Prompt tokens copied from the prefix cache instead of prefilled.",
                self.cached_prompt_tokens.load(Relaxed),
            ),
            (
                "attnres_generation_tokens_total",
                "Tokens generated.",
                self.generated_tokens.load(Relaxed),
            ),
            (
                "attnres_connections_refused_total",
                "Connections refused at once: their address held --max-client-connections.",
                self.connections_refused.load(Relaxed),
            ),
            (
                "attnres_write_timeouts_total",
                "Connections closed because the client did not read for --write-timeout.",
                self.write_timeouts.load(Relaxed),
            ),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
        }
        let gauges = [
            ("attnres_queue_length", "Requests waiting for a slot.", self.queued.load(Relaxed)),
            ("attnres_batch_size", "Sequences in the running batch.", self.running.load(Relaxed)),
            ("attnres_max_batch_size", "Cache slots (--max-batch).", self.max_batch),
            (
                "attnres_prefix_cache_bytes",
                "Bytes of keys and values the prefix cache holds.",
                self.prefix_cache_bytes.load(Relaxed),
            ),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        self.ttft.lock().unwrap().render(
            &mut o,
            "attnres_time_to_first_token_seconds",
            "From request to its first token.",
        );
        self.tpot.lock().unwrap().render(
            &mut o,
            "attnres_time_per_output_token_seconds",
            "Mean time between a request's tokens after the first.",
        );
        self.duration.lock().unwrap().render(
            &mut o,
            "attnres_request_duration_seconds",
            "From request to its last token.",
        );
        o
    }
}
