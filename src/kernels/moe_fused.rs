//! A lone sequence's MoE layer in one launch (a CUDA default since session
//! 31, `MLX_LFM_MOE_FUSED=0` off: its H200 test and greedy sets passed in
//! sessions 30-31, and the one-launch layers together read decode 1.12x /
//! 1.00x / 1.15x on the 350M / 1.2B / 8B-A1B in session 31's paired A/B, on
//! an H100): the residual add + RMSNorm, the router, the experts' gate/up
//! with their SwiGLU and the down projection with the weighted sum, which
//! otherwise are three launches (src/kernels/moe_router.rs
//! `route_gate_norm`, src/kernels/moe_experts.rs `gate_up` and `down`): 44
//! of the 8B-A1B's ~200 nodes a step, each one the host builds and
//! dispatches every token (the host bounds that model's decode in some
//! rounds) and each a kernel boundary on the GPU.
//!
//! The three stages depend on each other across the whole grid (the
//! experts need the router's choice, the down projection every gate/up
//! row), and MLX launches a custom kernel plainly (no cooperative launch,
//! so no grid-wide barrier that is safe whatever the residency). So each
//! block takes a ticket when it starts (a counter the kernel keeps in a
//! small state array of its layer) and its ticket, not its block index,
//! gives its part: ticket 0 the norm and the router, the next tickets the
//! gate/up rows, the last ones the down columns. A block waits only for
//! blocks with smaller tickets, which took theirs before it and so are
//! running or done and never wait on it: no deadlock, however few blocks a
//! GPU holds at once. The counters never reset: launch L of a layer takes
//! tickets `[L * NB, (L + 1) * NB)`, so a block knows its launch and what
//! to wait for (64-bit: no wrap). That needs a layer's launches to run one
//! after another, which MLX does not see to (the state is only ever an
//! input, so its graph has no edge through it): they are ordered by data,
//! as one sequence's steps are (each layer's input comes from the step
//! before). Two independent one-row passes of one model in a single
//! evaluation would interleave their tickets; nothing here makes them (a
//! batch of rows takes the three kernels). A wait that runs past
//! `LFM_SPIN_LIMIT` polls (each a load from L2 and a short sleep: far past
//! any real stage's microseconds, ~0.1 s or more) gives up and poisons the
//! layer's output with NaN (the step's finiteness check then fails it)
//! instead of hanging the GPU, still counting itself so that later
//! launches stay in step; a down block also waits for the router's mark,
//! so gate/up blocks that gave up never let it read an unwritten route.
//!
//! Each stage is the default kernel's own code over the same values (the
//! router + norm's device functions; the gate/up and down warps' helpers,
//! reading the normed row and the gated rows from shared memory after
//! loading them past L1; the down kernel's default arithmetic, not its
//! `MLX_LFM_MOE_DOWN_LOADS=early` variant), so the result is the three
//! launches' within NVVM's contraction choices (`moe_experts`'s note): the
//! test holds the residual sum to the bits and the output within two
//! roundings of them. Tests in src/kernels/tests.rs.

use super::moe_experts;
use super::moe_router;
use super::norm_gemv::NormIn;
use super::stages::{self, Built, Cells, TICKET_HEADER};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::Quantized;
use std::sync::OnceLock;



// Template constants: T, D (the row), F (an expert's hidden width), E,
// TOPK, NORM, the gate's GBITS / GGS, the experts' BITS / GS, WARPS (the
// block), EPS_BITS, SCALE_BITS. `ctr`: the layer's counters (tickets, the
// router's launch mark, gate/up blocks done). The body: the MoE part of
// src/kernels/stages.rs's `LAYER_SOURCE`.

