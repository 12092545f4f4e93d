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
pub(crate) fn block_for(d: i32, n_reads: i32) -> i32 {
    let mut b = 32;
    while b < 1024 && d > n_reads * b {
        b *= 2;
    }
    b
}

/// One row's add + RMSNorm for a block of `BLOCK` threads, shared with the
/// norm folded into a projection (src/kernels/norm_gemv.rs). Each thread's
/// 16-byte runs of `h`, `r` and `w` are all loaded before any is used and
/// kept in registers: the first version read and wrote element by element
/// and reread its own `s`, and as the compiler must assume `s` may alias
/// `h` and `r` it could not batch the loads past each store (~8 dependent
/// round trips a thread; ncu on the H200: 5.4 µs a launch for one 2048-wide
/// row). The arithmetic is unchanged.
pub(crate) const HEADER: &str = r#"#include <cooperative_groups/reduce.h>
// A 16-byte run's elements: with LFM_RUN_GUARDED (MLX_LFM_NORM_RUNS=guarded,
// opt-in until its H200 test), unrolled loops with a guard per element;
// otherwise the loop bound depends on the position, so the run's register
// array is indexed at run time and lives in local memory (a 64-byte stack
// frame in this kernel and the norm folds built on it, by ptxas;
// scripts/dev/nvrtc-check.py --ptxas). Same sums, same order.
#ifndef LFM_RUN_GUARDED
#define LFM_RUN_GUARDED 0
#endif
#ifndef LFM_NORM_IN_WIDER_BLOCK
#define LFM_NORM_IN_WIDER_BLOCK 0
#endif
#if LFM_RUN_GUARDED
#define LFM_RUN_FOR(i, n, live) _Pragma("unroll") for (int i = 0; i < (n); i++) if (live)
#else
#define LFM_RUN_FOR(i, n, live) for (int i = 0; i < (n) && (live); i++)
#endif
template <typename T>
__device__ inline uint4 lfm_run_load(const T* p, int base, int d, bool vec) {
  if (vec) return *reinterpret_cast<const uint4*>(p + base);
  uint4 v = make_uint4(0u, 0u, 0u, 0u);
  T* e = reinterpret_cast<T*>(&v);
  LFM_RUN_FOR(i, 16 / (int)sizeof(T), base + i < d) e[i] = p[base + i];
  return v;
}
template <typename T>
__device__ inline void lfm_run_store(T* p, int base, int d, bool vec, const uint4& v) {
  if (vec) {
    *reinterpret_cast<uint4*>(p + base) = v;
    return;
  }
  const T* e = reinterpret_cast<const T*>(&v);
  LFM_RUN_FOR(i, 16 / (int)sizeof(T), base + i < d) p[base + i] = e[i];
}
// s = h + r (rounded to T), y = w * T(s * rsqrt(mean(s^2) + eps)) for one
// row of D; s is written only where non-null. A thread's runs are
// tid, tid + BLOCK, ... (16 bytes each), its float32 sum of squares in
// element order, then the warp and the block (as MLX's rms_norm groups it).
// ALIGNED: every pointer on a 16-byte boundary and D a whole number of runs.
// (cooperative_groups spelled out: where MLX's generated source aliases it
// as cg relative to a header is not ours to rely on.)
template <typename T, int D, int BLOCK, bool ALIGNED>
__device__ inline void lfm_add_rms_row(const T* h, const T* r, const T* w, float eps, T* s, T* y) {
  constexpr int NR = 16 / sizeof(T);
  constexpr int RUNS = (D + BLOCK * NR - 1) / (BLOCK * NR);
  auto block = cooperative_groups::this_thread_block();
  auto warp = cooperative_groups::tiled_partition<32>(block);
  const int tid = threadIdx.x;
  // A block larger than BLOCK (the router's, a warp an expert: its kernel
  // defines LFM_NORM_IN_WIDER_BLOCK) runs the row with its first BLOCK
  // threads, so the sums are grouped as BLOCK's; in every other kernel
  // `in` is a constant true and the reduction is the code the H200's
  // tests ran.
#if LFM_NORM_IN_WIDER_BLOCK
  const bool in = tid < BLOCK;
#else
  constexpr bool in = true;
#endif
  uint4 hv[RUNS], rv[RUNS], wv[RUNS];
#pragma unroll
  for (int k = 0; k < RUNS; k++) {
    const int base = (tid + k * BLOCK) * NR;
    if (in && base < D) {
      const bool vec = ALIGNED && base + NR <= D;
      hv[k] = lfm_run_load(h, base, D, vec);
      rv[k] = lfm_run_load(r, base, D, vec);
      wv[k] = lfm_run_load(w, base, D, vec);
    }
  }
  float acc = 0.0f;
#pragma unroll
  for (int k = 0; k < RUNS; k++) {
    const int base = (tid + k * BLOCK) * NR;
    if (in && base < D) {
      const T* he = reinterpret_cast<const T*>(&hv[k]);
      const T* re = reinterpret_cast<const T*>(&rv[k]);
      T* se = reinterpret_cast<T*>(&hv[k]);
      LFM_RUN_FOR(i, NR, base + i < D) {
        const T v = T(static_cast<float>(he[i]) + static_cast<float>(re[i]));
        se[i] = v;
        const float f = static_cast<float>(v);
        acc += f * f;
      }
      if (s) lfm_run_store(s, base, D, ALIGNED && base + NR <= D, hv[k]);
    }
  }
  float total = cooperative_groups::reduce(warp, acc, cooperative_groups::plus<float>());
  if constexpr (BLOCK > 32) {
    __shared__ float part[BLOCK / 32];
#if LFM_NORM_IN_WIDER_BLOCK
    if (warp.thread_rank() == 0 && warp.meta_group_rank() < BLOCK / 32) part[warp.meta_group_rank()] = total;
    block.sync();
    const float x = warp.thread_rank() < BLOCK / 32 ? part[warp.thread_rank()] : 0.0f;
#else
    if (warp.thread_rank() == 0) part[warp.meta_group_rank()] = total;
    block.sync();
    const float x = warp.thread_rank() < warp.meta_group_size() ? part[warp.thread_rank()] : 0.0f;
#endif
    total = cooperative_groups::reduce(warp, x, cooperative_groups::plus<float>());
    // part is reused by the block's next row.
    block.sync();
  }
  const float nrm = rsqrtf(total / static_cast<float>(D) + eps);
#pragma unroll
  for (int k = 0; k < RUNS; k++) {
    const int base = (tid + k * BLOCK) * NR;
    if (in && base < D) {
      const T* se = reinterpret_cast<const T*>(&hv[k]);
      const T* we = reinterpret_cast<const T*>(&wv[k]);
      uint4 out;
      T* oe = reinterpret_cast<T*>(&out);
      LFM_RUN_FOR(i, NR, true) {
        oe[i] = T(static_cast<float>(we[i]) * static_cast<float>(T(static_cast<float>(se[i]) * nrm)));
      }
      lfm_run_store(y, base, D, ALIGNED && base + NR <= D, out);
    }
  }
}
"#;

