//! The stages a one-launch layer hands on within one kernel
//! (src/kernels/moe_fused.rs, conv_fused.rs, ffn_fused.rs, qkv_fused.rs;
//! the design is moe_fused.rs's note): their device helpers, their
//! counters, the test's give-up variant of each kernel and a count of the
//! graphs each was put into.

use super::add_rms_norm::Walks;
use crate::error::{Error, Result};
use crate::mlx::kernel::{CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::Quantized;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The waits, the staging loads, the tickets, the releases and the norm
/// stage every one-launch layer's kernel is built on.
pub(crate) const TICKET_HEADER: &str = r#"
#ifndef LFM_SPIN_LIMIT
#define LFM_SPIN_LIMIT (1 << 20)
#endif
// Waits (one thread) until *p >= v; 1 if it gave up. The acquire side of
// the stages' handoff: the fence after the value is seen orders what the
// block reads next after what the producer wrote before its release.
__device__ inline int lfm_wait_at_least(unsigned long long* p, unsigned long long v) {
  for (int i = 0; i < LFM_SPIN_LIMIT; i++) {
    if (*reinterpret_cast<volatile unsigned long long*>(p) >= v) {
      __threadfence();
      return 0;
    }
    __nanosleep(64);
  }
  return 1;
}
// n 16-byte runs from global memory another block wrote during this launch
// into shared memory, read at L2 (not a line L1 may hold from before).
__device__ inline void lfm_stage16(uint4* dst, const void* src, int n) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = __ldcg(s + i);
}
// The block's ticket (thread 0 takes it from the counter at st), for
// every thread: its launch (ticket / NB) and its part (ticket % NB).
template <int NB>
__device__ inline int lfm_take_part(unsigned long long* st, unsigned long long& launch) {
  __shared__ unsigned long long ticket;
  if (threadIdx.x == 0) ticket = atomicAdd(st, 1ull);
  __syncthreads();
  launch = ticket / NB;
  return static_cast<int>(ticket % NB);
}
// The release side: once the whole block has written its part, thread 0's
// fence, then the mark (at least v) or the count (one more).
__device__ inline void lfm_release_mark(unsigned long long* p, unsigned long long v) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicMax(p, v);
  }
}
__device__ inline void lfm_release_count(unsigned long long* p) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(p, 1ull);
  }
}
// Thread 0 waits for *p >= v, then (unless it gave up) for *p2 >= v2;
// every thread gets whether it gave up. (`late` is one variable a kernel:
// the second barrier lets a later call set it again.)
__device__ inline bool lfm_block_wait(unsigned long long* p, unsigned long long v, unsigned long long* p2,
                                      unsigned long long v2) {
  __shared__ int late;
  if (threadIdx.x == 0) {
    int l = lfm_wait_at_least(p, v);
    if (!l && p2) l = lfm_wait_at_least(p2, v2);
    late = l;
  }
  __syncthreads();
  const bool gave_up = late != 0;
  __syncthreads();
  return gave_up;
}
#if !LFM_NORM_IN_WIDER_BLOCK
#error "the fused layers' blocks are wider than the norm's: define LFM_NORM_IN_WIDER_BLOCK 1 before the add + RMSNorm code"
#endif
// The first stage of both fused layers: the residual add + RMSNorm of the
// row with the add + RMSNorm kernel's block of NBLK threads (its bits),
// the sum into s, the normed row into ys (shared) and yn (for the blocks
// after), and the whole block past its barrier.
template <typename T, int D, int NBLK>
__device__ inline void lfm_norm_stage(const T* h, const T* r, const T* wn, float eps, T* s, T* ys, T* yn) {
  if (lfm_aligned(h) && lfm_aligned(r) && lfm_aligned(wn) && lfm_aligned(s)) {
    lfm_add_rms_row<T, D, NBLK, true>(h, r, wn, eps, s, ys);
  } else {
    lfm_add_rms_row<T, D, NBLK, false>(h, r, wn, eps, s, ys);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < D; i += blockDim.x) yn[i] = ys[i];
  __syncthreads();
}
"#;

/// The body of the short-conv layer's, the feed-forward's, the MoE's and
/// the joined one-launch kernels (src/kernels/conv_fused.rs, ffn_fused.rs,
/// moe_fused.rs, conv_layer_fused.rs), one text for all so that each stage
/// is the same code in each: `LFM_CONV_PART`, `LFM_FFN_PART` and
/// `LFM_MOE_PART` choose the parts ([`layer_defines`]); the MoE part's
/// stages are the router + norm's and the experts' (moe_fused.rs's note). The conv part: the add + RMSNorm (its sum into
/// `LFM_CONV_SUM`), in_proj and the conv step a channel a warp, out_proj
/// an output a warp (into `LFM_CONV_ROW`); the feed-forward part: its add +
/// RMSNorm (joined: of out_proj's row and the conv's sum, staged at L2, as
/// the other kernel reads them from global memory; its normed row into
/// `LFM_FFN_YN`), the gate a warp an output (`LFM_F_ROWS`), w2 a warp an
/// output (`LFM_G_ROWS`). Counters: tickets; the conv's norm mark, its
/// channel blocks done and (joined) its out_proj blocks done; then the
/// feed-forward's norm mark and gate blocks done (in rounds,
/// `LFM_GATE_ROUNDS`: their first round, then each next round's).
pub(crate) const LAYER_SOURCE: &str = r#"
#ifndef LFM_OUT_ONLY
#define LFM_OUT_ONLY 0
#endif
#ifndef LFM_MOE_EXACT
#define LFM_MOE_EXACT 0
#endif
#ifndef LFM_MOE_DOWN_PREFETCH
#define LFM_MOE_DOWN_PREFETCH 0
#endif
#ifndef LFM_MOE_GATE_ROWS
#define LFM_MOE_GATE_ROWS 1
#endif
#if LFM_MOE_GATE_ROWS != 1 && (LFM_MOE_GATE_ROWS != 2 || LFM_CONV_PART || !LFM_MOE_PART || !LFM_MOE_EXACT)
#error "LFM_MOE_GATE_ROWS: 1, or 2 in the MoE layer's own kernel with its experts exact"
#endif
#ifndef LFM_MOE_DOWN_COLS
#define LFM_MOE_DOWN_COLS 1
#endif
#if LFM_MOE_DOWN_COLS != 1 && (LFM_MOE_DOWN_COLS != 2 || LFM_CONV_PART || !LFM_MOE_PART || !LFM_MOE_EXACT)
#error "LFM_MOE_DOWN_COLS: 1, or 2 in the MoE layer's own kernel with its experts exact"
#endif
#ifndef LFM_GATE_OUTS
#define LFM_GATE_OUTS 1
#endif
#ifndef LFM_GATE_ROUNDS
#define LFM_GATE_ROUNDS 0
#endif
#if LFM_GATE_OUTS > 1 && (LFM_CONV_PART || !LFM_FFN_PART)
#error "LFM_GATE_OUTS: the feed-forward's own kernel only"
#endif
#if (LFM_GATE_ROUNDS && LFM_GATE_OUTS != LFM_GATE_ROUNDS) || (!LFM_GATE_ROUNDS && LFM_GATE_OUTS > 2)
#error "LFM_GATE_ROUNDS: as many gate outputs a warp as rounds (and more than two only in rounds)"
#endif
#if LFM_MOE_DOWN_PREFETCH && (LFM_CONV_PART || !LFM_MOE_PART)
#error "LFM_MOE_DOWN_PREFETCH: the MoE layer's own kernel only"
#endif
#if LFM_CONV_PART && LFM_OUT_ONLY
  // Only the conv part's out_proj stage, over a row an earlier launch
  // wrote (an attention layer's output: its out_proj joined to the
  // feed-forward or MoE after it).
  constexpr int IB = 0;
  constexpr int CR = C * sizeof(T) / 16;
#elif LFM_CONV_PART
  constexpr int IB = (C + WARPS - 1) / WARPS;
  constexpr int CR = C * sizeof(T) / 16;
#else
  constexpr int IB = 0;
  constexpr int CR = 0;
#endif
  constexpr int OB = (D + WARPS - 1) / WARPS;
#if LFM_MOE_PART
  // The experts: gate/up a warp a row of one chosen expert
  // (LFM_MOE_GATE_ROWS of them: src/kernels/moe_fused.rs gate_rows), down
  // a warp one chosen expert of one output column (CPB columns a block;
  // LFM_MOE_DOWN_COLS of them, moe_fused.rs down_cols).
  constexpr int KE = TOPK;
  constexpr int RB = (F + LFM_MOE_GATE_ROWS * WARPS - 1) / (LFM_MOE_GATE_ROWS * WARPS);
  constexpr int GB = KE * RB;
  constexpr int CPB = WARPS / KE;
  constexpr int DB = (D + LFM_MOE_DOWN_COLS * CPB - 1) / (LFM_MOE_DOWN_COLS * CPB);
  constexpr int HR = KE * F * sizeof(T) / 16;
  constexpr int TAIL_NB = 1 + GB + DB;
  __shared__ float probs_s[E];
  __shared__ float part[WARPS];
#if LFM_MOE_DOWN_COLS == 2
  __shared__ float part2[WARPS];
#endif
#elif LFM_FFN_PART
  // (Two gate outputs a warp, src/kernels/ffn_fused.rs gate_outs: half the
  // gate's blocks.)
  constexpr int GB = (F + LFM_GATE_OUTS * WARPS - 1) / (LFM_GATE_OUTS * WARPS);
  constexpr int HR = F * sizeof(T) / 16;
  constexpr int TAIL_NB = 1 + GB + OB;
#else
  constexpr int GB = 0;
  constexpr int HR = 0;
  constexpr int TAIL_NB = 0;
#endif
  constexpr int CONV_NB = LFM_CONV_PART ? (LFM_OUT_ONLY ? OB : 1 + IB + OB) : 0;
  constexpr int NB = CONV_NB + TAIL_NB;
  constexpr int XR = D * sizeof(T) / 16;
  constexpr int SA = XR > CR ? XR : CR;
  constexpr int SB = SA > HR ? SA : HR;
  // (Joined: the second norm stages its two rows and writes its own.)
  constexpr int SN = (LFM_CONV_PART && TAIL_NB > 0) ? 3 * XR : 0;
  __shared__ uint4 sm[SB > SN ? SB : SN];
  unsigned long long* st = reinterpret_cast<unsigned long long*>(const_cast<uint32_t*>(ctr));
  const int lane = threadIdx.x % 32;
  const int wid = threadIdx.x / 32;
  unsigned long long launch;
  const int role = lfm_take_part<NB>(st, launch);
  const float poison = __int_as_float(0x7fc00000);
