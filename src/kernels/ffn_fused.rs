//! A lone sequence's dense feed-forward in one launch (`MLX_LFM_FFN_FUSED=1`,
//! opt-in until its H200 test and A/B): the residual add + RMSNorm before
//! it, the stacked w1/w3 with the SwiGLU gate, and w2; by default two or
//! three launches (the add + RMSNorm kernel or its fold into the SwiGLU
//! GEMV, the SwiGLU GEMV, MLX's GEMV of w2): 32 of the 1.2B's 138 nodes a
//! step over its 16 layers, 16 of the 350M's.
//!
//! Stages handed on as in src/kernels/moe_fused.rs (read its note: a
//! block's ticket from the layer's counters gives its part and its launch,
//! a block waits only on smaller tickets, a wait past its bound poisons
//! the output instead of hanging, and a layer's launches must be ordered
//! by data): ticket 0 the add + RMSNorm as the add + RMSNorm kernel's block
//! runs it (its bits); the next tickets a warp an output of the gate, its
//! w1 and w3 rows as the SwiGLU GEMV walks them (src/kernels/gemv.rs
//! `lfm_gemv_swiglu_warp`, MLX's `gemv_single` order, the gate rounded as
//! MLX's ops round it); the last tickets a warp an output of w2 as the
//! dense GEMV walks it (`lfm_gemv_warp`: MLX's one-row product to the bit
//! where MLX takes its GEMV, gates a multiple of 32 wide: every model's),
//! once every gate output is done. So the output is the stock path's bits
//! where it runs the add + RMSNorm kernel (the 1.2B's rows) and, by the
//! same sums grouped alike, where it folds the norm into the SwiGLU GEMV
//! (the 350M's); the test holds the sum to the bits and the output within
//! two roundings. With 16 warps a block, the 350M's w2 stage is 64 blocks
//! (MLX's GEMV spreads it over 128): what its A/B will show. Tests in
//! src/kernels/tests.rs.

use super::stages::{self, Built, Cells, TICKET_HEADER};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::Array;
use crate::model::linear::Normed;
use std::sync::OnceLock;

/// Template constants: T, D (the row), F (the gate's width), NBLK (the add +
/// RMSNorm kernel's block for this row), WARPS, EPS_BITS. `ctr`: the
/// layer's counters (tickets, the norm's launch mark, gate blocks done).
pub(crate) const SOURCE: &str = r#"
  constexpr int GB = (F + WARPS - 1) / WARPS;
  constexpr int OB = (D + WARPS - 1) / WARPS;
  constexpr int NB = 1 + GB + OB;
  constexpr int XR = D * sizeof(T) / 16;
  constexpr int HR = F * sizeof(T) / 16;
  __shared__ uint4 sm[XR > HR ? XR : HR];
  unsigned long long* st = reinterpret_cast<unsigned long long*>(const_cast<uint32_t*>(ctr));
  const int lane = threadIdx.x % 32;
  const int wid = threadIdx.x / 32;
  unsigned long long launch;
  const int role = lfm_take_part<NB>(st, launch);
  const T poison = T(__int_as_float(0x7fc00000));
  if (role == 0) {
    lfm_norm_stage<T, D, NBLK>(h, r, wn, __int_as_float(EPS_BITS), s, reinterpret_cast<T*>(sm), yn);
    lfm_release_mark(st + 1, launch + 1);
    return;
  }
  if (role <= GB) {
    // The gate's output j: w1's row j and w3's row F + j.
    const int j = (role - 1) * WARPS + wid;
    const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);
    if (!late) lfm_stage16(sm, yn, XR);
    __syncthreads();
    if (j < F) {
      if (!late) {
        lfm_gemv_swiglu_warp<T, D, 1>(reinterpret_cast<const T*>(sm), true, w13, lfm_aligned(w13), hk, F, j, lane);
      } else if (lane == 0) {
        hk[j] = poison;
      }
    }
    lfm_release_count(st + 2);
    return;
  }
  // w2's output n, once every gate output of the launch is done.
  const int n = (role - 1 - GB) * WARPS + wid;
  const bool late = lfm_block_wait(st + 2, (launch + 1) * GB, nullptr, 0);
  if (!late) lfm_stage16(sm, hk, HR);
  __syncthreads();
  if (n < D) {
    if (!late) {
      lfm_gemv_warp<T, F, 1>(reinterpret_cast<const T*>(sm), true, w2, lfm_aligned(w2), out, D, n, lane);
    } else if (lane == 0) {
      out[n] = poison;
    }
  }
"#;

/// Warps a block: 16, as the conv layer's (src/kernels/conv_fused.rs).
const WARPS: i32 = 16;
/// The widest row and gate served (by ptxas on sm_90 the kernel stays
/// within 64 registers a thread: `scripts/dev/nvrtc-check.py`).
const MAX_WIDTH: i32 = 16_384;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_in("MLX_LFM_FFN_FUSED", &ON)
}

