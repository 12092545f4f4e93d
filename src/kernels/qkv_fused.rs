//! A lone sequence's q/k/v stage of an attention layer in one launch (a
//! CUDA default since session 31, `MLX_LFM_QKV_FUSED=0` off: its H200 test
//! and greedy sets passed in sessions 30-31, and the one-launch layers
//! together read decode 1.12x / 1.00x / 1.15x on the 350M / 1.2B / 8B-A1B
//! in session 31's paired A/B, on an H100): the residual add + RMSNorm
//! before it, the stacked q/k/v projection and the heads' norm + RoPE,
//! otherwise three launches (the add + RMSNorm kernel, MLX's GEMV or `qmv`,
//! src/kernels/qk_norm_rope.rs's q/k/v kernel): 12 of the 1.2B's and the
//! 8B-A1B's nodes a step over their six attention layers.
//!
//! Stages handed on as in src/kernels/moe_fused.rs (read its note): ticket
//! 0 the add + RMSNorm as the add + RMSNorm kernel's block runs it; each
//! later ticket one head, its rows of the projection walked as MLX's own
//! kernels walk a row (dense: `gemv_single`'s order; 4-bit: its `qmv`
//! arithmetic), each rounded to the dtype as the product is, then the
//! head's norm and RoPE as the q/k/v kernel computes them (the same device
//! text, `QKV_FUSED_SOURCE` there). The position is read from its `[1]`
//! int32 array (the compiled step's view into its position table). Tests in
//! src/kernels/tests.rs.

use super::stages::{self, Built};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::{Normed, Quantized};
use std::sync::OnceLock;

/// Warps a block by default: a head's rows spread over them (HD a multiple
/// of it).
const WARPS: i32 = 16;
/// The widest head served (8 rows a warp).
const MAX_HEAD: i32 = 128;

/// `MLX_LFM_QKV_WARPS=32` (opt-in, session 38, not yet run on a GPU): a
/// head's rows over 32 warps instead of 16 (blocks of 1,024 threads, 2 of a
/// 64-wide head's rows a warp instead of 4). The launch is one block a
/// head, 49 on the 8B-A1B, so most of the GPU's 132 SMs sit idle while
/// each block's warps walk their rows in turn: session 38's profile had
/// the stage at 14.4 µs a launch for ~3.6 MB (~0.25 TB/s), 86 µs of that
/// step. Each row is the same walk, so the same bits (its test holds it
/// to them). Read at each launch's build, so a process can time both.
fn warps() -> i32 {
    static SET: OnceLock<i32> = OnceLock::new();
    if super::forced("MLX_LFM_QKV_WARPS") {
        return 32;
    }
    crate::knobs::cached("MLX_LFM_QKV_WARPS", &SET, |v| if v.map(str::trim) == Some("32") { 32 } else { WARPS })
}

/// `MLX_LFM_QKV_SPLIT=2|4` (opt-in, session 41; on its H100 the split
/// gave the one-block form's bits on the models' shapes, but 19.1 µs a
/// launch against 20.0 on the 1.2B's stage and decode 1.002x / 1.011x on
/// the 1.2B / 8B-A1B): each head's rows over that many blocks instead of one. The stage is one
/// block a head (48 on the 1.2B, 1 + 48 launched), so on a GPU of 132 SMs
/// most sit idle: session 40's profile of the 1.2B had it at ~15 µs for
/// 12.7 MB (~0.85 TB/s) a launch, six a step. A head's parts meet at its
/// last (the heads' norm needs all its rows): the others hand their rows,
/// rounded to the dtype as before, through the head's place in the output
/// and count themselves on the head's counter, which the last waits for
/// (their tickets come first, so they are running) and takes back down to
/// zero; v's rows are final where each part writes them. The same walk of
/// each row, so the same bits (its test holds it to them). Read once a
/// process (a test's override aside): a launch's tickets count its blocks,
/// so the launches on one layer's state keep one split; the split form
/// takes its tickets from its own words ([`split_place`]), so the one-block
/// form may run on the same state.
fn split() -> i32 {
    static SET: OnceLock<i32> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_QKV_SPLIT", &SET, |v| match v.map(str::trim) {
        Some("2") => 2,
        Some("4") => 4,
        _ => 1,
    })
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_QKV_FUSED", &ON)
}

static BUILT: Built = Built::new();

/// How many times [`forward`] has put the kernel into a graph in this
/// process: the greedy test's evidence that its runs took this path.
pub fn built() -> usize {
    BUILT.get()
}

static SPLIT_BUILT: Built = Built::new();

/// How many of [`built`]'s graphs took the split form ([`split`]).
pub fn split_built() -> usize {
    SPLIT_BUILT.get()
}

