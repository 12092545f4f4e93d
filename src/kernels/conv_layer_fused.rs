//! A lone sequence's whole short-conv decoder layer in one launch
//! (`MLX_LFM_CONV_LAYER_FUSED=1`, opt-in until its H200 test and A/B): the
//! conv layer as src/kernels/conv_fused.rs runs it, then its dense or
//! 4/8-bit feed-forward as src/kernels/ffn_fused.rs runs it, or its MoE as
//! src/kernels/moe_fused.rs runs it, where those are two launches (and the
//! stock path six to eight): the 1.2B's and the 350M's ten conv layers
//! after their first, the 8B-A1B's seventeen (one with a dense
//! feed-forward, sixteen with a MoE). Under the same switch an attention
//! layer's out_proj joins the feed-forward or MoE after it
//! ([`forward_out`]: the conv part's out_proj stage alone, over the heads'
//! row an earlier launch wrote): the six attention layers of each model.
//!
//! Six stages on the ticket scheme of src/kernels/moe_fused.rs (read its
//! note: a block's ticket gives its part and its launch, a block waits
//! only on smaller tickets, a wait past its bound poisons instead of
//! hanging, a layer's launches are ordered by data): the operator's add +
//! RMSNorm; in_proj and the conv step a channel a warp; out_proj an output
//! a warp, into a row the next stage reads; the feed-forward's add +
//! RMSNorm of that row and the residual, once every out_proj block is
//! done; the gate a warp an output; w2 a warp an output (with a MoE: its
//! add + RMSNorm and route, the chosen experts' gate/up rows, the down
//! columns, in blocks of the MoE kernel's 32 warps). The kernels compile
//! one text (src/kernels/stages.rs `LAYER_SOURCE`, its parts chosen by
//! defines), so each stage is the same code in each (the second norm reads
//! its two rows staged at L2 into shared memory, the values the other
//! kernel reads from global memory) and the outputs are the two kernels'
//! within NVVM's contraction choices: the test holds the conv's sum to the
//! bit and the rest within two roundings. Tests in src/kernels/tests.rs.

use super::stages::{self, Built, Cells, Projections};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::Array;
use crate::model::linear::{Normed, Quantized};
use std::sync::OnceLock;

// Template constants: T, D (the row), C (the conv's channels), KEEP (the
// state's positions), F (the gate's width), NBLK (the add + RMSNorm
// kernel's block for this row), WARPS, EPS_BITS; quantized, IBITS / IGS,
// OBITS / OGS, FBITS / FGS, GBITS / GGS (in_proj, out_proj, w1/w3, w2).
// `ctr`: the layer's counters (tickets; the first norm's mark; channel
// blocks done; out_proj blocks done; the second norm's mark; gate blocks
// done). The body: both parts of src/kernels/stages.rs's `LAYER_SOURCE`.

/// The feed-forward's products, beside the conv's (`LFM_IN_ROWS` /
/// `LFM_OUT_ROWS` of src/kernels/stages.rs): the same helpers over its
/// own projections (`fw`.. w1/w3 stacked, `gw`.. w2).
const QUANT_FFN_ROWS: &str = r#"
#define LFM_F_ROWS(K, R, rows, xs, lane, out) \
  lfm_stage_qrows<T, K, FBITS, FGS, R>(xs, fw, fscales, fbiases, rows, lane, out)
#define LFM_G_ROWS(K, R, rows, xs, lane, out) \
  lfm_stage_qrows<T, K, GBITS, GGS, R>(xs, gw, gscales, gbiases, rows, lane, out)
"#;
const DENSE_FFN_ROWS: &str = r#"
#define LFM_F_ROWS(K, R, rows, xs, lane, out) lfm_stage_drows<T, K, R>(xs, fw, rows, lane, out)
#define LFM_G_ROWS(K, R, rows, xs, lane, out) lfm_stage_drows<T, K, R>(xs, gw, rows, lane, out)
"#;

/// The feed-forward's products for a joined kernel.
fn ffn_rows(quant: bool) -> &'static str {
    if quant {
        QUANT_FFN_ROWS
    } else {
        DENSE_FFN_ROWS
    }
}

