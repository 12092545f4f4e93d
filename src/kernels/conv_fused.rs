//! A lone sequence's short-conv layer in one launch (a CUDA default since
//! session 31, `MLX_LFM_CONV_FUSED=0` off: its H200 test and greedy sets
//! passed in sessions 30-31, and the one-launch layers together read decode
//! 1.12x / 1.00x / 1.15x on the 350M / 1.2B / 8B-A1B in session 31's paired
//! A/B, on an H100): the residual add + RMSNorm before it, in_proj, the
//! gated conv step and out_proj, otherwise four launches (the add + RMSNorm
//! kernel, MLX's GEMV or `qmv`, the short-conv kernel, MLX's GEMV or
//! `qmv`): 54 of the 8B-A1B's ~200 nodes a step over its 18 conv layers, 40
//! of the 1.2B's 138 over its ten.
//!
//! Stages handed on as in src/kernels/moe_fused.rs (read its note: a
//! block's ticket from the layer's counters gives its part and its launch,
//! a block waits only on smaller tickets, a wait past its bound poisons
//! the output instead of hanging, and a layer's launches must be ordered
//! by data): ticket 0 the add + RMSNorm, as the add + RMSNorm kernel's
//! block runs it (the same grouping of the sums: its bits); the next
//! tickets a warp a channel c, in_proj's rows c, C + c and 2C + c (B, C and
//! x) and the conv step's arithmetic on them, as the short-conv kernel does
//! it (the state after the token written whole); the last tickets a warp
//! an output of out_proj, once every channel is done. The products
//! (src/kernels/stages.rs's, shared with the feed-forward and q/k/v
//! kernels) walk a row as MLX's own kernels do, so that each is MLX's one-row product: the
//! quantized ones in its `qmv` arithmetic (src/kernels/quant_gemv.rs
//! `lfm_qdot_mlx`, the quantized GEMV's walk), the dense ones in its
//! `gemv_single` order (src/kernels/gemv.rs `lfm_dot_rows`, as the fold of
//! in_proj into the conv step does). The test holds the sum to the bits and the state and
//! output within two roundings of the stock ops'. A stage that gives up
//! poisons the state after the token too (not only the output), so that
//! sequence's later steps stay NaN and fail the finiteness check as well:
//! no silently wrong state (the every-norm form's in_proj has no wait to
//! give up: its state is the token's). Tests in src/kernels/tests.rs.

use super::stages::{self, Built, Cells};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::Normed;
pub use super::stages::Projections;
use std::sync::OnceLock;

// Template constants: T, D (the row), C (the conv's channels), KEEP (the
// state's positions), IBITS / IGS and OBITS / OGS (in_proj's and
// out_proj's specifications), NBLK (the add + RMSNorm kernel's block for
// this row), WARPS, EPS_BITS; `ctr`: the layer's counters (tickets, the
// norm's launch mark, channel blocks done). The body: the conv part of
// src/kernels/stages.rs's `LAYER_SOURCE`.

/// Warps a block (a channel or an output each): 16, so that each stage's
/// blocks spread over ~128 of the H200's 132 SMs (two blocks an SM where
/// ptxas keeps a thread within 64 registers), where 32 put the channels
/// and the outputs on 64 each.
const WARPS: i32 = 32 / 2;
/// The widest row and conv served (by ptxas on sm_90 the kernels stay
/// within 64 registers a thread up to here: `scripts/dev/nvrtc-check.py`).
const MAX_WIDTH: i32 = 8192;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_CONV_FUSED", &ON)
}

static BUILT: Built = Built::new();
static EVERY_BUILT: Built = Built::new();
static WAIT_BUILT: Built = Built::new();

/// How many times [`forward`] has put the kernel into a graph in this
/// process: the greedy test's evidence that its runs took this path.
pub fn built() -> usize {
    BUILT.get()
}

/// How many of [`built`]'s graphs took the every-norm form
/// ([`every_norm`]): the tests' evidence.
pub fn every_norm_built() -> usize {
    EVERY_BUILT.get()
}

/// How many of [`built`]'s graphs took the waiting form (every-norm off):
/// the tests' evidence that `=0` reached the kernel (a count that only
/// rises, so a test beside it in the process cannot fail the check).
pub fn waiting_built() -> usize {
    WAIT_BUILT.get()
}

