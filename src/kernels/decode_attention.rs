//! Attention of one query token over a masked, fixed-size K/V buffer (the
//! decode step's shape on every path: flat, paged mirror, stacked batch) in
//! one kernel. MLX has no fused kernel for a boolean mask here and runs its
//! fallback: a scale multiply, a cuBLAS batched GEMM and its pointer setup,
//! the mask's select, a softmax and a batched GEMV, six launches per
//! attention layer and token.
//!
//! One block per (row, query head), 256 threads; a group of HD / 8 lanes
//! holds one position's key row (8 elements a lane), so a block scores
//! 2048 / HD positions at a time. Two passes over the keys (they stay in L2)
//! so the rounding is the fallback's: `q * scale` rounded to the model dtype,
//! each score rounded as the GEMM's output is, the softmax in float32 from
//! those and its probabilities rounded, then `sum p * v` in float32 rounded
//! once. Shapes come from MLX's shape arguments, so a cache growing by a
//! step does not compile a new kernel.

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{self, Array, Dtype, Mask};
use std::sync::OnceLock;

const THREADS: i32 = 256;

const SOURCE: &str = r#"
  constexpr int G = HD / 8;
  constexpr int GROUPS = 256 / G;
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int H = q_shape[1];
  const int KVH = k_shape[1];
  const int N = k_shape[2];
  const int MB = mask_shape[0];
  const int tid = threadIdx.x;
  const int grp = tid / G;
  const int lane = tid % G;
  const int warp = tid / 32;
  const float scale = __int_as_float(SCALE_BITS);
  const size_t head = static_cast<size_t>(b) * KVH + h / (H / KVH);
  const T* qp = q + (static_cast<size_t>(b) * H + h) * HD + lane * 8;
  const T* kp = k + head * N * HD + lane * 8;
  const T* vp = v + head * N * HD + lane * 8;
  const bool* mp = mask + static_cast<size_t>(MB == 1 ? 0 : b) * N;
  __shared__ float red[8];
  __shared__ float accs[GROUPS * HD];

  float qs[8];
  for (int i = 0; i < 8; i++) {
    qs[i] = static_cast<float>(T(static_cast<float>(qp[i]) * scale));
  }
  // Every lane of a warp runs the same iterations (the shuffles need them);
  // past the end a group re-reads the last row and ignores it.
  auto score = [&](int n) {
    const T* kr = kp + static_cast<size_t>(n < N ? n : N - 1) * HD;
    float s = 0.0f;
    for (int i = 0; i < 8; i++) {
      s += qs[i] * static_cast<float>(kr[i]);
    }
    for (int off = G / 2; off > 0; off >>= 1) {
      s += __shfl_xor_sync(0xffffffff, s, off);
    }
    return static_cast<float>(T(s));
  };
  auto block_reduce = [&](float x, bool is_max) {
    for (int off = 16; off > 0; off >>= 1) {
      const float y = __shfl_xor_sync(0xffffffff, x, off);
      x = is_max ? fmaxf(x, y) : x + y;
    }
    __syncthreads();
    if (tid % 32 == 0) red[warp] = x;
    __syncthreads();
    x = red[0];
    for (int w = 1; w < 8; w++) {
      x = is_max ? fmaxf(x, red[w]) : x + red[w];
    }
    return x;
  };

  const float neg_inf = -__int_as_float(0x7f800000);
  float m = neg_inf;
  for (int n0 = 0; n0 < N; n0 += GROUPS) {
    const int n = n0 + grp;
    const float s = score(n);
    if (n < N && mp[n]) m = fmaxf(m, s);
  }
  m = block_reduce(m, true);
  float l = 0.0f;
  for (int n0 = 0; n0 < N; n0 += GROUPS) {
    const int n = n0 + grp;
    const float s = score(n);
    if (lane == 0 && n < N && mp[n]) l += expf(s - m);
  }
  l = block_reduce(l, false);

  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  if (m != neg_inf) {
    for (int n0 = 0; n0 < N; n0 += GROUPS) {
      const int n = n0 + grp;
      const float s = score(n);
      if (n < N && mp[n]) {
        const float p = static_cast<float>(T(expf(s - m) / l));
        const T* vr = vp + static_cast<size_t>(n) * HD;
        for (int i = 0; i < 8; i++) {
          acc[i] += p * static_cast<float>(vr[i]);
        }
      }
    }
  }
  for (int i = 0; i < 8; i++) {
    accs[grp * HD + lane * 8 + i] = acc[i];
  }
  __syncthreads();
  if (tid < HD) {
    float o = 0.0f;
    for (int g = 0; g < GROUPS; g++) {
      o += accs[g * HD + tid];
    }
    out[(static_cast<size_t>(b) * H + h) * HD + tid] = T(o);
  }
