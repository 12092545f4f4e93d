//! One decode step of LFM2's double-gated short convolution in one kernel:
//! from in_proj's output `[B, 1, 3D]` (B, C, x) and the conv state `[B, L-1,
//! D]`, `bx = B * x`, the padded window `[state; bx]`, the depthwise conv
//! over it and `y = C * conv`, and the state after the token (the window's
//! last L-1 rows, exactly as the stock path's concatenate and slice leave
//! them). The stock graph spends a multiply, a concatenate (two copies), the
//! grouped conv, a second multiply and the state's slice per conv layer and
//! token; the 1.2B has ten conv layers. The new state comes out whole, so
//! no slice node follows the kernel (`ForwardCache::conv_step_update`).
//!
//! One thread per (row, channel). Rounding follows the stock ops: `bx` is
//! rounded to the model dtype before the window holds it, the conv sums in
//! float32 and is rounded once, then the gate multiply rounds again.

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use std::sync::OnceLock;

const SOURCE: &str = r#"
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t b = i / D;
  const int d = static_cast<int>(i - b * D);
  const T* row = bcx + b * 3 * D;
  const T* st = state + b * KEEP * D;
  T* ns = next + b * KEEP * D;
  const T* wd = w + static_cast<size_t>(d) * (KEEP + 1);
  float acc = 0.0f;
  for (int j = 0; j < KEEP; j++) {
    const T v = st[j * D + d];
    if (j > 0) ns[(j - 1) * D + d] = v;
    acc += static_cast<float>(wd[j]) * static_cast<float>(v);
  }
  const T bx = T(static_cast<float>(row[d]) * static_cast<float>(row[2 * D + d]));
  ns[(KEEP - 1) * D + d] = bx;
  acc += static_cast<float>(wd[KEEP]) * static_cast<float>(bx);
  y[b * D + d] = T(static_cast<float>(row[D + d]) * static_cast<float>(T(acc)));
"#;

// (Named apart from the earlier body, which wrote the padded window, from
// before every kernel's name carried a hash of its text: MLX keeps
// compiled kernels on disk by name; see mlx::kernel::module_name.)
fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_short_conv_step_next", &["bcx", "state", "w"], &["next", "y"], SOURCE, "").ok())
        .as_ref()
}

/// Threads per block: a power of two dividing D, so the grid is exactly
/// B * D threads and no thread needs a bounds check.
fn block_for(d: i32) -> Option<i32> {
    [256, 128, 64, 32].into_iter().find(|b| d % b == 0)
}

/// Whether the fused step serves these operands: one token per row, the
/// state and weights in the activations' dtype, no conv bias (LFM2 has
/// none; a checkpoint with one keeps the stock ops).
pub fn available(bcx: &Array, state: &Array, w: &Array, has_bias: bool) -> bool {
    // MLX_LFM_SHORT_CONV_KERNEL=0 keeps this one kernel off (the H200
    // benchmark's A/B of what it buys); MLX_LFM_KERNELS=0 turns all off.
    static ON: OnceLock<bool> = OnceLock::new();
    if !crate::knobs::cached("MLX_LFM_SHORT_CONV_KERNEL", &ON, |v| v != Some("0")) {
        return false;
    }
    let dt = bcx.dtype();
    if !cuda_kernels_enabled() || has_bias || !dt.is_float() || dt == Dtype::Float64 {
        return false;
    }
    if !super::one_token(bcx) || state.ndim() != 3 || w.ndim() != 2 {
        return false;
    }
    let (b, d, l) = (bcx.dim(0), w.dim(0), w.dim(1));
    bcx.dim(-1) == 3 * d
        && state.shape() == [b, l - 1, d]
        && state.dtype() == dt
        && w.dtype() == dt
        && l >= 2
        && b > 0
        && block_for(d).is_some()
        && kernel().is_some()
}

/// `(state after the token [B, L-1, D], y [B, 1, D])` for in_proj's output
/// `bcx`, the state before the token and the depthwise weights `w` (`[D,
/// L]`); `y` `[B, D]` for rows `bcx` `[B, 3D]`.
pub fn conv_step(bcx: &Array, state: &Array, w: &Array) -> Result<(Array, Array)> {
    let kern = kernel().ok_or_else(|| Error::mlx("the fused short-conv kernel is not available"))?;
    let (b, d, l) = (bcx.dim(0), w.dim(0), w.dim(1));
    let block = block_for(d).ok_or_else(|| Error::invalid(format!("short-conv kernel: width {d} is not a multiple of 32")))?;
    let threads = b.checked_mul(d).ok_or_else(|| Error::invalid("too many rows for the short-conv kernel"))?;
    let dt = bcx.dtype();
    let y_shape: Vec<i32> = if bcx.ndim() == 2 { vec![b, d] } else { vec![b, 1, d] };
    launch(kern, "short-conv kernel", &[bcx, state, w], [&[b, l - 1, d], &y_shape], (d, l, dt), threads, block)
}

