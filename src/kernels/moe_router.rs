//! LFM2-MoE's router after the sigmoid, in one kernel: the selection-only
//! expert bias, top-k, the chosen experts' probabilities normalised and
//! scaled. The stock graph is ~9 launches per MoE layer after the sigmoid
//! (a cast, the bias add, an argpartition that MLX's CUDA backend runs as a
//! single-block sort, the gather, sum, add, divide, cast): ~200 small
//! kernels a token on the 8B-A1B. The sigmoid stays MLX's own op, so the
//! probabilities are bit for bit the stock path's.
//!
//! One warp per routed row: lane `l` holds experts `l, l + 32, ...`; k
//! rounds of a warp-wide arg-max pick the experts in descending order of
//! their selection score. Every step rounds to the model dtype where the
//! stock ops would (the probabilities, their sum, the quotient), so the
//! scores match the stock path's to the last bit or one rounding; the order
//! of the k experts may differ from argpartition's (it is unspecified
//! there), which only reorders a k-term sum (exact for k = 2; the stock
//! graph's bf16 sum of more terms may round in another order).

use super::quant_gemv::{quant_template, spec_served};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::Quantized;
use std::sync::OnceLock;

/// Experts per lane the kernel keeps in registers (so at most 128 experts).
const MAX_PER_LANE: i32 = 4;
const MAX_K: i32 = 8;

/// The top-k and the weights from a row's probabilities, one warp: shared
/// by the kernel that reads the probabilities and the one that computes
/// them from the gate (`prob_of(e)`: expert e's probability as a float).
const ROUTE_HEADER: &str = r#"
template <typename T, int E, int KT, bool NORM, typename P, typename BT, typename ST, typename OT>
__device__ inline void lfm_route_warp(P prob_of, const BT* bias, const ST* scale, uint32_t* inds, OT* scores, int row,
                                      int lane) {
  constexpr int PER = (E + 31) / 32;
  float sel[PER];
  float prob[PER];
  bool used[PER];
  for (int j = 0; j < PER; j++) {
    const int e = lane + 32 * j;
    if (e < E) {
      prob[j] = prob_of(e);
      sel[j] = prob[j] + static_cast<float>(bias[e]);
      used[j] = false;
    } else {
      prob[j] = 0.0f;
      sel[j] = -3.0e38f;
      used[j] = true;
    }
  }
  float picked[KT];
  int index[KT];
  for (int k = 0; k < KT; k++) {
    // No lane holding an unused expert yields none (bi stays NONE), so a
    // NaN or -inf score can never leave an out-of-range expert id.
    constexpr int NONE = 0x7fffffff;
    float best = 0.0f;
    int bi = NONE;
    float bp = 0.0f;
    for (int j = 0; j < PER; j++) {
      const int e = lane + 32 * j;
      if (!used[j] && (bi == NONE || sel[j] > best || (sel[j] == best && e < bi))) {
        best = sel[j];
        bi = e;
        bp = prob[j];
      }
    }
    for (int off = 16; off > 0; off >>= 1) {
      const float ob = __shfl_xor_sync(0xffffffffu, best, off);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, off);
      const float op = __shfl_xor_sync(0xffffffffu, bp, off);
      if (oi != NONE && (bi == NONE || ob > best || (ob == best && oi < bi))) {
        best = ob;
        bi = oi;
        bp = op;
      }
    }
    for (int j = 0; j < PER; j++) {
      if (lane + 32 * j == bi) used[j] = true;
    }
    picked[k] = bp;
    index[k] = bi;
  }
  if (lane == 0) {
    // The stock ops' arithmetic in T's own operators, as MLX's binary
    // kernels do it (`x / y` on bf16 is __hdiv: an approximate float
    // quotient rounded to bf16, which a float `/` rounded after does not
    // always equal), with their scalars made in T.
    T denom = T(1.0f);
    if (NORM) {
      float s = 0.0f;
      for (int k = 0; k < KT; k++) s += picked[k];
      denom = T(s) + T(1e-6f);
    }
    const T f = T(static_cast<float>(scale[0]));
    const bool scaled = static_cast<float>(f) != 1.0f;
    for (int k = 0; k < KT; k++) {
      T v = T(picked[k]);
      if (NORM) v = v / denom;
      if (scaled) v = v * f;
      inds[row * KT + k] = static_cast<uint32_t>(index[k]);
      scores[row * KT + k] = static_cast<OT>(v);
    }
  }
}
"#;

