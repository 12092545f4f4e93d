//! A lone sequence's short-conv layer in one launch over quantized
//! projections (`MLX_LFM_CONV_FUSED=1`, opt-in until its H200 test and
//! A/B): the residual add + RMSNorm before it, in_proj, the gated conv
//! step and out_proj, by default four launches (the add + RMSNorm kernel,
//! MLX's `qmv`, the short-conv kernel, MLX's `qmv`): 54 of the 8B-A1B's
//! ~200 nodes a step over its 18 conv layers.
//!
//! Stages handed on as in src/kernels/moe_fused.rs (read its note: a
//! block's ticket from the layer's counters gives its part and its launch,
//! a block waits only on smaller tickets, a wait past its bound poisons
//! the output instead of hanging, and a layer's launches must be ordered
//! by data): ticket 0 the add + RMSNorm, as the add + RMSNorm kernel's
//! block runs it (the same grouping of the sums: its bits); the next
//! tickets a warp a channel c, in_proj's rows c, C + c and 2C + c (B, C and
//! x) in MLX's own `qmv` arithmetic (src/kernels/quant_gemv.rs
//! `lfm_qdot_mlx`, the `MLX_LFM_QGEMV_EXACT` walk, held to MLX's one-row
//! products on the H200) and the conv step's arithmetic on them, as the
//! short-conv kernel does it (the state after the token written whole); the
//! last tickets a warp an output of out_proj, in the same arithmetic, once
//! every channel is done. So the layer's values are the stock path's where
//! the MLX walk gives MLX's bits; the test holds the sum to the bits and
//! the state and output within two roundings of the stock ops'. A stage
//! that gives up poisons the state after the token too (not only the
//! output), so that sequence's later steps stay NaN and fail the
//! finiteness check as well: no silently wrong state. Tests in
//! src/kernels/tests.rs.

use super::moe_fused::{new_state, TICKET_HEADER};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::{Normed, Quantized};
use std::sync::OnceLock;

/// Template constants: T, D (the row), C (the conv's channels), KEEP (the
/// state's positions), IBITS / IGS and OBITS / OGS (in_proj's and
/// out_proj's specifications), NBLK (the add + RMSNorm kernel's block for
/// this row), WARPS, EPS_BITS. `ctr`: the layer's counters (tickets, the
/// norm's launch mark, channel blocks done).
pub(crate) const SOURCE: &str = r#"
  constexpr int IB = (C + WARPS - 1) / WARPS;
  constexpr int OB = (D + WARPS - 1) / WARPS;
  constexpr int NB = 1 + IB + OB;
  constexpr int XR = D * sizeof(T) / 16;
  constexpr int CR = C * sizeof(T) / 16;
  __shared__ uint4 sm[XR > CR ? XR : CR];
  unsigned long long* st = reinterpret_cast<unsigned long long*>(const_cast<uint32_t*>(ctr));
  const int lane = threadIdx.x % 32;
  const int wid = threadIdx.x / 32;
  unsigned long long launch;
  const int role = lfm_take_part<NB>(st, launch);
  const float poison = __int_as_float(0x7fc00000);
  if (role == 0) {
    lfm_norm_stage<T, D, NBLK>(h, r, wn, __int_as_float(EPS_BITS), s, reinterpret_cast<T*>(sm), yn);
    lfm_release_mark(st + 1, launch + 1);
    return;
  }
  if (role <= IB) {
    // in_proj's three rows of channel c, then the conv step on them.
    const int c = (role - 1) * WARPS + wid;
    const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);
    if (!late) lfm_stage16(sm, yn, XR);
    __syncthreads();
    if (c < C) {
      constexpr int G = D / IGS;
      constexpr int WORDS = D * IBITS / 32;
      float sb = 0.0f;
      float sc = 0.0f;
      float sx = 0.0f;
      if (!late) {
        const T* xs = reinterpret_cast<const T*>(sm);
#pragma unroll
        for (int q = 0; q < 3; q++) {
          // (The three rows asked of L2 first: the second and third then
          // wait on L2, not DRAM.)
          const size_t row = static_cast<size_t>(q) * C + c;
          lfm_prefetch_lines<D * IBITS / 8>(iw + row * WORDS, lane);
          lfm_prefetch_lines<G * (int)sizeof(T)>(iscales + row * G, lane);
          lfm_prefetch_lines<G * (int)sizeof(T)>(ibiases + row * G, lane);
        }
        const size_t rb = c;
        const size_t rc = static_cast<size_t>(C) + c;
        const size_t rx = 2 * static_cast<size_t>(C) + c;
        sb = lfm_qdot_mlx<T, D, IBITS, IGS, true>(xs, iw + rb * WORDS, iscales + rb * G, ibiases + rb * G, lane);
        sc = lfm_qdot_mlx<T, D, IBITS, IGS, true>(xs, iw + rc * WORDS, iscales + rc * G, ibiases + rc * G, lane);
        sx = lfm_qdot_mlx<T, D, IBITS, IGS, true>(xs, iw + rx * WORDS, iscales + rx * G, ibiases + rx * G, lane);
      }
      if (lane == 0) {
        const T* wd = cw + static_cast<size_t>(c) * (KEEP + 1);
        float acc = 0.0f;
        for (int j = 0; j < KEEP; j++) {
          const T v = state[j * C + c];
          if (j > 0) next[(j - 1) * C + c] = late ? T(poison) : v;
          acc += static_cast<float>(wd[j]) * static_cast<float>(v);
        }
        const T bt = T(sb);
        const T ct = T(sc);
        const T xt = T(sx);
        const T bx = T(static_cast<float>(bt) * static_cast<float>(xt));
        next[(KEEP - 1) * C + c] = late ? T(poison) : bx;
        acc += static_cast<float>(wd[KEEP]) * static_cast<float>(bx);
        yc[c] = late ? T(poison) : T(static_cast<float>(ct) * static_cast<float>(T(acc)));
      }
    }
    lfm_release_count(st + 2);
    return;
  }
  // out_proj's output n, once every channel of the launch is done.
  const int n = (role - 1 - IB) * WARPS + wid;
  const bool late = lfm_block_wait(st + 2, (launch + 1) * IB, nullptr, 0);
  if (!late) lfm_stage16(sm, yc, CR);
  __syncthreads();
  if (n < D) {
    constexpr int G = C / OGS;
    constexpr int WORDS = C * OBITS / 32;
    float o = 0.0f;
    if (!late) {
      const size_t row = n;
      lfm_prefetch_lines<C * OBITS / 8>(ow + row * WORDS, lane);
      lfm_prefetch_lines<G * (int)sizeof(T)>(oscales + row * G, lane);
      lfm_prefetch_lines<G * (int)sizeof(T)>(obiases + row * G, lane);
      o = lfm_qdot_mlx<T, C, OBITS, OGS, true>(reinterpret_cast<const T*>(sm), ow + row * WORDS, oscales + row * G,
                                               obiases + row * G, lane);
    }
    if (lane == 0) out[n] = late ? T(poison) : T(o);
  }
