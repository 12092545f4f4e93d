//! A lone sequence's feed-forward in one launch (a CUDA default since
//! session 31, `MLX_LFM_FFN_FUSED=0` off: its H200 test and greedy sets
//! passed in sessions 30-31, and the one-launch layers together read decode
//! 1.12x / 1.00x / 1.15x on the 350M / 1.2B / 8B-A1B in session 31's paired
//! A/B, on an H100): the residual add + RMSNorm before it, the stacked
//! w1/w3 with the SwiGLU gate, and w2, dense (the 350M's and the 1.2B's) or
//! 4/8-bit (the 8B-A1B's two dense layers); otherwise two to four launches
//! (the add + RMSNorm kernel or its fold into the SwiGLU GEMV, the SwiGLU
//! GEMV, MLX's GEMV of w2; quantized: MLX's `qmv` of w1/w3, the gate, `qmv`
//! of w2): 32 of the 1.2B's 138 nodes a step over its 16 layers, 16 of the
//! 350M's.
//!
//! Stages handed on as in src/kernels/moe_fused.rs (read its note: a
//! block's ticket from the layer's counters gives its part and its launch,
//! a block waits only on smaller tickets, a wait past its bound poisons
//! the output instead of hanging, and a layer's launches must be ordered
//! by data): ticket 0 the add + RMSNorm as the add + RMSNorm kernel's block
//! runs it (its bits); the next tickets a warp an output of the gate, its
//! w1 and w3 rows walked together, the gate rounded as MLX's ops round it
//! (`lfm_swiglu`); the last tickets a warp an output of w2, once every gate
//! output is done. The rows are walked as src/kernels/stages.rs's products
//! walk them: dense in MLX's `gemv_single` order (as the SwiGLU GEMV, src/kernels/gemv.rs
//! `lfm_gemv_swiglu_warp`, and MLX's one-row GEMV: its bits where MLX
//! takes its GEMV, gates a multiple of 32 wide: every model's), quantized
//! in MLX's `qmv` arithmetic (its bits). So the output is the stock path's
//! bits where it runs the add + RMSNorm kernel (the 1.2B's rows) and, by
//! the same sums grouped alike, where it folds the norm into the SwiGLU
//! GEMV (the 350M's); the test holds the sum to the bits and the output
//! within two roundings. With 16 warps a block, the 350M's w2 stage is 64
//! blocks (MLX's GEMV spreads it over 128): what its A/B will show. Tests
//! in src/kernels/tests.rs.

use super::stages::{self, Built};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::Normed;
pub use super::stages::Projections;
use std::sync::OnceLock;

// Template constants: T, D (the row), F (the gate's width), NBLK (the add +
// RMSNorm kernel's block for this row), WARPS, EPS_BITS, and quantized,
// IBITS / IGS and OBITS / OGS (w1/w3's and w2's specifications). `ctr`:
// the layer's counters (tickets, the norm's launch mark, gate blocks
// done; in rounds, a count a round); `iw`..: the projections as src/kernels/stages.rs's products name
// them (w1/w3 stacked, then w2). The body: the feed-forward part of
// src/kernels/stages.rs's `LAYER_SOURCE`.

/// Warps a block: 16, as the conv layer's (src/kernels/conv_fused.rs).
const WARPS: i32 = 16;
/// The widest row and gate served (by ptxas on sm_90 the kernel stays
/// within 64 registers a thread: `scripts/dev/nvrtc-check.py`).
const MAX_WIDTH: i32 = 16_384;

