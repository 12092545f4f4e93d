//! LFM2-MoE's experts over a prefill's many rows as grouped GEMMs: the
//! rows sorted by expert, cut into tiles of at most 64 rows of one expert
//! (each block finds its tile from the experts' row offsets, so the host
//! never waits for the expert counts), and every tile of a projection in
//! one launch (tensor cores, `mma.sync`
//! m16n8k16 with float32 accumulators, the tile's weights dequantized into
//! shared memory on the way). By the H200 profile a 512-token prefill of the
//! 8B-A1B spent 74% of its GPU time (62.7 of 85 ms) in MLX's `qmm_sm80`,
//! one launch per expert and projection at ~64 rows, 43 µs apiece; and the
//! per-expert chains are ~450 graph ops a layer on the host. llama.cpp's
//! whole prefill of that model took 24 ms.
//!
//! Rounding: each weight dequantized to the dtype (`scale * q + bias` in
//! float32, rounded once, as a dequantize to the dtype gives), products
//! summed in float32 by the tensor cores, each output rounded once.
//!
//! On by default on CUDA (`MLX_LFM_MOE_GEMM_KERNEL=0` turns it off). On
//! the H200 (2026-12-03, `bench/results/2026-12-03-h200-session11.raw.jsonl`)
//! its tests passed: against MLX's per-expert `quantized_matmul` and the
//! exact product at the 8B-A1B's shapes (`moe_gemm_kernel_matches_stock_ops`:
//! 0.0039 from the product of the rounded weights where MLX's kernels are
//! 0.018-0.021), the whole grouped prefill of a MoE layer against the
//! stock path and the exact product, and the greedy test's 4-bit MoE
//! fixture with it alone (no departure in 64 steps, compiled and eager);
//! the 8B-A1B prefilled 512 tokens 2.6x faster with it (A/B medians of 6).

use super::quant_gemv::spec_served;
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::Quantized;
use std::sync::OnceLock;

/// Rows a tile holds (the kernel's TM).
pub const TILE_ROWS: usize = 64;
/// Output columns a block computes; the projection's width must be a
/// multiple.
const TILE_COLS: i32 = 64;
/// The K step; the input width must be a multiple.
const TILE_K: i32 = 64;
const THREADS: i32 = 128;