/// The stacked q/k/v projection `[(H + 2 KVH) HD, D]`, as the kernel reads it.
#[derive(Clone, Copy)]
pub enum Projection<'a> {
    Quant(&'a Quantized),
    Dense(&'a Array),
}

/// The kernel; with `scratch`, its form with the scratch row (`yn`) in
/// the layer's state ([`stages::call_with_scratch`]); under
/// `MLX_LFM_EARLY_PREFETCH=qkv`, its form that asks L2 for its head's rows
/// before its wait ([`stages::early_prefetch`], [`EARLY_SUBSTITUTIONS`]).
fn kernel(quant: bool, scratch: bool) -> Option<&'static CudaKernel> {
    if every_norm() {
        static FORMS: stages::Forms = stages::Forms::new();
        static TEXT: OnceLock<String> = OnceLock::new();
        let base = if quant { "lfm_qkv_fused_en" } else { "lfm_qkv_fused_en_dense" };
        return every_norm_form(&FORMS, &TEXT, super::qk_norm_rope::QKV_FUSED_SOURCE, base, quant, scratch, false);
    }
    static FORMS: stages::Forms = stages::Forms::new();
    let base = if quant { "lfm_qkv_fused" } else { "lfm_qkv_fused_dense" };
    form(&FORMS, base, super::qk_norm_rope::QKV_FUSED_SOURCE, &EARLY_SUBSTITUTIONS, quant, scratch, false)
}

/// A form of `forms` named `base` over `body` (`early_subs` its early
/// form's), with the stage's operands (`kv`: the K/V buffers it writes in
/// place after them, and no k or v output: [`kv_kernel`]).
fn form(
    forms: &'static stages::Forms,
    base: &str,
    body: &str,
    early_subs: &[(&str, &str)],
    quant: bool,
    scratch: bool,
    kv: bool,
) -> Option<&'static CudaKernel> {
    // (A form without early substitutions has no early form.)
    let early = !early_subs.is_empty() && stages::early_prefetch("qkv");
    let mut inputs = vec!["h", "r", "wn"];
    inputs.extend(if quant { &["iw", "iscales", "ibiases"][..] } else { &["iw"][..] });
    inputs.extend(["qw", "kw", "offset", "ctr"]);
    if kv {
        inputs.extend(["kc", "vc"]);
    }
    // (The projection's rows as the first of a layer's two projections:
    // src/kernels/stages.rs's products and header.)
    let outputs: &[&str] = if kv { &["s", "qo", "yn"] } else { &["s", "qo", "ko", "vo", "yn"] };
    forms.kernel(base, (quant, scratch, early), body, early_subs, SCRATCH_PRELUDE, &inputs, (outputs, outputs.len() - 1), || {
        stages::layer_header(quant, false, "")
    })
}

/// `MLX_LFM_KV_IN_PLACE` (a CUDA default since session 46, `=0` off: its
/// kernel test passed on an H100 in session 45, its step's test and every
/// greedy set on all four fixtures in session 46, and its A/B read the
/// 1.2B's decode 1.065-1.070x there, 864-868 tok/s against 807-814;
/// `bench/results/2026-12-07-h100-session46.raw.jsonl`; the 350M's and
/// the 8B-A1B's not yet timed): a lone sequence's compiled decode step writes
/// each attention layer's new K and V rows into the layer's cache buffers
/// from this kernel's k and v head blocks, in place, at the position,
/// instead of two MLX scatters a layer after it (~4.6 µs each on the
/// H200's profile of the 1.2B: src/cache/batch.rs `kv_write_scatter`; 12
/// launches of a 1.2B token, ~55 µs). The same values (the head's rows as
/// the k and v outputs held them). The step's K/V buffers are then its
/// outputs the same, evaluated after q (`depends`): the attention kernel
/// after it reads them ordered by q, its output, and nothing else in the
/// step reads them; what reads them after the step is evaluated after it
/// (src/compiled/mod.rs `step`). Served over the buffers a sequence owns, row-
/// contiguous, so MLX hands the kernel the buffers themselves: a flat
/// cache's (`zeros`/`concatenate`) and a paged sequence's decode mirrors
/// (a `take` reshaped), src/compiled/mod.rs; a batch keeps the scatters.
pub fn kv_in_place() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_KV_IN_PLACE", &ON)
}

static KV_BUILT: Built = Built::new();

/// How many of [`built`]'s graphs wrote the K/V buffers in place
/// ([`kv_in_place`]): the greedy test's evidence.
pub fn kv_built() -> usize {
    KV_BUILT.get()
}

/// The one-block form's text writing k's and v's heads at the position of
/// the layer's K/V buffers (`kc`, `vc`: `[1, KVH, cap, HD]`, inputs written
/// in place, as the counters are) instead of the k and v outputs; a
/// position past the buffers' capacity writes nothing (the caller makes
/// room first: a write past them would land in another allocation).
const KV_SUBSTITUTION: (&str, &str) = (
    r#"  T* dst = is_q ? qo + static_cast<size_t>(hh) * HD
         : is_v ? vo + static_cast<size_t>(hh - QH - KVH) * HD
                : ko + static_cast<size_t>(hh - QH) * HD;
"#,
    r#"  const size_t lfm_cap = static_cast<size_t>(kc_shape[2]);
  const size_t lfm_at = static_cast<size_t>(static_cast<unsigned int>(offset[0]));
  if (!is_q && lfm_at >= lfm_cap) return;
  T* dst = is_q ? qo + static_cast<size_t>(hh) * HD
         : is_v ? const_cast<T*>(vc) + (static_cast<size_t>(hh - QH - KVH) * lfm_cap + lfm_at) * HD
                : const_cast<T*>(kc) + (static_cast<size_t>(hh - QH) * lfm_cap + lfm_at) * HD;
"#,
);

