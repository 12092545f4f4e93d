//! The residual add, the RMSNorm after it and the projection that reads the
//! norm, in one launch for a decode step's few rows: `s = h + r`,
//! `y = (rms_norm(s) * wn) @ w.T` (dense, dense with the SwiGLU gate over a
//! stacked `[w1; w3]`, or affine quantized). Each block first computes the
//! rows' sum and norm into shared memory exactly as the fused add + RMSNorm
//! kernel (src/kernels/add_rms_norm.rs) does, block 0 writes `s`, then each
//! warp runs the GEMV of its output column over the shared rows. By the H200
//! profile the add + RMSNorm launches are 31 a token on the 1.2B (~170 µs of
//! a 1.3 ms step) and 47 on the 8B-A1B: every norm whose only reader is one
//! projection (attention's qkv, the conv's in_proj, a dense MLP's w1/w3) is
//! folded into that projection's launch.
//!
//! On CUDA by default for the dense weights the GEMV kernels take by
//! default (src/kernels/gemv.rs, `serves_weight`); opt-in for quantized
//! ones (`MLX_LFM_NORM_GEMV_KERNEL=1` with the quantized GEMV's switch);
//! `=0` turns the fold off; `MLX_LFM_NORM_GEMV_PREFETCH=early` (opt-in)
//! asks L2 for each warp's first rows before the norm;
//! `MLX_LFM_FOLD_EPS_CONST=1` (opt-in) compiles eps in;
//! `MLX_LFM_NORM_GEMV_DEFERRED=1` (opt-in) takes the dense folds without
//! the prologue ([`DEFERRED_HEADER`]). Tests in src/kernels/tests.rs.

use super::add_rms_norm::{for_walk, Walks, EPS_CONST_SUBSTITUTIONS};
use super::quant_gemv::{quant_template, spec_served, warp_grid, THREADS};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::Quantized;
use std::sync::OnceLock;

/// Rows one launch serves.
pub const MAX_ROWS: usize = 8;
/// The normed rows live in static shared memory (48 KiB a block at most,
/// with room left for the reduction's and MLX's own).
const SHARED_BYTES: usize = 40 * 1024;

/// The norm is computed once per block, so each block serves many output
/// columns: a grid of at most [`MAX_BLOCKS`] blocks, each warp striding
/// over columns. (The first version, one block per 8 columns, ran the
/// prologue for every 8 columns: 0.65 TB/s on the 1.2B's qkv and in_proj in
/// the H200 profile of 2026-12-02.)
pub(crate) const PROLOGUE: &str = "
  __shared__ uint4 ys_store[M * K * sizeof(T) / 16];
  T* ys = reinterpret_cast<T*>(ys_store);
  {
    const float e = eps[0];
    const bool aligned = lfm_aligned(h) && lfm_aligned(r) && lfm_aligned(wn) && lfm_aligned(s);
    for (int m = 0; m < M; m++) {
      const size_t o = static_cast<size_t>(m) * K;
      T* sm = blockIdx.x == 0 ? s + o : nullptr;
      if (aligned) {
        lfm_add_rms_row<T, K, 256, true>(h + o, r + o, wn, e, sm, ys + o);
      } else {
        lfm_add_rms_row<T, K, 256, false>(h + o, r + o, wn, e, sm, ys + o);
      }
    }
    __syncthreads();
  }
  const int lane = threadIdx.x % 32;
  const int first = (blockIdx.x * (256 / 32) + threadIdx.x / 32) * LFM_COLS;
  const int stride = gridDim.x * (256 / 32) * LFM_COLS;
";

/// The early prefetch (`MLX_LFM_NORM_GEMV_PREFETCH=early`, opt-in until its
/// H200 A/B): before the prologue, each warp asks L2 for the weight rows of
/// its first column, so that their DRAM reads run while the block computes
/// the norm instead of after it. Session 20's A/B on the 1.2B: with the
/// fold at K = 2048 the step turned GPU-bound (the wait for a token
/// 200-385 µs), with the same GEMVs and no fold it did not (10-45 µs); at
/// that width the prologue (the row's loads, two block barriers) is about
/// as long as a block's share of the GEMV, and no weight load is in flight
/// during it. A prefetch takes no register and has no consumer: the sums
/// are the same, bit for bit (the test holds it).
const DENSE_EARLY: &str = r#"
  {
    const int n0 = (blockIdx.x * (256 / 32) + threadIdx.x / 32) * LFM_COLS;
    for (int c = 0; c < LFM_COLS; c++) {
      if (n0 + c < w_shape[0] && lfm_aligned(w)) lfm_prefetch_dense<T, K>(w + static_cast<size_t>(n0 + c) * K, threadIdx.x % 32);
    }
  }