#if LFM_CONV_PART && !LFM_OUT_ONLY
  if (role == 0) {
    lfm_norm_stage<T, D, NBLK>(h, r, wn, __int_as_float(EPS_BITS), LFM_CONV_SUM, reinterpret_cast<T*>(sm), yn);
    lfm_release_mark(st + 1, launch + 1);
    return;
  }
  if (role <= IB) {
    // in_proj's three rows of channel c, then the conv step on them.
    const int c = (role - 1) * WARPS + wid;
    const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);
    if (!late) lfm_stage16(sm, yn, XR);
    __syncthreads();
    if (c < C) {
      float s3[3] = {0.0f, 0.0f, 0.0f};
      const size_t rows[3] = {static_cast<size_t>(c), static_cast<size_t>(C) + c, 2 * static_cast<size_t>(C) + c};
      if (!late) LFM_IN_ROWS(D, 3, rows, reinterpret_cast<const T*>(sm), lane, s3);
      if (lane == 0) {
        const T* wd = cw + static_cast<size_t>(c) * (KEEP + 1);
        float acc = 0.0f;
        for (int j = 0; j < KEEP; j++) {
          const T v = state[j * C + c];
          if (j > 0) next[(j - 1) * C + c] = late ? T(poison) : v;
          acc += static_cast<float>(wd[j]) * static_cast<float>(v);
        }
        const T bt = T(s3[0]);
        const T ct = T(s3[1]);
        const T xt = T(s3[2]);
        const T bx = T(static_cast<float>(bt) * static_cast<float>(xt));
        next[(KEEP - 1) * C + c] = late ? T(poison) : bx;
        acc += static_cast<float>(wd[KEEP]) * static_cast<float>(bx);
        yc[c] = late ? T(poison) : T(static_cast<float>(ct) * static_cast<float>(T(acc)));
      }
    }
    lfm_release_count(st + 2);
    return;
  }
#endif
#if LFM_CONV_PART
  if (role < CONV_NB) {
    // out_proj's output n, once every channel of the launch is done (its
    // row from an earlier launch: at once).
#if LFM_OUT_ONLY
    const int n = role * WARPS + wid;
    const bool late = false;
    // (The heads' row comes from an earlier launch, as MLX hands it over:
    // where it does not start on a 16-byte boundary, element by element.)
    if (lfm_aligned(yc)) {
      lfm_stage16(sm, yc, CR);
    } else {
      for (int i = threadIdx.x; i < C; i += blockDim.x) reinterpret_cast<T*>(sm)[i] = yc[i];
    }
#else
    const int n = (role - 1 - IB) * WARPS + wid;
    const bool late = lfm_block_wait(st + 2, (launch + 1) * IB, nullptr, 0);
    if (!late) lfm_stage16(sm, yc, CR);
#endif
    __syncthreads();
    if (n < D) {
      float o[1] = {0.0f};
      const size_t rows[1] = {static_cast<size_t>(n)};
      if (!late) LFM_OUT_ROWS(C, 1, rows, reinterpret_cast<const T*>(sm), lane, o);
      if (lane == 0) LFM_CONV_ROW[n] = late ? T(poison) : T(o[0]);
    }
#if LFM_FFN_PART || LFM_MOE_PART
    lfm_release_count(st + 3);
#endif
    return;
  }
