//! Linear projections and the token embedding, dense or quantized as the
//! quant registry says.

use super::quant::QuantRegistry;
use super::weights::TensorStore;
use crate::error::{Error, Result};
use crate::mlx::distributed::Group;
use crate::mlx::{self, Array, Dtype, QuantSpec};

/// This process's part of a tensor-parallel model: rank `rank` of `size`
/// in `group`, whose `all_sum` joins the partial results of row-sharded
/// projections. Only models over more than one rank have one.
#[derive(Clone, Debug)]
pub struct Shard {
    pub group: Group,
    pub rank: usize,
    pub size: usize,
}

impl Shard {
    pub fn new(group: Group) -> Shard {
        Shard { rank: group.rank(), size: group.size(), group }
    }

    /// `count` (of `what`) split evenly, or an error naming them.
    pub fn part(&self, what: &str, count: usize) -> Result<usize> {
        if !count.is_multiple_of(self.size) {
            return Err(Error::config(format!(
                "tensor parallelism over {} ranks needs {what} ({count}) to be divisible by {}",
                self.size, self.size
            )));
        }
        Ok(count / self.size)
    }
}

/// The all_sum that joins row-sharded partial outputs (nothing on one rank).
pub fn reduce(shard: &Option<Shard>, y: Array) -> Result<Array> {
    match shard {
        Some(s) => s.group.all_sum(&y),
        None => Ok(y),
    }
}

