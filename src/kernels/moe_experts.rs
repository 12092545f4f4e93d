//! LFM2-MoE's routed experts for a decode step's few rows, in two kernels
//! over MLX affine quantized expert stacks:
//! - `gate_up`: for each row and each of its k experts, the stacked
//!   `[w1; w3]` GEMVs and the SwiGLU gate, `[R, k, F]` (the `[R, k, 2F]`
//!   projection is never written, the gate is no kernel of its own);
//! - `down`: for each row, `sum_j score_j * (h_j @ w2[e_j].T)`, `[R, D]`
//!   (no `[R, k, D]` intermediate, no multiply and reduce kernels).
//!
//! The stock graph is two `gather_qmv` launches at 0.6-0.7 TB/s plus ~6
//! small kernels per MoE layer (split, sigmoid, multiplies, the reduce):
//! on the 8B-A1B's 22 MoE layers, ~130 launches a token.
//!
//! Rounding follows the stock graph: each projection rounded to the dtype,
//! the gate as `lfm_swiglu`, each expert's output rounded and multiplied by
//! its score in the dtype, the k products summed in float32 and rounded
//! once (MLX's reduce accumulates bf16 in float32).
//!
//! On by default on CUDA (`MLX_LFM_MOE_KERNEL=0` turns it off): its
//! projections round as the quantized GEMV's do, closer to the exact
//! product than MLX's `gather_qmv` (see src/kernels/quant_gemv.rs); tests
//! in src/kernels/tests.rs. On the H200 the 8B-A1B decoded 1.65x and 1.83x
//! the defaults' rate with it (2026-12-02,
//! `bench/results/2026-12-02-h200-session9.raw.jsonl`, calls 3 and 7) and
//! 1.30x (2026-12-03, `bench/results/2026-12-03-h200-session11.raw.jsonl`),
//! and the greedy test's MoE fixture in 4-bit (router gate in groups of 32)
//! kept the stock ops' choices with it alone, compiled and eager (two
//! near-ties in 64 steps, leads 0.006 and 0.000).

use super::quant_gemv::{header, quant_template, spec_served, warp_grid, THREADS};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::Quantized;
use std::sync::OnceLock;

const GATE_UP_SOURCE: &str = r#"
  constexpr int G = K / GS;
  constexpr int WORDS = K * BITS / 32;
  const int lane = threadIdx.x % 32;
  const int rows = w_shape[1];
  const int F = rows / 2;
  const int n = blockIdx.x * (256 / 32) + threadIdx.x / 32;
  if (n >= F) return;
  const int slot = blockIdx.y;
  const size_t e = idx[slot];
  const size_t gi = e * rows + n;
  const size_t ui = e * rows + F + n;
  const T* xr = x + static_cast<size_t>(slot / KE) * K;
  float ag = 0.0f;
  float au = 0.0f;
  if (lfm_aligned(w) && lfm_aligned(x)) {
    lfm_qdot2_a<T, K, BITS, GS, true>(xr, w + gi * WORDS, scales + gi * G, biases + gi * G, w + ui * WORDS,
                                      scales + ui * G, biases + ui * G, lane, ag, au);
  } else {
    lfm_qdot2_a<T, K, BITS, GS, false>(xr, w + gi * WORDS, scales + gi * G, biases + gi * G, w + ui * WORDS,
                                       scales + ui * G, biases + ui * G, lane, ag, au);
  }
  ag = lfm_warp_sum(ag);
  au = lfm_warp_sum(au);
  if (lane == 0) y[static_cast<size_t>(slot) * F + n] = lfm_swiglu<T>(ag, au);
"#;

/// Each of a row's KE experts is its own warp (a block serves 8 / KE output
/// columns), their weighted outputs meet in shared memory and are summed in
/// expert order. The first version ran a column's experts one after another
/// in one warp: ~2 KiB of loads in flight a warp, 30 µs a launch on the
/// 8B-A1B (0.27 TB/s, ncu on the H200, 2026-12-02).
pub(crate) const DOWN_SOURCE: &str = r#"
  constexpr int G = K / GS;
  constexpr int WORDS = K * BITS / 32;
  constexpr int CPB = 8 / KE;
  __shared__ float part[8];
  const int lane = threadIdx.x % 32;
  const int wid = threadIdx.x / 32;
  const int D = w_shape[1];
  const int j = wid % KE;
  const int col = wid / KE;
  const int n = blockIdx.x * CPB + col;
  const int r = blockIdx.y;
  const bool active = col < CPB && n < D;
  if (active) {
    const int slot = r * KE + j;
    const size_t wi = static_cast<size_t>(idx[slot]) * D + n;
    const T* hr = h + static_cast<size_t>(slot) * K;
    float a = 0.0f;
    if (lfm_aligned(w) && lfm_aligned(h)) {
      lfm_qdot_a<T, K, 1, BITS, GS, true>(hr, w + wi * WORDS, scales + wi * G, biases + wi * G, lane, &a);
    } else {
      lfm_qdot_a<T, K, 1, BITS, GS, false>(hr, w + wi * WORDS, scales + wi * G, biases + wi * G, lane, &a);
    }
    a = lfm_warp_sum(a);
    if (lane == 0) part[wid] = static_cast<float>(T(static_cast<float>(T(a)) * static_cast<float>(score[slot])));
  }
  __syncthreads();
  if (active && j == 0 && lane == 0) {
    float total = 0.0f;
    for (int i = 0; i < KE; i++) total += part[col * KE + i];
    y[static_cast<size_t>(r) * D + n] = T(total);
  }