/// Warps a block, as the two one-launch kernels'.
const WARPS: i32 = 16;
/// The widest row, conv and gate served (the two kernels' own limits).
const MAX_WIDTH: i32 = 8192;
/// Counters: six 64-bit ones (twelve uint32 words, kept at 16).
pub const COUNTER_WORDS: usize = 16;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_in("MLX_LFM_CONV_LAYER_FUSED", &ON)
}

/// Whether the switch is on where our CUDA kernels run (what a layer asks
/// before it takes the conv state early).
pub fn enabled_here() -> bool {
    enabled() && cuda_kernels_enabled()
}

static BUILT: Built = Built::new();

/// How many times [`forward`] has put the kernel into a graph in this
/// process: the greedy test's evidence that its runs took this path.
pub fn built() -> usize {
    BUILT.get()
}

/// The conv + feed-forward kernel's operands' names (inputs, outputs).
fn layer_names(quant: bool) -> (Vec<&'static str>, Vec<&'static str>) {
    let ffn: &[&str] = if quant { &["fw", "fscales", "fbiases", "gw", "gscales", "gbiases"] } else { &["fw", "gw"] };
    let mut inputs = vec!["h", "r", "wn", "state", "cw"];
    inputs.extend(Projections::input_names(quant));
    inputs.push("fwn");
    inputs.extend(ffn);
    inputs.push("ctr");
    (inputs, vec!["s", "out", "next", "s1", "yn", "yc", "o1", "yn2", "hk"])
}

fn kernel(quant: bool) -> Option<&'static CudaKernel> {
    static K: [Cells; 2] = [stages::cells(), stages::cells()];
    let (inputs, outputs) = layer_names(quant);
    let name = if quant { "lfm_conv_layer_fused" } else { "lfm_conv_layer_fused_dense" };
    stages::kernel(&K[usize::from(quant)], name, &inputs, &outputs, stages::LAYER_SOURCE, || {
        stages::layer_header(quant, false, stages::layer_defines(true, stages::Tail::Ffn)) + ffn_rows(quant)
    })
}

/// The blocks of one launch: the first norm's, the channels', out_proj's,
/// the second norm's, the gate's, w2's.
fn blocks(d: i32, c: i32, f: i32) -> i64 {
    let w = WARPS as i64;
    let per = |n: i32| (n as i64 + w - 1) / w;
    1 + per(c) + per(d) + 1 + per(f) + per(d)
}

/// The layer's operands: the conv's pending norm `x` (one row, with a
/// residual to add), its projections, state (`[1, L - 1, C]`) and weights
/// (`[C, L]`), the feed-forward's norm weight and projections (w1/w3
/// stacked `[2F, D]`, w2 `[D, F]`), no biases.
pub struct ConvLayer<'a> {
    pub x: &'a Normed<'a>,
    pub conv: Projections<'a>,
    pub state: &'a Array,
    pub cw: &'a Array,
    pub ffn_norm: &'a Array,
    pub ffn: Projections<'a>,
}

/// Whether [`forward`] serves `l`: on ([`enabled`]), on CUDA, eps compiled
/// in (`MLX_LFM_EPS_CONST`, the default), both parts as the two one-launch
/// kernels serve them (src/kernels/conv_fused.rs and ffn_fused.rs), both
/// dense or both quantized, the staged rows within shared memory.
pub fn available(l: &ConvLayer, has_bias: bool) -> bool {
    let x = l.x;
    if !enabled_here() || l.conv.quant() != l.ffn.quant() || !super::conv_fused::part_served(x, l.conv, l.state, l.cw, has_bias, WARPS) {
        return false;
    }
    let (d, dt, c) = (x.h.dim(1), x.h.dtype(), l.cw.dim(0));
    let rows = l.ffn.first_rows();
    let f = rows / 2;
    let bytes = |len: i32| len as usize * dt.size();
    super::add_rms_norm::available(x.h, x.h, l.ffn_norm)
        && rows % 2 == 0
        && f > 0
        && l.ffn.served(dt, 2 * f, d, f)
        && f <= MAX_WIDTH
        && bytes(f) % 16 == 0
        && (3 * bytes(d)).max(bytes(c)).max(bytes(f)) <= stages::MAX_STAGED
        && kernel(l.conv.quant()).is_some()
}