"#;

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_decode_attention", &["q", "k", "v", "mask"], &["out"], SOURCE, "").ok())
        .as_ref()
}

/// Whether the kernel serves these operands: one query token, K and V of one
/// head size in {8, ..., 256} (a power of two), whole query heads per KV
/// head, a boolean mask `[1 or B, 1, 1, N]`.
pub fn available(q: &Array, k: &Array, v: &Array, mask: &Array) -> bool {
    // MLX_LFM_DECODE_ATTENTION_KERNEL=0 keeps this one kernel off (the A/B).
    static ON: OnceLock<bool> = OnceLock::new();
    if !*ON.get_or_init(|| std::env::var("MLX_LFM_DECODE_ATTENTION_KERNEL").ok().as_deref() != Some("0")) {
        return false;
    }
    let dt = q.dtype();
    if !cuda_kernels_enabled() || !dt.is_float() || dt == Dtype::Float64 {
        return false;
    }
    if q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4 || mask.ndim() != 4 {
        return false;
    }
    let (b, h, hd) = (q.dim(0), q.dim(1), q.dim(3));
    let (kvh, n) = (k.dim(1), k.dim(2));
    q.dim(2) == 1
        && k.dtype() == dt
        && v.dtype() == dt
        && k.shape() == v.shape()
        && k.dim(0) == b
        && k.dim(3) == hd
        && matches!(hd, 8 | 16 | 32 | 64 | 128 | 256)
        && kvh > 0
        && h % kvh == 0
        && n > 0
        && mask.dtype() == Dtype::Bool
        && (mask.dim(0) == 1 || mask.dim(0) == b)
        && mask.dim(1) == 1
        && mask.dim(2) == 1
        && mask.dim(3) == n
        && kernel().is_some()
}

/// `softmax(q k^T * scale, masked) v` for one query token: the kernel where
/// it serves, MLX's own sdpa elsewhere.
pub fn sdpa_masked(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Array) -> Result<Array> {
    if !available(q, k, v, mask) {
        return mlx::sdpa(q, k, v, scale, Mask::Array(mask));
    }
    let kern = kernel().ok_or_else(|| Error::mlx("the decode attention kernel is not available"))?;
    let (b, h, hd) = (q.dim(0), q.dim(1), q.dim(3));
    let gx = THREADS.checked_mul(h).ok_or_else(|| Error::invalid("too many heads for the decode attention kernel"))?;
    let mut outs = kern.call(
        &[q, k, v, mask],
        &[(&[b, h, 1, hd], q.dtype())],
        [gx, b, 1],
        [THREADS, 1, 1],
        &[
            ("HD", TemplateArg::Int(hd)),
            // A float constant as its bits: template arguments are integers.
            ("SCALE_BITS", TemplateArg::Int(scale.to_bits() as i32)),
            ("T", TemplateArg::Dtype(q.dtype())),
        ],
    )?;
    outs.pop().ok_or_else(|| Error::mlx("decode attention kernel: missing output"))
}
