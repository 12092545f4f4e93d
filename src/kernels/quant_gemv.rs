//! `x @ dequantize(w).T` for a decode step's few rows over an MLX affine
//! quantized projection (4 or 8 bits, groups of 32, 64 or 128, scales and
//! biases in the activations' dtype). By the H200 profile the 8B-A1B's
//! quantized GEMVs (MLX's `qmv` and `gather_qmv`) are 45% of its decode GPU
//! time at 0.5-0.7 TB/s; this reads each weight row once, one warp per
//! output column, the row asked of L2 before its sums, and sums as MLX's
//! own `qmv` does (`lfm_qdot_mlx`, below): a row in a half type is MLX's
//! product to the bit, read in less than half of MLX's time on an LM
//! head's width ([`MLX_SUFFIX`] has the figures).
//!
//! Its first form (session 9 to 56) summed each 16-byte chunk of packed
//! words in float32 (`s * sum(q * x) + b * sum(x)`, rounded once): closer
//! to the exact product than MLX's bf16 accumulation (on the H200 within
//! one bf16 rounding where MLX's `quantized_matmul` stood 0.006-0.053
//! away, `bench/results/2026-12-02-h200-session9-logs.tgz`, call 6), but
//! for that reason never the stock tokens (retired: [`MLX_SUFFIX`]). Its
//! chunk helpers (`lfm_xchunk`, `lfm_qx`, `lfm_qdot_a`, `lfm_qdot2_a`)
//! stay in the header for the MoE router, the experts' kernels
//! (src/kernels/moe_experts.rs) and the layers' stages, whose tests hold
//! them to their own references.
//!
//! A CUDA default since session 39: `MLX_LFM_QGEMV_KERNEL=0` turns it off.
//! Its test is in src/kernels/tests.rs.

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype, QuantMode, QuantSpec};
use crate::model::linear::Quantized;
use std::sync::OnceLock;

pub(crate) const THREADS: i32 = 256;
/// Rows of `x` one launch serves (more decode with MLX's quantized matmul).
pub const MAX_ROWS: usize = 8;