#endif
#if LFM_FFN_PART || LFM_MOE_PART
  constexpr int FC = LFM_CONV_PART ? 3 : 0;
  const int fr = role - CONV_NB;
  if (fr == 0) {
    // The feed-forward's add + RMSNorm (a MoE's with 256 threads, as the
    // router + norm kernel runs it, then the route on the normed row).
#if LFM_MOE_PART
    constexpr int TN = 256;
#else
    constexpr int TN = NBLK;
#endif
#if LFM_CONV_PART
    // Once every out_proj block of the launch is done: its row and the
    // residual sum (the conv's, or the attention layer's input), staged at
    // L2 (other blocks wrote them in this launch).
    const bool late = lfm_block_wait(st + 3, (launch + 1) * OB, nullptr, 0);
    T* hs = reinterpret_cast<T*>(sm);
    T* rs = hs + D;
    T* ys = rs + D;
    if (!late) {
      lfm_stage16(sm, o1, XR);
#if LFM_OUT_ONLY
      // (The residual sum, an input: as the heads' row above.)
      if (lfm_aligned(r)) {
        lfm_stage16(sm + XR, r, XR);
      } else {
        for (int i = threadIdx.x; i < D; i += blockDim.x) rs[i] = r[i];
      }
#else
      lfm_stage16(sm + XR, LFM_TAIL_RESIDUAL, XR);
#endif
    }
    __syncthreads();
    if (late) {
      for (int i = threadIdx.x; i < D; i += blockDim.x) {
        s[i] = T(poison);
        LFM_FFN_YN[i] = T(poison);
      }
#if LFM_MOE_PART
      // (No expert: every later stage of the launch poisons its part.)
      if (threadIdx.x < KE) {
        inds[threadIdx.x] = E;
        scores[threadIdx.x] = poison;
      }
#endif
    } else {
      lfm_norm_stage<T, D, TN>(hs, rs, fwn, __int_as_float(EPS_BITS), s, ys, LFM_FFN_YN);
#else
    {
      T* ys = reinterpret_cast<T*>(sm);
      lfm_norm_stage<T, D, TN>(h, r, wn, __int_as_float(EPS_BITS), s, ys, LFM_FFN_YN);
#endif
#if LFM_MOE_PART
      const float sc[1] = {__int_as_float(SCALE_BITS)};
      lfm_gate_route<T, D, E, GBITS, GGS, TOPK, NORM, WARPS>(ys, lfm_aligned(gw), gw, gscales, gbiases, bias, sc, inds,
                                                            scores, probs_s, 0);
#endif
    }
    lfm_release_mark(st + FC + 1, launch + 1);
    return;
  }
#if LFM_MOE_PART
  if (fr <= GB) {
    // Gate/up: a warp one row of one chosen expert, after the route.
    const int j = (fr - 1) / RB;
    const int n = ((fr - 1) % RB) * WARPS + wid;
    const bool late = lfm_block_wait(st + FC + 1, launch + 1, nullptr, 0);
    T* xs = reinterpret_cast<T*>(sm);
    if (!late) lfm_stage16(sm, LFM_FFN_YN, XR);
    __syncthreads();
#if LFM_MOE_DOWN_PREFETCH == 1
    lfm_moe_down_prefetch<T, D, F, BITS, GS, RB>(dw, dscales, dbiases, late ? E : __ldcg(inds + j), E, (fr - 1) % RB);
#endif
#if LFM_MOE_GATE_ROWS == 2
    {
      // The warp's second output n2 = n + RB * WARPS too, its four rows
      // asked of L2 first and then walked in turn, each as it is alone
      // (MLX's walk: the same sums). (Past F, on the last blocks of a
      // width that is no multiple of 2 * WARPS, n2 walks n's rows again
      // and writes nothing.)
      const int n2 = n + RB * WARPS;
      const int m2 = n2 < F ? n2 : n;
      const size_t ex = late ? 0 : __ldcg(inds + j);
      const bool bad = late || ex >= E;
      float g4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      if (!bad && n < F) {
        const size_t base = ex * (2 * F);
        const size_t rows[4] = {base + n, base + F + n, base + m2, base + F + m2};
        lfm_stage_qrows<T, D, BITS, GS, 4>(xs, uw, uscales, ubiases, rows, lane, g4);
      }
      if (lane == 0 && n < F) hk[static_cast<size_t>(j) * F + n] = bad ? T(poison) : lfm_swiglu<T>(g4[0], g4[1]);
      if (lane == 0 && n2 < F) hk[static_cast<size_t>(j) * F + n2] = bad ? T(poison) : lfm_swiglu<T>(g4[2], g4[3]);
    }
#else
    if (n < F) {
      float ag = 0.0f;
      float au = 0.0f;
      // (An expert id out of range, which the route never writes, poisons
      // rather than reads past the stacks.)
      const size_t ex = late ? 0 : __ldcg(inds + j);
      const bool bad = late || ex >= E;
      if (!bad) {
        const size_t gi = ex * (2 * F) + n;
        const size_t ui = ex * (2 * F) + F + n;
#if LFM_MOE_EXACT
        // MLX's qmv arithmetic (src/kernels/moe_fused.rs experts_exact),
        // as the feed-forward's LFM_F_ROWS walks its pair.
        const size_t rows[2] = {gi, ui};
        float gu[2];
        lfm_stage_qrows<T, D, BITS, GS, 2>(xs, uw, uscales, ubiases, rows, lane, gu);
        ag = gu[0];
        au = gu[1];
#else
        constexpr int G = D / GS;
        constexpr int WORDS = D * BITS / 32;
        if (lfm_aligned(uw)) {
          lfm_qdot2_a<T, D, BITS, GS, true>(xs, uw + gi * WORDS, uscales + gi * G, ubiases + gi * G, uw + ui * WORDS,
                                            uscales + ui * G, ubiases + ui * G, lane, ag, au);
        } else {
          lfm_qdot2_a<T, D, BITS, GS, false>(xs, uw + gi * WORDS, uscales + gi * G, ubiases + gi * G, uw + ui * WORDS,
                                             uscales + ui * G, ubiases + ui * G, lane, ag, au);
        }
        ag = lfm_warp_sum(ag);
        au = lfm_warp_sum(au);
#endif
      }
      if (lane == 0) hk[static_cast<size_t>(j) * F + n] = bad ? T(poison) : lfm_swiglu<T>(ag, au);
    }
#endif
#if LFM_MOE_DOWN_PREFETCH == 2
    lfm_moe_down_prefetch<T, D, F, BITS, GS, RB>(dw, dscales, dbiases, late ? E : __ldcg(inds + j), E, (fr - 1) % RB);
#endif
    lfm_release_count(st + FC + 2);
    return;
  }
  // Down: a warp one chosen expert of one output column, the column's
  // experts summed in their order, after every gate/up block of the launch.
  const int db = fr - 1 - GB;
  // The router's mark too: gate/up blocks that gave up still count
  // themselves, and the route's outputs are only written once it is set.
  const bool late = lfm_block_wait(st + FC + 2, (launch + 1) * GB, st + FC + 1, launch + 1);
  const T* hs = reinterpret_cast<const T*>(sm);
  if (!late) lfm_stage16(sm, hk, HR);
  __syncthreads();
  const int j = wid % KE;
  const int col = wid / KE;
  const int n = db * CPB + col;
  const bool active = col < CPB && n < D;
  const size_t ex = late ? 0 : __ldcg(inds + j);
  if (active && (late || ex >= E) && lane == 0) part[wid] = poison;
#if LFM_MOE_DOWN_COLS == 2
  // And column n2 = n + DB * CPB of the same expert: both rows asked of L2
  // first, then each walked as it is alone (the same sums). (Past D, on
  // the last blocks, n2 walks n's row again and writes nothing.)
  const int n2 = n + DB * CPB;
  const bool active2 = col < CPB && n2 < D;
  if (active2 && (late || ex >= E) && lane == 0) part2[wid] = poison;
#endif
  if (active && !late && ex < E) {
    const size_t wi = ex * D + n;
    const T* hr = hs + static_cast<size_t>(j) * F;
#if LFM_MOE_EXACT && LFM_MOE_DOWN_COLS == 2
    const size_t rows[2] = {wi, ex * D + (active2 ? n2 : n)};
    float a2[2];
    lfm_stage_qrows<T, F, BITS, GS, 2>(hr, dw, dscales, dbiases, rows, lane, a2);
    const float a = a2[0];
    if (active2 && lane == 0) part2[wid] = static_cast<float>(T(static_cast<float>(T(a2[1])) * __ldcg(scores + j)));
#elif LFM_MOE_EXACT
    const size_t rows[1] = {wi};
    float a;
    lfm_stage_qrows<T, F, BITS, GS, 1>(hr, dw, dscales, dbiases, rows, lane, &a);
#else
    constexpr int G = F / GS;
    constexpr int WORDS = F * BITS / 32;
    float a = 0.0f;
    if (lfm_aligned(dw)) {
      lfm_qdot_a<T, F, 1, BITS, GS, true>(hr, dw + wi * WORDS, dscales + wi * G, dbiases + wi * G, lane, &a);
    } else {
      lfm_qdot_a<T, F, 1, BITS, GS, false>(hr, dw + wi * WORDS, dscales + wi * G, dbiases + wi * G, lane, &a);
    }
    a = lfm_warp_sum(a);
#endif
    if (lane == 0) part[wid] = static_cast<float>(T(static_cast<float>(T(a)) * __ldcg(scores + j)));
  }
  __syncthreads();
#if LFM_MOE_DOWN_COLS == 2
  if (active2 && j == 0 && lane == 0) {
    float total2 = 0.0f;
    for (int i = 0; i < KE; i++) total2 += part2[col * KE + i];
    out[n2] = late ? T(poison) : T(total2);
  }
#endif
  if (active && j == 0 && lane == 0) {
    float total = 0.0f;
    for (int i = 0; i < KE; i++) total += part[col * KE + i];
    out[n] = late ? T(poison) : T(total);
  }
#else
  if (fr <= GB) {
    // The gate's output j: w1's row j and w3's row F + j.
    const int j = (fr - 1) * WARPS + wid;
    const bool late = lfm_block_wait(st + FC + 1, launch + 1, nullptr, 0);
    if (!late) lfm_stage16(sm, LFM_FFN_YN, XR);
    __syncthreads();
#if LFM_GATE_ROUNDS
    // Output j (round 0: the gated row's first GB * WARPS), counted done
    // before output j + GB * WARPS (round 1), and so on, so that w2's
    // blocks walk each round's part of the row while the next is made
    // (ffn_fused.rs rounds).
    for (int k = 0; k < LFM_GATE_ROUNDS; k++) {
      const int jk = j + k * GB * WARPS;
      if (jk < F) {
        float gu[2] = {0.0f, 0.0f};
        const size_t rows[2] = {static_cast<size_t>(jk), static_cast<size_t>(F) + jk};
        if (!late) LFM_F_ROWS(D, 2, rows, reinterpret_cast<const T*>(sm), lane, gu);
        if (lane == 0) hk[jk] = late ? T(poison) : lfm_swiglu<T>(gu[0], gu[1]);
      }
#ifdef LFM_STAMP
      // (Done before its last release, as every stage's stamp.)
      if (k == LFM_GATE_ROUNDS - 1) LFM_STAMP(3);
#endif
      lfm_release_count(st + FC + 2 + k);
    }
    return;
#elif LFM_GATE_OUTS == 2
    // And output j + GB * WARPS: the two outputs' four rows walked
    // together, each row's sum the walk it takes alone.
    const int j2 = j + GB * WARPS;
    if (j2 < F) {
      float gu[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const size_t rows[4] = {static_cast<size_t>(j), static_cast<size_t>(F) + j, static_cast<size_t>(j2),
                              static_cast<size_t>(F) + j2};
      if (!late) LFM_F_ROWS(D, 4, rows, reinterpret_cast<const T*>(sm), lane, gu);
      if (lane == 0) {
        hk[j] = late ? T(poison) : lfm_swiglu<T>(gu[0], gu[1]);
        hk[j2] = late ? T(poison) : lfm_swiglu<T>(gu[2], gu[3]);
      }
    } else
#endif
    if (j < F) {
      float gu[2] = {0.0f, 0.0f};
      const size_t rows[2] = {static_cast<size_t>(j), static_cast<size_t>(F) + j};
      if (!late) LFM_F_ROWS(D, 2, rows, reinterpret_cast<const T*>(sm), lane, gu);
      if (lane == 0) hk[j] = late ? T(poison) : lfm_swiglu<T>(gu[0], gu[1]);
    }
    lfm_release_count(st + FC + 2);
    return;
  }
#if LFM_GATE_ROUNDS
  // w2's output n: the gated row's first round's part once every gate
  // block has done its round 0, then each next part after its round;
  // each lane's columns in the one walk's order (lfm_drow_round), so the
  // same sum. (Its first two lines are the other form's, so that the
  // early and timeline forms' substitutions land in both.)
  const int n = (fr - 1 - GB) * WARPS + wid;
  const bool late = lfm_block_wait(st + FC + 2, (launch + 1) * GB, nullptr, 0);
  constexpr int H = GB * WARPS;
  const T* xs = reinterpret_cast<const T*>(sm);
  const T* wr = ow + static_cast<size_t>(n < D ? n : 0) * F;
  float o = 0.0f;
  bool gone = late;
  for (int k = 0; k < LFM_GATE_ROUNDS; k++) {
    const int lo = k * H;
    const int hi = lo + H < F ? lo + H : F;
    // (gone is the block's: every thread calls the wait or none does.)
    if (k > 0) gone = gone || lfm_block_wait(st + FC + 2 + k, (launch + 1) * GB, nullptr, 0);
    if (!gone && lo < hi) lfm_stage16(sm + lo * sizeof(T) / 16, hk + lo, (hi - lo) * static_cast<int>(sizeof(T)) / 16);
    __syncthreads();
#ifdef LFM_STAMP
    if (k == 0) LFM_STAMP(2);
#endif
    if (n < D && !gone) lfm_drow_round<T, F, H, LFM_GATE_ROUNDS>(xs, wr, lfm_aligned(ow), lane, k, &o);
  }
  o = lfm_warp_sum(o);
  if (n < D && lane == 0) out[n] = gone ? T(poison) : T(o);
#ifdef LFM_STAMP
  LFM_STAMP(3);
#endif
#else
  // w2's output n, once every gate output of the launch is done.
  const int n = (fr - 1 - GB) * WARPS + wid;
  const bool late = lfm_block_wait(st + FC + 2, (launch + 1) * GB, nullptr, 0);
  if (!late) lfm_stage16(sm, hk, HR);
  __syncthreads();
  if (n < D) {
    float o[1] = {0.0f};
    const size_t rows[1] = {static_cast<size_t>(n)};
    if (!late) LFM_G_ROWS(F, 1, rows, reinterpret_cast<const T*>(sm), lane, o);
    if (lane == 0) out[n] = late ? T(poison) : T(o[0]);
  }
#endif
#endif
#endif
"#;

/// L2 prefetches of a byte span, by a warp's lanes and by a whole block
/// (no register, no consumer: the DRAM reads start at once and a later
/// load waits on L2 at most). One a 32-byte sector the span touches: PTX
/// promises the line that holds the address, and L2 fills by sectors, so
/// a prefetch a 128-byte line could bring a quarter of it (the span of a
/// 1 KB row is then one prefetch a lane).
pub(crate) const PREFETCH_HEADER: &str = r#"
__device__ inline void lfm_prefetch_span(const void* p, int bytes, int lane) {
  const unsigned long long a = reinterpret_cast<unsigned long long>(p);
  for (unsigned long long l = (a & ~31ull) + 32ull * lane; l < a + bytes; l += 32ull * 32ull) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(l));
  }
}
__device__ inline void lfm_prefetch_block(const void* p, int bytes) {
  const unsigned long long a = reinterpret_cast<unsigned long long>(p);
  for (unsigned long long l = (a & ~31ull) + 32ull * threadIdx.x; l < a + bytes; l += 32ull * blockDim.x) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(l));
  }
}
"#;

