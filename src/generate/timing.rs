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

/// A measurement switch (`MLX_LFM_COUNT_STEP_NODES=1`, per engine through
/// `knobs`): each decode step's graph, as dispatched (the tokens' and what
/// the caches built beside them), is walked and its nodes counted into
/// [`StepNodes`], outside the dispatch's clock. What MLX's dispatch costs
/// grows with the nodes (each one's `eval_gpu`): session 57's H100 read
/// the stacked 16-row step's dispatch at 4-10x the one-row step's, and this
/// says how many nodes each hands MLX. Never on by default (the walk is
/// host time a step).
pub fn count_nodes() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::knobs::cached("MLX_LFM_COUNT_STEP_NODES", &ON, |v| v == Some("1"))
}

/// One loop's node counts under [`count_nodes`].
pub(crate) struct NodeCounts {
    steps: AtomicU64,
    sum: AtomicU64,
    min: AtomicU64,
    max: AtomicU64,
}

impl NodeCounts {
    const fn new() -> Self {
        NodeCounts { steps: AtomicU64::new(0), sum: AtomicU64::new(0), min: AtomicU64::new(u64::MAX), max: AtomicU64::new(0) }
    }

    fn add(&self, n: u64) {
        self.steps.fetch_add(1, Relaxed);
        self.sum.fetch_add(n, Relaxed);
        self.min.fetch_min(n, Relaxed);
        self.max.fetch_max(n, Relaxed);
    }

    fn take(&self) -> StepNodes {
        let steps = self.steps.swap(0, Relaxed);
        let (sum, min, max) = (self.sum.swap(0, Relaxed), self.min.swap(u64::MAX, Relaxed), self.max.swap(0, Relaxed));
        if steps == 0 {
            return StepNodes::default();
        }
        StepNodes { steps, sum, min, max }
    }
}

/// Nodes a counted step handed MLX: the least (a steady step), the most (a
/// step that also joined rows or copied filled blocks) and their sum.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepNodes {
    pub steps: u64,
    pub sum: u64,
    pub min: u64,
    pub max: u64,
}

impl StepNodes {
    pub fn mean(&self) -> f64 {
        self.sum as f64 / self.steps.max(1) as f64
    }
}

static SINGLE_NODES: NodeCounts = NodeCounts::new();
static BATCH_NODES: NodeCounts = NodeCounts::new();

/// The single-sequence loop's node counts so far, reset (apart from
/// [`take`], which other measurements reset on their own schedule).
pub fn take_single_nodes() -> StepNodes {
    SINGLE_NODES.take()
}

/// The stacked batch step's node counts so far, reset.
pub fn take_batch_nodes() -> StepNodes {
    BATCH_NODES.take()
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
    nodes: &'static NodeCounts,
}

impl Clock {
    pub(crate) fn nodes(&self, n: u64) {
        self.nodes.add(n);
    }

    pub(crate) fn dispatch(&self, since: Instant) {
        add(self.dispatch, since);
    }

    pub(crate) fn sync(&self, since: Instant) {
        add(self.sync, since);
    }
}

/// The single-sequence loop's counters ([`StepTimes`]).
pub(crate) static SINGLE: Clock = Clock { dispatch: &DISPATCH_NS, sync: &SYNC_NS, nodes: &SINGLE_NODES };
/// The stacked batch step's counters ([`BatchTimes`]).
pub(crate) static BATCH: Clock = Clock { dispatch: &BATCH_DISPATCH_NS, sync: &BATCH_SYNC_NS, nodes: &BATCH_NODES };

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
