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
static SYNC_NS: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepTimes {
    /// Tokens read back (one a step).
    pub tokens: u64,
    pub build_ns: u64,
    pub dispatch_ns: u64,
    pub wait_ns: u64,
    /// With [`sync_steps`] on: the wait for each step right after its
    /// dispatch (the device's time left once the host let go of it).
    pub sync_ns: u64,
}

impl StepTimes {
    /// Microseconds a token: (build, dispatch, wait); zeros before any token.
    pub fn per_token_us(&self) -> (f64, f64, f64) {
        let n = self.tokens.max(1) as f64 * 1000.0;
        (self.build_ns as f64 / n, self.dispatch_ns as f64 / n, self.wait_ns as f64 / n)
    }

    /// Microseconds a token of [`StepTimes::sync_ns`].
    pub fn sync_us(&self) -> f64 {
        self.sync_ns as f64 / (self.tokens.max(1) as f64 * 1000.0)
    }
}

/// A measurement switch (`MLX_LFM_SYNC_STEPS=1`, per engine through
/// `knobs`): each decode step (a single sequence's in `Sequence::sample`, a
/// stacked batch's in the scheduler, counted in [`BatchTimes`]) is waited
/// for as soon as it is dispatched,
/// before the next is built, so the host never runs ahead of the device.
/// Build and dispatch then are the host's own cost with an idle device
/// (MLX's `eval_impl`, `mlx/transforms.cpp`, stops its caller while more
/// than `MAX_ACTIVE_TASKS` = 10 committed batches are in flight, so in the
/// pipelined loop a dispatch may also be waiting on the device, and a wait
/// near zero does not prove a host-bound step), and the decode rate is
/// 1 / (host + the device's tail):
/// set beside the pipelined figures of the same run, it says which of the
/// two bounds a step. Never on by default (it serialises host and device).
pub fn sync_steps() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::knobs::cached("MLX_LFM_SYNC_STEPS", &ON, |v| v == Some("1"))
}

fn add(counter: &AtomicU64, since: Instant) {
    counter.fetch_add(since.elapsed().as_nanos() as u64, Relaxed);
}

pub(crate) fn build(since: Instant) {
    add(&BUILD_NS, since);
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
        sync_ns: SYNC_NS.swap(0, Relaxed),
    }
}

/// Where a decode loop counts a step's dispatch and synchronous wait
/// (`generate::dispatch_step`).
pub(crate) struct Clock {
    dispatch: &'static AtomicU64,
    sync: &'static AtomicU64,
}

impl Clock {
    pub(crate) fn dispatch(&self, since: Instant) {
        add(self.dispatch, since);
    }

    pub(crate) fn sync(&self, since: Instant) {
        add(self.sync, since);
    }
}

/// The single-sequence loop's counters ([`StepTimes`]).
pub(crate) static SINGLE: Clock = Clock { dispatch: &DISPATCH_NS, sync: &SYNC_NS };
/// The stacked batch step's counters ([`BatchTimes`]).
pub(crate) static BATCH: Clock = Clock { dispatch: &BATCH_DISPATCH_NS, sync: &BATCH_SYNC_NS };

/// The same phases for the scheduler's stacked batch step (all rows in one
/// compiled call): per step, not per token.
static BATCH_STACKED: AtomicU64 = AtomicU64::new(0);
static BATCH_STEPS: AtomicU64 = AtomicU64::new(0);
static BATCH_BUILD_NS: AtomicU64 = AtomicU64::new(0);
static BATCH_DISPATCH_NS: AtomicU64 = AtomicU64::new(0);
static BATCH_SYNC_NS: AtomicU64 = AtomicU64::new(0);
static BATCH_ACCEPT_NS: AtomicU64 = AtomicU64::new(0);

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BatchTimes {
    /// Stacked steps run (build, dispatch and sync are theirs).
    pub stacked: u64,
    /// Scheduler steps run (accept is theirs: a batch's last row steps alone).
    pub steps: u64,
    /// Building the step: the batch's reconciliation, the compiled call,
    /// each row's bookkeeping and draw.
    pub build_ns: u64,
    /// Handing the step's tokens to MLX (`async_eval`).
    pub dispatch_ns: u64,
    /// With [`sync_steps`]: the wait right after the dispatch.
    pub sync_ns: u64,
    /// Each row's read of its token (the wait for the step before) and its
    /// delivery: decoding, stop strings, the observer.
    pub accept_ns: u64,
}

impl BatchTimes {
    /// Microseconds a step: build, dispatch and sync a stacked step, accept
    /// a scheduler step; zeros before any.
    pub fn per_step_us(&self) -> [f64; 4] {
        let (s, n) = (self.stacked.max(1) as f64 * 1000.0, self.steps.max(1) as f64 * 1000.0);
        [self.build_ns as f64 / s, self.dispatch_ns as f64 / s, self.sync_ns as f64 / s, self.accept_ns as f64 / n]
    }
}

pub(crate) fn batch_build(since: Instant) {
    add(&BATCH_BUILD_NS, since);
    BATCH_STACKED.fetch_add(1, Relaxed);
}

pub(crate) fn batch_accept(since: Instant) {
    add(&BATCH_ACCEPT_NS, since);
    BATCH_STEPS.fetch_add(1, Relaxed);
}

/// The batch counts so far, reset to zero.
pub fn take_batch() -> BatchTimes {
    BatchTimes {
        stacked: BATCH_STACKED.swap(0, Relaxed),
        steps: BATCH_STEPS.swap(0, Relaxed),
        build_ns: BATCH_BUILD_NS.swap(0, Relaxed),
        dispatch_ns: BATCH_DISPATCH_NS.swap(0, Relaxed),
        sync_ns: BATCH_SYNC_NS.swap(0, Relaxed),
        accept_ns: BATCH_ACCEPT_NS.swap(0, Relaxed),
    }
}
