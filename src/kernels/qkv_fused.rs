//! A lone sequence's q/k/v stage of an attention layer in one launch (a
//! CUDA default since session 31, `MLX_LFM_QKV_FUSED=0` off: its H200 test
//! and greedy sets passed in sessions 30-31, and the one-launch layers
//! together read decode 1.12x / 1.00x / 1.15x on the 350M / 1.2B / 8B-A1B
//! in session 31's paired A/B, on an H100): the residual add + RMSNorm
//! before it, the stacked q/k/v projection and the heads' norm + RoPE,
//! otherwise three launches (the add + RMSNorm kernel, MLX's GEMV or `qmv`,
//! src/kernels/qk_norm_rope.rs's q/k/v kernel): 12 of the 1.2B's and the
//! 8B-A1B's nodes a step over their six attention layers.
//!
//! Stages handed on as in src/kernels/moe_fused.rs (read its note): ticket
//! 0 the add + RMSNorm as the add + RMSNorm kernel's block runs it; each
//! later ticket one head, its rows of the projection walked as MLX's own
//! kernels walk a row (dense: `gemv_single`'s order; 4-bit: its `qmv`
//! arithmetic), each rounded to the dtype as the product is, then the
//! head's norm and RoPE as the q/k/v kernel computes them (the same device
//! text, `QKV_FUSED_SOURCE` there). The position is read from its `[1]`
//! int32 array (the compiled step's view into its position table). Tests in
//! src/kernels/tests.rs.

use super::stages::{self, Built};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::{Normed, Quantized};
use std::sync::OnceLock;

/// Warps a block by default: a head's rows spread over them (HD a multiple
/// of it).
const WARPS: i32 = 16;
/// The widest head served (8 rows a warp).
const MAX_HEAD: i32 = 128;

/// `MLX_LFM_QKV_WARPS=32` (opt-in, session 38, not yet run on a GPU): a
/// head's rows over 32 warps instead of 16 (blocks of 1,024 threads, 2 of a
/// 64-wide head's rows a warp instead of 4). The launch is one block a
/// head, 49 on the 8B-A1B, so most of the GPU's 132 SMs sit idle while
/// each block's warps walk their rows in turn: session 38's profile had
/// the stage at 14.4 µs a launch for ~3.6 MB (~0.25 TB/s), 86 µs of that
/// step. Each row is the same walk, so the same bits (its test holds it
/// to them). Read at each launch's build, so a process can time both.
fn warps() -> i32 {
    static SET: OnceLock<i32> = OnceLock::new();
    if super::forced("MLX_LFM_QKV_WARPS") {
        return 32;
    }
    crate::knobs::cached("MLX_LFM_QKV_WARPS", &SET, |v| if v.map(str::trim) == Some("32") { 32 } else { WARPS })
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_QKV_FUSED", &ON)
}

static BUILT: Built = Built::new();

/// How many times [`forward`] has put the kernel into a graph in this
/// process: the greedy test's evidence that its runs took this path.
pub fn built() -> usize {
    BUILT.get()
}

/// The stacked q/k/v projection `[(H + 2 KVH) HD, D]`, as the kernel reads it.
#[derive(Clone, Copy)]
pub enum Projection<'a> {
    Quant(&'a Quantized),
    Dense(&'a Array),
}

/// The kernel; with `scratch`, its form with the scratch row (`yn`) in
/// the layer's state ([`stages::call_with_scratch`]); under
/// `MLX_LFM_EARLY_PREFETCH=qkv`, its form that asks L2 for its head's rows
/// before its wait ([`stages::early_prefetch`], [`EARLY_SUBSTITUTIONS`]).
fn kernel(quant: bool, scratch: bool) -> Option<&'static CudaKernel> {
    static FORMS: stages::Forms = stages::Forms::new();
    let early = stages::early_prefetch("qkv");
    let mut inputs = vec!["h", "r", "wn"];
    inputs.extend(if quant { &["iw", "iscales", "ibiases"][..] } else { &["iw"][..] });
    inputs.extend(["qw", "kw", "offset", "ctr"]);
    // (The projection's rows as the first of a layer's two projections:
    // src/kernels/stages.rs's products and header.)
    let base = if quant { "lfm_qkv_fused" } else { "lfm_qkv_fused_dense" };
    let outputs = ["s", "qo", "ko", "vo", "yn"];
    let body = super::qk_norm_rope::QKV_FUSED_SOURCE;
    FORMS.kernel(base, (quant, scratch, early), body, &EARLY_SUBSTITUTIONS, SCRATCH_PRELUDE, &inputs, (&outputs, 4), || {
        stages::layer_header(quant, false, "")
    })
}

