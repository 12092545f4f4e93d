//! A quantized embedding's rows for token ids in one kernel
//! (`MLX_LFM_QUANT_EMBED_KERNEL=1`, opt-in until its H200 test and A/B).
//! The stock path takes the ids' rows of the packed weights, the scales and
//! the biases (a gather and a reshape each) and dequantizes them: seven
//! nodes at the head of every decode step of a model with a quantized
//! embedding (the 8B-A1B's, whose step is bound by the host's work a node).
//!
//! One thread per packed 32-bit word of an output row: its values
//! dequantized as MLX's affine dequantize does them, `scale * T(q) + bias`
//! in the model dtype's own operators (so the same roundings), the word's
//! values lowest bits first. Affine 2, 4 and 8 bits (whole values a word);
//! other modes and widths keep the stock ops.

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype, QuantMode, QuantSpec};
use std::sync::OnceLock;

const SOURCE: &str = r#"
  constexpr int PER_WORD = 32 / BITS;
  constexpr int WORDS = D / PER_WORD;
  constexpr unsigned MASK = (1u << BITS) - 1u;
  size_t rows = 1;
  for (int a = 0; a < ids_ndim; a++) rows *= static_cast<size_t>(ids_shape[a]);
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * WORDS) return;
  const size_t r = i / WORDS;
  const int j = static_cast<int>(i - r * WORDS);
  const size_t row = static_cast<size_t>(ids[r]);
  const unsigned word = w[row * WORDS + j];
  const int col = j * PER_WORD;
  const T scale = scales[row * (D / GS) + col / GS];
  const T bias = biases[row * (D / GS) + col / GS];
  T* o = out + r * D + col;
#pragma unroll
  for (int k = 0; k < PER_WORD; k++) {
    const unsigned q = (word >> (BITS * k)) & MASK;
    o[k] = scale * static_cast<T>(static_cast<float>(q)) + bias;
  }
"#;

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_quant_embed", &["ids", "w", "scales", "biases"], &["out"], SOURCE, "").ok())
        .as_ref()
}

const THREADS: i32 = 256;

/// Whether the kernel serves the rows of `ids` (int32 or uint32, any
/// shape) from the quantized table (`w` `[V, D * bits / 32]` uint32,
/// `scales` and `biases` `[V, D / group]`) into `dtype`: on CUDA with
/// `MLX_LFM_QUANT_EMBED_KERNEL=1` (or a test's opt-in), affine 2, 4 or 8
/// bits, the scales and biases in `dtype`, at most 2^31 threads.
pub fn available(ids: &Array, w: &Array, scales: &Array, biases: Option<&Array>, spec: QuantSpec, dtype: Dtype) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    if !super::opt_in("MLX_LFM_QUANT_EMBED_KERNEL", &ON) || !cuda_kernels_enabled() {
        return false;
    }
    let Some(b) = biases else { return false };
    if spec.mode != QuantMode::Affine || ![2, 4, 8].contains(&spec.bits) || !dtype.is_float() || dtype == Dtype::Float64 {
        return false;
    }
    if ids.ndim() == 0 || w.ndim() != 2 || scales.ndim() != 2 || w.dtype() != Dtype::Uint32 || !matches!(ids.dtype(), Dtype::Int32 | Dtype::Uint32) {
        return false;
    }
    let d = w.dim(1) as i64 * 32 / spec.bits as i64;
    let rows = ids.size() as i64;
    d > 0
        && spec.group_size % (32 / spec.bits) == 0
        && d % spec.group_size as i64 == 0
        && d <= i32::MAX as i64
        && scales.shape() == [w.dim(0), (d / spec.group_size as i64) as i32]
        && b.shape() == scales.shape()
        && scales.dtype() == dtype
        && b.dtype() == dtype
        && rows > 0
        && rows * w.dim(1) as i64 <= (i32::MAX - THREADS) as i64
        && kernel().is_some()
}

/// The rows of `ids` dequantized: `ids.shape ++ [D]` in `dtype` (callers
/// check [`available`]; ids must lie in the table, as the model checks
/// every prompt's).
pub fn embed(ids: &Array, w: &Array, scales: &Array, biases: &Array, spec: QuantSpec, dtype: Dtype) -> Result<Array> {
    let kern = kernel().ok_or_else(|| Error::mlx("the quantized embedding kernel is not available"))?;
    let words = w.dim(1);
    let d = words * (32 / spec.bits);
    let threads = (ids.size() as i64 * words as i64 + THREADS as i64 - 1) / THREADS as i64 * THREADS as i64;
    let threads = i32::try_from(threads).map_err(|_| Error::invalid(format!("quantized embedding kernel: {} ids of {d}", ids.size())))?;
    let mut shape = ids.shape();
    shape.push(d);
    let mut outs = kern.call(
        &[ids, w, scales, biases],
        &[(&shape, dtype)],
        [threads, 1, 1],
        [THREADS, 1, 1],
        &[
            ("D", TemplateArg::Int(d)),
            ("BITS", TemplateArg::Int(spec.bits)),
            ("GS", TemplateArg::Int(spec.group_size)),
            ("T", TemplateArg::Dtype(dtype)),
        ],
    )?;
    outs.pop().ok_or_else(|| Error::mlx("quantized embedding kernel: missing output"))
}