/// `MLX_LFM_CONV_EVERY_NORM` (written in session 48; a CUDA default since
/// session 50, `=0` off: its test cases passed on an H100 in session 49,
/// its greedy sets on all four fixtures there; with the q/k/v stage's and
/// the feed-forward's forms, decode 1.035x on the 1.2B and 1.066x on the
/// 350M in session 50's A/B): in_proj's blocks each compute the layer's
/// add + RMSNorm
/// ([`stages::CONV_EVERY_NORM_SUBSTITUTION`]) instead of waiting for the
/// first block's mark and reading its row back, as the q/k/v stage's
/// every-norm form does (`MLX_LFM_QKV_EVERY_NORM`, which read the 1.2B's
/// decode 1.014-1.021x over its six attention layers in session 48's A/B
/// on an H100): the same code on the same values, so the same bits; each
/// block reads the row's three vectors (12 KB at 2,048 wide) from L2. No
/// early form (its text asks for in_proj's rows before the wait this one
/// has not); the bench's timeline form stays the waiting one. With no wait
/// before it, in_proj never gives up here, so the state after the token is
/// the token's, not poisoned (out_proj's wait still poisons the output).
fn every_norm() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_CONV_EVERY_NORM", &ON)
}

/// The kernel; with `scratch`, its form with the scratch rows (`yn`,
/// `yc`) in the layer's state ([`stages::call_with_scratch`]); under
/// `MLX_LFM_EARLY_PREFETCH=conv`, its form that asks for its rows before
/// its waits ([`stages::early_prefetch`]).
fn kernel(quant: bool, scratch: bool) -> Option<&'static CudaKernel> {
    static FORMS: stages::Forms = stages::Forms::new();
    static EVERY_FORMS: stages::Forms = stages::Forms::new();
    static EVERY_TEXT: OnceLock<String> = OnceLock::new();
    let mut inputs = vec!["h", "r", "wn", "state", "cw"];
    inputs.extend(Projections::input_names(quant));
    inputs.push("ctr");
    let outputs = ["s", "out", "next", "yn", "yc"];
    let header = || stages::layer_header(quant, false, stages::layer_defines(true, stages::Tail::None));
    if every_norm() {
        let body = EVERY_TEXT.get_or_init(|| super::substituted(stages::LAYER_SOURCE, &[stages::CONV_EVERY_NORM_SUBSTITUTION]));
        let base = if quant { "lfm_conv_fused_en" } else { "lfm_conv_fused_dense_en" };
        return EVERY_FORMS.kernel(base, (quant, scratch, false), body, &[], SCRATCH_PRELUDE, &inputs, (&outputs, 3), header);
    }
    let early = stages::early_prefetch("conv");
    let base = if quant { "lfm_conv_fused" } else { "lfm_conv_fused_dense" };
    FORMS.kernel(base, (quant, scratch, early), stages::LAYER_SOURCE, &stages::EARLY_SUBSTITUTIONS, SCRATCH_PRELUDE, &inputs, (&outputs, 3), header)
}

/// The scratch rows' pointers into the layer's state
/// (`MLX_LFM_SCRATCH_IN_STATE`, src/kernels/stages.rs), as the outputs of
/// those names were: the normed row and the gated channels.
const SCRATCH_PRELUDE: &str = r#"
  unsigned char* lfm_scratch = reinterpret_cast<unsigned char*>(const_cast<uint32_t*>(ctr));
  T* yn = reinterpret_cast<T*>(lfm_scratch + SCR_YN);
  T* yc = reinterpret_cast<T*>(lfm_scratch + SCR_YC);
"#;

/// The uint32 words of a conv layer's state: its counters and room for
/// its scratch rows (`d` wide and `c` channels, at up to 4 bytes each).
pub fn state_words(d: usize, c: usize) -> usize {
    stages::state_words(&[d as i64 * 4, c as i64 * 4])
}

/// The blocks of one launch: the norm's, the channels', out_proj's.
fn blocks(d: i32, c: i32) -> i64 {
    let w = WARPS as i64;
    1 + (c as i64 + w - 1) / w + (d as i64 + w - 1) / w
}

/// Whether the switch is on where our CUDA kernels run (what the layer
/// asks before it takes the conv state early).
pub fn enabled_here() -> bool {
    enabled() && cuda_kernels_enabled()
}

/// `MLX_LFM_CONV_FIRST_FUSED` (a CUDA default since session 40, `=0`
/// off; written in session 39): the first layer's
/// conv through this kernel too, over a residual of zeros (the model's
/// `zero_row`, made once at load: `h + 0` is `h`, but for a zero's sign,
/// so the residual sum is the one the layer computes without it; its norm
/// is this kernel's reduction, as in every later layer, where MLX's
/// `rms_norm` ran: within a rounding of it, not its bits). The first layer
/// has no residual to add, so without it the layer runs its norm, in_proj,
/// conv step and out_proj as four launches: on session 38's profile of the
/// 8B-A1B ~24 µs of GPU time against this kernel's ~18, and three more
/// nodes a token for a host that bounds the step (the 350M's). Session
/// 40's paired A/B on an H100 read decode 1.015x on the 8B-A1B (four reps
/// 1.008-1.017, where its all-default arm spread 0.5%) and 1.026x on the
/// 350M; its greedy sets kept the stock tokens on every fixture.
pub fn first_layer() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_CONV_FIRST_FUSED", &ON)
}