/// The MoE layer's down rows asked of L2 by its gate/up blocks
/// (src/kernels/moe_fused.rs `down_prefetch`): gate/up block `q` of its
/// expert's `RB` takes the `q`th share of that expert's `D` down rows (their
/// words, scales and biases), so that every chosen expert's down matrix is
/// asked for once, while the gate/up stage runs, and the down blocks after
/// it find their rows in L2. Needs [`PREFETCH_HEADER`].
pub(crate) const MOE_DOWN_PREFETCH_HEADER: &str = r#"
template <typename T, int D, int F, int BITS, int GS, int RB>
__device__ inline void lfm_moe_down_prefetch(const uint32_t* dw, const T* dsc, const T* dbi, uint32_t ex, uint32_t experts,
                                             int q) {
  constexpr int SHARE = (D + RB - 1) / RB;
  constexpr int WORDS = F * BITS / 32;
  constexpr int G = F / GS;
  const int r0 = q * SHARE;
  const int n = D - r0 < SHARE ? D - r0 : SHARE;
  if (ex >= experts || n <= 0) return;
  const size_t row0 = static_cast<size_t>(ex) * D + r0;
  lfm_prefetch_block(dw + row0 * WORDS, n * WORDS * 4);
  lfm_prefetch_block(dsc + row0 * G, n * G * (int)sizeof(T));
  lfm_prefetch_block(dbi + row0 * G, n * G * (int)sizeof(T));
}
"#;

/// The one-launch layers [`early_prefetch`] names.
const EARLY_PARTS: [&str; 3] = ["conv", "ffn", "qkv"];

/// `MLX_LFM_EARLY_PREFETCH=conv,ffn,qkv` (any of them, or `all`; opt-in,
/// session 34; the MoE router's rows before its ticket, session 35, tied
/// and was retired): the one-launch conv layer's,
/// feed-forward's and q/k/v stage's blocks ask L2 for their weight rows
/// when they take their part, before they wait for the stage before
/// theirs (the weights depend on nothing the launch computes), so the
/// rows' DRAM reads run during the norm's stage and the first
/// projection's instead of after them. (The q/k/v stage is 49 blocks on
/// the 8B-A1B, a head each: 107 µs of session 33's step over six layers.)
/// Session 33's ncu (an H100): the 8B-A1B's conv layer 25 µs a launch for
/// ~9.4 MB (~0.37 TB/s), all its 257 blocks resident at once; its rows
/// were asked for only after each wait. The same sums (a prefetch changes
/// no value): the kernels' tests hold the forms to the same bits.
/// (Session 34's kernel-bench, an H100: the conv layer 26.9 µs early
/// against 26.1, bf16 23.4 against 21.9, the feed-forward 40.9 against
/// 41.4: no gain where every block is resident and waits anyway.)
/// Forms of the waiting kernels: since session 50, when each stage's
/// every-norm form became a CUDA default, a stage takes its early form
/// only with its every-norm switch `=0` (`MLX_LFM_QKV_EVERY_NORM`,
/// `MLX_LFM_CONV_EVERY_NORM`, `MLX_LFM_FFN_EVERY_NORM`).
pub(crate) fn early_prefetch(part: &str) -> bool {
    static ON: OnceLock<[bool; 3]> = OnceLock::new();
    let on = crate::knobs::cached("MLX_LFM_EARLY_PREFETCH", &ON, |v| {
        let parts: Vec<&str> = v.unwrap_or("").split(',').map(str::trim).collect();
        EARLY_PARTS.map(|p| parts.contains(&p) || parts.contains(&"all"))
    });
    EARLY_PARTS.iter().position(|p| *p == part).is_some_and(|i| on[i])
}

/// The early form's prefetch of a weight row (`LFM_EARLY_IN(K, row)` of
/// the first projection by a warp, `LFM_EARLY_OUT` of the second;
/// `LFM_EARLY_IN_BLOCK(K, row0, n)` the first's rows `row0..row0 + n` by
/// the block; `K` their width): quantized, the rows' words, scales and
/// biases; dense, their values.
const EARLY_QUANT_ROWS: &str = r#"
#define LFM_EARLY_ROW_Q(w, sc, bi, K, B, GS_, row) { \
  lfm_prefetch_span(w + static_cast<size_t>(row) * ((K) * (B) / 32), (K) * (B) / 8, lane); \
  lfm_prefetch_span(sc + static_cast<size_t>(row) * ((K) / (GS_)), (K) / (GS_) * (int)sizeof(T), lane); \
  lfm_prefetch_span(bi + static_cast<size_t>(row) * ((K) / (GS_)), (K) / (GS_) * (int)sizeof(T), lane); }
#define LFM_EARLY_IN(K, row) LFM_EARLY_ROW_Q(iw, iscales, ibiases, K, IBITS, IGS, row)
#define LFM_EARLY_OUT(K, row) LFM_EARLY_ROW_Q(ow, oscales, obiases, K, OBITS, OGS, row)
#define LFM_EARLY_IN_BLOCK(K, row0, n) { \
  lfm_prefetch_block(iw + static_cast<size_t>(row0) * ((K) * IBITS / 32), (n) * ((K) * IBITS / 8)); \
  lfm_prefetch_block(iscales + static_cast<size_t>(row0) * ((K) / IGS), (n) * ((K) / IGS) * (int)sizeof(T)); \
  lfm_prefetch_block(ibiases + static_cast<size_t>(row0) * ((K) / IGS), (n) * ((K) / IGS) * (int)sizeof(T)); }
"#;
const EARLY_DENSE_ROWS: &str = r#"
#define LFM_EARLY_IN(K, row) lfm_prefetch_span(iw + static_cast<size_t>(row) * (K), (K) * (int)sizeof(T), lane)
#define LFM_EARLY_OUT(K, row) lfm_prefetch_span(ow + static_cast<size_t>(row) * (K), (K) * (int)sizeof(T), lane)
#define LFM_EARLY_IN_BLOCK(K, row0, n) lfm_prefetch_block(iw + static_cast<size_t>(row0) * (K), (n) * (K) * (int)sizeof(T))
"#;

/// The early form's header, before the layer's own.
pub(crate) fn early_header(quant: bool) -> String {
    format!("{PREFETCH_HEADER}{}", if quant { EARLY_QUANT_ROWS } else { EARLY_DENSE_ROWS })
}

/// Where the early form asks for its rows: each stage's rows before its
/// wait (in_proj's three rows of a channel, out_proj's output row; the
/// feed-forward's w1 and w3 rows of an output, w2's row), each text found
/// in [`LAYER_SOURCE`] (a test holds it).
pub(crate) const EARLY_SUBSTITUTIONS: [(&str, &str); 4] = [
    (
        "    const int c = (role - 1) * WARPS + wid;\n    const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n",
        "    const int c = (role - 1) * WARPS + wid;\n    if (c < C) {\n      LFM_EARLY_IN(D, c);\n      LFM_EARLY_IN(D, C + c);\n      LFM_EARLY_IN(D, 2 * C + c);\n    }\n    const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n",
    ),
    (
        "    const int n = (role - 1 - IB) * WARPS + wid;\n    const bool late = lfm_block_wait(st + 2, (launch + 1) * IB, nullptr, 0);\n",
        "    const int n = (role - 1 - IB) * WARPS + wid;\n    if (n < D) LFM_EARLY_OUT(C, n);\n    const bool late = lfm_block_wait(st + 2, (launch + 1) * IB, nullptr, 0);\n",
    ),
    (
        "    const int j = (fr - 1) * WARPS + wid;\n    const bool late = lfm_block_wait(st + FC + 1, launch + 1, nullptr, 0);\n",
        "    const int j = (fr - 1) * WARPS + wid;\n    if (j < F) {\n      LFM_EARLY_IN(D, j);\n      LFM_EARLY_IN(D, F + j);\n    }\n#if LFM_GATE_OUTS == 2\n    if (j + GB * WARPS < F) {\n      LFM_EARLY_IN(D, j + GB * WARPS);\n      LFM_EARLY_IN(D, F + j + GB * WARPS);\n    }\n#endif\n    const bool late = lfm_block_wait(st + FC + 1, launch + 1, nullptr, 0);\n",
    ),
    (
        "  const int n = (fr - 1 - GB) * WARPS + wid;\n  const bool late = lfm_block_wait(st + FC + 2, (launch + 1) * GB, nullptr, 0);\n",
        "  const int n = (fr - 1 - GB) * WARPS + wid;\n  if (n < D) LFM_EARLY_OUT(F, n);\n  const bool late = lfm_block_wait(st + FC + 2, (launch + 1) * GB, nullptr, 0);\n",
    ),
];

/// A block's own add + RMSNorm of the layer's row into its shared row
/// (`sm`), `eps` the template constant that holds it: the norm stage's
/// code on the same operands (`lfm_add_rms_row` groups its sums by `NBLK`
/// whatever the block's width, and its aligned and element-wise loads sum
/// in one order), so the first block's bits, without waiting for its mark
/// and reading its row back from L2. The every-norm forms' text: the q/k/v
/// stage's (qkv_fused.rs) and the conv's and feed-forward's
/// ([`CONV_EVERY_NORM_SUBSTITUTION`], [`FFN_EVERY_NORM_SUBSTITUTION`]).
macro_rules! own_norm {
    ($eps:literal) => {
        concat!(
            "  if (lfm_aligned(h) && lfm_aligned(r) && lfm_aligned(wn)) {\n",
            "    lfm_add_rms_row<T, D, NBLK, true>(h, r, wn, __int_as_float(",
            $eps,
            "), static_cast<T*>(nullptr), reinterpret_cast<T*>(sm));\n",
            "  } else {\n",
            "    lfm_add_rms_row<T, D, NBLK, false>(h, r, wn, __int_as_float(",
            $eps,
            "), static_cast<T*>(nullptr), reinterpret_cast<T*>(sm));\n",
            "  }\n"
        )
    };
}
pub(crate) use own_norm;

/// `MLX_LFM_CONV_EVERY_NORM` (a CUDA default since session 50, `=0` off):
/// in_proj's blocks each compute the layer's add + RMSNorm ([`own_norm`])
/// instead of waiting for the first block's. The short-conv layer's own
/// kernel (conv_fused.rs) only.
pub(crate) const CONV_EVERY_NORM_SUBSTITUTION: (&str, &str) = (
    "    const int c = (role - 1) * WARPS + wid;\n    const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n    if (!late) lfm_stage16(sm, yn, XR);\n",
    concat!("    const int c = (role - 1) * WARPS + wid;\n    constexpr bool late = false;\n", own_norm!("EPS_BITS")),
);

