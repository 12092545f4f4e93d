//! A lone sequence's MoE layer in one launch (a CUDA default since session
//! 31, `MLX_LFM_MOE_FUSED=0` off: its H200 test and greedy sets passed in
//! sessions 30-31, and the one-launch layers together read decode 1.12x /
//! 1.00x / 1.15x on the 350M / 1.2B / 8B-A1B in session 31's paired A/B, on
//! an H100): the residual add + RMSNorm, the router, the experts' gate/up
//! with their SwiGLU and the down projection with the weighted sum, which
//! otherwise are three launches (src/kernels/moe_router.rs
//! `route_gate_norm`, src/kernels/moe_experts.rs `gate_up` and `down`): 44
//! of the 8B-A1B's ~200 nodes a step, each one the host builds and
//! dispatches every token (the host bounds that model's decode in some
//! rounds) and each a kernel boundary on the GPU.
//!
//! The three stages depend on each other across the whole grid (the
//! experts need the router's choice, the down projection every gate/up
//! row), and MLX launches a custom kernel plainly (no cooperative launch,
//! so no grid-wide barrier that is safe whatever the residency). So each
//! block takes a ticket when it starts (a counter the kernel keeps in a
//! small state array of its layer) and its ticket, not its block index,
//! gives its part: ticket 0 the norm and the router, the next tickets the
//! gate/up rows, the last ones the down columns. A block waits only for
//! blocks with smaller tickets, which took theirs before it and so are
//! running or done and never wait on it: no deadlock, however few blocks a
//! GPU holds at once. The counters never reset: launch L of a layer takes
//! tickets `[L * NB, (L + 1) * NB)`, so a block knows its launch and what
//! to wait for (64-bit: no wrap). That needs a layer's launches to run one
//! after another, which MLX does not see to (the state is only ever an
//! input, so its graph has no edge through it): they are ordered by data,
//! as one sequence's steps are (each layer's input comes from the step
//! before). Two independent one-row passes of one model in a single
//! evaluation would interleave their tickets; nothing here makes them (a
//! batch of rows takes the three kernels). A wait that runs past
//! `LFM_SPIN_LIMIT` polls (each a load from L2 and a short sleep: far past
//! any real stage's microseconds, ~0.1 s or more) gives up and poisons the
//! layer's output with NaN (the step's finiteness check then fails it)
//! instead of hanging the GPU, still counting itself so that later
//! launches stay in step; a down block also waits for the router's mark,
//! so gate/up blocks that gave up never let it read an unwritten route.
//!
//! Each stage is the default kernel's own code over the same values (the
//! router + norm's device functions; the gate/up and down warps' helpers,
//! reading the normed row and the gated rows from shared memory after
//! loading them past L1; the down kernel's default arithmetic, not its
//! `MLX_LFM_MOE_DOWN_LOADS=early` variant), so the result is the three
//! launches' within NVVM's contraction choices (`moe_experts`'s note): the
//! test holds the residual sum to the bits and the output within two
//! roundings of them. That is the float form; since session 38 the
//! experts' rows take MLX's own `qmv` arithmetic by default where the
//! quantized walk takes its rows in pairs ([`experts_exact`]), held to the
//! stock ops' graph. Tests in src/kernels/tests.rs.

use super::moe_experts;
use super::moe_router;
use super::quant_gemv;
use super::norm_gemv::NormIn;
use super::stages::{self, Built, Cells, TICKET_HEADER};
use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{Array, Dtype};
use crate::model::linear::Quantized;
use std::sync::OnceLock;



// Template constants: T, D (the row), F (an expert's hidden width), E,
// TOPK, NORM, the gate's GBITS / GGS, the experts' BITS / GS, WARPS (the
// block), EPS_BITS, SCALE_BITS. `ctr`: the layer's counters (tickets, the
// router's launch mark, gate/up blocks done). The body: the MoE part of
// src/kernels/stages.rs's `LAYER_SOURCE`.