"#;

/// Warps a block (a channel or an output each).
const WARPS: i32 = 32;
/// Shared memory the staged rows may take (48 KiB is the static limit).
const MAX_STAGED: usize = 32 * 1024;
/// The widest row and conv served: by ptxas (sm_90) the kernel stays
/// within the 64 registers a thread of 1,024 allow up to here (at most 54,
/// 4-bit bf16 rows of 4,096 to 8,192).
const MAX_WIDTH: i32 = 8192;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_in("MLX_LFM_CONV_FUSED", &ON)
}

static BUILT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many times [`forward`] has put the kernel into a graph in this
/// process: the greedy test's evidence that its runs took this path.
pub fn built() -> usize {
    BUILT.load(std::sync::atomic::Ordering::Relaxed)
}

fn kernel() -> Option<&'static CudaKernel> {
    static K: [super::add_rms_norm::Walks; 2] = [const { [const { OnceLock::new() }; 2] }; 2];
    let stuck = super::moe_fused::no_wait();
    super::add_rms_norm::for_walk(&K[usize::from(stuck)], || {
        let (name, define) = if stuck { ("lfm_conv_fused_no_wait", "#define LFM_SPIN_LIMIT 0\n") } else { ("lfm_conv_fused", "") };
        CudaKernel::new(
            &super::add_rms_norm::kernel_name(name),
            &["h", "r", "wn", "iw", "iscales", "ibiases", "state", "cw", "ow", "oscales", "obiases", "ctr"],
            &["s", "out", "next", "yn", "yc"],
            SOURCE,
            // (Two of MLX's tiles a batch, not four: the same sums, and
            // 44 registers a thread by ptxas, where four took 84, over the
            // 64 that a block of 1,024 threads allows.)
            &format!(
                "{define}#define LFM_NORM_IN_WIDER_BLOCK 1\n#define LFM_QMLX_TILES 2\n{}{}{TICKET_HEADER}",
                super::add_rms_norm::device_code(),
                super::quant_gemv::header()
            ),
        )
        .ok()
    })
}

/// The layer's counters ([`crate::kernels::moe_fused::new_state`]).
pub fn new_counters() -> Result<Array> {
    new_state()
}

/// The blocks of one launch: the norm's, the channels', out_proj's.
fn blocks(d: i32, c: i32) -> i64 {
    let w = WARPS as i64;
    1 + (c as i64 + w - 1) / w + (d as i64 + w - 1) / w
}

/// Whether the switch is on where our CUDA kernels run (what the layer
/// asks before it takes the conv state early).
pub fn enabled_here() -> bool {
    enabled() && cuda_kernels_enabled()
}

