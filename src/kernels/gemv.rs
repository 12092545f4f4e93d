//! `x @ w.T` for a decode step's few rows (`x` `[.., K]` with at most 8 rows,
//! `w` a dense `[N, K]` projection): one warp per output column walks its
//! row of `w` as MLX's `gemv_single` does (so that a one-row product equals
//! MLX's to the bit), with the row prefetched into L2 up front and each
//! batch of loads issued before its sums, and applies it to every row of
//! `x`; with the MLP's stacked w1/w3, the SwiGLU gate in the same launch.
//! By the H200 profile MLX's `gemv_single` is 60% of the 1.2B's decode GPU
//! time, at ~3 TB/s.
//!
//! On CUDA by default for inputs at most 1024 wide, where it wins
//! ([`serves_weight`]: the 350M's projections, none of the 1.2B's);
//! `MLX_LFM_GEMV_KERNEL=1` takes every weight, `=0` none. Its tests are in
//! `src/kernels/tests.rs`.

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use std::sync::OnceLock;

const THREADS: i32 = 256;
/// Rows of `x` one launch serves (a batch of more decodes with MLX's GEMM).
/// Each row count is its own compiled kernel (M is a template constant):
/// the first step at a new batch size pays one NVRTC compile, cached on disk.
pub const MAX_ROWS: usize = 8;

/// Whether a pointer sits on a 16-byte boundary (every kernel that makes
/// vector loads asks).
pub(crate) const ALIGN_HEADER: &str = "
__device__ inline bool lfm_aligned(const void* p) {
  return (reinterpret_cast<unsigned long long>(p) & 15) == 0;
}
";

/// The GEMV kernels' device code with the alignment test it uses.
pub(crate) fn header() -> String {
    format!("{ALIGN_HEADER}{HEADER}")
}