/// The chunk helpers: a chunk of `x` into floats (and its sum), and the
/// sum of `q * x` over one packed 16-byte chunk (MLX packs the first value
/// of a word in its lowest bits).
pub(crate) const QUANT_HEADER: &str = "
template <typename T, int BITS>
__device__ inline float lfm_xchunk(const T* xr, size_t c, bool aligned, float* xf) {
  constexpr int VPC = 128 / BITS;
  constexpr int E = 16 / sizeof(T);
  float xs = 0.0f;
#pragma unroll
  for (int t = 0; t < VPC / E; t++) {
    const uint4 v = lfm_load16(xr, c * (VPC / E) + t, aligned);
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int j = 0; j < E; j++) {
      xf[t * E + j] = static_cast<float>(e[j]);
      xs += xf[t * E + j];
    }
  }
  return xs;
}
template <int BITS>
__device__ inline float lfm_qx(const uint4& wv, const float* xf) {
  constexpr int VPW = 32 / BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const uint32_t* ww = reinterpret_cast<const uint32_t*>(&wv);
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < 4; j++) {
#pragma unroll
    for (int v = 0; v < VPW; v++) {
      // float(q) as (2^23 + q) - 2^23 from its bits: exact for q < 2^23, and
      // an add where the int-to-float convert (I2FP) runs at a quarter of
      // the FMA's rate on sm_90: 128 of them per 4-bit chunk per lane.
      const float q = __int_as_float(0x4B000000u | ((ww[j] >> (BITS * v)) & MASK)) - 8388608.0f;
      acc += q * xf[j * VPW + v];
    }
  }
  return acc;
}
// acc[m] += this lane's share of one quantized row (words wr, scales sr,
// biases br) dotted with row m of x; the chunks' words, scales and biases
// loaded in batches before their sums and ALIGNED a template constant (see
// lfm_dot_rows_a).
template <typename T, int K, int M, int BITS, int GS, bool ALIGNED>
__device__ inline void lfm_qdot_a(const T* x, const uint32_t* wr, const T* sr, const T* br, int lane, float* acc) {
  constexpr int VPC = 128 / BITS;
  constexpr int C = K / VPC;
  constexpr int IT = (C + 31) / 32;
  constexpr int B = IT < LFM_BATCH ? IT : LFM_BATCH;
  // One batch (IT <= B) already issues every load of the row up front.
  if (ALIGNED && IT > B) lfm_prefetch_row<IT, C>(wr, lane);
#pragma unroll
  for (int i0 = 0; i0 < IT; i0 += B) {
    uint4 wv[B];
    float s[B];
    float b[B];
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int c = lane + (i0 + u) * 32;
      if (i0 + u < IT && (C % 32 == 0 || c < C)) {
        wv[u] = lfm_load16(wr, c, ALIGNED);
        s[u] = static_cast<float>(sr[c * VPC / GS]);
        b[u] = static_cast<float>(br[c * VPC / GS]);
      }
    }
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int c = lane + (i0 + u) * 32;
      if (i0 + u < IT && (C % 32 == 0 || c < C)) {
#pragma unroll
        for (int m = 0; m < M; m++) {
          float xf[VPC];
          const float xs = lfm_xchunk<T, BITS>(x + static_cast<size_t>(m) * K, c, ALIGNED, xf);
          acc[m] += s[u] * lfm_qx<BITS>(wv[u], xf) + b[u] * xs;
        }
      }
    }
  }
}
// Two rows against one x (the SwiGLU's gate and up rows): both rows' loads
// of a batch issued together, x read once.
template <typename T, int K, int BITS, int GS, bool ALIGNED>
__device__ inline void lfm_qdot2_a(const T* x, const uint32_t* gr, const T* gs, const T* gb, const uint32_t* ur,
                                   const T* us, const T* ub, int lane, float& ag, float& au) {
  constexpr int VPC = 128 / BITS;
  constexpr int C = K / VPC;
  constexpr int IT = (C + 31) / 32;
  constexpr int B = IT < LFM_BATCH / 2 ? IT : LFM_BATCH / 2;
  if (ALIGNED && IT > B) {
    lfm_prefetch_row<IT, C>(gr, lane);
    lfm_prefetch_row<IT, C>(ur, lane);
  }
#pragma unroll
  for (int i0 = 0; i0 < IT; i0 += B) {
    uint4 gv[B];
    uint4 uv[B];
    float sg[B], bg[B], su[B], bu[B];
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int c = lane + (i0 + u) * 32;
      if (i0 + u < IT && (C % 32 == 0 || c < C)) {
        const int g = c * VPC / GS;
        gv[u] = lfm_load16(gr, c, ALIGNED);
        uv[u] = lfm_load16(ur, c, ALIGNED);
        sg[u] = static_cast<float>(gs[g]);
        bg[u] = static_cast<float>(gb[g]);
        su[u] = static_cast<float>(us[g]);
        bu[u] = static_cast<float>(ub[g]);
      }
    }
#pragma unroll
    for (int u = 0; u < B; u++) {
      const int c = lane + (i0 + u) * 32;
      if (i0 + u < IT && (C % 32 == 0 || c < C)) {
        float xf[VPC];
        const float xs = lfm_xchunk<T, BITS>(x, c, ALIGNED, xf);
        ag += sg[u] * lfm_qx<BITS>(gv[u], xf) + bg[u] * xs;
        au += su[u] * lfm_qx<BITS>(uv[u], xf) + bu[u] * xs;
      }
    }
  }
}
// (a & mask) | bits in one LOP3 (ptxas takes one immediate a LOP3, so
// with two constants it makes two).
__device__ inline uint32_t lfm_and_or(uint32_t a, uint32_t mask, uint32_t bits) {
  uint32_t d;
  asm(\"lop3.b32 %0, %1, %2, %3, 0xEA;\" : \"=r\"(d) : \"r\"(a), \"r\"(mask), \"r\"(bits));
  return d;
}
// MLX's own qmv arithmetic (the quantized GEMV's, since session 39): what the pinned
// 0.32.4 wheel's qmv_kernel<8, E, GS, true, residue, T, uint4|uint8, T>
// computes, as the upstream source with that template signature does it,
// read against the wheel's sm_90 SASS (bf16 4-bit: HADD2 with -128 after a
// LOP3, the exact magic-number conversion of q; one HFMA2 q * s + b per
// element, the source's multiply and add contracted by ptxas into a single
// rounding; HFMA2 for the sums; 16 ordered FADDs; a 5-step butterfly).
// Lane l takes E = 16 (4-bit, 16-bit T) or 8 consecutive elements at
// l E + r 32 E; each weight is dequantized in T as fma(q, s, b); 4-bit sums
// x * w per element position in T (one fused rounding a step), 8-bit in
// float; the E sums are added in order in float, then the warp's
// butterfly, rounded to T once.
__device__ inline __nv_bfloat16 lfm_qfma(__nv_bfloat16 a, __nv_bfloat16 b, __nv_bfloat16 c) { return __hfma(a, b, c); }
__device__ inline __half lfm_qfma(__half a, __half b, __half c) { return __hfma(a, b, c); }
__device__ inline float lfm_qfma(float a, float b, float c) { return fmaf(a, b, c); }
// q (below 2^BITS, BITS <= 8) in T, by its bits as MLX's qmv makes it (a
// LOP3 and an add of the magic number, both exact: every value is one T
// holds), not by the conversion units' I2F and F2F, whose throughput
// bounded the one-launch 4-bit layers (sm_90 SASS of conv_fused: an I2FP
// and an F2FP a weight). The same value T(float(q)), so the same bits.
template <typename T, int BITS>
struct lfm_qint_t;
template <int BITS>
struct lfm_qint_t<float, BITS> {
  static __device__ inline float of(uint32_t q) { return __uint_as_float(0x4B000000u | q) - 8388608.0f; }
};
template <int BITS>
struct lfm_qint_t<__half, BITS> {
  // (1024 + q, exact below 1,024, less 1024.)
  static __device__ inline __half of(uint32_t q) {
    return __hsub(__ushort_as_half(static_cast<unsigned short>(0x6400u | q)), __ushort_as_half(0x6400));
  }
};
template <int BITS>
struct lfm_qint_t<__nv_bfloat16, BITS> {
  static __device__ inline __nv_bfloat16 of(uint32_t q) {
    if constexpr (BITS <= 7) {
      // (128 + q, exact below 128, less 128.)
      return __hsub(__ushort_as_bfloat16(static_cast<unsigned short>(0x4300u | q)), __ushort_as_bfloat16(0x4300));
    } else {
      // (float(q) has at most 8 significant bits: its top half is bf16(q).)
      const float f = lfm_qint_t<float, 8>::of(q);
      return __ushort_as_bfloat16(static_cast<unsigned short>(__float_as_uint(f) >> 16));
    }
  }
};
#ifndef LFM_QINT_BITS
#define LFM_QINT_BITS 0
#endif
template <typename T, int BITS>
__device__ inline T lfm_qdequant(uint32_t q, T s, T b) {
  // (float32's multiply and add contracted too, as nvcc builds them by
  // default.)
#if LFM_QINT_BITS
  return lfm_qfma(lfm_qint_t<T, BITS>::of(q), s, b);
#else
  return lfm_qfma(T(static_cast<float>(q)), s, b);
#endif
}
template <bool F, typename T>
struct lfm_acc_t {
  using type = T;
};
template <typename T>
struct lfm_acc_t<true, T> {
  using type = float;
};
// (The tile's packed words read as words, x's 16-byte runs as such where
// the row is aligned: the loads only, the same values.)
#ifndef LFM_QMLX_TILES
#define LFM_QMLX_TILES 4
#endif
static_assert(LFM_QMLX_TILES >= 1, \"LFM_QMLX_TILES: at least one tile a batch\");
#ifndef LFM_QINT_PAIRS
#define LFM_QINT_PAIRS 0
#endif
// q in pairs (the default since session 38; MLX_LFM_QINT=pairs): a 4-bit row of a 16-bit T walked two
// values an instruction, each lane of a pair the scalar walk's operation
// (HSUB2, HFMA2: one rounding a lane, as HSUB and HFMA), so the same bits.
// A word's places v and v + 4 share a pair: their bits masked in place
// under the magic's exponent (one LOP3 after one shift), x's two values
// put beside each other by one PRMT. The pair type and magic of T (none
// but for the 16-bit types).
template <typename T>
struct lfm_pair_t {
  using P = uint32_t;
  static constexpr uint32_t MAGIC = 0u;
};
template <>
struct lfm_pair_t<__nv_bfloat16> {
  using P = __nv_bfloat162;
  static constexpr uint32_t MAGIC = 0x43004300u;
};
template <>
struct lfm_pair_t<__half> {
  using P = __half2;
  static constexpr uint32_t MAGIC = 0x64006400u;
};
template <typename P>
__device__ inline P lfm_as_pair(uint32_t v) {
  return *reinterpret_cast<const P*>(&v);
}
template <typename T, int K, int BITS, int GS, bool XA>
__device__ inline float lfm_qdot_mlx(const T* x, const uint32_t* wr, const T* sr, const T* br, int lane) {
  constexpr int E = (sizeof(T) <= 2 && BITS <= 4) ? 16 : 8;
  constexpr int EW = 32 * E;
  constexpr int VPW = 32 / BITS;
  constexpr bool PAIRS = LFM_QINT_PAIRS && BITS == 4 && sizeof(T) == 2;
  using A = typename lfm_acc_t<(BITS >= 8), T>::type;
  using PT = lfm_pair_t<T>;
  using P = typename PT::P;
  A sums[E];
#pragma unroll
  for (int j = 0; j < E; j++) sums[j] = A(0.0f);
  // (Paired: element j's sum in pair 4 (j / 8) + j % 4, its low half where
  // j % 8 < 4.)
  P sp[PAIRS ? E / 2 : 1];
#pragma unroll
  for (int k = 0; k < (PAIRS ? E / 2 : 1); k++) sp[k] = lfm_as_pair<P>(0u);
  // A tile: this lane's E weights at idx (packed words), their scale and
  // bias; its E elements of x are read as it is summed (x is every warp's:
  // cache hits, where the weights come from DRAM).
  struct Tile {
    T s, b;
    uint32_t ww[E / VPW];
  };
  auto load = [&](int idx, Tile& t) {
    t.s = sr[idx / GS];
    t.b = br[idx / GS];
#pragma unroll
    for (int i = 0; i < E / VPW; i++) t.ww[i] = wr[idx / VPW + i];
  };
  auto fold = [&](int idx, const Tile& t) {
    uint4 xraw[E * sizeof(T) / 16];
    if constexpr (XA) {
#pragma unroll
      for (int u = 0; u < E * (int)sizeof(T) / 16; u++) xraw[u] = reinterpret_cast<const uint4*>(x + idx)[u];
    } else {
#pragma unroll
      for (int j = 0; j < E; j++) reinterpret_cast<T*>(xraw)[j] = x[idx + j];
    }
    const T* xv = reinterpret_cast<const T*>(xraw);
    if constexpr (PAIRS) {
      const uint32_t* xw = reinterpret_cast<const uint32_t*>(xraw);
      const P s2(t.s, t.s);
      const P b2(t.b, t.b);
      const P m2 = lfm_as_pair<P>(PT::MAGIC);
#pragma unroll
      for (int w = 0; w < 2; w++) {
#pragma unroll
        for (int v = 0; v < 4; v++) {
          const P q2 = __hsub2(lfm_as_pair<P>(lfm_and_or(t.ww[w] >> (4 * v), 0x000F000Fu, PT::MAGIC)), m2);
          const P x2 = lfm_as_pair<P>(__byte_perm(xw[4 * w + v / 2], xw[4 * w + 2 + v / 2], (v % 2) ? 0x7632 : 0x5410));
          sp[4 * w + v] = __hfma2(x2, __hfma2(q2, s2, b2), sp[4 * w + v]);
        }
      }
    } else {
#pragma unroll
      for (int j = 0; j < E; j++) {
        const uint32_t q = (t.ww[j / VPW] >> (BITS * (j % VPW))) & ((1u << BITS) - 1u);
        const T wq = lfm_qdequant<T, BITS>(q, t.s, t.b);
        if constexpr (BITS >= 8) {
          sums[j] = fmaf(static_cast<float>(xv[j]), static_cast<float>(wq), sums[j]);
        } else {
          sums[j] = lfm_qfma(xv[j], wq, sums[j]);
        }
      }
    }
  };
  // The loads of up to LFM_QMLX_TILES tiles issued before any of them is
  // summed, the tiles then summed in turn as before (the same operations
  // in the same order: the same bits). One tile at a time, each lane's
  // warp waited on memory once a tile: four round trips a row at K = 2048
  // (the A/B of session 23 put the variant at 0.89x the stock qmv).
  // (The caller has asked L2 for the row: lfm_qgemv_mlx_warp.)
  constexpr int R = K / EW;
  constexpr int RB = R < 1 ? 1 : (R < LFM_QMLX_TILES ? R : LFM_QMLX_TILES);
#pragma unroll 1
  for (int r0 = 0; r0 < R; r0 += RB) {
    Tile t[RB];
#pragma unroll
    for (int u = 0; u < RB; u++) {
      if (r0 + u < R) load(lane * E + (r0 + u) * EW, t[u]);
    }
#pragma unroll
    for (int u = 0; u < RB; u++) {
      if (r0 + u < R) fold(lane * E + (r0 + u) * EW, t[u]);
    }
  }
  if constexpr (K % EW != 0) {
    const int idx = lane * E + K - K % EW;
    if (idx < K) {
      Tile t;
      load(idx, t);
      fold(idx, t);
    }
  }
  float sum = 0.0f;
  if constexpr (PAIRS) {
#pragma unroll
    for (int j = 0; j < E; j++) {
      const P p = sp[4 * (j / 8) + j % 4];
      sum += static_cast<float>(j % 8 < 4 ? p.x : p.y);
    }
  } else {
#pragma unroll
    for (int j = 0; j < E; j++) sum += static_cast<float>(sums[j]);
  }
  return lfm_warp_sum(sum);
}
// The first BYTES bytes at p asked of L2, one 128-byte line a lane.
template <int BYTES>
__device__ inline void lfm_prefetch_lines(const void* p, int lane) {
#pragma unroll
  for (int off = lane * 128; off < BYTES; off += 32 * 128) {
    asm volatile(\"prefetch.global.L2 [%0];\" ::\"l\"(reinterpret_cast<const char*>(p) + off));
  }
}
template <typename T, int K, int M, int BITS, int GS, bool XA>
__device__ inline void lfm_qgemv_mlx_warp(const T* x, const uint32_t* w, const T* scales, const T* biases, T* y, int N,
                                          int n, int lane) {
  constexpr int G = K / GS;
  const uint32_t* wr = w + static_cast<size_t>(n) * (K * BITS / 32);
  const T* sr = scales + static_cast<size_t>(n) * G;
  const T* br = biases + static_cast<size_t>(n) * G;
  // The row's words, scales and biases asked of L2 once for its M rows of
  // x (ptxas sinks later tiles' weight loads toward their sums to spare
  // registers: those loads then wait on L2, not DRAM).
  lfm_prefetch_lines<K * BITS / 8>(wr, lane);
  lfm_prefetch_lines<G * (int)sizeof(T)>(sr, lane);
  lfm_prefetch_lines<G * (int)sizeof(T)>(br, lane);
#pragma unroll 1
  for (int m = 0; m < M; m++) {
    const float s = lfm_qdot_mlx<T, K, BITS, GS, XA>(x + static_cast<size_t>(m) * K, wr, sr, br, lane);
    if (lane == 0) y[static_cast<size_t>(m) * N + n] = T(s);
  }
}
template <typename T, int K, int M, int BITS, int GS>
__device__ inline void lfm_qgemv_warp(const T* x, bool xa, const uint32_t* w, const T* scales, const T* biases, T* y,
                                      int N, int n, int lane) {
  if (xa) {
    lfm_qgemv_mlx_warp<T, K, M, BITS, GS, true>(x, w, scales, biases, y, N, n, lane);
  } else {
    lfm_qgemv_mlx_warp<T, K, M, BITS, GS, false>(x, w, scales, biases, y, N, n, lane);
  }
}
";

/// Both headers, in the order the kernels need them (with [`qint_mode`]'s
/// defines where it is on).
pub(crate) fn header() -> String {
    let define = match qint_mode() {
        QintMode::Convert => "",
        QintMode::Bits => "#define LFM_QINT_BITS 1\n",
        QintMode::Pairs => "#define LFM_QINT_BITS 1\n#define LFM_QINT_PAIRS 1\n",
    };
    format!("{define}{}{QUANT_HEADER}", super::gemv::header())
}

/// How the MLX-exact quantized walk (`lfm_qdot_mlx`: the one-launch 4-bit
/// conv, feed-forward and q/k/v layers and MoE experts, the quantized GEMV)
/// makes q in T: by its bits, a 4-bit bf16/half row two values an
/// instruction (the default, `pairs`); by its bits one at a time (`bits`);
/// by the conversion units (`convert`, the default before session 38).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum QintMode {
    Convert,
    Bits,
    Pairs,
}

/// `MLX_LFM_QINT`: how q is made in T (see [`QintMode`]). `pairs`, the
/// default since session 38: q by its bits (`lfm_qint_t`: a LOP3 and an
/// exact magic-number add, as MLX's own qmv does, where `convert` spent an
/// I2FP and an F2FP a weight on the conversion units) and a 4-bit row of
/// bf16 or half walked two values an instruction (`lfm_pair_t`: a word's
/// places v and v + 4 masked in place in one LOP3 after one shift, x's two
/// values beside each other by one PRMT, HSUB2 and two HFMA2 a pair). Each
/// lane of a pair is the scalar walk's operation with its one rounding, so
/// all three modes give the same values and bits (the kernels' GPU tests
/// hold each to MLX's). Adopted on the H100 in session 38: its five layer
/// tests passed, the 4-bit conv and feed-forward layers ran 28-30% faster
/// in kernel-bench (session 36), and the 8B-A1B decoded 1.10x the
/// conversion walk's rate in a paired A/B of processes. `bits` (session
/// 35: kernel-bench mixed, its tests not yet finished on a GPU) and
/// `convert` stay as opt-outs. Read once a process: every kernel built on
/// this header is built once a process, so its A/B is of processes and its
/// tests run in a process with it set.
pub(crate) fn qint_mode() -> QintMode {
    static MODE: OnceLock<QintMode> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("MLX_LFM_QINT").as_deref().map(str::trim) {
        Ok("bits") => QintMode::Bits,
        Ok("convert") => QintMode::Convert,
        _ => QintMode::Pairs,
    })
}

/// Whether [`qint_mode`] is `bits` (its test's switch: under the default
/// that test would check the paired walk).
#[cfg(test)]
pub(crate) fn qint_bits() -> bool {
    qint_mode() == QintMode::Bits
}

/// Whether [`qint_mode`] makes q by the conversion units (its test's switch).
#[cfg(test)]
pub(crate) fn qint_convert() -> bool {
    qint_mode() == QintMode::Convert
}

const SOURCE: &str = r#"
  const int N = w_shape[0];
  const int n = blockIdx.x * (256 / 32) + threadIdx.x / 32;
  if (n >= N) return;
  lfm_qgemv_warp<T, K, M, BITS, GS>(x, lfm_aligned(x), w, scales, biases, y, N, n, threadIdx.x % 32);
"#;

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new(&format!("lfm_qgemv{MLX_SUFFIX}"), &["x", "w", "scales", "biases"], &["y"], SOURCE, &header()).ok()
    })
    .as_ref()
}