"#;

const SWIGLU_EARLY: &str = r#"
  {
    const int f = w_shape[0] / 2;
    const int n0 = (blockIdx.x * (256 / 32) + threadIdx.x / 32) * LFM_COLS;
    for (int c = 0; c < LFM_COLS; c++) {
      if (n0 + c < f && lfm_aligned(w)) {
        lfm_prefetch_dense<T, K>(w + static_cast<size_t>(n0 + c) * K, threadIdx.x % 32);
        lfm_prefetch_dense<T, K>(w + static_cast<size_t>(f + n0 + c) * K, threadIdx.x % 32);
      }
    }
  }
"#;

/// The packed words of the first column's row (its scales and biases, a
/// few dozen bytes, come with the GEMV's own loads).
const QUANT_EARLY: &str = r#"
  {
    constexpr int ROW_BYTES = K * BITS / 8;
    const int n0 = blockIdx.x * (256 / 32) + threadIdx.x / 32;
    if (ROW_BYTES % 16 == 0 && n0 < w_shape[0] && lfm_aligned(w)) {
      constexpr int C = ROW_BYTES / 16;
      lfm_prefetch_row<(C + 31) / 32, C>(w + static_cast<size_t>(n0) * (ROW_BYTES / 4), threadIdx.x % 32);
    }
  }
"#;

const DENSE_SOURCE: &str = r#"
  const int N = w_shape[0];
  for (int n = first; n < N; n += stride) lfm_gemv_warp<T, K, M, LFM_COLS>(ys, true, w, lfm_aligned(w), y, N, n, lane);
"#;

const SWIGLU_SOURCE: &str = r#"
  const int F = w_shape[0] / 2;
  for (int n = first; n < F; n += stride) lfm_gemv_swiglu_warp<T, K, M, LFM_COLS>(ys, true, w, lfm_aligned(w), y, F, n, lane);
"#;

const QUANT_SOURCE: &str = r#"
  const int N = w_shape[0];
  for (int n = first; n < N; n += stride) {
    lfm_qgemv_warp<T, K, M, BITS, GS>(ys, true, w, scales, biases, y, N, n, lane);
  }
"#;