/// The tensor-core product of one 16x16 A fragment and one 16x8 B fragment
/// into float32 accumulators (PTX ISA fragment layouts: A row-major, B
/// column-major, two consecutive K values in each 32-bit register).
const MMA_HEADER: &str = r#"
__device__ inline void lfm_mma(float* c, const uint32_t* a, const uint32_t* b, __nv_bfloat16) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ inline void lfm_mma(float* c, const uint32_t* a, const uint32_t* b, __half) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ inline uint32_t lfm_pair(const void* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
"#;

/// A block: tile `blockIdx.y` of the rows `x` `[R, K]` sorted by expert
/// (`offsets` `[E + 1]`: expert e's rows are `[offsets[e], offsets[e + 1])`,
/// cut into tiles of 64 in expert order; blocks past the last tile return)
/// against 64 output columns of that expert's `w` `[E, N, K * BITS / 32]`;
/// 4 warps, each 32 rows x 32 columns.
pub(crate) const SOURCE: &str = r#"
  constexpr int TM = 64;
  constexpr int TN = 64;
  constexpr int TK = 64;
  constexpr int LD = TK + 8;
  constexpr int G = K / GS;
  constexpr int WORDS = K * BITS / 32;
  constexpr int VPC = 128 / BITS;
  constexpr int CPR = TK / VPC;
  __shared__ __align__(16) T xs[TM * LD];
  __shared__ __align__(16) T ws[TN * LD];
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wm = warp >> 1;
  const int wn = warp & 1;
  __shared__ int tile_at[3];
  if (tid == 0) {
    const int experts = w_shape[0];
    const int want = blockIdx.y;
    int before = 0;
    tile_at[0] = -1;
    for (int j = 0; j < experts; j++) {
      const int a = offsets[j];
      const int count = offsets[j + 1] - a;
      const int tiles = count > 0 ? (count + TM - 1) / TM : 0;
      if (want < before + tiles) {
        tile_at[0] = j;
        tile_at[1] = a + (want - before) * TM;
        tile_at[2] = min(TM, offsets[j + 1] - tile_at[1]);
        break;
      }
      before += tiles;
    }
  }
  __syncthreads();
  if (tile_at[0] < 0) return;
  const int N = w_shape[1];
  const int n0 = blockIdx.x * TN;
  const int e = tile_at[0];
  const int r0 = tile_at[1];
  const int rows = tile_at[2];
  const bool xa = lfm_aligned(x);
  const bool wa = lfm_aligned(w);
  const uint32_t* wb = w + (static_cast<size_t>(e) * N + n0) * WORDS;
  const T* sb = scales + (static_cast<size_t>(e) * N + n0) * G;
  const T* bb = biases + (static_cast<size_t>(e) * N + n0) * G;
  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int v = 0; v < 4; v++) acc[i][j][v] = 0.0f;
  for (int k0 = 0; k0 < K; k0 += TK) {
    // x: 64 rows of 64 values, 8 a chunk; rows past the tile are zeros.
    for (int c = tid; c < TM * TK / 8; c += 128) {
      const int r = c / (TK / 8);
      const int kc = (c % (TK / 8)) * 8;
      uint4 v = make_uint4(0u, 0u, 0u, 0u);
      if (r < rows) v = lfm_load16(x + static_cast<size_t>(r0 + r) * K, (k0 + kc) / 8, xa);
      *reinterpret_cast<uint4*>(&xs[r * LD + kc]) = v;
    }
    // w: 64 rows of 64 values, VPC (one group's) a 16-byte chunk.
    for (int c = tid; c < TN * CPR; c += 128) {
      const int n = c / CPR;
      const int j = c % CPR;
      const int k = k0 + j * VPC;
      const uint4 q = lfm_load16(wb + static_cast<size_t>(n) * WORDS, k / VPC, wa);
      const float s = static_cast<float>(sb[n * G + k / GS]);
      const float b = static_cast<float>(bb[n * G + k / GS]);
      const uint32_t qw[4] = {q.x, q.y, q.z, q.w};
      T* dst = &ws[n * LD + j * VPC];
#pragma unroll
      for (int i = 0; i < VPC; i++) {
        const uint32_t bits = (qw[i / (32 / BITS)] >> (BITS * (i % (32 / BITS)))) & ((1u << BITS) - 1u);
        dst[i] = T(fmaf(s, static_cast<float>(bits), b));
      }
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < TK; kk += 16) {
      const int col = kk + (lane & 3) * 2;
      uint32_t a[2][4];
      uint32_t bf[4][2];
#pragma unroll
      for (int mi = 0; mi < 2; mi++) {
        const int row = wm * 32 + mi * 16 + (lane >> 2);
        a[mi][0] = lfm_pair(&xs[row * LD + col]);
        a[mi][1] = lfm_pair(&xs[(row + 8) * LD + col]);
        a[mi][2] = lfm_pair(&xs[row * LD + col + 8]);
        a[mi][3] = lfm_pair(&xs[(row + 8) * LD + col + 8]);
      }
#pragma unroll
      for (int ni = 0; ni < 4; ni++) {
        const int n = wn * 32 + ni * 8 + (lane >> 2);
        bf[ni][0] = lfm_pair(&ws[n * LD + col]);
        bf[ni][1] = lfm_pair(&ws[n * LD + col + 8]);
      }
#pragma unroll
      for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++) lfm_mma(acc[mi][ni], a[mi], bf[ni], T());
    }
    __syncthreads();
  }