/// Warps a block: a warp an expert for the router (as the router + norm
/// kernel's default), 32 experts a row on the 8B-A1B; ptxas keeps the
/// kernel within the 64 registers a thread that 1,024 threads allow. (One
/// block an SM at its 56 registers, ~3.6 waves of the 8B-A1B's 481 blocks;
/// blocks of 16 and 8 warps, two and four an SM, and the router's rows
/// asked of L2 before the ticket were timed in session 35 on an H100:
/// 41.60, 44.61 and 41.70 µs against 41.57 under ncu, and retired. Its
/// ncu stalls: barrier waits lead, the stages' handoffs.)
pub(crate) const WARPS: i32 = 32;
/// The router's scratch outputs hold this many entries whatever k is, so
/// that they stay over 8 bytes (MLX 0.32.4 keeps smaller arrays in its
/// managed scalar pool, slow for the GPU to read; `moe_router::scores_f32`).
pub(crate) const ROUTE_SLOTS: i32 = 8;
/// The widest expert served: by ptxas (sm_90, CUDA 13.5 here) the kernel
/// stays within the 64 registers a thread of 1,024 allow up to here in
/// every dtype, specification and row width the router + norm fold serves
/// (56 on the 8B-A1B; 64, the most, on rows of 1,536, whose last chunk is
/// guarded); one-expert rows of 12,288 and more with 8-bit experts took
/// 65-66, and MLX gives a custom kernel no launch bounds.
const MAX_F: i64 = 8192;

fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    super::opt_out("MLX_LFM_MOE_FUSED", &ON)
}

/// The scratch rows' bytes (the normed row, the route's experts and
/// weights, the gated rows: the last four outputs of [`forward`]'s launch,
/// whose sizes `stages::call_with_scratch` places) at `elem` bytes an
/// activation: what a layer's state is sized for.
fn scratch_bytes(d: i64, f: i64, k: i64, elem: i64) -> [i64; 4] {
    [d * elem, ROUTE_SLOTS as i64 * 4, ROUTE_SLOTS as i64 * 4, k * f * elem]
}

/// The uint32 words of a MoE layer's state: its counters, and room for
/// its scratch rows at up to 4 bytes an activation (~37 KB a layer of the
/// 8B-A1B).
pub fn state_words(d: usize, f: usize, k: usize) -> usize {
    stages::state_words(&scratch_bytes(d as i64, f as i64, k.clamp(1, ROUTE_SLOTS as usize) as i64, 4))
}

/// The scratch rows' pointers into the state, as the outputs of those
/// names were (the body is the same text).
const SCRATCH_PRELUDE: &str = r#"
  unsigned char* lfm_scratch = reinterpret_cast<unsigned char*>(const_cast<uint32_t*>(ctr));
  T* yn = reinterpret_cast<T*>(lfm_scratch + SCR_YN);
  uint32_t* inds = reinterpret_cast<uint32_t*>(lfm_scratch + SCR_INDS);
  float* scores = reinterpret_cast<float*>(lfm_scratch + SCR_SCORES);
  T* hk = reinterpret_cast<T*>(lfm_scratch + SCR_HK);
"#;

static BUILT: Built = Built::new();
static BUILT_EXACT: Built = Built::new();
static BUILT_PREFETCH: Built = Built::new();
static BUILT_GATE_ROWS: Built = Built::new();
static BUILT_DOWN_COLS: Built = Built::new();

/// How many times [`forward`] has put the kernel into a graph in this
/// process (a compiled step once, when it is traced): the greedy test's
/// evidence that its default runs took this path at all.
pub fn built() -> usize {
    BUILT.get()
}

/// How many of those launches took the experts-exact form
/// ([`experts_exact`]): its tests' evidence that it ran, not the default.
pub fn built_exact() -> usize {
    BUILT_EXACT.get()
}

const INPUTS: [&str; 14] = ["h", "r", "wn", "gw", "gscales", "gbiases", "bias", "uw", "uscales", "ubiases", "dw", "dscales", "dbiases", "ctr"];

fn header() -> String {
    format!("{}{}{TICKET_HEADER}", stages::layer_defines(false, stages::Tail::Moe), moe_router::gate_norm_header())
}

/// Which form of the kernel a launch takes: its experts in MLX's
/// arithmetic ([`experts_exact`]), its down rows asked of L2 by the
/// gate/up blocks ([`down_prefetch`]: 0 not, 1 before their rows, 2 after),
/// its gate/up outputs a warp ([`gate_rows`]: 1 or 2), its down columns a
/// warp ([`down_cols`]: 1 or 2; session 38's first form of it is in
/// [`down_cols`]'s note).
#[derive(Clone, Copy)]
struct Form {
    exact: bool,
    prefetch: u8,
    gate_rows: u8,
    down_cols: u8,
}

/// How many forms [`Form::index`] tells apart.
const FORMS: usize = 24;

impl Form {
    fn index(self) -> usize {
        usize::from(self.exact)
            + 2 * usize::from(self.prefetch.min(2))
            + 6 * usize::from(self.gate_rows == 2)
            + 12 * usize::from(self.down_cols == 2)
    }