/// The operands both joined kernels begin with (the conv kernel's, then
/// the second norm's weight) and their template constants (the conv
/// part's, blocks of `warps` warps), for `what`'s errors.
fn conv_part_operands<'a>(
    x: &Normed<'a>,
    conv: Projections<'a>,
    state: &'a Array,
    cw: &'a Array,
    ffn_norm: &'a Array,
    warps: i32,
    what: &str,
) -> Result<(Vec<&'a Array>, stages::Specs)> {
    let (mut inputs, template) = super::conv_fused::part_operands(x, conv, state, cw, warps, what)?;
    inputs.push(ffn_norm);
    Ok((inputs, template))
}

/// The launch's outputs: the residual sum after the conv (`s1`, what the
/// feed-forward's norm adds to), after the feed-forward's norm (`s2`),
/// the feed-forward's output and the conv state after the token.
pub struct Outputs {
    pub s1: Array,
    pub s2: Array,
    pub out: Array,
    pub next: Array,
}

impl Outputs {
    /// The first four of a launch's outputs (the rest are its stages'
    /// scratch), counted as a graph the kernel was put into.
    fn from(mut outs: Vec<Array>, what: &str) -> Result<Outputs> {
        outs.truncate(4);
        BUILT.bump();
        let missing = || Error::mlx(format!("{what}: missing output"));
        let s1 = outs.pop().ok_or_else(missing)?;
        let next = outs.pop().ok_or_else(missing)?;
        let out = outs.pop().ok_or_else(missing)?;
        let s2 = outs.pop().ok_or_else(missing)?;
        Ok(Outputs { s1, s2, out, next })
    }
}

/// An output's shape and dtype (None: the activations').
type OutputSpec = (Vec<i32>, Option<crate::mlx::Dtype>);

/// The outputs both joined kernels begin with: the second sum, the output,
/// the state after the token, the first sum, the first norm's row, the
/// conv's gated row, out_proj's row, the second norm's row.
fn conv_outputs(d: i32, c: i32, w: i32) -> Vec<OutputSpec> {
    let row = || (vec![1, d], None);
    vec![row(), row(), (vec![1, w - 1, c], None), row(), (vec![d], None), (vec![c], None), (vec![d], None), (vec![d], None)]
}

/// The launch of `grid` threads in blocks of `threads`.
fn call(
    kern: &CudaKernel,
    inputs: &[&Array],
    shapes: &[OutputSpec],
    dt: crate::mlx::Dtype,
    grid: i32,
    threads: i32,
    template: &[(&str, TemplateArg)],
) -> Result<Vec<Array>> {
    let outputs: Vec<(&[i32], crate::mlx::Dtype)> = shapes.iter().map(|(shape, t)| (shape.as_slice(), t.unwrap_or(dt))).collect();
    kern.call(inputs, &outputs, [grid, 1, 1], [threads, 1, 1], template)
}

/// The layer in one launch (callers check [`available`]); `ctr` the
/// layer's own ([`COUNTER_WORDS`] words, `stages::new_counters_of`).
pub fn forward(l: &ConvLayer, ctr: &Array) -> Result<Outputs> {
    const WHAT: &str = "the fused conv layer kernel";
    let x = l.x;
    let kern = kernel(l.conv.quant()).ok_or_else(|| Error::mlx(format!("{WHAT} is not available")))?;
    stages::check_counters_of(ctr, COUNTER_WORDS, WHAT)?;
    let (mut inputs, mut template) = conv_part_operands(x, l.conv, l.state, l.cw, l.ffn_norm, WARPS, WHAT)?;
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let (c, w) = (l.cw.dim(0), l.cw.dim(1));
    let f = l.ffn.first_rows() / 2;
    let nb = blocks(d, c, f);
    let threads = WARPS * 32;
    let grid = i32::try_from(nb * threads as i64).map_err(|_| Error::invalid(format!("fused conv layer kernel: {nb} blocks")))?;
    template.push(("F", TemplateArg::Int(f)));
    let (ffn, spec) = ffn_operands(l.ffn)?;
    template.extend(spec);
    inputs.extend(ffn);
    inputs.push(ctr);
    let mut shapes = conv_outputs(d, c, w);
    shapes.push((vec![f], None));
    let outs = call(kern, &inputs, &shapes, dt, grid, threads, &template)?;
    Outputs::from(outs, "fused conv layer kernel")
}

