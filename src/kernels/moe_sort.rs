//! A prefill's MoE rows sorted by expert in one launch, for the grouped
//! expert GEMMs (src/kernels/moe_gemm.rs; `SparseMoe::grouped_kernel`).
//! The stock bookkeeping is two argsorts (the order and its inverse), a
//! floor division (each sorted entry's token row), a take (the sorted
//! ids) and the experts' offsets as an arange, two expand_dims, a less
//! than, a cast and a sum: eight kernels and two views a MoE layer, 176
//! nodes over the 8B-A1B's 22 MoE layers for each prefill chunk, where the
//! host's cost is ~6-8 µs a kernel node (session 33's `dispatch-cost`) and
//! the 8B-A1B's P=512 prefill stays 1-3% under llama.cpp's (session 40).
//!
//! `MLX_LFM_MOE_SORT_KERNEL` (written in session 40, a CUDA default since
//! session 41, `=0` off: its H100 test gave a host's stable sort exactly,
//! the grouped prefill the argsorts' bits, and with the combine below its
//! paired A/B read the 8B-A1B's P=512 prefill 1.094-1.098x, every rep,
//! the sort alone 1.038-1.058x; decode unchanged,
//! `bench/results/2026-12-06-h100-session41.raw.jsonl`): one block of 1,024
//! threads counts the ids by expert (the offsets), then places each entry
//! a tile of 1,024 at a time: its expert's base, the counts of the warps
//! before its own in the tile, its rank among its warp's lanes of the same
//! expert (`__match_any_sync`). So the sort is stable, as a host's sort by
//! (expert, index) is, and its outputs are the same arrays the stock
//! bookkeeping gives wherever MLX's argsort keeps ties in index order (the
//! grouped GEMM's rows do not depend on their order within an expert
//! anyway: each output is one row's own sums). Its `src` goes to the
//! gate/up GEMM, which reads each sorted row through it
//! (`moe_gemm::grouped_gemm_gathered`), so no take writes the sorted rows
//! first: a ninth node, and the rows' 8 MB written and read again at
//! P=512 on the 8B-A1B. Ids at or past the expert
//! count (which the router never gives) are counted as the last expert, so
//! that no write leaves the arrays.
//!
//! `MLX_LFM_MOE_COMBINE_KERNEL` (session 40, a CUDA default since session
//! 41, `=0` off; its H100 test gave the stock multiply and sum's bits, 0
//! of 14,976 values apart; over the sort
//! kernel's int32 places): the experts' rows back in token order and
//! weighted, in one launch, where the stock graph takes them back (a take),
//! reshapes them, multiplies each by its weight and sums a token's `k`
//! (two more kernels and two views): each product rounded to the dtype as
//! MLX's multiply rounds it, the `k` of a token summed in float32 in
//! order and rounded once. Tests in src/kernels/tests.rs.

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use std::sync::OnceLock;

const THREADS: i32 = 1024;
/// The most experts served (the warps' counts take 32 x E ints of shared
/// memory: 16 KB here).
pub const MAX_EXPERTS: i32 = 128;
/// The most entries (rows x experts a row) one launch sorts: one block
/// walks them all, ~1,024 a step.
pub const MAX_ENTRIES: i32 = 1 << 20;

const SOURCE: &str = r#"
  constexpr int W = 32;
  const int n = ids_shape[0];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  __shared__ int count[E];
  __shared__ int base[E];
  __shared__ int wc[W * E];
  for (int e = tid; e < E; e += blockDim.x) count[e] = 0;
  __syncthreads();
  for (int i = tid; i < n; i += blockDim.x) {
    const uint32_t v = ids[i];
    atomicAdd(&count[v < E ? static_cast<int>(v) : E - 1], 1);
  }
  __syncthreads();
  if (tid == 0) {
    int run = 0;
    for (int e = 0; e < E; e++) {
      base[e] = run;
      offsets[e] = run;
      run += count[e];
    }
    offsets[E] = run;
  }
  __syncthreads();
  for (int t0 = 0; t0 < n; t0 += blockDim.x) {
    const int i = t0 + tid;
    // (E: no entry, past the end.)
    int e = E;
    if (i < n) {
      const uint32_t v = ids[i];
      e = v < E ? static_cast<int>(v) : E - 1;
    }
    const unsigned same = __match_any_sync(0xffffffffu, e);
    const int rank = __popc(same & ((1u << lane) - 1u));
    for (int x = tid; x < W * E; x += blockDim.x) wc[x] = 0;
    __syncthreads();
    if (e < E && rank == 0) wc[warp * E + e] = __popc(same);
    __syncthreads();
    // Each expert's warps in order: their counts become exclusive sums,
    // and count[] this tile's total.
    for (int x = tid; x < E; x += blockDim.x) {
      int run = 0;
      for (int w = 0; w < W; w++) {
        const int c = wc[w * E + x];
        wc[w * E + x] = run;
        run += c;
      }
      count[x] = run;
    }
    __syncthreads();
    if (e < E) {
      const int p = base[e] + wc[warp * E + e] + rank;
      inv[i] = p;
      src[p] = i / K;
    }
    __syncthreads();
    for (int x = tid; x < E; x += blockDim.x) base[x] += count[x];
    __syncthreads();
  }
"#;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_MOE_SORT_KERNEL", &ON)
}

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_moe_sort", &["ids"], &["src", "inv", "offsets"], SOURCE, "").ok()).as_ref()
}