/// How a projection (`[.., out, in]`) is cut across ranks.
#[derive(Clone, Copy)]
pub enum Split<'a> {
    /// Every rank holds all of it.
    Whole,
    /// Column-parallel: this rank keeps its part of each of `chunks` equal
    /// consecutive blocks of output rows (3 for the conv's B/C/x), so the
    /// local output is the same blocks, narrower.
    Out { shard: &'a Shard, chunks: usize },
    /// Row-parallel: this rank keeps its slice of the input axis; the
    /// outputs are partial sums, joined by an all_sum (a bias is kept on
    /// rank 0 only, so it is added once).
    In(&'a Shard),
}

/// `a` restricted to `idx` along `axis`: a gather, so the result owns new
/// memory and the full tensor it came from can be freed after load (a
/// slice would be a view that keeps all of it alive).
fn take_owned(a: &Array, idx: &[i32], axis: i32) -> Result<Array> {
    a.take(&Array::from_slice(idx, &[idx.len() as i32])?, axis)
}

/// Indices of this rank's rows: its `1/size` of each of `chunks` blocks of `n`.
fn out_rows(path: &str, n: i32, chunks: usize, s: &Shard) -> Result<Vec<i32>> {
    let block = n as usize / chunks;
    if !(n as usize).is_multiple_of(chunks) || !block.is_multiple_of(s.size) {
        return Err(Error::config(format!(
            "tensor parallelism over {} ranks cannot split the {n} outputs of `{path}` ({chunks} block(s))",
            s.size
        )));
    }
    let w = block / s.size;
    Ok((0..chunks).flat_map(|c| (c * block + s.rank * w..c * block + (s.rank + 1) * w).map(|i| i as i32)).collect())
}

fn in_range(start: i32, len: i32) -> Vec<i32> {
    (start..start + len).collect()
}

#[derive(Clone)]
pub struct Quantized {
    pub weight: Array,
    pub scales: Array,
    pub biases: Option<Array>,
    pub spec: QuantSpec,
}

#[derive(Clone)]
pub enum Weight {
    /// `[out, in]`, used as `x @ w.T`.
    Dense(Array),
    Quant(Quantized),
}

/// Loads this rank's part (`split`) of `<path>.weight`, whose logical shape
/// is `lead ++ [out, in]`. Quantized weights split on group boundaries.
pub fn load_weight_split(
    store: &mut TensorStore,
    reg: &QuantRegistry,
    path: &str,
    lead: &[i32],
    out: i32,
    inp: i32,
    split: Split,
) -> Result<Weight> {
    let w = load_weight(store, reg, path, lead, out, inp)?;
    split_weight(w, path, lead.len(), out, inp, split)
}

/// This rank's part (`split`) of `w` (logical shape `lead ++ [out, in]`,
/// `lead_len` leading axes).
pub fn split_weight(w: Weight, path: &str, lead_len: usize, out: i32, inp: i32, split: Split) -> Result<Weight> {
    let lead = vec![0; lead_len];
    match split {
        Split::Whole => Ok(w),
        Split::Out { shard, chunks } => {
            let rows = out_rows(path, out, chunks, shard)?;
            let axis = lead.len() as i32;
            Ok(match w {
                Weight::Dense(a) => Weight::Dense(take_owned(&a, &rows, axis)?),
                Weight::Quant(q) => Weight::Quant(Quantized {
                    weight: take_owned(&q.weight, &rows, axis)?,
                    scales: take_owned(&q.scales, &rows, axis)?,
                    biases: q.biases.as_ref().map(|b| take_owned(b, &rows, axis)).transpose()?,
                    spec: q.spec,
                }),
            })
        }
        Split::In(s) => {
            let axis = lead.len() as i32 + 1;
            let local = inp / s.size as i32;
            if inp % s.size as i32 != 0 {
                return Err(Error::config(format!(
                    "tensor parallelism over {} ranks cannot split the {inp} inputs of `{path}`",
                    s.size
                )));
            }
            let r = s.rank as i32;
            Ok(match w {
                Weight::Dense(a) => Weight::Dense(take_owned(&a, &in_range(r * local, local), axis)?),
                Weight::Quant(q) => {
                    let gs = q.spec.group_size;
                    if local % gs != 0 || (local * q.spec.bits) % 32 != 0 {
                        return Err(Error::config(format!(
                            "tensor parallelism over {} ranks cannot split `{path}`: {local} inputs per rank is not a \
                             whole number of quantization groups of {gs}",
                            s.size
                        )));
                    }
                    let (words, groups) = (local * q.spec.bits / 32, local / gs);
                    Weight::Quant(Quantized {
                        weight: take_owned(&q.weight, &in_range(r * words, words), axis)?,
                        scales: take_owned(&q.scales, &in_range(r * groups, groups), axis)?,
                        biases: q.biases.as_ref().map(|b| take_owned(b, &in_range(r * groups, groups), axis)).transpose()?,
                        spec: q.spec,
                    })
                }
            })
        }
    }
}

/// Loads `<path>.weight` of logical shape `lead ++ [out, in]`, quantized when
/// the registry lists `path`.
pub fn load_weight(store: &mut TensorStore, reg: &QuantRegistry, path: &str, lead: &[i32], out: i32, inp: i32) -> Result<Weight> {
    let shape = |last: i32| -> Vec<i32> { lead.iter().copied().chain([out, last]).collect() };
    match reg.get(path) {
        None => Ok(Weight::Dense(store.get_shaped(&format!("{path}.weight"), &shape(inp))?)),
        Some(spec) => {
            if inp % spec.group_size != 0 || (inp * spec.bits) % 32 != 0 {
                return Err(Error::load(format!(
                    "projection `{path}` has input width {inp}, which {} with group_size {} cannot pack",
                    spec.mode.name(),
                    spec.group_size
                )));
            }
            let weight = store.raw_shaped(&format!("{path}.weight"), &shape(inp * spec.bits / 32))?;
            if weight.dtype() != Dtype::Uint32 {
                return Err(Error::load(format!(
                    "quantized weight `{path}.weight` must be uint32, found {}",
                    weight.dtype()
                )));
            }
            let groups = inp / spec.group_size;
            // mx/nv fp formats store scales as uint8 (e8m0 / e4m3): keep them raw.
            let scales = store.raw_shaped(&format!("{path}.scales"), &shape(groups))?;
            let scales_ok = if spec.mode.has_biases() { scales.dtype().is_float() } else { scales.dtype() == Dtype::Uint8 };
            if !scales_ok {
                return Err(Error::load(format!(
                    "quantized scales `{path}.scales` have dtype {}, which {} does not use ({})",
                    scales.dtype(),
                    spec.mode.name(),
                    if spec.mode.has_biases() { "a floating-point dtype" } else { "uint8" }
                )));
            }
            let biases = if spec.mode.has_biases() {
                Some(store.get_shaped(&format!("{path}.biases"), &shape(groups))?)
            } else {
                None
            };
            Ok(Weight::Quant(Quantized { weight, scales, biases, spec }))
        }
    }
}

impl Weight {
    pub fn spec(&self) -> Option<QuantSpec> {
        match self {
            Weight::Dense(_) => None,
            Weight::Quant(q) => Some(q.spec),
        }
    }

    /// `x @ w.T`.
    pub fn apply(&self, x: &Array) -> Result<Array> {
        self.apply_cached(x, &Transposed::default())
    }

    /// `x @ w.T`, a dense `w.T` kept in `wt`.
    pub fn apply_cached(&self, x: &Array, wt: &Transposed) -> Result<Array> {
        match self {
            Weight::Dense(w) if crate::kernels::gemv::available(x, w) => crate::kernels::gemv::gemv(x, w),
            Weight::Dense(w) => wt.product(x, w),
            Weight::Quant(q) if crate::kernels::quant_gemv::available(x, q) => crate::kernels::quant_gemv::qgemv(x, q),
            Weight::Quant(q) => mlx::quantized_matmul(x, &q.weight, &q.scales, q.biases.as_ref(), true, q.spec),
        }
    }

    /// Logical element count (for parameter counts).
    pub fn params(&self) -> usize {
        match self {
            Weight::Dense(w) => w.size(),
            Weight::Quant(q) => q.weight.size() * 32 / q.spec.bits as usize,
        }
    }

    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Weight::Dense(w) => vec![w],
            Weight::Quant(q) => {
                let mut v = vec![&q.weight, &q.scales];
                v.extend(q.biases.as_ref());
                v
            }
        }
    }
}