/// Whether [`forward`] serves the pending norm `x` (one row, with a
/// residual to add), the quantized in_proj `wi` (`[3C, D]`) and out_proj
/// `wo` (`[D, C]`), no biases, the conv state `state` (`[1, L - 1, C]`)
/// and weights `cw` (`[C, L]`): on ([`enabled`]), on CUDA, with eps
/// compiled in (`MLX_LFM_EPS_CONST`, the default), where the add + RMSNorm
/// kernel serves the row (the same block), specifications the MLX walk
/// serves, and the staged rows within shared memory.
pub fn available(x: &Normed, wi: &Quantized, wo: &Quantized, state: &Array, cw: &Array, has_bias: bool) -> bool {
    let Some(r) = x.r else { return false };
    if !enabled_here() || has_bias || !super::add_rms_norm::eps_const() || x.h.ndim() != 2 || x.h.dim(0) != 1 {
        return false;
    }
    if wi.weight.ndim() != 2 || wo.weight.ndim() != 2 || state.ndim() != 3 || cw.ndim() != 2 {
        return false;
    }
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let (c, l) = (cw.dim(0), cw.dim(1));
    let width = |q: &Quantized| q.weight.dim(1) as i64 * 32 / q.spec.bits as i64;
    let bytes = |len: i32| len as usize * dt.size();
    super::add_rms_norm::available(x.h, r, x.w)
        && super::quant_gemv::spec_served(wi, dt, d)
        && super::quant_gemv::spec_served(wo, dt, c)
        && width(wi) == d as i64
        && width(wo) == c as i64
        && wi.weight.dim(0) == 3 * c
        && wo.weight.dim(0) == d
        && wi.scales.shape() == [3 * c, d / wi.spec.group_size]
        && wo.scales.shape() == [d, c / wo.spec.group_size]
        && l >= 2
        && state.shape() == [1, l - 1, c]
        && state.dtype() == dt
        && cw.dtype() == dt
        && d <= MAX_WIDTH
        && c <= MAX_WIDTH
        && bytes(d) % 16 == 0
        && bytes(c) % 16 == 0
        && bytes(d).max(bytes(c)) <= MAX_STAGED
        && kernel().is_some()
}

/// `(the residual sum [1, D], out_proj's output [1, D] (before a tensor
/// parallel reduce), the state after the token [1, L - 1, C])` in one
/// launch (callers check [`available`]); `ctr` the layer's own
/// ([`new_counters`]).
pub fn forward(x: &Normed, wi: &Quantized, wo: &Quantized, state: &Array, cw: &Array, ctr: &Array) -> Result<(Array, Array, Array)> {
    let kern = kernel().ok_or_else(|| Error::mlx("the fused short-conv layer kernel is not available"))?;
    let r = x.r.ok_or_else(|| Error::invalid("the fused short-conv layer kernel needs a residual to add"))?;
    let missing = |what: &str| Error::invalid(format!("the fused short-conv layer kernel needs affine biases ({what})"));
    let ib = wi.biases.as_ref().ok_or_else(|| missing("in_proj"))?;
    let ob = wo.biases.as_ref().ok_or_else(|| missing("out_proj"))?;
    if ctr.dtype() != Dtype::Uint32 || ctr.size() != 8 {
        return Err(Error::invalid("the fused short-conv layer kernel's counters must be 8 uint32 (new_counters)"));
    }
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let (c, l) = (cw.dim(0), cw.dim(1));
    let nb = blocks(d, c);
    let threads = WARPS * 32;
    let grid = i32::try_from(nb * threads as i64).map_err(|_| Error::invalid(format!("fused short-conv layer kernel: {nb} blocks")))?;
    let template = [
        ("T", TemplateArg::Dtype(dt)),
        ("D", TemplateArg::Int(d)),
        ("C", TemplateArg::Int(c)),
        ("KEEP", TemplateArg::Int(l - 1)),
        ("IBITS", TemplateArg::Int(wi.spec.bits)),
        ("IGS", TemplateArg::Int(wi.spec.group_size)),
        ("OBITS", TemplateArg::Int(wo.spec.bits)),
        ("OGS", TemplateArg::Int(wo.spec.group_size)),
        ("NBLK", TemplateArg::Int(super::add_rms_norm::block_for(d, 16 / dt.size() as i32))),
        ("WARPS", TemplateArg::Int(WARPS)),
        ("EPS_BITS", TemplateArg::Int(x.eps.to_bits() as i32)),
    ];
    let mut outs = kern.call(
        &[x.h, r, x.w, &wi.weight, &wi.scales, ib, state, cw, &wo.weight, &wo.scales, ob, ctr],
        &[(&[1, d], dt), (&[1, d], dt), (&[1, l - 1, c], dt), (&[d], dt), (&[c], dt)],
        [grid, 1, 1],
        [threads, 1, 1],
        &template,
    )?;
    outs.truncate(3);
    BUILT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let missing = || Error::mlx("fused short-conv layer kernel: missing output");
    let next = outs.pop().ok_or_else(missing)?;
    let out = outs.pop().ok_or_else(missing)?;
    let s = outs.pop().ok_or_else(missing)?;
    Ok((s, out, next))
}

#[cfg(test)]
pub(crate) fn launch_blocks(d: i32, c: i32) -> i64 {
    blocks(d, c)
}
