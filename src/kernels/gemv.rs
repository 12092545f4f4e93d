//! `x @ w.T` for a decode step's few rows (`x` `[.., K]` with at most 8 rows,
//! `w` a dense `[N, K]` projection): one warp per output column reads its
//! row of `w` with 16-byte loads, all of them issued before the first is
//! summed (K is a compile-time constant, so the loop unrolls), and applies
//! it to every row of `x`. By the H200 profile MLX's `gemv_single` is 60% of
//! the 1.2B's decode GPU time, at ~3 TB/s over all projections and ~0.5 TB/s
//! on the small ones.
//!
//! Opt-in (`MLX_LFM_GEMV_KERNEL=1`) until it has run on a GPU: its test and
//! the A/B against MLX's GEMV are in `src/kernels/tests.rs` and
//! `bench/h200/run.py ab`. Rounding as MLX's GEMV: products summed in
//! float32, rounded to the model dtype once.

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use std::sync::OnceLock;

const THREADS: i32 = 256;
/// Rows of `x` one launch serves (a batch of more decodes with MLX's GEMM).
/// Each row count is its own compiled kernel (M is a template constant):
/// the first step at a new batch size pays one NVRTC compile, cached on disk.
pub const MAX_ROWS: usize = 8;

/// 16 bytes of a row: one vector load where `x` and `w` start on 16-byte
/// boundaries (every row does then: K is a multiple of 8), element by
/// element where one does not (a view MLX passes with its offset).
const HEADER: &str = "
template <typename U>
__device__ inline uint4 lfm_load16(const U* base, size_t c, bool aligned) {
  if (aligned) return reinterpret_cast<const uint4*>(base)[c];
  uint4 r;
  U* e = reinterpret_cast<U*>(&r);
  for (int j = 0; j < 16 / (int)sizeof(U); j++) e[j] = base[c * (16 / sizeof(U)) + j];
  return r;
}
";

const SOURCE: &str = r#"
  constexpr int E = 16 / sizeof(T);
  constexpr int C = K / E;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int N = w_shape[0];
  const int n = blockIdx.x * (256 / 32) + warp;
  if (n >= N) return;
  const bool aligned = ((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(w)) & 15) == 0;
  const T* wr = w + static_cast<size_t>(n) * K;
  float acc[M];
#pragma unroll
  for (int m = 0; m < M; m++) acc[m] = 0.0f;
  // A constant trip count (K is a template constant), so the loads of
  // several iterations are issued before their sums.
  constexpr int IT = (C + 31) / 32;
#pragma unroll 8
  for (int i = 0; i < IT; i++) {
    const int c = lane + i * 32;
    if (C % 32 != 0 && c >= C) break;
    const uint4 wv = lfm_load16(wr, c, aligned);
    const T* we = reinterpret_cast<const T*>(&wv);
#pragma unroll
    for (int m = 0; m < M; m++) {
      const uint4 xv = lfm_load16(x + static_cast<size_t>(m) * K, c, aligned);
      const T* xe = reinterpret_cast<const T*>(&xv);
#pragma unroll
      for (int j = 0; j < E; j++) acc[m] += static_cast<float>(we[j]) * static_cast<float>(xe[j]);
    }
  }
#pragma unroll
  for (int m = 0; m < M; m++) {
    float s = acc[m];
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
    if (lane == 0) y[static_cast<size_t>(m) * N + n] = T(s);
  }
"#;

/// The MLP's `silu(x @ w1.T) * (x @ w3.T)` from the stacked `[w1; w3]`
/// (`[2F, K]`): a warp reads row n of each half and writes the gated value,
/// so the `[.., 2F]` projection is never written and the gate is not a
/// kernel of its own. Rounded as the stock ops round: each projection to
/// the dtype, then each step of MLX's sigmoid, `g * sigmoid(g)` and the
/// product.
const SWIGLU_SOURCE: &str = r#"
  constexpr int E = 16 / sizeof(T);
  constexpr int C = K / E;
  constexpr int IT = (C + 31) / 32;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int F = w_shape[0] / 2;
  const int n = blockIdx.x * (256 / 32) + warp;
  if (n >= F) return;
  const bool aligned = ((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(w)) & 15) == 0;
  const T* gr = w + static_cast<size_t>(n) * K;
  const T* ur = w + static_cast<size_t>(F + n) * K;
  float ag[M];
  float au[M];
#pragma unroll
  for (int m = 0; m < M; m++) { ag[m] = 0.0f; au[m] = 0.0f; }