/// `MLX_LFM_FFN_GATE_ROWS=2` (opt-in, session 42; its test passed on an
/// H100 in session 43, which timed it no faster: decode 1.014x on the
/// 1.2B, its gate done later and w2 still 17-18 µs after it):
/// each gate warp two outputs, `j` and `j + GB * WARPS`, their w1 and w3
/// rows walked together (four rows a warp), so the gate takes half the
/// blocks. Session 42's chained timelines (an H100) had the 1.2B's launch
/// at 42.4 µs for 101 MB: the gate (67 MB) done at 26.0 µs, w2 (33.5 MB)
/// 16.4 µs after it at ~2.0 TB/s, and the last w2 block starting at 25.0 µs.
/// NVRTC 13 and ptxas for sm_90 put the bf16 kernel at 32 registers a
/// thread (either form), so an SM holds 4 blocks of 512 threads, an H100
/// 528: of the default's 641, 113 of w2's start only as the gate's blocks
/// leave; the two-outputs form's 385 are all resident from the start, and
/// under `MLX_LFM_EARLY_PREFETCH=ffn` w2's rows can be asked for while the
/// gate runs. Each row is the same walk, so the same bits (its test holds
/// it to them). Read once a process (a test's or bench's override aside):
/// a launch's tickets count its blocks, so the launches on one layer's
/// state keep one form.
fn gate_outs() -> i32 {
    static SET: OnceLock<i32> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_FFN_GATE_ROWS", &SET, |v| if v.map(str::trim) == Some("2") { 2 } else { 1 })
}

/// `MLX_LFM_FFN_GATE_ROUNDS` (a CUDA default in two rounds since session
/// 44, `=0` off; `=1` or `=2` two rounds, `=3` and `=4` that many; dense
/// rows only; it takes the place of [`gate_outs`]'s form where it
/// serves; written in session 43): each gate warp makes its
/// outputs one after the other, its block counting each round's output
/// (the gated row's first `GB * WARPS`, then the next) done before it
/// walks the next one's rows, and w2's blocks walk each round's part of
/// their rows as soon as every gate block has done that round (the gain
/// wants w2's blocks resident beside the gate's: 1 + GB + D / 16 blocks,
/// 385 on the 1.2B in two rounds, 257 in four; progress does not, a
/// block waiting only on smaller tickets). So w2's reads run beside the gate's instead
/// of after them (session 42's chained timelines, an H100: the 1.2B's w2
/// done 16.4 µs after its gate). Each row is the same walk, its lanes'
/// columns in the same order (`lfm_drow_round`), so the same bits; a
/// counter a round (`ctr`'s third word pair on, within
/// [`stages::COUNTERS`]). Session 43 (an H100): two rounds, the 1.2B's
/// launch 38.5 µs against 41.9, decode 1.043-1.048x. Session 44 (an H100):
/// its test (each launch after one over another input, on the 1.2B's and
/// the 350M's gates) and greedy sets passed; two rounds read decode
/// 1.052-1.056x on the 1.2B and 1.038-1.050x on the 350M in five and three
/// reps of its A/B, four rounds 1.007-1.011x and 0.995-1.005x (the gate's
/// blocks a quarter of the default's: its walk slower than the overlap
/// gains). Served where every round's part is whole steps of a warp's walk
/// (128 columns); elsewhere (the 4-bit rows, gates of other widths) the
/// form before it. By default on bf16 rows only, the dtype its tests and
/// A/B ran on (float16 and float32 where the switch is set). An unknown
/// value is the default's, not off. `(rounds, whether the switch is set)`.
fn rounds() -> (i32, bool) {
    static SET: OnceLock<(i32, bool)> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_FFN_GATE_ROUNDS", &SET, |v| match v.map(str::trim) {
        None | Some("") => (2, false),
        Some("0") => (0, true),
        Some("3") => (3, true),
        Some("4") => (4, true),
        Some(_) => (2, true),
    })
}

/// Whether `g` rounds serve a gate `f` wide: each round's part (`GB *
/// WARPS` outputs, the last what is left) whole steps of the walk, and
/// every round some.
pub(crate) fn rounds_serve(f: i32, g: i32) -> bool {
    let part = gate_blocks(f, g) * WARPS as i64;
    g >= 2 && f % 128 == 0 && part % 128 == 0 && part * (g as i64 - 1) < f as i64
}