    /// The kernel's names: the outputs form's, the scratch form's.
    fn names(self) -> &'static [String; 2] {
        static NAMES: [OnceLock<[String; 2]>; FORMS] = [const { OnceLock::new() }; FORMS];
        NAMES[self.index()].get_or_init(|| {
            let pf = ["", "_pf", "_pfa"][usize::from(self.prefetch.min(2))];
            let g2 = if self.gate_rows == 2 { "_g2" } else { "" };
            let d2 = if self.down_cols == 2 { "_d2" } else { "" };
            let base = format!("lfm_moe_fused{}{pf}{g2}{d2}", if self.exact { "_exact" } else { "" });
            [base.clone(), format!("{base}_scr")]
        })
    }

    /// The form's header: its defines first; the exact form's experts
    /// walk their rows as the one-launch layers do (`stages::QUANT_PRODUCTS`).
    fn header(self) -> String {
        let (exact, products) = if self.exact { (EXACT_DEFINES, stages::QUANT_PRODUCTS) } else { ("", "") };
        let prefetch = match self.prefetch {
            0 => String::new(),
            p => format!("#define LFM_MOE_DOWN_PREFETCH {p}\n{}{}", stages::PREFETCH_HEADER, stages::MOE_DOWN_PREFETCH_HEADER),
        };
        let rows = if self.gate_rows == 2 { "#define LFM_MOE_GATE_ROWS 2\n" } else { "" };
        let cols = if self.down_cols == 2 { "#define LFM_MOE_DOWN_COLS 2\n" } else { "" };
        format!("{exact}{rows}{cols}{}{products}{prefetch}", header())
    }
}

/// The kernel in `form`; with `scratch`, its form with the scratch rows
/// (`yn`, `inds`, `scores`, `hk`) in the layer's state
/// ([`stages::call_with_scratch`]).
fn kernel(scratch: bool, form: Form) -> Option<&'static CudaKernel> {
    static K: [[Cells; 2]; FORMS] = [const { [stages::cells(), stages::cells()] }; FORMS];
    static SCRATCH_SOURCE: OnceLock<String> = OnceLock::new();
    let outputs = ["s", "out", "yn", "inds", "scores", "hk"];
    let cells = &K[form.index()];
    let [name, scratch_name] = form.names();
    let (name, scratch_name) = (name.as_str(), scratch_name.as_str());
    let head = move || form.header();
    if scratch {
        let source = SCRATCH_SOURCE.get_or_init(|| format!("{SCRATCH_PRELUDE}{}", stages::LAYER_SOURCE));
        return stages::kernel(&cells[1], scratch_name, &INPUTS, &outputs[..2], source, head);
    }
    stages::kernel(&cells[0], name, &INPUTS, &outputs, stages::LAYER_SOURCE, head)
}

/// `MLX_LFM_MOE_DOWN_PREFETCH=1` (or `after`; opt-in, session 38, not yet
/// run on a GPU): each gate/up block of the one-launch MoE layer asks L2
/// for its share of its expert's down rows (stages.rs
/// `lfm_moe_down_prefetch`), before its own rows (`1`) or after them
/// (`after`). Session 35's timelines on the H100 had a clean launch's
/// down stage take 12.8 of its 35.4 µs for ~7.3 MB (~0.57 TB/s): its 256
/// blocks start only as the gate/up blocks leave the SMs (one 1,024-thread
/// block an SM), so no down row is asked for before the gate/up stage ends.
/// A prefetch changes no value: its test holds it to the bits of the form
/// it varies. Read at each launch's build, so a process can time the forms.
pub(crate) fn down_prefetch() -> u8 {
    static SET: OnceLock<u8> = OnceLock::new();
    if super::forced("MLX_LFM_MOE_DOWN_PREFETCH") {
        return 1;
    }
    crate::knobs::cached("MLX_LFM_MOE_DOWN_PREFETCH", &SET, |v| match v.map(str::trim) {
        Some("1") => 1,
        Some("after") => 2,
        _ => 0,
    })
}

/// How many launches asked L2 for the down rows ([`down_prefetch`]).
pub fn built_prefetch() -> usize {
    BUILT_PREFETCH.get()
}