/// The K/V-writing form's text ([`KV_SUBSTITUTION`]), made once.
fn kv_source() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| super::substituted(super::qk_norm_rope::QKV_FUSED_SOURCE, &[KV_SUBSTITUTION]))
}

/// The K/V-writing form's kernel ([`kernel`]'s forms: the one-block
/// form's blocks and tickets, so either may run on a state the other ran on).
fn kv_kernel(quant: bool, scratch: bool) -> Option<&'static CudaKernel> {
    if every_norm() {
        static FORMS: stages::Forms = stages::Forms::new();
        static TEXT: OnceLock<String> = OnceLock::new();
        let base = if quant { "lfm_qkv_fused_kv_en" } else { "lfm_qkv_fused_kv_en_dense" };
        return every_norm_form(&FORMS, &TEXT, kv_source(), base, quant, scratch, true);
    }
    static FORMS: stages::Forms = stages::Forms::new();
    let base = if quant { "lfm_qkv_fused_kv" } else { "lfm_qkv_fused_kv_dense" };
    form(&FORMS, base, kv_source(), &EARLY_SUBSTITUTIONS, quant, scratch, true)
}

/// `MLX_LFM_QKV_EVERY_NORM` (written in session 46; a CUDA default since
/// session 50 with the conv's and feed-forward's forms, `=0` off: its
/// test passed on an H100 in session 49, its greedy sets on all four
/// fixtures there and in session 48, and the three forms together read
/// decode 1.035x on the 1.2B, 1.066x on the 350M and 1.022x on the
/// 8B-A1B in session 50's A/B on an H100,
/// `bench/results/2026-12-07-h100-session50.raw.jsonl`): every head's block
/// computes the layer's add + RMSNorm itself, into its shared row, instead
/// of waiting for the first block's (its release, a fence and an atomic,
/// the waiters' poll, then the row read back from L2). Session 41's
/// kernel-bench read the stage at 19-20 µs a launch however its 12.6 MB
/// were split (and 19.2 µs for the 8B-A1B's 3.2 MB of 4-bit rows): mostly
/// fixed time, the handoff its first suspect. The same norm code on the
/// same values in every block (the first block's own call, which still
/// writes the sum the layer hands on), so the same bits; each block reads
/// the row's three vectors (12 KB at 2,048 wide) from L2. The one-block
/// form and its K/V-writing form; not the split.
fn every_norm() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_QKV_EVERY_NORM", &ON)
}

/// The every-norm forms' text for a head's block in place of its wait for
/// the norm and its read of the normed row ([`every_norm`]).
pub(crate) const EVERY_NORM_SUBSTITUTION: (&str, &str) = (
    "  const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n  if (!late) lfm_stage16(sm, yn, XR);\n",
    concat!("  constexpr bool late = false;\n", stages::own_norm!("EPS_NORM_BITS")),
);

/// The every-norm form of `source` ([`EVERY_NORM_SUBSTITUTION`], its text
/// made once into `text`) among `forms`: no early form, since the early
/// text asks for a head's rows before the wait this one has not.
#[allow(clippy::too_many_arguments)]
fn every_norm_form(
    forms: &'static stages::Forms,
    text: &'static OnceLock<String>,
    source: &str,
    base: &str,
    quant: bool,
    scratch: bool,
    kv: bool,
) -> Option<&'static CudaKernel> {
    let body = text.get_or_init(|| super::substituted(source, &[EVERY_NORM_SUBSTITUTION]));
    form(forms, base, body, &[], quant, scratch, kv)
}

static EVERY_BUILT: Built = Built::new();
static WAIT_BUILT: Built = Built::new();

/// How many of [`built`]'s graphs took an every-norm form: the greedy
/// test's evidence.
pub fn every_norm_built() -> usize {
    EVERY_BUILT.get()
}

/// How many of [`built`]'s graphs took a waiting form (every-norm off, or
/// the split form, which has none): the tests' evidence that `=0` reached
/// the kernel.
pub fn waiting_built() -> usize {
    WAIT_BUILT.get()
}