/// Where the early form asks for its head's rows: before its wait for the
/// norm (the head's `HD` rows are one run of the stacked projection).
pub(crate) const EARLY_SUBSTITUTIONS: [(&str, &str); 1] = [
    (
        "  const int hh = role - 1;\n  const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n",
        "  const int hh = role - 1;\n  LFM_EARLY_IN_BLOCK(D, static_cast<size_t>(hh) * HD, HD);\n  const bool late = lfm_block_wait(st + 1, launch + 1, nullptr, 0);\n",
    ),
];

/// The scratch row's pointer into the layer's state
/// (`MLX_LFM_SCRATCH_IN_STATE`, src/kernels/stages.rs), as the output of
/// that name was: the normed row.
const SCRATCH_PRELUDE: &str = r#"
  unsigned char* lfm_scratch = reinterpret_cast<unsigned char*>(const_cast<uint32_t*>(ctr));
  T* yn = reinterpret_cast<T*>(lfm_scratch + SCR_YN);
"#;

/// The uint32 words of an attention layer's state: its counters and room
/// for its scratch row (`d` wide, at up to 4 bytes).
pub fn state_words(d: usize) -> usize {
    stages::state_words(&[d as i64 * 4])
}

/// Whether the switch is on where our CUDA kernels run.
pub fn enabled_here() -> bool {
    enabled() && cuda_kernels_enabled()
}

/// Whether [`forward`] serves the pending norm `x` (one row, with a
/// residual to add), the stacked projection `p` (no bias), the heads'
/// norm weights `qw` / `kw` and `heads` (query heads, KV heads, head
/// width), with the position `offset` (`[1]` int32): on ([`enabled`]), on
/// CUDA, eps compiled in (`MLX_LFM_EPS_CONST`, the default), where the add +
/// RMSNorm kernel serves the row with a block no wider than this kernel's
/// and the q/k/v kernel's code serves the heads (the caller asks that
/// kernel's own switch, `qkv_wanted`, first).
pub fn available(x: &Normed, p: Projection, qw: &Array, kw: &Array, heads: (i32, i32, i32), offset: &Array) -> bool {
    let Some(r) = x.r else { return false };
    if !enabled_here() || !super::add_rms_norm::eps_const() || x.h.ndim() != 2 || x.h.dim(0) != 1 {
        return false;
    }
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let (qh, kvh, hd) = heads;
    let rows = (qh + 2 * kvh) as i64 * hd as i64;
    let product = match p {
        Projection::Quant(q) => {
            q.weight.ndim() == 2
                && super::quant_gemv::spec_served(q, dt, d)
                && q.weight.dim(0) as i64 == rows
                && q.weight.dim(1) as i64 * 32 / q.spec.bits as i64 == d as i64
                && q.scales.shape() == [q.weight.dim(0), d / q.spec.group_size]
        }
        Projection::Dense(w) => w.ndim() == 2 && w.dtype() == dt && w.dim(0) as i64 == rows && w.dim(1) == d && d % 8 == 0,
    };
    let warps = warps();
    // (The rows the 16-warp form serves, in either form: over 32 warps the
    // norm's block could take rows past them, where ptxas put f16 heads of
    // 128 at 80 registers, past the 64 that 1,024 threads allow.)
    super::add_rms_norm::available(x.h, r, x.w)
        && super::add_rms_norm::block_for(d, 16 / dt.size() as i32) <= WARPS * 32
        && product
        && hd > 0
        && hd % warps == 0
        // (By ptxas, dense rows of 3,072 and more with heads of 256 took
        // 164-168 registers a thread, past what 512 threads have; heads up
        // to 128 stay at or under 86.)
        && hd <= MAX_HEAD
        && qh > 0
        && kvh > 0
        // (The q/k/v kernel's own conditions on the heads and the norms.)
        && super::qk_norm_rope::qkv_served(dt, qw, kw, heads)
        && offset.dtype() == Dtype::Int32
        && offset.size() == 1
        && ((d as usize) * dt.size()).is_multiple_of(16)
        && (d as usize) * dt.size() <= stages::MAX_STAGED
        && kernel(matches!(p, Projection::Quant(_)), false).is_some()
}