pub(crate) const SOURCE: &str = r#"
  constexpr int NR = 16 / sizeof(T);
  const size_t row = blockIdx.x;
  const float e = eps[0];
  const bool aligned = D % NR == 0 && lfm_aligned(h) && lfm_aligned(r) && lfm_aligned(w) && lfm_aligned(s) && lfm_aligned(y);
  if (aligned) {
    lfm_add_rms_row<T, D, BLOCK, true>(h + row * D, r + row * D, w, e, s + row * D, y + row * D);
  } else {
    lfm_add_rms_row<T, D, BLOCK, false>(h + row * D, r + row * D, w, e, s + row * D, y + row * D);
  }
"#;

/// The add + RMSNorm device code with the alignment helpers it uses.
pub(crate) fn header() -> String {
    format!("{}{}", device_code(), super::gemv::ALIGN_HEADER)
}

/// Whether the runs are walked with a guard per element
/// (`MLX_LFM_NORM_RUNS=guarded`; see `HEADER`). Opt-in until its H200 test
/// and A/B: every kernel built on this code is made once for each walk.
fn guarded_runs() -> bool {
    static G: OnceLock<bool> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_NORM_RUNS", &G, |v| v == Some("guarded"))
}

/// A kernel built on this code, one for each walk of the runs.
pub(crate) type Walks = [OnceLock<Option<CudaKernel>>; 2];