/// A conv layer's MoE (the 8B-A1B's conv layers past its dense ones): the
/// router's quantized gate and selection bias (`[E]` float32), the
/// stacked experts' gate/up and down, `k` experts a row, whether their
/// weights are normalised, the route's scale.
#[derive(Clone, Copy)]
pub struct Moe<'a> {
    pub gate: &'a Quantized,
    pub bias: &'a Array,
    pub gate_up: &'a Quantized,
    pub down: &'a Quantized,
    pub k: usize,
    pub norm: bool,
    pub scale: f32,
}

/// A conv layer with its MoE: the conv part as [`ConvLayer`]'s, the MoE's
/// norm weight and experts.
pub struct ConvMoeLayer<'a> {
    pub x: &'a Normed<'a>,
    pub conv: Projections<'a>,
    pub state: &'a Array,
    pub cw: &'a Array,
    pub ffn_norm: &'a Array,
    pub moe: Moe<'a>,
}

/// The conv + MoE kernel's operands' names (inputs, outputs).
fn moe_names(quant: bool) -> (Vec<&'static str>, Vec<&'static str>) {
    let mut inputs = vec!["h", "r", "wn", "state", "cw"];
    inputs.extend(Projections::input_names(quant));
    inputs.extend(["fwn", "gw", "gscales", "gbiases", "bias", "uw", "uscales", "ubiases", "dw", "dscales", "dbiases", "ctr"]);
    (inputs, vec!["s", "out", "next", "s1", "yn", "yc", "o1", "yn2", "inds", "scores", "hk"])
}

fn moe_kernel(quant: bool) -> Option<&'static CudaKernel> {
    static K: [Cells; 2] = [stages::cells(), stages::cells()];
    let (inputs, outputs) = moe_names(quant);
    let name = if quant { "lfm_conv_moe_fused" } else { "lfm_conv_moe_fused_dense" };
    stages::kernel(&K[usize::from(quant)], name, &inputs, &outputs, stages::LAYER_SOURCE, || {
        stages::layer_header(quant, true, stages::layer_defines(true, stages::Tail::Moe))
    })
}

/// The blocks of one launch: the conv part's at the MoE's width (a block
/// of [`super::moe_fused::WARPS`] warps), the router's, `k` experts' gate/up
/// rows, the down columns.
fn moe_blocks(d: i32, c: i32, f: i32, k: i32) -> i64 {
    let w = super::moe_fused::WARPS as i64;
    let per = |n: i32| (n as i64 + w - 1) / w;
    let cols = w / k as i64;
    1 + per(c) + per(d) + 1 + k as i64 * per(f) + (d as i64 + cols - 1) / cols
}

/// Whether [`forward_moe`] serves `l`: the conv part as [`available`]
/// serves it (blocks of the MoE's width), the MoE as the one-launch MoE
/// kernel serves it (src/kernels/moe_fused.rs, whose own switch need not
/// be on), and the staged rows within shared memory.
pub fn available_moe(l: &ConvMoeLayer, has_bias: bool) -> bool {
    let x = l.x;
    if !enabled_here() || l.moe.gate_up.weight.ndim() != 3 || !super::conv_fused::part_served(x, l.conv, l.state, l.cw, has_bias, super::moe_fused::WARPS) {
        return false;
    }
    let (d, dt, c) = (x.h.dim(1), x.h.dtype(), l.cw.dim(0));
    let bytes = |len: i32| len as usize * dt.size();
    // (The MoE's norm reads out_proj's row and the conv's sum, of the
    // row's shape and dtype: `x.h` stands for both in the MoE's checks.)
    let n = super::norm_gemv::NormIn { h: x.h, r: x.h, wn: l.ffn_norm, eps: x.eps_array, eps_value: Some(x.eps) };
    let m = l.moe;
    let conv_four_bit = matches!(l.conv, Projections::Quant(i, o) if i.spec.bits == 4 && o.spec.bits == 4);
    moe_fits(d, dt, &m, conv_four_bit)
        && super::moe_fused::served(&n, m.gate, m.gate_up, m.down, m.k)
        && (3 * bytes(d)).max(bytes(c)) <= stages::MAX_STAGED
        && moe_kernel(l.conv.quant()).is_some()
}