/// Warps a block: a warp an expert for the router (as the router + norm
/// kernel's default), 32 experts a row on the 8B-A1B; ptxas keeps the
/// kernel within the 64 registers a thread that 1,024 threads allow.
pub(crate) const WARPS: i32 = 32;
/// Warps a block of the wide form ([`rows_a_warp`]): 16, so that a block
/// launches whatever registers ptxas gives a thread (up to 128 at 512
/// threads; MLX gives a custom kernel no launch bounds). At 1,024 threads
/// the wide form took 66-96 registers on some served shapes (rows of
/// 1,536 or 4,096, 8-bit experts in groups of 32: nvrtc-check's probes),
/// past the 64 that allow a launch; on the 8B-A1B's it takes 56 at 4 rows
/// a warp and 64 at 8, two blocks an SM. The router's warps then take two experts each, each
/// expert's dot still one warp's: the same bits.
const WIDE_WARPS: i32 = 16;
/// The router's scratch outputs hold this many entries whatever k is, so
/// that they stay over 8 bytes (MLX 0.32.4 keeps smaller arrays in its
/// managed scalar pool, slow for the GPU to read; `moe_router::scores_f32`).
pub(crate) const ROUTE_SLOTS: i32 = 8;
/// The widest expert served: by ptxas (sm_90, CUDA 13.5 here) the kernel
/// stays within the 64 registers a thread of 1,024 allow up to here in
/// every dtype, specification and row width the router + norm fold serves
/// (56 on the 8B-A1B; 64, the most, on rows of 1,536, whose last chunk is
/// guarded); one-expert rows of 12,288 and more with 8-bit experts took
/// 65-66, and MLX gives a custom kernel no launch bounds.
const MAX_F: i64 = 8192;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_MOE_FUSED", &ON)
}

/// The scratch rows' bytes (the normed row, the route's experts and
/// weights, the gated rows: the last four outputs of [`forward`]'s launch,
/// whose sizes `stages::call_with_scratch` places) at `elem` bytes an
/// activation: what a layer's state is sized for.
fn scratch_bytes(d: i64, f: i64, k: i64, elem: i64) -> [i64; 4] {
    [d * elem, ROUTE_SLOTS as i64 * 4, ROUTE_SLOTS as i64 * 4, k * f * elem]
}

/// The uint32 words of a MoE layer's state: its counters, and room for
/// its scratch rows at up to 4 bytes an activation (~37 KB a layer of the
/// 8B-A1B).
pub fn state_words(d: usize, f: usize, k: usize) -> usize {
    stages::state_words(&scratch_bytes(d as i64, f as i64, k.clamp(1, ROUTE_SLOTS as usize) as i64, 4))
}

/// The scratch rows' pointers into the state, as the outputs of those
/// names were (the body is the same text).
const SCRATCH_PRELUDE: &str = r#"
  unsigned char* lfm_scratch = reinterpret_cast<unsigned char*>(const_cast<uint32_t*>(ctr));
  T* yn = reinterpret_cast<T*>(lfm_scratch + SCR_YN);
  uint32_t* inds = reinterpret_cast<uint32_t*>(lfm_scratch + SCR_INDS);
  float* scores = reinterpret_cast<float*>(lfm_scratch + SCR_SCORES);
  T* hk = reinterpret_cast<T*>(lfm_scratch + SCR_HK);
"#;

/// `MLX_LFM_MOE_FUSED_ROWS=R` (2, 4 or 8; opt-in, session 34, not yet
/// run on a GPU): the launch's experts `R` rows a warp instead of one, in
/// about one wave. The default launch is 481 blocks of 1,024 threads on the
/// 8B-A1B, one block an SM at its 56 registers a thread, so ~3.6 waves of
/// blocks one after another, each a few µs of a ticket, a wait, a staged
/// row, one DRAM round trip for 1-2 KB a warp and a release: session 33's
/// ncu had the launch at 40 µs in the step, ~0.6 TB/s of its ~25 MB. The
/// wide form's blocks are 512 threads ([`WIDE_WARPS`]): with R = 4 it is
/// 241 blocks (the router's, 112 gate/up, 128 down), two an SM at its 56
/// registers, fewer than the 264 the H100's and H200's 132 SMs hold (R =
/// 8: 121), and each warp asks L2 for all its rows'
/// bytes (prefetch: no register) as soon as the route names their expert,
/// then sums them one after another from L2: the down blocks, resident
/// while the gate/up blocks run, fetch their rows during the gate/up
/// stage instead of after it, and the router's block asks for the gate's
/// rows before its norm. Each row is the same helper over the same values
/// and each column's experts are summed in the same order, so the outputs
/// are the default launch's bits (its test holds them to that).
///
/// A layer's state serves one form for its life (its tickets' epochs are
/// counted in its launch's blocks): the switch is read once a process, or
/// held by an engine's own switches.
pub fn rows_a_warp() -> i32 {
    static R: OnceLock<i32> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_MOE_FUSED_ROWS", &R, |v| {
        v.map(str::trim).and_then(|s| s.parse::<i32>().ok()).filter(|r| [2, 4, 8].contains(r)).unwrap_or(1)
    })
}

