//! Attention's per-head RMSNorm of q and k and the RoPE after it, for a
//! decode step (one token per row), in one kernel. The stock graph runs
//! MLX's `rms_norm_small` and `rope_single` for q and for k: four launches
//! per attention layer and token (ncu on the H200: ~3.5 µs each, 24 of the
//! 1.2B's 175 launches a token).
//!
//! One block per row, `HD / NR` threads per head (NR values of 16 bytes
//! each), every head of q then of k. The arithmetic is MLX's, step for
//! step, so the result is bit for bit the stock path's:
//! - rms_norm: thread t holds elements `[NR t, NR t + NR)` and sums their
//!   squares in float32 in order, the head's partial sums meet in a
//!   butterfly (xor masks from half the group down to 1: what MLX's
//!   `cg::reduce` over a block whose other lanes hold zeros adds up to),
//!   `y = T(w * T(x * rsqrt(sum / HD + eps)))`;
//! - rope (non-traditional, over the whole head): pair `i` of `HD / 2`
//!   turns by `offset * exp2(-(i / (HD / 2)) * log2(theta))` with the
//!   full-precision `cos` and `sin`, `x1 c - x2 s` and `x1 s + x2 c` in
//!   float32 from the normed values, each rounded to the dtype.
//!   `log2(theta)` comes from the host's `log2f`, as MLX's does.

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use std::sync::OnceLock;

// The norm and RoPE of one head's slice, after a prefix that sets `src`,
// `w`, `dst`, `live`, `is_v`, `t` and `pos` for this thread.
macro_rules! norm_rope_body {
    () => {
        r#"  float x[NR];
  float acc = 0.0f;
#pragma unroll
  for (int j = 0; j < NR; j++) x[j] = 0.0f;
  if (live) {
#pragma unroll
    for (int j = 0; j < NR; j++) {
      x[j] = static_cast<float>(src[t * NR + j]);
      acc += x[j] * x[j];
    }
  }
  // The head's threads are TPH aligned lanes of one warp (TPH divides 32).
#pragma unroll
  for (int m = TPH / 2; m > 0; m >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, m);
  const float nrm = rsqrtf(acc / static_cast<float>(HD) + __int_as_float(EPS_BITS));
  float y[NR];
#pragma unroll
  for (int j = 0; j < NR; j++) {
    const T wj = live ? w[t * NR + j] : T(0.0f);
    y[j] = static_cast<float>(T(static_cast<float>(wj) * static_cast<float>(T(x[j] * nrm))));
  }
  // The partner half of the head: thread t's elements pair with t ^ TPH/2's.
  float other[NR];
#pragma unroll
  for (int j = 0; j < NR; j++) other[j] = __shfl_xor_sync(0xffffffff, y[j], TPH / 2);
  if (!live) return;
  if (is_v) {
    // v passes through: only laid out heads-first.
#pragma unroll
    for (int j = 0; j < NR; j++) dst[t * NR + j] = src[t * NR + j];
    return;
  }
  const bool first = t < TPH / 2;
  const float base = __int_as_float(BASE_BITS);
#pragma unroll
  for (int j = 0; j < NR; j++) {
    const int e = t * NR + j;
    const int pair = first ? e : e - HALF;
    const float d = static_cast<float>(pair) / static_cast<float>(HALF);
    const float inv_freq = exp2f(-d * base);
    const float theta = pos * inv_freq;
    const float c = cosf(theta);
    const float s = sinf(theta);
    const float x1 = first ? y[j] : other[j];
    const float x2 = first ? other[j] : y[j];
    const float r = first ? x1 * c - x2 * s : x1 * s + x2 * c;
    dst[e] = T(r);
  }
"#
    };
}