/// The layer in one launch (callers check [`available_moe`]); `ctr` the
/// layer's own ([`COUNTER_WORDS`] words).
pub fn forward_moe(l: &ConvMoeLayer, ctr: &Array) -> Result<Outputs> {
    use super::moe_fused::{ROUTE_SLOTS, WARPS as MOE_WARPS};
    const WHAT: &str = "the fused conv + MoE layer kernel";
    let x = l.x;
    let m = l.moe;
    let kern = moe_kernel(l.conv.quant()).ok_or_else(|| Error::mlx(format!("{WHAT} is not available")))?;
    stages::check_counters_of(ctr, COUNTER_WORDS, WHAT)?;
    let (mut inputs, mut template) = conv_part_operands(x, l.conv, l.state, l.cw, l.ffn_norm, MOE_WARPS, WHAT)?;
    let (experts, moe_spec, (f, k)) = moe_operands(&m, WHAT)?;
    let (d, dt) = (x.h.dim(1), x.h.dtype());
    let (c, w) = (l.cw.dim(0), l.cw.dim(1));
    let nb = moe_blocks(d, c, f, k);
    let threads = MOE_WARPS * 32;
    let grid = i32::try_from(nb * threads as i64).map_err(|_| Error::invalid(format!("fused conv + MoE layer kernel: {nb} blocks")))?;
    template.extend(moe_spec);
    inputs.extend(experts);
    inputs.push(ctr);
    let mut shapes = conv_outputs(d, c, w);
    shapes.extend([(vec![ROUTE_SLOTS], Some(crate::mlx::Dtype::Uint32)), (vec![ROUTE_SLOTS], Some(crate::mlx::Dtype::Float32)), (vec![k, f], None)]);
    let outs = call(kern, &inputs, &shapes, dt, grid, threads, &template)?;
    Outputs::from(outs, "fused conv + MoE layer kernel")
}

/// The feed-forward's projections as a joined kernel takes them: its
/// inputs, and its specifications under its own names (`FBITS`.. for
/// w1/w3, `GBITS`.. for w2; the conv's or out_proj's take `IBITS`/`OBITS`).
fn ffn_operands(p: Projections<'_>) -> Result<(Vec<&Array>, stages::Specs)> {
    let (inputs, spec) = p.inputs()?;
    let renamed = spec.into_iter().map(|(name, v)| {
        let name = match name {
            "IBITS" => "FBITS",
            "IGS" => "FGS",
            "OBITS" => "GBITS",
            "OGS" => "GGS",
            other => other,
        };
        (name, v)
    });
    Ok((inputs, renamed.collect()))
}

/// The MoE's inputs as the joined kernels take them (the router gate, its
/// selection bias, the experts), its template constants and `(F, k)`, for
/// `what`'s errors: experts a row within the route's slots, affine biases.
fn moe_operands<'a>(m: &Moe<'a>, what: &str) -> Result<(Vec<&'a Array>, stages::Specs, (i32, i32))> {
    use super::moe_fused::ROUTE_SLOTS;
    if !(1..=ROUTE_SLOTS as usize).contains(&m.k) {
        return Err(Error::invalid(format!("{what}: {} experts a row (1 to {ROUTE_SLOTS} are served)", m.k)));
    }
    let missing = |part: &str| Error::invalid(format!("{what} needs affine biases ({part})"));
    let gb = m.gate.biases.as_ref().ok_or_else(|| missing("the router gate"))?;
    let ub = m.gate_up.biases.as_ref().ok_or_else(|| missing("the experts' gate/up"))?;
    let db = m.down.biases.as_ref().ok_or_else(|| missing("the experts' down"))?;
    let (e, f, k) = (m.gate.weight.dim(0), m.gate_up.weight.dim(1) / 2, m.k as i32);
    let inputs = vec![&m.gate.weight, &m.gate.scales, gb, m.bias, &m.gate_up.weight, &m.gate_up.scales, ub, &m.down.weight, &m.down.scales, db];
    let spec = vec![
        ("F", TemplateArg::Int(f)),
        ("E", TemplateArg::Int(e)),
        ("TOPK", TemplateArg::Int(k)),
        ("NORM", TemplateArg::Bool(m.norm)),
        ("GBITS", TemplateArg::Int(m.gate.spec.bits)),
        ("GGS", TemplateArg::Int(m.gate.spec.group_size)),
        ("BITS", TemplateArg::Int(m.gate_up.spec.bits)),
        ("GS", TemplateArg::Int(m.gate_up.spec.group_size)),
        ("SCALE_BITS", TemplateArg::Int(m.scale.to_bits() as i32)),
    ];
    Ok((inputs, spec, (f, k)))
}