/// `MLX_LFM_FFN_EVERY_NORM` (a CUDA default since session 50, `=0` off):
/// the gate's blocks each compute the feed-forward's add + RMSNorm
/// ([`own_norm`]) instead of waiting for the first block's. The
/// feed-forward's own kernel (ffn_fused.rs) only: joined to a conv layer,
/// its norm's rows come from the same launch.
pub(crate) const FFN_EVERY_NORM_SUBSTITUTION: (&str, &str) = (
    "    const int j = (fr - 1) * WARPS + wid;\n    const bool late = lfm_block_wait(st + FC + 1, launch + 1, nullptr, 0);\n    if (!late) lfm_stage16(sm, LFM_FFN_YN, XR);\n",
    concat!(
        "    const int j = (fr - 1) * WARPS + wid;\n#if LFM_CONV_PART\n#error \"the feed-forward's every-norm form: its own kernel only\"\n#endif\n    constexpr bool late = false;\n",
        own_norm!("EPS_BITS")
    ),
);

/// A one-launch layer's kernels in their forms (dense or quantized, with
/// or without the scratch rows in the state, the early prefetch or not):
/// each form's cells and its text, made once.
pub(crate) struct Forms {
    cells: [[[Cells; 2]; 2]; 2],
    texts: [[OnceLock<String>; 2]; 2],
}

impl Forms {
    pub(crate) const fn new() -> Forms {
        Forms { cells: [const { [const { [cells(), cells()] }; 2] }; 2], texts: [const { [const { OnceLock::new() }; 2] }; 2] }
    }

    /// The form's kernel: named `base` (`_early`, then `_scr`, after it
    /// for those forms), over `body` (with `early`, `early_subs` made in;
    /// with `scratch`, `prelude` before it) and `header()` (after the
    /// early form's, [`early_header`]); with `scratch`, the first `kept`
    /// of `outputs` (the scratch rows are the rest).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn kernel(
        &'static self,
        base: &str,
        (quant, scratch, early): (bool, bool, bool),
        body: &str,
        early_subs: &[(&str, &str)],
        prelude: &str,
        inputs: &[&str],
        (outputs, kept): (&[&str], usize),
        header: impl FnOnce() -> String,
    ) -> Option<&'static CudaKernel> {
        let text = self.texts[usize::from(early)][usize::from(scratch)].get_or_init(|| {
            let body = if early { super::substituted(body, early_subs) } else { body.to_string() };
            format!("{}{body}", if scratch { prelude } else { "" })
        });
        // (The name only where the form is first made: a step looks its
        // kernels up every token.)
        let name = || format!("{base}{}{}", if early { "_early" } else { "" }, if scratch { "_scr" } else { "" });
        let outputs = if scratch { &outputs[..kept] } else { outputs };
        kernel_named(&self.cells[usize::from(early)][usize::from(scratch)][usize::from(quant)], name, inputs, outputs, text, || {
            let head = header();
            if early { format!("{}{head}", early_header(quant)) } else { head }
        })
    }
}

/// [`LAYER_SOURCE`] as a one-launch kernel's form runs it: with `early`
/// its rows asked for before its waits ([`EARLY_SUBSTITUTIONS`]), after
/// `prelude` (a scratch-rows form's, or none); made once into `cell`.
pub(crate) fn layer_source(cell: &'static OnceLock<String>, prelude: &str, early: bool) -> &'static str {
    cell.get_or_init(|| {
        let body = if early { super::substituted(LAYER_SOURCE, &EARLY_SUBSTITUTIONS) } else { LAYER_SOURCE.to_string() };
        format!("{prelude}{body}")
    })
}

/// [`LAYER_SOURCE`] with its timeline stamps in ([`TIMELINE_SUBSTITUTIONS`]),
/// its rows asked for early or not: one text each, made once, for every
/// one-launch layer's timeline form.
pub(crate) fn stamped_layer_source(early: bool) -> &'static str {
    static SOURCES: [OnceLock<String>; 2] = [OnceLock::new(), OnceLock::new()];
    static STAMPED: [OnceLock<String>; 2] = [OnceLock::new(), OnceLock::new()];
    let body = layer_source(&SOURCES[usize::from(early)], "", early);
    STAMPED[usize::from(early)].get_or_init(|| super::substituted(body, &TIMELINE_SUBSTITUTIONS))
}

/// A timeline form of a [`LAYER_SOURCE`] kernel (the bench's, never a
/// step's): thread 0 of each block stamps the GPU's global timer into the
/// extra output `times` (int64, four a block by its ticket's part) when
/// the block takes its ticket (all four, so a stage a part never reaches
/// reads as its start), when its wait ends, when its staged row is in
/// shared memory and when its part is done: where a launch's time goes
/// between the stages' handoffs, which ncu's one duration a launch does
/// not say. The stamps go in by [`TIMELINE_SUBSTITUTIONS`], so the
/// kernels the steps run keep their text.
pub(crate) const TIMELINE_HEADER: &str = r#"
__device__ inline long long lfm_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return static_cast<long long>(t);
}
#define LFM_STAMP(i) \
  do { \
    if (threadIdx.x == 0) times[static_cast<size_t>(role) * 4 + (i)] = lfm_now(); \
  } while (0)
#define LFM_STAMP_START() \
  do { \
    if (threadIdx.x == 0) { \
      const long long t0_ = lfm_now(); \
      for (int i_ = 0; i_ < 4; i_++) times[static_cast<size_t>(role) * 4 + i_] = t0_; \
    } \
  } while (0)
"#;

/// Where the timeline form stamps (see [`TIMELINE_HEADER`]): `(text, the
/// text with its stamp)`, each text found in [`LAYER_SOURCE`] (a test
/// holds it). The feed-forward's part shares the gate stage's texts and
/// w2's staging with the MoE's; its w2's wait and end have their own. (The conv part's second
/// stamp lands in its out_proj-only form's path too, where it is the
/// block's start again.)
pub(crate) const TIMELINE_SUBSTITUTIONS: [(&str, &str); 17] = [
    (
        "  const int role = lfm_take_part<NB>(st, launch);\n",
        "  const int role = lfm_take_part<NB>(st, launch);\n  LFM_STAMP_START();\n",
    ),
    // The conv part: its norm, its channels' blocks, out_proj's blocks.
    ("    lfm_release_mark(st + 1, launch + 1);\n    return;\n", "    LFM_STAMP(3);\n    lfm_release_mark(st + 1, launch + 1);\n    return;\n"),
    (
        "    const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n",
        "    const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n    LFM_STAMP(1);\n",
    ),
    ("    if (!late) lfm_stage16(sm, yn, XR);\n    __syncthreads();\n", "    if (!late) lfm_stage16(sm, yn, XR);\n    __syncthreads();\n    LFM_STAMP(2);\n"),
    ("    lfm_release_count(st + 2);\n    return;\n", "    LFM_STAMP(3);\n    lfm_release_count(st + 2);\n    return;\n"),
    (
        "    const bool late = lfm_block_wait(st + 2, (launch + 1) * IB, nullptr, 0);\n",
        "    const bool late = lfm_block_wait(st + 2, (launch + 1) * IB, nullptr, 0);\n    LFM_STAMP(1);\n",
    ),
    (
        "    if (!late) lfm_stage16(sm, yc, CR);\n#endif\n    __syncthreads();\n",
        "    if (!late) lfm_stage16(sm, yc, CR);\n#endif\n    __syncthreads();\n    LFM_STAMP(2);\n",
    ),
    (
        "      if (lane == 0) LFM_CONV_ROW[n] = late ? T(poison) : T(o[0]);\n    }\n",
        "      if (lane == 0) LFM_CONV_ROW[n] = late ? T(poison) : T(o[0]);\n    }\n    LFM_STAMP(3);\n",
    ),
    // The feed-forward's or MoE's part.
    (
        "    lfm_release_mark(st + FC + 1, launch + 1);\n    return;\n",
        "    LFM_STAMP(3);\n    lfm_release_mark(st + FC + 1, launch + 1);\n    return;\n",
    ),
    (
        "    const bool late = lfm_block_wait(st + FC + 1, launch + 1, nullptr, 0);\n",
        "    const bool late = lfm_block_wait(st + FC + 1, launch + 1, nullptr, 0);\n    LFM_STAMP(1);\n",
    ),
    (
        "    if (!late) lfm_stage16(sm, LFM_FFN_YN, XR);\n    __syncthreads();\n",
        "    if (!late) lfm_stage16(sm, LFM_FFN_YN, XR);\n    __syncthreads();\n    LFM_STAMP(2);\n",
    ),
    (
        "    lfm_release_count(st + FC + 2);\n    return;\n",
        "    LFM_STAMP(3);\n    lfm_release_count(st + FC + 2);\n    return;\n",
    ),
    (
        "  const bool late = lfm_block_wait(st + FC + 2, (launch + 1) * GB, st + FC + 1, launch + 1);\n",
        "  const bool late = lfm_block_wait(st + FC + 2, (launch + 1) * GB, st + FC + 1, launch + 1);\n  LFM_STAMP(1);\n",
    ),
    ("  if (!late) lfm_stage16(sm, hk, HR);\n  __syncthreads();\n", "  if (!late) lfm_stage16(sm, hk, HR);\n  __syncthreads();\n  LFM_STAMP(2);\n"),
    (
        "    out[n] = late ? T(poison) : T(total);\n  }\n",
        "    out[n] = late ? T(poison) : T(total);\n  }\n  LFM_STAMP(3);\n",
    ),
    // The feed-forward's w2 blocks (their staging is the MoE down blocks' text).
    (
        "  const bool late = lfm_block_wait(st + FC + 2, (launch + 1) * GB, nullptr, 0);\n",
        "  const bool late = lfm_block_wait(st + FC + 2, (launch + 1) * GB, nullptr, 0);\n  LFM_STAMP(1);\n",
    ),
    (
        "    if (lane == 0) out[n] = late ? T(poison) : T(o[0]);\n  }\n",
        "    if (lane == 0) out[n] = late ? T(poison) : T(o[0]);\n  }\n  LFM_STAMP(3);\n",
    ),
];