/// The device code the GEMV kernels share (the quantized ones and the
/// fused norm + GEMV too): 16-byte loads, one vector load where the row
/// starts on a 16-byte boundary (every row does then: K is a multiple of 8),
/// element by element where it does not (a view MLX passes with its
/// offset); a warp's dot products of one weight row with M rows of `x`; the
/// SwiGLU gate rounded as MLX's CUDA ops round it.
const HEADER: &str = "
template <typename U>
__device__ inline uint4 lfm_load16(const U* base, size_t c, bool aligned) {
  if (aligned) return reinterpret_cast<const uint4*>(base)[c];
  uint4 r;
  U* e = reinterpret_cast<U*>(&r);
  for (int j = 0; j < 16 / (int)sizeof(U); j++) e[j] = base[c * (16 / sizeof(U)) + j];
  return r;
}
__device__ inline float lfm_warp_sum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
  return v;
}
// ptxas spreads a batch's loads between the sums where registers are
// short (the dense GEMV's: 3 of a row's 8 issued up front in the SASS of
// 2026-12-02), so the dot helpers first ask L2 for the row's 16-byte chunks
// (prefetch: no register, no consumer, issued where written, SASS
// CCTL.E.PF2): the row's DRAM reads start at once and the loads after
// them wait on L2 at most.
#define LFM_BATCH 8
#ifndef LFM_DENSE_PREFETCH
#define LFM_DENSE_PREFETCH 1
#endif
#ifndef LFM_DENSE_PLAIN
#define LFM_DENSE_PLAIN 0
#endif
template <int IT, int C>
__device__ inline void lfm_prefetch_row(const void* base, int lane) {
#pragma unroll
  for (int i = 0; i < IT; i++) {
    const int c = lane + i * 32;
    if (C % 32 == 0 || c < C) asm volatile(\"prefetch.global.L2 [%0];\" ::\"l\"(reinterpret_cast<const uint4*>(base) + c));
  }
}
// The dense dots walk a row as MLX's gemv_single does, so that a one-row
// product is MLX's to the bit: lane l takes N contiguous elements at
// N l, N l + 32 N, ... (N = 4 where K is a multiple of 128, 2 of 64, else
// 1), summing products into one float32 in that order; the warp then sums
// in a butterfly (lfm_warp_sum, as cg::reduce does) and rounds once.
// (The first version took 16-byte runs, 8 bf16 a lane: within one rounding
// of MLX's, and a random model's greedy text left the stock path's after a
// few dozen tokens.) The loads of a batch of steps are issued before their
// sums and the row is prefetched into L2 up front (see lfm_prefetch_row).
template <int K>
struct lfm_npt {
  static constexpr int v = K % 128 == 0 ? 4 : (K % 64 == 0 ? 2 : 1);
};
template <typename T, int N>
struct alignas(N * sizeof(T)) lfm_vec {
  T e[N];
};
template <typename T, int N, bool ALIGNED>
__device__ inline lfm_vec<T, N> lfm_loadv(const T* p) {
  if constexpr (ALIGNED) {
    return *reinterpret_cast<const lfm_vec<T, N>*>(p);
  } else {
    lfm_vec<T, N> r;
#pragma unroll
    for (int j = 0; j < N; j++) r.e[j] = p[j];
    return r;
  }
}
template <typename T, int K>
__device__ inline void lfm_prefetch_dense(const T* wr, int lane) {
  constexpr int C16 = K * sizeof(T) / 16;
  lfm_prefetch_row<(C16 + 31) / 32, C16>(wr, lane);
}
// acc[r * M + m] += this lane's share of (weight row wr[r]) . (row m of x),
// for R weight rows at once (the SwiGLU's gate and up rows: x read once,
// both rows' loads of a batch issued together). ALIGNED (a template
// constant, so the test sits outside the loops): every row starts on a
// 16-byte boundary.
// acc[r * M + m] += (the R weight rows' elements w[r] at col) . (row m of
// x at col): one column step of a lane, each sum in the order walked.
template <typename T, int K, int M, int R, int N, bool ALIGNED>
__device__ inline void lfm_dot_step(const T* x, int col, const lfm_vec<T, N>* w, float* acc) {
#pragma unroll
  for (int m = 0; m < M; m++) {
    const lfm_vec<T, N> xv = lfm_loadv<T, N, ALIGNED>(x + static_cast<size_t>(m) * K + col);
#pragma unroll
    for (int j = 0; j < N; j++) {
      const float xf = static_cast<float>(xv.e[j]);
#pragma unroll
      for (int r = 0; r < R; r++) acc[r * M + m] += static_cast<float>(w[r].e[j]) * xf;
    }
  }
}
template <typename T, int K, int M, int R, bool ALIGNED>
__device__ inline void lfm_dot_rows_a(const T* x, const T* const* wr, int lane, float* acc) {
  constexpr int N = lfm_npt<K>::v;
  constexpr int STEP = 32 * N;
  constexpr int IT = (K + STEP - 1) / STEP;
  // More rows than the SwiGLU's two (LFM_COLS > 1): as many loads in
  // flight a lane, in shorter batches, so the registers stay in bounds.
  constexpr int BR = R <= 2 ? LFM_BATCH : (16 / R < 2 ? 2 : 16 / R);
  constexpr int B = IT < BR ? IT : BR;
  if (LFM_DENSE_PLAIN) {
    // MLX's own loop: one load of each row at a time, not unrolled (the
    // same columns in the same order, so the same sums).
#pragma unroll 1
    for (int col = N * lane; col < K; col += STEP) {
      lfm_vec<T, N> wv[R];
#pragma unroll
      for (int r = 0; r < R; r++) wv[r] = lfm_loadv<T, N, ALIGNED>(wr[r] + col);
      lfm_dot_step<T, K, M, R, N, ALIGNED>(x, col, wv, acc);
    }
    return;
  }
  if (ALIGNED && LFM_DENSE_PREFETCH) {
#pragma unroll
    for (int r = 0; r < R; r++) lfm_prefetch_dense<T, K>(wr[r], lane);
  }
#pragma unroll
  for (int i0 = 0; i0 < IT; i0 += B) {
    lfm_vec<T, N> wv[R][B];
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int col = N * lane + (i0 + u) * STEP;
      if (i0 + u < IT && col < K) {
#pragma unroll
        for (int r = 0; r < R; r++) wv[r][u] = lfm_loadv<T, N, ALIGNED>(wr[r] + col);
      }
    }
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int col = N * lane + (i0 + u) * STEP;
      if (i0 + u < IT && col < K) {
        lfm_vec<T, N> wu[R];
#pragma unroll
        for (int r = 0; r < R; r++) wu[r] = wv[r][u];
        lfm_dot_step<T, K, M, R, N, ALIGNED>(x, col, wu, acc);
      }
    }
  }
}
template <typename T, int K, int M, int R>
__device__ inline void lfm_dot_rows(const T* x, bool xa, const T* const* wr, bool wa, int lane, float* acc) {
  if (xa && wa) {
    lfm_dot_rows_a<T, K, M, R, true>(x, wr, lane, acc);
  } else {
    lfm_dot_rows_a<T, K, M, R, false>(x, wr, lane, acc);
  }
}
// silu(g) * u from the two projections' float sums, each step in T as
// MLX's CUDA ops compute it: each projection rounded to T, then its Sigmoid
// functor in T (y = 1 / (1 + exp(|g|)), g < 0 ? y : 1 - y, with exp and
// abs as MLX's device code maps them for half types: hexp, __habs; the
// half types' operators round each step), g * sigmoid(g), times u.
__device__ inline __nv_bfloat16 lfm_exp_t(__nv_bfloat16 v) { return hexp(v); }
__device__ inline __half lfm_exp_t(__half v) { return hexp(v); }
__device__ inline float lfm_exp_t(float v) { return expf(v); }
__device__ inline __nv_bfloat16 lfm_abs_t(__nv_bfloat16 v) { return __habs(v); }
__device__ inline __half lfm_abs_t(__half v) { return __habs(v); }
__device__ inline float lfm_abs_t(float v) { return fabsf(v); }
template <typename T>
__device__ inline T lfm_sigmoid_t(T gt) {
  const T one = T(1.0f);
  const T y = one / (one + lfm_exp_t(lfm_abs_t(gt)));
  return static_cast<float>(gt) < 0.0f ? y : one - y;
}
template <typename T>
__device__ inline T lfm_swiglu(float g, float u) {
  const T gt = T(g);
  return (gt * lfm_sigmoid_t<T>(gt)) * T(u);
}
// Output columns n .. n + C - 1 (this warp's) of x @ w.T for M rows:
// y[m, n + c]. The C rows are walked together, each summed in MLX's order
// (so the same bits as a warp a column), x read once a step for all of
// them; a column past N re-reads the last row and is not stored.
template <typename T, int K, int M, int C = 1>
__device__ inline void lfm_gemv_warp(const T* x, bool xa, const T* w, bool wa, T* y, int N, int n, int lane) {
  float acc[C * M];
#pragma unroll
  for (int i = 0; i < C * M; i++) acc[i] = 0.0f;
  const T* rows[C];
#pragma unroll
  for (int c = 0; c < C; c++) rows[c] = w + static_cast<size_t>(n + c < N ? n + c : N - 1) * K;
  lfm_dot_rows<T, K, M, C>(x, xa, rows, wa, lane, acc);
#pragma unroll
  for (int c = 0; c < C; c++) {
#pragma unroll
    for (int m = 0; m < M; m++) {
      const float s = lfm_warp_sum(acc[c * M + m]);
      if (lane == 0 && n + c < N) y[static_cast<size_t>(m) * N + n + c] = T(s);
    }
  }
}
// Columns n .. n + C - 1 of silu(x @ w[..F].T) * (x @ w[F..].T) for the
// stacked [2F, K] w: the C gate rows and the C up rows walked together.
template <typename T, int K, int M, int C = 1>
__device__ inline void lfm_gemv_swiglu_warp(const T* x, bool xa, const T* w, bool wa, T* y, int F, int n, int lane) {
  float acc[2 * C * M];
#pragma unroll
  for (int i = 0; i < 2 * C * M; i++) acc[i] = 0.0f;
  const T* rows[2 * C];
#pragma unroll
  for (int c = 0; c < C; c++) {
    const int f = n + c < F ? n + c : F - 1;
    rows[c] = w + static_cast<size_t>(f) * K;
    rows[C + c] = w + static_cast<size_t>(F + f) * K;
  }
  lfm_dot_rows<T, K, M, 2 * C>(x, xa, rows, wa, lane, acc);
#pragma unroll
  for (int c = 0; c < C; c++) {
#pragma unroll
    for (int m = 0; m < M; m++) {
      const float g = lfm_warp_sum(acc[c * M + m]);
      const float u = lfm_warp_sum(acc[(C + c) * M + m]);
      if (lane == 0 && n + c < F) y[static_cast<size_t>(m) * F + n + c] = lfm_swiglu<T>(g, u);
    }
  }
}
// Output columns a warp takes (MLX_LFM_GEMV_COLS, an A/B's knob).
#ifndef LFM_COLS
#define LFM_COLS 1
#endif
";