/// The gate kernels' shared part (after the quantized GEMV's helpers and
/// [`ROUTE_HEADER`]): each warp the dot of one expert's gate row with `xr`
/// at a time (float32 sums, rounded to T once), the logit's sigmoid as
/// MLX's Sigmoid functor computes it in T, then the route over the block's
/// probabilities (`probs_s`, shared). `al`: `xr` and `w` on 16-byte
/// boundaries.
const GATE_HEADER: &str = r#"
template <typename T, int D, int E, int BITS, int GS, int TOPK, bool NORM, int WARPS, typename BT, typename ST,
          typename OT>
__device__ inline void lfm_gate_route(const T* xr, bool al, const uint32_t* w, const T* scales, const T* biases,
                                      const BT* bias, const ST* scale, uint32_t* inds, OT* scores, float* probs_s,
                                      int row) {
  constexpr int G = D / GS;
  const int lane = threadIdx.x % 32;
  const int wid = threadIdx.x / 32;
  for (int e = wid; e < E; e += WARPS) {
    float acc = 0.0f;
    const uint32_t* wr = w + static_cast<size_t>(e) * (D * BITS / 32);
    if (al) {
      lfm_qdot_a<T, D, 1, BITS, GS, true>(xr, wr, scales + e * G, biases + e * G, lane, &acc);
    } else {
      lfm_qdot_a<T, D, 1, BITS, GS, false>(xr, wr, scales + e * G, biases + e * G, lane, &acc);
    }
    acc = lfm_warp_sum(acc);
    if (lane == 0) probs_s[e] = static_cast<float>(lfm_sigmoid_t<T>(T(acc)));
  }
  __syncthreads();
  if (wid == 0) {
    lfm_route_warp<T, E, TOPK, NORM>([&](int e) { return probs_s[e]; }, bias, scale, inds, scores, row, lane);
  }
}
"#;

/// One warp per routed row over the probabilities `[N, E]`.
const SOURCE: &str = r#"
  const int row = blockIdx.x;
  lfm_route_warp<T, E, K, NORM>([&](int e) { return static_cast<float>(probs[row * E + e]); }, bias, scale, inds,
                                scores, row, threadIdx.x);
"#;

/// The gate's quantized GEMV, its sigmoid and the route in one launch: one
/// block per row, each warp the dot of one expert's gate row at a time
/// (the quantized GEMV's helpers: float32 sums, rounded to T once), the
/// logit's sigmoid as MLX's Sigmoid functor computes it in T, then the
/// route as above over the block's probabilities.
const GATE_SOURCE: &str = r#"
  constexpr int WARPS = E < 32 ? E : 32;
  __shared__ float probs_s[E];
  const int row = blockIdx.x;
  const T* xr = x + static_cast<size_t>(row) * D;
  lfm_gate_route<T, D, E, BITS, GS, TOPK, NORM, WARPS>(xr, lfm_aligned(x) && lfm_aligned(w), w, scales, biases, bias, scale,
                                                      inds, scores, probs_s, row);
"#;