static BUILT: Built = Built::new();

/// How many times [`forward`] has put the kernel into a graph in this
/// process: the greedy test's evidence that its runs took this path.
pub fn built() -> usize {
    BUILT.get()
}

fn kernel() -> Option<&'static CudaKernel> {
    static K: Cells = stages::cells();
    // (The dense GEMVs' default walk: no L2 prefetch.)
    stages::kernel(&K, "lfm_ffn_fused", &["h", "r", "wn", "w13", "w2", "ctr"], &["s", "out", "yn", "hk"], SOURCE, || {
        format!(
            "#define LFM_NORM_IN_WIDER_BLOCK 1\n#define LFM_DENSE_PREFETCH 0\n{}{}{TICKET_HEADER}",
            super::add_rms_norm::device_code(),
            super::gemv::header()
        )
    })
}

/// The blocks of one launch: the norm's, the gate's, w2's.
fn blocks(d: i32, f: i32) -> i64 {
    let w = WARPS as i64;
    1 + (f as i64 + w - 1) / w + (d as i64 + w - 1) / w
}

/// Whether [`forward`] serves the pending norm `x` (one row, with a
/// residual to add), the stacked dense w1/w3 `w13` (`[2F, D]`) and w2
/// (`[D, F]`), in the activations' dtype, no biases: on ([`enabled`]), on
/// CUDA, with eps compiled in (`MLX_LFM_EPS_CONST`, the default), where the
/// add + RMSNorm kernel serves the row with a block no wider than this
/// kernel's, and the staged rows within shared memory.
pub fn available(x: &Normed, w13: &Array, w2: &Array) -> bool {
    let Some(r) = x.r else { return false };
    if !enabled() || !cuda_kernels_enabled() || !super::add_rms_norm::eps_const() || x.h.ndim() != 2 || x.h.dim(0) != 1 {
        return false;
    }
    if w13.ndim() != 2 || w2.ndim() != 2 {
        return false;
    }
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let f = w2.dim(1);
    let bytes = |len: i32| len as usize * dt.size();
    super::add_rms_norm::available(x.h, r, x.w)
        && super::add_rms_norm::block_for(d, 16 / dt.size() as i32) <= WARPS * 32
        && w13.dtype() == dt
        && w2.dtype() == dt
        && f > 0
        && w13.shape() == [2 * f, d]
        && w2.dim(0) == d
        && d % 8 == 0
        && f % 8 == 0
        && d <= MAX_WIDTH
        && f <= MAX_WIDTH
        && bytes(d).max(bytes(f)) <= stages::MAX_STAGED
        && kernel().is_some()
}

/// `(the residual sum [1, D], w2's output [1, D] (before a tensor parallel
/// reduce))` in one launch (callers check [`available`]); `ctr` the
/// layer's own (`stages::new_counters`).
pub fn forward(x: &Normed, w13: &Array, w2: &Array, ctr: &Array) -> Result<(Array, Array)> {
    let kern = kernel().ok_or_else(|| Error::mlx("the fused feed-forward kernel is not available"))?;
    let r = x.r.ok_or_else(|| Error::invalid("the fused feed-forward kernel needs a residual to add"))?;
    stages::check_counters(ctr, "the fused feed-forward kernel")?;
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let f = w2.dim(1);
    let nb = blocks(d, f);
    let threads = WARPS * 32;
    let grid = i32::try_from(nb * threads as i64).map_err(|_| Error::invalid(format!("fused feed-forward kernel: {nb} blocks")))?;
    let template = [
        ("T", TemplateArg::Dtype(dt)),
        ("D", TemplateArg::Int(d)),
        ("F", TemplateArg::Int(f)),
        ("NBLK", TemplateArg::Int(super::add_rms_norm::block_for(d, 16 / dt.size() as i32))),
        ("WARPS", TemplateArg::Int(WARPS)),
        ("EPS_BITS", TemplateArg::Int(x.eps.to_bits() as i32)),
    ];
    let mut outs = kern.call(
        &[x.h, r, x.w, w13, w2, ctr],
        &[(&[1, d], dt), (&[1, d], dt), (&[d], dt), (&[f], dt)],
        [grid, 1, 1],
        [threads, 1, 1],
        &template,
    )?;
    outs.truncate(2);
    BUILT.bump();
    let missing = || Error::mlx("fused feed-forward kernel: missing output");
    let out = outs.pop().ok_or_else(missing)?;
    let s = outs.pop().ok_or_else(missing)?;
    Ok((s, out))
}

#[cfg(test)]
pub(crate) fn launch_blocks(d: i32, f: i32) -> i64 {
    blocks(d, f)
}