const SOURCE: &str = r#"
  const int N = w_shape[0];
  const int n = (blockIdx.x * (256 / 32) + threadIdx.x / 32) * LFM_COLS;
  if (n >= N) return;
  lfm_gemv_warp<T, K, M, LFM_COLS>(x, lfm_aligned(x), w, lfm_aligned(w), y, N, n, threadIdx.x % 32);
"#;

/// The MLP's `silu(x @ w1.T) * (x @ w3.T)` from the stacked `[w1; w3]`
/// (`[2F, K]`): a warp reads row n of each half and writes the gated value,
/// so the `[.., 2F]` projection is never written and the gate is not a
/// kernel of its own. Rounded as the stock ops round (`lfm_swiglu`).
const SWIGLU_SOURCE: &str = r#"
  const int F = w_shape[0] / 2;
  const int n = (blockIdx.x * (256 / 32) + threadIdx.x / 32) * LFM_COLS;
  if (n >= F) return;
  lfm_gemv_swiglu_warp<T, K, M, LFM_COLS>(x, lfm_aligned(x), w, lfm_aligned(w), y, F, n, threadIdx.x % 32);
"#;

/// How the dense GEMVs (and the SwiGLU GEMV) walk a row
/// (`MLX_LFM_GEMV_LOOP`): by default batches of loads, each issued before
/// its sums; `prefetch`, the same after an L2 prefetch of the whole row
/// (the default until session 26); `plain`, MLX's own loop, one load at a
/// time. Every walk sums the same columns in the same order: the same bits
/// (`gemv_kernel_matches_stock_ops` holds the walks to each other).
/// Session 26's `kernel-bench` on the H200 (ncu, each kernel alone, caches
/// flushed; `bench/results/2026-12-05-h200-session26.raw.jsonl`) timed the
/// walk without the prefetch at or under MLX's `gemv_single` on every
/// shape of the 1.2B (2048 x 2048: 5.38 against 5.47 µs; 6144 x 2048: 8.64
/// against 8.70; 2048 x 8192: 12.42 against 12.86; the 65,536-row head:
/// 60.3 against 61.7) and the prefetching walk 14-19% slower on the wide
/// ones (10.72, 14.94, 70.5 µs): the prefetch cost more than it hid.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Walk {
    Batched,
    NoPrefetch,
    Plain,
}