/// The split form's text ([`split`]): the one-block form's with a head's
/// rows over `SPLIT` blocks, its tickets and norm mark (`st`) at `HEAD_ST`
/// (bytes into the state) and its heads' counters after them.
pub(crate) const SPLIT_SUBSTITUTIONS: [(&str, &str); 6] = [
    (
        "  constexpr int NB = 1 + NHEADS;\n",
        "  constexpr int NB = 1 + NHEADS * SPLIT;\n  constexpr int HP = HD / SPLIT;\n  static_assert(HP % WARPS == 0 && HP * sizeof(T) % 16 == 0, \"a part's rows tile the warps and 16-byte runs\");\n",
    ),
    (
        "  unsigned long long* st = reinterpret_cast<unsigned long long*>(const_cast<uint32_t*>(ctr));\n",
        "  unsigned long long* st = reinterpret_cast<unsigned long long*>(reinterpret_cast<unsigned char*>(const_cast<uint32_t*>(ctr)) + HEAD_ST);\n",
    ),
    ("  const int hh = role - 1;\n", "  const int hh = (role - 1) / SPLIT;\n  const int part = (role - 1) % SPLIT;\n"),
    ("    constexpr int RPW = HD / WARPS;\n", "    constexpr int RPW = HP / WARPS;\n"),
    (
        "rows[i] = static_cast<size_t>(hh) * HD + wid * RPW + i;",
        "rows[i] = static_cast<size_t>(hh) * HD + part * HP + wid * RPW + i;",
    ),
    ("hv[wid * RPW + i] = late", "hv[part * HP + wid * RPW + i] = late"),
];

/// Where a split head's parts meet (after [`SPLIT_SUBSTITUTIONS`], in
/// place of the one-block form's barrier before its head's norm): every
/// part but the last, and every part of a v head, writes its rows to the
/// head's place in the output; the others count themselves on the head's
/// counter; the last waits for them, takes the count back down and stages
/// their rows (a prefix of the head: its own are the last) beside its own.
const SPLIT_MEET: (&str, &str) = (
    "  __syncthreads();\n  if (threadIdx.x >= 32) return;\n",
    r#"  __syncthreads();
  {
    const bool vh = hh >= QH + KVH;
    T* hdst = hh < QH ? qo + static_cast<size_t>(hh) * HD
            : vh ? vo + static_cast<size_t>(hh - QH - KVH) * HD
                 : ko + static_cast<size_t>(hh - QH) * HD;
    unsigned long long* hc = st + 2 + hh;
    if (vh || part != SPLIT - 1) {
      for (int i = threadIdx.x; i < HP; i += blockDim.x) hdst[part * HP + i] = hv[part * HP + i];
      if (!vh) lfm_release_count(hc);
      return;
    }
    const bool hlate = lfm_block_wait(hc, SPLIT - 1, nullptr, 0);
    if (threadIdx.x == 0) atomicAdd(hc, 0ull - static_cast<unsigned long long>(SPLIT - 1));
    if (hlate) {
      for (int i = threadIdx.x; i < (SPLIT - 1) * HP; i += blockDim.x) hv[i] = T(__int_as_float(0x7fc00000));
    } else {
      lfm_stage16(hv_store, hdst, static_cast<int>((SPLIT - 1) * HP * sizeof(T) / 16));
    }
    __syncthreads();
  }
  if (threadIdx.x >= 32) return;
"#,
);

/// The split form's text, made once.
fn split_source() -> &'static str {
    static TEXT: OnceLock<String> = OnceLock::new();
    TEXT.get_or_init(|| {
        let body = super::substituted(super::qk_norm_rope::QKV_FUSED_SOURCE, &SPLIT_SUBSTITUTIONS);
        super::substituted(&body, &[SPLIT_MEET])
    })
}

/// The split form's early prefetch: its part's rows.
pub(crate) const SPLIT_EARLY_SUBSTITUTIONS: [(&str, &str); 1] = [
    (
        "  const int part = (role - 1) % SPLIT;\n  const bool late",
        "  const int part = (role - 1) % SPLIT;\n  LFM_EARLY_IN_BLOCK(D, static_cast<size_t>(hh) * HD + part * HP, HP);\n  const bool late",
    ),
];

/// The split form's kernel ([`kernel`]'s forms).
fn split_kernel(quant: bool, scratch: bool) -> Option<&'static CudaKernel> {
    static FORMS: stages::Forms = stages::Forms::new();
    let base = if quant { "lfm_qkv_split" } else { "lfm_qkv_split_dense" };
    form(&FORMS, base, split_source(), &SPLIT_EARLY_SUBSTITUTIONS, quant, scratch, false)
}

/// Where a layer's state holds the split form's words (bytes in): its
/// tickets, its norm's mark, then a counter a head; `d` the model's width.
pub(crate) fn split_place(d: usize) -> i64 {
    stages::scratch_places(&[d as i64 * 4, 0]).0[1]
}

/// The split form's words' bytes for `heads` q, k and v heads.
fn split_bytes(heads: usize) -> i64 {
    (2 + heads as i64) * 8
}

/// The split [`forward`] launches for these operands on `ctr`: 1 (the
/// one-block form) unless `MLX_LFM_QKV_SPLIT` asks for more, each part's
/// rows tile the warps and 16-byte runs, and the state has the split's
/// words.
pub(crate) fn split_for(ctr: &Array, dt: Dtype, d: i32, heads: (i32, i32, i32)) -> i32 {
    let n = split();
    let (qh, kvh, hd) = heads;
    let hp = hd / n;
    let room = split_place(d as usize) + split_bytes((qh + 2 * kvh) as usize);
    if n > 1 && hd % n == 0 && hp % warps() == 0 && (hp as usize * dt.size()).is_multiple_of(16) && (ctr.size() as i64) * 4 >= room {
        n
    } else {
        1
    }
}