#pragma unroll
  for (int mi = 0; mi < 2; mi++) {
#pragma unroll
    for (int ni = 0; ni < 4; ni++) {
      const int row = wm * 32 + mi * 16 + (lane >> 2);
      const int col = n0 + wn * 32 + ni * 8 + (lane & 3) * 2;
      if (row < rows) {
        T* o = y + static_cast<size_t>(r0 + row) * N + col;
        o[0] = T(acc[mi][ni][0]);
        o[1] = T(acc[mi][ni][1]);
      }
      if (row + 8 < rows) {
        T* o = y + static_cast<size_t>(r0 + row + 8) * N + col;
        o[0] = T(acc[mi][ni][2]);
        o[1] = T(acc[mi][ni][3]);
      }
    }
  }
"#;

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| {
        let header = format!("{}{MMA_HEADER}", super::gemv::header());
        CudaKernel::new("lfm_moe_gemm", &["x", "offsets", "w", "scales", "biases"], &["y"], SOURCE, &header).ok()
    })
    .as_ref()
}

/// The form that reads each sorted row through its token's row of the
/// unsorted `x` (`src`, src/kernels/moe_sort.rs), in place of a take that
/// writes the sorted rows first: the same values, so the same bits.
pub(crate) const GATHERED_SUBSTITUTIONS: [(&str, &str); 1] = [
    (
        "      if (r < rows) v = lfm_load16(x + static_cast<size_t>(r0 + r) * K, (k0 + kc) / 8, xa);\n",
        "      if (r < rows) v = lfm_load16(x + static_cast<size_t>(src[r0 + r]) * K, (k0 + kc) / 8, xa);\n",
    ),
];

fn gathered_kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| {
        let header = format!("{}{MMA_HEADER}", super::gemv::header());
        let source = super::substituted(SOURCE, &GATHERED_SUBSTITUTIONS);
        CudaKernel::new("lfm_moe_gemm_gathered", &["x", "src", "offsets", "w", "scales", "biases"], &["y"], &source, &header).ok()
    })
    .as_ref()
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_MOE_GEMM_KERNEL", &ON)
}

/// Whether the kernel serves `x` `[R, K]` against the stacked experts `w`
/// `[E, N, K * bits / 32]`: on, on CUDA, bf16 or f16 activations, affine 4
/// or 8 bits in groups of 32 to 128, K a multiple of 64 and N of 64.
pub fn available(x: &Array, w: &Quantized) -> bool {
    x.ndim() == 2 && serves(x.dim(1), x.dtype(), w)
}

/// [`available`] for rows `k` wide in dtype `dt`.
pub fn serves(k: i32, dt: Dtype, w: &Quantized) -> bool {
    if !enabled() || !cuda_kernels_enabled() || w.weight.ndim() != 3 {
        return false;
    }
    let (e, n) = (w.weight.dim(0), w.weight.dim(1));
    matches!(dt, Dtype::Bfloat16 | Dtype::Float16)
        && spec_served(w, dt, k)
        && k % TILE_K == 0
        && n > 0
        && n % TILE_COLS == 0
        && e > 0
        && w.weight.dim(2) as i64 * 32 == k as i64 * w.spec.bits as i64
        && w.scales.shape() == [e, n, k / w.spec.group_size]
        && kernel().is_some()
}

/// Blocks along y one launch takes (CUDA's grid y limit).
const MAX_TILES: i64 = 65_535;

/// The tiles the rows of `rows` sorted by expert can make with `experts`
/// experts, at most: each expert's last tile may be partial.
pub fn tile_bound(rows: i32, experts: i32) -> i64 {
    (rows as i64 + TILE_ROWS as i64 - 1) / TILE_ROWS as i64 + experts as i64
}

/// Whether one launch covers `rows` rows over `experts` experts.
pub fn fits(rows: i32, experts: i32) -> bool {
    rows > 0 && tile_bound(rows, experts) <= MAX_TILES
}

/// Expert `e`'s first row among rows sorted by expert, for e in `0..=E`:
/// how many of the sorted ids `ids` `[R]` are below e (`[E + 1]` int32).
pub fn offsets(ids: &Array, experts: i32) -> Result<Array> {
    let bounds = crate::mlx::arange(0.0, (experts + 1) as f64, 1.0, ids.dtype())?;
    ids.expand_dims(1)?.lt(&bounds.expand_dims(0)?)?.astype(Dtype::Int32)?.sum(&[0], false)
}