/// The quantized GEMV and its norm fold sum as MLX's own `qmv` does
/// (`lfm_qdot_mlx`), so a row in a half type is MLX's product to the bit
/// and the greedy test has no departure left to come from them. Adopted on
/// the H100 in session 39 (then `MLX_LFM_QGEMV_EXACT`): its test and
/// greedy sets passed, and kernel-bench (ncu, each launch alone) had it
/// read the 8B-A1B's 4-bit LM head (65,536 x 2,048, 75 MB) in 33.5 µs
/// against MLX's `qmv`'s 78.6, and its 6,144 x 2,048 projection in 7.6
/// against 10.9. Session 56 retired the float32 sums it replaced
/// (`MLX_LFM_QGEMV_EXACT=0`): closer to the exact product, but the tiny
/// MoE fixture's 4-bit greedy run departed from the stock tokens with them
/// in every session from 32 to 56, so they could never be adopted. The
/// kernels keep the suffix their names took then, so that their names in
/// ncu's and kernel-bench's records since session 39 still find them.
pub(crate) const MLX_SUFFIX: &str = "_mlx";

/// On where our CUDA kernels run unless `MLX_LFM_QGEMV_KERNEL=0`
/// ([`MLX_SUFFIX`] says why).
fn enabled() -> bool {
    static ON: OnceLock<Option<bool>> = OnceLock::new();
    super::cuda_default("MLX_LFM_QGEMV_KERNEL", &ON)
}