fn walk() -> Walk {
    static W: OnceLock<Walk> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_GEMV_LOOP", &W, |v| match v {
        Some("plain") => Walk::Plain,
        Some("prefetch") => Walk::Batched,
        _ => Walk::NoPrefetch,
    })
}

/// Output columns a warp takes (`MLX_LFM_GEMV_COLS`: 1, the default, 2 or
/// 4; an A/B's knob), for the dense GEMVs and the dense norm folds. Each
/// column's row is still summed in MLX's order (the same bits); more
/// columns a warp read `x` (or the fold's shared rows) once for all of
/// them, issue fewer instructions a weight byte and, in the folds, run the
/// norm's prologue in fewer blocks: session 21's ncu put the 1.2B's
/// 6,144-column fold at 45 cycles a warp's issue, ~730 instructions a
/// warp, 22% of DRAM's peak.
pub(crate) fn cols() -> i32 {
    static C: OnceLock<i32> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_GEMV_COLS", &C, |v| match v.map(str::trim) {
        Some("2") => 2,
        Some("4") => 4,
        _ => 1,
    })
}

/// `cols()` as an index of a kernel's variants, its name's suffix and the
/// define its source is compiled with.
pub(crate) fn cols_variant() -> (usize, &'static str, &'static str) {
    match cols() {
        2 => (1, "_c2", "#define LFM_COLS 2\n"),
        4 => (2, "_c4", "#define LFM_COLS 4\n"),
        _ => (0, "", ""),
    }
}