/// Whether [`forward`] serves the pending norm `x` (one row, with a
/// residual to add), the projections `p` (in_proj `[3C, D]`, out_proj
/// `[D, C]`; quantized: specifications the MLX walk serves; dense: the
/// activations' dtype), no biases, the conv state `state` (`[1, L - 1, C]`)
/// and weights `cw` (`[C, L]`): on ([`enabled`]), on CUDA, with eps
/// compiled in (`MLX_LFM_EPS_CONST`, the default), where the add + RMSNorm
/// kernel serves the row with a block no wider than this kernel's (the
/// same grouping of its sums), and the staged rows within shared memory.
pub fn available(x: &Normed, p: Projections, state: &Array, cw: &Array, has_bias: bool) -> bool {
    if !enabled_here() || !part_served(x, p, state, cw, has_bias, WARPS) {
        return false;
    }
    let bytes = |len: i32| len as usize * x.h.dtype().size();
    bytes(x.h.dim(1)).max(bytes(cw.dim(0))) <= stages::MAX_STAGED && kernel(p.quant(), false).is_some()
}

/// The conv layer's operands as this kernel's stages serve them, in blocks
/// of `warps` warps (also the joined kernels' conv part,
/// src/kernels/conv_layer_fused.rs; callers ask for their switch and for
/// CUDA): eps compiled in,
/// no bias, one row `x` with a residual to add, its norm as the add +
/// RMSNorm kernel serves it with a block no wider than ours, the
/// projections as the products serve them, the state and weights in the
/// row's dtype, the row and the channels within [`MAX_WIDTH`] and whole
/// 16-byte runs.
pub(crate) fn part_served(x: &Normed, p: Projections, state: &Array, cw: &Array, has_bias: bool, warps: i32) -> bool {
    let Some(r) = x.r else { return false };
    if has_bias || !super::add_rms_norm::eps_const() || x.h.ndim() != 2 || x.h.dim(0) != 1 {
        return false;
    }
    if state.ndim() != 3 || cw.ndim() != 2 {
        return false;
    }
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let (c, l) = (cw.dim(0), cw.dim(1));
    let bytes = |len: i32| len as usize * dt.size();
    super::add_rms_norm::available(x.h, r, x.w)
        && super::add_rms_norm::block_for(d, 16 / dt.size() as i32) <= warps * 32
        && c > 0
        && p.served(dt, 3 * c, d, c)
        && l >= 2
        && state.shape() == [1, l - 1, c]
        && state.dtype() == dt
        && cw.dtype() == dt
        && d <= MAX_WIDTH
        && c <= MAX_WIDTH
        && bytes(d) % 16 == 0
        && bytes(c) % 16 == 0
}

/// `(the residual sum [1, D], out_proj's output [1, D] (before a tensor
/// parallel reduce), the state after the token [1, L - 1, C])` in one
/// launch (callers check [`available`]); `ctr` the layer's own
/// (`stages::new_counters`).
pub fn forward(x: &Normed, p: Projections, state: &Array, cw: &Array, ctr: &Array) -> Result<(Array, Array, Array)> {
    let mut outs = launch(x, p, state, cw, ctr, false)?;
    let missing = || Error::mlx("fused short-conv layer kernel: missing output");
    let next = outs.pop().ok_or_else(missing)?;
    let out = outs.pop().ok_or_else(missing)?;
    let s = outs.pop().ok_or_else(missing)?;
    Ok((s, out, next))
}

/// [`forward`]'s output and state after the token through the kernel's
/// timeline form (the bench's: `stages::TIMELINE_HEADER`), with its stamps
/// `[NB * 4]` int64 and the parts' bounds: the channels' blocks are parts
/// `1..=channels`, out_proj's `channels + 1..nb`.
#[doc(hidden)]
pub fn forward_timeline(x: &Normed, p: Projections, state: &Array, cw: &Array, ctr: &Array) -> Result<(Array, Array, Array, usize, usize)> {
    let mut outs = launch(x, p, state, cw, ctr, true)?;
    let missing = || Error::mlx("fused short-conv layer kernel: missing output");
    let times = outs.pop().ok_or_else(missing)?;
    let (d, c) = (x.h.dim(1), cw.dim(0));
    let channels = (c as i64 + WARPS as i64 - 1) / WARPS as i64;
    let next = outs.swap_remove(2);
    Ok((outs.swap_remove(1), next, times, channels as usize, blocks(d, c) as usize))
}