/// Whether a joined kernel's MoE blocks (1,024 threads) stay within the 64
/// registers a thread that allows, by ptxas on sm_90: rows of 1,024 and
/// 2,048 (the 8B-A1B's: 56) with every projection 4-bit (`proj_four_bit`:
/// the conv's or out_proj's) and the router at 4 or 8 bits, in bfloat16 or
/// float16. Rows of 1,536 (a guarded last chunk) took 66, of 3,072 and
/// 4,096 66-70, 8-bit projections 72 in float16: those layers keep the two
/// launches. (The router at 8 bits is how checkpoints hold it: mlx-lm's
/// LFM2-MoE recipe and src/convert quantize `feed_forward.gate` at 8 bits
/// in groups of 64. Until session 32 this took a 4-bit router only, so the
/// joined MoE forms never served a converted checkpoint: the WideMoe
/// greedy set and the 8B-A1B's A/B found them never built.)
pub(crate) fn moe_fits(d: i32, dt: crate::mlx::Dtype, m: &Moe, proj_four_bit: bool) -> bool {
    let four_bit = |q: &Quantized| q.spec.bits == 4;
    matches!(d, 1024 | 2048)
        && matches!(dt, crate::mlx::Dtype::Bfloat16 | crate::mlx::Dtype::Float16)
        && proj_four_bit
        && matches!(m.gate.spec.bits, 4 | 8)
        && four_bit(m.gate_up)
        && four_bit(m.down)
}

/// An attention layer's out_proj, as the out-only kernel reads it.
#[derive(Clone, Copy)]
pub enum OutProj<'a> {
    Quant(&'a Quantized),
    Dense(&'a Array),
}

/// What follows out_proj: the dense or 4/8-bit feed-forward, or the MoE.
#[derive(Clone, Copy)]
pub enum Tail<'a> {
    Ffn(Projections<'a>),
    Moe(Moe<'a>),
}

/// An attention layer's out_proj joined to the feed-forward or MoE after
/// it (the same switch): the attention's output row `row` (`[1, C]`, what
/// an earlier launch wrote), the layer's residual sum `r` (`[1, D]`), and
/// the rest as [`ConvLayer`]'s and [`ConvMoeLayer`]'s second half.
pub struct OutLayer<'a> {
    pub row: &'a Array,
    pub r: &'a Array,
    pub out_proj: OutProj<'a>,
    pub ffn_norm: &'a Array,
    pub tail: Tail<'a>,
    pub eps: f32,
    pub eps_array: &'a Array,
}

/// The out_proj-joined kernel's operands' names (inputs, outputs).
fn out_names(quant: bool, moe: bool) -> (Vec<&'static str>, Vec<&'static str>) {
    let mut inputs = vec!["yc", "r"];
    inputs.extend(if quant { &["ow", "oscales", "obiases"][..] } else { &["ow"][..] });
    inputs.push("fwn");
    inputs.extend(match (moe, quant) {
        (true, _) => &["gw", "gscales", "gbiases", "bias", "uw", "uscales", "ubiases", "dw", "dscales", "dbiases"][..],
        (false, true) => &["fw", "fscales", "fbiases", "gw", "gscales", "gbiases"][..],
        (false, false) => &["fw", "gw"][..],
    });
    inputs.push("ctr");
    let mut outputs = vec!["s", "out", "o1", "yn2"];
    outputs.extend(if moe { &["inds", "scores", "hk"][..] } else { &["hk"][..] });
    (inputs, outputs)
}

fn out_kernel(quant: bool, moe: bool) -> Option<&'static CudaKernel> {
    static K: [[Cells; 2]; 2] = [[stages::cells(), stages::cells()], [stages::cells(), stages::cells()]];
    let (inputs, outputs) = out_names(quant, moe);
    let tail = if moe { stages::Tail::Moe } else { stages::Tail::Ffn };
    let name = match (moe, quant) {
        (true, true) => "lfm_out_moe_fused",
        (true, false) => "lfm_out_moe_fused_dense",
        (false, true) => "lfm_out_ffn_fused",
        (false, false) => "lfm_out_ffn_fused_dense",
    };
    stages::kernel(&K[usize::from(moe)][usize::from(quant)], name, &inputs, &outputs, stages::LAYER_SOURCE, || {
        let rows = if moe { "" } else { ffn_rows(quant) };
        stages::layer_header(quant, moe, stages::out_defines(tail)) + rows
    })
}