/// A launch's stamps (`times`, four a block by part, nanoseconds of the
/// GPU's global timer) summed up for parts `[first, end)`: from the
/// launch's first stamp, in µs, the earliest and latest start, the latest
/// end, and the medians of the blocks' wait, staging and work.
pub fn timeline_summary(times: &[i64], first: usize, end: usize) -> Option<serde_json::Value> {
    let t0 = times.iter().step_by(4).copied().min()?;
    let blocks: Vec<&[i64]> = times.chunks_exact(4).skip(first).take(end.saturating_sub(first)).collect();
    if blocks.is_empty() {
        return None;
    }
    let us = |ns: i64| ns as f64 / 1000.0;
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let part = |a: usize, b: usize| median(blocks.iter().map(|t| us(t[b] - t[a])).collect());
    Some(serde_json::json!({
        "blocks": blocks.len(),
        "first_start_us": us(blocks.iter().map(|t| t[0]).min()? - t0),
        "last_start_us": us(blocks.iter().map(|t| t[0]).max()? - t0),
        "last_end_us": us(blocks.iter().map(|t| t[3]).max()? - t0),
        "wait_us_median": part(0, 1),
        "stage_us_median": part(1, 2),
        "work_us_median": part(2, 3),
    }))
}

/// The defines that make [`LAYER_SOURCE`] the conv layer's kernel, the
/// feed-forward's, or the two joined (their parts and the rows each
/// writes); a kernel's header puts them before the source's.
pub(crate) fn layer_defines(conv: bool, tail: Tail) -> &'static str {
    match (conv, tail) {
        (true, Tail::None) => "#define LFM_CONV_PART 1\n#define LFM_FFN_PART 0\n#define LFM_MOE_PART 0\n#define LFM_CONV_SUM s\n#define LFM_CONV_ROW out\n",
        (false, Tail::Ffn | Tail::None) => concat!(
            "#define LFM_CONV_PART 0\n#define LFM_FFN_PART 1\n#define LFM_MOE_PART 0\n#define LFM_FFN_YN yn\n",
            "#define LFM_F_ROWS(K, R, rows, xs, lane, out) LFM_IN_ROWS(K, R, rows, xs, lane, out)\n",
            "#define LFM_G_ROWS(K, R, rows, xs, lane, out) LFM_OUT_ROWS(K, R, rows, xs, lane, out)\n"
        ),
        (false, Tail::Moe) => "#define LFM_CONV_PART 0\n#define LFM_FFN_PART 0\n#define LFM_MOE_PART 1\n#define LFM_FFN_YN yn\n",
        (true, Tail::Ffn) => concat!(
            "#define LFM_CONV_PART 1\n#define LFM_FFN_PART 1\n#define LFM_MOE_PART 0\n#define LFM_CONV_SUM s1\n",
            "#define LFM_CONV_ROW o1\n#define LFM_FFN_YN yn2\n#define LFM_TAIL_RESIDUAL s1\n"
        ),
        (true, Tail::Moe) => concat!(
            "#define LFM_CONV_PART 1\n#define LFM_FFN_PART 0\n#define LFM_MOE_PART 1\n#define LFM_CONV_SUM s1\n",
            "#define LFM_CONV_ROW o1\n#define LFM_FFN_YN yn2\n#define LFM_TAIL_RESIDUAL s1\n"
        ),
    }
}

/// The defines that make [`LAYER_SOURCE`] an attention layer's out_proj
/// joined to the feed-forward or MoE after it: the conv part's out_proj
/// stage alone, over the input row `yc`, the residual sum the input `r`.
pub(crate) fn out_defines(tail: Tail) -> &'static str {
    match tail {
        Tail::Moe => concat!(
            "#define LFM_CONV_PART 1\n#define LFM_OUT_ONLY 1\n#define LFM_FFN_PART 0\n#define LFM_MOE_PART 1\n",
            "#define LFM_CONV_ROW o1\n#define LFM_FFN_YN yn2\n#define LFM_TAIL_RESIDUAL r\n"
        ),
        _ => concat!(
            "#define LFM_CONV_PART 1\n#define LFM_OUT_ONLY 1\n#define LFM_FFN_PART 1\n#define LFM_MOE_PART 0\n",
            "#define LFM_CONV_ROW o1\n#define LFM_FFN_YN yn2\n#define LFM_TAIL_RESIDUAL r\n"
        ),
    }
}

/// What follows the conv part in a [`LAYER_SOURCE`] kernel.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Tail {
    None,
    /// The dense or 4/8-bit feed-forward.
    Ffn,
    /// The MoE: the route and the chosen experts.
    Moe,
}

/// The products of a layer's two projections for [`Projections::Quant`]
/// (`LFM_IN_ROWS(K, R, rows, xs, lane, out)`: the first projection's rows
/// `rows[0..R]` with the staged `K`-wide row `xs`, each summed whole into
/// `out`; `LFM_OUT_ROWS` the same of the second), in MLX's own `qmv`
/// arithmetic (src/kernels/quant_gemv.rs `lfm_qdot_mlx`, the quantized
/// GEMV's walk: MLX's one-row product to the bit), every row
/// asked of L2 first (a warp's later rows then wait on L2, not DRAM).
pub(crate) const QUANT_PRODUCTS: &str = r#"
template <typename T, int K, int BITS, int GS, int R>
__device__ inline void lfm_stage_qrows(const T* xs, const uint32_t* w, const T* sc, const T* bi, const size_t* rows,
                                       int lane, float* out) {
  constexpr int G = K / GS;
  constexpr int WORDS = K * BITS / 32;
#pragma unroll
  for (int q = 0; q < R; q++) {
    lfm_prefetch_lines<K * BITS / 8>(w + rows[q] * WORDS, lane);
    lfm_prefetch_lines<G * (int)sizeof(T)>(sc + rows[q] * G, lane);
    lfm_prefetch_lines<G * (int)sizeof(T)>(bi + rows[q] * G, lane);
  }
#pragma unroll
  for (int q = 0; q < R; q++) {
    out[q] = lfm_qdot_mlx<T, K, BITS, GS, true>(xs, w + rows[q] * WORDS, sc + rows[q] * G, bi + rows[q] * G, lane);
  }
}
#define LFM_IN_ROWS(K, R, rows, xs, lane, out) \
  lfm_stage_qrows<T, K, IBITS, IGS, R>(xs, iw, iscales, ibiases, rows, lane, out)
#define LFM_OUT_ROWS(K, R, rows, xs, lane, out) \
  lfm_stage_qrows<T, K, OBITS, OGS, R>(xs, ow, oscales, obiases, rows, lane, out)
"#;

/// The same for [`Projections::Dense`], a warp's rows walked together as
/// MLX's `gemv_single` walks a row (src/kernels/gemv.rs `lfm_dot_rows`:
/// each a one-row product to MLX's bit; the dense GEMVs' default walk, no
/// L2 prefetch: a kernel's header defines `LFM_DENSE_PREFETCH 0`).
pub(crate) const DENSE_PRODUCTS: &str = r#"
template <typename T, int K, int R>
__device__ inline void lfm_stage_drows(const T* xs, const T* w, const size_t* rows, int lane, float* out) {
  const T* p[R];
#pragma unroll
  for (int q = 0; q < R; q++) {
    p[q] = w + rows[q] * K;
    out[q] = 0.0f;
  }
  lfm_dot_rows<T, K, 1, R>(xs, true, p, lfm_aligned(w), lane, out);
#pragma unroll
  for (int q = 0; q < R; q++) out[q] = lfm_warp_sum(out[q]);
}
#define LFM_IN_ROWS(K, R, rows, xs, lane, out) lfm_stage_drows<T, K, R>(xs, iw, rows, lane, out)
#define LFM_OUT_ROWS(K, R, rows, xs, lane, out) lfm_stage_drows<T, K, R>(xs, ow, rows, lane, out)
"#;

/// The rounds feed-forward's w2 walk (`LFM_GATE_ROUNDS`,
/// src/kernels/ffn_fused.rs rounds): one dense row's columns `LO..HI`
/// (whole steps of a warp: the Rust side serves only such rounds) walked
/// as src/kernels/gemv.rs `lfm_dot_rows` walks them, its batches of loads
/// before their sums, into `acc`, neither reset nor summed over the warp:
/// a row's walk in spans is its walk in one, each lane's columns in the
/// same order. (Bounds known at run time put the form at 60-66 registers
/// a thread by ptxas, against 32: hence one walk a round.)
pub(crate) const ROUNDS_HEADER: &str = r#"
template <typename T, int K, int LO, int HI, bool ALIGNED>
__device__ inline void lfm_drow_span_a(const T* x, const T* w, int lane, float* acc) {
  constexpr int N = lfm_npt<K>::v;
  constexpr int STEP = 32 * N;
  static_assert(LO % STEP == 0 && HI % STEP == 0 && LO < HI && HI <= K, "a span of whole steps of the row");
  constexpr int I0 = LO / STEP;
  constexpr int IT = HI / STEP;
  constexpr int B = IT - I0 < LFM_BATCH ? IT - I0 : LFM_BATCH;
#pragma unroll
  for (int i0 = I0; i0 < IT; i0 += B) {
    lfm_vec<T, N> wv[B];
#pragma unroll
    for (int u = 0; u < B; u++) {
      if (i0 + u < IT) wv[u] = lfm_loadv<T, N, ALIGNED>(w + N * lane + (i0 + u) * STEP);
    }
#pragma unroll
    for (int u = 0; u < B; u++) {
      if (i0 + u < IT) lfm_dot_step<T, K, 1, 1, N, ALIGNED>(x, N * lane + (i0 + u) * STEP, wv + u, acc);
    }
  }
}
// Round k's span, k * H up to (k + 1) * H or the row's end, of G rounds:
// each span its own unrolled walk (a span with bounds known at compile
// time keeps a lane's loads in its registers).
template <typename T, int K, int H, int G, int K0 = 0>
__device__ inline void lfm_drow_round(const T* x, const T* w, bool wa, int lane, int k, float* acc) {
  if constexpr (K0 < G) {
    constexpr int LO = K0 * H;
    constexpr int HI = LO + H < K ? LO + H : K;
    if (k == K0) {
      if constexpr (LO < HI) {
        if (wa) {
          lfm_drow_span_a<T, K, LO, HI, true>(x, w, lane, acc);
        } else {
          lfm_drow_span_a<T, K, LO, HI, false>(x, w, lane, acc);
        }
      }
      return;
    }
    lfm_drow_round<T, K, H, G, K0 + 1>(x, w, wa, lane, k, acc);
  }
}
"#;