/// The wide form's experts: the part of `stages::LAYER_SOURCE` from
/// [`WIDE_FROM`] through [`WIDE_TO`] (the gate/up and down stages) in its
/// place, and [`WIDE_SUBSTITUTIONS`] for the blocks' counts.
const WIDE_FROM: &str = "    // Gate/up: a warp one row of one chosen expert, after the route.\n";
const WIDE_TO: &str = "    out[n] = late ? T(poison) : T(total);\n  }\n";
const WIDE_EXPERTS: &str = r#"    // Gate/up: RPW rows of one chosen expert a warp, asked of L2 once the
    // route names the expert, then summed one after another.
    const int j = (fr - 1) / RB;
    const int n0 = ((fr - 1) % RB) * WARPS * RPW + wid * RPW;
    const bool late = lfm_block_wait(st + FC + 1, launch + 1, nullptr, 0);
    // (An expert id out of range, which the route never writes, poisons
    // rather than reads past the stacks.)
    const size_t ex = late ? 0 : __ldcg(inds + j);
    const bool bad = late || ex >= E;
    constexpr int G = D / GS;
    constexpr int WORDS = D * BITS / 32;
    if (!bad) {
#pragma unroll
      for (int q = 0; q < RPW; q++) {
        if (n0 + q < F) {
          const size_t gi = ex * (2 * F) + n0 + q;
          const size_t ui = gi + F;
          lfm_prefetch_span(uw + gi * WORDS, WORDS * 4, lane);
          lfm_prefetch_span(uw + ui * WORDS, WORDS * 4, lane);
          lfm_prefetch_span(uscales + gi * G, G * sizeof(T), lane);
          lfm_prefetch_span(ubiases + gi * G, G * sizeof(T), lane);
          lfm_prefetch_span(uscales + ui * G, G * sizeof(T), lane);
          lfm_prefetch_span(ubiases + ui * G, G * sizeof(T), lane);
        }
      }
    }
    T* xs = reinterpret_cast<T*>(sm);
    if (!late) lfm_stage16(sm, LFM_FFN_YN, XR);
    __syncthreads();
    // (The rows' results kept until every row is summed: no global store
    // between one row's loads and the next's, so they may overlap.)
    T res[RPW];