/// The deferred fold (`MLX_LFM_NORM_GEMV_DEFERRED=1`, opt-in until its
/// H200 test and A/B): no prologue. RMSNorm scales a row by one number, so
/// `(rms_norm(s) * wn) . w_n = (s * wn) . w_n * rsqrt(mean(s^2) + eps)`:
/// each warp walks `h`, `r` and `wn` beside its weight rows, forms
/// `s = T(h + r)` as the add rounds it, sums `s^2` and `(s * wn) * w` in
/// float32, and scales its sums once at the end. No barrier, no shared
/// memory, and a warp's weight loads are in flight from its first step:
/// session 20's A/B found the prologue folds at K = 2048 slower than
/// MLX's GEMV after a separate norm, because no weight load was in flight
/// while each block computed the norm (the step's GPU time rose ~200 µs).
/// The price: every warp reads `h`, `r` and `wn` (L1 after its block's
/// first warp) and the normed row is no longer rounded to T before the
/// product, so the sums are within a rounding of the stock ops', not
/// theirs to the bit (its test holds it to the exact product of the row
/// normed in float32, at least as close as the stock ops, and its residual
/// sum to the bit; the greedy tests' set
/// `norm-gemv-deferred`). The warp of the first column writes `s`. Eps is
/// compiled in (`EPS_BITS`): the fold is taken only where the caller gives
/// its value.
const DEFERRED_HEADER: &str = r#"
template <typename T, int N, bool ALIGNED>
__device__ inline void lfm_storev(T* p, const lfm_vec<T, N>& v) {
  if constexpr (ALIGNED) {
    *reinterpret_cast<lfm_vec<T, N>*>(p) = v;
  } else {
#pragma unroll
    for (int j = 0; j < N; j++) p[j] = v.e[j];
  }
}
// acc[q * M + m] += this lane's share of w[q] . (s[m] * g), ss[m] += its
// share of s[m]^2, with s = T(h + r) (written to `so` where non-null); the
// weight loads of a batch issued before its sums, as lfm_dot_rows_a.
template <typename T, int K, int M, int R, bool ALIGNED>
__device__ inline void lfm_dot_rows_deferred_a(const T* h, const T* r, const T* g, T* so, const T* const* wr, int lane,
                                               float* acc, float* ss) {
  constexpr int N = lfm_npt<K>::v;
  constexpr int STEP = 32 * N;
  constexpr int IT = (K + STEP - 1) / STEP;
  constexpr int BR = R <= 2 ? LFM_BATCH : (16 / R < 2 ? 2 : 16 / R);
  constexpr int B = IT < BR ? IT : BR;
#pragma unroll
  for (int i0 = 0; i0 < IT; i0 += B) {
    lfm_vec<T, N> wv[R][B];
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int col = N * lane + (i0 + u) * STEP;
      if (i0 + u < IT && col < K) {
#pragma unroll
        for (int q = 0; q < R; q++) wv[q][u] = lfm_loadv<T, N, ALIGNED>(wr[q] + col);
      }
    }
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int col = N * lane + (i0 + u) * STEP;
      if (i0 + u < IT && col < K) {
        const lfm_vec<T, N> gv = lfm_loadv<T, N, ALIGNED>(g + col);
#pragma unroll
        for (int m = 0; m < M; m++) {
          const size_t o = static_cast<size_t>(m) * K + col;
          const lfm_vec<T, N> hv = lfm_loadv<T, N, ALIGNED>(h + o);
          const lfm_vec<T, N> rv = lfm_loadv<T, N, ALIGNED>(r + o);
          lfm_vec<T, N> sv;
#pragma unroll
          for (int j = 0; j < N; j++) sv.e[j] = T(static_cast<float>(hv.e[j]) + static_cast<float>(rv.e[j]));
          if (so) lfm_storev<T, N, ALIGNED>(so + o, sv);
#pragma unroll
          for (int j = 0; j < N; j++) {
            const float sf = static_cast<float>(sv.e[j]);
            ss[m] += sf * sf;
            const float xf = sf * static_cast<float>(gv.e[j]);
#pragma unroll
            for (int q = 0; q < R; q++) acc[q * M + m] += static_cast<float>(wv[q][u].e[j]) * xf;
          }
        }
      }
    }
  }
}
// The M rows' 1 / rms after the walk: every lane gets the warp's sums.
template <typename T, int K, int M, int R>
__device__ inline void lfm_dot_rows_deferred(const T* h, const T* r, const T* g, T* so, bool xa, const T* const* wr, bool wa,
                                             int lane, float eps, float* acc, float* nrm) {
  float ss[M];
#pragma unroll
  for (int m = 0; m < M; m++) ss[m] = 0.0f;
  if (xa && wa) {
    lfm_dot_rows_deferred_a<T, K, M, R, true>(h, r, g, so, wr, lane, acc, ss);
  } else {
    lfm_dot_rows_deferred_a<T, K, M, R, false>(h, r, g, so, wr, lane, acc, ss);
  }
#pragma unroll
  for (int m = 0; m < M; m++) nrm[m] = rsqrtf(lfm_warp_sum(ss[m]) / static_cast<float>(K) + eps);
}
"#;

const DENSE_DEFERRED_SOURCE: &str = r#"
  const int lane = threadIdx.x % 32;
  const int N = w_shape[0];
  const int n = (blockIdx.x * (256 / 32) + threadIdx.x / 32) * LFM_COLS;
  if (n >= N) return;
  const bool xa = lfm_aligned(h) && lfm_aligned(r) && lfm_aligned(wn) && lfm_aligned(s);
  float acc[LFM_COLS * M];
#pragma unroll
  for (int i = 0; i < LFM_COLS * M; i++) acc[i] = 0.0f;
  const T* rows[LFM_COLS];
#pragma unroll
  for (int c = 0; c < LFM_COLS; c++) rows[c] = w + static_cast<size_t>(n + c < N ? n + c : N - 1) * K;
  float nrm[M];
  lfm_dot_rows_deferred<T, K, M, LFM_COLS>(h, r, wn, n == 0 ? s : nullptr, xa, rows, lfm_aligned(w), lane,
                                           __int_as_float(EPS_BITS), acc, nrm);