/// The form a launch takes: 0 one gate output a warp, 1 two ([`gate_outs`]),
/// 2 to 4 that many in rounds ([`rounds`], where they serve `f` dense).
fn form(quant: bool, f: i32, dt: Dtype) -> usize {
    let (g, asked) = rounds();
    if g > 0 && !quant && rounds_serve(f, g) && (asked || dt == Dtype::Bfloat16) {
        return g as usize;
    }
    usize::from(gate_outs() == 2)
}

/// A [`form`]'s gate outputs a warp: its `LFM_GATE_OUTS` (the grid's
/// blocks follow from it, and must be the kernel's `NB`: a grid of other
/// blocks shifts every later launch's tickets on the same state).
fn outs_of(form: usize) -> i32 {
    match form {
        0 => 1,
        1 => 2,
        g => g as i32,
    }
}

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_FFN_FUSED", &ON)
}

static BUILT: Built = Built::new();
static BUILT_ROUNDS: [Built; 5] = [const { Built::new() }; 5];

/// How many of [`built`]'s launches took the form of `g` rounds
/// ([`rounds`], 2 to 4): the tests' evidence that their runs did.
pub fn built_rounds(g: usize) -> usize {
    BUILT_ROUNDS.get(g).map_or(0, Built::get)
}

/// How many times [`forward`] has put the kernel into a graph in this
/// process: the greedy test's evidence that its runs took this path.
pub fn built() -> usize {
    BUILT.get()
}

static EVERY_BUILT: Built = Built::new();
static WAIT_BUILT: Built = Built::new();

/// How many of [`built`]'s graphs took the every-norm form
/// ([`every_norm`]): the tests' evidence.
pub fn every_norm_built() -> usize {
    EVERY_BUILT.get()
}

/// How many of [`built`]'s graphs took the waiting form (every-norm off):
/// the tests' evidence that `=0` reached the kernel.
pub fn waiting_built() -> usize {
    WAIT_BUILT.get()
}

/// `MLX_LFM_FFN_EVERY_NORM` (written in session 48; a CUDA default since
/// session 50, `=0` off: its test cases passed on an H100 in session 50
/// with the whole test, its greedy sets on all four fixtures in session
/// 49; with the q/k/v stage's and the conv's forms, decode 1.035x on the
/// 1.2B and 1.066x on the 350M in session 50's A/B): the gate's blocks each
/// compute the feed-forward's add + RMSNorm
/// ([`stages::FFN_EVERY_NORM_SUBSTITUTION`]) instead of waiting for the
/// first block's mark and reading its row back, as the q/k/v stage's
/// every-norm form does (`MLX_LFM_QKV_EVERY_NORM`: the 1.2B's decode
/// 1.014-1.021x over its six attention layers in session 48's A/B on an
/// H100; the feed-forward runs in all 16): the same code on the same
/// values, so the same bits; each gate block reads the row's three vectors
/// (12 KB at 2,048 wide) from L2, ~2-3 MB a launch in all. Every form
/// ([`form`]'s); no early form (its text asks for the gate's rows before
/// the wait this one has not); the bench's timeline form stays the waiting
/// one.
fn every_norm() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_FFN_EVERY_NORM", &ON)
}