const SOURCE: &str = concat!(
    r#"
  constexpr int NR = 16 / sizeof(T);
  constexpr int TPH = HD / NR;
  constexpr int HALF = HD / 2;
  const int H = q_shape[2] / HD;
  const int KVH = k_shape[2] / HD;
  const int b = blockIdx.x;
  const int tid = threadIdx.x;
  const int head = tid / TPH;
  const int t = tid % TPH;
  const bool is_q = head < H;
  const bool live = head < H + KVH;
  constexpr bool is_v = false;
  const T* src = is_q ? q + (static_cast<size_t>(b) * H + head) * HD : k + (static_cast<size_t>(b) * KVH + (head - H)) * HD;
  const T* w = is_q ? qw : kw;
  T* dst = is_q ? qo + (static_cast<size_t>(b) * H + head) * HD : ko + (static_cast<size_t>(b) * KVH + (head - H)) * HD;
  const float pos = static_cast<float>(offset[PER_ROW ? b : 0]);
"#,
    norm_rope_body!()
);

/// The same over a stacked q/k/v projection's rows `[B, (H + 2 KVH) HD]`
/// (no split, no reshapes: seven nodes of a decode step's attention layer
/// become this one), v copied out heads-first beside q and k.
// A thread's head and its role among a stacked projection's q, k and v
// heads (QH, KVH, KVH of them), its lane `t` within the head.
macro_rules! qkv_heads {
    () => {
        r#"
  constexpr int NR = 16 / sizeof(T);
  constexpr int TPH = HD / NR;
  constexpr int HALF = HD / 2;
  const int tid = threadIdx.x;
  const int head = tid / TPH;
  const int t = tid % TPH;
  const bool is_q = head < QH;
  const bool is_v = head >= QH + KVH;
  const bool live = head < QH + 2 * KVH;
"#
    };
}

const QKV_SOURCE: &str = concat!(
    r#"
  const int b = blockIdx.x;"#,
    qkv_heads!(),
    r#"  // A row's heads lie in the projection's order: q's, k's, then v's.
  const T* src = qkv + (static_cast<size_t>(b) * (QH + 2 * KVH) + head) * HD;
  const T* w = is_q ? qw : kw;
  T* dst = is_q ? qo + (static_cast<size_t>(b) * QH + head) * HD
         : is_v ? vo + (static_cast<size_t>(b) * KVH + (head - QH - KVH)) * HD
                : ko + (static_cast<size_t>(b) * KVH + (head - QH)) * HD;
  const float pos = static_cast<float>(offset[PER_ROW ? b : 0]);
"#,
    norm_rope_body!()
);

/// A lone sequence's q/k/v stage in one launch (src/kernels/qkv_fused.rs:
/// the residual add and RMSNorm, the stacked projection and this file's
/// norm and RoPE, on the ticket stages of src/kernels/moe_fused.rs): a
/// block a head, its HD rows of the projection (`LFM_IN_ROWS`, src/kernels/stages.rs: the
/// projection's walk, rounded to T as the product is) into shared memory,
/// then the head's norm and RoPE by its first warp, the `norm_rope_body`
/// arithmetic on the same values as the kernel above.
pub(crate) const QKV_FUSED_SOURCE: &str = concat!(
    r#"
  constexpr int NHEADS = QH + 2 * KVH;
  constexpr int NB = 1 + NHEADS;
  static_assert(HD % WARPS == 0 && HD * sizeof(T) % 16 == 0 && D * sizeof(T) % 16 == 0, "the head's rows tile the warps");
  static_assert(32 % (HD / (16 / sizeof(T))) == 0, "a head's lanes tile a warp");
  constexpr int XR = D * sizeof(T) / 16;
  __shared__ uint4 sm[XR];
  __shared__ uint4 hv_store[HD * sizeof(T) / 16];
  T* hv = reinterpret_cast<T*>(hv_store);
  unsigned long long* st = reinterpret_cast<unsigned long long*>(const_cast<uint32_t*>(ctr));
  unsigned long long launch;
  const int role = lfm_take_part<NB>(st, launch);
  if (role == 0) {
    lfm_norm_stage<T, D, NBLK>(h, r, wn, __int_as_float(EPS_NORM_BITS), s, reinterpret_cast<T*>(sm), yn);
    lfm_release_mark(st + 1, launch + 1);
    return;
  }
  const int hh = role - 1;
  const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);
  if (!late) lfm_stage16(sm, yn, XR);
  __syncthreads();
  {
    const int lane = threadIdx.x % 32;
    const int wid = threadIdx.x / 32;
    constexpr int RPW = HD / WARPS;
    float acc[RPW];
#pragma unroll
    for (int i = 0; i < RPW; i++) acc[i] = 0.0f;
    size_t rows[RPW];
#pragma unroll
    for (int i = 0; i < RPW; i++) rows[i] = static_cast<size_t>(hh) * HD + wid * RPW + i;
    if (!late) LFM_IN_ROWS(D, RPW, rows, reinterpret_cast<const T*>(sm), lane, acc);
    if (lane == 0) {
#pragma unroll
      for (int i = 0; i < RPW; i++) hv[wid * RPW + i] = late ? T(__int_as_float(0x7fc00000)) : T(acc[i]);
    }
  }
  __syncthreads();
  if (threadIdx.x >= 32) return;
  // This block's head alone, on its first warp's first TPH lanes (the
  // others hold zeros through the shuffles).
  constexpr int NR = 16 / sizeof(T);
  constexpr int TPH = HD / NR;
  constexpr int HALF = HD / 2;
  const int t = threadIdx.x;
  const bool live = t < TPH;
  const bool is_q = hh < QH;
  const bool is_v = hh >= QH + KVH;
  const T* src = hv;
  const T* w = is_q ? qw : kw;
  T* dst = is_q ? qo + static_cast<size_t>(hh) * HD
         : is_v ? vo + static_cast<size_t>(hh - QH - KVH) * HD
                : ko + static_cast<size_t>(hh - QH) * HD;
  const float pos = static_cast<float>(offset[0]);