/// Where the early form asks for its head's rows: before its wait for the
/// norm (the head's `HD` rows are one run of the stacked projection).
pub(crate) const EARLY_SUBSTITUTIONS: [(&str, &str); 1] = [
    (
        "  const int hh = role - 1;\n  const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n",
        "  const int hh = role - 1;\n  LFM_EARLY_IN_BLOCK(D, static_cast<size_t>(hh) * HD, HD);\n  const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n",
    ),
];

/// The scratch row's pointer into the layer's state
/// (`MLX_LFM_SCRATCH_IN_STATE`, src/kernels/stages.rs), as the output of
/// that name was: the normed row.
const SCRATCH_PRELUDE: &str = r#"
  unsigned char* lfm_scratch = reinterpret_cast<unsigned char*>(const_cast<uint32_t*>(ctr));
  T* yn = reinterpret_cast<T*>(lfm_scratch + SCR_YN);
"#;

/// The uint32 words of an attention layer's state: its counters, room
/// for its scratch row (`d` wide, at up to 4 bytes) and the split form's
/// words for `heads` q, k and v heads ([`split`]).
pub fn state_words(d: usize, heads: usize) -> usize {
    stages::state_words(&[d as i64 * 4, split_bytes(heads)])
}

/// Whether the switch is on where our CUDA kernels run.
pub fn enabled_here() -> bool {
    enabled() && cuda_kernels_enabled()
}

/// Whether [`forward`] serves the pending norm `x` (one row, with a
/// residual to add), the stacked projection `p` (no bias), the heads'
/// norm weights `qw` / `kw` and `heads` (query heads, KV heads, head
/// width), with the position `offset` (`[1]` int32): on ([`enabled`]), on
/// CUDA, eps compiled in (`MLX_LFM_EPS_CONST`, the default), where the add +
/// RMSNorm kernel serves the row with a block no wider than this kernel's
/// and the q/k/v kernel's code serves the heads (the caller asks that
/// kernel's own switch, `qkv_wanted`, first).
pub fn available(x: &Normed, p: Projection, qw: &Array, kw: &Array, heads: (i32, i32, i32), offset: &Array) -> bool {
    let Some(r) = x.r else { return false };
    if !enabled_here() || !super::add_rms_norm::eps_const() || x.h.ndim() != 2 || x.h.dim(0) != 1 {
        return false;
    }
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let (qh, kvh, hd) = heads;
    let rows = (qh + 2 * kvh) as i64 * hd as i64;
    let product = match p {
        Projection::Quant(q) => {
            q.weight.ndim() == 2
                && super::quant_gemv::spec_served(q, dt, d)
                && q.weight.dim(0) as i64 == rows
                && q.weight.dim(1) as i64 * 32 / q.spec.bits as i64 == d as i64
                && q.scales.shape() == [q.weight.dim(0), d / q.spec.group_size]
        }
        Projection::Dense(w) => w.ndim() == 2 && w.dtype() == dt && w.dim(0) as i64 == rows && w.dim(1) == d && d % 8 == 0,
    };
    let warps = warps();
    // (The rows the 16-warp form serves, in either form: over 32 warps the
    // norm's block could take rows past them, where ptxas put f16 heads of
    // 128 at 80 registers, past the 64 that 1,024 threads allow.)
    super::add_rms_norm::available(x.h, r, x.w)
        && super::add_rms_norm::block_for(d, 16 / dt.size() as i32) <= WARPS * 32
        && product
        && hd > 0
        && hd % warps == 0
        // (By ptxas, dense rows of 3,072 and more with heads of 256 took
        // 164-168 registers a thread, past what 512 threads have; heads up
        // to 128 stay at or under 86.)
        && hd <= MAX_HEAD
        && qh > 0
        && kvh > 0
        // (The q/k/v kernel's own conditions on the heads and the norms.)
        && super::qk_norm_rope::qkv_served(dt, qw, kw, heads)
        && offset.dtype() == Dtype::Int32
        && offset.size() == 1
        && ((d as usize) * dt.size()).is_multiple_of(16)
        && (d as usize) * dt.size() <= stages::MAX_STAGED
        && kernel(matches!(p, Projection::Quant(_)), false).is_some()
}

/// `(the residual sum [1, D], q [1, H, 1, HD], k [1, KVH, 1, HD], v [1,
/// KVH, 1, HD])` in one launch, as the q/k/v kernel lays them out (callers
/// check [`available`]); `consts` the heads' norm's eps and RoPE's base,
/// `ctr` the layer's own (`stages::new_counters`).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    x: &Normed,
    p: Projection,
    qw: &Array,
    kw: &Array,
    heads: (i32, i32, i32),
    offset: &Array,
    consts: (f32, f32),
    ctr: &Array,
) -> Result<(Array, Array, Array, Array)> {
    let mut outs = launch(x, p, qw, kw, heads, offset, consts, ctr, false, None)?;
    let missing = || Error::mlx("fused q/k/v kernel: missing output");
    let v = outs.pop().ok_or_else(missing)?;
    let k = outs.pop().ok_or_else(missing)?;
    let q = outs.pop().ok_or_else(missing)?;
    let s = outs.pop().ok_or_else(missing)?;
    Ok((s, q, k, v))
}