/// `y[r] = x[r] @ dequantize(w[e(r)]).T` for rows `x` `[R, K]` sorted by
/// expert, `offsets` from [`offsets`] over the same rows: `[R, N]`
/// (callers check [`available`] and [`fits`]).
pub fn grouped_gemm(x: &Array, offsets: &Array, w: &Quantized) -> Result<Array> {
    launch(x, None, offsets, w)
}

/// [`grouped_gemm`] of the rows `x[src[p]]` (`src` `[R]` int32, the rows
/// of `x` `[rows, K]` in expert order: [`crate::kernels::moe_sort::sort_rows`]'s),
/// without writing them out first: `[R, N]`.
pub fn grouped_gemm_gathered(x: &Array, src: &Array, offsets: &Array, w: &Quantized) -> Result<Array> {
    if src.ndim() != 1 || src.dtype() != Dtype::Int32 {
        return Err(Error::invalid(format!("MoE grouped GEMM: rows {:?} of {:?}, not [R] int32", src.shape(), src.dtype())));
    }
    launch(x, Some(src), offsets, w)
}

fn launch(x: &Array, src: Option<&Array>, offsets: &Array, w: &Quantized) -> Result<Array> {
    let kern = if src.is_some() { gathered_kernel() } else { kernel() };
    let kern = kern.ok_or_else(|| Error::mlx("the MoE grouped GEMM kernel is not available"))?;
    let biases = w.biases.as_ref().ok_or_else(|| Error::invalid("the MoE grouped GEMM kernel needs affine biases"))?;
    let (r, k) = (src.map_or(x.dim(0), |s| s.dim(0)), x.dim(1));
    let (e, n) = (w.weight.dim(0), w.weight.dim(1));
    if !fits(r, e) {
        return Err(Error::invalid(format!("MoE grouped GEMM: {r} rows over {e} experts exceed a launch")));
    }
    if offsets.shape() != [e + 1] || offsets.dtype() != Dtype::Int32 {
        return Err(Error::invalid(format!("MoE grouped GEMM: offsets {:?} for {e} experts", offsets.shape())));
    }
    let template = [
        ("K", TemplateArg::Int(k)),
        ("BITS", TemplateArg::Int(w.spec.bits)),
        ("GS", TemplateArg::Int(w.spec.group_size)),
        ("T", TemplateArg::Dtype(x.dtype())),
    ];
    let inputs: Vec<&Array> = match src {
        Some(src) => vec![x, src, offsets, &w.weight, &w.scales, biases],
        None => vec![x, offsets, &w.weight, &w.scales, biases],
    };
    let mut outs = kern.call(
        &inputs,
        &[(&[r, n], x.dtype())],
        [(n / TILE_COLS) * THREADS, tile_bound(r, e) as i32, 1],
        [THREADS, 1, 1],
        &template,
    )?;
    outs.pop().ok_or_else(|| Error::mlx("MoE grouped GEMM kernel: missing output"))
}

#[cfg(test)]
mod tests {
    use super::{offsets, tile_bound};
    use crate::mlx::{Array, Dtype};

    #[test]
    fn offsets_count_the_rows_below_each_expert() {
        let ids = Array::from_slice(&[0u32, 0, 0, 2, 2, 5], &[6]).unwrap();
        let o: Vec<i32> = offsets(&ids, 8).unwrap().to_vec().unwrap();
        assert_eq!(o, vec![0, 3, 3, 5, 5, 5, 6, 6, 6]);
        assert_eq!(offsets(&ids, 8).unwrap().dtype(), Dtype::Int32);
        // 130 rows of one expert: three tiles; the bound adds one a expert.
        assert_eq!(tile_bound(130, 1), 4);
        assert_eq!(tile_bound(128, 32), 34);
    }
}