/// A dense weight's transpose, made once as an evaluated view of it (no
/// copy), so that a step's graph holds no transpose node per projection:
/// MLX encodes every node of a step on the host, and on CUDA that host
/// work, not the GPU, bounds the decode rate (src/generate/timing.rs).
#[derive(Clone, Default)]
pub struct Transposed {
    t: std::cell::OnceCell<Array>,
    /// `w.T` as `[1, in, out]` (see [`Transposed::product`]).
    batch1: std::cell::OnceCell<Array>,
}

/// An evaluated view made once (see [`Transposed`]).
fn cached_view(cell: &std::cell::OnceCell<Array>, make: impl FnOnce() -> Result<Array>) -> Result<Array> {
    if let Some(t) = cell.get() {
        return Ok(t.clone());
    }
    let t = make()?;
    // Evaluated, the view is a leaf of any later graph. (Inside a function
    // transformation it cannot be evaluated, and stays a node of that
    // graph; the first use is a prefill, outside any.)
    if mlx::eval(&[&t]).is_ok() {
        let _ = cell.set(t.clone());
    }
    Ok(t)
}

/// Whether a stacked projection of `x` runs part by part
/// ([`Linear::forward_parts`]): opt-in (`MLX_LFM_PREFILL_SPLIT=1`), for
/// inputs of more than 32 rows (a prompt's; a decode step keeps its one
/// product). In the H200's profile of a 512-token prefill of the 1.2B
/// (session 9), elementwise ops on split views of the stacked outputs
/// (the conv's B/C/x gates, the SwiGLU gate, q/k/v's copies) ran MLX's
/// strided kernels: 68 launches, 683 µs of 4.4 ms.
pub fn split_products(x: &Array) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    // The switch first: an eager decode step asks once a layer or more.
    crate::kernels::opt_in("MLX_LFM_PREFILL_SPLIT", &ON) && x.ndim() >= 2 && x.size() / x.dim(-1).max(1) as usize > 32
}

/// On CUDA by default since session 14 (paired A/B on the H200: decode
/// +3% on the 350M, +5% on the 1.2B, its 512-token prefill +9%; the greedy
/// test kept the stock tokens), `MLX_LFM_BATCH1_MATMUL=0` off, `=1` on
/// elsewhere: see [`Transposed::product`].
fn batch1_matmul() -> bool {
    static ON: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    crate::kernels::cuda_default("MLX_LFM_BATCH1_MATMUL", &ON)
}

/// Whether a prompt's pass (more than one position) takes the one-batch
/// product too: unless `MLX_LFM_BATCH1_MATMUL_PROMPTS=0` (an A/B's knob:
/// session 24's rounds timed the 1.2B's 512-token prefill with the stock
/// path, the 2-D product among its differences, at 111,281 / 98,979 tok/s
/// against the defaults' 97,543 / 97,442, where session 14's A/B had
/// measured +9% for the one-batch product).
fn batch1_prompts() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::knobs::cached("MLX_LFM_BATCH1_MATMUL_PROMPTS", &ON, |v| v.map(str::trim) != Some("0"))
}