/// Whether [`forward_into`] serves these operands: [`available`]'s, on
/// ([`kv_in_place`]), and the K/V buffers `kc` / `vc` `[1, KVH, cap, HD]`
/// in the row's dtype.
#[allow(clippy::too_many_arguments)]
pub fn available_into(x: &Normed, p: Projection, qw: &Array, kw: &Array, heads: (i32, i32, i32), offset: &Array, kc: &Array, vc: &Array) -> bool {
    refusal_into(x, p, qw, kw, heads, offset, kc, vc).is_none()
}

/// Why [`available_into`] does not serve these operands (None: it does).
#[allow(clippy::too_many_arguments)]
pub fn refusal_into(x: &Normed, p: Projection, qw: &Array, kw: &Array, heads: (i32, i32, i32), offset: &Array, kc: &Array, vc: &Array) -> Option<&'static str> {
    let (_, kvh, hd) = heads;
    let fits = |b: &Array| b.ndim() == 4 && b.dtype() == x.h.dtype() && b.dim(0) == 1 && b.dim(1) == kvh && b.dim(2) > 0 && b.dim(3) == hd;
    if !kv_in_place() {
        Some("MLX_LFM_KV_IN_PLACE is off")
    } else if !fits(kc) || !fits(vc) || kc.shape() != vc.shape() {
        Some("the K/V buffers are not [1, kv heads, cap, head_dim] in the row's dtype")
    } else if !available(x, p, qw, kw, heads, offset) {
        Some("the one-launch q/k/v stage does not serve the row")
    } else if kv_kernel(matches!(p, Projection::Quant(_)), false).is_none() {
        Some("the K/V-writing kernel could not be made")
    } else {
        None
    }
}

/// The last reason a layer's in-place K/V write was refused
/// ([`note_refusal`]): what the greedy test's evidence reports where a
/// run never took it.
static REFUSED: parking_lot::Mutex<Option<&'static str>> = parking_lot::Mutex::new(None);

pub fn note_refusal(why: &'static str) {
    *REFUSED.lock() = Some(why);
}

pub fn last_refusal() -> Option<&'static str> {
    *REFUSED.lock()
}

/// [`last_refusal`], cleared: a test's run then reports only its own.
pub fn take_refusal() -> Option<&'static str> {
    REFUSED.lock().take()
}

/// `(the residual sum [1, D], q [1, H, 1, HD])` in one launch that also
/// writes k's and v's heads into the layer's K/V buffers `kv` at the
/// position, in place ([`kv_in_place`]; callers check [`available_into`]
/// and make room for the position first).
#[allow(clippy::too_many_arguments)]
pub fn forward_into(
    x: &Normed,
    p: Projection,
    qw: &Array,
    kw: &Array,
    heads: (i32, i32, i32),
    offset: &Array,
    consts: (f32, f32),
    ctr: &Array,
    kv: (&Array, &Array),
) -> Result<(Array, Array)> {
    let mut outs = launch(x, p, qw, kw, heads, offset, consts, ctr, false, Some(kv))?;
    let missing = || Error::mlx("fused q/k/v kernel: missing output");
    let q = outs.pop().ok_or_else(missing)?;
    let s = outs.pop().ok_or_else(missing)?;
    Ok((s, q))
}

/// [`forward`]'s q through the one-block stage's timeline form (the
/// bench's: `stages::TIMELINE_HEADER`, [`TIMELINE_SUBSTITUTIONS`]; never
/// split), with its stamps `[NB * 4]` int64 and its blocks: block 0 the
/// norm's, the rest a head each (`1..nb`).
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn forward_timeline(
    x: &Normed,
    p: Projection,
    qw: &Array,
    kw: &Array,
    heads: (i32, i32, i32),
    offset: &Array,
    consts: (f32, f32),
    ctr: &Array,
) -> Result<(Array, Array, usize)> {
    let mut outs = launch(x, p, qw, kw, heads, offset, consts, ctr, true, None)?;
    let missing = || Error::mlx("fused q/k/v kernel: missing output");
    let times = outs.pop().ok_or_else(missing)?;
    let (qh, kvh, _) = heads;
    Ok((outs.swap_remove(1), times, 1 + (qh + 2 * kvh) as usize))
}