/// A conv kernel's launch over `inputs` with the width, the window and the
/// dtype as its constants: its two outputs (the state or window, then `y`)
/// of `shapes`, in `dt`.
fn launch(
    kern: &CudaKernel,
    what: &str,
    inputs: &[&Array],
    shapes: [&[i32]; 2],
    (d, l, dt): (i32, i32, Dtype),
    threads: i32,
    block: i32,
) -> Result<(Array, Array)> {
    let mut outs = kern.call(
        inputs,
        &[(shapes[0], dt), (shapes[1], dt)],
        [threads, 1, 1],
        [block, 1, 1],
        &[("D", TemplateArg::Int(d)), ("KEEP", TemplateArg::Int(l - 1)), ("T", TemplateArg::Dtype(dt))],
    )?;
    let y = outs.pop().ok_or_else(|| Error::mlx(format!("{what}: missing output")))?;
    let state = outs.pop().ok_or_else(|| Error::mlx(format!("{what}: missing output")))?;
    Ok((state, y))
}

/// The conv layer's in_proj GEMV and the step above in one launch
/// (`MLX_LFM_CONV_GEMV_KERNEL=1`, opt-in until its H200 A/B): a warp per
/// channel d walks in_proj's rows d, D + d and 2D + d (B, C and x) as the
/// dense GEMV does (src/kernels/gemv.rs: MLX's `gemv_single` order, so each
/// is MLX's one-row product to the bit), rounds each to the dtype, and its
/// lane 0 runs the step's arithmetic above on them. The `[1, 3D]`
/// projection is never written and the step is no launch of its own: a
/// node fewer a conv layer and token (ten on the 1.2B, whose in_proj is
/// MLX's GEMV by default).
const GEMV_SOURCE: &str = r#"
  const int lane = threadIdx.x % 32;
  const int d = blockIdx.x * (256 / 32) + threadIdx.x / 32;
  if (d >= D) return;
  float acc[3] = {0.0f, 0.0f, 0.0f};
  const T* rows[3] = {w + static_cast<size_t>(d) * K, w + static_cast<size_t>(D + d) * K,
                      w + static_cast<size_t>(2 * D + d) * K};
  lfm_dot_rows<T, K, 1, 3>(x, lfm_aligned(x), rows, lfm_aligned(w), lane, acc);
  const float sb = lfm_warp_sum(acc[0]);
  const float sc = lfm_warp_sum(acc[1]);
  const float sx = lfm_warp_sum(acc[2]);
  if (lane != 0) return;
  const T bt = T(sb);
  const T ct = T(sc);
  const T xt = T(sx);
  const T* wd = cw + static_cast<size_t>(d) * (KEEP + 1);
  float a = 0.0f;
  for (int j = 0; j < KEEP; j++) {
    const T v = state[j * D + d];
    if (j > 0) next[(j - 1) * D + d] = v;
    a += static_cast<float>(wd[j]) * static_cast<float>(v);
  }
  const T bx = T(static_cast<float>(bt) * static_cast<float>(xt));
  next[(KEEP - 1) * D + d] = bx;
  a += static_cast<float>(wd[KEEP]) * static_cast<float>(bx);
  y[d] = T(static_cast<float>(ct) * static_cast<float>(T(a)));
"#;

fn gemv_kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| {
        CudaKernel::new("lfm_conv_gemv_step", &["x", "w", "state", "cw"], &["next", "y"], GEMV_SOURCE, &super::gemv::header()).ok()
    })
    .as_ref()
}

/// Whether the fused in_proj is on: `MLX_LFM_CONV_GEMV_KERNEL=1` (or a
/// test's opt-in) where our CUDA kernels run.
pub fn gemv_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_in("MLX_LFM_CONV_GEMV_KERNEL", &ON) && cuda_kernels_enabled()
}