/// Template constants a kernel's projections add (their specifications).
pub(crate) type Specs = Vec<(&'static str, TemplateArg)>;

/// Whether `q` is an `[n, k]` projection (in logical columns) the MLX walk
/// of [`QUANT_PRODUCTS`] serves for activations of dtype `dt`, its scales
/// and biases in step.
fn quant_fits(q: &Quantized, dt: Dtype, n: i32, k: i32) -> bool {
    super::quant_gemv::spec_served(q, dt, k)
        && q.weight.ndim() == 2
        && q.weight.dim(0) == n
        && q.weight.dim(1) as i64 * 32 == k as i64 * q.spec.bits as i64
        && q.scales.shape() == [n, k / q.spec.group_size]
        && q.biases.as_ref().is_some_and(|b| b.shape() == q.scales.shape())
}

/// A one-launch layer's two projections: the first reads the normed row
/// (the conv's in_proj, the feed-forward's stacked w1/w3), the second the
/// layer's inner row (out_proj, w2). No biases (callers check).
#[derive(Clone, Copy)]
pub enum Projections<'a> {
    /// MLX affine quantized.
    Quant(&'a Quantized, &'a Quantized),
    /// Dense, in the activations' dtype.
    Dense(&'a Array, &'a Array),
}

impl<'a> Projections<'a> {
    pub(crate) fn quant(&self) -> bool {
        matches!(self, Projections::Quant(..))
    }

    /// The first projection's rows (its outputs).
    pub(crate) fn first_rows(&self) -> i32 {
        match self {
            Projections::Quant(i, _) => i.weight.dim(0),
            Projections::Dense(i, _) => i.dim(0),
        }
    }

    /// Whether the first is `[rows, d]` and the second `[d, width]` (in
    /// logical columns), each in a form [`QUANT_PRODUCTS`] or
    /// [`DENSE_PRODUCTS`] serve for activations of dtype `dt`: quantized,
    /// a specification the MLX walk serves with its scales and biases in
    /// step; dense, in `dt`, the widths multiples of 8 (16-byte loads).
    pub(crate) fn served(&self, dt: Dtype, rows: i32, d: i32, width: i32) -> bool {
        match *self {
            Projections::Quant(i, o) => quant_fits(i, dt, rows, d) && quant_fits(o, dt, d, width),
            Projections::Dense(i, o) => {
                i.dtype() == dt && o.dtype() == dt && i.shape() == [rows, d] && o.shape() == [d, width] && d % 8 == 0 && width % 8 == 0
            }
        }
    }

    /// Whether the second is `[d, width]` as [`Self::served`] serves it
    /// (the first not asked).
    pub(crate) fn served_second(&self, dt: Dtype, d: i32, width: i32) -> bool {
        match *self {
            Projections::Quant(_, o) => quant_fits(o, dt, d, width),
            Projections::Dense(_, o) => o.dtype() == dt && o.shape() == [d, width] && d % 8 == 0 && width % 8 == 0,
        }
    }

    /// The kernel's inputs for the two projections, named as
    /// [`Self::input_names`] names them, and (quantized) their
    /// specifications as template constants.
    pub(crate) fn inputs(&self) -> Result<(Vec<&'a Array>, Specs)> {
        match *self {
            Projections::Quant(i, o) => {
                let missing = |what: &str| Error::invalid(format!("a one-launch layer's {what} projection needs affine biases"));
                let ib = i.biases.as_ref().ok_or_else(|| missing("first"))?;
                let ob = o.biases.as_ref().ok_or_else(|| missing("second"))?;
                let spec = [
                    ("IBITS", TemplateArg::Int(i.spec.bits)),
                    ("IGS", TemplateArg::Int(i.spec.group_size)),
                    ("OBITS", TemplateArg::Int(o.spec.bits)),
                    ("OGS", TemplateArg::Int(o.spec.group_size)),
                ];
                Ok((vec![&i.weight, &i.scales, ib, &o.weight, &o.scales, ob], spec.to_vec()))
            }
            Projections::Dense(i, o) => Ok((vec![i, o], Vec::new())),
        }
    }

    /// The names [`Self::inputs`] go by in the kernel's source.
    pub(crate) fn input_names(quant: bool) -> &'static [&'static str] {
        if quant {
            &["iw", "iscales", "ibiases", "ow", "oscales", "obiases"]
        } else {
            &["iw", "ow"]
        }
    }

    /// The products' header for these projections.
    pub(crate) fn products(quant: bool) -> &'static str {
        if quant {
            QUANT_PRODUCTS
        } else {
            DENSE_PRODUCTS
        }
    }
}

/// A one-launch layer kernel's header: the products' walk (quantized: two
/// of MLX's tiles a batch, not four: the same sums, and 44 registers a
/// thread by ptxas where four took 84; dense: the GEMVs' default walk, no
/// L2 prefetch), `defines` (the body's parts, [`layer_defines`]), the add +
/// RMSNorm code and the GEMVs' (with `moe`, the router + norm kernel's
/// header, which holds them), the ticket helpers, the projections'
/// products.
pub(crate) fn layer_header(quant: bool, moe: bool, defines: &str) -> String {
    let walk = if quant { "#define LFM_QMLX_TILES 2\n" } else { "#define LFM_DENSE_PREFETCH 0\n" };
    let products = Projections::products(quant);
    if moe {
        return format!("{walk}{defines}{}{TICKET_HEADER}{products}", super::moe_router::gate_norm_header());
    }
    let gemvs = if quant { super::quant_gemv::header() } else { super::gemv::header() };
    format!("#define LFM_NORM_IN_WIDER_BLOCK 1\n{walk}{defines}{}{gemvs}{TICKET_HEADER}{products}", super::add_rms_norm::device_code())
}

/// Shared memory a one-launch kernel's staged rows may take (48 KiB is
/// the static limit, with the stages' own few words beside them).
pub(crate) const MAX_STAGED: usize = 32 * 1024;

/// A layer's counters: four 64-bit counters, zero (eight uint32: MLX's
/// signature names the element type; the kernels read them as 64-bit).
/// Made once per layer and kept with it; only its own kernel's launches,
/// one after another, touch them. Made by an op and evaluated, so that on
/// CUDA they are device memory (an array the host writes is managed
/// memory, whose page the host could pull back).
pub fn new_counters() -> Result<Array> {
    new_counters_of(COUNTERS)
}

/// The uint32 words of [`new_counters`]: six word pairs, the feed-forward
/// in four rounds' most (tickets, the norm's mark, a count a round;
/// src/kernels/ffn_fused.rs rounds), 48 bytes before the scratch rows' 256.
pub(crate) const COUNTERS: usize = 12;

/// `words` uint32 counters, zero, as [`new_counters`] makes them (a kernel
/// of more stages, src/kernels/conv_layer_fused.rs, counts more).
pub fn new_counters_of(words: usize) -> Result<Array> {
    let counters = crate::mlx::zeros(&[words as i32], Dtype::Uint32)?;
    counters.eval()?;
    Ok(counters)
}

/// `MLX_LFM_SCRATCH_IN_STATE` (session 33; a default since session 39,
/// `=0` turns it off): a one-launch
/// layer's scratch rows (the normed row, the gated rows, the route's
/// experts and weights: what one stage hands the next within a launch)
/// kept in the layer's state after its counters, instead of outputs MLX
/// allocates at every launch and the caller drops. Session 33's
/// `dispatch-cost` (an H100): a custom kernel's dispatch grows by ~1.8 µs
/// and its build by ~1.1 µs an output (12.5 and 8.2 µs with six outputs,
/// 3.6 and 2.6 with one); a step of the 8B-A1B gives 132 scratch outputs
/// (22 MoE layers' four, 17 conv layers' two, 6 q/k/v stages' one, 2
/// feed-forwards' two), the 350M's 58. The rows are written and read
/// within one launch, as in the outputs (never read before the launch
/// wrote them: an output's memory is not cleared either); a layer's
/// launches run one after another, ordered by data, as its tickets already
/// need. Adopted on the H100 in session 39: its layer tests (the same
/// bits as the outputs, twice over one state) passed in session 35 and
/// its greedy set on the wide MoE fixture in sessions 35-39; session 38's
/// A/B on the 8B-A1B cut the host's build by ~75 µs a token and its
/// dispatch by ~120 with the decode unchanged (1.003) where the GPU
/// bounded the step, and session 39's host bounded it (1.1-1.5 ms of
/// dispatch a token). A state made without room for the rows still takes
/// the outputs (`scratch_template`).
pub(crate) fn scratch_in_state() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_SCRATCH_IN_STATE", &ON)
}

/// Where scratch rows of `bytes` each live in a layer's state (bytes from
/// its start): after the counters, each on a 256-byte boundary (rows are
/// staged 16 bytes a load); and where the last ends.
pub(crate) fn scratch_places(bytes: &[i64]) -> (Vec<i64>, i64) {
    let up = |x: i64| (x + 255) / 256 * 256;
    let mut at = up(COUNTERS as i64 * 4);
    let mut places = Vec::with_capacity(bytes.len());
    for (i, b) in bytes.iter().enumerate() {
        places.push(at);
        at = if i + 1 < bytes.len() { up(at + b) } else { at + b };
    }
    (places, at)
}

/// The uint32 words of a layer's state: its counters and scratch rows of
/// `bytes` each ([`scratch_places`]). Made on every backend at the
/// model's load, so that the switch may be turned on later; callers size
/// the rows at 4 bytes an activation, the widest dtype served.
pub fn state_words(bytes: &[i64]) -> usize {
    (scratch_places(bytes).1.max(COUNTERS as i64 * 4) as usize).div_ceil(4)
}