impl Transposed {
    /// `w.T` (`w` `[.., out, in]`), from the cache after its first use.
    pub fn of(&self, w: &Array) -> Result<Array> {
        cached_view(&self.t, || w.t())
    }

    /// `x @ w.T` for a dense 2-D `w`. MLX's matmul folds a `[B, T, in]`
    /// input against a 2-D weight to `[B*T, in]` and back, two nodes more
    /// than the product; with the switch on ([`batch1_matmul`]: CUDA's
    /// default), a one-batch input (every single-sequence step and prefill)
    /// meets the weight as a `[1, in, out]` view instead, a batched product
    /// of one that MLX builds as one node (a prompt's too, unless
    /// [`batch1_prompts`] says otherwise). (On other backends nothing has
    /// timed it against the 2-D product, so they keep that.)
    pub fn product(&self, x: &Array, w: &Array) -> Result<Array> {
        if x.ndim() == 3 && x.dim(0) == 1 && w.ndim() == 2 && batch1_matmul() && (x.dim(1) == 1 || batch1_prompts()) {
            let w3 = cached_view(&self.batch1, || self.of(w)?.expand_dims(0))?;
            return x.matmul(&w3);
        }
        x.matmul(&self.of(w)?)
    }
}

#[derive(Clone)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Array>,
    wt: Transposed,
}

impl Linear {
    pub fn load(store: &mut TensorStore, reg: &QuantRegistry, path: &str, inp: usize, out: usize, bias: bool) -> Result<Linear> {
        Linear::load_split(store, reg, path, inp, out, bias, Split::Whole)
    }

    /// This rank's part of the projection (see [`Split`]).
    pub fn load_split(
        store: &mut TensorStore,
        reg: &QuantRegistry,
        path: &str,
        inp: usize,
        out: usize,
        bias: bool,
        split: Split,
    ) -> Result<Linear> {
        let weight = load_weight_split(store, reg, path, &[], out as i32, inp as i32, split)?;
        let bias = if bias {
            let b = store.get_shaped(&format!("{path}.bias"), &[out as i32])?;
            match split {
                Split::Whole => Some(b),
                Split::Out { shard, chunks } => Some(take_owned(&b, &out_rows(path, out as i32, chunks, shard)?, 0)?),
                Split::In(s) if s.rank == 0 => Some(b),
                Split::In(_) => None,
            }
        } else {
            None
        };
        Ok(Linear::new(weight, bias))
    }

    pub fn new(weight: Weight, bias: Option<Array>) -> Linear {
        Linear { weight, bias, wt: Transposed::default() }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        match (&self.weight, &self.bias) {
            (Weight::Dense(w), Some(b)) => mlx::addmm(b, x, &self.wt.of(w)?, 1.0, 1.0),
            (w, None) => w.apply_cached(x, &self.wt),
            (w, Some(b)) => w.apply_cached(x, &self.wt)?.add(b),
        }
    }

    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.weight.arrays();
        v.extend(self.bias.as_ref());
        v
    }

    /// `forward(x)` cut into consecutive output blocks of `widths`, each
    /// its own product against those rows of the weight (a view), so that
    /// each block comes out contiguous: the ops after a prompt's stacked
    /// projection then read contiguous rows, where split views of one
    /// output are strided (see [`split_products`]).
    pub fn forward_parts(&self, x: &Array, widths: &[i32]) -> Result<Vec<Array>> {
        let mut out = Vec::with_capacity(widths.len());
        let mut at = 0;
        for &w in widths {
            let (a, b) = (at, at + w);
            at = b;
            let y = match &self.weight {
                Weight::Dense(wd) => x.matmul(&self.wt.of(wd)?.slice_axis(1, a, b)?)?,
                Weight::Quant(q) => {
                    let rows = |t: &Array| t.slice_axis(0, a, b);
                    let biases = q.biases.as_ref().map(rows).transpose()?;
                    mlx::quantized_matmul(x, &rows(&q.weight)?, &rows(&q.scales)?, biases.as_ref(), true, q.spec)?
                }
            };
            out.push(match &self.bias {
                Some(bias) => y.add(&bias.slice_axis(0, a, b)?)?,
                None => y,
            });
        }
        if at != self.weight.out_dim() {
            return Err(Error::invalid(format!("projection parts of {at} outputs for a weight of {}", self.weight.out_dim())));
        }
        Ok(out)
    }

    /// `(s, forward(rms_norm(s)))` for the pending norm `n` (`s` its
    /// residual sum): the add, the norm and this projection in one launch
    /// where the fused kernel serves them (src/kernels/norm_gemv.rs).
    pub fn forward_normed(&self, n: &Normed) -> Result<(Array, Array)> {
        use crate::kernels::norm_gemv;
        if let (Some(k), None) = (n.kernel_input(), &self.bias) {
            match &self.weight {
                Weight::Dense(w) if norm_gemv::dense_available(&k, w) => return norm_gemv::norm_gemv(&k, w),
                Weight::Quant(q) if norm_gemv::quant_available(&k, q) => return norm_gemv::norm_qgemv(&k, q),
                _ => {}
            }
        }
        let (s, x) = n.compute()?;
        Ok((s, self.forward(&x)?))
    }
}