#pragma unroll 4
  for (int i = 0; i < IT; i++) {
    const int c = lane + i * 32;
    if (C % 32 != 0 && c >= C) break;
    const uint4 gv = lfm_load16(gr, c, aligned);
    const uint4 uv = lfm_load16(ur, c, aligned);
    const T* ge = reinterpret_cast<const T*>(&gv);
    const T* ue = reinterpret_cast<const T*>(&uv);
#pragma unroll
    for (int m = 0; m < M; m++) {
      const uint4 xv = lfm_load16(x + static_cast<size_t>(m) * K, c, aligned);
      const T* xe = reinterpret_cast<const T*>(&xv);
#pragma unroll
      for (int j = 0; j < E; j++) {
        const float xf = static_cast<float>(xe[j]);
        ag[m] += static_cast<float>(ge[j]) * xf;
        au[m] += static_cast<float>(ue[j]) * xf;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < M; m++) {
    float g = ag[m];
    float u = au[m];
    for (int off = 16; off > 0; off >>= 1) {
      g += __shfl_xor_sync(0xffffffff, g, off);
      u += __shfl_xor_sync(0xffffffff, u, off);
    }
    if (lane == 0) {
      // MLX's CUDA sigmoid, each step in T: y = 1 / (1 + exp(|x|)),
      // x < 0 ? y : 1 - y; then silu = x * sigmoid(x), times u.
      const float gt = static_cast<float>(T(g));
      const float ex = static_cast<float>(T(expf(fabsf(gt))));
      const float yv = static_cast<float>(T(1.0f / static_cast<float>(T(1.0f + ex))));
      const float sig = gt < 0.0f ? yv : static_cast<float>(T(1.0f - yv));
      const float a = static_cast<float>(T(gt * sig));
      y[static_cast<size_t>(m) * F + n] = T(a * static_cast<float>(T(u)));
    }
  }
"#;

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_gemv", &["x", "w"], &["y"], SOURCE, HEADER).ok()).as_ref()
}

fn swiglu_kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_gemv_swiglu", &["x", "w"], &["y"], SWIGLU_SOURCE, HEADER).ok()).as_ref()
}

thread_local! {
    static FORCED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` with the kernel on on this thread without the environment
/// variable (the kernel tests; other tests in the process keep the default).
pub fn with_forced<R>(f: impl FnOnce() -> R) -> R {
    let before = FORCED.with(|c| c.replace(true));
    let r = f();
    FORCED.with(|c| c.set(before));
    r
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    FORCED.with(|c| c.get()) || *ON.get_or_init(|| std::env::var("MLX_LFM_GEMV_KERNEL").ok().as_deref() == Some("1"))
}

/// Whether the kernel serves `x @ w.T`: on, on CUDA, float `x` and `w` of one
/// dtype, `w` 2-D `[N, K]` with K a multiple of 8 (whole 16-byte loads) and
/// at most 16,384, `x` `[.., K]` with 1 to [`MAX_ROWS`] rows.
pub fn available(x: &Array, w: &Array) -> bool {
    if !enabled() || !cuda_kernels_enabled() {
        return false;
    }
    let dt = x.dtype();
    if !dt.is_float() || dt == Dtype::Float64 || w.dtype() != dt || w.ndim() != 2 || x.ndim() < 1 {
        return false;
    }
    let k = w.dim(1);
    let rows = if x.dim(-1) > 0 { x.size() / x.dim(-1) as usize } else { 0 };
    x.dim(-1) == k && k > 0 && k % 8 == 0 && k <= 16_384 && w.dim(0) > 0 && (1..=MAX_ROWS).contains(&rows) && kernel().is_some()
}

/// Whether [`gemv_swiglu`] serves `x` and the stacked `w`.
pub fn swiglu_available(x: &Array, w: &Array) -> bool {
    available(x, w) && w.dim(0) % 2 == 0 && swiglu_kernel().is_some()
}

/// `silu(x @ w[..F].T) * (x @ w[F..].T)` for a stacked `[2F, K]` `w`
/// (callers check [`swiglu_available`] and that the halves are equal).
pub fn gemv_swiglu(x: &Array, w: &Array) -> Result<Array> {
    let kern = swiglu_kernel().ok_or_else(|| Error::mlx("the GEMV + SwiGLU kernel is not available"))?;
    let n2 = w.dim(0);
    if n2 % 2 != 0 {
        return Err(Error::invalid(format!("GEMV + SwiGLU: the stacked weight has an odd number of rows ({n2})")));
    }
    launch(kern, x, w, n2 / 2)
}

/// `x @ w.T` through the kernel (callers check [`available`] first).
pub fn gemv(x: &Array, w: &Array) -> Result<Array> {
    let kern = kernel().ok_or_else(|| Error::mlx("the GEMV kernel is not available"))?;
    launch(kern, x, w, w.dim(0))
}

/// A warp for each of `cols` output columns; the output is `x`'s shape with
/// `cols` as its last axis.
fn launch(kern: &CudaKernel, x: &Array, w: &Array, cols: i32) -> Result<Array> {
    let k = w.dim(1);
    let rows = x.size() / k as usize;
    let per_block = THREADS / 32;
    let blocks = (cols + per_block - 1) / per_block;
    let grid = blocks.checked_mul(THREADS).ok_or_else(|| Error::invalid("too many output columns for the GEMV kernel"))?;
    let mut shape = x.shape();
    *shape.last_mut().ok_or_else(|| Error::invalid("GEMV of a scalar"))? = cols;
    let mut outs = kern.call(
        &[x, w],
        &[(&shape, x.dtype())],
        [grid, 1, 1],
        [THREADS, 1, 1],
        &[("K", TemplateArg::Int(k)), ("M", TemplateArg::Int(rows as i32)), ("T", TemplateArg::Dtype(x.dtype()))],
    )?;
    outs.pop().ok_or_else(|| Error::mlx("GEMV kernel: missing output"))
}