#pragma unroll
    for (int q = 0; q < RPW; q++) {
      const int n = n0 + q;
      float ag = 0.0f;
      float au = 0.0f;
      if (!bad && n < F) {
        const size_t gi = ex * (2 * F) + n;
        const size_t ui = ex * (2 * F) + F + n;
        if (lfm_aligned(uw)) {
          lfm_qdot2_a<T, D, BITS, GS, true>(xs, uw + gi * WORDS, uscales + gi * G, ubiases + gi * G, uw + ui * WORDS,
                                            uscales + ui * G, ubiases + ui * G, lane, ag, au);
        } else {
          lfm_qdot2_a<T, D, BITS, GS, false>(xs, uw + gi * WORDS, uscales + gi * G, ubiases + gi * G, uw + ui * WORDS,
                                             uscales + ui * G, ubiases + ui * G, lane, ag, au);
        }
        ag = lfm_warp_sum(ag);
        au = lfm_warp_sum(au);
      }
      res[q] = bad ? T(poison) : lfm_swiglu<T>(ag, au);
    }
    if (lane == 0) {
#pragma unroll
      for (int q = 0; q < RPW; q++) {
        if (n0 + q < F) hk[static_cast<size_t>(j) * F + n0 + q] = res[q];
      }
    }
    lfm_release_count(st + FC + 2);
    return;
  }
  // Down: RPW output columns of one chosen expert a warp, the columns'
  // experts summed in their order. Their rows are asked of L2 once the
  // route is known, while the gate/up blocks still run; the sums wait
  // for every gate/up block of the launch.
  const int db = fr - 1 - GB;
  const int j = wid % KE;
  const int col = wid / KE;
  const int n0 = db * CPB * RPW + col * RPW;
  constexpr int G = F / GS;
  constexpr int WORDS = F * BITS / 32;
  {
    const bool unrouted = lfm_block_wait(st + FC + 1, launch + 1, nullptr, 0);
    const size_t ex = unrouted ? E : __ldcg(inds + j);
    if (ex < E && col < CPB) {
#pragma unroll
      for (int q = 0; q < RPW; q++) {
        if (n0 + q < D) {
          const size_t wi = ex * D + n0 + q;
          lfm_prefetch_span(dw + wi * WORDS, WORDS * 4, lane);
          lfm_prefetch_span(dscales + wi * G, G * sizeof(T), lane);
          lfm_prefetch_span(dbiases + wi * G, G * sizeof(T), lane);
        }
      }
    }
  }
  // The router's mark too: gate/up blocks that gave up still count
  // themselves, and the route's outputs are only written once it is set.
  const bool late = lfm_block_wait(st + FC + 2, (launch + 1) * GB, st + FC + 1, launch + 1);
  const T* hs = reinterpret_cast<const T*>(sm);
  if (!late) lfm_stage16(sm, hk, HR);
  __syncthreads();
  const size_t ex = late ? 0 : __ldcg(inds + j);
#pragma unroll
  for (int q = 0; q < RPW; q++) {
    const int n = n0 + q;
    if (col >= CPB || n >= D) break;
    if ((late || ex >= E) && lane == 0) part[wid * RPW + q] = poison;
    if (!late && ex < E) {
      const size_t wi = ex * D + n;
      const T* hr = hs + static_cast<size_t>(j) * F;
      float a = 0.0f;
      if (lfm_aligned(dw)) {
        lfm_qdot_a<T, F, 1, BITS, GS, true>(hr, dw + wi * WORDS, dscales + wi * G, dbiases + wi * G, lane, &a);
      } else {
        lfm_qdot_a<T, F, 1, BITS, GS, false>(hr, dw + wi * WORDS, dscales + wi * G, dbiases + wi * G, lane, &a);
      }
      a = lfm_warp_sum(a);
      if (lane == 0) part[wid * RPW + q] = static_cast<float>(T(static_cast<float>(T(a)) * __ldcg(scores + j)));
    }
  }
  __syncthreads();
  for (int q = 0; q < RPW; q++) {
    const int n = n0 + q;
    if (col >= CPB || n >= D || j != 0 || lane != 0) break;
    float total = 0.0f;
    for (int i = 0; i < KE; i++) total += part[(col * KE + i) * RPW + q];
    out[n] = late ? T(poison) : T(total);
  }
"#;

/// The wide form's counts (RPW rows a warp) and its router's gate asked of
/// L2 before the norm, in `stages::LAYER_SOURCE`'s MoE part.
const WIDE_SUBSTITUTIONS: [(&str, &str); 4] = [
    ("  constexpr int RB = (F + WARPS - 1) / WARPS;\n", "  constexpr int RB = (F + WARPS * RPW - 1) / (WARPS * RPW);\n"),
    ("  constexpr int DB = (D + CPB - 1) / CPB;\n", "  constexpr int DB = (D + CPB * RPW - 1) / (CPB * RPW);\n"),
    ("  __shared__ float part[WARPS];\n", "  __shared__ float part[WARPS * RPW];\n"),
    (
        "      T* ys = reinterpret_cast<T*>(sm);\n      lfm_norm_stage<T, D, TN>(h, r, wn,",
        "      T* ys = reinterpret_cast<T*>(sm);\n      lfm_prefetch_block(gw, E * D * GBITS / 8);\n      lfm_prefetch_block(gscales, E * (D / GGS) * sizeof(T));\n      lfm_prefetch_block(gbiases, E * (D / GGS) * sizeof(T));\n      lfm_norm_stage<T, D, TN>(h, r, wn,",
    ),
];