/// `rms_norm(h + r) * w`, not yet computed: handed to the layer part that
/// reads it, whose first projection may fold the add and the norm into its
/// own launch. `s` (the residual sum, `h` without `r`) comes back with the
/// result either way.
pub struct Normed<'a> {
    pub h: &'a Array,
    pub r: Option<&'a Array>,
    pub w: &'a Array,
    pub eps: f32,
    /// `eps` as a float32 `[1]` array (the fused kernels read it).
    pub eps_array: &'a Array,
}

impl Normed<'_> {
    /// `(s, rms_norm(s) * w)` as separate ops (the fused add + RMSNorm
    /// kernel where it serves).
    pub fn compute(&self) -> Result<(Array, Array)> {
        let (h, w) = (self.h, self.w);
        match self.r {
            None => Ok((h.clone(), mlx::rms_norm(h, Some(w), self.eps)?)),
            Some(r) if crate::kernels::add_rms_norm::available(h, r, w) => {
                crate::kernels::add_rms_norm::add_rms_norm_with(h, r, w, self.eps_array, self.eps)
            }
            Some(r) => {
                let s = h.add(r)?;
                let y = mlx::rms_norm(&s, Some(w), self.eps)?;
                Ok((s, y))
            }
        }
    }

    /// The operands of the fused norm + GEMV kernels (there is a residual).
    pub fn kernel_input(&self) -> Option<crate::kernels::norm_gemv::NormIn<'_>> {
        self.r.map(|r| crate::kernels::norm_gemv::NormIn { h: self.h, r, wn: self.w, eps: self.eps_array, eps_value: Some(self.eps) })
    }
}

/// Token embedding; also the tied LM head.
#[derive(Clone)]
pub struct Embedding {
    pub weight: Weight,
    pub dtype: Dtype,
    /// The tied head's `E.T` (see [`Transposed`]).
    wt: Transposed,
}

impl Embedding {
    /// `dtype` is what a quantized table dequantizes to (the model's compute dtype).
    pub fn load(store: &mut TensorStore, reg: &QuantRegistry, path: &str, vocab: usize, dim: usize, dtype: Dtype) -> Result<Embedding> {
        let weight = load_weight(store, reg, path, &[], vocab as i32, dim as i32)?;
        let dtype = match &weight {
            Weight::Dense(w) => w.dtype(),
            Weight::Quant(_) => dtype,
        };
        Ok(Embedding { weight, dtype, wt: Transposed::default() })
    }

    /// Rows for `ids` (any shape) -> `ids.shape ++ [dim]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match &self.weight {
            Weight::Dense(w) => w.take(ids, 0),
            Weight::Quant(q) => {
                use crate::kernels::quant_embed;
                if let Some(b) = q.biases.as_ref().filter(|b| quant_embed::available(ids, &q.weight, &q.scales, Some(b), q.spec, self.dtype)) {
                    // CUDA (opt-in): the rows' gathers and their dequantize
                    // in one launch.
                    return quant_embed::embed(ids, &q.weight, &q.scales, b, q.spec, self.dtype);
                }
                let w = q.weight.take(ids, 0)?;
                let s = q.scales.take(ids, 0)?;
                let b = q.biases.as_ref().map(|b| b.take(ids, 0)).transpose()?;
                mlx::dequantize(&w, &s, b.as_ref(), q.spec, Some(self.dtype))
            }
        }
    }

    /// The tied head: `x @ E.T`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        self.weight.apply_cached(x, &self.wt)
    }
}