#pragma unroll
  for (int c = 0; c < LFM_COLS; c++) {
#pragma unroll
    for (int m = 0; m < M; m++) {
      const float v = lfm_warp_sum(acc[c * M + m]);
      if (lane == 0 && n + c < N) y[static_cast<size_t>(m) * N + n + c] = T(v * nrm[m]);
    }
  }
"#;

const SWIGLU_DEFERRED_SOURCE: &str = r#"
  const int lane = threadIdx.x % 32;
  const int F = w_shape[0] / 2;
  const int n = (blockIdx.x * (256 / 32) + threadIdx.x / 32) * LFM_COLS;
  if (n >= F) return;
  const bool xa = lfm_aligned(h) && lfm_aligned(r) && lfm_aligned(wn) && lfm_aligned(s);
  float acc[2 * LFM_COLS * M];
#pragma unroll
  for (int i = 0; i < 2 * LFM_COLS * M; i++) acc[i] = 0.0f;
  const T* rows[2 * LFM_COLS];
#pragma unroll
  for (int c = 0; c < LFM_COLS; c++) {
    const int f = n + c < F ? n + c : F - 1;
    rows[c] = w + static_cast<size_t>(f) * K;
    rows[LFM_COLS + c] = w + static_cast<size_t>(F + f) * K;
  }
  float nrm[M];
  lfm_dot_rows_deferred<T, K, M, 2 * LFM_COLS>(h, r, wn, n == 0 ? s : nullptr, xa, rows, lfm_aligned(w), lane,
                                               __int_as_float(EPS_BITS), acc, nrm);
#pragma unroll
  for (int c = 0; c < LFM_COLS; c++) {
#pragma unroll
    for (int m = 0; m < M; m++) {
      const float g = lfm_warp_sum(acc[c * M + m]);
      const float u = lfm_warp_sum(acc[(LFM_COLS + c) * M + m]);
      if (lane == 0 && n + c < F) y[static_cast<size_t>(m) * F + n + c] = lfm_swiglu<T>(g * nrm[m], u * nrm[m]);
    }
  }
"#;

/// Blocks a launch uses at most: eight per SM of an H200 (132 SMs), so that
/// a warp serves one or two columns. At two per SM (264) a warp ran up to
/// three columns in turn, each waiting on DRAM: 26 µs a launch for the
/// 8B-A1B's 6144-column in_proj (ncu, 2026-12-02), where the norm each
/// block recomputes costs one round trip since its loads were batched.
const MAX_BLOCKS: i32 = 1056;

/// The norm's code and the GEMVs' headers; the quantized fold's through
/// [`super::quant_gemv::header`], so it makes q as the other quantized
/// kernels do (it took the raw header, and with it the conversion units'
/// walk, the default before session 38, until session 56: the same bits,
/// more time).
fn header(quant: bool) -> String {
    let gemvs = if quant { super::quant_gemv::header() } else { super::gemv::header() };
    format!("{}{gemvs}", super::add_rms_norm::device_code())
}

/// Whether the folds prefetch their first column's rows before the
/// prologue (`MLX_LFM_NORM_GEMV_PREFETCH=early`; see [`DENSE_EARLY`]).
fn early_prefetch() -> bool {
    static E: OnceLock<bool> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_NORM_GEMV_PREFETCH", &E, |v| v == Some("early"))
}

/// A fold's kernels: for each of the dense GEMVs' column counts
/// ([`super::gemv::cols`]; the quantized fold takes one), for each
/// prefetch, with eps read or compiled in, one for each walk of the norm's
/// runs (each its own name: MLX keeps compiled kernels by name).
type Variants = [[[Walks; 2]; 2]; 3];

/// Output columns a warp of this fold takes.
fn fold_cols(quant: bool) -> i32 {
    if quant {
        1
    } else {
        super::gemv::cols()
    }
}

