//! Where a single sequence's decode step spends the host's time: building
//! the step's graph (the compiled call or the eager forward, the sampler's
//! ops), handing it to MLX (`async_eval`: MLX encodes and launches every
//! kernel on this thread), and waiting for the token before it. Because step
//! t+1 is queued before token t is read, a step whose wait is near zero is
//! bound by the host, not the device; the H200 benchmark prints these per
//! step (`mlx-lfm-bench`), as no timeline profiler runs there.
//!
//! Process-wide counters (relaxed atomics: a figure, not a synchronisation);
//! two `Instant` reads a phase, well under a microsecond a step.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

static BUILD_NS: AtomicU64 = AtomicU64::new(0);
static DISPATCH_NS: AtomicU64 = AtomicU64::new(0);
static WAIT_NS: AtomicU64 = AtomicU64::new(0);
static TOKENS: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// Tokens read back (one a step).
    pub tokens: u64,
    pub build_ns: u64,
    pub dispatch_ns: u64,
    pub wait_ns: u64,
}

impl StepTimes {
    /// Microseconds a token: (build, dispatch, wait); zeros before any token.
    pub fn per_token_us(&self) -> (f64, f64, f64) {
        let n = self.tokens.max(1) as f64 * 1000.0;
        (self.build_ns as f64 / n, self.dispatch_ns as f64 / n, self.wait_ns as f64 / n)
    }
}

fn add(counter: &AtomicU64, since: Instant) {
    counter.fetch_add(since.elapsed().as_nanos() as u64, Relaxed);
}

pub(crate) fn build(since: Instant) {
    add(&BUILD_NS, since);
}

pub(crate) fn dispatch(since: Instant) {
    add(&DISPATCH_NS, since);
}

pub(crate) fn wait(since: Instant) {
    add(&WAIT_NS, since);
    TOKENS.fetch_add(1, Relaxed);
}

/// The counts so far, reset to zero.
pub fn take() -> StepTimes {
    StepTimes {
        tokens: TOKENS.swap(0, Relaxed),
        build_ns: BUILD_NS.swap(0, Relaxed),
        dispatch_ns: DISPATCH_NS.swap(0, Relaxed),
        wait_ns: WAIT_NS.swap(0, Relaxed),
    }
}