/// Whether [`sort_rows`] serves the expert ids `ids` (`[N]` uint32, `k` a
/// row) over `experts` experts: on, on CUDA, within the bounds above.
pub fn available(ids: &Array, k: i32, experts: i32) -> bool {
    enabled()
        && cuda_kernels_enabled()
        && ids.ndim() == 1
        && ids.dtype() == Dtype::Uint32
        && (1..=MAX_ENTRIES).contains(&ids.dim(0))
        && k >= 1
        && ids.dim(0) % k == 0
        && (1..=MAX_EXPERTS).contains(&experts)
        && kernel().is_some()
}

/// The entries of `ids` sorted by expert, stably: `(src, inv, offsets)`,
/// int32: `src[p]` the row (`index / k`) of the entry at sorted place `p`,
/// `inv[i]` entry `i`'s place, `offsets[e]` how many entries are below
/// expert `e`, for `e` in `0..=experts` (callers check [`available`]).
pub fn sort_rows(ids: &Array, k: i32, experts: i32) -> Result<(Array, Array, Array)> {
    let kern = kernel().ok_or_else(|| Error::mlx("the MoE sort kernel is not available"))?;
    let n = ids.dim(0);
    let mut outs = kern.call(
        &[ids],
        &[(&[n], Dtype::Int32), (&[n], Dtype::Int32), (&[experts + 1], Dtype::Int32)],
        [THREADS, 1, 1],
        [THREADS, 1, 1],
        &[("K", TemplateArg::Int(k)), ("E", TemplateArg::Int(experts))],
    )?;
    let missing = || Error::mlx("MoE sort kernel: missing output");
    let offsets = outs.pop().ok_or_else(missing)?;
    let inv = outs.pop().ok_or_else(missing)?;
    let src = outs.pop().ok_or_else(missing)?;
    Ok((src, inv, offsets))
}

/// A block's threads take 8 values each of a row (16 bytes of bf16).
const COMBINE_SOURCE: &str = r#"
  const int r = blockIdx.y;
  const int c = (blockIdx.x * blockDim.x + threadIdx.x) * 8;
  if (c >= D) return;
  float acc[8];
#pragma unroll
  for (int u = 0; u < 8; u++) acc[u] = 0.0f;
  for (int j = 0; j < K; j++) {
    const int p = inv[r * K + j];
    const float s = static_cast<float>(scores[r * K + j]);
    const T* yr = y + static_cast<size_t>(p) * D + c;
#pragma unroll
    for (int u = 0; u < 8; u++) acc[u] += static_cast<float>(T(static_cast<float>(yr[u]) * s));
  }
  T* o = out + static_cast<size_t>(r) * D + c;
#pragma unroll
  for (int u = 0; u < 8; u++) o[u] = T(acc[u]);
"#;

const COMBINE_THREADS: i32 = 256;

fn combine_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_MOE_COMBINE_KERNEL", &ON)
}

fn combine_kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_moe_combine", &["y", "inv", "scores"], &["out"], COMBINE_SOURCE, "").ok()).as_ref()
}

/// Whether [`combine`] can serve rows `d` wide of dtype `dt` weighted by
/// scores of dtype `st` (what a caller asks before it builds the rows).
pub fn combine_serves(d: i32, dt: Dtype, st: Dtype) -> bool {
    combine_enabled()
        && cuda_kernels_enabled()
        && matches!(dt, Dtype::Bfloat16 | Dtype::Float16 | Dtype::Float32)
        && d % 8 == 0
        && st == dt
        && combine_kernel().is_some()
}

/// Whether [`combine`] serves the sorted rows `y` (`[N, D]`), the places
/// `inv` (`[N]` int32, [`sort_rows`]'s) and the weights `scores` (`[N /
/// k, k]`, `y`'s dtype): on, on CUDA, a float `y` with `D` a multiple of 8.
pub fn combine_available(y: &Array, inv: &Array, scores: &Array, k: i32) -> bool {
    y.ndim() == 2
        && combine_serves(y.dim(1), y.dtype(), scores.dtype())
        && k >= 1
        && y.dim(0) % k == 0
        && (1..=MAX_ENTRIES).contains(&y.dim(0))
        && inv.shape() == [y.dim(0)]
        && inv.dtype() == Dtype::Int32
        && scores.shape() == [y.dim(0) / k, k]
        && y.dim(0) / k <= MAX_COMBINE_ROWS
}

/// The most rows (tokens) one combine launch serves: a block row each
/// along the grid's y, whose bound is 65,535 blocks.
pub const MAX_COMBINE_ROWS: i32 = 65_535;

/// `out[r] = sum_j y[inv[r k + j]] * scores[r, j]`, `[N / k, D]` (callers
/// check [`combine_available`]).
pub fn combine(y: &Array, inv: &Array, scores: &Array, k: i32) -> Result<Array> {
    let kern = combine_kernel().ok_or_else(|| Error::mlx("the MoE combine kernel is not available"))?;
    let (n, d) = (y.dim(0), y.dim(1));
    let rows = n / k;
    let per_block = COMBINE_THREADS * 8;
    let blocks = (d + per_block - 1) / per_block;
    let mut outs = kern.call(
        &[y, inv, scores],
        &[(&[rows, d], y.dtype())],
        [blocks * COMBINE_THREADS, rows, 1],
        [COMBINE_THREADS, 1, 1],
        &[("K", TemplateArg::Int(k)), ("D", TemplateArg::Int(d)), ("T", TemplateArg::Dtype(y.dtype()))],
    )?;
    outs.pop().ok_or_else(|| Error::mlx("MoE combine kernel: missing output"))
}