/// The kernel; with `scratch`, its form with the scratch rows (`yn`,
/// `hk`) in the layer's state ([`stages::call_with_scratch`]).
fn kernel(quant: bool, scratch: bool, form: usize) -> Option<&'static CudaKernel> {
    static FORMS: [stages::Forms; 5] = [const { stages::Forms::new() }; 5];
    static EVERY_FORMS: [stages::Forms; 5] = [const { stages::Forms::new() }; 5];
    static EVERY_TEXT: OnceLock<String> = OnceLock::new();
    let every = every_norm();
    // (MLX_LFM_EARLY_PREFETCH=ffn: its form that asks for its rows before
    // its waits, stages::early_prefetch.)
    let early = !every && stages::early_prefetch("ffn");
    let mut inputs = vec!["h", "r", "wn"];
    inputs.extend(Projections::input_names(quant));
    inputs.push("ctr");
    let outputs = ["s", "out", "yn", "hk"];
    let header = || {
        let head = stages::layer_header(quant, false, stages::layer_defines(false, stages::Tail::Ffn));
        format!("{}{head}{}", gate_define(form), form_code(form))
    };
    if every {
        let body = EVERY_TEXT.get_or_init(|| super::substituted(stages::LAYER_SOURCE, &[stages::FFN_EVERY_NORM_SUBSTITUTION]));
        const NAMES: [[&str; 5]; 2] = [
            ["lfm_ffn_fused_en", "lfm_ffn_fused_g2_en", "lfm_ffn_fused_r2_en", "lfm_ffn_fused_r3_en", "lfm_ffn_fused_r4_en"],
            ["lfm_ffn_fused_q_en", "lfm_ffn_fused_q_g2_en", "lfm_ffn_fused_q_r2_en", "lfm_ffn_fused_q_r3_en", "lfm_ffn_fused_q_r4_en"],
        ];
        let base = NAMES[usize::from(quant)][form];
        return EVERY_FORMS[form].kernel(base, (quant, scratch, false), body, &[], SCRATCH_PRELUDE, &inputs, (&outputs, 2), header);
    }
    FORMS[form].kernel(
        base_name(quant, form),
        (quant, scratch, early),
        stages::LAYER_SOURCE,
        &stages::EARLY_SUBSTITUTIONS,
        SCRATCH_PRELUDE,
        &inputs,
        (&outputs, 2),
        header,
    )
}

/// A form's kernel name: `lfm_ffn_fused`, then `_q` (4-bit), then `_g2`
/// ([`gate_outs`]'s two outputs a warp) or `_r2`.. (in rounds).
fn base_name(quant: bool, form: usize) -> &'static str {
    const NAMES: [[&str; 5]; 2] = [
        ["lfm_ffn_fused", "lfm_ffn_fused_g2", "lfm_ffn_fused_r2", "lfm_ffn_fused_r3", "lfm_ffn_fused_r4"],
        ["lfm_ffn_fused_q", "lfm_ffn_fused_q_g2", "lfm_ffn_fused_q_r2", "lfm_ffn_fused_q_r3", "lfm_ffn_fused_q_r4"],
    ];
    NAMES[usize::from(quant)][form]
}

/// The defines of a [`form`] (none for the default's, whose text is as
/// before), before the layer's header.
fn gate_define(form: usize) -> String {
    match form {
        0 => String::new(),
        1 => format!("#define LFM_GATE_OUTS {}\n", outs_of(1)),
        g => format!("#define LFM_GATE_OUTS {}\n#define LFM_GATE_ROUNDS {g}\n", outs_of(g)),
    }
}

/// A [`form`]'s code after the layer's header (the rounds' w2 walk, on
/// the dense walk's helpers).
fn form_code(form: usize) -> &'static str {
    if form >= 2 {
        stages::ROUNDS_HEADER
    } else {
        ""
    }
}

/// The scratch rows' pointers into the layer's state
/// (`MLX_LFM_SCRATCH_IN_STATE`, src/kernels/stages.rs), as the outputs of
/// those names were: the normed row and the gated rows.
const SCRATCH_PRELUDE: &str = r#"
  unsigned char* lfm_scratch = reinterpret_cast<unsigned char*>(const_cast<uint32_t*>(ctr));
  T* yn = reinterpret_cast<T*>(lfm_scratch + SCR_YN);
  T* hk = reinterpret_cast<T*>(lfm_scratch + SCR_HK);
"#;