/// `(the residual sum [1, D], q [1, H, 1, HD], k [1, KVH, 1, HD], v [1,
/// KVH, 1, HD])` in one launch, as the q/k/v kernel lays them out (callers
/// check [`available`]); `eps` the heads' norm's, `theta` RoPE's base,
/// `ctr` the layer's own (`stages::new_counters`).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    x: &Normed,
    p: Projection,
    qw: &Array,
    kw: &Array,
    heads: (i32, i32, i32),
    offset: &Array,
    (eps, theta): (f32, f32),
    ctr: &Array,
) -> Result<(Array, Array, Array, Array)> {
    let quant = matches!(p, Projection::Quant(_));
    let kern = kernel(quant, false).ok_or_else(|| Error::mlx("the fused q/k/v kernel is not available"))?;
    let r = x.r.ok_or_else(|| Error::invalid("the fused q/k/v kernel needs a residual to add"))?;
    stages::check_state(ctr, "the fused q/k/v kernel")?;
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let (qh, kvh, hd) = heads;
    let nb = 1 + qh as i64 + 2 * kvh as i64;
    let warps = warps();
    let threads = warps * 32;
    let grid = i32::try_from(nb * threads as i64).map_err(|_| Error::invalid(format!("fused q/k/v kernel: {nb} blocks")))?;
    let mut template = vec![
        ("T", TemplateArg::Dtype(dt)),
        ("D", TemplateArg::Int(d)),
        ("HD", TemplateArg::Int(hd)),
        ("QH", TemplateArg::Int(qh)),
        ("KVH", TemplateArg::Int(kvh)),
        ("NBLK", TemplateArg::Int(super::add_rms_norm::block_for(d, 16 / dt.size() as i32))),
        ("WARPS", TemplateArg::Int(warps)),
        ("EPS_NORM_BITS", TemplateArg::Int(x.eps.to_bits() as i32)),
        ("EPS_BITS", TemplateArg::Int(eps.to_bits() as i32)),
        // (As the q/k/v kernel takes it: log2 of the base, the host's.)
        ("BASE_BITS", TemplateArg::Int(theta.log2().to_bits() as i32)),
    ];
    let inputs: Vec<&Array> = match p {
        Projection::Quant(q) => {
            template.extend([("IBITS", TemplateArg::Int(q.spec.bits)), ("IGS", TemplateArg::Int(q.spec.group_size))]);
            let b = q.biases.as_ref().ok_or_else(|| Error::invalid("the fused q/k/v kernel needs affine biases"))?;
            vec![x.h, r, x.w, &q.weight, &q.scales, b, qw, kw, offset, ctr]
        }
        Projection::Dense(w) => vec![x.h, r, x.w, w, qw, kw, offset, ctr],
    };
    let mut outs = stages::call_with_scratch(
        kern,
        || kernel(quant, true),
        &inputs,
        &[(&[1, d], dt), (&[1, qh, 1, hd], dt), (&[1, kvh, 1, hd], dt), (&[1, kvh, 1, hd], dt), (&[d], dt)],
        &["SCR_YN"],
        ctr,
        [grid, 1, 1],
        [threads, 1, 1],
        &template,
    )?;
    BUILT.bump();
    let missing = || Error::mlx("fused q/k/v kernel: missing output");
    let v = outs.pop().ok_or_else(missing)?;
    let k = outs.pop().ok_or_else(missing)?;
    let q = outs.pop().ok_or_else(missing)?;
    let s = outs.pop().ok_or_else(missing)?;
    Ok((s, q, k, v))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The early form's prefetch finds its place in the body, once.
    #[test]
    fn the_early_prefetch_finds_its_place() {
        let body = super::super::qk_norm_rope::QKV_FUSED_SOURCE;
        assert_eq!(body.matches(EARLY_SUBSTITUTIONS[0].0).count(), 1);
        assert!(super::super::substituted(body, &EARLY_SUBSTITUTIONS).contains("LFM_EARLY_IN_BLOCK(D,"));
    }
}