/// `MLX_LFM_MOE_GATE_ROWS` (session 51; the default since session 53,
/// `=1` off; with the experts exact, where [`registers_fit_two`] says):
/// each gate/up warp makes two outputs of its expert, `n` and
/// `n + RB * 32` (RB the expert's blocks), its four rows asked of L2
/// together, so that the gate/up stage takes half the blocks: the
/// 8B-A1B's 224 gate/up blocks of 1,024 threads, one an SM at the
/// kernel's 56 registers, are two waves on an H100's 132 SMs, and 112 are
/// one. Each row is walked as it is alone, so the same bits (its test
/// holds it to the form it varies). Session 35's blocks of 16 and 8 warps
/// kept two waves (two and four an SM); session 38's two down columns a
/// warp halved the down blocks instead, and its waits gave up. Read at
/// each launch's build, so a process can time both forms, each on a state
/// of its own: a block finds its launch and part from its ticket over the
/// launch's block count, which this form changes (a state that served the
/// other form would put its blocks out of step, their waits giving up).
/// Session 53's H100: the 8B-A1B's launch 35.2 µs against 37.7 alone,
/// 34.8 with [`down_cols`] (kernel-bench), and its decode 1.045-1.056x
/// with both (paired A/B, 3 reps; 1.030-1.042x alone).
pub(crate) fn gate_rows() -> u8 {
    static SET: OnceLock<u8> = OnceLock::new();
    one_or_two("MLX_LFM_MOE_GATE_ROWS", &SET)
}

/// A two-outputs switch ([`gate_rows`], [`down_cols`]): 1 where `var=1`
/// (or `=0`, off as every default's switch), else 2 (the default since
/// session 53) where the form serves.
fn one_or_two(var: &str, cell: &'static OnceLock<u8>) -> u8 {
    if super::forced(var) {
        return 2;
    }
    crate::knobs::cached(var, cell, |v| if matches!(v.map(str::trim), Some("0") | Some("1")) { 1 } else { 2 })
}

/// How many launches took two gate/up outputs a warp ([`gate_rows`]).
pub fn built_gate_rows() -> usize {
    BUILT_GATE_ROWS.get()
}

/// `MLX_LFM_MOE_DOWN_COLS` (session 51; the default since session 53,
/// `=1` off; where [`registers_fit_two`] says, as [`gate_rows`]): each down warp
/// makes two output columns of its expert, `n` and `n + DB * 32 / k` (DB
/// the down blocks), both rows asked of L2 first, so that the down stage
/// takes half the blocks (the 8B-A1B's 256 to 128: with [`gate_rows`]'s
/// 112 gate/up blocks, the launch's 241 blocks fit an H100's 132 SMs in
/// two turns). Each row is walked as it is alone and each column's
/// experts summed in their order, so the same bits. Session 38's two down
/// columns a warp (`MLX_LFM_MOE_DOWN_ROWS=2`) were retired on a
/// kernel-bench launch that ran 268 ms, its waits giving up; that arm
/// shared one layer state with forms of other block counts, which puts
/// every ticket out of step (the fault session 51's review found in the
/// gate rows' first arm), so that reading said nothing of the form. Read
/// at each launch's build; each form on a state of its own. Session 53's
/// H100: 35.5 µs a launch against 37.7 alone (kernel-bench), the 8B-A1B's
/// decode 1.030-1.039x alone (paired A/B, 3 reps).
pub(crate) fn down_cols() -> u8 {
    static SET: OnceLock<u8> = OnceLock::new();
    one_or_two("MLX_LFM_MOE_DOWN_COLS", &SET)
}

/// How many launches took two down columns a warp ([`down_cols`]).
pub fn built_down_cols() -> usize {
    BUILT_DOWN_COLS.get()
}

/// The form a launch of these operands takes (the timeline form's too:
/// its test and the bench hold it to that form's bits). Where the MLX walk
/// does not serve the experts, the float form runs.
fn form_of(gu: &Quantized, down: &Quantized, dt: Dtype, d: i32, f: i32, k: usize) -> Form {
    let exact = experts_exact()
        && quant_gemv::spec_served(gu, dt, d)
        && quant_gemv::spec_served(down, dt, f)
        && registers_fit(gu.spec.bits, d, true);
    let two = registers_fit_two(gu.spec.bits, d, exact, k);
    let gate_rows = if gate_rows() == 2 && two { 2 } else { 1 };
    let down_cols = if down_cols() == 2 && two { 2 } else { 1 };
    Form { exact, prefetch: down_prefetch(), gate_rows, down_cols }
}

/// The experts-exact form's defines: MLX's walk for the experts, two
/// tiles' loads a batch (the walk's default four took 92 registers a
/// thread, bf16 on sm_90 by ptxas, past the 64 that the launch's 1,024
/// threads allow, and MLX gives a custom kernel no launch bounds; two take
/// 56, the default form's count; the batch is the loads only, not the
/// arithmetic, and each row is asked of L2 whole first).
const EXACT_DEFINES: &str = "#define LFM_MOE_EXACT 1\n#define LFM_QMLX_TILES 2\n";