"#;

/// The one-column down kernel with every load of a warp issued before its
/// first sum (`MLX_LFM_MOE_DOWN_LOADS=early`, an A/B's knob): the score
/// with the expert index, then each chunk's words, scale, bias and h
/// values. In the default kernel ptxas, keeping it at 34 registers, leaves
/// the h chunk's later 16-byte loads each after the previous one's sums and
/// the score's load after the warp's shuffles, so a warp waits on ~7 loads
/// one after another (the sm_90 SASS of K = 1792 4-bit g64): session 26's
/// ncu had its warps 40 cycles an issue on loads (gate/up: 3) at 7% of
/// DRAM's bandwidth, 22 µs a launch against MLX's `gather_qmv` at 13.6.
/// The same chunks in the same order and the same expression, so within a
/// rounding of the default (NVVM may contract `s * qx + b * xs` the other
/// way, as it did in session 24's retired C-columns-a-warp kernel). Chunks
/// are loaded in batches of at most 16 16-byte h loads so a float32 h or a
/// long row does not spill. Session 27 on the H200 (tests passed; ncu, one
/// row alone): 25.5 µs against the default's 32.1 and MLX's 13.4, and
/// ncu's per-instruction view put most of either kernel's waiting on the
/// score's load, an 8-byte array in MLX's managed scalar pool (see
/// `moe_router::scores_f32`).
const DOWN_EARLY_HEADER: &str = r#"
template <typename T, int K, int BITS, int GS>
__device__ inline float lfm_qdot_early(const T* x, const uint32_t* wr, const T* sr, const T* br, int lane) {
  constexpr int VPC = 128 / BITS;
  constexpr int C = K / VPC;
  constexpr int IT = (C + 31) / 32;
  constexpr int E = 16 / sizeof(T);
  constexpr int XV = VPC / E;
  constexpr int BX = 16 / XV < 1 ? 1 : 16 / XV;
  constexpr int B = IT < BX ? IT : BX;
  float acc = 0.0f;
#pragma unroll
  for (int i0 = 0; i0 < IT; i0 += B) {
    uint4 wv[B];
    uint4 xv[B][XV];
    float s[B];
    float b[B];
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int c = lane + (i0 + u) * 32;
      if (i0 + u < IT && (C % 32 == 0 || c < C)) {
        wv[u] = lfm_load16(wr, c, true);
        s[u] = static_cast<float>(sr[c * VPC / GS]);
        b[u] = static_cast<float>(br[c * VPC / GS]);
#pragma unroll
        for (int t = 0; t < XV; t++) xv[u][t] = lfm_load16(x, static_cast<size_t>(c) * XV + t, true);
      }
    }
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int c = lane + (i0 + u) * 32;
      if (i0 + u < IT && (C % 32 == 0 || c < C)) {
        float xf[VPC];
        float xs = 0.0f;
#pragma unroll
        for (int t = 0; t < XV; t++) {
          const T* e = reinterpret_cast<const T*>(&xv[u][t]);
#pragma unroll
          for (int q = 0; q < E; q++) {
            xf[t * E + q] = static_cast<float>(e[q]);
            xs += xf[t * E + q];
          }
        }
        acc += s[u] * lfm_qx<BITS>(wv[u], xf) + b[u] * xs;
      }
    }
  }
  return acc;
}
"#;

/// `DOWN_SOURCE` with the aligned walk's sums from [`DOWN_EARLY_HEADER`]
/// and the score read beside the expert index: the substitutions, in
/// order (scripts/dev/nvrtc-check.py makes the same ones).
pub(crate) const DOWN_EARLY_SUBSTITUTIONS: [(&str, &str); 3] = [
    (
        "lfm_qdot_a<T, K, 1, BITS, GS, true>(hr, w + wi * WORDS, scales + wi * G, biases + wi * G, lane, &a);",
        "a = lfm_qdot_early<T, K, BITS, GS>(hr, w + wi * WORDS, scales + wi * G, biases + wi * G, lane);",
    ),
    ("const int slot = r * KE + j;", "const int slot = r * KE + j;\n    const float sc = static_cast<float>(score[slot]);"),
    ("static_cast<float>(T(a)) * static_cast<float>(score[slot])", "static_cast<float>(T(a)) * sc"),
];

/// `MLX_LFM_MOE_DOWN_LOADS=early`: the down kernel with its loads issued
/// first (`DOWN_EARLY_SUBSTITUTIONS`); anything else the default.
fn down_early() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_MOE_DOWN_LOADS", &ON, |v| v.map(str::trim) == Some("early"))
}