fn make(cells: &'static Variants, name: &str, inputs: &[&str], early: &str, body: &str, quant: bool, eps_const: bool) -> Option<&'static CudaKernel> {
    let early_on = early_prefetch();
    // (The quantized fold: one column a warp, in MLX's arithmetic, in the
    // first of the cells the dense folds' column counts use.)
    let (c, csuffix, cdefine) = if quant { (0, super::quant_gemv::MLX_SUFFIX, "") } else { super::gemv::cols_variant() };
    for_walk(&cells[c][usize::from(early_on)][usize::from(eps_const)], || {
        let mut name = super::add_rms_norm::kernel_name(name);
        let prologue = if eps_const {
            name.push_str("_epsc");
            super::substituted(PROLOGUE, &EPS_CONST_SUBSTITUTIONS)
        } else {
            PROLOGUE.to_string()
        };
        let source = if early_on {
            name.push_str("_early");
            format!("{early}{prologue}{body}")
        } else {
            format!("{prologue}{body}")
        };
        name.push_str(csuffix);
        CudaKernel::new(&name, inputs, &["s", "y"], &source, &format!("{cdefine}{}", header(quant))).ok()
    })
}

/// The fold's cells: one per column count, prefetch, eps form and walk.
macro_rules! variants {
    () => {
        [const { [const { [const { [const { OnceLock::new() }; 2] }; 2] }; 2] }; 3]
    };
}

fn dense_kernel(eps_const: bool) -> Option<&'static CudaKernel> {
    static K: Variants = variants!();
    make(&K, "lfm_norm_gemv", &["h", "r", "wn", "eps", "w"], DENSE_EARLY, DENSE_SOURCE, false, eps_const)
}

fn swiglu_kernel(eps_const: bool) -> Option<&'static CudaKernel> {
    static K: Variants = variants!();
    make(&K, "lfm_norm_gemv_swiglu", &["h", "r", "wn", "eps", "w"], SWIGLU_EARLY, SWIGLU_SOURCE, false, eps_const)
}

fn quant_kernel(eps_const: bool) -> Option<&'static CudaKernel> {
    static K: Variants = variants!();
    make(&K, "lfm_norm_qgemv", &["h", "r", "wn", "eps", "w", "scales", "biases"], QUANT_EARLY, QUANT_SOURCE, true, eps_const)
}

/// Whether the folds are the deferred ones where eps's value is given
/// (`MLX_LFM_NORM_GEMV_DEFERRED=1`; [`DEFERRED_HEADER`]).
/// (A knob, not an opt-in kernel: a test's every-opt-in run keeps the
/// prologue folds, whose bits the eps and walk variants are held to; the
/// deferred folds have their own test cases and greedy set.)
fn deferred() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_NORM_GEMV_DEFERRED", &ON, |v| v == Some("1"))
}

/// The deferred dense or SwiGLU fold, one per column count.
fn deferred_kernel(swiglu: bool) -> Option<&'static CudaKernel> {
    static K: [[OnceLock<Option<CudaKernel>>; 3]; 2] = [const { [const { OnceLock::new() }; 3] }; 2];
    let (c, csuffix, cdefine) = super::gemv::cols_variant();
    K[usize::from(swiglu)][c]
        .get_or_init(|| {
            let (name, body) = if swiglu {
                ("lfm_norm_gemv_swiglu_deferred", SWIGLU_DEFERRED_SOURCE)
            } else {
                ("lfm_norm_gemv_deferred", DENSE_DEFERRED_SOURCE)
            };
            let header = format!("{cdefine}{}{DEFERRED_HEADER}", super::gemv::header());
            CudaKernel::new(&format!("{name}{csuffix}"), &["h", "r", "wn", "eps", "w"], &["s", "y"], body, &header).ok()
        })
        .as_ref()
}

/// The dense or SwiGLU fold these operands take: the deferred kernel where
/// it is on and eps's value is given, else the prologue's.
fn dense_fold(n: &NormIn, swiglu: bool) -> Option<(&'static CudaKernel, bool)> {
    if deferred() && n.eps_value.is_some() {
        // (One that did not build leaves the prologue fold.)
        if let Some(k) = deferred_kernel(swiglu) {
            return Some((k, true));
        }
    }
    let k = if swiglu { swiglu_kernel(n.eps_const().is_some()) } else { dense_kernel(n.eps_const().is_some()) };
    k.map(|k| (k, false))
}

/// `MLX_LFM_NORM_GEMV_KERNEL`: `Some(true)` at `=1`, `Some(false)` at `=0`,
/// None unset.
fn switched() -> Option<bool> {
    static ON: OnceLock<Option<bool>> = OnceLock::new();
    super::switch("MLX_LFM_NORM_GEMV_KERNEL", &ON)
}