/// Whether [`conv_gemv_step`] serves one row `x` (`[1, K]` or `[1, 1,
/// K]`), the dense in_proj `w` (`[3D, K]`, no bias), the state and the
/// conv weights: on CUDA with `MLX_LFM_CONV_GEMV_KERNEL=1`, one row only
/// (MLX's product for several rows is another kernel, whose sums this one
/// does not walk), K a multiple of 8 up to 16,384.
pub fn gemv_available(x: &Array, w: &Array, state: &Array, cw: &Array, has_bias: bool) -> bool {
    if !gemv_enabled() || has_bias {
        return false;
    }
    let dt = x.dtype();
    if !dt.is_float() || dt == Dtype::Float64 || w.ndim() != 2 || cw.ndim() != 2 || state.ndim() != 3 {
        return false;
    }
    let (d, l, k) = (cw.dim(0), cw.dim(1), w.dim(1));
    let rows = if x.dim(-1) > 0 { x.size() / x.dim(-1) as usize } else { 0 };
    rows == 1
        && super::one_token(x)
        && x.dim(-1) == k
        && k > 0
        && k % 8 == 0
        && k <= 16_384
        && w.dim(0) == 3 * d
        && d > 0
        && l >= 2
        && state.shape() == [1, l - 1, d]
        && w.dtype() == dt
        && state.dtype() == dt
        && cw.dtype() == dt
        && gemv_kernel().is_some()
}

/// `(state after the token [1, L-1, D], y)` for the normed row `x`: the
/// in_proj product `x @ w.T` and [`conv_step`] on it, one launch; `y` in
/// `x`'s shape with D for K.
pub fn conv_gemv_step(x: &Array, w: &Array, state: &Array, cw: &Array) -> Result<(Array, Array)> {
    let kern = gemv_kernel().ok_or_else(|| Error::mlx("the fused in_proj + short-conv kernel is not available"))?;
    let (d, l, k) = (cw.dim(0), cw.dim(1), w.dim(1));
    let dt = x.dtype();
    // (One dtype: the kernel reads every operand as `T`.)
    if [w, state, cw].iter().any(|a| a.dtype() != dt) {
        return Err(Error::invalid(format!(
            "in_proj + short-conv kernel: the row is {dt:?}, in_proj {:?}, the state {:?}, the conv weights {:?}",
            w.dtype(),
            state.dtype(),
            cw.dtype()
        )));
    }
    let mut y_shape = x.shape();
    if let Some(last) = y_shape.last_mut() {
        *last = d;
    }
    let blocks = (d + 7) / 8;
    let threads = blocks.checked_mul(256).ok_or_else(|| Error::invalid(format!("in_proj + short-conv kernel: {d} channels")))?;
    let mut outs = kern.call(
        &[x, w, state, cw],
        &[(&[1, l - 1, d], dt), (&y_shape, dt)],
        [threads, 1, 1],
        [256, 1, 1],
        &[("K", TemplateArg::Int(k)), ("D", TemplateArg::Int(d)), ("KEEP", TemplateArg::Int(l - 1)), ("T", TemplateArg::Dtype(dt))],
    )?;
    let y = outs.pop().ok_or_else(|| Error::mlx("in_proj + short-conv kernel: missing output"))?;
    let next = outs.pop().ok_or_else(|| Error::mlx("in_proj + short-conv kernel: missing output"))?;
    Ok((next, y))
}

/// A prompt's pass of the short conv in one kernel
/// (a CUDA default since session 27, `MLX_LFM_CONV_PREFILL_KERNEL=0` off;
/// session 26's paired A/B on the H200: 512-token prefill 1.10x / 1.14x on
/// the 350M / 1.2B, 1.01x on the 8B-A1B, and the greedy test kept the
/// stock tokens with it on every fixture):
/// from in_proj's output `[B, T, 3D]` and the state before the prompt, the
/// padded window `[state; B * x]` (what the caches keep their state and
/// block-end snapshots from) and `y = C * conv` for every position. The
/// stock ops spend a strided multiply, a concatenate, MLX's grouped conv
/// and a second strided multiply per conv layer: in the H200's profile of
/// the 1.2B's 512-token prefill the conv alone was 29 µs a layer
/// (`conv2d_grouped_direct_kernel`, ~2 MB read) and the multiplies on the
/// split views more.
///
/// One thread per (row, position, channel), each position's window summed
/// as the decode step above sums its one: the same float32 products in the
/// same order, so a prompt's conv equals the step kernel's run token by
/// token (`conv_prefill_kernel_matches_stock_ops`), and MLX's conv within a
/// rounding, as the step is. `bx` of a window's other positions is
/// recomputed from in_proj's output (two loads, from L1/L2) rather than
/// shared through memory: one pass, no synchronisation. The batch and the
/// prompt length are read from the shape at run time (a template constant
/// would compile a kernel per prompt length).
const PREFILL_SOURCE: &str = r#"
  const size_t steps = static_cast<size_t>(bcx_shape[1]);
  const size_t n = static_cast<size_t>(bcx_shape[0]) * steps * D;
  const size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const size_t bt = i / D;
  const int d = static_cast<int>(i - bt * D);
  const size_t b = bt / steps;
  const size_t t = bt - b * steps;
  const T* rows = bcx + b * steps * 3 * D;
  const T* st = state + b * KEEP * D;
  T* pad = padded + b * (KEEP + steps) * D;
  const T* wd = w + static_cast<size_t>(d) * (KEEP + 1);
  if (t == 0) {
    for (int j = 0; j < KEEP; j++) pad[j * D + d] = st[j * D + d];
  }
  float acc = 0.0f;
  T bx = T(0.0f);
  for (int j = 0; j <= KEEP; j++) {
    const size_t p = t + j;
    T v;
    if (p < KEEP) {
      v = st[p * D + d];
    } else {
      const T* r = rows + (p - KEEP) * 3 * D;
      v = T(static_cast<float>(r[d]) * static_cast<float>(r[2 * D + d]));
    }
    acc += static_cast<float>(wd[j]) * static_cast<float>(v);
    bx = v;
  }
  pad[(KEEP + t) * D + d] = bx;
  y[bt * D + d] = T(static_cast<float>(rows[t * 3 * D + D + d]) * static_cast<float>(T(acc)));