/// The launch: `[s, q, k, v]`, or (`timeline`) the timeline form's every
/// output, its stamps last, or (`kv`, the K/V buffers written in place)
/// `[s, q]`.
#[allow(clippy::too_many_arguments)]
fn launch(
    x: &Normed,
    p: Projection,
    qw: &Array,
    kw: &Array,
    heads: (i32, i32, i32),
    offset: &Array,
    (eps, theta): (f32, f32),
    ctr: &Array,
    timeline: bool,
    kv: Option<(&Array, &Array)>,
) -> Result<Vec<Array>> {
    let quant = matches!(p, Projection::Quant(_));
    let r = x.r.ok_or_else(|| Error::invalid("the fused q/k/v kernel needs a residual to add"))?;
    stages::check_state(ctr, "the fused q/k/v kernel")?;
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let (qh, kvh, hd) = heads;
    // (Where the split form's kernel object would not be made, the
    // one-block form: its tickets are its own words, so the state stays in
    // step. NVRTC compiles at the graph's eval, so a text that fails there
    // fails the step, as the one-block form's would.)
    // (The K/V-writing form is the one-block form's.)
    let parts = match split_for(ctr, dt, d, heads) {
        n if n > 1 && !timeline && kv.is_none() && split_kernel(quant, false).is_some() => n,
        _ => 1,
    };
    let form = |scratch: bool| match (kv, parts) {
        (Some(_), _) => kv_kernel(quant, scratch),
        (None, 1) => kernel(quant, scratch),
        _ => split_kernel(quant, scratch),
    };
    let kern = if timeline { timeline_kernel(quant) } else { form(false) };
    let kern = kern.ok_or_else(|| Error::mlx("the fused q/k/v kernel is not available"))?;
    let nb = 1 + (qh as i64 + 2 * kvh as i64) * parts as i64;
    let warps = warps();
    let threads = warps * 32;
    let grid = i32::try_from(nb * threads as i64).map_err(|_| Error::invalid(format!("fused q/k/v kernel: {nb} blocks")))?;
    let mut template = vec![
        ("T", TemplateArg::Dtype(dt)),
        ("D", TemplateArg::Int(d)),
        ("HD", TemplateArg::Int(hd)),
        ("QH", TemplateArg::Int(qh)),
        ("KVH", TemplateArg::Int(kvh)),
        ("NBLK", TemplateArg::Int(super::add_rms_norm::block_for(d, 16 / dt.size() as i32))),
        ("WARPS", TemplateArg::Int(warps)),
        ("EPS_NORM_BITS", TemplateArg::Int(x.eps.to_bits() as i32)),
        ("EPS_BITS", TemplateArg::Int(eps.to_bits() as i32)),
        // (As the q/k/v kernel takes it: log2 of the base, the host's.)
        ("BASE_BITS", TemplateArg::Int(theta.log2().to_bits() as i32)),
    ];
    if parts > 1 {
        let place = i32::try_from(split_place(d as usize)).map_err(|_| Error::invalid(format!("fused q/k/v kernel: a state {d} wide")))?;
        template.extend([("SPLIT", TemplateArg::Int(parts)), ("HEAD_ST", TemplateArg::Int(place))]);
    }
    let mut inputs: Vec<&Array> = match p {
        Projection::Quant(q) => {
            template.extend([("IBITS", TemplateArg::Int(q.spec.bits)), ("IGS", TemplateArg::Int(q.spec.group_size))]);
            let b = q.biases.as_ref().ok_or_else(|| Error::invalid("the fused q/k/v kernel needs affine biases"))?;
            vec![x.h, r, x.w, &q.weight, &q.scales, b, qw, kw, offset, ctr]
        }
        Projection::Dense(w) => vec![x.h, r, x.w, w, qw, kw, offset, ctr],
    };
    let (s_out, q_out, kv_out, yn_out): (&[i32], &[i32], &[i32], &[i32]) = (&[1, d], &[1, qh, 1, hd], &[1, kvh, 1, hd], &[d]);
    let all = [(s_out, dt), (q_out, dt), (kv_out, dt), (kv_out, dt), (yn_out, dt)];
    let written = [(s_out, dt), (q_out, dt), (yn_out, dt)];
    let outputs: &[(&[i32], Dtype)] = match kv {
        Some((kc, vc)) => {
            inputs.extend([kc, vc]);
            &written
        }
        None => &all,
    };
    if timeline {
        return stages::call_stamped(kern, &inputs, outputs, nb, [grid, 1, 1], [threads, 1, 1], &template, "fused q/k/v kernel");
    }
    let mut outs =
        stages::call_with_scratch(kern, || form(true), &inputs, outputs, &["SCR_YN"], ctr, [grid, 1, 1], [threads, 1, 1], &template)?;
    BUILT.bump();
    if parts > 1 {
        SPLIT_BUILT.bump();
    }
    if kv.is_some() {
        KV_BUILT.bump();
    }
    if every_norm() && (kv.is_some() || parts == 1) {
        EVERY_BUILT.bump();
    } else {
        WAIT_BUILT.bump();
    }
    outs.truncate(outputs.len() - 1);
    Ok(outs)
}