/// The kernel of this walk from `cells`, made by `make` the first time
/// (which builds on [`device_code`] and [`kernel_name`]).
pub(crate) fn for_walk(cells: &'static Walks, make: impl FnOnce() -> Option<CudaKernel>) -> Option<&'static CudaKernel> {
    cells[usize::from(guarded_runs())].get_or_init(make).as_ref()
}

/// `HEADER` as this process compiles it.
pub(crate) fn device_code() -> String {
    let define = if guarded_runs() { "#define LFM_RUN_GUARDED 1\n" } else { "" };
    format!("{define}{HEADER}")
}

/// A kernel's name built on this code: its own for the guarded walk (MLX
/// keeps compiled kernels by name).
pub(crate) fn kernel_name(base: &str) -> String {
    if guarded_runs() {
        format!("{base}_guarded")
    } else {
        base.to_string()
    }
}

fn kernel() -> Option<&'static CudaKernel> {
    static K: Walks = [OnceLock::new(), OnceLock::new()];
    for_walk(&K, || CudaKernel::new(&kernel_name("lfm_add_rms_norm"), &["h", "r", "w", "eps"], &["s", "y"], SOURCE, &header()).ok())
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
    crate::knobs::cached("MLX_LFM_ADD_RMS_NORM_MAX_ROWS", &MAX, |v| match v {
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

/// The kernel with eps compiled in as a constant instead of read from its
/// `[1]` array: a CUDA default since session 27 (`MLX_LFM_EPS_CONST=0`
/// off; the H200's paired A/B of session 26: decode 1.03x / 1.08x / 1.01x
/// on the 350M / 1.2B / 8B-A1B; its test holds it to the array kernel's
/// bits, and the router + norm kernel takes its constants under it too). MLX
/// 0.32.4 keeps every array of at most 8 bytes in managed memory, in pages
/// the host also writes each token (the step's position), and a decode
/// step runs this kernel twice a layer (31 times on the 1.2B): whether
/// that read costs the GPU is what `kernel-bench`'s scalar arms ask.
pub(crate) fn eps_const() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_EPS_CONST", &ON)
}

/// The read of eps and what replaces it where eps is compiled in
/// (`EPS_BITS`, its float's bits, a template constant): the same arithmetic
/// on the same float. This kernel's and the norm folds' (src/kernels/norm_gemv.rs).
pub(crate) const EPS_CONST_SUBSTITUTIONS: [(&str, &str); 1] = [
    ("const float e = eps[0];", "const float e = __int_as_float(EPS_BITS);"),
];

/// The default kernel's source with eps a template constant.
fn const_kernel() -> Option<&'static CudaKernel> {
    static K: Walks = [OnceLock::new(), OnceLock::new()];
    for_walk(&K, || {
        let src = super::substituted(SOURCE, &EPS_CONST_SUBSTITUTIONS);
        CudaKernel::new(&kernel_name("lfm_add_rms_norm_epsc"), &["h", "r", "w", "eps"], &["s", "y"], &src, &header()).ok()
    })
}

/// [`add_rms_norm`] where the caller also has eps's value: the kernel that
/// has it as a constant (unless `MLX_LFM_EPS_CONST=0`).
pub fn add_rms_norm_with(h: &Array, r: &Array, w: &Array, eps: &Array, eps_value: f32) -> Result<(Array, Array)> {
    match const_kernel().filter(|_| eps_const()) {
        Some(kern) => launch(kern, h, r, w, eps, &[("EPS_BITS", TemplateArg::Int(eps_value.to_bits() as i32))]),
        None => add_rms_norm(h, r, w, eps),
    }
}

/// `(h + r, rms_norm(h + r) * w)`, both shaped like `h`; `eps` is a float32
/// `[1]` array (the model makes it once: a scalar here would be uploaded
/// twice per layer per token on the eager path).
pub fn add_rms_norm(h: &Array, r: &Array, w: &Array, eps: &Array) -> Result<(Array, Array)> {
    let kern = kernel().ok_or_else(|| Error::mlx("the fused add + RMSNorm kernel is not available"))?;
    launch(kern, h, r, w, eps, &[])
}

fn launch(kern: &CudaKernel, h: &Array, r: &Array, w: &Array, eps: &Array, extra: &[(&str, TemplateArg)]) -> Result<(Array, Array)> {
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
        &[&[("D", TemplateArg::Int(d)), ("BLOCK", TemplateArg::Int(block)), ("T", TemplateArg::Dtype(dt))][..], extra].concat(),
    )?;
    let y = outs.pop().ok_or_else(|| Error::mlx("add_rms_norm kernel: missing output"))?;
    let s = outs.pop().ok_or_else(|| Error::mlx("add_rms_norm kernel: missing output"))?;
    Ok((s, y))
}