/// `MLX_LFM_MOE_EXACT` (session 37; the default since session 38 where the
/// walk takes 4-bit rows in pairs, `MLX_LFM_QINT` unset; `=0` turns it off,
/// `=1` on under any `MLX_LFM_QINT`): the experts' gate/up and down rows
/// walked as the one-launch feed-forward walks its rows, in MLX's own `qmv`
/// arithmetic (src/kernels/quant_gemv.rs `lfm_qdot_mlx`, each row asked of
/// L2 first), where the float form walks them in float32 as the three MoE
/// kernels do. In pairs this one-launch layer ran 37.7 µs against the
/// float form's 41.6 on the H100 (session 38's kernel-bench, the 8B-A1B's
/// shapes), and the 8B-A1B decoded 1.145x the conversion walk's rate with
/// it (1.10x in pairs without it); by the conversion units it lost (47.1
/// µs, 0.91x), so it follows the walk's default. Not the three kernels'
/// bits: its test holds it to the stock ops' graph within bf16's rounding,
/// and the wide MoE fixture's greedy tokens held (session 38). Where the
/// walk does not serve the experts' specification, the float form runs.
/// Read at each launch's build, so a process can time both forms.
pub(crate) fn experts_exact() -> bool {
    static SET: OnceLock<Option<bool>> = OnceLock::new();
    super::switch("MLX_LFM_MOE_EXACT", &SET).unwrap_or_else(|| quant_gemv::qint_mode() == quant_gemv::QintMode::Pairs)
}

/// The gate/up blocks and the down blocks of one launch (as the kernel
/// counts them; `k` in 1..=8, `form`'s gate/up outputs and down columns a
/// warp).
fn parts(d: i32, f: i32, k: i32, form: Form) -> (i64, i64) {
    let (w, k64) = (WARPS as i64, k as i64);
    let per_block = w * i64::from(form.gate_rows.max(1));
    let gate_up = k64 * ((f as i64 + per_block - 1) / per_block);
    let per = w / k64 * i64::from(form.down_cols.max(1));
    (gate_up, (d as i64 + per - 1) / per)
}

/// The blocks of one launch: the router's, the gate/up rows', the down
/// columns'.
fn blocks(d: i32, f: i32, k: i32, form: Form) -> i64 {
    let (gate_up, down) = parts(d, f, k, form);
    1 + gate_up + down
}

/// Whether [`forward`] serves the pending norm `n` (one row) through the
/// quantized gate `g` and the experts `gu` / `down` with `k` experts a
/// row: on ([`enabled`]), on CUDA, where the router + norm fold and the
/// experts' kernels serve these operands (their own conditions: the row's
/// width and dtype, the specifications, the shapes), with eps and the
/// route's scale compiled in (`MLX_LFM_EPS_CONST`, the default), both
/// expert stacks of one specification, and the staged rows within shared
/// memory.
pub fn available(n: &NormIn, g: &Quantized, gu: &Quantized, down: &Quantized, k: usize) -> bool {
    // (The form the launch will take, which since session 38 is the
    // experts-exact one: a form that does not build is not available.)
    enabled()
        && served(n, g, gu, down, k)
        && kernel(false, form_of(gu, down, n.h.dtype(), n.h.dim(1), gu.weight.dim(1) / 2, k)).is_some()
}

/// [`available`] but for the switch and the kernel: whether the layer's
/// stages serve these operands (also what src/kernels/conv_layer_fused.rs
/// asks of a conv layer's MoE).
pub(crate) fn served(n: &NormIn, g: &Quantized, gu: &Quantized, down: &Quantized, k: usize) -> bool {
    if !cuda_kernels_enabled() || n.h.ndim() != 2 || n.h.dim(0) != 1 || !super::add_rms_norm::eps_const() {
        return false;
    }
    if !(1..=ROUTE_SLOTS as usize).contains(&k) || gu.spec != down.spec || gu.weight.ndim() != 3 || down.weight.ndim() != 3 {
        return false;
    }
    let (d, dt) = (n.h.dim(1), n.h.dtype());
    let width = |q: &Quantized| q.weight.dim(2) as i64 * 32 / q.spec.bits as i64;
    let f = width(down);
    let bytes = |len: i64| len as usize * dt.size();
    moe_router::gate_norm_available(n, g, k)
        && moe_experts::available(1, k, dt, gu, down)
        // (The kernel takes the row's width for the down stack's rows and
        // the gate/up stack's inputs.)
        && width(gu) == d as i64
        && down.weight.dim(1) == d
        && f <= MAX_F
        && bytes(d as i64) % 16 == 0
        && bytes(f) % 16 == 0
        && bytes(d as i64).max(bytes(k as i64 * f)) <= stages::MAX_STAGED
        && registers_fit(gu.spec.bits, d, false)
}