/// Where the one-block stage's timeline form stamps ([`forward_timeline`]):
/// each block when it takes its ticket; the norm's block when it is done;
/// a head's when its wait ends, when the normed row is staged and when its
/// rows' products are in (before its norm and RoPE on the first warp).
/// Each text found once in the body (a test holds it); the ticket's and
/// the norm's are the layers' own ([`stages::TIMELINE_SUBSTITUTIONS`]).
pub(crate) const TIMELINE_SUBSTITUTIONS: [(&str, &str); 5] = [
    stages::TIMELINE_SUBSTITUTIONS[0],
    stages::TIMELINE_SUBSTITUTIONS[1],
    (
        "  const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n",
        "  const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n  LFM_STAMP(1);\n",
    ),
    ("  if (!late) lfm_stage16(sm, yn, XR);\n  __syncthreads();\n", "  if (!late) lfm_stage16(sm, yn, XR);\n  __syncthreads();\n  LFM_STAMP(2);\n"),
    ("  __syncthreads();\n  if (threadIdx.x >= 32) return;\n", "  __syncthreads();\n  LFM_STAMP(3);\n  if (threadIdx.x >= 32) return;\n"),
];

/// The one-block stage's timeline form, dense or 4-bit.
fn timeline_kernel(quant: bool) -> Option<&'static CudaKernel> {
    static K: [stages::Cells; 2] = [stages::cells(), stages::cells()];
    static SOURCE: OnceLock<String> = OnceLock::new();
    let source = SOURCE.get_or_init(|| super::substituted(super::qk_norm_rope::QKV_FUSED_SOURCE, &TIMELINE_SUBSTITUTIONS));
    let mut inputs = vec!["h", "r", "wn"];
    inputs.extend(if quant { &["iw", "iscales", "ibiases"][..] } else { &["iw"][..] });
    inputs.extend(["qw", "kw", "offset", "ctr"]);
    let outputs = ["s", "qo", "ko", "vo", "yn", "times"];
    let name = if quant { "lfm_qkv_fused_timeline" } else { "lfm_qkv_fused_dense_timeline" };
    stages::kernel(&K[usize::from(quant)], name, &inputs, &outputs, source, || {
        format!("{}{}", stages::TIMELINE_HEADER, stages::layer_header(quant, false, ""))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The timeline form's stamps each find their place in the body, once.
    #[test]
    fn every_timeline_stamp_finds_its_place() {
        let body = super::super::qk_norm_rope::QKV_FUSED_SOURCE;
        for (was, _) in TIMELINE_SUBSTITUTIONS {
            assert_eq!(body.matches(was).count(), 1, "{was}");
        }
        let stamped = super::super::substituted(body, &TIMELINE_SUBSTITUTIONS);
        assert_eq!(stamped.matches("LFM_STAMP(").count(), 4);
        assert_eq!(stamped.matches("LFM_STAMP_START();").count(), 1);
    }

    /// The K/V-writing form's substitution finds its place once, and its
    /// text writes k and v through the buffers, not the outputs.
    #[test]
    fn the_kv_form_finds_its_place() {
        let body = super::super::qk_norm_rope::QKV_FUSED_SOURCE;
        assert_eq!(body.matches(KV_SUBSTITUTION.0).count(), 1);
        let text = kv_source();
        assert!(text.contains("const_cast<T*>(kc)") && text.contains("const_cast<T*>(vc)") && text.contains("kc_shape[2]"));
        assert!(!text.contains(": ko +") && !text.contains("? vo +"), "the K/V form still writes the k or v output");
        assert_eq!(text.matches(EARLY_SUBSTITUTIONS[0].0).count(), 1, "the early form's place");
    }

    /// The early form's prefetch finds its place in the body, once.
    #[test]
    fn the_early_prefetch_finds_its_place() {
        let body = super::super::qk_norm_rope::QKV_FUSED_SOURCE;
        assert_eq!(body.matches(EARLY_SUBSTITUTIONS[0].0).count(), 1);
        assert!(super::super::substituted(body, &EARLY_SUBSTITUTIONS).contains("LFM_EARLY_IN_BLOCK(D,"));
    }

    /// The split form's substitutions each find their place once, in
    /// turn, and its early prefetch finds its place in the split text.
    #[test]
    fn the_split_form_finds_its_places() {
        let mut body = super::super::qk_norm_rope::QKV_FUSED_SOURCE.to_string();
        for (was, now) in SPLIT_SUBSTITUTIONS.iter().chain([&SPLIT_MEET]) {
            assert_eq!(body.matches(was).count(), 1, "{was}");
            body = body.replace(was, now);
        }
        assert_eq!(body, split_source());
        assert!(body.contains("ctr)) + HEAD_ST);"), "the split form takes the one-block form's tickets");
        assert_eq!(body.matches(SPLIT_EARLY_SUBSTITUTIONS[0].0).count(), 1);
        // (The state's words: the split's after the scratch row, 256-aligned.)
        assert_eq!(split_place(2048) % 256, 0);
        assert!(split_place(2048) >= stages::scratch_places(&[2048 * 4]).1);
        assert_eq!(state_words(2048, 48) as i64 * 4, split_place(2048) + split_bytes(48));
    }
}