/// Whether projections that read the same input are stacked into one at
/// load (`MLX_LFM_FUSE_PROJECTIONS=0` keeps them apart, for A/B runs).
pub fn fuse_projections() -> bool {
    !matches!(crate::knobs::var("MLX_LFM_FUSE_PROJECTIONS").as_deref(), Some("0"))
}

impl Weight {
    /// The weights stacked along their output axis (`[.., out, in]`), so one
    /// matmul replaces several: each output row is still its own dot
    /// product over the same input. None when they cannot be stacked (dense
    /// next to quantized, different quantization, dtypes or input widths).
    pub fn stack_outputs(parts: &[&Weight]) -> Result<Option<Weight>> {
        let first = match parts.first() {
            Some(w) => *w,
            None => return Ok(None),
        };
        let same_tail = |a: &Array, b: &Array| {
            let (sa, sb) = (a.shape(), b.shape());
            sa.len() == sb.len() && a.dtype() == b.dtype() && sa[..sa.len() - 2] == sb[..sb.len() - 2] && sa.last() == sb.last()
        };
        let cat = |arrs: Vec<&Array>| -> Result<Array> {
            let axis = arrs[0].ndim() as i32 - 2;
            crate::mlx::concatenate(&arrs, axis)
        };
        match first {
            Weight::Dense(w0) => {
                let mut ws = vec![];
                for p in parts {
                    match p {
                        Weight::Dense(w) if same_tail(w0, w) => ws.push(w),
                        _ => return Ok(None),
                    }
                }
                Ok(Some(Weight::Dense(cat(ws)?)))
            }
            Weight::Quant(q0) => {
                let mut qs = vec![];
                for p in parts {
                    match p {
                        Weight::Quant(q)
                            if q.spec == q0.spec
                                && same_tail(&q0.weight, &q.weight)
                                && same_tail(&q0.scales, &q.scales)
                                && match (&q0.biases, &q.biases) {
                                    (Some(a), Some(b)) => same_tail(a, b),
                                    (None, None) => true,
                                    _ => false,
                                } =>
                        {
                            qs.push(q)
                        }
                        _ => return Ok(None),
                    }
                }
                let biases = match q0.biases {
                    Some(_) => Some(cat(qs.iter().map(|q| q.biases.as_ref().unwrap()).collect())?),
                    None => None,
                };
                Ok(Some(Weight::Quant(Quantized {
                    weight: cat(qs.iter().map(|q| &q.weight).collect())?,
                    scales: cat(qs.iter().map(|q| &q.scales).collect())?,
                    biases,
                    spec: q0.spec,
                })))
            }
        }
    }

    /// Output width (the `out` of `[.., out, in]`).
    pub fn out_dim(&self) -> i32 {
        match self {
            Weight::Dense(w) => w.dim(-2),
            Weight::Quant(q) => q.weight.dim(-2),
        }
    }
}

/// Projections of one input (attention's q, k, v; the MLP's gate and up):
/// stacked into one matmul where they can be (one kernel instead of
/// several on a decode step, and a larger one that reads memory faster),
/// split back by output width.
pub enum Projections {
    Stacked { linear: Linear, widths: Vec<i32> },
    Separate(Vec<Linear>),
}

impl Projections {
    pub fn new(parts: Vec<Linear>) -> Result<Projections> {
        let bias_dtype = |p: &Linear| p.bias.as_ref().map(|b| b.dtype());
        if parts.len() < 2 || !fuse_projections() || parts.iter().any(|p| bias_dtype(p) != bias_dtype(&parts[0])) {
            return Ok(Projections::Separate(parts));
        }
        let weights: Vec<&Weight> = parts.iter().map(|p| &p.weight).collect();
        let Some(weight) = Weight::stack_outputs(&weights)? else {
            return Ok(Projections::Separate(parts));
        };
        let bias = match parts[0].bias {
            Some(_) => {
                let bs: Vec<&Array> = parts.iter().map(|p| p.bias.as_ref().unwrap()).collect();
                Some(crate::mlx::concatenate(&bs, 0)?)
            }
            None => None,
        };
        let widths = parts.iter().map(|p| p.weight.out_dim()).collect();
        Ok(Projections::Stacked { linear: Linear::new(weight, bias), widths })
    }