/// Whether the launch's 1,024 threads fit the form's registers: MLX gives
/// a custom kernel no launch bounds, and past 64 registers a thread it
/// would not launch. A ptxas sweep for sm_90 (session 37, ~115 served
/// shapes a form): 8-bit experts over rows that are not whole passes of
/// the warps' 16-byte chunks (D not a multiple of 512: 1,056 to 1,920)
/// took 72-80 in the default form, and the experts-exact form took 70 on
/// 4-bit rows of 1,152 and 1,280. Those rows take the three kernels (or,
/// for the exact form, the float form); session 37's route in every
/// gate/up block (retired in session 38) never took more than the form it
/// varied, nor does the down rows' prefetch (nvrtc-check's `@pf` entries).
fn registers_fit(bits: i32, d: i32, exact: bool) -> bool {
    (bits != 8 && !exact) || d % 512 == 0
}

/// Where a launch takes the forms of two gate/up outputs or down columns a
/// warp ([`gate_rows`], [`down_cols`]); elsewhere the forms of one: the
/// experts exact (the default), 4-bit, rows of 1,024 or 2,048, up to 4
/// experts a row. By ptxas (sm_90, CUDA 13 here; session 51's sweeps over
/// D, the experts' and the router's bits and groups, k, F to 8,192 and
/// each dtype) those stay within the 64 registers that 1,024 threads
/// allow: the 8B-A1B's bf16 kernel 56 (52 with one output), the two forms
/// together 63-64 at the most on some shapes of each k (at the limit: a
/// device compiler that took more would fail such a launch, as the forms'
/// test would show). Outside them: 8 experts a row 63-64 for the gate
/// rows' form alone, 8-bit experts up to 71, rows of 1,536 up to 79, rows
/// of 3,072 and 4,096 up to 72, the float form up to 92.
fn registers_fit_two(bits: i32, d: i32, exact: bool, k: usize) -> bool {
    exact && bits == 4 && matches!(d, 1024 | 2048) && k <= 4
}

/// The residual sum `s = h + r` and the layer's output (before a tensor
/// parallel reduce), both `[1, D]`, in one launch (callers check
/// [`available`]): `bias` the router's selection bias `[E]` float32, `eps`
/// and `scale` the norm's eps and the route's scale, `state` the layer's
/// own (`stages::new_counters`).
#[allow(clippy::too_many_arguments)]
pub fn forward(
    n: &NormIn,
    g: &Quantized,
    bias: &Array,
    gu: &Quantized,
    down: &Quantized,
    state: &Array,
    k: usize,
    norm: bool,
    eps: f32,
    scale: f32,
) -> Result<(Array, Array)> {
    let (mut outs, _) = launch(n, g, bias, gu, down, state, k, norm, eps, scale, false)?;
    let out = outs.pop().ok_or_else(|| Error::mlx("fused MoE kernel: missing output"))?;
    let s = outs.pop().ok_or_else(|| Error::mlx("fused MoE kernel: missing output"))?;
    Ok((s, out))
}

/// [`forward`]'s layer output through the kernel's timeline form (the
/// bench's: `stages::TIMELINE_HEADER`), with its stamps `[NB * 4]` int64
/// and the parts' bounds: the gate/up blocks are parts `1..=gate_up`, the
/// down blocks `gate_up + 1..nb`.
#[doc(hidden)]
#[allow(clippy::too_many_arguments)]
pub fn forward_timeline(
    n: &NormIn,
    g: &Quantized,
    bias: &Array,
    gu: &Quantized,
    down: &Quantized,
    state: &Array,
    k: usize,
    norm: bool,
    eps: f32,
    scale: f32,
) -> Result<(Array, Array, usize, usize)> {
    let (mut outs, form) = launch(n, g, bias, gu, down, state, k, norm, eps, scale, true)?;
    let times = outs.pop().ok_or_else(|| Error::mlx("fused MoE kernel: missing output"))?;
    let (d, f) = (n.h.dim(1), gu.weight.dim(1) / 2);
    let (gate_up, down) = parts(d, f, k as i32, form);
    Ok((outs.swap_remove(1), times, gate_up as usize, (1 + gate_up + down) as usize))
}

