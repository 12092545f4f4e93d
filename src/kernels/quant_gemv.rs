//! `x @ dequantize(w).T` for a decode step's few rows over an MLX affine
//! quantized projection (4 or 8 bits, groups of 32, 64 or 128, scales and
//! biases in the activations' dtype). By the H200 profile the 8B-A1B's
//! quantized GEMVs (MLX's `qmv` and `gather_qmv`) are 45% of its decode GPU
//! time at 0.5-0.7 TB/s; this reads each weight row once with 16-byte loads,
//! one warp per output column, as the bf16 GEMV (src/kernels/gemv.rs) does.
//!
//! The arithmetic is MLX's own (`lfm_qdot`): the first version summed
//! `s * sum(q * x) + b * sum(x)` in float32, more exactly than MLX's 4-bit
//! kernels (which accumulate in bf16), and so differed from the stock ops
//! by 3-4 bf16 roundings on the H200, enough to change greedy tokens.
//!
//! Opt-in (`MLX_LFM_QGEMV_KERNEL=1`) until its A/B on the H200 says it wins;
//! its test is in src/kernels/tests.rs. The MoE experts' kernels
//! (src/kernels/moe_experts.rs) share this file's chunk helpers.

use super::gemv::HEADER as GEMV_HEADER;
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype, QuantMode, QuantSpec};
use crate::model::linear::Quantized;
use std::sync::OnceLock;

pub(crate) const THREADS: i32 = 256;
/// Rows of `x` one launch serves (more decode with MLX's quantized matmul).
pub const MAX_ROWS: usize = 8;

/// One lane's part of a quantized row's dot product, computed as MLX's own
/// CUDA `qmv`/`gather_qmv` compute it (mlx/backend/cuda/quantized/qmm/qmv.cu
/// in the MLX we link), so that our results equal the stock ops': each lane
/// takes EPT consecutive values per pass (16 for a 16-bit dtype at 4 bits,
/// else 8), dequantizes them in the dtype (`q * scale + bias`, each step
/// rounded), accumulates them per position in the dtype (at 8 bits, in
/// float32), then sums its EPT accumulators in float32; the warp's sum is a
/// cooperative-groups reduction, rounded to the dtype once. Rounding through
/// float32 where MLX uses a 16-bit intrinsic gives the same value (the
/// products of two 16-bit floats are exact in float32).
pub(crate) const QUANT_HEADER: &str = "
#include <cooperative_groups/reduce.h>
template <typename T, int K, int BITS, int GS>
__device__ inline float lfm_qdot(const T* x, bool xa, const uint32_t* wr, const T* sr, const T* br, int lane) {
  constexpr bool NARROW = sizeof(T) <= 2 && BITS <= 4;
  constexpr int EPT = NARROW ? 16 : 8;
  constexpr bool FACC = BITS >= 8 || sizeof(T) == 4;
  constexpr int PER = 32 * EPT;
  constexpr int FULL = K / PER;
  constexpr int REST = K % PER;
  constexpr int VPW = 32 / BITS;
  constexpr int WPL = EPT / VPW;
  constexpr int XC = EPT * sizeof(T) / 16;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  float accf[EPT];
  T acct[EPT];
#pragma unroll
  for (int i = 0; i < EPT; i++) { accf[i] = 0.0f; acct[i] = T(0.0f); }
  auto pass = [&](int idx) {
    const int g = idx / GS;
    const float s = static_cast<float>(sr[g]);
    const float b = static_cast<float>(br[g]);
    uint32_t wv[WPL];
#pragma unroll
    for (int j = 0; j < WPL; j++) wv[j] = wr[idx / VPW + j];
    uint4 xv[XC];
#pragma unroll
    for (int t = 0; t < XC; t++) xv[t] = lfm_load16(x, idx / (16 / sizeof(T)) + t, xa);
    const T* xe = reinterpret_cast<const T*>(xv);
#pragma unroll
    for (int i = 0; i < EPT; i++) {
      const float q = static_cast<float>((wv[i / VPW] >> (BITS * (i % VPW))) & MASK);
      float w;
      if constexpr (sizeof(T) == 4) {
        w = fmaf(q, s, b);
      } else {
        w = static_cast<float>(T(static_cast<float>(T(q * s)) + b));
      }
      if constexpr (FACC) {
        accf[i] = fmaf(static_cast<float>(xe[i]), w, accf[i]);
      } else {
        acct[i] = T(fmaf(static_cast<float>(xe[i]), w, static_cast<float>(acct[i])));
      }
    }
  };
#pragma unroll
  for (int r = 0; r < FULL; r++) pass(lane * EPT + r * PER);
  if constexpr (REST != 0) {
    const int idx = lane * EPT + K - REST;
    if (idx < K) pass(idx);
  }
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < EPT; i++) sum += FACC ? accf[i] : static_cast<float>(acct[i]);
  return sum;
}
// The warp's total of each lane's lfm_qdot, as MLX reduces it.
__device__ inline float lfm_qwarp_sum(float v) {
  namespace cgq = cooperative_groups;
  return cgq::reduce(cgq::tiled_partition<32>(cgq::this_thread_block()), v, cgq::plus<float>());
}
// Output column n (this warp's) of x @ dequantize(w).T for M rows.
template <typename T, int K, int M, int BITS, int GS>
__device__ inline void lfm_qgemv_warp(const T* x, bool xa, const uint32_t* w, const T* scales, const T* biases,
                                      T* y, int N, int n, int lane) {
  constexpr int G = K / GS;
  const uint32_t* wr = w + static_cast<size_t>(n) * (K * BITS / 32);
  const T* sr = scales + static_cast<size_t>(n) * G;
  const T* br = biases + static_cast<size_t>(n) * G;
#pragma unroll
  for (int m = 0; m < M; m++) {
    const float s = lfm_qwarp_sum(lfm_qdot<T, K, BITS, GS>(x + static_cast<size_t>(m) * K, xa, wr, sr, br, lane));
    if (lane == 0) y[static_cast<size_t>(m) * N + n] = T(s);
  }
}
";