/// A kernel's cells: one for each walk, each for each [`cols`].
type Cells = [[OnceLock<Option<CudaKernel>>; 3]; 3];

/// The kernel named `name` (suffixed by its walk and columns) over
/// `source`, one per walk and column count.
fn for_walk(cells: &'static Cells, name: &str, source: &str) -> Option<&'static CudaKernel> {
    let (i, suffix, defines) = match walk() {
        Walk::Batched => (0, "", ""),
        Walk::NoPrefetch => (1, "_no_prefetch", "#define LFM_DENSE_PREFETCH 0\n"),
        Walk::Plain => (2, "_plain", "#define LFM_DENSE_PLAIN 1\n"),
    };
    let (c, csuffix, cdefine) = cols_variant();
    cells[i][c]
        .get_or_init(|| {
            CudaKernel::new(&format!("{name}{suffix}{csuffix}"), &["x", "w"], &["y"], source, &format!("{defines}{cdefine}{}", header())).ok()
        })
        .as_ref()
}

fn kernel() -> Option<&'static CudaKernel> {
    static K: Cells = [const { [const { OnceLock::new() }; 3] }; 3];
    for_walk(&K, "lfm_gemv", SOURCE)
}

fn swiglu_kernel() -> Option<&'static CudaKernel> {
    static K: Cells = [const { [const { OnceLock::new() }; 3] }; 3];
    for_walk(&K, "lfm_gemv_swiglu", SWIGLU_SOURCE)
}

/// Whether the dense GEMV kernels take the `[N, K]` weight `w`:
/// `MLX_LFM_GEMV_KERNEL=1` for every weight, `=0` for none; unset, weights
/// at most [`default_max_k`] wide. On the H200 (bench/results/2026-12-03-h200-session12.*)
/// the kernels with the norm fold on every weight decoded the 350M (K =
/// 1024 but for w2) 1.22x faster than MLX's GEMVs, taking a third of its
/// step's nodes off the host (call 5), and the 1.2B (K = 2048 and 8192)
/// 0.83x: there the step is bound by the GPU, where the kernels read those
/// rows more slowly than MLX's `gemv_single`; on the 1.2B's weights of at
/// most 24 MiB alone they still lost (call 8). By default one row only
/// (a single sequence's step, what those A/Bs timed); a batched step keeps
/// MLX's products unless the switch is on.
pub(crate) fn serves_weight(w: &Array, rows: usize) -> bool {
    serves_up_to(w, rows, default_max_k())
}