/// Whether the fold takes the dense `w`: as the dense GEMV kernels do
/// ([`super::gemv::serves_weight`]: unset, one row, inputs at most 1024 wide),
/// unless `MLX_LFM_NORM_GEMV_KERNEL` says otherwise.
fn serves_dense(w: &Array, rows: usize) -> bool {
    switched().unwrap_or_else(|| super::gemv::serves_weight(w, rows))
}

/// Whether the folds compile eps in where the caller gives its value
/// (`MLX_LFM_FOLD_EPS_CONST=1`: opt-in until its H200 test and A/B; the
/// add + RMSNorm and router + norm kernels do by default since session 27,
/// and the folds are the 350M's default projections, 32 launches a step).
/// The prologue otherwise reads eps from its `[1]` array in MLX 0.32.4's
/// managed scalar pool, across the bus (~1.6 µs a launch, session 26's
/// kernel-bench), before the norm and so before everything after it;
/// compiled in, it takes the add + RMSNorm kernel's substitution
/// (`add_rms_norm::EPS_CONST_SUBSTITUTIONS`): the same float, the same bits.
fn fold_eps_const() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_in("MLX_LFM_FOLD_EPS_CONST", &ON) && super::add_rms_norm::eps_const()
}

/// `rms_norm(h + r) * wn` for the fused kernels: `h` and `r` `[.., K]` of
/// one shape, `wn` `[K]`, `eps` a float32 `[1]` array.
pub struct NormIn<'a> {
    pub h: &'a Array,
    pub r: &'a Array,
    pub wn: &'a Array,
    pub eps: &'a Array,
    /// `eps`'s value where the caller has it: the folds then compile it in
    /// under `MLX_LFM_FOLD_EPS_CONST=1` (the add + RMSNorm kernel's substitution).
    pub eps_value: Option<f32>,
}

impl NormIn<'_> {
    /// eps's value, where the folds take it as a constant.
    fn eps_const(&self) -> Option<f32> {
        self.eps_value.filter(|_| fold_eps_const())
    }

    /// Whether the operands fit one another (`r` as `h`, `wn` one weight
    /// per column of `h` in its dtype, `eps` a float32 `[1]`): what every
    /// kernel that folds this norm asks before its own limits.
    pub(crate) fn consistent(&self) -> bool {
        let (h, dt) = (self.h, self.h.dtype());
        h.ndim() >= 1
            && self.r.dtype() == dt
            && self.wn.dtype() == dt
            && self.r.shape() == h.shape()
            && self.wn.shape() == [h.dim(-1)]
            && self.eps.dtype() == Dtype::Float32
            && self.eps.size() == 1
    }

    /// `(K, rows)` where the kernels serve these operands: on CUDA, one
    /// float dtype, 1 to [`MAX_ROWS`] rows, K a multiple of 8 and at most
    /// 16,384, the rows fitting in shared memory.
    fn served(&self) -> Option<(i32, usize)> {
        let (h, dt) = (self.h, self.h.dtype());
        if !cuda_kernels_enabled() || !self.consistent() {
            return None;
        }
        let k = h.dim(-1);
        let rows = if k > 0 { h.size() / k as usize } else { 0 };
        let ok = dt.is_float()
            && dt != Dtype::Float64
            && k > 0
            && k % 8 == 0
            && k <= 16_384
            && (1..=MAX_ROWS).contains(&rows)
            && rows * k as usize * dt.size() <= SHARED_BYTES;
        ok.then_some((k, rows))
    }
}

/// Whether [`norm_gemv`] serves `n` and the dense `[N, K]` `w`.
pub fn dense_available(n: &NormIn, w: &Array) -> bool {
    n.served().is_some_and(|(k, rows)| {
        serves_dense(w, rows) && w.dtype() == n.h.dtype() && w.ndim() == 2 && w.dim(1) == k && w.dim(0) > 0
    })
        && dense_fold(n, false).is_some()
}

/// Whether [`norm_gemv_swiglu`] serves `n` and the stacked `[2F, K]` `w`.
pub fn swiglu_available(n: &NormIn, w: &Array) -> bool {
    dense_available(n, w) && w.dim(0) % 2 == 0 && dense_fold(n, true).is_some()
}

