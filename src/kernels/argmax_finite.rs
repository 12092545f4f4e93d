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
//!
//! `MLX_LFM_ARGMAX_VEC=1` (opt-in, session 39): the same scan over 16-byte
//! chunks. Session 39's profile of the 1.2B's step put this kernel at
//! 12.6 µs a token for a 65,536-wide bf16 row (128 KB): each thread's 64
//! two-byte loads, one after another, each waiting on the one before.
//! Chunked, a thread has eight loads, issued four at a time, so the row's
//! reads overlap. Each thread walks its chunks in order and a chunk in
//! order, keeping the first maximum. Every value of a chunk follows every
//! value of the chunks before it, so the block's reduction still keeps the
//! first maximum of the row.
//! A row that does not start on a 16-byte boundary takes the scalar scan
//! (a [B, V] row-contiguous array whose V * size is not a multiple of 16);
//! so do the values past the last whole chunk.

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

/// The scan over 16-byte chunks (`MLX_LFM_ARGMAX_VEC`): every 1024th chunk
/// from the thread's own, then, as [`SOURCE`], every 1024th value past the
/// last whole chunk (all of them where the row is not on a boundary).
const VEC_SOURCE: &str = r#"
  const int row = blockIdx.x;
  const int tid = threadIdx.x;
  const int V = logits_shape[1];
  const T* x = logits + static_cast<size_t>(row) * V;
  constexpr int E = 16 / sizeof(T);
  float best = -__int_as_float(0x7f800000);
  int besti = 0x7fffffff;
  int bad = 0;
  const int chunks = (reinterpret_cast<unsigned long long>(x) & 15ull) == 0 ? V / E : 0;
  // Four chunks' loads issued before their values are read (ptxas left
  // to itself spread them between the compares).
  for (int c0 = tid; c0 < chunks; c0 += 4 * 1024) {
    uint4 w[4];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      if (c0 + u * 1024 < chunks) w[u] = reinterpret_cast<const uint4*>(x)[c0 + u * 1024];
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const int c = c0 + u * 1024;
      if (c >= chunks) break;
      const T* e = reinterpret_cast<const T*>(&w[u]);
#pragma unroll
      for (int j = 0; j < E; j++) {
        const float v = static_cast<float>(e[j]);
        if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) {
          bad = 1;
        } else if (v > best) {
          best = v;
          besti = c * E + j;
        }
      }
    }
  }
  for (int i = chunks * E + tid; i < V; i += 1024) {
    const float v = static_cast<float>(x[i]);
    if ((__float_as_uint(v) & 0x7f800000u) == 0x7f800000u) {
      bad = 1;
    } else if (v > best) {
      best = v;
      besti = i;
    }
  }
  lfm_argmax_block(best, besti, bad, token, finite, row);
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

/// The block's largest value and first index, written as the row's token
/// and flag (the chunked scan's; [`SOURCE`] does the same inline, which
/// keeps the default's SASS as its tests ran it: as a call ptxas gave it
/// 20 registers where it has 24).
const BLOCK_HEADER: &str = r#"
__device__ inline void lfm_argmax_block(float best, int besti, int bad, uint32_t* token, uint32_t* finite, int row) {
  lfm_warp_argmax(best, besti);
  __shared__ float sb[32];
  __shared__ int si[32];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
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
}
"#;

/// Whether the scan goes over 16-byte chunks (`MLX_LFM_ARGMAX_VEC=1`, or a
/// test's opt-in).
fn vectorized() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_in("MLX_LFM_ARGMAX_VEC", &ON)
}

fn kernel() -> Option<&'static CudaKernel> {
    static K: [OnceLock<Option<CudaKernel>>; 2] = [OnceLock::new(), OnceLock::new()];
    let (i, name, source) = if vectorized() { (1, "lfm_argmax_finite_vec", VEC_SOURCE) } else { (0, "lfm_argmax_finite", SOURCE) };
    K[i].get_or_init(|| {
        let header = if i == 1 { format!("{HEADER}{BLOCK_HEADER}") } else { HEADER.to_string() };
        CudaKernel::new(name, &["logits"], &["token", "finite"], source, &header).ok()
    })
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