/// The blocks of one launch: out_proj's, then the feed-forward's or the
/// MoE's (as [`blocks`] and [`moe_blocks`] count them, less the conv's).
fn out_blocks(d: i32, tail_f: i32, k: Option<i32>) -> i64 {
    match k {
        Some(k) => moe_blocks(d, 0, tail_f, k) - 1,
        None => blocks(d, 0, tail_f) - 1,
    }
}

/// Whether [`forward_out`] serves rows like `like` (`[1, D]`: the layer's
/// input, of the residual sum's shape and dtype): on, on CUDA, eps
/// compiled in, out_proj `[D, C]` without a bias as the products serve it,
/// the tail as [`available`] / [`available_moe`] serve theirs (the MoE
/// within the same register bounds), the staged rows within shared
/// memory. Asked before the attention runs (its row's width `c`).
pub fn available_out(like: &Array, c: i32, out_proj: OutProj, ffn_norm: &Array, tail: Tail, eps_array: &Array) -> bool {
    if !enabled_here() || !super::add_rms_norm::eps_const() || c <= 0 || like.ndim() != 2 || like.dim(0) != 1 {
        return false;
    }
    let (d, dt) = (like.dim(1), like.dtype());
    let bytes = |len: i32| len as usize * dt.size();
    let quant = matches!(out_proj, OutProj::Quant(_));
    // (out_proj as the second of a pair: the first stands in, unread.)
    let served_out = match out_proj {
        OutProj::Quant(q) => Projections::Quant(q, q).served_second(dt, d, c),
        OutProj::Dense(w) => Projections::Dense(w, w).served_second(dt, d, c),
    };
    let tail_ok = match tail {
        Tail::Ffn(p) => {
            let f = p.first_rows() / 2;
            p.quant() == quant
                && p.first_rows() % 2 == 0
                && f > 0
                && f <= MAX_WIDTH
                && p.served(dt, 2 * f, d, f)
                && bytes(f) % 16 == 0
                && bytes(f) <= stages::MAX_STAGED
                && super::add_rms_norm::block_for(d, 16 / dt.size() as i32) <= WARPS * 32
        }
        Tail::Moe(m) => {
            let n = super::norm_gemv::NormIn { h: like, r: like, wn: ffn_norm, eps: eps_array, eps_value: None };
            moe_fits(d, dt, &m, matches!(out_proj, OutProj::Quant(q) if q.spec.bits == 4))
                && super::moe_fused::served(&n, m.gate, m.gate_up, m.down, m.k)
        }
    };
    served_out
        && tail_ok
        && super::add_rms_norm::available(like, like, ffn_norm)
        && d <= MAX_WIDTH
        && c <= MAX_WIDTH
        && bytes(d) % 16 == 0
        && bytes(c) % 16 == 0
        && (3 * bytes(d)).max(bytes(c)) <= stages::MAX_STAGED
        && out_kernel(quant, matches!(tail, Tail::Moe(_))).is_some()
}