fn down_early_kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new(
            "lfm_moe_down_early",
            &["h", "idx", "score", "w", "scales", "biases"],
            &["y"],
            &super::substituted(DOWN_SOURCE, &DOWN_EARLY_SUBSTITUTIONS),
            &format!("{}{DOWN_EARLY_HEADER}", header()),
        )
        .ok()
    })
    .as_ref()
}

fn gate_up_kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new("lfm_moe_gate_up", &["x", "idx", "w", "scales", "biases"], &["y"], GATE_UP_SOURCE, &header()).ok()
    })
    .as_ref()
}

fn down_kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new("lfm_moe_down", &["h", "idx", "score", "w", "scales", "biases"], &["y"], DOWN_SOURCE, &header()).ok()
    })
    .as_ref()
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_MOE_KERNEL", &ON)
}

/// The largest `rows * k` a launch takes (CUDA's grid y limit).
const MAX_SLOTS: i64 = 65_535;

/// Whether the two kernels serve `rows` routed rows of width `d`, `k`
/// experts each, in dtype `dt`, with the stacked `[E, 2F, ..]` gate/up and
/// the `[E, D, ..]` down projections.
pub fn available(rows: i32, k: usize, dt: Dtype, gate_up: &Quantized, down: &Quantized) -> bool {
    if !enabled() || !cuda_kernels_enabled() || gate_up.weight.ndim() != 3 || down.weight.ndim() != 3 {
        return false;
    }
    let (e, f2) = (gate_up.weight.dim(0), gate_up.weight.dim(1));
    let f = f2 / 2;
    let d = down.weight.dim(1);
    let k_in = |q: &Quantized| q.weight.dim(2) as i64 * 32 / q.spec.bits as i64;
    rows > 0
        && (1..=8).contains(&k)
        && rows as i64 * k as i64 <= MAX_SLOTS
        && f2 % 2 == 0
        && f > 0
        && d > 0
        && down.weight.dim(0) == e
        && k_in(down) == f as i64
        && spec_served(gate_up, dt, k_in(gate_up) as i32)
        && spec_served(down, dt, f)
        && gate_up.scales.shape() == [e, f2, k_in(gate_up) as i32 / gate_up.spec.group_size]
        && down.scales.shape() == [e, d, f / down.spec.group_size]
        && gate_up_kernel().is_some()
        && down_kernel().is_some()
}

/// `silu(x @ w1[e].T) * (x @ w3[e].T)` for each row of `x` `[R, D]` and each
/// of its experts `idx` `[R, k]` (uint32): `[R, k, F]`.
pub fn gate_up(x: &Array, idx: &Array, w: &Quantized) -> Result<Array> {
    let kern = gate_up_kernel().ok_or_else(|| Error::mlx("the MoE gate/up kernel is not available"))?;
    let (r, d) = (x.dim(0), x.dim(1));
    let k = idx.dim(-1);
    let f = w.weight.dim(1) / 2;
    let biases = w.biases.as_ref().ok_or_else(|| Error::invalid("the MoE kernels need affine biases"))?;
    let mut template = quant_template(w, d, x.dtype());
    template.push(("KE", TemplateArg::Int(k)));
    let mut outs = kern.call(
        &[x, idx, &w.weight, &w.scales, biases],
        &[(&[r, k, f], x.dtype())],
        [warp_grid(f)?, r * k, 1],
        [THREADS, 1, 1],
        &template,
    )?;
    outs.pop().ok_or_else(|| Error::mlx("MoE gate/up kernel: missing output"))
}

/// `sum_j score[r, j] * (h[r, j] @ w2[idx[r, j]].T)` for `h` `[R, k, F]`:
/// `[R, D]`.
pub fn down(h: &Array, idx: &Array, score: &Array, w: &Quantized) -> Result<Array> {
    let early = if down_early() { down_early_kernel() } else { None };
    let kern = early.or_else(down_kernel).ok_or_else(|| Error::mlx("the MoE down kernel is not available"))?;
    let (r, k, f) = (h.dim(0), h.dim(1), h.dim(2));
    let d = w.weight.dim(1);
    let biases = w.biases.as_ref().ok_or_else(|| Error::invalid("the MoE kernels need affine biases"))?;
    let mut template = quant_template(w, f, h.dtype());
    template.push(("KE", TemplateArg::Int(k)));
    if !(1..=8).contains(&k) {
        return Err(Error::invalid(format!("MoE down kernel: {k} experts a row (1 to 8 are served)")));
    }
    let per_block = 8 / k;
    let blocks = (d + per_block - 1) / per_block;
    let mut outs = kern.call(
        &[h, idx, score, &w.weight, &w.scales, biases],
        &[(&[r, d], h.dtype())],
        [blocks.checked_mul(THREADS).ok_or_else(|| Error::invalid(format!("MoE down kernel: {d} columns")))?, r, 1],
        [THREADS, 1, 1],
        &template,
    )?;
    outs.pop().ok_or_else(|| Error::mlx("MoE down kernel: missing output"))
}