/// The uint32 words of a feed-forward's state: its counters and room for
/// its scratch rows (`d` wide and `f` gated, at up to 4 bytes each).
pub fn state_words(d: usize, f: usize) -> usize {
    stages::state_words(&[d as i64 * 4, f as i64 * 4])
}

/// The blocks of one launch: the norm's, the gate's (`gate` outputs a
/// warp), w2's.
fn blocks(d: i32, f: i32, gate: i32) -> i64 {
    let w = WARPS as i64;
    1 + gate_blocks(f, gate) + (d as i64 + w - 1) / w
}

/// The gate's blocks, `gate` outputs a warp.
fn gate_blocks(f: i32, gate: i32) -> i64 {
    let w = WARPS as i64 * gate as i64;
    (f as i64 + w - 1) / w
}

/// Whether [`forward`] serves the pending norm `x` (one row, with a
/// residual to add) and the projections `p`: w1/w3 stacked (`[2F, D]`) and
/// w2 (`[D, F]`), no biases, dense in the activations' dtype or quantized
/// as the MLX walk serves (src/kernels/stages.rs): on ([`enabled`]), on
/// CUDA, with eps compiled in (`MLX_LFM_EPS_CONST`, the default), where the
/// add + RMSNorm kernel serves the row with a block no wider than this
/// kernel's, and the staged rows within shared memory.
pub fn available(x: &Normed, p: Projections) -> bool {
    let Some(r) = x.r else { return false };
    if !enabled() || !cuda_kernels_enabled() || !super::add_rms_norm::eps_const() || x.h.ndim() != 2 || x.h.dim(0) != 1 {
        return false;
    }
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let rows = p.first_rows();
    let f = rows / 2;
    let bytes = |len: i32| len as usize * dt.size();
    super::add_rms_norm::available(x.h, r, x.w)
        && super::add_rms_norm::block_for(d, 16 / dt.size() as i32) <= WARPS * 32
        && rows % 2 == 0
        && f > 0
        && p.served(dt, 2 * f, d, f)
        && d <= MAX_WIDTH
        && f <= MAX_WIDTH
        && bytes(d) % 16 == 0
        && bytes(f) % 16 == 0
        && bytes(d).max(bytes(f)) <= stages::MAX_STAGED
        && kernel(p.quant(), false, form(p.quant(), f, dt)).is_some()
}

/// `(the residual sum [1, D], w2's output [1, D] (before a tensor parallel
/// reduce))` in one launch (callers check [`available`]); `ctr` the
/// layer's own (`stages::new_counters`).
pub fn forward(x: &Normed, p: Projections, ctr: &Array) -> Result<(Array, Array)> {
    let mut outs = launch(x, p, ctr, false)?;
    let missing = || Error::mlx("fused feed-forward kernel: missing output");
    let out = outs.pop().ok_or_else(missing)?;
    let s = outs.pop().ok_or_else(missing)?;
    Ok((s, out))
}

/// [`forward`]'s output through the kernel's timeline form (the bench's:
/// `stages::TIMELINE_HEADER`), with its stamps `[NB * 4]` int64 and the
/// parts' bounds: the gate's blocks are parts `1..=gate`, w2's
/// `gate + 1..nb`.
#[doc(hidden)]
pub fn forward_timeline(x: &Normed, p: Projections, ctr: &Array) -> Result<(Array, Array, usize, usize)> {
    let mut outs = launch(x, p, ctr, true)?;
    let missing = || Error::mlx("fused feed-forward kernel: missing output");
    let times = outs.pop().ok_or_else(missing)?;
    let (d, f) = (x.h.dim(1), p.first_rows() / 2);
    let g = outs_of(form(p.quant(), f, x.h.dtype()));
    Ok((outs.swap_remove(1), times, gate_blocks(f, g) as usize, blocks(d, f, g) as usize))
}