/// `stages::LAYER_SOURCE` as the wide form runs it; `None` if a piece it
/// replaces is not there (a test holds that each is).
fn wide_source() -> Option<String> {
    let src = stages::LAYER_SOURCE;
    let from = src.find(WIDE_FROM)?;
    let to = src[from..].find(WIDE_TO)? + from + WIDE_TO.len();
    let spliced = format!("{}{WIDE_EXPERTS}{}", &src[..from], &src[to..]);
    WIDE_SUBSTITUTIONS.iter().all(|(was, _)| spliced.contains(was)).then(|| super::substituted(&spliced, &WIDE_SUBSTITUTIONS))
}

static BUILT: Built = Built::new();

/// How many times [`forward`] has put the kernel into a graph in this
/// process (a compiled step once, when it is traced): the greedy test's
/// evidence that its default runs took this path at all.
pub fn built() -> usize {
    BUILT.get()
}

const INPUTS: [&str; 14] = ["h", "r", "wn", "gw", "gscales", "gbiases", "bias", "uw", "uscales", "ubiases", "dw", "dscales", "dbiases", "ctr"];

fn header() -> String {
    format!("{}{}{TICKET_HEADER}", stages::layer_defines(false, stages::Tail::Moe), moe_router::gate_norm_header())
}

/// The kernel; with `scratch`, its form with the scratch rows (`yn`,
/// `inds`, `scores`, `hk`) in the layer's state
/// ([`stages::call_with_scratch`]); with `wide`, its form of several rows a
/// warp ([`rows_a_warp`]).
fn kernel(scratch: bool, wide: bool) -> Option<&'static CudaKernel> {
    static K: [Cells; 4] = [stages::cells(), stages::cells(), stages::cells(), stages::cells()];
    static SOURCES: [OnceLock<Option<String>>; 3] = [OnceLock::new(), OnceLock::new(), OnceLock::new()];
    let outputs = ["s", "out", "yn", "inds", "scores", "hk"];
    let body: &'static str = if wide { SOURCES[0].get_or_init(wide_source).as_deref()? } else { stages::LAYER_SOURCE };
    let at = usize::from(scratch) + 2 * usize::from(wide);
    let name = ["lfm_moe_fused", "lfm_moe_fused_scr", "lfm_moe_fused_wide", "lfm_moe_fused_wide_scr"][at];
    let head = move || if wide { format!("{}{}", stages::PREFETCH_HEADER, header()) } else { header() };
    if scratch {
        let source = SOURCES[1 + usize::from(wide)].get_or_init(|| Some(format!("{SCRATCH_PRELUDE}{body}"))).as_deref()?;
        return stages::kernel(&K[at], name, &INPUTS, &outputs[..2], source, head);
    }
    stages::kernel(&K[at], name, &INPUTS, &outputs, body, head)
}

/// The warps a block of the form at `r` rows a warp.
fn warps(r: i32) -> i32 {
    if r > 1 {
        WIDE_WARPS
    } else {
        WARPS
    }
}

/// The gate/up blocks and the down blocks of one launch at `r` rows a
/// warp (as the kernel counts them; `k` in 1..=8).
fn parts(d: i32, f: i32, k: i32, r: i32) -> (i64, i64) {
    let (w, k64, r) = (warps(r) as i64, k as i64, r as i64);
    let gate_up = k64 * ((f as i64 + w * r - 1) / (w * r));
    let per = w / k64 * r;
    (gate_up, (d as i64 + per - 1) / per)
}

/// The blocks of one launch: the router's, the gate/up rows', the down
/// columns'.
fn blocks(d: i32, f: i32, k: i32, r: i32) -> i64 {
    let (gate_up, down) = parts(d, f, k, r);
    1 + gate_up + down
}