/// The template values naming a launch's scratch rows' places in `ctr`
/// (`names[i]` at row `i`, `bytes` each), where the switch is on and the
/// state holds them; `None`: the rows go to outputs (the switch off, or a
/// state made for narrower rows).
pub(crate) fn scratch_template(names: &[&'static str], bytes: &[i64], ctr: &Array) -> Option<Vec<(&'static str, TemplateArg)>> {
    if !scratch_in_state() {
        return None;
    }
    let (places, end) = scratch_places(bytes);
    if ctr.dtype() != Dtype::Uint32 || (ctr.size() as i64) * 4 < end || places.iter().any(|p| *p > i32::MAX as i64) {
        return None;
    }
    Some(names.iter().zip(places).map(|(n, p)| (*n, TemplateArg::Int(p as i32))).collect())
}

/// A timeline form's launch: `outputs`, then the stamps, four int64 a block
/// of the launch's `nb` ([`TIMELINE_HEADER`]); `what` names the kernel in
/// the error where `nb` blocks' stamps would not fit an i32 shape.
#[allow(clippy::too_many_arguments)]
pub(crate) fn call_stamped(
    kern: &CudaKernel,
    inputs: &[&Array],
    outputs: &[(&[i32], Dtype)],
    nb: i64,
    grid: [i32; 3],
    block: [i32; 3],
    template: &[(&str, TemplateArg)],
    what: &str,
) -> Result<Vec<Array>> {
    let stamps = [i32::try_from(nb * 4).map_err(|_| Error::invalid(format!("{what}: {nb} blocks")))?];
    let mut all = outputs.to_vec();
    all.push((&stamps, Dtype::Int64));
    kern.call(inputs, &all, grid, block, template)
}

/// A one-launch kernel's launch whose last outputs are scratch rows (what
/// one stage hands the next within the launch; the caller keeps only the
/// outputs before them), named `scratch` for the kernel's template values:
/// where [`scratch_in_state`] is on and the state `ctr` holds rows of
/// those outputs' sizes, through `in_state` (the same body after a
/// prelude placing the rows in `ctr`) without those outputs; else through
/// `kern` with them. Either way, the outputs before the rows.
#[allow(clippy::too_many_arguments)]
pub(crate) fn call_with_scratch(
    kern: &CudaKernel,
    in_state: impl FnOnce() -> Option<&'static CudaKernel>,
    inputs: &[&Array],
    outputs: &[(&[i32], Dtype)],
    scratch: &[&'static str],
    ctr: &Array,
    grid: [i32; 3],
    block: [i32; 3],
    template: &[(&str, TemplateArg)],
) -> Result<Vec<Array>> {
    let kept = outputs.len().checked_sub(scratch.len()).ok_or_else(|| Error::invalid("a launch with more scratch rows than outputs"))?;
    let bytes: Vec<i64> =
        outputs[kept..].iter().map(|(shape, dt)| shape.iter().map(|&n| n as i64).product::<i64>() * dt.size() as i64).collect();
    if let Some((places, ks)) = scratch_template(scratch, &bytes, ctr).and_then(|p| in_state().map(|k| (p, k))) {
        let template: Vec<(&str, TemplateArg)> = template.iter().copied().chain(places).collect();
        return ks.call(inputs, &outputs[..kept], grid, block, &template);
    }
    let mut outs = kern.call(inputs, outputs, grid, block, template)?;
    outs.truncate(kept);
    Ok(outs)
}

/// That `ctr` is a layer's state: uint32, at least its counters (and, past
/// them, room for scratch rows: [`state_words`]), for `what`.
pub(crate) fn check_state(ctr: &Array, what: &str) -> Result<()> {
    if ctr.dtype() != Dtype::Uint32 || ctr.size() < COUNTERS {
        return Err(Error::invalid(format!("{what}: its state must be at least {COUNTERS} uint32 (stages::state_words)")));
    }
    Ok(())
}

/// That `ctr` is `words` uint32 counters ([`new_counters_of`]), for `what`.
pub(crate) fn check_counters_of(ctr: &Array, words: usize, what: &str) -> Result<()> {
    if ctr.dtype() != Dtype::Uint32 || ctr.size() != words {
        return Err(Error::invalid(format!("{what}: its counters must be {words} uint32 (stages::new_counters_of)")));
    }
    Ok(())
}

/// `MLX_LFM_FUSED_NO_WAIT=1` (a test's knob): every wait gives up at once,
/// so a test sees the poisoned output a stuck stage would give (and the
/// counters still in step after it), not a hang.
fn no_wait() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_FUSED_NO_WAIT", &ON, |v| v == Some("1"))
}

/// A one-launch kernel's cells: with and without the give-up variant, each
/// for each walk of the add + RMSNorm code.
pub(crate) type Cells = [Walks; 2];

/// Empty [`Cells`] (for a kernel's static).
pub(crate) const fn cells() -> Cells {
    [const { [const { OnceLock::new() }; 2] }; 2]
}

/// The kernel `name` over `source` and `header()`, made once per cell: as
/// given, or (under [`no_wait`]) named `{name}_no_wait` with its waits
/// giving up at once.
pub(crate) fn kernel(
    cells: &'static Cells,
    name: &str,
    inputs: &[&str],
    outputs: &[&str],
    source: &str,
    header: impl FnOnce() -> String,
) -> Option<&'static CudaKernel> {
    kernel_named(cells, || name.to_string(), inputs, outputs, source, header)
}

/// [`kernel`], its name made only where the kernel is.
fn kernel_named(
    cells: &'static Cells,
    name: impl FnOnce() -> String,
    inputs: &[&str],
    outputs: &[&str],
    source: &str,
    header: impl FnOnce() -> String,
) -> Option<&'static CudaKernel> {
    let stuck = no_wait();
    super::add_rms_norm::for_walk(&cells[usize::from(stuck)], || {
        let name = name();
        let (name, wait) = if stuck { (format!("{name}_no_wait"), "#define LFM_SPIN_LIMIT 0\n") } else { (name, "") };
        CudaKernel::new(&super::add_rms_norm::kernel_name(&name), inputs, outputs, source, &format!("{wait}{}", header())).ok()
    })
}

/// How many graphs a one-launch kernel was put into in this process (the
/// greedy test's evidence that a run took its path).
pub(crate) struct Built(AtomicUsize);

impl Built {
    pub(crate) const fn new() -> Built {
        Built(AtomicUsize::new(0))
    }

    pub(crate) fn bump(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each of the early form's prefetches finds its place, once (w2's
    /// twice: the feed-forward's rounds form starts its w2 stage as the
    /// other form does, behind its own #if).
    #[test]
    fn every_early_prefetch_finds_its_place() {
        for (was, now) in EARLY_SUBSTITUTIONS {
            let places = if was.contains("(launch + 1) * GB, nullptr") { 2 } else { 1 };
            assert_eq!(LAYER_SOURCE.matches(was).count(), places, "{was:?}");
            let (first, last) = (was.lines().next().unwrap(), was.lines().last().unwrap());
            assert!(now.contains("LFM_EARLY_") && now.starts_with(first) && now.ends_with(&format!("{last}\n")), "{now:?}");
        }
        let early = super::super::substituted(LAYER_SOURCE, &EARLY_SUBSTITUTIONS);
        // (Two of them the two-gate-outputs form's, behind its #if.)
        assert_eq!(early.matches("LFM_EARLY_IN(").count(), 7);
        // (And w2's in the rounds form, which starts as the other's.)
        assert_eq!(early.matches("LFM_EARLY_OUT(").count(), 3);
        for quant in [true, false] {
            let h = early_header(quant);
            assert!(h.contains("#define LFM_EARLY_IN(") && h.contains("#define LFM_EARLY_OUT(") && h.contains("lfm_prefetch_span"));
        }
    }

    /// Each of the timeline form's stamps finds its place in the body
    /// (a substitution that found nothing would leave a stage unstamped).
    #[test]
    fn every_timeline_stamp_finds_its_place() {
        for (was, now) in TIMELINE_SUBSTITUTIONS {
            assert!(LAYER_SOURCE.contains(was), "not in LAYER_SOURCE: {was:?}");
            assert!(now.contains("LFM_STAMP") && now.contains(was.trim_end()));
        }
        let stamped = super::super::substituted(LAYER_SOURCE, &TIMELINE_SUBSTITUTIONS);
        // (Eight in the MoE part, six in the feed-forward's gate and w2
        // stages, seven in the conv part; and the feed-forward's rounds
        // form: its w2 wait's as the other form's, and three of its own,
        // each behind an `#ifdef LFM_STAMP`: seven more.)
        assert_eq!(LAYER_SOURCE.matches("LFM_STAMP").count(), 6);
        assert_eq!(stamped.matches("LFM_STAMP").count(), 28);
        // (And over the early form's text: none lost.)
        let early = super::super::substituted(LAYER_SOURCE, &EARLY_SUBSTITUTIONS);
        assert_eq!(super::super::substituted(&early, &TIMELINE_SUBSTITUTIONS).matches("LFM_STAMP").count(), 28);
        let times = [10_000i64, 11_000, 12_000, 15_000, 10_500, 16_000, 17_000, 20_000, 10_700, 21_000, 21_500, 30_000];
        let s = timeline_summary(&times, 1, 3).unwrap();
        assert_eq!(s["blocks"], 2);
        assert_eq!(s["last_end_us"], 20.0);
        assert_eq!(s["last_start_us"], 0.7);
        assert_eq!(s["wait_us_median"], 10.3);
        assert!(timeline_summary(&times, 3, 3).is_none());
    }

    /// Scratch rows sit after the counters, each on a 256-byte boundary,
    /// none over another, and the state's words hold the last.
    #[test]
    fn scratch_rows_sit_apart_after_the_counters() {
        for bytes in [vec![4096i64, 32, 32, 14336], vec![4096, 4096], vec![2048], vec![1, 1, 1], vec![]] {
            let (places, end) = scratch_places(&bytes);
            assert_eq!(places.len(), bytes.len());
            let mut last = COUNTERS as i64 * 4;
            for (at, b) in places.iter().zip(&bytes) {
                assert_eq!(at % 256, 0, "{bytes:?}: a row at {at}");
                assert!(*at >= last, "{bytes:?}: a row at {at} over the one before (ending at {last})");
                last = at + b;
            }
            assert_eq!(end, if bytes.is_empty() { 256 } else { last }, "{bytes:?}");
            assert!(state_words(&bytes) as i64 * 4 >= end.max(COUNTERS as i64 * 4), "{bytes:?}");
        }
        assert_eq!(state_words(&[]), 64);
        assert_eq!(scratch_places(&[4096, 32, 32, 14336]).0, vec![256, 4352, 4608, 4864]);
    }
}