"#,
    norm_rope_body!()
);

/// The same over a prompt's stacked projection `[B, T, (H + 2 KVH) HD]`
/// (a CUDA default since session 26, `MLX_LFM_QKV_PREFILL_KERNEL=0` turns
/// it off: its H200 test gave the stock ops' bits, and the paired A/B's
/// 512-token prefill read 1.10x on the 350M and 1.14x on the 1.2B, 1.01x
/// on the 8B-A1B, decode unchanged; `bench/results/2026-12-05-h200-session26.raw.jsonl`):
/// one block a position, q, k and v written heads-first `[B, heads, T,
/// HD]`, position `offset + s` for the row's s-th token. The stock pass
/// runs a split, three reshapes, MLX's rms_norm and rope for q and for k
/// and three transposes: in the H200's profile of the 1.2B's 512-token
/// prefill the ropes were 16 µs a launch and the norms 9 (over the
/// transposed views). The prompt's length is read from the shape at run
/// time (a template constant would compile a kernel per length).
const QKV_PREFILL_SOURCE: &str = concat!(
    r#"
  const int steps = qkv_shape[1];
  const int row = blockIdx.x;
  const int b = row / steps;
  const int s = row - b * steps;"#,
    qkv_heads!(),
    r#"  const T* src = qkv + (static_cast<size_t>(row) * (QH + 2 * KVH) + head) * HD;
  const T* w = is_q ? qw : kw;
  // (Threads past the last head compute an index they never write through.)
  const size_t hh = is_q ? static_cast<size_t>(b) * QH + head
                         : static_cast<size_t>(b) * KVH + (head - QH - (is_v ? KVH : 0));
  T* dst = (is_q ? qo : is_v ? vo : ko) + (hh * steps + s) * HD;
  const float pos = static_cast<float>(offset[PER_ROW ? b : 0] + s);
"#,
    norm_rope_body!()
);

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new("lfm_qk_norm_rope", &["q", "k", "qw", "kw", "offset"], &["qo", "ko"], SOURCE, "").ok()
    })
    .as_ref()
}

