//! A greedy draw and its finiteness flag in one kernel. The stock graph
//! takes the row's argmax (ArgReduce, then a Squeeze) and, for the check
//! that the model's logits are finite (`generate::sampler::finite_rows`),
//! a sum, a Squeeze, a subtraction, a comparison and a cast: five kernels
//! and two views each token, on a step whose host cost is ~6-10 µs a node
//! on the H200 (session 17).
//!
//! One block of 1024 threads a row: each thread scans every 1024th value,
//! keeping its first largest finite value and whether it saw a NaN or an
//! infinity; the warps, then the block, keep the larger value and on a tie
//! the lower index (the first maximum, as MLX's argmax). A row's flag is 1
//! when every value is finite; its token is then the argmax, and
//! otherwise unspecified (the caller fails the request on the flag).

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use std::sync::OnceLock;

const THREADS: i32 = 1024;

const SOURCE: &str = r#"
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int V = logits_shape[1];
  const T* x = logits + static_cast<size_t>(row) * V;
  float best = -__int_as_float(0x7f800000);
  int besti = 0x7fffffff;
  int bad = 0;
  for (int i = tid; i < V; i += 1024) {
    const float v = static_cast<float>(x[i]);
    // (Exponent bits all ones: an infinity or a NaN.)
    if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) {
      bad = 1;
    } else if (v > best) {
      best = v;
      besti = i;
    }
  }
  lfm_warp_argmax(best, besti);
  __shared__ float sb[32];
  __shared__ int si[32];
  const int warp = tid / 32;
  const int lane = tid % 32;
  if (lane == 0) {
    sb[warp] = best;
    si[warp] = besti;
  }
  const int any_bad = __syncthreads_or(bad);
  if (warp == 0) {
    best = sb[lane];
    besti = si[lane];
    lfm_warp_argmax(best, besti);
    if (lane == 0) {
      token[row] = static_cast<uint32_t>(besti == 0x7fffffff ? 0 : besti);
      finite[row] = any_bad ? 0u : 1u;
    }
  }
"#;

/// A warp's largest value and, on a tie, its lowest index, in every lane.
const HEADER: &str = r#"
__device__ inline void lfm_warp_argmax(float& best, int& besti) {
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) {
    const float ob = __shfl_xor_sync(0xffffffff, best, m);
    const int oi = __shfl_xor_sync(0xffffffff, besti, m);
    if (ob > best || (ob == best && oi < besti)) {
      best = ob;
      besti = oi;
    }
  }
}
"#;

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_argmax_finite", &["logits"], &["token", "finite"], SOURCE, HEADER).ok())
        .as_ref()
}

/// Whether the kernel serves `logits` (`[B, V]`, a float dtype) on CUDA:
/// a default there since session 18 (its test passed on the H200; paired
/// A/B decode 0.99x / 1.01x / 1.06x on the 350M / 1.2B / 8B-A1B, picked
/// under the decode-only rule; `MLX_LFM_ARGMAX_KERNEL=0` turns it off).
pub fn available(logits: &Array) -> bool {
    static ON: OnceLock<Option<bool>> = OnceLock::new();
    let dt = logits.dtype();
    super::cuda_default("MLX_LFM_ARGMAX_KERNEL", &ON)
        && cuda_kernels_enabled()
        && logits.ndim() == 2
        && logits.dim(0) > 0
        && logits.dim(1) > 0
        && dt.is_float()
        && dt != Dtype::Float64
        && kernel().is_some()
}

/// `(argmax, finite)` of each row of `logits`, both `[B]` uint32 (what
/// `argmax(-1)` and `sampler::finite_rows` give); None where the kernel
/// does not serve them.
pub fn argmax_finite(logits: &Array) -> Result<Option<(Array, Array)>> {
    if !available(logits) {
        return Ok(None);
    }
    let kern = kernel().ok_or_else(|| Error::mlx("the argmax kernel is not available"))?;
    let b = logits.dim(0);
    let mut outs = kern.call(
        &[logits],
        &[(&[b], Dtype::Uint32), (&[b], Dtype::Uint32)],
        [THREADS.checked_mul(b).ok_or_else(|| Error::invalid(format!("argmax: {b} rows")))?, 1, 1],
        [THREADS, 1, 1],
        &[("T", TemplateArg::Dtype(logits.dtype()))],
    )?;
    let missing = || Error::mlx("argmax kernel: missing output");
    let finite = outs.pop().ok_or_else(missing)?;
    let token = outs.pop().ok_or_else(missing)?;
    Ok(Some((token, finite)))
}