"#;

fn prefill_kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_short_conv_prefill", &["bcx", "state", "w"], &["padded", "y"], PREFILL_SOURCE, "").ok())
        .as_ref()
}

const PREFILL_THREADS: i32 = 256;

/// Whether [`conv_prefill`] serves a pass of several positions: on CUDA
/// unless `MLX_LFM_CONV_PREFILL_KERNEL=0` (a test may turn it on), in_proj's
/// output `[B, T, 3D]` with T > 1 (one position is the step's), the state
/// `[B, L-1, D]` and the conv weights `[D, L]` in its dtype, no conv bias,
/// and a launch of at most 2^31 threads.
pub fn prefill_available(bcx: &Array, state: &Array, w: &Array, has_bias: bool) -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    if !super::opt_out("MLX_LFM_CONV_PREFILL_KERNEL", &ON) || !cuda_kernels_enabled() || has_bias {
        return false;
    }
    let dt = bcx.dtype();
    if !dt.is_float() || dt == Dtype::Float64 || bcx.ndim() != 3 || state.ndim() != 3 || w.ndim() != 2 {
        return false;
    }
    let (b, t, d, l) = (bcx.dim(0), bcx.dim(1), w.dim(0), w.dim(1));
    b > 0
        && t > 1
        && d > 0
        && l >= 2
        && bcx.dim(2) == 3 * d
        && state.shape() == [b, l - 1, d]
        && state.dtype() == dt
        && w.dtype() == dt
        && prefill_threads(b, t, d).is_some()
        && prefill_kernel().is_some()
}

/// Threads of a launch over `b * t * d` outputs, rounded up to whole blocks.
fn prefill_threads(b: i32, t: i32, d: i32) -> Option<i32> {
    let n = b.checked_mul(t)?.checked_mul(d)?;
    n.checked_add(PREFILL_THREADS - 1).map(|m| m / PREFILL_THREADS * PREFILL_THREADS)
}

/// `(the padded window [B, L-1+T, D], y [B, T, D])` for in_proj's output
/// `bcx` (`[B, T, 3D]`: B, C and x), the state before the pass and the
/// depthwise weights `w` (`[D, L]`).
pub fn conv_prefill(bcx: &Array, state: &Array, w: &Array) -> Result<(Array, Array)> {
    let kern = prefill_kernel().ok_or_else(|| Error::mlx("the short-conv prefill kernel is not available"))?;
    if bcx.ndim() != 3 || w.ndim() != 2 {
        return Err(Error::invalid(format!(
            "short-conv prefill kernel: in_proj's output is {:?} and the conv weights {:?}, expected [B, T, 3D] and [D, L]",
            bcx.shape(),
            w.shape()
        )));
    }
    let (b, t, d, l) = (bcx.dim(0), bcx.dim(1), w.dim(0), w.dim(1));
    let dt = bcx.dtype();
    if bcx.dim(2) != 3 * d || state.shape() != [b, l - 1, d] || state.dtype() != dt || w.dtype() != dt {
        return Err(Error::invalid(format!(
            "short-conv prefill kernel: in_proj's output {:?} {dt:?}, the state {:?} {:?}, the conv weights {:?} {:?} do not fit",
            bcx.shape(),
            state.shape(),
            state.dtype(),
            w.shape(),
            w.dtype()
        )));
    }
    let threads = prefill_threads(b, t, d)
        .ok_or_else(|| Error::invalid(format!("short-conv prefill kernel: {b} x {t} x {d} outputs exceed one launch")))?;
    launch(kern, "short-conv prefill kernel", &[bcx, state, w], [&[b, l - 1 + t, d], &[b, t, d]], (d, l, dt), threads, PREFILL_THREADS)
}