/// Whether the fused kernel serves a decode step's `q` `[B, 1, H * HD]` and
/// `k` `[B, 1, KVH * HD]` (or rows without the 1) with norm weights `[HD]` and an int32 offset
/// (scalar, `[1]` or one per row): on CUDA, a default there since session
/// 17 (bit for bit equal to the stock ops on the H200; its paired A/B
/// 1.02x / 1.09x / 1.00x decode on the 350M / 1.2B / 8B-A1B;
/// `MLX_LFM_QK_NORM_ROPE_KERNEL=0` turns it off), one float dtype, HD a
/// power of two whose 16-byte runs fit a warp, and every head of a row in
/// one block.
pub fn available(q: &Array, k: &Array, qw: &Array, kw: &Array, head_dim: i32) -> bool {
    static ON: OnceLock<Option<bool>> = OnceLock::new();
    if !super::cuda_default("MLX_LFM_QK_NORM_ROPE_KERNEL", &ON) {
        return false;
    }
    let dt = q.dtype();
    if !cuda_kernels_enabled() || !super::one_token(q) || !super::one_token(k) {
        return false;
    }
    let hd = head_dim;
    let (heads, kv_heads) = if hd > 0 { (q.dim(-1) / hd, k.dim(-1) / hd) } else { (0, 0) };
    k.dtype() == dt
        && norms_fit(qw, kw, dt, hd)
        && q.dim(0) == k.dim(0)
        && q.dim(0) > 0
        && heads > 0
        && kv_heads > 0
        && q.dim(-1) == heads * hd
        && k.dim(-1) == kv_heads * hd
        && block_fits(dt, heads + kv_heads, hd)
        && kernel().is_some()
}

/// One block a row holds `heads` heads of `head_dim`: a float dtype whose
/// 16-byte runs tile a power-of-two head within a warp (2 to 32 lanes a
/// head), at most 1024 threads.
fn block_fits(dt: Dtype, heads: i32, head_dim: i32) -> bool {
    if !dt.is_float() || dt == Dtype::Float64 || head_dim <= 0 || heads <= 0 {
        return false;
    }
    let tph = head_dim / (16 / dt.size() as i32);
    (head_dim as u32).is_power_of_two() && (2..=32).contains(&tph) && heads as i64 * tph as i64 <= 1024
}

/// Whether the q/k/v kernel's code serves these heads `(query heads, KV
/// heads, head width)` and norm weights in `dt` (the fused q/k/v stage's
/// question, src/kernels/qkv_fused.rs).
pub(crate) fn qkv_served(dt: Dtype, qw: &Array, kw: &Array, (heads, kv_heads, head_dim): (i32, i32, i32)) -> bool {
    heads_served(dt, heads, kv_heads, head_dim) && norms_fit(qw, kw, dt, head_dim)
}

/// The norm weights: `[head_dim]` each, in the activations' dtype.
fn norms_fit(qw: &Array, kw: &Array, dt: Dtype, head_dim: i32) -> bool {
    qw.dtype() == dt && kw.dtype() == dt && qw.shape() == [head_dim] && kw.shape() == [head_dim]
}

/// Launches `kern` over `b` rows of `per_row` positions of `heads` heads
/// (one block a position, whole warps; the lanes past the last head hold
/// zeros) with the norm and RoPE constants; `extra` template arguments
/// follow `HD`.
#[allow(clippy::too_many_arguments)]
fn launch(
    kern: &CudaKernel,
    what: &str,
    inputs: &[&Array],
    outputs: &[(&[i32], Dtype)],
    (b, per_row, heads, head_dim): (i32, i32, i32, i32),
    extra: &[(&str, TemplateArg)],
    offset: &Array,
    (eps, theta): (f32, f32),
) -> Result<Vec<Array>> {
    if !offset_served(offset, b) {
        return Err(Error::invalid(format!(
            "{what}: {} offsets of {:?} for {b} rows (int32, one or one per row)",
            offset.size(),
            offset.dtype()
        )));
    }
    let dt = outputs[0].1;
    let threads = heads * (head_dim / (16 / dt.size() as i32));
    let block = (threads + 31) / 32 * 32;
    let mut template = vec![("HD", TemplateArg::Int(head_dim))];
    template.extend(extra.iter().cloned());
    template.extend([
        ("PER_ROW", TemplateArg::Bool(offset.size() != 1)),
        // Float constants as their bits: template arguments are integers.
        ("EPS_BITS", TemplateArg::Int(eps.to_bits() as i32)),
        ("BASE_BITS", TemplateArg::Int(theta.log2().to_bits() as i32)),
        ("T", TemplateArg::Dtype(dt)),
    ]);
    let grid = b
        .checked_mul(per_row)
        .and_then(|n| n.checked_mul(block))
        .ok_or_else(|| Error::invalid(format!("{what}: {b} rows of {per_row} positions")))?;
    let outs = kern.call(inputs, outputs, [grid, 1, 1], [block, 1, 1], &template)?;
    if outs.len() != outputs.len() {
        return Err(Error::mlx(format!("{what} kernel: {} outputs, expected {}", outs.len(), outputs.len())));
    }
    Ok(outs)
}