    /// `(s, each projection of rms_norm(s))` for the pending norm `n`: one
    /// fused launch for stacked projections where the kernel serves them.
    pub fn forward_normed(&self, n: &Normed) -> Result<(Array, Vec<Array>)> {
        match self {
            Projections::Stacked { linear, widths } if split_products(n.h) => {
                let (s, x) = n.compute()?;
                Ok((s, linear.forward_parts(&x, widths)?))
            }
            Projections::Stacked { linear, widths } => {
                let (s, y) = linear.forward_normed(n)?;
                Ok((s, split_widths(&y, widths)?))
            }
            Projections::Separate(_) => {
                let (s, x) = n.compute()?;
                Ok((s, self.forward(&x)?))
            }
        }
    }

    /// `(s, the stacked projections of rms_norm(s), unsplit)` where they
    /// are one product (a decode step's, or a prompt's, for a kernel that
    /// reads each part where it lies); None where they are not stacked or a
    /// prompt's rows take them part by part (`MLX_LFM_PREFILL_SPLIT`).
    pub fn forward_normed_stacked(&self, n: &Normed) -> Result<Option<(Array, Array)>> {
        match self {
            Projections::Stacked { linear, .. } if !split_products(n.h) => Ok(Some(linear.forward_normed(n)?)),
            _ => Ok(None),
        }
    }

    /// The stacked parts' widths (None where the projections are separate).
    pub fn stacked_widths(&self) -> Option<&[i32]> {
        match self {
            Projections::Stacked { widths, .. } => Some(widths),
            Projections::Separate(_) => None,
        }
    }

    /// Each projection of `x`, in the order given to `new`.
    pub fn forward(&self, x: &Array) -> Result<Vec<Array>> {
        match self {
            Projections::Separate(ps) => ps.iter().map(|p| p.forward(x)).collect(),
            Projections::Stacked { linear, widths } if split_products(x) => linear.forward_parts(x, widths),
            Projections::Stacked { linear, widths } => {
                let y = linear.forward(x)?;
                split_widths(&y, widths)
            }
        }
    }

    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Projections::Separate(ps) => ps.iter().flat_map(|p| p.arrays()).collect(),
            Projections::Stacked { linear, .. } => linear.arrays(),
        }
    }

    /// Logical parameters (weights and biases).
    pub fn params(&self) -> usize {
        let lin = |p: &Linear| p.weight.params() + p.bias.as_ref().map(|b| b.size()).unwrap_or(0);
        match self {
            Projections::Separate(ps) => ps.iter().map(lin).sum(),
            Projections::Stacked { linear, .. } => lin(linear),
        }
    }
}

