//! Attention of one query token over a masked, fixed-size K/V buffer (the
//! decode step's shape on every path: flat, paged mirror, stacked batch) in
//! one kernel. MLX has no fused kernel for a boolean mask here and runs its
//! fallback: a scale multiply, a cuBLAS batched GEMM and its pointer setup,
//! the mask's select, a softmax and a batched GEMV, six launches per
//! attention layer and token.
//!
//! One block per (row, query head), 256 threads, three passes that each keep
//! many loads in flight (the first version scored positions in lane groups
//! joined by shuffles after every row, and its loops waited on each load:
//! ~37 us a launch over 768 positions on the H200, latency not bandwidth):
//! 1. a thread per position scores its key row with 16-byte loads and keeps
//!    the score in a scratch row (`sc`, float32 `[B, H, N]`);
//! 2. the block's max and sum of `exp(s - max)` over the unmasked scores;
//! 3. probabilities into the scratch row, then lane groups of HD / 8 lanes
//!    (8 elements a lane) sum `p * v` over the positions, several rows in
//!    flight per lane.
//!
//! Masked positions are never loaded. The rounding is the fallback's:
//! `q * scale` rounded to the model dtype, each score rounded as the GEMM's
//! output is, the softmax in float32 from those and its probabilities
//! rounded, then `sum p * v` in float32 rounded once. A compiled step's
//! variant ([`sdpa_upto`]) takes the row's position instead of a mask and
//! stops there, so the step builds no mask (three nodes a token). Shapes
//! come from MLX's shape arguments, so a cache growing by a step does not
//! compile a new kernel.

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{self, Array, Dtype, Mask};
use std::sync::OnceLock;

const THREADS: i32 = 256;

const SOURCE: &str = r#"
  // A block sums DPB of the head's HD output elements, PARTS blocks a
  // head (the split variant, LFM_ATT_DPB; else one block a head).
#ifdef LFM_ATT_DPB
  constexpr int DPB = LFM_ATT_DPB < HD ? LFM_ATT_DPB : HD;
#else
  constexpr int DPB = HD;
#endif
  constexpr int PARTS = HD / DPB;
  constexpr int G = DPB / 8;
  constexpr int GROUPS = 256 / G;
  // Elements of T in one 16-byte load.
  constexpr int E = 16 / sizeof(T);
  const int h = blockIdx.x / PARTS;
  const int part = blockIdx.x % PARTS;
  const int b = blockIdx.y;
  const int H = q_shape[1];
  const int KVH = k_shape[1];
  const int N = k_shape[2];
  const int tid = threadIdx.x;
  const int grp = tid / G;
  const int lane = tid % G;
  const float scale = __int_as_float(SCALE_BITS);
  const size_t head = static_cast<size_t>(b) * KVH + h / (H / KVH);
  const T* qp = q + (static_cast<size_t>(b) * H + h) * HD;
  const T* kp = k + head * N * HD;
  const T* vp = v + head * N * HD + part * DPB + lane * 8;
  // `NV`, the positions the loops run to, and `valid(n)`:
  __VALIDITY__
#if LFM_ATT_SMEM
  // The row's scores in shared memory (SN, at least N, a
  // template constant): the max, sum and probability passes and the p * v
  // pass read them there, not back from L2.
  __shared__ float ssc[SN];
  float* srow = ssc;
#else
  float* srow = sc + ((static_cast<size_t>(b) * H + h) * PARTS + part) * N;
#endif
  __shared__ float qs[HD];
  __shared__ float red[8];
  __shared__ float accs[GROUPS * DPB];

  for (int i = tid; i < HD; i += 256) {
    qs[i] = static_cast<float>(T(static_cast<float>(qp[i]) * scale));
  }
  __syncthreads();
  auto block_reduce = [&](float x, bool is_max) { return lfm_att_block_reduce(x, is_max, red); };

  const float neg_inf = -__int_as_float(0x7f800000);
  float m = neg_inf;
  for (int n = tid; n < NV; n += 256) {
    if (!valid(n)) continue;
    const uint4* kr = reinterpret_cast<const uint4*>(kp + static_cast<size_t>(n) * HD);
    float s = 0.0f;
    // Up to 8 loads (128 bytes) in flight at a time, so a long row does
    // not spill registers.
    constexpr int CH = HD / E < 8 ? HD / E : 8;
    for (int c0 = 0; c0 < HD / E; c0 += CH) {
      uint4 raw[CH];
#pragma unroll
      for (int c = 0; c < CH; c++) raw[c] = kr[c0 + c];
#pragma unroll
      for (int c = 0; c < CH; c++) {
        const T* e = reinterpret_cast<const T*>(&raw[c]);
#pragma unroll
        for (int j = 0; j < E; j++) s += qs[(c0 + c) * E + j] * static_cast<float>(e[j]);
      }
    }
    s = static_cast<float>(T(s));
    srow[n] = s;
    m = fmaxf(m, s);
  }
  m = block_reduce(m, true);
  float l = 0.0f;
  for (int n = tid; n < NV; n += 256) {
    if (valid(n)) l += expf(srow[n] - m);
  }
  l = block_reduce(l, false);
  // Probabilities; 0 marks a position that adds nothing (masked, or the
  // whole row masked).
  for (int n = tid; n < NV; n += 256) {
    srow[n] = (valid(n) && m != neg_inf) ? static_cast<float>(T(expf(srow[n] - m) / l)) : 0.0f;
  }
  __syncthreads();

  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#if LFM_ATT_SMEM
  // A group's positions grp, grp + GROUPS, ... in the same order, the V
  // rows of U of them loaded before any is summed (the loop above waited
  // on each row in turn: ~17 dependent round trips a group over ~550
  // positions, 15.7 us a launch under ncu in session 22): the same sums.
  constexpr int U = 8;
  constexpr int VL = 8 / E > 0 ? 8 / E : 1;
  for (int n0 = grp; n0 < NV; n0 += GROUPS * U) {
    float pu[U];
    uint4 raw[U][VL];
#pragma unroll
    for (int u = 0; u < U; u++) {
      const int n = n0 + u * GROUPS;
      pu[u] = n < NV ? srow[n] : 0.0f;
      if (pu[u] != 0.0f) {
        const uint4* vr = reinterpret_cast<const uint4*>(vp + static_cast<size_t>(n) * HD);
#pragma unroll
        for (int c = 0; c < VL; c++) raw[u][c] = vr[c];
      }
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
      if (pu[u] != 0.0f) {
        const T* e = reinterpret_cast<const T*>(raw[u]);
#pragma unroll
        for (int i = 0; i < 8; i++) acc[i] += pu[u] * static_cast<float>(e[i]);
      }
    }
  }