/// The layer's residual add and feed-forward RMSNorm folded in front of the
/// gate (one launch fewer a MoE layer and token: 22 on the 8B-A1B): the
/// block of 256 threads runs the add + RMSNorm of its row as the fused
/// kernel does at 256 threads (src/kernels/add_rms_norm.rs: the same
/// grouping of the sums, so `s` and `y` are that kernel's bits), writes
/// both (the experts read `y`), keeps `y` in shared memory and routes from
/// it as [`GATE_SOURCE`] does, a warp an expert at a time.
pub(crate) const GATE_NORM_SOURCE: &str = r#"
  // RW warps (a warp an expert, the gate kernel's own layout; 8 with
  // MLX_LFM_ROUTER_NORM_WIDE=0): the norm runs on the first 256 threads either way.
  constexpr int WARPS = RW;
  __shared__ uint4 ys_store[D * sizeof(T) / 16];
  __shared__ float probs_s[E];
  T* ys = reinterpret_cast<T*>(ys_store);
  const int row = blockIdx.x;
  {
    const size_t o = static_cast<size_t>(row) * D;
    if (lfm_aligned(h) && lfm_aligned(r) && lfm_aligned(wn) && lfm_aligned(s) && lfm_aligned(y)) {
      lfm_add_rms_row<T, D, 256, true>(h + o, r + o, wn, eps[0], s + o, ys);
    } else {
      lfm_add_rms_row<T, D, 256, false>(h + o, r + o, wn, eps[0], s + o, ys);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < D; i += 32 * RW) y[o + i] = ys[i];
  }
  lfm_gate_route<T, D, E, BITS, GS, TOPK, NORM, WARPS>(ys, lfm_aligned(w), w, scales, biases, bias, scale, inds, scores,
                                                      probs_s, row);
"#;

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_moe_router", &["probs", "bias", "scale"], &["inds", "scores"], SOURCE, ROUTE_HEADER).ok())
        .as_ref()
}

/// The router + norm kernel: reading eps and the route's scale from their
/// `[1]` arrays, or (`consts`, under `MLX_LFM_EPS_CONST=1`) with both
/// compiled in (`EPS_BITS`, `SCALE_BITS`; [`GATE_NORM_CONST_SUBSTITUTIONS`]).
/// MLX 0.32.4 keeps arrays of at most 8 bytes in a managed pool whose pages
/// the host writes each token (the position), and a read from it cost a
/// launch ~1.6 µs on the H200 (session 26's `kernel-bench`, 4.0 µs against
/// 2.3 from device memory); this kernel reads eps before its norm, on the
/// path of everything after, 22 times an 8B-A1B step. The same floats, so
/// the same bits (its test).
fn gate_norm_kernel(consts: bool) -> Option<&'static CudaKernel> {
    static K: [super::add_rms_norm::Walks; 2] = [const { [const { OnceLock::new() }; 2] }; 2];
    super::add_rms_norm::for_walk(&K[usize::from(consts)], || {
        let (name, source) = if consts {
            ("lfm_moe_router_gate_norm_c", super::substituted(GATE_NORM_SOURCE, &GATE_NORM_CONST_SUBSTITUTIONS))
        } else {
            ("lfm_moe_router_gate_norm", GATE_NORM_SOURCE.to_string())
        };
        CudaKernel::new(
            &super::add_rms_norm::kernel_name(name),
            &["h", "r", "wn", "eps", "w", "scales", "biases", "bias", "scale"],
            &["s", "y", "inds", "scores"],
            &source,
            &gate_norm_header(),
        )
        .ok()
    })
}

/// `GATE_NORM_SOURCE` with eps and the scale constants: the substitutions,
/// in order (scripts/dev/nvrtc-check.py makes the same ones).
pub(crate) const GATE_NORM_CONST_SUBSTITUTIONS: [(&str, &str); 3] = [
    ("eps[0]", "__int_as_float(EPS_BITS)"),
    ("bias, scale, inds", "bias, lfm_scale_c, inds"),
    ("  constexpr int WARPS = RW;", "  constexpr int WARPS = RW;\n  const float lfm_scale_c[1] = {__int_as_float(SCALE_BITS)};"),
];

/// The router + norm kernels' header (their block may be wider than the
/// norm's 256 threads).
pub(crate) fn gate_norm_header() -> String {
    format!(
        "#define LFM_NORM_IN_WIDER_BLOCK 1\n{}{}{ROUTE_HEADER}{GATE_HEADER}",
        super::add_rms_norm::device_code(),
        super::quant_gemv::header()
    )
}

fn gate_kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| {
        let header = format!("{}{ROUTE_HEADER}{GATE_HEADER}", super::quant_gemv::header());
        CudaKernel::new(
            "lfm_moe_router_gate",
            &["x", "w", "scales", "biases", "bias", "scale"],
            &["inds", "scores"],
            GATE_SOURCE,
            &header,
        )
        .ok()
    })
    .as_ref()
}