/// Whether [`forward`] serves the pending norm `n` (one row) through the
/// quantized gate `g` and the experts `gu` / `down` with `k` experts a
/// row: on ([`enabled`]), on CUDA, where the router + norm fold and the
/// experts' kernels serve these operands (their own conditions: the row's
/// width and dtype, the specifications, the shapes), with eps and the
/// route's scale compiled in (`MLX_LFM_EPS_CONST`, the default), both
/// expert stacks of one specification, and the staged rows within shared
/// memory.
pub fn available(n: &NormIn, g: &Quantized, gu: &Quantized, down: &Quantized, k: usize) -> bool {
    enabled() && served(n, g, gu, down, k) && kernel(false, rows_a_warp() > 1).is_some()
}

/// [`available`] but for the switch and the kernel: whether the layer's
/// stages serve these operands (also what src/kernels/conv_layer_fused.rs
/// asks of a conv layer's MoE).
pub(crate) fn served(n: &NormIn, g: &Quantized, gu: &Quantized, down: &Quantized, k: usize) -> bool {
    if !cuda_kernels_enabled() || n.h.ndim() != 2 || n.h.dim(0) != 1 || !super::add_rms_norm::eps_const() {
        return false;
    }
    if !(1..=ROUTE_SLOTS as usize).contains(&k) || gu.spec != down.spec || gu.weight.ndim() != 3 || down.weight.ndim() != 3 {
        return false;
    }
    let (d, dt) = (n.h.dim(1), n.h.dtype());
    let width = |q: &Quantized| q.weight.dim(2) as i64 * 32 / q.spec.bits as i64;
    let f = width(down);
    let bytes = |len: i64| len as usize * dt.size();
    moe_router::gate_norm_available(n, g, k)
        && moe_experts::available(1, k, dt, gu, down)
        // (The kernel takes the row's width for the down stack's rows and
        // the gate/up stack's inputs.)
        && width(gu) == d as i64
        && down.weight.dim(1) == d
        && f <= MAX_F
        && bytes(d as i64) % 16 == 0
        && bytes(f) % 16 == 0
        && bytes(d as i64).max(bytes(k as i64 * f)) <= stages::MAX_STAGED
}

/// The residual sum `s = h + r` and the layer's output (before a tensor
/// parallel reduce), both `[1, D]`, in one launch (callers check
/// [`available`]): `bias` the router's selection bias `[E]` float32, `eps`
/// and `scale` the norm's eps and the route's scale, `state` the layer's
/// own (`stages::new_counters`).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    n: &NormIn,
    g: &Quantized,
    bias: &Array,
    gu: &Quantized,
    down: &Quantized,
    state: &Array,
    k: usize,
    norm: bool,
    eps: f32,
    scale: f32,
) -> Result<(Array, Array)> {
    let mut outs = launch(n, g, bias, gu, down, state, k, norm, eps, scale, false)?;
    let out = outs.pop().ok_or_else(|| Error::mlx("fused MoE kernel: missing output"))?;
    let s = outs.pop().ok_or_else(|| Error::mlx("fused MoE kernel: missing output"))?;
    Ok((s, out))
}

/// [`forward`]'s layer output through the kernel's timeline form (the
/// bench's: `stages::TIMELINE_HEADER`), with its stamps `[NB * 4]` int64
/// and the parts' bounds: the gate/up blocks are parts `1..=gate_up`, the
/// down blocks `gate_up + 1..nb`.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn forward_timeline(
    n: &NormIn,
    g: &Quantized,
    bias: &Array,
    gu: &Quantized,
    down: &Quantized,
    state: &Array,
    k: usize,
    norm: bool,
    eps: f32,
    scale: f32,
) -> Result<(Array, Array, usize, usize)> {
    let mut outs = launch(n, g, bias, gu, down, state, k, norm, eps, scale, true)?;
    let times = outs.pop().ok_or_else(|| Error::mlx("fused MoE kernel: missing output"))?;
    let (d, f, r) = (n.h.dim(1), gu.weight.dim(1) / 2, rows_a_warp());
    let (gate_up, down) = parts(d, f, k as i32, r);
    Ok((outs.swap_remove(1), times, gate_up as usize, (1 + gate_up + down) as usize))
}

