//! The residual add and the RMSNorm after it in one kernel: `s = h + r`,
//! `y = rms_norm(s) * w`. Every decoder layer has two such pairs (after its
//! operator and after its feed-forward, the latter meeting the next layer's
//! norm), so a decode step of the 1.2B saves 31 launches of a ~2.5 µs add.
//!
//! One block per row. The arithmetic follows MLX's own kernels: the sum
//! rounded to the model dtype, the mean of squares in float32 (each thread
//! a 16-byte run of the row, then a warp and a block reduction, as MLX's
//! rms_norm groups it), `w * T(s * rsqrt(mean + eps))`.

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use std::sync::OnceLock;

/// Threads per row: as MLX's rms_norm picks them for a width (the fewest
/// whose 16-byte reads cover the row, 32 to 1024), so the float32 sum of
/// squares is grouped as MLX groups it.
fn block_for(d: i32, n_reads: i32) -> i32 {
    let mut b = 32;
    while b < 1024 && d > n_reads * b {
        b *= 2;
    }
    b
}

const HEADER: &str = "#include <cooperative_groups/reduce.h>\n";

const SOURCE: &str = r#"
  constexpr int NR = 16 / sizeof(T);
  auto block = cg::this_thread_block();
  auto warp = cg::tiled_partition<32>(block);
  const size_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const T* hr = h + row * D;
  const T* rr = r + row * D;
  T* sr = s + row * D;
  T* yr = y + row * D;
  float acc = 0.0f;
  for (int base = tid * NR; base < D; base += BLOCK * NR) {
    for (int i = 0; i < NR && base + i < D; i++) {
      const T v = T(static_cast<float>(hr[base + i]) + static_cast<float>(rr[base + i]));
      sr[base + i] = v;
      const float f = static_cast<float>(v);
      acc += f * f;
    }
  }
  float total = cg::reduce(warp, acc, cg::plus<float>());
  if constexpr (BLOCK > 32) {
    __shared__ float part[BLOCK / 32];
    if (warp.thread_rank() == 0) part[warp.meta_group_rank()] = total;
    block.sync();
    const float x = warp.thread_rank() < warp.meta_group_size() ? part[warp.thread_rank()] : 0.0f;
    total = cg::reduce(warp, x, cg::plus<float>());
  }
  const float nrm = rsqrtf(total / static_cast<float>(D) + eps[0]);
  for (int base = tid * NR; base < D; base += BLOCK * NR) {
    for (int i = 0; i < NR && base + i < D; i++) {
      const float f = static_cast<float>(sr[base + i]);
      yr[base + i] = T(static_cast<float>(w[base + i]) * static_cast<float>(T(f * nrm)));
    }
  }
"#;

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_add_rms_norm", &["h", "r", "w", "eps"], &["s", "y"], SOURCE, HEADER).ok())
        .as_ref()
}

/// The fused kernel serves at most this many rows (MLX's add and rms_norm
/// the rest): it was written for decode (1-16 rows), and in a 512-token
/// prefill on the H200 ncu timed it at 27 µs a launch. The A/B of
/// 2026-12-02 (`bench/results/2026-12-02-h200-opt-in-kernels.raw.jsonl`,
/// call 8: the 1.2B's 512-token prefill, two interleaved turns) measured
/// MLX's ops there 4.9% faster with decode unchanged, which `run.py pick`'s
/// rule (3%) adopts. `MLX_LFM_ADD_RMS_NORM_MAX_ROWS=N` sets another bound,
/// `all` lifts it.
const DEFAULT_MAX_ROWS: usize = 16;

fn max_rows() -> Option<usize> {
    static MAX: OnceLock<Option<usize>> = OnceLock::new();
    *MAX.get_or_init(|| match std::env::var("MLX_LFM_ADD_RMS_NORM_MAX_ROWS").ok().as_deref() {
        Some("all") => None,
        Some(v) => Some(v.trim().parse().unwrap_or(DEFAULT_MAX_ROWS)),
        None => Some(DEFAULT_MAX_ROWS),
    })
}

/// Whether the fused kernel serves these operands on this backend.
pub fn available(h: &Array, r: &Array, w: &Array) -> bool {
    let dt = h.dtype();
    let rows = if h.ndim() >= 1 && h.dim(-1) > 0 { h.size() / h.dim(-1) as usize } else { 0 };
    if max_rows().is_some_and(|m| rows > m) {
        return false;
    }
    cuda_kernels_enabled()
        && dt.is_float()
        && dt != Dtype::Float64
        && r.dtype() == dt
        && w.dtype() == dt
        && h.shape() == r.shape()
        && w.ndim() == 1
        && h.ndim() >= 1
        && h.size() > 0
        && w.dim(0) == h.dim(-1)
        && kernel().is_some()
}

/// `(h + r, rms_norm(h + r) * w)`, both shaped like `h`; `eps` is a float32
/// `[1]` array (the model makes it once: a scalar here would be uploaded
/// twice per layer per token on the eager path).
pub fn add_rms_norm(h: &Array, r: &Array, w: &Array, eps: &Array) -> Result<(Array, Array)> {
    let kern = kernel().ok_or_else(|| Error::mlx("the fused add + RMSNorm kernel is not available"))?;
    let shape = h.shape();
    let d = *shape.last().ok_or_else(|| Error::invalid("add_rms_norm of a scalar"))?;
    let rows: i32 = shape[..shape.len() - 1].iter().product();
    let dt = h.dtype();
    let block = block_for(d, 16 / dt.size() as i32);
    let mut outs = kern.call(
        &[h, r, w, eps],
        &[(&shape, dt), (&shape, dt)],
        [block.checked_mul(rows).ok_or_else(|| Error::invalid("too many rows for the add + RMSNorm kernel"))?, 1, 1],
        [block, 1, 1],
        &[("D", TemplateArg::Int(d)), ("BLOCK", TemplateArg::Int(block)), ("T", TemplateArg::Dtype(dt))],
    )?;
    let y = outs.pop().ok_or_else(|| Error::mlx("add_rms_norm kernel: missing output"))?;
    let s = outs.pop().ok_or_else(|| Error::mlx("add_rms_norm kernel: missing output"))?;
    Ok((s, y))
}