/// The layer's second half in one launch (callers check [`available_out`]
/// with `l`'s shapes); `ctr` the layer's own ([`COUNTER_WORDS`] words).
/// Outputs as [`forward`]'s, `s1` the residual sum it was given and `next`
/// its out_proj row (no conv state).
pub fn forward_out(l: &OutLayer, ctr: &Array) -> Result<Outputs> {
    use super::moe_fused::{ROUTE_SLOTS, WARPS as MOE_WARPS};
    let quant = matches!(l.out_proj, OutProj::Quant(_));
    let moe = matches!(l.tail, Tail::Moe(_));
    let what = "the fused out_proj + feed-forward kernel";
    let kern = out_kernel(quant, moe).ok_or_else(|| Error::mlx(format!("{what} is not available")))?;
    stages::check_counters_of(ctr, COUNTER_WORDS, what)?;
    if l.row.ndim() != 2 || l.r.ndim() != 2 {
        return Err(Error::invalid(format!("{what}: rows must be [1, width]")));
    }
    let (d, dt, c) = (l.r.dim(1), l.r.dtype(), l.row.dim(1));
    let mut template = vec![
        ("T", TemplateArg::Dtype(dt)),
        ("D", TemplateArg::Int(d)),
        ("C", TemplateArg::Int(c)),
        ("NBLK", TemplateArg::Int(super::add_rms_norm::block_for(d, 16 / dt.size() as i32))),
        ("EPS_BITS", TemplateArg::Int(l.eps.to_bits() as i32)),
    ];
    let mut inputs = vec![l.row, l.r];
    match l.out_proj {
        OutProj::Quant(q) => {
            let b = q.biases.as_ref().ok_or_else(|| Error::invalid(format!("{what} needs affine biases (out_proj)")))?;
            inputs.extend([&q.weight, &q.scales, b]);
            template.extend([("OBITS", TemplateArg::Int(q.spec.bits)), ("OGS", TemplateArg::Int(q.spec.group_size))]);
        }
        OutProj::Dense(w) => inputs.push(w),
    }
    inputs.push(l.ffn_norm);
    let (warps, nb, mut shapes) = match l.tail {
        Tail::Ffn(p) => {
            let f = p.first_rows() / 2;
            let (ffn, spec) = ffn_operands(p)?;
            inputs.extend(ffn);
            template.extend(spec);
            template.push(("F", TemplateArg::Int(f)));
            (WARPS, out_blocks(d, f, None), vec![(vec![f], None)])
        }
        Tail::Moe(m) => {
            let (experts, spec, (f, k)) = moe_operands(&m, what)?;
            inputs.extend(experts);
            template.extend(spec);
            let shapes = vec![
                (vec![ROUTE_SLOTS], Some(crate::mlx::Dtype::Uint32)),
                (vec![ROUTE_SLOTS], Some(crate::mlx::Dtype::Float32)),
                (vec![k, f], None),
            ];
            (MOE_WARPS, out_blocks(d, f, Some(k)), shapes)
        }
    };
    template.push(("WARPS", TemplateArg::Int(warps)));
    inputs.push(ctr);
    let threads = warps * 32;
    let grid = i32::try_from(nb * threads as i64).map_err(|_| Error::invalid(format!("{what}: {nb} blocks")))?;
    let row = || (vec![1, d], None);
    let mut all = vec![row(), row(), (vec![d], None), (vec![d], None)];
    all.append(&mut shapes);
    let mut outs = call(kern, &inputs, &all, dt, grid, threads, &template)?;
    outs.truncate(3);
    BUILT.bump();
    let missing = || Error::mlx(format!("{what}: missing output"));
    let o1 = outs.pop().ok_or_else(missing)?;
    let out = outs.pop().ok_or_else(missing)?;
    let s2 = outs.pop().ok_or_else(missing)?;
    Ok(Outputs { s1: l.r.clone(), s2, out, next: o1 })
}

/// Every form's name and operand names (inputs, then outputs), as its
/// kernel function asks MLX for it.
#[cfg(test)]
pub(crate) fn every_operands() -> Vec<(String, Vec<&'static str>)> {
    let mut all = Vec::new();
    for quant in [false, true] {
        let join = |(i, o): (Vec<&'static str>, Vec<&'static str>)| i.into_iter().chain(o).collect::<Vec<_>>();
        all.push((format!("conv + feed-forward, quantized {quant}"), join(layer_names(quant))));
        all.push((format!("conv + MoE, quantized {quant}"), join(moe_names(quant))));
        for moe in [false, true] {
            all.push((format!("out_proj + {}, quantized {quant}", if moe { "MoE" } else { "feed-forward" }), join(out_names(quant, moe))));
        }
    }
    all
}

#[cfg(test)]
pub(crate) fn launch_blocks_out(d: i32, f: i32, k: Option<i32>) -> i64 {
    out_blocks(d, f, k)
}

#[cfg(test)]
pub(crate) fn launch_blocks_moe(d: i32, c: i32, f: i32, k: i32) -> i64 {
    moe_blocks(d, c, f, k)
}

#[cfg(test)]
pub(crate) fn launch_blocks(d: i32, c: i32, f: i32) -> i64 {
    blocks(d, c, f)
}