/// The kernel's timeline form (outputs as [`kernel`]'s, then `times`), of
/// the default or the `wide` form.
fn timeline_kernel(wide: bool) -> Option<&'static CudaKernel> {
    static K: [Cells; 2] = [stages::cells(), stages::cells()];
    static SOURCES: [OnceLock<Option<String>>; 2] = [OnceLock::new(), OnceLock::new()];
    let source = SOURCES[usize::from(wide)]
        .get_or_init(|| {
            let body = if wide { wide_source()? } else { stages::LAYER_SOURCE.to_string() };
            Some(super::substituted(&body, &stages::TIMELINE_SUBSTITUTIONS))
        })
        .as_deref()?;
    let outputs = ["s", "out", "yn", "inds", "scores", "hk", "times"];
    let name = if wide { "lfm_moe_fused_wide_timeline" } else { "lfm_moe_fused_timeline" };
    let head = move || format!("{}{}{}", stages::TIMELINE_HEADER, if wide { stages::PREFETCH_HEADER } else { "" }, header());
    stages::kernel(&K[usize::from(wide)], name, &INPUTS, &outputs, source, head)
}

/// The launch: `[s, out]`, or (`timeline`) every output of the timeline
/// form, its stamps last.
#[allow(clippy::too_many_arguments)]
fn launch(
    n: &NormIn,
    g: &Quantized,
    bias: &Array,
    gu: &Quantized,
    down: &Quantized,
    state: &Array,
    k: usize,
    norm: bool,
    eps: f32,
    scale: f32,
    timeline: bool,
) -> Result<Vec<Array>> {
    let unavailable = || Error::mlx("the fused MoE kernel is not available");
    let r = rows_a_warp();
    let wide = r > 1;
    let kern = if timeline { timeline_kernel(wide) } else { kernel(false, wide) }.ok_or_else(unavailable)?;
    let missing = |what: &str| Error::invalid(format!("the fused MoE kernel needs affine biases ({what})"));
    let gb = g.biases.as_ref().ok_or_else(|| missing("the router gate"))?;
    let ub = gu.biases.as_ref().ok_or_else(|| missing("the experts' gate/up"))?;
    let db = down.biases.as_ref().ok_or_else(|| missing("the experts' down"))?;
    stages::check_state(state, "the fused MoE kernel")?;
    if !(1..=ROUTE_SLOTS as usize).contains(&k) {
        return Err(Error::invalid(format!("the fused MoE kernel: {k} experts a row (1 to {ROUTE_SLOTS} are served)")));
    }
    let (d, dt) = (n.h.dim(1), n.h.dtype());
    let (e, f) = (g.weight.dim(0), gu.weight.dim(1) / 2);
    let k = k as i32;
    let nb = blocks(d, f, k, r);
    let threads = warps(r) * 32;
    let grid = i32::try_from(nb * threads as i64).map_err(|_| Error::invalid(format!("fused MoE kernel: {nb} blocks")))?;
    let template = [
        ("T", TemplateArg::Dtype(dt)),
        ("D", TemplateArg::Int(d)),
        ("F", TemplateArg::Int(f)),
        ("E", TemplateArg::Int(e)),
        ("TOPK", TemplateArg::Int(k)),
        ("NORM", TemplateArg::Bool(norm)),
        ("GBITS", TemplateArg::Int(g.spec.bits)),
        ("GGS", TemplateArg::Int(g.spec.group_size)),
        ("BITS", TemplateArg::Int(gu.spec.bits)),
        ("GS", TemplateArg::Int(gu.spec.group_size)),
        ("WARPS", TemplateArg::Int(warps(r))),
        ("EPS_BITS", TemplateArg::Int(eps.to_bits() as i32)),
        ("SCALE_BITS", TemplateArg::Int(scale.to_bits() as i32)),
    ];
    // (RPW only in the wide form, so the default's text and values stay
    // those its tests passed with.)
    let template: Vec<(&str, TemplateArg)> = template.into_iter().chain(wide.then_some(("RPW", TemplateArg::Int(r)))).collect();
    let inputs = [n.h, n.r, n.wn, &g.weight, &g.scales, gb, bias, &gu.weight, &gu.scales, ub, &down.weight, &down.scales, db, state];
    let outputs: [(&[i32], Dtype); 6] = [
        (&[1, d], dt),
        (&[1, d], dt),
        (&[d], dt),
        (&[ROUTE_SLOTS], Dtype::Uint32),
        (&[ROUTE_SLOTS], Dtype::Float32),
        (&[k, f], dt),
    ];
    let outs = if timeline {
        let stamps = i32::try_from(nb * 4).map_err(|_| Error::invalid(format!("fused MoE kernel: {nb} blocks")))?;
        let stamp_shape = [stamps];
        let mut all = outputs.to_vec();
        all.push((&stamp_shape, Dtype::Int64));
        kern.call(&inputs, &all, [grid, 1, 1], [threads, 1, 1], &template)?
    } else {
        stages::call_with_scratch(
            kern,
            || kernel(true, wide),
            &inputs,
            &outputs,
            &["SCR_YN", "SCR_INDS", "SCR_SCORES", "SCR_HK"],
            state,
            [grid, 1, 1],
            [threads, 1, 1],
            &template,
        )?
    };
    if !timeline {
        BUILT.bump();
    }
    Ok(outs)
}