/// `y`'s last axis cut into consecutive pieces of `widths` (views, no copy).
pub fn split_widths(y: &Array, widths: &[i32]) -> Result<Vec<Array>> {
    if widths.len() < 2 {
        return Ok(vec![y.clone()]);
    }
    // One split node rather than a slice a part: a decode step's host cost
    // is its node count (src/generate/timing.rs).
    let mut cuts = Vec::with_capacity(widths.len() - 1);
    let mut at = 0;
    for &w in &widths[..widths.len() - 1] {
        at += w;
        cuts.push(at);
    }
    y.split_at(&cuts, -1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mlx::random::normal;

    /// A dense projection's graph, after its first use, holds the matmul
    /// and no transpose of the weight (the host encodes every node of a
    /// decode step), with the same result as `x @ w.T`.
    #[test]
    fn dense_projection_reuses_its_transposed_weight() {
        let w = normal(&[48, 64], Dtype::Float32, 0.0, 0.1, None).unwrap();
        let b = normal(&[48], Dtype::Float32, 0.0, 0.1, None).unwrap();
        let x = normal(&[3, 64], Dtype::Float32, 0.0, 1.0, None).unwrap();
        for bias in [None, Some(b.clone())] {
            let lin = Linear::new(Weight::Dense(w.clone()), bias.clone());
            let first = lin.forward(&x).unwrap();
            mlx::eval(&[&first]).unwrap();
            let y = lin.forward(&x).unwrap();
            let ops = mlx::graph_ops(&[&y]).unwrap();
            assert!(ops.iter().all(|(name, _)| name != "Transpose"), "bias {}: {ops:?}", bias.is_some());
            let mut want = x.matmul(&w.t().unwrap()).unwrap();
            if let Some(b) = &bias {
                want = want.add(b).unwrap();
            }
            let (got, want): (Vec<f32>, Vec<f32>) = (y.to_vec().unwrap(), want.to_vec().unwrap());
            let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-5, "bias {}: {worst} from x @ w.T", bias.is_some());
        }
        // With the one-batch product on (opt-in): one node for a [1, T, K]
        // input, the same values; inputs of more batches fold as before.
        crate::kernels::with_opt_in(|| {
            let lin = Linear::new(Weight::Dense(w.clone()), None);
            for x3 in [x.reshape(&[1, 3, 64]).unwrap(), x.reshape(&[3, 1, 64]).unwrap()] {
                mlx::eval(&[&lin.forward(&x3).unwrap()]).unwrap();
                let y = lin.forward(&x3).unwrap();
                let ops = mlx::graph_ops(&[&y]).unwrap();
                let want = x3.matmul(&w.t().unwrap()).unwrap();
                assert_eq!(y.shape(), want.shape());
                let (got, want): (Vec<f32>, Vec<f32>) = (y.to_vec().unwrap(), want.to_vec().unwrap());
                let worst = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(worst <= 1e-5, "{:?}: {worst} from x @ w.T", x3.shape());
                if x3.dim(0) == 1 {
                    assert_eq!(ops, vec![("Matmul".to_string(), 1)], "{:?}", x3.shape());
                } else {
                    assert!(ops.iter().any(|(n, _)| n == "Flatten"), "{:?}: {ops:?}", x3.shape());
                }
            }
        });
        // The count itself: a fresh projection's graph has the transpose.
        let fresh = x.matmul(&w.t().unwrap()).unwrap();
        let ops = mlx::graph_ops(&[&fresh]).unwrap();
        assert_eq!(ops.iter().find(|(n, _)| n == "Transpose").map(|(_, c)| *c), Some(1), "{ops:?}");
    }
}

#[cfg(test)]
mod batch1_tests {
    use super::Transposed;
    use crate::knobs::with_overrides;
    use crate::mlx::{self, random::normal, Dtype};

    /// With the one-batch product on, a decode step's `[1, 1, K]` row takes
    /// it (one node) and a prompt's `[1, T, K]` too, unless
    /// `MLX_LFM_BATCH1_MATMUL_PROMPTS=0` folds the prompt to 2-D and back
    /// (three nodes); the products are the same.
    #[test]
    fn prompts_can_keep_the_two_d_product() {
        let w = normal(&[24, 32], Dtype::Float32, 0.0, 1.0, None).unwrap();
        let row = normal(&[1, 1, 32], Dtype::Float32, 0.0, 1.0, None).unwrap();
        let prompt = normal(&[1, 7, 32], Dtype::Float32, 0.0, 1.0, None).unwrap();
        mlx::eval(&[&w, &row, &prompt]).unwrap();
        let nodes = |a: &crate::mlx::Array| -> usize { mlx::graph_ops(&[a]).unwrap().iter().map(|(_, n)| n).sum() };
        let run = |prompts: &str| {
            let set = [
                ("MLX_LFM_BATCH1_MATMUL".to_string(), Some("1".to_string())),
                ("MLX_LFM_BATCH1_MATMUL_PROMPTS".to_string(), Some(prompts.to_string())),
            ];
            with_overrides(&set, || {
                let t = Transposed::default();
                (t.product(&row, &w).unwrap(), t.product(&prompt, &w).unwrap())
            })
        };
        let (r1, p1) = run("1");
        let (r0, p0) = run("0");
        assert_eq!((nodes(&r1), nodes(&p1)), (1, 1), "the one-batch product: {:?}", mlx::graph_ops(&[&p1]).unwrap());
        assert_eq!((nodes(&r0), nodes(&p0)), (1, 3), "prompts folded to 2-D: {:?}", mlx::graph_ops(&[&p0]).unwrap());
        let f = |a: &crate::mlx::Array| a.to_vec::<f32>().unwrap();
        assert_eq!(p0.shape(), vec![1, 7, 24]);
        let (a, b) = (f(&p0), f(&p1));
        assert!(a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-4 * x.abs().max(1.0)), "{a:?} vs {b:?}");
    }
}