/// Whether the kernel reads `offset` for `rows` rows: int32, one position
/// for every row or one per row.
pub fn offset_served(offset: &Array, rows: i32) -> bool {
    offset.dtype() == Dtype::Int32 && (offset.size() == 1 || offset.size() == rows as usize)
}

/// `(rope(rms_norm(q) * qw), rope(rms_norm(k) * kw))` per head, as
/// `[B, H, 1, HD]` and `[B, KVH, 1, HD]`; `offset` int32, a scalar or `[1]`
/// (every row at one position) or `[B]`. Callers check [`available`].
pub fn qk_norm_rope(q: &Array, k: &Array, qw: &Array, kw: &Array, offset: &Array, head_dim: i32, eps: f32, theta: f32) -> Result<(Array, Array)> {
    let kern = kernel().ok_or_else(|| Error::mlx("the q/k norm + RoPE kernel is not available"))?;
    let dt = q.dtype();
    let b = q.dim(0);
    let (heads, kv_heads) = (q.dim(-1) / head_dim, k.dim(-1) / head_dim);
    // The kernel reads its heads' width as `q_shape[2]`: rows are viewed
    // as `[B, 1, width]` (two views, against the three launches it saves).
    let (q, k) = if q.ndim() == 2 { (&q.reshape(&[b, 1, -1])?, &k.reshape(&[b, 1, -1])?) } else { (q, k) };
    let outs = launch(
        kern,
        "q/k norm + RoPE",
        &[q, k, qw, kw, offset],
        &[(&[b, heads, 1, head_dim], dt), (&[b, kv_heads, 1, head_dim], dt)],
        (b, 1, heads + kv_heads, head_dim),
        &[],
        offset,
        (eps, theta),
    )?;
    let [qo, ko]: [Array; 2] = outs.try_into().map_err(|_| Error::mlx("q/k norm + RoPE kernel: outputs"))?;
    Ok((qo, ko))
}

fn qkv_kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new("lfm_qkv_norm_rope", &["qkv", "qw", "kw", "offset"], &["qo", "ko", "vo"], QKV_SOURCE, "").ok()
    })
    .as_ref()
}

/// Whether a decode step's attention should hand the kernel its stacked
/// q/k/v projection whole: on CUDA, a default there since session 18 (its
/// test bit for bit and its greedy run passed on the H200; paired A/B
/// decode 1.03x / 1.04x / 1.05x on the 350M / 1.2B / 8B-A1B;
/// `MLX_LFM_QKV_NORM_ROPE_KERNEL=0` turns it off): asked before the
/// projection, of its input `h` (one token a row) and the heads; the
/// projection's output is then checked by [`qkv_available`].
pub fn qkv_wanted(h: &Array, heads: i32, kv_heads: i32, head_dim: i32) -> bool {
    static ON: OnceLock<Option<bool>> = OnceLock::new();
    super::cuda_default("MLX_LFM_QKV_NORM_ROPE_KERNEL", &ON)
        && cuda_kernels_enabled()
        && super::one_token(h)
        && heads_served(h.dtype(), heads, kv_heads, head_dim)
}

/// One block a row holds every head, q's, k's and v's: a float dtype whose
/// 16-byte runs tile a power-of-two head within a warp.
fn heads_served(dt: Dtype, heads: i32, kv_heads: i32, head_dim: i32) -> bool {
    heads > 0 && kv_heads > 0 && block_fits(dt, heads + 2 * kv_heads, head_dim)
}