#[cfg(test)]
pub(crate) fn launch_blocks(d: i32, f: i32, k: i32) -> i64 {
    blocks(d, f, k, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The wide form's text: its experts' part in place of the default's,
    /// its counts over RPW, the router's gate asked of L2, and every
    /// timeline stamp still finding its place; its blocks on the 8B-A1B at
    /// 4 rows a warp fewer than the 264 of 512 threads the H100's and
    /// H200's 132 SMs hold at its registers.
    #[test]
    fn the_wide_form_replaces_the_experts_stages() {
        let wide = wide_source().expect("the wide form's pieces are in LAYER_SOURCE");
        assert!(!wide.contains(WIDE_FROM) && wide.contains(WIDE_EXPERTS));
        for (was, now) in WIDE_SUBSTITUTIONS {
            assert!(!wide.contains(was) && wide.contains(now), "{was:?}");
        }
        // (The MoE part's stages end where the feed-forward's begin.)
        assert!(wide.contains("#else\n  if (fr <= GB) {\n    // The gate's output j"));
        let stamped = crate::kernels::substituted(&wide, &stages::TIMELINE_SUBSTITUTIONS);
        assert_eq!(stamped.matches("LFM_STAMP").count(), 19);
        // (One row a warp: blocks of 32 warps; more: of 16.)
        assert_eq!(parts(2048, 1792, 4, 1), (224, 256));
        assert_eq!(parts(2048, 1792, 4, 4), (112, 128));
        assert_eq!(blocks(2048, 1792, 4, 4), 241);
        assert_eq!(blocks(2048, 1792, 4, 8), 121);
        assert_eq!(parts(2048, 256, 3, 8), (6, 52));
        assert_eq!(parts(1024, 256, 4, 2), (32, 128));
    }

    /// A MoE layer's state holds its scratch rows at either activation
    /// size (the 8B-A1B's: ~37 KB), and its rows sit where the kernel
    /// expects them in bf16 (nvrtc-check's `moe_fused.rs@scratch` takes
    /// these places).
    #[test]
    fn a_moe_state_holds_its_scratch_rows() {
        for (d, f, k) in [(2048, 1792, 4), (1536, 512, 3), (1024, 256, 8), (64, 32, 1)] {
            for elem in [2, 4] {
                let end = stages::scratch_places(&scratch_bytes(d, f, k, elem)).1;
                assert!(state_words(d as usize, f as usize, k as usize) as i64 * 4 >= end, "{d} {f} {k} ({elem}-byte)");
            }
        }
        assert!(state_words(2048, 1792, 4) * 4 < 40 * 1024);
        assert_eq!(stages::scratch_places(&scratch_bytes(2048, 1792, 4, 2)).0, vec![256, 4352, 4608, 4864]);
    }
}
