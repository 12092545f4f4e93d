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

use crate::error::Result;
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use std::sync::OnceLock;

/// Experts per lane the kernel keeps in registers (so at most 128 experts).
const MAX_PER_LANE: i32 = 4;
const MAX_K: i32 = 8;

const SOURCE: &str = r#"
  constexpr int PER = (E + 31) / 32;
  const int row = blockIdx.x;
  const int lane = threadIdx.x;
  float sel[PER];
  float prob[PER];
  bool used[PER];
  for (int j = 0; j < PER; j++) {
    const int e = lane + 32 * j;
    if (e < E) {
      prob[j] = static_cast<float>(probs[row * E + e]);
      sel[j] = prob[j] + bias[e];
      used[j] = false;
    } else {
      prob[j] = 0.0f;
      sel[j] = -3.0e38f;
      used[j] = true;
    }
  }
  float picked[K];
  int index[K];
  for (int k = 0; k < K; k++) {
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
      for (int k = 0; k < K; k++) s += picked[k];
      denom = T(s) + T(1e-6f);
    }
    const T f = T(scale[0]);
    const bool scaled = static_cast<float>(f) != 1.0f;
    for (int k = 0; k < K; k++) {
      T v = T(picked[k]);
      if (NORM) v = v / denom;
      if (scaled) v = v * f;
      inds[row * K + k] = static_cast<uint32_t>(index[k]);
      scores[row * K + k] = v;
    }
  }
"#;

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_moe_router", &["probs", "bias", "scale"], &["inds", "scores"], SOURCE, "").ok())
        .as_ref()
}

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
        return Err(crate::error::Error::invalid("the MoE router kernel takes at least one row"));
    }
    let kern = kernel().ok_or_else(|| crate::error::Error::mlx("the fused MoE router kernel is not available"))?;
    let dt = probs.dtype();
    let k = k as i32;
    let shape = [n, k];
    let mut outs = kern.call(
        &[probs, bias, scale],
        &[(&shape, Dtype::Uint32), (&shape, dt)],
        [n.checked_mul(32).ok_or_else(|| crate::error::Error::invalid("too many rows for the router kernel"))?, 1, 1],
        [32, 1, 1],
        &[("E", TemplateArg::Int(e)), ("K", TemplateArg::Int(k)), ("NORM", TemplateArg::Bool(norm)), ("T", TemplateArg::Dtype(dt))],
    )?;
    let scores = outs.pop().ok_or_else(|| crate::error::Error::mlx("router kernel: missing output"))?;
    let inds = outs.pop().ok_or_else(|| crate::error::Error::mlx("router kernel: missing output"))?;
    Ok((inds, scores))
}