/// The switch's rule for a weight: `MLX_LFM_GEMV_KERNEL` where set, else
/// one row of a weight at most `max_k` wide.
fn serves_up_to(w: &Array, rows: usize, max_k: usize) -> bool {
    static ON: OnceLock<Option<bool>> = OnceLock::new();
    super::switch("MLX_LFM_GEMV_KERNEL", &ON).unwrap_or_else(|| rows == 1 && w.ndim() == 2 && w.dim(1) as usize <= max_k)
}

/// The widest input (K) the GEMV kernels take by default:
/// `MLX_LFM_GEMV_KERNEL_MAX_K` (an A/B's knob), else 1024.
pub(crate) fn default_max_k() -> usize {
    static MAX: OnceLock<usize> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_GEMV_KERNEL_MAX_K", &MAX, |v| {
        v.and_then(|v| v.trim().parse::<usize>().ok()).filter(|&k| k <= 1 << 20).unwrap_or(1024)
    })
}

/// Whether the kernel serves `x @ w.T`: on for `w` ([`serves_weight`]), on CUDA, float `x` and `w` of one
/// dtype, `w` 2-D `[N, K]` with K a multiple of 8 (whole 16-byte loads) and
/// at most 16,384, `x` `[.., K]` with 1 to [`MAX_ROWS`] rows.
pub fn available(x: &Array, w: &Array) -> bool {
    fits(x, w, serves_weight) && kernel().is_some()
}

/// The operands' limits of every dense GEMV kernel, with `serves` (the
/// switch's rule for a weight and a row count).
fn fits(x: &Array, w: &Array, serves: fn(&Array, usize) -> bool) -> bool {
    if !cuda_kernels_enabled() {
        return false;
    }
    let dt = x.dtype();
    if !dt.is_float() || dt == Dtype::Float64 || w.dtype() != dt || w.ndim() != 2 || x.ndim() < 1 {
        return false;
    }
    let k = w.dim(1);
    let rows = if x.dim(-1) > 0 { x.size() / x.dim(-1) as usize } else { 0 };
    if !serves(w, rows) {
        return false;
    }
    x.dim(-1) == k && k > 0 && k % 8 == 0 && k <= 16_384 && w.dim(0) > 0 && (1..=MAX_ROWS).contains(&rows)
}

/// Whether [`gemv_swiglu`] serves `x` and the stacked `w`.
pub fn swiglu_available(x: &Array, w: &Array) -> bool {
    fits(x, w, serves_swiglu_weight) && w.dim(0) % 2 == 0 && swiglu_kernel().is_some()
}

/// As [`serves_weight`], with its own widest input:
/// `MLX_LFM_SWIGLU_GEMV_MAX_K` (an A/B's knob), else [`SWIGLU_MAX_K`] or
/// the GEMVs' if wider. On the 1.2B (K = 2048) MLX's GEMV of the stacked
/// w1/w3 is followed by a Split, a copy and the compiled gate, three
/// kernels a layer (4.1 + 2.8 us under session 22's ncu, 16 layers) that
/// this kernel's gate in the same launch leaves out, where the other
/// K = 2048 GEMVs of ours lost to MLX's on GPU time (1.25-1.64 ms a step
/// against 1.09, session 22).
fn serves_swiglu_weight(w: &Array, rows: usize) -> bool {
    static MAX: OnceLock<Option<usize>> = OnceLock::new();
    let max = crate::knobs::cached("MLX_LFM_SWIGLU_GEMV_MAX_K", &MAX, |v| {
        v.and_then(|v| v.trim().parse::<usize>().ok()).filter(|&k| k <= 1 << 20)
    });
    serves_up_to(w, rows, max.unwrap_or_else(|| SWIGLU_MAX_K.max(default_max_k())))
}