/// Whether the quantized GEMVs are on (a CUDA default; `MLX_LFM_QGEMV_KERNEL`).
pub(crate) fn switched_on() -> bool {
    enabled()
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

#[cfg(test)]
mod tests {
    use super::QUANT_HEADER;

    /// A float16 value from its bits (normal numbers: the magic ones).
    fn f16_value(bits: u16) -> f32 {
        let (e, m) = (((bits >> 10) & 0x1f) as i32, (bits & 0x3ff) as f32);
        assert!(bits >> 15 == 0 && (1..31).contains(&e), "{bits:#x}: not a positive normal float16");
        (1.0 + m / 1024.0) * 2f32.powi(e - 15)
    }

    /// The MLX-exact walk's q in T by its bits (`lfm_qint_t`) is the value
    /// the conversion units made, T(float(q)), for every q of up to 8 bits:
    /// the magic numbers' sums are exact and each result is one T holds,
    /// so the same bits go into the same products.
    #[test]
    fn a_quantized_value_by_its_bits_is_its_conversion() {
        for c in ["0x4B000000u | q) - 8388608.0f", "0x4300u | q", "__ushort_as_bfloat16(0x4300)", "0x6400u | q", "__ushort_as_half(0x6400)"] {
            assert!(QUANT_HEADER.contains(c), "{c} not in the header");
        }
        for q in 0u32..256 {
            // float32: 2^23 + q less 2^23.
            assert_eq!(f32::from_bits(0x4B00_0000 | q) - 8_388_608.0, q as f32);
            // bfloat16 at 8 bits: float(q)'s top half, its low half zero.
            assert_eq!((q as f32).to_bits() & 0xffff, 0, "{q}: not a bfloat16");
            if q < 128 {
                // bfloat16 below 8 bits: 128 + q less 128, each a bfloat16.
                assert_eq!(f32::from_bits((0x4300 | q) << 16) - 128.0, q as f32);
            }
            // float16: 1024 + q less 1024 (q below 1,024).
            assert_eq!(f16_value(0x6400 | q as u16) - 1024.0, q as f32);
        }
        assert_eq!(f32::from_bits(0x4300 << 16), 128.0);
        assert_eq!(f16_value(0x6400), 1024.0);
    }

    /// The paired walk's places (`MLX_LFM_QINT=pairs`): for every word,
    /// each of its four pairs holds places v and v + 4 as 128 + q (bf16)
    /// or 1024 + q (half) by the mask and magic, x's PRMT pairs the same
    /// two elements, and the final sum reads element j where the fold put
    /// it, so each element's sum is the scalar walk's, in its order.
    #[test]
    fn a_pair_holds_the_places_and_the_x_its_sum_is_read_from() {
        for c in [
            "lfm_and_or(t.ww[w] >> (4 * v), 0x000F000Fu, PT::MAGIC)",
            "__byte_perm(xw[4 * w + v / 2], xw[4 * w + 2 + v / 2], (v % 2) ? 0x7632 : 0x5410)",
            "const P q2 = __hsub2(",
            "static constexpr uint32_t MAGIC = 0x43004300u;",
            "static constexpr uint32_t MAGIC = 0x64006400u;",
            "sp[4 * (j / 8) + j % 4]",
            "j % 8 < 4 ? p.x : p.y",
        ] {
            assert!(QUANT_HEADER.contains(c), "{c} not in the header");
        }
        // __byte_perm(a, b, s): byte i of the result is byte s_i of b:a.
        let perm = |a: u32, b: u32, sel: u32| -> u32 {
            let bytes = ((b as u64) << 32) | a as u64;
            (0..4).map(|i| (((bytes >> (8 * ((sel >> (4 * i)) & 7))) & 0xff) as u32) << (8 * i)).fold(0, |acc, v| acc | v)
        };
        let words = [0u32, 0xffff_ffff, 0x7654_3210, 0x0123_4567, 0x9e37_79b9, 0xdead_beef];
        for w in words {
            for v in 0..4 {
                for (magic, base) in [(0x4300u32, 128u32), (0x6400, 1024)] {
                    let pair = ((w >> (4 * v)) & 0x000F_000F) | (magic << 16 | magic);
                    let (lo, hi) = (pair & 0xffff, pair >> 16);
                    let q = |place: u32| (w >> (4 * place)) & 0xf;
                    // The magic's value plus q, in its own bits (bf16 and
                    // half both keep q under their mantissa's top bit).
                    assert_eq!((lo - magic, hi - magic), (q(v), q(v + 4)), "word {w:#x} place {v}");
                    // Each half is the magic's value plus q in its type
                    // (bf16 128 + q, half 1024 + q): HSUB2 of the magic
                    // leaves q exactly.
                    for (half, q) in [(lo, q(v)), (hi, q(v + 4))] {
                        let value = if magic == 0x4300 { f32::from_bits(half << 16) } else { f16_value(half as u16) };
                        assert_eq!(value, (base + q) as f32, "word {w:#x} place {v}");
                    }
                }
            }
        }
        // x: element e of a 16-value tile in word e / 2, half e % 2; pair
        // 4 w + v takes elements 8 w + v (low) and 8 w + v + 4 (high).
        let xw: Vec<u32> = (0..8u32).map(|k| ((2 * k + 1) << 16) | (2 * k)).collect();
        for w in 0..2usize {
            for v in 0..4usize {
                let sel = if v % 2 == 1 { 0x7632 } else { 0x5410 };
                let got = perm(xw[4 * w + v / 2], xw[4 * w + 2 + v / 2], sel);
                assert_eq!((got & 0xffff, got >> 16), ((8 * w + v) as u32, (8 * w + v + 4) as u32), "pair {}", 4 * w + v);
            }
        }
        for j in 0..16usize {
            let (pair, low) = (4 * (j / 8) + j % 4, j % 8 < 4);
            let (w, v) = (pair / 4, pair % 4);
            assert_eq!(if low { 8 * w + v } else { 8 * w + v + 4 }, j, "element {j}");
        }
    }
}