#else
#pragma unroll 4
  for (int n = grp; n < NV; n += GROUPS) {
    const float p = srow[n];
    if (p != 0.0f) {
      const uint4* vr = reinterpret_cast<const uint4*>(vp + static_cast<size_t>(n) * HD);
      uint4 raw[8 / E > 0 ? 8 / E : 1];
#pragma unroll
      for (int c = 0; c < 8 / E; c++) raw[c] = vr[c];
      const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
      for (int i = 0; i < 8; i++) acc[i] += p * static_cast<float>(e[i]);
    }
  }
#endif
  for (int i = 0; i < 8; i++) {
    accs[grp * DPB + lane * 8 + i] = acc[i];
  }
  __syncthreads();
  T* op = out + (static_cast<size_t>(b) * H + h) * HD + part * DPB;
#ifndef LFM_ATT_DPB
  for (int d = tid; d < DPB; d += 256) {
    float o = 0.0f;
    for (int g = 0; g < GROUPS; g++) {
      o += accs[g * DPB + d];
    }
    op[d] = T(o);
  }
#else
  // GROUPS partial sums an element (128 or 256 where a block sums 16 or
  // 8): summed by 256 / DPB threads an element in slices, then the slices
  // in order, not by one thread walking them all.
  constexpr int SL = 256 / DPB;
  __shared__ float fin[256];
  {
    const int d = tid % DPB;
    const int sl = tid / DPB;
    float o = 0.0f;
    for (int g = sl; g < GROUPS; g += SL) o += accs[g * DPB + d];
    fin[sl * DPB + d] = o;
  }
  __syncthreads();
  if (tid < DPB) {
    float o = 0.0f;
    for (int i = 0; i < SL; i++) o += fin[i * DPB + tid];
    op[tid] = T(o);
  }
#endif
"#;

/// The wide variant (`MLX_LFM_DECODE_ATTENTION_WIDE=1`, opt-in until its
/// GPU test and A/B): one block a query head as the default, but a row's
/// HD elements over LPR = HD / (16 / sizeof(T)) lanes, one 16-byte load
/// each, so a block loads 256 / LPR rows at once, CK of them a lane before
/// any is summed, and the first CK rows of V with the first of K (V's
/// loads wait on nothing). The default walks a position a thread and then
/// V a lane group, its passes each a few dependent round trips to L2 or
/// DRAM (~10.7 µs a launch over ~550 positions in session 33's warm ncu
/// of the 8B-A1B's step, six a token, for ~140 KB); here ~550 positions
/// take three rounds of K's loads and two of V's. The scores stay in
/// shared memory (capacity [`SMEM_MAX`]); the probabilities are computed
/// as the V rows are summed, rounded as the default rounds them. A score
/// sums its row's products in lane slices joined by shuffles, and the
/// output its rows in another order: the stock ops' tolerance, not the
/// default's bits.
const WIDE_SOURCE: &str = r#"
  constexpr int E = 16 / sizeof(T);
  constexpr int LPR = HD / E;
  static_assert(LPR >= 1 && LPR <= 32 && 32 % LPR == 0, "a row's loads tile a warp");
  constexpr int SLOTS = 256 / LPR;
  constexpr int CK = 8;
  constexpr int CHUNK = SLOTS * CK;
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int H = q_shape[1];
  const int KVH = k_shape[1];
  const int N = k_shape[2];
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int slot = tid / LPR;
  const int lane = tid % LPR;
  const float scale = __int_as_float(SCALE_BITS);
  const size_t head = static_cast<size_t>(b) * KVH + h / (H / KVH);
  const T* qp = q + (static_cast<size_t>(b) * H + h) * HD + lane * E;
  const uint4* kp = reinterpret_cast<const uint4*>(k + head * N * HD) + lane;
  const uint4* vp = reinterpret_cast<const uint4*>(v + head * N * HD) + lane;
  // `NV`, the positions the loops run to, and `valid(n)`:
  __VALIDITY__
  __shared__ float ssc[SN];
  __shared__ float red[8];
  __shared__ float accs[8 * HD];
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
  // Every loop runs to the same bound on every thread (rows past NV load
  // nothing and sum zeros), so a slot's shuffles always have their lanes.
  // A row past the position bound is never loaded; a masked one may be
  // (inside the buffer), and is never summed.
  uint4 vr[CK];
  uint4 kr[CK];
#pragma unroll
  for (int u = 0; u < CK; u++) {
    const int n = u * SLOTS + slot;
    kr[u] = n < NV ? kp[static_cast<size_t>(n) * LPR] : zero;
    vr[u] = n < NV ? vp[static_cast<size_t>(n) * LPR] : zero;
  }
  // This lane's E query values, scaled and rounded as the fallback's multiply.
  float qv[E];