/// The SwiGLU GEMV's widest input by default, since session 23: the
/// H200's paired A/B put the 1.2B's decode at 1.027x with it (1.046x with
/// the shared-memory attention; its GPU time a step 1,114-1,122 us against
/// the defaults' 1,086-1,115, two samples each), and its test gave the
/// stock ops' bits at that shape (sessions 22 and 23), so a model's
/// tokens are the stock path's.
/// `MLX_LFM_SWIGLU_GEMV_MAX_K=1024` restores the GEMVs' bound.
const SWIGLU_MAX_K: usize = 2048;

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

/// A warp for each [`cols()`] of `cols` output columns; the output is `x`'s
/// shape with `cols` as its last axis.
fn launch(kern: &CudaKernel, x: &Array, w: &Array, cols: i32) -> Result<Array> {
    let k = w.dim(1);
    let rows = x.size() / k as usize;
    let per_block = THREADS / 32;
    let per_warp = self::cols();
    let warps = (cols + per_warp - 1) / per_warp;
    let blocks = (warps + per_block - 1) / per_block;
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

#[cfg(test)]
mod default_tests {
    use super::serves_weight;
    use crate::mlx::{zeros, Dtype};

    /// Whether the environment sets the switches these tests hold to their
    /// default rule (then they say so and skip).
    fn default_rule_overridden() -> bool {
        let set = std::env::var_os("MLX_LFM_GEMV_KERNEL").is_some() || std::env::var_os("MLX_LFM_GEMV_KERNEL_MAX_K").is_some();
        if set {
            eprintln!("skipped: MLX_LFM_GEMV_KERNEL(_MAX_K) is set, so the default rule is not what runs");
        }
        set
    }

    /// Unset, the switch serves one row of a weight at most 1024 wide (what
    /// the H200's A/B timed); a test's opt-in turns it on for any.
    #[test]
    fn gemv_default_serves_one_row_of_narrow_weights() {
        if default_rule_overridden() {
            return;
        }
        let narrow = zeros(&[16, 1024], Dtype::Bfloat16).unwrap();
        let wide = zeros(&[16, 2048], Dtype::Bfloat16).unwrap();
        assert!(serves_weight(&narrow, 1));
        assert!(!serves_weight(&narrow, 2), "a batched step keeps MLX's products by default");
        assert!(!serves_weight(&wide, 1), "inputs wider than 1024 keep MLX's GEMV by default");
        crate::kernels::with_opt_in_one("MLX_LFM_GEMV_KERNEL", || {
            assert!(serves_weight(&wide, 8));
        });
    }

    /// The SwiGLU GEMV's own widest input: unset, 2048 (the 1.2B's, the
    /// plain GEMVs keeping 1024); set, one row of a weight up to it.
    #[test]
    fn swiglu_gemv_takes_its_own_widest_input() {
        use super::serves_swiglu_weight;
        if default_rule_overridden() {
            return;
        }
        let narrow = zeros(&[16, 1024], Dtype::Bfloat16).unwrap();
        let wide = zeros(&[16, 2048], Dtype::Bfloat16).unwrap();
        let wider = zeros(&[16, 4096], Dtype::Bfloat16).unwrap();
        let unset = [("MLX_LFM_SWIGLU_GEMV_MAX_K".to_string(), None)];
        crate::knobs::with_overrides(&unset, || {
            assert!(serves_swiglu_weight(&narrow, 1));
            assert!(serves_swiglu_weight(&wide, 1), "unset, 2048");
            assert!(!serves_swiglu_weight(&wider, 1), "unset, not past 2048");
            assert!(!serves_swiglu_weight(&wide, 2), "a batched step keeps MLX's products");
            assert!(!serves_weight(&wide, 1), "the plain GEMVs keep their own bound");
        });
        let off = [("MLX_LFM_SWIGLU_GEMV_MAX_K".to_string(), Some("1024".to_string()))];
        crate::knobs::with_overrides(&off, || {
            assert!(serves_swiglu_weight(&narrow, 1));
            assert!(!serves_swiglu_weight(&wide, 1), "1024: the GEMVs' bound again");
        });
    }
}