/// On by default since session 14 (the H200's paired A/B: 8B-A1B decode
/// +3%, five reps of five above 1.02; the greedy test kept the stock
/// tokens), `MLX_LFM_ROUTER_GATE_KERNEL=0` off.
fn gate_enabled() -> bool {
    static ON: OnceLock<Option<bool>> = OnceLock::new();
    super::cuda_default("MLX_LFM_ROUTER_GATE_KERNEL", &ON)
}

/// Rows the gate kernel serves (a decode step's; each block reads the
/// whole gate, which a prefill's many rows do better as one matmul).
pub const GATE_MAX_ROWS: i32 = 16;
/// The widest gate input the kernel serves (see [`gate_available`]).
const GATE_MAX_WIDTH: i32 = 8192;

/// Whether the fused router serves `experts` and `k` on this backend.
pub fn available(experts: usize, k: usize) -> bool {
    cuda_kernels_enabled() && experts as i32 <= 32 * MAX_PER_LANE && k as i32 <= MAX_K && k >= 1 && k <= experts && kernel().is_some()
}

/// `probs` `[N, E]` (the sigmoid of the gate's output, float dtype),
/// `bias` `[E]` float32 (zeros when the model has none), `scale` `[1]`
/// float32: the chosen experts `[N, k]` (uint32) and their weights `[N, k]`
/// in the probabilities' dtype.
pub fn route(probs: &Array, bias: &Array, scale: &Array, k: usize, norm: bool) -> Result<(Array, Array)> {
    let (n, e) = (probs.dim(0), probs.dim(1));
    if n == 0 {
        return Err(Error::invalid("the MoE router kernel takes at least one row"));
    }
    let kern = kernel().ok_or_else(|| Error::mlx("the fused MoE router kernel is not available"))?;
    let dt = probs.dtype();
    let k = k as i32;
    let shape = [n, k];
    let mut outs = kern.call(
        &[probs, bias, scale],
        &[(&shape, Dtype::Uint32), (&shape, dt)],
        [n.checked_mul(32).ok_or_else(|| Error::invalid("too many rows for the router kernel"))?, 1, 1],
        [32, 1, 1],
        &[("E", TemplateArg::Int(e)), ("K", TemplateArg::Int(k)), ("NORM", TemplateArg::Bool(norm)), ("T", TemplateArg::Dtype(dt))],
    )?;
    let scores = outs.pop().ok_or_else(|| Error::mlx("router kernel: missing output"))?;
    let inds = outs.pop().ok_or_else(|| Error::mlx("router kernel: missing output"))?;
    Ok((inds, scores))
}

/// Whether the gate kernel serves `n` rows `d` wide in dtype `dt` through
/// the quantized gate `q` `[E, d * bits / 32]` with `k` experts a row: on
/// ([`gate_enabled`]), on CUDA, 1 to [`GATE_MAX_ROWS`] rows
/// at most 8,192 wide, a specification the quantized GEMV's helpers serve.
pub fn gate_available(n: i32, d: i32, dt: Dtype, q: &Quantized, k: usize) -> bool {
    if !gate_enabled() || q.weight.ndim() != 2 {
        return false;
    }
    let e = q.weight.dim(0);
    available(e as usize, k)
        && (1..=GATE_MAX_ROWS).contains(&n)
        // A block is up to 1,024 threads (64 registers each at most); ptxas
        // needs more for float32 rows of 16,384 (fine at 8,192 and below).
        && d <= GATE_MAX_WIDTH
        && spec_served(q, dt, d)
        && q.weight.dim(1) as i64 * 32 == d as i64 * q.spec.bits as i64
        && q.scales.shape() == [e, d / q.spec.group_size]
        && gate_kernel().is_some()
}

/// The gate kernels' template constants: rows `d` wide in `dt` through
/// the gate `q`, `k` experts a row.
fn gate_template(q: &Quantized, d: i32, dt: Dtype, k: i32, norm: bool) -> Vec<(&'static str, TemplateArg)> {
    let mut template = quant_template(q, d, dt);
    // quant_template names the input width K; here K is not used (the
    // route's k is TOPK) and the width is D.
    template.retain(|(name, _)| *name != "K");
    template.extend([
        ("D", TemplateArg::Int(d)),
        ("E", TemplateArg::Int(q.weight.dim(0))),
        ("TOPK", TemplateArg::Int(k)),
        ("NORM", TemplateArg::Bool(norm)),
    ]);
    template
}