/// The kernel's timeline form (outputs as [`kernel`]'s, then `times`).
fn timeline_kernel(quant: bool, form: usize) -> Option<&'static CudaKernel> {
    // (By rows asked for early, the form, 4-bit.)
    static K: [[[stages::Cells; 2]; 5]; 2] = [const { [const { [stages::cells(), stages::cells()] }; 5] }; 2];
    let early = stages::early_prefetch("ffn");
    let source = stages::stamped_layer_source(early);
    let mut inputs = vec!["h", "r", "wn"];
    inputs.extend(Projections::input_names(quant));
    inputs.push("ctr");
    let outputs = ["s", "out", "yn", "hk", "times"];
    let name = format!("{}_timeline{}", base_name(quant, form), if early { "_early" } else { "" });
    stages::kernel(&K[usize::from(early)][form][usize::from(quant)], &name, &inputs, &outputs, source, || {
        let head = stages::layer_header(quant, false, stages::layer_defines(false, stages::Tail::Ffn));
        let early = if early { stages::early_header(quant) } else { String::new() };
        format!("{}{early}{}{head}{}", stages::TIMELINE_HEADER, gate_define(form), form_code(form))
    })
}

/// The launch: `[s, out]`, or (`timeline`) every output of the timeline
/// form, its stamps last.
fn launch(x: &Normed, p: Projections, ctr: &Array, timeline: bool) -> Result<Vec<Array>> {
    let f = p.first_rows() / 2;
    let form = form(p.quant(), f, x.h.dtype());
    let gate = outs_of(form);
    let kern = if timeline { timeline_kernel(p.quant(), form) } else { kernel(p.quant(), false, form) };
    let kern = kern.ok_or_else(|| Error::mlx("the fused feed-forward kernel is not available"))?;
    let r = x.r.ok_or_else(|| Error::invalid("the fused feed-forward kernel needs a residual to add"))?;
    stages::check_state(ctr, "the fused feed-forward kernel")?;
    // (A round's count each: word pairs 2 to 1 + rounds, within
    // stages::COUNTERS, which check_state holds every state to.)
    debug_assert!(2 * (2 + gate as usize) <= stages::COUNTERS);
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let nb = blocks(d, f, gate);
    let threads = WARPS * 32;
    let grid = i32::try_from(nb * threads as i64).map_err(|_| Error::invalid(format!("fused feed-forward kernel: {nb} blocks")))?;
    let mut template = vec![
        ("T", TemplateArg::Dtype(dt)),
        ("D", TemplateArg::Int(d)),
        ("F", TemplateArg::Int(f)),
        ("NBLK", TemplateArg::Int(super::add_rms_norm::block_for(d, 16 / dt.size() as i32))),
        ("WARPS", TemplateArg::Int(WARPS)),
        ("EPS_BITS", TemplateArg::Int(x.eps.to_bits() as i32)),
    ];
    let (projections, spec) = p.inputs()?;
    template.extend(spec);
    let mut inputs = vec![x.h, r, x.w];
    inputs.extend(projections);
    inputs.push(ctr);
    let outputs: [(&[i32], Dtype); 4] = [(&[1, d], dt), (&[1, d], dt), (&[d], dt), (&[f], dt)];
    if timeline {
        return stages::call_stamped(kern, &inputs, &outputs, nb, [grid, 1, 1], [threads, 1, 1], &template, "fused feed-forward kernel");
    }
    let outs = stages::call_with_scratch(
        kern,
        || kernel(p.quant(), true, form),
        &inputs,
        &outputs,
        &["SCR_YN", "SCR_HK"],
        ctr,
        [grid, 1, 1],
        [threads, 1, 1],
        &template,
    )?;
    BUILT.bump();
    if form >= 2 {
        BUILT_ROUNDS[form].bump();
    }
    if every_norm() {
        EVERY_BUILT.bump();
    } else {
        WAIT_BUILT.bump();
    }
    Ok(outs)
}