/// Both headers, in the order the kernels need them.
pub(crate) fn header() -> String {
    format!("{GEMV_HEADER}{QUANT_HEADER}")
}

const SOURCE: &str = r#"
  const int N = w_shape[0];
  const int n = blockIdx.x * (256 / 32) + threadIdx.x / 32;
  if (n >= N) return;
  lfm_qgemv_warp<T, K, M, BITS, GS>(x, lfm_aligned(x), w, scales, biases, y, N, n, threadIdx.x % 32);
"#;

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_qgemv", &["x", "w", "scales", "biases"], &["y"], SOURCE, &header()).ok())
        .as_ref()
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_in("MLX_LFM_QGEMV_KERNEL", &ON)
}

/// Whether the chunk helpers serve this quantization for activations of
/// dtype `dt` and input width `k`: affine, 4 or 8 bits, groups of 32, 64
/// or 128 (a whole number of 16-byte chunks each), scales and biases in
/// `dt`, and `k` at most 16,384 (the unrolled loop's length).
pub(crate) fn spec_served(q: &Quantized, dt: Dtype, k: i32) -> bool {
    let QuantSpec { mode, bits, group_size } = q.spec;
    mode == QuantMode::Affine
        && matches!(bits, 4 | 8)
        && matches!(group_size, 32 | 64 | 128)
        && dt.is_float()
        && dt != Dtype::Float64
        && q.scales.dtype() == dt
        && q.biases.as_ref().is_some_and(|b| b.dtype() == dt)
        && q.weight.dtype() == Dtype::Uint32
        && k > 0
        && k % group_size == 0
        && k <= 16_384
}

/// Whether the kernel serves `x @ dequantize(q).T`: on, on CUDA, a 2-D
/// `[N, K * bits / 32]` weight, `x` `[.., K]` with 1 to [`MAX_ROWS`] rows.
pub fn available(x: &Array, q: &Quantized) -> bool {
    if !enabled() || !cuda_kernels_enabled() || q.weight.ndim() != 2 || x.ndim() < 1 {
        return false;
    }
    let k = x.dim(-1);
    let rows = if k > 0 { x.size() / k as usize } else { 0 };
    spec_served(q, x.dtype(), k)
        && q.weight.dim(1) as i64 * 32 == k as i64 * q.spec.bits as i64
        && q.scales.shape() == [q.weight.dim(0), k / q.spec.group_size]
        && q.weight.dim(0) > 0
        && (1..=MAX_ROWS).contains(&rows)
        && kernel().is_some()
}

/// Template arguments every quantized kernel takes.
pub(crate) fn quant_template(q: &Quantized, k: i32, dt: Dtype) -> Vec<(&'static str, TemplateArg)> {
    vec![
        ("K", TemplateArg::Int(k)),
        ("BITS", TemplateArg::Int(q.spec.bits)),
        ("GS", TemplateArg::Int(q.spec.group_size)),
        ("T", TemplateArg::Dtype(dt)),
    ]
}

/// Threads along x for one warp per each of `cols` outputs.
pub(crate) fn warp_grid(cols: i32) -> Result<i32> {
    let per_block = THREADS / 32;
    ((cols + per_block - 1) / per_block)
        .checked_mul(THREADS)
        .ok_or_else(|| Error::invalid(format!("too many output columns ({cols}) for a GEMV kernel")))
}

/// `x @ dequantize(q).T` through the kernel (callers check [`available`]).
pub fn qgemv(x: &Array, q: &Quantized) -> Result<Array> {
    let kern = kernel().ok_or_else(|| Error::mlx("the quantized GEMV kernel is not available"))?;
    let (n, k) = (q.weight.dim(0), x.dim(-1));
    let rows = x.size() / k as usize;
    let biases = q.biases.as_ref().ok_or_else(|| Error::invalid("the quantized GEMV kernel needs affine biases"))?;
    let mut shape = x.shape();
    *shape.last_mut().ok_or_else(|| Error::invalid("GEMV of a scalar"))? = n;
    let mut template = quant_template(q, k, x.dtype());
    template.push(("M", TemplateArg::Int(rows as i32)));
    let mut outs = kern.call(
        &[x, &q.weight, &q.scales, biases],
        &[(&shape, x.dtype())],
        [warp_grid(n)?, 1, 1],
        [THREADS, 1, 1],
        &template,
    )?;
    outs.pop().ok_or_else(|| Error::mlx("quantized GEMV kernel: missing output"))
}