#pragma unroll
  for (int j = 0; j < E; j++) qv[j] = static_cast<float>(T(static_cast<float>(qp[j]) * scale));
  const float neg_inf = -__int_as_float(0x7f800000);
  auto block_reduce = [&](float x, bool is_max) { return lfm_att_block_reduce(x, is_max, red); };
  float m = neg_inf;
  for (int base = 0; base < NV; base += CHUNK) {
    if (base > 0) {
#pragma unroll
      for (int u = 0; u < CK; u++) {
        const int n = base + u * SLOTS + slot;
        kr[u] = n < NV ? kp[static_cast<size_t>(n) * LPR] : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < CK; u++) {
      const T* e = reinterpret_cast<const T*>(&kr[u]);
      float s = 0.0f;
#pragma unroll
      for (int j = 0; j < E; j++) s += qv[j] * static_cast<float>(e[j]);
#pragma unroll
      for (int off = LPR / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
      s = static_cast<float>(T(s));
      const int n = base + u * SLOTS + slot;
      if (n < NV) {
        const bool ok = valid(n);
        if (lane == 0) ssc[n] = ok ? s : neg_inf;
        if (ok) m = fmaxf(m, s);
      }
    }
  }
  m = block_reduce(m, true);
  float l = 0.0f;
  if (m != neg_inf) {
    for (int n = tid; n < NV; n += 256) l += expf(ssc[n] - m);
  }
  l = block_reduce(l, false);
  float acc[E];
#pragma unroll
  for (int j = 0; j < E; j++) acc[j] = 0.0f;
  for (int base = 0; base < NV; base += CHUNK) {
    if (base > 0) {
#pragma unroll
      for (int u = 0; u < CK; u++) {
        const int n = base + u * SLOTS + slot;
        vr[u] = n < NV ? vp[static_cast<size_t>(n) * LPR] : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < CK; u++) {
      const int n = base + u * SLOTS + slot;
      const float s = n < NV ? ssc[n] : neg_inf;
      // 0 for a masked position or a row with none valid, as the default.
      const float p = (s != neg_inf && m != neg_inf) ? static_cast<float>(T(expf(s - m) / l)) : 0.0f;
      if (p != 0.0f) {
        const T* e = reinterpret_cast<const T*>(&vr[u]);
#pragma unroll
        for (int j = 0; j < E; j++) acc[j] += p * static_cast<float>(e[j]);
      }
    }
  }
  // A warp's slots joined (the lanes holding one slice of HD), then the
  // warps in order.
#pragma unroll
  for (int off = LPR; off < 32; off <<= 1) {
#pragma unroll
    for (int j = 0; j < E; j++) acc[j] += __shfl_xor_sync(0xffffffff, acc[j], off);
  }
  if (tid % 32 < LPR) {
#pragma unroll
    for (int j = 0; j < E; j++) accs[warp * HD + lane * E + j] = acc[j];
  }
  __syncthreads();
  T* op = out + (static_cast<size_t>(b) * H + h) * HD;
  for (int d = tid; d < HD; d += 256) {
    float o = 0.0f;
    for (int w = 0; w < 8; w++) o += accs[w * HD + d];
    op[d] = T(o);
  }
"#;

/// The positions split over CHUNKS blocks a KV head
/// (`MLX_LFM_DECODE_ATTENTION_CHUNKS=N`, opt-in until its H200 test and
/// A/B), each block scoring its chunk for the R query heads that read that
/// KV head (K and V loaded once for all of them) and keeping, a head, the
/// chunk's max score, its sum of `exp(s - max)` and its unnormalised `sum
/// exp(s - max) v` (float32 `[B, H, CHUNKS, HD + 2]`); [`JOIN_SOURCE`]
/// then joins a head's chunks. Session 22's ncu timed the one-block-a-head
/// kernel at 15.7 us a launch over ~550 positions: 32 blocks on the H200's
/// 132 SMs, each walking every position in dependent passes; the split by
/// output elements (`attention-split`, four times the blocks, each still
/// scoring every position) moved nothing. Scores are the default kernel's
/// (the same sums, rounded to the dtype); the probabilities are not
/// rounded before `p * v` and are normalised after the join, so the output
/// is held to MLX's within the default's tolerance, not to its bits.
const PART_SOURCE: &str = r#"
  constexpr int E = 16 / sizeof(T);
  constexpr int G = HD / 8;
  constexpr int GROUPS = 256 / G;
  const int H = q_shape[1];
  const int KVH = k_shape[1];
  const int N = k_shape[2];
  const int kvh = blockIdx.x / CHUNKS;
  const int c = blockIdx.x % CHUNKS;
  const int b = blockIdx.y;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const float scale = __int_as_float(SCALE_BITS);
  __VALIDITY__
  const int L = (NV + CHUNKS - 1) / CHUNKS;
  const int lo = c * L;
  const int hi = lo + L < NV ? lo + L : NV;
  const size_t head = static_cast<size_t>(b) * KVH + kvh;
  const T* kp = k + head * N * HD;
  const T* vp = v + head * N * HD;
  __shared__ float qs[R * HD];
  __shared__ float red[8 * R];
  __shared__ float accs[GROUPS * HD];
  for (int i = tid; i < R * HD; i += 256) {
    const int r = i / HD;
    const T* qp = q + (static_cast<size_t>(b) * H + kvh * R + r) * HD;
    qs[i] = static_cast<float>(T(static_cast<float>(qp[i - r * HD]) * scale));
  }
  __syncthreads();
  // Head r's scores (then its exp(s - max)) over this chunk: srow[r * N + n].
  float* srow = sc + (static_cast<size_t>(b) * H + kvh * R) * N;
  // x[r] of every thread to the block's max or sum for each head r.
  auto reduce_heads = [&](float* x, bool is_max) {
#pragma unroll
    for (int r = 0; r < R; r++) {
      float y = x[r];
      for (int off = 16; off > 0; off >>= 1) {
        const float z = __shfl_xor_sync(0xffffffff, y, off);
        y = is_max ? fmaxf(y, z) : y + z;
      }
      if (tid % 32 == 0) red[warp * R + r] = y;
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < R; r++) {
      float y = red[r];
      for (int w = 1; w < 8; w++) y = is_max ? fmaxf(y, red[w * R + r]) : y + red[w * R + r];
      x[r] = y;
    }
    __syncthreads();
  };
  const float neg_inf = -__int_as_float(0x7f800000);
  float m[R];
#pragma unroll
  for (int r = 0; r < R; r++) m[r] = neg_inf;
  // (Read through a volatile view: R * HD query values do not fit in
  // registers, and ptxas would otherwise hoist them all out of the loop and
  // spill; one broadcast shared load a product instead.)
  const volatile float* qv = qs;
  for (int n = lo + tid; n < hi; n += 256) {
    if (!valid(n)) continue;
    const uint4* kr = reinterpret_cast<const uint4*>(kp + static_cast<size_t>(n) * HD);
    float s[R];
#pragma unroll
    for (int r = 0; r < R; r++) s[r] = 0.0f;
    constexpr int CH = HD / E < 8 ? HD / E : 8;
    for (int c0 = 0; c0 < HD / E; c0 += CH) {
      uint4 raw[CH];
#pragma unroll
      for (int cc = 0; cc < CH; cc++) raw[cc] = kr[c0 + cc];
#pragma unroll
      for (int cc = 0; cc < CH; cc++) {
        const T* e = reinterpret_cast<const T*>(&raw[cc]);
#pragma unroll
        for (int j = 0; j < E; j++) {
          const float kv = static_cast<float>(e[j]);
#pragma unroll
          for (int r = 0; r < R; r++) s[r] += qv[r * HD + (c0 + cc) * E + j] * kv;
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
      const float sr = static_cast<float>(T(s[r]));
      srow[static_cast<size_t>(r) * N + n] = sr;
      m[r] = fmaxf(m[r], sr);
    }
  }
  reduce_heads(m, true);
  float l[R];
#pragma unroll
  for (int r = 0; r < R; r++) l[r] = 0.0f;
  for (int n = lo + tid; n < hi; n += 256) {
    if (!valid(n)) continue;
#pragma unroll
    for (int r = 0; r < R; r++) {
      const float e = expf(srow[static_cast<size_t>(r) * N + n] - m[r]);
      srow[static_cast<size_t>(r) * N + n] = e;
      l[r] += e;
    }
  }
  reduce_heads(l, false);
  const int lane = tid % G;
  const int grp = tid / G;
  float acc[R][8];
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int i = 0; i < 8; i++) acc[r][i] = 0.0f;
  }
  constexpr int VL = 8 / E > 0 ? 8 / E : 1;
#pragma unroll 2
  for (int n = lo + grp; n < hi; n += GROUPS) {
    if (!valid(n)) continue;
    const uint4* vr = reinterpret_cast<const uint4*>(vp + static_cast<size_t>(n) * HD + lane * 8);
    uint4 raw[VL];
#pragma unroll
    for (int cc = 0; cc < VL; cc++) raw[cc] = vr[cc];
    const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
    for (int r = 0; r < R; r++) {
      const float p = srow[static_cast<size_t>(r) * N + n];
#pragma unroll
      for (int i = 0; i < 8; i++) acc[r][i] += p * static_cast<float>(e[i]);
    }
  }
  float* part = parts + ((static_cast<size_t>(b) * H + kvh * R) * CHUNKS + c) * (HD + 2);
#pragma unroll
  for (int r = 0; r < R; r++) {
#pragma unroll
    for (int i = 0; i < 8; i++) accs[grp * HD + lane * 8 + i] = acc[r][i];
    __syncthreads();
    float* pr = part + static_cast<size_t>(r) * CHUNKS * (HD + 2);
    for (int d = tid; d < HD; d += 256) {
      float o = 0.0f;
      for (int g = 0; g < GROUPS; g++) o += accs[g * HD + d];
      pr[d] = o;
    }
    if (tid == 0) {
      pr[HD] = m[r];
      pr[HD + 1] = l[r];
    }
    __syncthreads();
  }
"#;

/// A head's chunks joined: the largest chunk max M, each chunk's sums
/// scaled by `exp(max - M)`, the output `sum / total` rounded once (0 for a
/// row with no valid position, as the default kernel gives).
const JOIN_SOURCE: &str = r#"
  const int h = blockIdx.x;
  const int b = blockIdx.y;
  const int d = threadIdx.x;
  const int H = parts_shape[1];
  if (d >= HD) return;
  const float* p = parts + (static_cast<size_t>(b) * H + h) * CHUNKS * (HD + 2);
  const float neg_inf = -__int_as_float(0x7f800000);
  float top = neg_inf;
  for (int c = 0; c < CHUNKS; c++) top = fmaxf(top, p[c * (HD + 2) + HD]);
  float total = 0.0f;
  float o = 0.0f;
  if (top != neg_inf) {
    for (int c = 0; c < CHUNKS; c++) {
      const float mc = p[c * (HD + 2) + HD];
      if (mc == neg_inf) continue;
      const float w = expf(mc - top);
      total += p[c * (HD + 2) + HD + 1] * w;
      o += p[c * (HD + 2) + d] * w;
    }
  }
  out[(static_cast<size_t>(b) * H + h) * HD + d] = T(total > 0.0f ? o / total : 0.0f);
"#;

/// The boolean mask's validity: its row (shared or the query row's).
const MASK_VALID: &str = "const bool* mp = mask + static_cast<size_t>(mask_shape[0] == 1 ? 0 : b) * N;
  const int NV = N;
  auto valid = [&](int n) { return mp[n]; };";

/// Positions up to the row's own (`upto`, an int32 scalar or one a row,
/// `PER_ROW`): the mask a compiled step built from the position each step
/// (an arange, a compare and a reshape, three nodes) read from the
/// position itself; nothing past it is visited.
const UPTO_VALID: &str = "const int lim = upto[PER_ROW ? b : 0];
  const int NV = lim < 0 ? 0 : (lim < N ? lim + 1 : N);
  auto valid = [&](int) { return true; };";

/// How a launch lays out its blocks and keeps its scores.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Variant {
    /// A block a query head, the scores in a scratch row.
    Plain,
    /// The scores in shared memory ([`smem_capacity`]).
    Smem,
    /// [`split_dims`] output elements a block (several blocks a head).
    Split(i32),
    /// A row over several lanes, many rows' loads in flight ([`WIDE_SOURCE`]).
    Wide,
}

/// The kernel in `cell`: the body with `validity`, its fourth input
/// `bound`, built as `variant` lays it out.
fn made(cell: &'static OnceLock<Option<CudaKernel>>, name: &str, bound: &str, validity: &str, variant: Variant) -> Option<&'static CudaKernel> {
    cell.get_or_init(|| {
        let body = if variant == Variant::Wide { WIDE_SOURCE } else { SOURCE };
        let src = body.replace("__VALIDITY__", validity);
        let (name, header) = match variant {
            Variant::Wide => (format!("{name}_wide"), HEADER.to_string()),
            Variant::Plain => (name.to_string(), HEADER.to_string()),
            Variant::Smem => (format!("{name}_smem"), format!("#define LFM_ATT_SMEM 1\n{HEADER}")),
            Variant::Split(d) => (format!("{name}_split{d}"), format!("#define LFM_ATT_DPB {d}\n{HEADER}")),
        };
        CudaKernel::new(&name, &["q", "k", "v", bound], &["out", "sc"], &src, &header).ok()
    })
    .as_ref()
}

const HEADER: &str = r#"#ifndef LFM_ATT_SMEM
#define LFM_ATT_SMEM 0
#endif
// The max or sum of x over a block of 256 threads (8 warps), every thread
// given it; `red` is 8 floats of shared memory, free again on return.
__device__ inline float lfm_att_block_reduce(float x, bool is_max, float* red) {
  for (int off = 16; off > 0; off >>= 1) {
    const float y = __shfl_xor_sync(0xffffffff, x, off);
    x = is_max ? fmaxf(x, y) : x + y;
  }
  __syncthreads();
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = x;
  __syncthreads();
  x = red[0];
  for (int w = 1; w < 8; w++) {
    x = is_max ? fmaxf(x, red[w]) : x + red[w];
  }
  return x;
}
"#;

/// The most positions whose scores the shared-memory variant holds (32 KiB
/// of float32 beside the 8 KiB of the p * v partial sums: within the 48 KiB
/// of static shared memory a block may have).
const SMEM_MAX: i32 = 8192;

/// `MLX_LFM_DECODE_ATTENTION_SMEM=1` (opt-in until its H200 A/B with one
/// capacity): the variant that keeps a row's scores in shared memory and
/// loads several V rows of a lane group before summing them, the same sums
/// in the same order (the same bits). Session 22's ncu timed the kernel at
/// 15.7 us a launch over ~550 positions (6 a token on every model), where
/// its bytes take ~1 us: its passes wait on L2 and DRAM in turn.
///
/// The scores' capacity is one template constant, [`SMEM_MAX`], whatever
/// the buffer's length. Session 23's rounds ran the variant with the
/// length rounded up to a power of two, a kernel a doubling, and the first
/// decode at each prompt length ran at 79-145 tok/s against 395-912 in the
/// reps after it (every arm with our kernels; the stock ops' arm and
/// session 22's rounds without the variant did not): consistent with a
/// kernel built in the middle of a reply each time the cache crossed a
/// power of two. One kernel, built at the first step, serves every length
/// up to 8,192. Its ~41 KiB of shared memory a block does not lower its
/// occupancy: ptxas's 96 registers a thread (the default kernel's 98)
/// already hold it to 2 blocks an SM.
fn smem_capacity(n: i32) -> Option<i32> {
    static ON: OnceLock<bool> = OnceLock::new();
    if !super::opt_in("MLX_LFM_DECODE_ATTENTION_SMEM", &ON) || n > SMEM_MAX {
        return None;
    }
    Some(SMEM_MAX)
}

/// `MLX_LFM_DECODE_ATTENTION_SPLIT=1` (16) or `=8` (opt-in until its H200
/// A/B): a head's output elements split over HD / 16 (or HD / 8) blocks,
/// each scoring every position (its head's K read again, from L2) and
/// summing `p * v` over its own slice of V, so that a step's 32 heads run
/// as 128 (or 256) blocks, not 32 on the H200's 132 SMs, and each lane
/// group walks 4 (or 8) times fewer positions. Session 22's ncu timed the
/// one-block-a-head kernel at 15.7 us a launch over ~550 positions (73
/// GB/s): 32 SMs waiting on their loads. Its sums of `p * v` run in
/// another order than the default's (within the stock ops' tolerance, not
/// the same bits); it keeps the scratch row, never the shared scores.
fn split_dims() -> Option<i32> {
    static DIMS: OnceLock<Option<i32>> = OnceLock::new();
    if super::forced("MLX_LFM_DECODE_ATTENTION_SPLIT") {
        return Some(16);
    }
    crate::knobs::cached("MLX_LFM_DECODE_ATTENTION_SPLIT", &DIMS, |v| match v {
        Some("1") | Some("16") => Some(16),
        Some("8") => Some(8),
        _ => None,
    })
}

/// `MLX_LFM_DECODE_ATTENTION_CHUNKS=N` (2 to 64; opt-in until its H200
/// A/B): the positions over N blocks a KV head ([`PART_SOURCE`]), joined
/// by a second launch. Before the split and the shared scores.
fn chunks() -> Option<i32> {
    static N: OnceLock<Option<i32>> = OnceLock::new();
    // (Under a test's every-opt-in run the split and the shared scores
    // keep their turn: only the switch's own opt-in chunks.)
    if super::forced_alone("MLX_LFM_DECODE_ATTENTION_CHUNKS") {
        return Some(8);
    }
    crate::knobs::cached("MLX_LFM_DECODE_ATTENTION_CHUNKS", &N, |v| {
        v.and_then(|v| v.trim().parse::<i32>().ok()).filter(|n| (2..=64).contains(n))
    })
}

/// Query heads a KV head may serve in the chunked kernel (its registers
/// hold R x 8 partial sums a lane; ptxas: 72-96 registers at R = 4, no
/// spills). The 350M's 2, the 1.2B's and the 8B-A1B's 4.
const CHUNKED_MAX_R: i32 = 4;

fn chunked_kernels(upto: bool) -> Option<(&'static CudaKernel, &'static CudaKernel)> {
    static PART: [OnceLock<Option<CudaKernel>>; 2] = [const { OnceLock::new() }; 2];
    static JOIN: OnceLock<Option<CudaKernel>> = OnceLock::new();
    let (name, bound, validity) = match upto {
        true => ("lfm_decode_attention_part_upto", "upto", UPTO_VALID),
        false => ("lfm_decode_attention_part", "mask", MASK_VALID),
    };
    let part = PART[usize::from(upto)]
        .get_or_init(|| CudaKernel::new(name, &["q", "k", "v", bound], &["parts", "sc"], &PART_SOURCE.replace("__VALIDITY__", validity), "").ok())
        .as_ref()?;
    let join = JOIN.get_or_init(|| CudaKernel::new("lfm_decode_attention_join", &["parts"], &["out"], JOIN_SOURCE, "").ok()).as_ref()?;
    Some((part, join))
}

/// The chunked launch pair, where it is on and serves the heads (at most
/// [`CHUNKED_MAX_R`] query heads a KV head); None otherwise.
#[allow(clippy::too_many_arguments)]
fn launch_chunked(
    upto: bool,
    q: &Array,
    k: &Array,
    v: &Array,
    bound: &Array,
    scale: f32,
    extra: &[(&'static str, TemplateArg)],
    rows: bool,
) -> Result<Option<Array>> {
    let Some(c) = chunks() else { return Ok(None) };
    let (b, h, hd) = (q.dim(0), q.dim(1), q.dim(3));
    let (kvh, n) = (k.dim(1), k.dim(2));
    let r = h / kvh;
    if r > CHUNKED_MAX_R {
        return Ok(None);
    }
    let Some((part, join)) = chunked_kernels(upto) else { return Ok(None) };
    let dt = q.dtype();
    let too_many = || Error::invalid("too many heads for the decode attention kernel");
    let gx = kvh.checked_mul(c).and_then(|x| x.checked_mul(THREADS)).ok_or_else(too_many)?;
    let mut template = vec![
        ("HD", TemplateArg::Int(hd)),
        ("R", TemplateArg::Int(r)),
        ("CHUNKS", TemplateArg::Int(c)),
        ("SCALE_BITS", TemplateArg::Int(scale.to_bits() as i32)),
        ("T", TemplateArg::Dtype(dt)),
    ];
    template.extend(extra.iter().cloned());
    let outs = part.call(
        &[q, k, v, bound],
        &[(&[b, h, c, hd + 2], Dtype::Float32), (&[b, h, n], Dtype::Float32)],
        [gx, b, 1],
        [THREADS, 1, 1],
        &template,
    )?;
    let parts = outs.into_iter().next().ok_or_else(|| Error::mlx("decode attention chunks: missing output"))?;
    let width = h.checked_mul(hd).ok_or_else(too_many)?;
    let out_shape = if rows { vec![b, width] } else { vec![b, h, 1, hd] };
    let block = hd.max(32);
    let gj = h.checked_mul(block).ok_or_else(too_many)?;
    let mut outs = join.call(
        &[&parts],
        &[(&out_shape, dt)],
        [gj, b, 1],
        [block, 1, 1],
        &[("HD", TemplateArg::Int(hd)), ("CHUNKS", TemplateArg::Int(c)), ("T", TemplateArg::Dtype(dt))],
    )?;
    Ok(Some(outs.pop().ok_or_else(|| Error::mlx("decode attention join: missing output"))?))
}

/// `MLX_LFM_DECODE_ATTENTION_WIDE=1` (opt-in until its GPU test and A/B):
/// [`WIDE_SOURCE`] where it serves `n` positions of head size `hd` in
/// `dt` (the scores within [`SMEM_MAX`], a row's 16-byte loads within a
/// warp). Under a test's every-opt-in run the split and the shared scores
/// keep their turn: only the switch's own opt-in takes it.
fn wide(n: i32, hd: i32, dt: Dtype) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    let on = super::forced_alone("MLX_LFM_DECODE_ATTENTION_WIDE")
        || crate::knobs::cached("MLX_LFM_DECODE_ATTENTION_WIDE", &ON, |v| v == Some("1"));
    let per_load = (16 / dt.size().max(1)) as i32;
    on && n <= SMEM_MAX && hd >= per_load && (1..=32).contains(&(hd / per_load))
}

/// The variant a launch over `n` positions of head size `hd` in `dt` takes
/// (the wide one first, then the split, then the shared scores).
fn variant(n: i32, hd: i32, dt: Dtype) -> Variant {
    if wide(n, hd, dt) {
        return Variant::Wide;
    }
    match split_dims() {
        Some(d) if hd > d => Variant::Split(d),
        _ if smem_capacity(n).is_some() => Variant::Smem,
        _ => Variant::Plain,
    }
}

/// The cell of `variant` among a kernel's built variants.
fn slot(variant: Variant) -> usize {
    match variant {
        Variant::Plain => 0,
        Variant::Smem => 1,
        Variant::Split(16) => 2,
        Variant::Split(_) => 3,
        Variant::Wide => 4,
    }
}

fn kernel(variant: Variant) -> Option<&'static CudaKernel> {
    static K: [OnceLock<Option<CudaKernel>>; 5] = [const { OnceLock::new() }; 5];
    made(&K[slot(variant)], "lfm_decode_attention", "mask", MASK_VALID, variant)
}

fn upto_kernel(variant: Variant) -> Option<&'static CudaKernel> {
    static K: [OnceLock<Option<CudaKernel>>; 5] = [const { OnceLock::new() }; 5];
    made(&K[slot(variant)], "lfm_decode_attention_upto", "upto", UPTO_VALID, variant)
}

/// Whether the kernel serves these operands: one query token, K and V of one
/// head size in {8, ..., 256} (a power of two), whole query heads per KV
/// head, a boolean mask `[1 or B, 1, 1, N]`.
pub fn available(q: &Array, k: &Array, v: &Array, mask: &Array) -> bool {
    // MLX_LFM_DECODE_ATTENTION_KERNEL=0 keeps this one kernel off (the A/B).
    static ON: OnceLock<bool> = OnceLock::new();
    if !crate::knobs::cached("MLX_LFM_DECODE_ATTENTION_KERNEL", &ON, |v| v != Some("0")) {
        return false;
    }
    let dt = q.dtype();
    if !cuda_kernels_enabled() || !dt.is_float() || dt == Dtype::Float64 {
        return false;
    }
    if mask.ndim() != 4 || !operands_served(q, k, v) {
        return false;
    }
    let (b, n) = (q.dim(0), k.dim(2));
    mask.dtype() == Dtype::Bool
        && (mask.dim(0) == 1 || mask.dim(0) == b)
        && mask.dim(1) == 1
        && mask.dim(2) == 1
        && mask.dim(3) == n
        && kernel(Variant::Plain).is_some()
}

/// q, K and V as the kernel takes them (the dtype checked by the caller).
fn operands_served(q: &Array, k: &Array, v: &Array) -> bool {
    q.ndim() == 4 && q.dim(2) == 1 && dims_served(q.dtype(), (q.dim(0), q.dim(1), q.dim(3)), k, v)
}

/// [`operands_served`] for a query of `dt` and `(rows, heads, head_dim)`
/// (one token a row), before the query is made.
fn dims_served(dt: Dtype, (b, h, hd): (i32, i32, i32), k: &Array, v: &Array) -> bool {
    if k.ndim() != 4 || v.ndim() != 4 {
        return false;
    }
    let (kvh, n) = (k.dim(1), k.dim(2));
    k.dtype() == dt
        && v.dtype() == dt
        && k.shape() == v.shape()
        && k.dim(0) == b
        && k.dim(3) == hd
        && matches!(hd, 8 | 16 | 32 | 64 | 128 | 256)
        && kvh > 0
        && h % kvh == 0
        && n > 0
}

/// Whether the position-bounded kernel serves these operands: as
/// [`available`], with `upto` an int32 scalar (every row) or one a row.
/// `MLX_LFM_ATTENTION_UPTO=0` keeps the mask (its A/B and test).
pub fn upto_available(q: &Array, k: &Array, v: &Array, upto: &Array) -> bool {
    q.ndim() == 4 && q.dim(2) == 1 && upto_serves(q.dtype(), (q.dim(0), q.dim(1), q.dim(3)), k, v, upto)
}

/// [`upto_available`] for a query of `dt` and `(rows, heads, head_dim)`,
/// before the query is made: a step that has its q/k/v kernel write K/V
/// in place asks first, since only a kernel that takes q reads the
/// written row in order (src/cache/batch.rs `kv_buffers`).
pub fn upto_serves(dt: Dtype, q_dims: (i32, i32, i32), k: &Array, v: &Array, upto: &Array) -> bool {
    static ON: OnceLock<Option<bool>> = OnceLock::new();
    if !super::cuda_default("MLX_LFM_ATTENTION_UPTO", &ON) {
        return false;
    }
    static KERNEL_ON: OnceLock<bool> = OnceLock::new();
    if !crate::knobs::cached("MLX_LFM_DECODE_ATTENTION_KERNEL", &KERNEL_ON, |v| v != Some("0")) {
        return false;
    }
    if !cuda_kernels_enabled() || !dt.is_float() || dt == Dtype::Float64 || !dims_served(dt, q_dims, k, v) {
        return false;
    }
    upto.dtype() == Dtype::Int32
        && (upto.ndim() == 0 || (upto.ndim() == 1 && upto.dim(0) == q_dims.0))
        && upto_kernel(Variant::Plain).is_some()
}

/// `softmax(q k^T * scale) v` for one query token over each row's positions
/// `0..=upto` (the mask `arange(N) < upto + 1`, not built): the kernel; the
/// caller checks [`upto_available`] and builds the mask where it fails.
/// `rows`: the output as `[B, heads * head_dim]` (the same memory as `[B,
/// heads, 1, head_dim]`), what a decode step's output projection reads,
/// with no reshape node after it.
pub fn sdpa_upto(q: &Array, k: &Array, v: &Array, scale: f32, upto: &Array, rows: bool) -> Result<Array> {
    let per_row = vec![("PER_ROW", TemplateArg::Int(i32::from(upto.ndim() == 1)))];
    if let Some(out) = launch_chunked(true, q, k, v, upto, scale, &per_row, rows)? {
        return Ok(out);
    }
    launch(upto_kernel, q, k, v, upto, scale, per_row, rows)
}

/// `softmax(q k^T * scale, masked) v` for one query token: the kernel where
/// it serves, MLX's own sdpa elsewhere.
pub fn sdpa_masked(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Array) -> Result<Array> {
    if !available(q, k, v, mask) {
        return mlx::sdpa(q, k, v, scale, Mask::Array(mask));
    }
    if let Some(out) = launch_chunked(false, q, k, v, mask, scale, &[], false)? {
        return Ok(out);
    }
    launch(kernel, q, k, v, mask, scale, vec![], false)
}

/// Either kernel over `(q, k, v, bound)`: the mask or the positions.
/// (`made`: the kernel as [`variant`] lays it out, or the plain one where
/// that variant does not compile.)
#[allow(clippy::too_many_arguments)]
fn launch(
    made: fn(Variant) -> Option<&'static CudaKernel>,
    q: &Array,
    k: &Array,
    v: &Array,
    bound: &Array,
    scale: f32,
    mut extra: Vec<(&'static str, TemplateArg)>,
    rows: bool,
) -> Result<Array> {
    let (b, h, hd) = (q.dim(0), q.dim(1), q.dim(3));
    let n = k.dim(2);
    let want = variant(n, hd, q.dtype());
    let chosen = if made(want).is_some() { want } else { Variant::Plain };
    let kern = made(chosen).ok_or_else(|| Error::mlx("the decode attention kernel is not available"))?;
    let parts = match chosen {
        Variant::Split(d) => hd / d,
        Variant::Smem | Variant::Wide => {
            extra.push(("SN", TemplateArg::Int(SMEM_MAX)));
            1
        }
        Variant::Plain => 1,
    };
    let blocks = h.checked_mul(parts).ok_or_else(|| Error::invalid("too many heads for the decode attention kernel"))?;
    let gx = THREADS.checked_mul(blocks).ok_or_else(|| Error::invalid("too many heads for the decode attention kernel"))?;
    let mut template = vec![
        ("HD", TemplateArg::Int(hd)),
        // A float constant as its bits: template arguments are integers.
        ("SCALE_BITS", TemplateArg::Int(scale.to_bits() as i32)),
        ("T", TemplateArg::Dtype(q.dtype())),
    ];
    template.extend(extra);
    let width = h.checked_mul(hd).ok_or_else(|| Error::invalid("too many heads for the decode attention kernel"))?;
    let out_shape = if rows { vec![b, width] } else { vec![b, h, 1, hd] };
    // (The wide variant keeps its scores in shared memory: a token scratch.)
    let scratch = if chosen == Variant::Wide { vec![1] } else { vec![b, blocks, n] };
    let outs = kern.call(
        &[q, k, v, bound],
        &[(&out_shape, q.dtype()), (&scratch, Dtype::Float32)],
        [gx, b, 1],
        [THREADS, 1, 1],
        &template,
    )?;
    // The scores' scratch row (the second output) is the kernel's alone.
    outs.into_iter().next().ok_or_else(|| Error::mlx("decode attention kernel: missing output"))
}

#[cfg(test)]
mod tests {
    use super::{chunks, variant, Variant};
    use crate::mlx::Dtype;
    use crate::knobs::with_overrides;

    fn with(vars: &[(&str, &str)], f: impl FnOnce()) {
        let v: Vec<(String, Option<String>)> = vars.iter().map(|(k, v)| (k.to_string(), Some(v.to_string()))).collect();
        with_overrides(&v, f)
    }

    const WIDE_OFF: (&str, &str) = ("MLX_LFM_DECODE_ATTENTION_WIDE", "0");

    /// Which layout a launch takes: the split only where a head has more
    /// output elements than a block sums, before the shared scores.
    #[test]
    fn the_split_serves_heads_wider_than_a_block() {
        // (The shared scores set off, so the environment does not decide.)
        with(&[("MLX_LFM_DECODE_ATTENTION_SPLIT", "1"), ("MLX_LFM_DECODE_ATTENTION_SMEM", "0"), WIDE_OFF], || {
            assert_eq!(variant(768, 64, Dtype::Bfloat16), Variant::Split(16));
            assert_eq!(variant(768, 256, Dtype::Bfloat16), Variant::Split(16));
            assert_eq!(variant(768, 32, Dtype::Bfloat16), Variant::Split(16));
            assert_eq!(variant(768, 16, Dtype::Bfloat16), Variant::Plain);
        });
        with(&[("MLX_LFM_DECODE_ATTENTION_SPLIT", "8"), ("MLX_LFM_DECODE_ATTENTION_SMEM", "0"), WIDE_OFF], || {
            assert_eq!(variant(768, 64, Dtype::Bfloat16), Variant::Split(8));
            assert_eq!(variant(768, 8, Dtype::Bfloat16), Variant::Plain);
        });
        with(&[("MLX_LFM_DECODE_ATTENTION_SPLIT", "1"), ("MLX_LFM_DECODE_ATTENTION_SMEM", "1"), WIDE_OFF], || {
            assert_eq!(variant(768, 64, Dtype::Bfloat16), Variant::Split(16));
            assert_eq!(variant(768, 16, Dtype::Bfloat16), Variant::Smem);
            assert_eq!(variant(9000, 16, Dtype::Bfloat16), Variant::Plain);
        });
        let off = |v| [("MLX_LFM_DECODE_ATTENTION_SPLIT", v), ("MLX_LFM_DECODE_ATTENTION_SMEM", "0"), WIDE_OFF];
        with(&off("0"), || assert_eq!(variant(768, 64, Dtype::Bfloat16), Variant::Plain));
        with(&off("2"), || assert_eq!(variant(768, 64, Dtype::Bfloat16), Variant::Plain));
    }

    /// The wide variant before the split, where its scores fit shared
    /// memory and a row's 16-byte loads fit a warp (bf16 heads of 8 to 256,
    /// float32 of 4 to 128); elsewhere what the other switches say.
    #[test]
    fn the_wide_variant_serves_rows_within_a_warp_and_its_scores() {
        let on = [("MLX_LFM_DECODE_ATTENTION_WIDE", "1"), ("MLX_LFM_DECODE_ATTENTION_SPLIT", "1"), ("MLX_LFM_DECODE_ATTENTION_SMEM", "0")];
        with(&on, || {
            assert_eq!(variant(768, 64, Dtype::Bfloat16), Variant::Wide);
            assert_eq!(variant(8192, 256, Dtype::Bfloat16), Variant::Wide);
            assert_eq!(variant(8192, 8, Dtype::Float16), Variant::Wide);
            assert_eq!(variant(768, 128, Dtype::Float32), Variant::Wide);
            assert_eq!(variant(8193, 64, Dtype::Bfloat16), Variant::Split(16));
            assert_eq!(variant(768, 256, Dtype::Float32), Variant::Split(16));
            assert_eq!(variant(768, 4, Dtype::Bfloat16), Variant::Plain);
        });
        for v in ["0", "2", "yes"] {
            with(&[("MLX_LFM_DECODE_ATTENTION_WIDE", v), ("MLX_LFM_DECODE_ATTENTION_SPLIT", "0"), ("MLX_LFM_DECODE_ATTENTION_SMEM", "0")], || {
                assert_eq!(variant(768, 64, Dtype::Bfloat16), Variant::Plain, "{v:?}")
            });
        }
        crate::kernels::with_opt_in_one("MLX_LFM_DECODE_ATTENTION_WIDE", || assert_eq!(variant(768, 64, Dtype::Bfloat16), Variant::Wide));
    }

    /// The chunked variant's count: 2 to 64 chunks, anything else off.
    #[test]
    fn attention_chunks_take_two_to_sixty_four() {
        for (v, want) in [("8", Some(8)), ("2", Some(2)), ("64", Some(64)), (" 4 ", Some(4)), ("1", None), ("65", None), ("x", None), ("0", None)] {
            with(&[("MLX_LFM_DECODE_ATTENTION_CHUNKS", v)], || assert_eq!(chunks(), want, "{v:?}"));
        }
        crate::kernels::with_opt_in_one("MLX_LFM_DECODE_ATTENTION_CHUNKS", || assert_eq!(chunks(), Some(8)));
    }
}