/// The kernel's timeline form (outputs as [`kernel`]'s, then `times`), of
/// the default or (`MLX_LFM_EARLY_PREFETCH=conv`) the early form.
fn timeline_kernel(quant: bool) -> Option<&'static CudaKernel> {
    static K: [[Cells; 2]; 2] = [[stages::cells(), stages::cells()], [stages::cells(), stages::cells()]];
    let early = stages::early_prefetch("conv");
    let source = stages::stamped_layer_source(early);
    let mut inputs = vec!["h", "r", "wn", "state", "cw"];
    inputs.extend(Projections::input_names(quant));
    inputs.push("ctr");
    let outputs = ["s", "out", "next", "yn", "yc", "times"];
    let base = if quant { "lfm_conv_fused_timeline" } else { "lfm_conv_fused_dense_timeline" };
    let name = format!("{base}{}", if early { "_early" } else { "" });
    stages::kernel(&K[usize::from(early)][usize::from(quant)], &name, &inputs, &outputs, source, || {
        let head = stages::layer_header(quant, false, stages::layer_defines(true, stages::Tail::None));
        let early = if early { stages::early_header(quant) } else { String::new() };
        format!("{}{early}{head}", stages::TIMELINE_HEADER)
    })
}

/// The launch: `[s, out, next]`, or (`timeline`) every output of the
/// timeline form, its stamps last.
fn launch(x: &Normed, p: Projections, state: &Array, cw: &Array, ctr: &Array, timeline: bool) -> Result<Vec<Array>> {
    const WHAT: &str = "the fused short-conv layer kernel";
    let kern = if timeline { timeline_kernel(p.quant()) } else { kernel(p.quant(), false) };
    let kern = kern.ok_or_else(|| Error::mlx(format!("{WHAT} is not available")))?;
    stages::check_state(ctr, WHAT)?;
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let (c, l) = (cw.dim(0), cw.dim(1));
    let nb = blocks(d, c);
    let threads = WARPS * 32;
    let grid = i32::try_from(nb * threads as i64).map_err(|_| Error::invalid(format!("fused short-conv layer kernel: {nb} blocks")))?;
    let (mut inputs, template) = part_operands(x, p, state, cw, WARPS, WHAT)?;
    inputs.push(ctr);
    let outputs: [(&[i32], Dtype); 5] = [(&[1, d], dt), (&[1, d], dt), (&[1, l - 1, c], dt), (&[d], dt), (&[c], dt)];
    if timeline {
        return stages::call_stamped(kern, &inputs, &outputs, nb, [grid, 1, 1], [threads, 1, 1], &template, "fused short-conv layer kernel");
    }
    let outs = stages::call_with_scratch(
        kern,
        || kernel(p.quant(), true),
        &inputs,
        &outputs,
        &["SCR_YN", "SCR_YC"],
        ctr,
        [grid, 1, 1],
        [threads, 1, 1],
        &template,
    )?;
    BUILT.bump();
    if every_norm() {
        EVERY_BUILT.bump();
    } else {
        WAIT_BUILT.bump();
    }
    Ok(outs)
}

/// The operands a launch with the conv part begins with (the row, its
/// residual and norm weight, the conv's state, weights and projections)
/// and the conv part's template constants, blocks of `warps` warps: this
/// kernel's, and the joined kernels' first (src/kernels/conv_layer_fused.rs),
/// for `what`'s errors.
pub(crate) fn part_operands<'a>(
    x: &Normed<'a>,
    p: Projections<'a>,
    state: &'a Array,
    cw: &'a Array,
    warps: i32,
    what: &str,
) -> Result<(Vec<&'a Array>, stages::Specs)> {
    let r = x.r.ok_or_else(|| Error::invalid(format!("{what} needs a residual to add")))?;
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let (c, w) = (cw.dim(0), cw.dim(1));
    let mut template = vec![
        ("T", TemplateArg::Dtype(dt)),
        ("D", TemplateArg::Int(d)),
        ("C", TemplateArg::Int(c)),
        ("KEEP", TemplateArg::Int(w - 1)),
        ("NBLK", TemplateArg::Int(super::add_rms_norm::block_for(d, 16 / dt.size() as i32))),
        ("WARPS", TemplateArg::Int(warps)),
        ("EPS_BITS", TemplateArg::Int(x.eps.to_bits() as i32)),
    ];
    let (projections, spec) = p.inputs()?;
    template.extend(spec);
    let mut inputs = vec![x.h, r, x.w, state, cw];
    inputs.extend(projections);
    Ok((inputs, template))
}

#[cfg(test)]
pub(crate) fn launch_blocks(d: i32, c: i32) -> i64 {
    blocks(d, c)
}