/// Warps of the router + norm kernel's block: a warp an expert as the gate
/// kernel has them, at least 8 (the norm runs on the first 256 threads),
/// or with `MLX_LFM_ROUTER_NORM_WIDE=0` 8 (256 threads, each warp four of
/// the 8B-A1B's 32 experts in turn). Session 22 timed the 8-warp kernel
/// at 1,587-1,674 us of GPU time a step against the defaults' 1,468-1,524
/// (the gate kernel runs 32 warps): the 22 launches it spares the host
/// came back as GPU time; a warp an expert won session 23's A/B.
pub(crate) fn gate_norm_warps(experts: i32) -> i32 {
    static WIDE: OnceLock<bool> = OnceLock::new();
    if crate::knobs::cached("MLX_LFM_ROUTER_NORM_WIDE", &WIDE, |v| v != Some("0")) {
        experts.clamp(8, 32)
    } else {
        8
    }
}

/// On by default where our CUDA kernels run since session 23: the H200's
/// paired A/B put the 8B-A1B's decode at 1.041x with a warp an expert
/// (six reps of six above 1.00; 1.056x with the shared-memory attention),
/// and its test gives the bits of the two launches it replaces (the add +
/// RMSNorm and router gate kernels, defaults since sessions 14 and 18),
/// so a model's tokens are theirs. (The greedy test's MoE fixture, 64
/// wide, takes another add + RMSNorm block and never reaches the fold.)
/// `MLX_LFM_ROUTER_NORM_KERNEL=0` off.
fn gate_norm_enabled() -> bool {
    static ON: OnceLock<Option<bool>> = OnceLock::new();
    super::cuda_default("MLX_LFM_ROUTER_NORM_KERNEL", &ON)
}

/// Whether [`route_gate_norm`] serves the pending norm `n` (its rows `[N,
/// D]`, one token each) through the quantized gate `q` with `k` experts a
/// row: on ([`gate_norm_enabled`]), where [`gate_available`] serves the
/// normed rows, the rows' width a whole number of 16-byte runs for which
/// the add + RMSNorm kernel also takes 256 threads (bf16 and f16 rows of
/// 1,032 to 2,048, float32 of 520 to 1,024: one run a thread).
pub fn gate_norm_available(n: &super::norm_gemv::NormIn, q: &Quantized, k: usize) -> bool {
    let (h, dt) = (n.h, n.h.dtype());
    if !gate_norm_enabled() || h.ndim() != 2 {
        return false;
    }
    let (rows, d) = (h.dim(0), h.dim(1));
    let run = 16 / dt.size() as i32;
    n.consistent()
        && d % run == 0
        // The fused add + RMSNorm kernel's own block for this row (its
        // sums grouped as this kernel's 256 threads group them: the same
        // bits); other widths and dtypes keep the two launches.
        && super::add_rms_norm::block_for(d, run) == 256
        && gate_available(rows, d, dt, q, k)
        && gate_norm_kernel(false).is_some()
}