/// The kernel's timeline form (outputs as [`kernel`]'s, then `times`).
fn timeline_kernel(form: Form) -> Option<&'static CudaKernel> {
    static K: [Cells; FORMS] = [const { stages::cells() }; FORMS];
    static NAMES: [OnceLock<String>; FORMS] = [const { OnceLock::new() }; FORMS];
    let source = stages::stamped_layer_source(false);
    let outputs = ["s", "out", "yn", "inds", "scores", "hk", "times"];
    let name = NAMES[form.index()].get_or_init(|| format!("{}_timeline", form.names()[0]));
    stages::kernel(&K[form.index()], name, &INPUTS, &outputs, source, move || format!("{}{}", stages::TIMELINE_HEADER, form.header()))
}

/// The launch: `[s, out]`, or (`timeline`) every output of the timeline
/// form, its stamps last; and the form it took (its block count).
#[allow(clippy::too_many_arguments)]
fn launch(
    n: &NormIn,
    g: &Quantized,
    bias: &Array,
    gu: &Quantized,
    down: &Quantized,
    state: &Array,
    k: usize,
    norm: bool,
    eps: f32,
    scale: f32,
    timeline: bool,
) -> Result<(Vec<Array>, Form)> {
    let unavailable = || Error::mlx("the fused MoE kernel is not available");
    let (d, dt) = (n.h.dim(1), n.h.dtype());
    let (e, f) = (g.weight.dim(0), gu.weight.dim(1) / 2);
    let form = form_of(gu, down, dt, d, f, k);
    let kern = if timeline { timeline_kernel(form) } else { kernel(false, form) }.ok_or_else(unavailable)?;
    let missing = |what: &str| Error::invalid(format!("the fused MoE kernel needs affine biases ({what})"));
    let gb = g.biases.as_ref().ok_or_else(|| missing("the router gate"))?;
    let ub = gu.biases.as_ref().ok_or_else(|| missing("the experts' gate/up"))?;
    let db = down.biases.as_ref().ok_or_else(|| missing("the experts' down"))?;
    stages::check_state(state, "the fused MoE kernel")?;
    if !(1..=ROUTE_SLOTS as usize).contains(&k) {
        return Err(Error::invalid(format!("the fused MoE kernel: {k} experts a row (1 to {ROUTE_SLOTS} are served)")));
    }
    let k = k as i32;
    let nb = blocks(d, f, k, form);
    let threads = WARPS * 32;
    let grid = i32::try_from(nb * threads as i64).map_err(|_| Error::invalid(format!("fused MoE kernel: {nb} blocks")))?;
    let template = [
        ("T", TemplateArg::Dtype(dt)),
        ("D", TemplateArg::Int(d)),
        ("F", TemplateArg::Int(f)),
        ("E", TemplateArg::Int(e)),
        ("TOPK", TemplateArg::Int(k)),
        ("NORM", TemplateArg::Bool(norm)),
        ("GBITS", TemplateArg::Int(g.spec.bits)),
        ("GGS", TemplateArg::Int(g.spec.group_size)),
        ("BITS", TemplateArg::Int(gu.spec.bits)),
        ("GS", TemplateArg::Int(gu.spec.group_size)),
        ("WARPS", TemplateArg::Int(WARPS)),
        ("EPS_BITS", TemplateArg::Int(eps.to_bits() as i32)),
        ("SCALE_BITS", TemplateArg::Int(scale.to_bits() as i32)),
    ];
    let inputs = [n.h, n.r, n.wn, &g.weight, &g.scales, gb, bias, &gu.weight, &gu.scales, ub, &down.weight, &down.scales, db, state];
    let outputs: [(&[i32], Dtype); 6] = [
        (&[1, d], dt),
        (&[1, d], dt),
        (&[d], dt),
        (&[ROUTE_SLOTS], Dtype::Uint32),
        (&[ROUTE_SLOTS], Dtype::Float32),
        (&[k, f], dt),
    ];
    let outs = if timeline {
        stages::call_stamped(kern, &inputs, &outputs, nb, [grid, 1, 1], [threads, 1, 1], &template, "fused MoE kernel")?
    } else {
        stages::call_with_scratch(
            kern,
            || kernel(true, form),
            &inputs,
            &outputs,
            &["SCR_YN", "SCR_INDS", "SCR_SCORES", "SCR_HK"],
            state,
            [grid, 1, 1],
            [threads, 1, 1],
            &template,
        )?
    };
    if !timeline {
        BUILT.bump();
        if form.exact {
            BUILT_EXACT.bump();
        }
        if form.prefetch != 0 {
            BUILT_PREFETCH.bump();
        }
        if form.gate_rows == 2 {
            BUILT_GATE_ROWS.bump();
        }
        if form.down_cols == 2 {
            BUILT_DOWN_COLS.bump();
        }
    }
    Ok((outs, form))
}