/// Whether a prompt's attention (`h` `[B, T, D]`, T > 1) should hand the
/// prefill kernel its stacked q/k/v projection whole: on CUDA unless
/// `MLX_LFM_QKV_PREFILL_KERNEL=0`.
pub fn qkv_prefill_wanted(h: &Array, heads: i32, kv_heads: i32, head_dim: i32) -> bool {
    prefill_enabled() && cuda_kernels_enabled() && prompt(h) && heads_served(h.dtype(), heads, kv_heads, head_dim)
}

fn prefill_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_QKV_PREFILL_KERNEL", &ON)
}

/// A prompt's rows: `[B, T, W]` with more than one position.
fn prompt(a: &Array) -> bool {
    a.ndim() == 3 && a.dim(1) > 1
}

fn qkv_prefill_kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new("lfm_qkv_norm_rope_prefill", &["qkv", "qw", "kw", "offset"], &["qo", "ko", "vo"], QKV_PREFILL_SOURCE, "")
            .ok()
    })
    .as_ref()
}

/// Whether the kernel serves `qkv`, a stacked projection's rows `[B, W]`
/// or `[B, 1, W]` with `W = (heads + 2 kv_heads) head_dim` (or, with the
/// prefill kernel on, a prompt's `[B, T, W]`), norm weights `[head_dim]`
/// of its dtype, on CUDA.
pub fn qkv_available(qkv: &Array, qw: &Array, kw: &Array, heads: i32, kv_heads: i32, head_dim: i32) -> bool {
    let dt = qkv.dtype();
    let served = match prompt(qkv) {
        true => {
            prefill_enabled() && qkv.dim(0).checked_mul(qkv.dim(1)).is_some_and(|n| n <= i32::MAX / 1024) && qkv_prefill_kernel().is_some()
        }
        false => super::one_token(qkv),
    };
    served
        && qkv.dim(0) > 0
        && heads_served(dt, heads, kv_heads, head_dim)
        && qkv.dim(-1) as i64 == (heads + 2 * kv_heads) as i64 * head_dim as i64
        && norms_fit(qw, kw, dt, head_dim)
        && cuda_kernels_enabled()
        && qkv_kernel().is_some()
}

/// `(rope(rms_norm(q) * qw), rope(rms_norm(k) * kw), v)` from a stacked
/// projection's rows, as `[B, H, 1, HD]`, `[B, KVH, 1, HD]` and
/// `[B, KVH, 1, HD]` (what the split, its reshapes, the norms and the ropes
/// give), or from a prompt's `[B, T, W]` as `[B, H, T, HD]` and so on, its
/// s-th position at `offset + s`; `offset` as for [`qk_norm_rope`]. Callers
/// check [`qkv_available`].
pub fn qkv_norm_rope(
    qkv: &Array,
    qw: &Array,
    kw: &Array,
    offset: &Array,
    (heads, kv_heads, head_dim): (i32, i32, i32),
    eps: f32,
    theta: f32,
) -> Result<(Array, Array, Array)> {
    let steps = if prompt(qkv) { qkv.dim(1) } else { 1 };
    let kern = match steps {
        1 => qkv_kernel().ok_or_else(|| Error::mlx("the q/k/v norm + RoPE kernel is not available"))?,
        _ => qkv_prefill_kernel().ok_or_else(|| Error::mlx("the q/k/v norm + RoPE prefill kernel is not available"))?,
    };
    let dt = qkv.dtype();
    let b = qkv.dim(0);
    let outs = launch(
        kern,
        "q/k/v norm + RoPE",
        &[qkv, qw, kw, offset],
        &[(&[b, heads, steps, head_dim], dt), (&[b, kv_heads, steps, head_dim], dt), (&[b, kv_heads, steps, head_dim], dt)],
        (b, steps, heads + 2 * kv_heads, head_dim),
        &[("QH", TemplateArg::Int(heads)), ("KVH", TemplateArg::Int(kv_heads))],
        offset,
        (eps, theta),
    )?;
    let [qo, ko, vo]: [Array; 3] = outs.try_into().map_err(|_| Error::mlx("q/k/v norm + RoPE kernel: outputs"))?;
    Ok((qo, ko, vo))
}