#[cfg(test)]
pub(crate) fn launch_blocks(d: i32, f: i32, gate: i32) -> i64 {
    blocks(d, f, gate)
}

/// Whether a launch over a gate `f` wide takes a rounds form as the
/// switches stand (a timeline's w2 waits then end after the first round).
#[cfg(test)]
pub(crate) fn in_rounds(quant: bool, f: i32, dt: Dtype) -> bool {
    form(quant, f, dt) >= 2
}

#[cfg(test)]
mod tests {
    /// Rounds serve a gate only where every round's part is whole steps
    /// of the walk (128 columns) and every round has some: the 1.2B's
    /// 8,192 in two and four, the 350M's 4,608 in two, three and four.
    #[test]
    fn rounds_serve_whole_steps_only() {
        for (f, g, served) in [
            (8192, 2, true),
            (8192, 3, false),
            (8192, 4, true),
            (4608, 2, true),
            (4608, 3, true),
            (4608, 4, true),
            (2048, 4, true),
            (192, 2, false),
            (128, 2, false),
            (8320, 2, false),
        ] {
            assert_eq!(super::rounds_serve(f, g), served, "a gate {f} wide in {g} rounds");
        }
    }

    /// Two rounds by default on bf16 dense gates they serve (session 44);
    /// float16 and float32 only where the switch asks; never 4-bit rows;
    /// `=0` off, `=3`/`=4` that many where they serve.
    #[test]
    fn rounds_by_default_on_bf16_dense_gates() {
        use crate::mlx::Dtype::{Bfloat16, Float16, Float32};
        let with = |v: Option<&str>, f: &dyn Fn() -> usize| {
            let set = [
                ("MLX_LFM_FFN_GATE_ROUNDS".to_string(), v.map(str::to_string)),
                ("MLX_LFM_FFN_GATE_ROWS".to_string(), Some("1".to_string())),
            ];
            crate::knobs::with_overrides(&set, f)
        };
        assert_eq!(with(None, &|| super::form(false, 8192, Bfloat16)), 2);
        assert_eq!(with(None, &|| super::form(false, 4608, Bfloat16)), 2);
        assert_eq!(with(None, &|| super::form(false, 8192, Float16)), 0);
        assert_eq!(with(None, &|| super::form(true, 8192, Bfloat16)), 0);
        assert_eq!(with(None, &|| super::form(false, 192, Bfloat16)), 0);
        assert_eq!(with(Some("0"), &|| super::form(false, 8192, Bfloat16)), 0);
        assert_eq!(with(Some("1"), &|| super::form(false, 8192, Float32)), 2);
        assert_eq!(with(Some("4"), &|| super::form(false, 8192, Float16)), 4);
        assert_eq!(with(Some("3"), &|| super::form(false, 8192, Bfloat16)), 0);
        assert_eq!(with(Some("3"), &|| super::form(false, 4608, Bfloat16)), 3);
        assert_eq!(with(Some(""), &|| super::form(false, 8192, Float16)), 0);
    }

    /// Each form's grid counts the gate outputs its kernel text makes a
    /// warp (session 44: the two-outputs form's grid counted one, so its
    /// launches after the first on a state took each other's tickets).
    #[test]
    fn grid_counts_the_kernels_gate_outputs() {
        for (form, outs) in [(0, 1), (1, 2), (2, 2), (3, 3), (4, 4)] {
            assert_eq!(super::outs_of(form), outs, "form {form}");
            let text = super::gate_define(form);
            let defined = text
                .lines()
                .find_map(|l| l.strip_prefix("#define LFM_GATE_OUTS "))
                .map_or(1, |v| v.trim().parse::<i32>().unwrap());
            assert_eq!(defined, outs, "form {form}: {text:?}");
            let w = 16 * outs as i64;
            assert_eq!(super::blocks(2048, 8192, outs), 1 + (8192 + w - 1) / w + 128, "form {form}");
        }
    }
}