#[cfg(test)]
pub(crate) fn launch_blocks(d: i32, f: i32, k: i32) -> i64 {
    blocks(d, f, k, Form { exact: true, prefetch: 0, gate_rows: 1, down_cols: 1 })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The launch's parts: a block of 32 warps for 32 gate/up rows of one
    /// chosen expert, for 32 / k down columns.
    #[test]
    fn a_launch_counts_its_parts() {
        let form = |gate_rows: u8, down_cols: u8| Form { exact: true, prefetch: 0, gate_rows, down_cols };
        assert_eq!(parts(2048, 1792, 4, form(1, 1)), (224, 256));
        assert_eq!(blocks(2048, 1792, 4, form(1, 1)), 481);
        assert_eq!(parts(2048, 256, 8, form(1, 1)), (64, 512));
        assert_eq!(parts(1024, 256, 3, form(1, 1)), (24, 103));
        // Two gate/up outputs a warp: half the gate/up blocks (rounded up
        // an expert), the 8B-A1B's 112 within an H100's 132 SMs; two down
        // columns a warp: half the down blocks (32 / k columns a block).
        assert_eq!(parts(2048, 1792, 4, form(2, 1)), (112, 256));
        assert_eq!(parts(2048, 256, 8, form(2, 1)), (32, 512));
        assert_eq!(parts(1536, 544, 3, form(2, 1)), (27, 154));
        assert_eq!(parts(2048, 1792, 4, form(1, 2)), (224, 128));
        assert_eq!(blocks(2048, 1792, 4, form(2, 2)), 241);
        assert_eq!(parts(1024, 256, 3, form(1, 2)), (24, 52));
        assert_eq!(parts(2048, 256, 1, form(1, 2)), (8, 32));
    }

    /// The rows whose registers fit the launch (`registers_fit`): the
    /// 8B-A1B's and every shape of the kernel's test, not the 8-bit or
    /// exact forms' rows that ptxas put past 64 registers.
    #[test]
    fn the_launch_fits_its_registers() {
        for (bits, d, exact) in [(4, 2048, false), (4, 2048, true), (8, 2048, true), (8, 1536, false), (8, 1024, true), (4, 1536, true)] {
            assert!(registers_fit(bits, d, exact), "{bits}-bit rows of {d}, exact {exact}");
        }
        assert!(registers_fit(4, 1152, false), "4-bit rows of 1,152: 64 registers or fewer in the default form");
        for (bits, d, exact) in [(8, 1056, false), (8, 1280, false), (8, 1792, false), (8, 1920, false), (4, 1152, true), (4, 1280, true)] {
            assert!(!registers_fit(bits, d, exact), "{bits}-bit rows of {d}, exact {exact}");
        }
        // Two gate/up outputs a warp: the 8B-A1B's rows with the experts
        // exact, not the forms and rows that ptxas put past 64.
        assert!(registers_fit_two(4, 2048, true, 4) && registers_fit_two(4, 1024, true, 1));
        for (bits, d, exact, k) in [(4, 2048, false, 4), (8, 2048, true, 4), (4, 1536, true, 4), (4, 3072, true, 4), (4, 4096, true, 4), (4, 2048, true, 8)] {
            assert!(!registers_fit_two(bits, d, exact, k), "{bits}-bit rows of {d}, exact {exact}, {k} experts, two outputs");
        }
    }

    /// A MoE layer's state holds its scratch rows at either activation
    /// size (the 8B-A1B's: ~37 KB), and its rows sit where the kernel
    /// expects them in bf16 (nvrtc-check's `moe_fused.rs@scratch` takes
    /// these places).
    #[test]
    fn a_moe_state_holds_its_scratch_rows() {
        for (d, f, k) in [(2048, 1792, 4), (1536, 512, 3), (1024, 256, 8), (64, 32, 1)] {
            for elem in [2, 4] {
                let end = stages::scratch_places(&scratch_bytes(d, f, k, elem)).1;
                assert!(state_words(d as usize, f as usize, k as usize) as i64 * 4 >= end, "{d} {f} {k} ({elem}-byte)");
            }
        }
        assert!(state_words(2048, 1792, 4) * 4 < 40 * 1024);
        assert_eq!(stages::scratch_places(&scratch_bytes(2048, 1792, 4, 2)).0, vec![256, 4352, 4608, 4864]);
    }
}