/// Whether [`norm_qgemv`] serves `n` and the quantized `[N, K * bits / 32]`
/// `q` (the quantized GEMV's switch must be on too: it rounds as that
/// kernel does; the fold is opt-in for quantized weights).
pub fn quant_available(n: &NormIn, q: &Quantized) -> bool {
    switched() == Some(true) && super::quant_gemv::switched_on() && n.served().is_some_and(|(k, _)| {
        spec_served(q, n.h.dtype(), k)
            && q.weight.ndim() == 2
            && q.weight.dim(0) > 0
            && q.weight.dim(1) as i64 * 32 == k as i64 * q.spec.bits as i64
            && q.scales.shape() == [q.weight.dim(0), k / q.spec.group_size]
    }) && quant_kernel(n.eps_const().is_some()).is_some()
}

/// `(h + r, (rms_norm(h + r) * wn) @ w.T)`.
pub fn norm_gemv(n: &NormIn, w: &Array) -> Result<(Array, Array)> {
    let (kern, deferred) = dense_fold(n, false).ok_or_else(|| Error::mlx("the fused norm + GEMV kernel is not available"))?;
    launch(kern, n, &[w], w.dim(0), vec![], fold_cols(false), deferred)
}

/// `(h + r, silu(y @ w[..F].T) * (y @ w[F..].T))` with `y = rms_norm(h + r) * wn`.
pub fn norm_gemv_swiglu(n: &NormIn, w: &Array) -> Result<(Array, Array)> {
    let (kern, deferred) = dense_fold(n, true).ok_or_else(|| Error::mlx("the fused norm + GEMV + SwiGLU kernel is not available"))?;
    let n2 = w.dim(0);
    if n2 % 2 != 0 {
        return Err(Error::invalid(format!("norm + GEMV + SwiGLU: the stacked weight has an odd number of rows ({n2})")));
    }
    launch(kern, n, &[w], n2 / 2, vec![], fold_cols(false), deferred)
}

/// `(h + r, (rms_norm(h + r) * wn) @ dequantize(q).T)`.
pub fn norm_qgemv(n: &NormIn, q: &Quantized) -> Result<(Array, Array)> {
    let kern = quant_kernel(n.eps_const().is_some()).ok_or_else(|| Error::mlx("the fused norm + quantized GEMV kernel is not available"))?;
    let biases = q.biases.as_ref().ok_or_else(|| Error::invalid("the quantized GEMV kernels need affine biases"))?;
    let k = n.h.dim(-1);
    let mut template = quant_template(q, k, n.h.dtype());
    template.retain(|(name, _)| *name != "K" && *name != "T");
    launch(kern, n, &[&q.weight, &q.scales, biases], q.weight.dim(0), template, fold_cols(true), false)
}

/// A warp for each `per_warp` of `cols` output columns (striding over more
/// where the grid is capped: the prologue folds; a deferred one has no
/// prologue to share, and no cap); `y` is `h`'s shape with `cols` as its
/// last axis.
fn launch(
    kern: &CudaKernel,
    n: &NormIn,
    weights: &[&Array],
    cols: i32,
    mut template: Vec<(&'static str, TemplateArg)>,
    per_warp: i32,
    deferred: bool,
) -> Result<(Array, Array)> {
    let (h, dt) = (n.h, n.h.dtype());
    let k = h.dim(-1);
    let rows = h.size() / k as usize;
    let hs = h.shape();
    let mut ys = hs.clone();
    *ys.last_mut().ok_or_else(|| Error::invalid("norm + GEMV of a scalar"))? = cols;
    let mut inputs = vec![n.h, n.r, n.wn, n.eps];
    inputs.extend_from_slice(weights);
    template.extend([("K", TemplateArg::Int(k)), ("M", TemplateArg::Int(rows as i32)), ("T", TemplateArg::Dtype(dt))]);
    // (A deferred fold always has eps compiled in: it is taken only where
    // the value is given.)
    if let Some(e) = if deferred { n.eps_value } else { n.eps_const() } {
        template.push(("EPS_BITS", TemplateArg::Int(e.to_bits() as i32)));
    }
    let grid = warp_grid((cols + per_warp - 1) / per_warp)?;
    let grid = if deferred { grid } else { grid.min(MAX_BLOCKS * THREADS) };
    let mut outs = kern.call(&inputs, &[(&hs, dt), (&ys, dt)], [grid, 1, 1], [THREADS, 1, 1], &template)?;
    let y = outs.pop().ok_or_else(|| Error::mlx("norm + GEMV kernel: missing output"))?;
    let s = outs.pop().ok_or_else(|| Error::mlx("norm + GEMV kernel: missing output"))?;
    Ok((s, y))
}