/// The residual sum `s = h + r`, the norm `y = rms_norm(s) * wn` (both
/// `[N, D]`) and the route from `y` (as [`route_gate`] gives it) in one
/// launch (callers check [`gate_norm_available`]).
pub fn route_gate_norm(
    n: &super::norm_gemv::NormIn,
    q: &Quantized,
    bias: &Array,
    scale: &Array,
    k: usize,
    norm: bool,
    consts: Option<(f32, f32)>,
) -> Result<(Array, Array, Array, Array)> {
    // `consts`: eps's and the scale's values, taken as constants under
    // MLX_LFM_EPS_CONST=1 (they must be what `n.eps` and `scale` hold).
    let consts = consts.filter(|_| super::add_rms_norm::eps_const());
    let kern = gate_norm_kernel(consts.is_some()).ok_or_else(|| Error::mlx("the MoE router + norm kernel is not available"))?;
    let biases = q.biases.as_ref().ok_or_else(|| Error::invalid("the MoE router + norm kernel needs affine biases"))?;
    let (rows, d) = (n.h.dim(0), n.h.dim(1));
    let dt = n.h.dtype();
    let shape = [rows, k as i32];
    let score_dt = if scores_f32() { Dtype::Float32 } else { dt };
    let mut template = gate_template(q, d, dt, k as i32, norm);
    let warps = gate_norm_warps(q.weight.dim(0));
    template.push(("RW", TemplateArg::Int(warps)));
    if let Some((eps, scale)) = consts {
        template.push(("EPS_BITS", TemplateArg::Int(eps.to_bits() as i32)));
        template.push(("SCALE_BITS", TemplateArg::Int(scale.to_bits() as i32)));
    }
    let threads = 32 * warps;
    let mut outs = kern.call(
        &[n.h, n.r, n.wn, n.eps, &q.weight, &q.scales, biases, bias, scale],
        &[(&[rows, d], dt), (&[rows, d], dt), (&shape, Dtype::Uint32), (&shape, score_dt)],
        [rows.checked_mul(threads).ok_or_else(|| Error::invalid("too many rows for the router + norm kernel"))?, 1, 1],
        [threads, 1, 1],
        &template,
    )?;
    let missing = || Error::mlx("router + norm kernel: missing output");
    let scores = outs.pop().ok_or_else(missing)?;
    let inds = outs.pop().ok_or_else(missing)?;
    let y = outs.pop().ok_or_else(missing)?;
    let s = outs.pop().ok_or_else(missing)?;
    Ok((s, y, inds, scores))
}

/// `MLX_LFM_ROUTER_SCORES_F32=1` (opt-in until its H200 test and A/B): the
/// router + norm kernel writes the experts' weights as float32 (each
/// still rounded to the model dtype first, so the same values) for the
/// experts' down kernel to read. A decode row's four bf16 weights are 8
/// bytes, and MLX 0.32.4's CUDA allocator puts every array of at most 8
/// bytes, a kernel's output too, in its managed scalar pool, whose pages
/// the host writes each token (the position): session 27's ncu source
/// view of the down kernel (`run.py kernel-detail`, its kernel-bench arm,
/// whose weights are such an array too) had ~60% of its warps' stall
/// samples on the instruction waiting for that weight's load, in the
/// default kernel and in the one with every load first (32.1 and 25.5 µs
/// a launch there against MLX's `gather_qmv` at 13.4, which reads no
/// weight). In float32 the row's weights are 16 bytes: device memory.
pub fn scores_f32() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_in("MLX_LFM_ROUTER_SCORES_F32", &ON)
}

/// [`route`] from the gate's input `x` `[N, D]`: the gate `q` (quantized,
/// no bias), its sigmoid and the route in one launch (callers check
/// [`gate_available`]).
pub fn route_gate(x: &Array, q: &Quantized, bias: &Array, scale: &Array, k: usize, norm: bool) -> Result<(Array, Array)> {
    let kern = gate_kernel().ok_or_else(|| Error::mlx("the MoE router gate kernel is not available"))?;
    let biases = q.biases.as_ref().ok_or_else(|| Error::invalid("the MoE router gate kernel needs affine biases"))?;
    let (n, d, e) = (x.dim(0), x.dim(1), q.weight.dim(0));
    let dt = x.dtype();
    let k = k as i32;
    let shape = [n, k];
    let template = gate_template(q, d, dt, k, norm);
    let mut outs = kern.call(
        &[x, &q.weight, &q.scales, biases, bias, scale],
        &[(&shape, Dtype::Uint32), (&shape, dt)],
        [n.checked_mul(32 * e.min(32)).ok_or_else(|| Error::invalid("too many rows for the router gate kernel"))?, 1, 1],
        [32 * e.min(32), 1, 1],
        &template,
    )?;
    let scores = outs.pop().ok_or_else(|| Error::mlx("router gate kernel: missing output"))?;
    let inds = outs.pop().ok_or_else(|| Error::mlx("router gate kernel: missing output"))?;
    Ok((inds, scores))
}
