//! LFM2-MoE's sparse feed-forward: a sigmoid router whose `expert_bias` only
//! steers selection, and SwiGLU experts run through gathered matmuls.
//!
//! Expert dispatch:
//! - many routed rows in a prefill: rows are sorted by expert so each
//!   expert's weights are read once (`sorted` gather kernels);
//! - few rows, and every decode step: direct gathered matmuls, no sort.
//!
//! MLX's CPU backend only runs `gather_mm` in float32. For a bf16/f16 model
//! on CPU we therefore never call it: decode gathers just the k selected
//! experts' weights and upcasts those (cost ~ active parameters), prefill
//! groups rows by expert on the host and runs one ordinary matmul per expert
//! in the model's own dtype. Nothing is converted at load, so memory stays
//! that of the checkpoint.

use super::activations::swiglu;
use super::config::ModelConfig;
use super::linear::{fuse_projections, load_weight, reduce, split_weight, split_widths, Linear, Shard, Split, Weight};
use super::quant::QuantRegistry;
use super::weights::TensorStore;
use crate::error::{Error, Result};
use crate::mlx::{self, concatenate, runtime, stack, Array, Dtype};

/// Routed rows at or above which the sorted path is used (mlx-lm's rule).
const SORT_THRESHOLD: usize = 64;

/// `x` `[.., D]` as rows: (their count, D, the leading shape).
fn rows_of(x: &Array) -> (i32, i32, Vec<i32>) {
    let mut lead = x.shape();
    let d = lead.pop().unwrap_or(1);
    (lead.iter().product(), d, lead)
}

/// `a` in `shape`, without a reshape node where it already is.
fn shaped(a: &Array, shape: &[i32]) -> Result<Array> {
    if a.shape() == shape {
        Ok(a.clone())
    } else {
        a.reshape(shape)
    }
}

pub struct SparseMoe {
    pub gate: Linear,
    pub expert_bias: Option<Array>,
    /// Stacked experts `[E, out, in]` (dense or quantized); gate and up
    /// stacked into one where they can be.
    pub gate_up: GateUp,
    pub down_proj: Weight,
    pub num_experts: usize,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    /// Dense non-f32 experts on MLX's CPU backend (see the module note).
    cpu_non_f32: bool,
    /// Prefill groups rows per expert on the host (see `host_grouped`).
    pub grouped_prefill: bool,
    /// The fused router's selection bias (zeros without one) and scale,
    /// made once rather than uploaded per layer per token.
    router_consts: (Array, Array),
    /// The one-launch layer's counters (`kernels::moe_fused`), made on the
    /// device once: only that kernel, on this layer, touches them.
    fused_state: Array,
    /// Tensor parallel: every expert's hidden width is split across the
    /// ranks (gate/up column-sharded, down row-sharded) with the router
    /// replicated, so each rank runs the same routing over its slice of
    /// every chosen expert and one all_sum per layer joins them.
    pub shard: Option<Shard>,
}

fn stack_experts(st: &mut TensorStore, p: &str, names: &[&str], e: usize, out: i32, inp: i32) -> Result<Weight> {
    let mut ws = Vec::with_capacity(e);
    for i in 0..e {
        let found = names.iter().map(|n| format!("{p}.experts.{i}.{n}.weight")).find(|n| st.has(n));
        let name = found.ok_or_else(|| {
            Error::load(format!("checkpoint is missing tensor `{p}.experts.{i}.{}.weight`", names[0]))
        })?;
        ws.push(st.get_shaped(&name, &[out, inp])?);
    }
    let refs: Vec<&Array> = ws.iter().collect();
    Ok(Weight::Dense(stack(&refs, 0)?))
}

/// MLX_LFM_MOE_PREFILL: `grouped` (per-expert matmuls after a host-side
/// grouping) or `gathered` (MLX's sorted gather kernels, mlx-lm's way).
/// Default: grouped on the GPU, gathered on CPU.
fn grouped_prefill() -> Result<bool> {
    match crate::knobs::var("MLX_LFM_MOE_PREFILL").as_deref() {
        None | Some("") => Ok(runtime::default_device() == runtime::DeviceType::Gpu),
        Some("grouped") => Ok(true),
        Some("gathered") => Ok(false),
        Some(v) => Err(Error::config(format!("MLX_LFM_MOE_PREFILL={v} is not valid; use grouped or gathered"))),
    }
}

impl SparseMoe {
    pub fn load(st: &mut TensorStore, reg: &QuantRegistry, p: &str, c: &ModelConfig, shard: Option<&Shard>) -> Result<SparseMoe> {
        let m = c.moe.as_ref().expect("MoE layer in a dense config");
        let (d, ff, e) = (c.hidden_size as i32, m.moe_ff_dim as i32, m.num_experts);
        let (gate_proj, up_proj, down_proj) = if st.has(&format!("{p}.switch_mlp.gate_proj.weight")) {
            let sp = format!("{p}.switch_mlp");
            (
                load_weight(st, reg, &format!("{sp}.gate_proj"), &[e as i32], ff, d)?,
                load_weight(st, reg, &format!("{sp}.up_proj"), &[e as i32], ff, d)?,
                load_weight(st, reg, &format!("{sp}.down_proj"), &[e as i32], d, ff)?,
            )
        } else {
            (
                stack_experts(st, p, &["w1", "gate_proj"], e, ff, d)?,
                stack_experts(st, p, &["w3", "up_proj"], e, ff, d)?,
                stack_experts(st, p, &["w2", "down_proj"], e, d, ff)?,
            )
        };
        let (gate_proj, up_proj, down_proj, ff) = match shard {
            Some(s) => {
                let cols = Split::Out { shard: s, chunks: 1 };
                (
                    split_weight(gate_proj, &format!("{p} gate_proj"), 1, ff, d, cols)?,
                    split_weight(up_proj, &format!("{p} up_proj"), 1, ff, d, cols)?,
                    split_weight(down_proj, &format!("{p} down_proj"), 1, d, ff, Split::In(s))?,
                    ff / s.size as i32,
                )
            }
            None => (gate_proj, up_proj, down_proj, ff),
        };
        let expert_bias = if m.use_expert_bias {
            // Selection is done in float32, like the reference.
            let b = st.raw_shaped(&format!("{p}.expert_bias"), &[e as i32])?;
            if !b.dtype().is_float() {
                return Err(Error::load(format!("tensor `{p}.expert_bias` has dtype {}; a floating-point tensor is expected", b.dtype())));
            }
            Some(b.astype(Dtype::Float32)?)
        } else {
            None
        };
        let dense_dtype = match &gate_proj {
            Weight::Dense(w) => Some(w.dtype()),
            Weight::Quant(_) => None,
        };
        let stacked = if fuse_projections() { Weight::stack_outputs(&[&gate_proj, &up_proj])? } else { None };
        let gate_up = match stacked {
            Some(w) => GateUp::Stacked(w, ff),
            None => GateUp::Separate(gate_proj, up_proj),
        };
        let router_consts = (
            match &expert_bias {
                Some(b) => b.clone(),
                None => mlx::zeros(&[e as i32], Dtype::Float32)?,
            },
            Array::from_slice(&[m.routed_scaling_factor], &[1])?,
        );
        // (Counters, and room for the one-launch layer's scratch rows:
        // MLX_LFM_SCRATCH_IN_STATE.)
        let fused_state = crate::kernels::stages::new_counters_of(crate::kernels::moe_fused::state_words(
            d as usize,
            ff as usize,
            m.experts_per_token,
        ))?;
        Ok(SparseMoe {
            gate: Linear::load(st, reg, &format!("{p}.gate"), d as usize, e, false)?,
            expert_bias,
            gate_up,
            down_proj,
            num_experts: e,
            top_k: m.experts_per_token,
            norm_topk_prob: m.norm_topk_prob,
            routed_scaling_factor: m.routed_scaling_factor,
            cpu_non_f32: runtime::default_device() == runtime::DeviceType::Cpu
                && dense_dtype.is_some_and(|dt| dt != Dtype::Float32),
            grouped_prefill: grouped_prefill()?,
            router_consts,
            fused_state,
            shard: shard.cloned(),
        })
    }

    /// Chosen experts `[B, T, k]` and their weights `[B, T, k]` (in x's
    /// dtype): one fused kernel on MLX's CUDA backend, the stock ops
    /// elsewhere.
    pub fn route(&self, x: &Array) -> Result<(Array, Array)> {
        let (rows, d, lead) = rows_of(x);
        if let (Weight::Quant(q), None) = (&self.gate.weight, &self.gate.bias) {
            if crate::kernels::moe_router::gate_available(rows, d, x.dtype(), q, self.top_k) {
                let (bias, scale) = &self.router_consts;
                let (inds, scores) =
                    crate::kernels::moe_router::route_gate(&shaped(x, &[rows, d])?, q, bias, scale, self.top_k, self.norm_topk_prob)?;
                let out = [lead.as_slice(), &[self.top_k as i32]].concat();
                return Ok((shaped(&inds, &out)?, shaped(&scores, &out)?));
            }
        }
        if crate::kernels::moe_router::available(self.num_experts, self.top_k) && x.dtype().is_float() {
            return self.route_fused(x);
        }
        self.route_stock(x)
    }

    pub(crate) fn route_fused(&self, x: &Array) -> Result<(Array, Array)> {
        let (rows, _, lead) = rows_of(x);
        let e = self.num_experts as i32;
        let probs = shaped(&self.gate.forward(x)?.sigmoid()?, &[rows, e])?;
        let (bias, scale) = &self.router_consts;
        let (inds, scores) = crate::kernels::moe_router::route(&probs, bias, scale, self.top_k, self.norm_topk_prob)?;
        let out = [lead.as_slice(), &[self.top_k as i32]].concat();
        // The gate may be stored in another dtype than the activations
        // (an f32 router beside bf16 layers): weights in x's dtype, as the
        // stock path returns them.
        Ok((shaped(&inds, &out)?, shaped(&scores, &out)?.astype(x.dtype())?))
    }

    /// The router in MLX's stock ops (every backend but CUDA).
    pub(crate) fn route_stock(&self, x: &Array) -> Result<(Array, Array)> {
        let k = self.top_k as i32;
        let probs = self.gate.forward(x)?.sigmoid()?;
        let select = match &self.expert_bias {
            Some(b) => probs.astype(Dtype::Float32)?.add(b)?,
            None => probs.clone(),
        };
        let e = self.num_experts as i32;
        let inds = select.argpartition(e - k, -1)?.slice_axis(-1, e - k, e)?.stop_gradient()?;
        #[cfg(test)]
        if route_margins::recording() {
            route_margins::record(&select, &probs, k as usize)?;
        }
        let mut scores = probs.take_along_axis(&inds, -1)?;
        if self.norm_topk_prob {
            scores = scores.div(&scores.sum(&[-1], true)?.add_scalar(1e-6)?)?;
        }
        if self.routed_scaling_factor != 1.0 {
            scores = scores.mul_scalar(self.routed_scaling_factor as f64)?;
        }
        Ok((inds, scores.astype(x.dtype())?))
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        if let Some(y) = self.fused_forward(x)? {
            return reduce(&self.shard, y);
        }
        if x.ndim() == 2 {
            // A decode step's rows (`decode_rows`): the stock experts run
            // over `[B, T, D]`.
            return self.forward(&x.expand_dims(1)?)?.squeeze(1);
        }
        let (inds, scores) = self.route(x)?;
        if let Some(y) = self.grouped_combined(x, &inds, &scores)? {
            return reduce(&self.shard, y);
        }
        let y = self.experts(x, &inds)?;
        reduce(&self.shard, y.mul(&scores.expand_dims(-1)?)?.sum(&[-2], false)?)
    }

    /// The router and the experts as the one-launch conv + MoE layer reads
    /// them (src/kernels/conv_layer_fused.rs): a quantized gate without a
    /// bias, quantized experts with gate/up stacked; None otherwise or
    /// under tensor parallelism (a rank's output is reduced first).
    pub(crate) fn stage_moe(&self) -> Option<crate::kernels::conv_layer_fused::Moe<'_>> {
        let (Weight::Quant(gate), None) = (&self.gate.weight, &self.gate.bias) else { return None };
        let (GateUp::Stacked(Weight::Quant(gate_up), _), Weight::Quant(down)) = (&self.gate_up, &self.down_proj) else {
            return None;
        };
        if self.shard.is_some() {
            return None;
        }
        Some(crate::kernels::conv_layer_fused::Moe {
            gate,
            bias: &self.router_consts.0,
            gate_up,
            down,
            k: self.top_k,
            norm: self.norm_topk_prob,
            scale: self.routed_scaling_factor,
        })
    }

    /// A decode step's layer from its pending norm `n` (rows `[R, D]`, one
    /// token each): the residual add, the norm and the router in one launch
    /// (`kernels::moe_router::route_gate_norm`), then the experts' two
    /// kernels: `(the residual sum, the output)`, or None where those
    /// kernels do not all serve (the caller computes the norm).
    pub fn forward_normed(&self, n: &crate::kernels::norm_gemv::NormIn, eps: f32) -> Result<Option<(Array, Array)>> {
        use crate::kernels::{moe_experts, moe_fused, moe_router};
        let (Weight::Quant(g), None) = (&self.gate.weight, &self.gate.bias) else { return Ok(None) };
        if !moe_router::gate_norm_available(n, g, self.top_k) {
            return Ok(None);
        }
        let (GateUp::Stacked(Weight::Quant(gu), _), Weight::Quant(down)) = (&self.gate_up, &self.down_proj) else {
            return Ok(None);
        };
        let (rows, dt) = (n.h.dim(0), n.h.dtype());
        if !moe_experts::available(rows, self.top_k, dt, gu, down) {
            return Ok(None);
        }
        let (bias, scale) = &self.router_consts;
        if moe_fused::available(n, g, gu, down, self.top_k) {
            let (k, norm, sf) = (self.top_k, self.norm_topk_prob, self.routed_scaling_factor);
            let (s, out) = moe_fused::forward(n, g, bias, gu, down, &self.fused_state, k, norm, eps, sf)?;
            return Ok(Some((s, reduce(&self.shard, out)?)));
        }
        let consts = Some((eps, self.routed_scaling_factor));
        let (s, y, idx, scores) = moe_router::route_gate_norm(n, g, bias, scale, self.top_k, self.norm_topk_prob, consts)?;
        let h = moe_experts::gate_up(&y, &idx, gu)?;
        let out = moe_experts::down(&h, &idx, &scores, down)?;
        Ok(Some((s, reduce(&self.shard, out)?)))
    }

    /// A decode step's layer on CUDA: the router and the experts' two
    /// kernels (src/kernels/moe_experts.rs) over the step's rows `[R, D]`,
    /// with no reshape between them (each is a node the host encodes every
    /// step, and the host bounds the decode rate there); the output
    /// `[B, T, D]`. For quantized experts with gate and up stacked; None
    /// where the kernels do not serve.
    fn fused_forward(&self, x: &Array) -> Result<Option<Array>> {
        use crate::kernels::moe_experts;
        // A decode step's rows `[B, D]` (`decode_rows`) are one token each.
        let as_rows = x.ndim() == 2;
        let (b, t, d) = if as_rows { (x.dim(0), 1, x.dim(1)) } else { (x.dim(0), x.dim(1), x.dim(2)) };
        let k = self.top_k;
        // Only where the stock path gathers directly (see `experts`).
        if t > 1 && (b * t) as usize * k >= SORT_THRESHOLD {
            return Ok(None);
        }
        let (GateUp::Stacked(Weight::Quant(gu), _), Weight::Quant(down)) = (&self.gate_up, &self.down_proj) else {
            return Ok(None);
        };
        if !moe_experts::available(b * t, k, x.dtype(), gu, down) {
            return Ok(None);
        }
        let rows = if as_rows { x.clone() } else { x.reshape(&[b * t, d])? };
        let (idx, scores) = self.route(&rows)?;
        // The kernels read uint32 experts and weights in x's dtype (what
        // `route` gives on CUDA; anything else takes the stock experts).
        if idx.dtype() != Dtype::Uint32 || scores.dtype() != x.dtype() {
            return Ok(None);
        }
        let h = moe_experts::gate_up(&rows, &idx, gu)?;
        let y = moe_experts::down(&h, &idx, &scores, down)?;
        Ok(Some(if as_rows { y } else { y.reshape(&[b, t, d])? }))
    }

    /// SwiGLU of each row through each of its k experts: `[B, T, k, D]`.
    pub fn experts(&self, x: &Array, inds: &Array) -> Result<Array> {
        let (b, t, d) = (x.dim(0), x.dim(1), x.dim(2));
        let k = self.top_k as i32;
        // Sorting pays only for many rows, and only in a prefill: a decode
        // step (one token per row, however many rows) gathers directly. It
        // must: the compiled step traces it, and the host-grouped path
        // reads the expert counts back to the host.
        let many = t > 1 && (b * t * k) as usize >= SORT_THRESHOLD;
        if self.cpu_non_f32 {
            return if many { self.host_grouped(x, inds) } else { self.gathered_upcast(x, inds) };
        }
        if many && self.grouped_prefill {
            if let Some(y) = self.grouped_kernel(x, inds)? {
                return Ok(y);
            }
            return self.host_grouped(x, inds);
        }
        if many {
            let flat = inds.reshape(&[-1])?;
            let order = flat.argsort(0)?;
            let inv = order.argsort(0)?;
            let rows = order.floor_divide_scalar(k as f64)?;
            let xs = x.reshape(&[b * t, 1, d])?.take(&rows, 0)?;
            let idx = flat.take(&order, 0)?;
            let y = self.swiglu_gathered(&xs, &idx, true)?; // [n, 1, D]
            y.take(&inv, 0)?.reshape(&[b, t, k, d])
        } else {
            let xe = x.reshape(&[b, t, 1, 1, d])?;
            let y = self.swiglu_gathered(&xe, inds, false)?; // [B, T, k, 1, D]
            y.squeeze(-2)
        }
    }

    fn swiglu_gathered(&self, x: &Array, idx: &Array, sorted: bool) -> Result<Array> {
        let (g, u) = self.gate_up.apply(|w| gathered(w, x, idx, sorted))?;
        gathered(&self.down_proj, &swiglu(&g, &u)?, idx, sorted)
    }

    /// Few rows on CPU with non-f32 experts: take the selected experts and
    /// run them in float32.
    fn gathered_upcast(&self, x: &Array, inds: &Array) -> Result<Array> {
        let (b, t, d) = (x.dim(0), x.dim(1), x.dim(2));
        let k = self.top_k as i32;
        let flat = inds.reshape(&[-1])?;
        let xs = x
            .reshape(&[b * t, 1, 1, d])?
            .broadcast_to(&[b * t, k, 1, d])?
            .reshape(&[b * t * k, 1, d])?
            .astype(Dtype::Float32)?;
        let sel = |w: &Weight| -> Result<Array> {
            match w {
                Weight::Dense(w) => w.take(&flat, 0)?.astype(Dtype::Float32),
                Weight::Quant(_) => unreachable!("quantized experts do not take the upcast path"),
            }
        };
        let (g, u) = self.gate_up.apply(|w| xs.matmul(&sel(w)?.t()?))?;
        let y = swiglu(&g, &u)?.matmul(&sel(&self.down_proj)?.t()?)?;
        y.astype(x.dtype())?.reshape(&[b, t, k, d])
    }

    /// Many rows: sort rows by expert, read the per-expert counts on the host
    /// (one sync per MoE layer per prefill chunk), then one ordinary (or
    /// quantized) matmul chain per expert over its contiguous rows. On the
    /// GPU this beats MLX's sorted gather kernels by a wide margin; on CPU it
    /// is how non-f32 experts run at all.
    fn host_grouped(&self, x: &Array, inds: &Array) -> Result<Array> {
        let (b, t, d) = (x.dim(0), x.dim(1), x.dim(2));
        let k = self.top_k as i32;
        let flat = inds.reshape(&[-1])?;
        let order = flat.argsort(0)?;
        let inv = order.argsort(0)?;
        let sorted_ids: Vec<u32> = flat.take(&order, 0)?.to_vec()?;
        let rows = order.floor_divide_scalar(k as f64)?;
        let xs = x.reshape(&[b * t, d])?.take(&rows, 0)?;
        let mut outs = Vec::new();
        let mut start = 0usize;
        while start < sorted_ids.len() {
            let e = sorted_ids[start] as i32;
            let mut end = start;
            while end < sorted_ids.len() && sorted_ids[end] as i32 == e {
                end += 1;
            }
            let seg = xs.slice_axis(0, start as i32, end as i32)?;
            let (g, u) = self.gate_up.apply(|w| expert_apply(w, e, &seg))?;
            outs.push(expert_apply(&self.down_proj, e, &swiglu(&g, &u)?)?);
            start = end;
        }
        let refs: Vec<&Array> = outs.iter().collect();
        concatenate(&refs, 0)?.take(&inv, 0)?.reshape(&[b, t, k, d])
    }

    /// Many rows through both projections as grouped GEMMs, one launch
    /// each (src/kernels/moe_gemm.rs), the rows sorted by expert on the GPU
    /// and no count read back to the host: for quantized experts with gate
    /// and up stacked; None where the kernel does not serve.
    pub(crate) fn grouped_kernel(&self, x: &Array, inds: &Array) -> Result<Option<Array>> {
        let (b, t, d) = (x.dim(0), x.dim(1), x.dim(2));
        let k = self.top_k as i32;
        let Some((y, inv)) = self.grouped_sorted(x, &inds.reshape(&[-1])?)? else { return Ok(None) };
        Ok(Some(y.take(&inv, 0)?.reshape(&[b, t, k, d])?))
    }

    /// [`Self::grouped_kernel`]'s rows weighted by `scores` and summed a
    /// token, `[B, T, D]`, in one launch after the GEMMs
    /// (src/kernels/moe_sort.rs `combine`, `MLX_LFM_MOE_COMBINE_KERNEL`);
    /// None where that does not serve.
    pub(crate) fn grouped_combined(&self, x: &Array, inds: &Array, scores: &Array) -> Result<Option<Array>> {
        use crate::kernels::moe_sort;
        let (b, t, d) = (x.dim(0), x.dim(1), x.dim(2));
        let k = self.top_k as i32;
        if self.cpu_non_f32 || !self.grouped_prefill || t <= 1 || ((b * t * k) as usize) < SORT_THRESHOLD {
            return Ok(None);
        }
        // (Asked before any node is built: the places must be the sort
        // kernel's, int32.)
        let experts = match &self.gate_up {
            GateUp::Stacked(Weight::Quant(gu), _) => gu.weight.dim(0),
            _ => return Ok(None),
        };
        if !moe_sort::combine_serves(d, x.dtype(), scores.dtype()) || b * t > moe_sort::MAX_COMBINE_ROWS {
            return Ok(None);
        }
        let flat = inds.reshape(&[-1])?;
        if !moe_sort::available(&flat, k, experts) {
            return Ok(None);
        }
        let Some((y, inv)) = self.grouped_sorted(x, &flat)? else { return Ok(None) };
        let w = scores.reshape(&[b * t, k])?;
        if !moe_sort::combine_available(&y, &inv, &w, k) {
            return Err(Error::mlx(format!("MoE combine: rows {:?}, places {:?}, weights {:?} not served", y.shape(), inv.shape(), w.shape())));
        }
        Ok(Some(moe_sort::combine(&y, &inv, &w, k)?.reshape(&[b, t, d])?))
    }

    /// The grouped GEMMs' output rows in expert order (`[B T k, D]`) and
    /// each entry's place among them, for the experts `flat` (`[B T k]`, a
    /// token's k in a row), or None where the kernel does not serve.
    fn grouped_sorted(&self, x: &Array, flat: &Array) -> Result<Option<(Array, Array)>> {
        use crate::kernels::{moe_gemm, moe_sort};
        let (b, t, d) = (x.dim(0), x.dim(1), x.dim(2));
        if !self.grouped_serves(b * t, d, x.dtype()) {
            return Ok(None);
        }
        let (GateUp::Stacked(Weight::Quant(gu), ff), Weight::Quant(down)) = (&self.gate_up, &self.down_proj) else {
            return Ok(None);
        };
        let k = self.top_k as i32;
        let experts = gu.weight.dim(0);
        let x2 = x.reshape(&[b * t, d])?;
        // The sort by expert in one launch where that is on
        // (src/kernels/moe_sort.rs), else MLX's argsorts and the offsets' ops.
        // (The sort kernel's rows go to the gate/up GEMM as places in x2,
        // which it reads through: no take writes them sorted first.)
        let (gate_up, offsets, inv) = if moe_sort::available(flat, k, experts) {
            let (src, inv, offsets) = moe_sort::sort_rows(flat, k, experts)?;
            (moe_gemm::grouped_gemm_gathered(&x2, &src, &offsets, gu)?, offsets, inv)
        } else {
            let order = flat.argsort(0)?;
            let inv = order.argsort(0)?;
            let xs = x2.take(&order.floor_divide_scalar(k as f64)?, 0)?;
            let offsets = moe_gemm::offsets(&flat.take(&order, 0)?, experts)?;
            (moe_gemm::grouped_gemm(&xs, &offsets, gu)?, offsets, inv)
        };
        let mut p = split_widths(&gate_up, &[*ff, *ff])?;
        let u = p.pop().expect("two widths");
        let g = p.pop().expect("two widths");
        let y = moe_gemm::grouped_gemm(&swiglu(&g, &u)?, &offsets, down)?;
        Ok(Some((y, inv)))
    }

    /// Whether the grouped GEMM kernel serves `rows` rows `d` wide in dtype
    /// `dt` (quantized experts with gate and up stacked).
    fn grouped_serves(&self, rows: i32, d: i32, dt: Dtype) -> bool {
        use crate::kernels::moe_gemm;
        let (GateUp::Stacked(Weight::Quant(gu), ff), Weight::Quant(down)) = (&self.gate_up, &self.down_proj) else {
            return false;
        };
        let experts = gu.weight.dim(0);
        moe_gemm::serves(d, dt, gu)
            && moe_gemm::serves(*ff, dt, down)
            && down.weight.dim(0) == experts
            && moe_gemm::fits(rows * self.top_k as i32, experts)
    }

    /// Whether a pass over `rows` rows `d` wide (one prompt) reads nothing
    /// back to the host, as a traced pass must: the rows go through the
    /// direct gather, the sorted gather or the grouped GEMM kernel, not the
    /// chains grouped on the host ([`SparseMoe::host_grouped`], see
    /// [`SparseMoe::experts`]).
    pub fn prefill_traceable(&self, rows: i32, d: i32, dt: Dtype) -> bool {
        let many = rows > 1 && rows as usize * self.top_k >= SORT_THRESHOLD;
        if !many {
            return true;
        }
        if self.cpu_non_f32 {
            return false;
        }
        !self.grouped_prefill || self.grouped_serves(rows, d, dt)
    }

    /// Whether the decode path must avoid gather_mm (see the module note).
    pub fn cpu_non_f32(&self) -> bool {
        self.cpu_non_f32
    }

    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.gate.arrays();
        v.extend(self.expert_bias.as_ref());
        match &self.gate_up {
            GateUp::Stacked(w, _) => v.extend(w.arrays()),
            GateUp::Separate(g, u) => {
                v.extend(g.arrays());
                v.extend(u.arrays());
            }
        }
        v.extend(self.down_proj.arrays());
        v
    }

    pub fn parameter_count(&self) -> usize {
        self.gate.weight.params()
            + self.expert_bias.as_ref().map(|b| b.size()).unwrap_or(0)
            + match &self.gate_up {
                GateUp::Stacked(w, _) => w.params(),
                GateUp::Separate(g, u) => g.params() + u.params(),
            }
            + self.down_proj.params()
    }
}

/// The experts' gate and up projections, which read the same input:
/// stacked along their output axis into one `[E, 2 * ff, in]` weight (one
/// gathered matmul per step instead of two) unless they cannot be.
pub enum GateUp {
    Stacked(Weight, i32),
    Separate(Weight, Weight),
}

impl GateUp {
    /// `(gate, up)` outputs of `f` (a matmul of the weight it is given).
    fn apply(&self, f: impl Fn(&Weight) -> Result<Array>) -> Result<(Array, Array)> {
        match self {
            GateUp::Stacked(w, ff) => {
                let mut p = split_widths(&f(w)?, &[*ff, *ff])?;
                let u = p.pop().expect("two widths");
                Ok((p.pop().expect("two widths"), u))
            }
            GateUp::Separate(g, u) => Ok((f(g)?, f(u)?)),
        }
    }
}

/// MLX_LFM_MOE_DEQUANT_ROWS=N: in a host-grouped prefill, an expert with at
/// least N rows has its quantized weight dequantized to the activations'
/// dtype and runs an ordinary matmul instead of `quantized_matmul`. Unset:
/// never. On the H200 a 512-token prefill of the 8B-A1B spends 74% of its
/// GPU time in MLX's `qmm` at ~64 rows an expert (43 µs each, where a
/// dequantize and a cuBLAS GEMM of that size should take a fraction);
/// this switch is the A/B that decides it (`bench/h200/run.py ab`).
fn dequant_rows() -> Option<usize> {
    static ROWS: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    crate::knobs::cached("MLX_LFM_MOE_DEQUANT_ROWS", &ROWS, |v| v.and_then(|v| v.parse().ok()))
}

/// `x @ W[e].T` for one expert `e` of a stacked weight.
fn expert_apply(w: &Weight, e: i32, x: &Array) -> Result<Array> {
    expert_apply_with(w, e, x, dequant_rows())
}

fn expert_apply_with(w: &Weight, e: i32, x: &Array, dequant_rows: Option<usize>) -> Result<Array> {
    let one = |a: &Array| -> Result<Array> { a.slice_axis(0, e, e + 1)?.squeeze(0) };
    match w {
        Weight::Dense(w) => x.matmul(&one(w)?.t()?),
        Weight::Quant(q) => {
            let b = q.biases.as_ref().map(one).transpose()?;
            let rows = if x.ndim() >= 1 && x.dim(-1) > 0 { x.size() / x.dim(-1) as usize } else { 0 };
            if dequant_rows.is_some_and(|n| rows >= n) {
                let dense = mlx::dequantize(&one(&q.weight)?, &one(&q.scales)?, b.as_ref(), q.spec, Some(x.dtype()))?;
                return x.matmul(&dense.t()?);
            }
            mlx::quantized_matmul(x, &one(&q.weight)?, &one(&q.scales)?, b.as_ref(), true, q.spec)
        }
    }
}

/// `x @ W[idx].T` through MLX's gathered kernels.
fn gathered(w: &Weight, x: &Array, idx: &Array, sorted: bool) -> Result<Array> {
    match w {
        // MLX's CPU gather_mm is float32-only. Dense non-f32 experts reach
        // here only beside quantized ones (a projection too narrow for the
        // group size stays dense: tiny checkpoints); all-dense ones take the
        // cheaper upcast of just the chosen experts (`cpu_non_f32`).
        Weight::Dense(w) if w.dtype() != Dtype::Float32 && runtime::default_device() == runtime::DeviceType::Cpu => {
            let f = mlx::gather_mm(&x.astype(Dtype::Float32)?, &w.astype(Dtype::Float32)?.t()?, None, Some(idx), sorted)?;
            f.astype(x.dtype())
        }
        Weight::Dense(w) => mlx::gather_mm(x, &w.t()?, None, Some(idx), sorted),
        Weight::Quant(q) => {
            mlx::gather_qmm(x, &q.weight, &q.scales, q.biases.as_ref(), None, Some(idx), true, q.spec, sorted)
        }
    }
}

/// The stock router's closest call at each step, for the greedy test
/// (src/kernels/tests.rs): where the k-th and (k+1)-th experts' scores
/// lie within a few roundings of the probabilities' dtype, another
/// rounding of the same sums (a kernel's) may choose the other expert, and
/// the layer's output then differs by more than any rounding: a departure
/// there is the route's near-tie, not a kernel's error. (Session 40: the
/// tiny MoE fixture's bf16 departures at step 44, of two opt-in sets since
/// session 32, came where the stock route's margin was 0.0005, a tenth of
/// a bf16 rounding, on this CPU's run of the same tokens.)
#[cfg(test)]
pub(crate) mod route_margins {
    use crate::error::Result;
    use crate::mlx::{Array, Dtype};
    use std::cell::RefCell;

    thread_local! {
        static CLOSEST: RefCell<Option<f32>> = const { RefCell::new(None) };
    }

    pub(crate) fn recording() -> bool {
        CLOSEST.with(|c| c.borrow().is_some())
    }

    /// The smallest margin (in roundings of the probabilities' dtype at the
    /// k-th expert's probability) over every router call `f` makes, of
    /// each call's last row (the row behind the logits a step gives: a
    /// prompt's last); infinity if none.
    pub(crate) fn closest<R>(f: impl FnOnce() -> R) -> (R, f32) {
        let outer = CLOSEST.with(|c| c.replace(Some(f32::INFINITY)));
        let r = f();
        let got = CLOSEST.with(|c| c.replace(outer)).unwrap_or(f32::INFINITY);
        (r, got)
    }

    /// One call's selection scores `select` (`[.., E]`: the probabilities
    /// `probs`, plus any expert bias), its last row.
    pub(crate) fn record(select: &Array, probs: &Array, k: usize) -> Result<()> {
        let e = select.dim(-1) as usize;
        if k == 0 || k >= e || select.size() < e || probs.size() != select.size() {
            return Ok(());
        }
        let last = |a: &Array| -> Result<Vec<f32>> {
            let v: Vec<f32> = a.astype(Dtype::Float32)?.to_vec()?;
            Ok(v[v.len() - e..].to_vec())
        };
        let (sel, p) = (last(select)?, last(probs)?);
        let bits = match probs.dtype() {
            Dtype::Bfloat16 => 7,
            Dtype::Float16 => 10,
            _ => 23,
        };
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| sel[b].total_cmp(&sel[a]));
        // (A rounding of the probability is what may move the k-th expert's
        // score: its step at that probability's magnitude.)
        let kth = p[order[k - 1]].abs().max(f32::MIN_POSITIVE);
        let ulp = 2f32.powi(kth.log2().floor() as i32 - bits);
        let least = (sel[order[k - 1]] - sel[order[k]]) / ulp;
        CLOSEST.with(|c| {
            if let Some(m) = c.borrow_mut().as_mut() {
                *m = m.min(least);
            }
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::fixture::{self, FixtureSpec, Preset};
    use crate::generate::prefill;
    use crate::model::lfm2::FeedForward;
    use crate::model::{load_model, LoadOptions};

    /// An expert run as a dequantized matmul (MLX_LFM_MOE_DEQUANT_ROWS)
    /// computes what `quantized_matmul` computes, for each quantization
    /// mode, and the threshold picks the path by rows.
    #[test]
    fn dequantized_expert_matches_quantized_matmul() {
        use super::{expert_apply_with, Weight};
        use crate::mlx::random::normal;
        use crate::mlx::{quantize, Dtype, QuantMode, QuantSpec};
        use crate::model::linear::Quantized;
        let w = normal(&[3, 64, 128], Dtype::Float32, 0.0, 0.05, None).unwrap();
        let x = normal(&[8, 128], Dtype::Float32, 0.0, 1.0, None).unwrap();
        for (mode, bits, group_size) in [(QuantMode::Affine, 4, 64), (QuantMode::Affine, 8, 32), (QuantMode::Mxfp4, 4, 32)] {
            let spec = QuantSpec { mode, bits, group_size };
            let (weight, scales, biases) = quantize(&w, spec).unwrap();
            let q = Weight::Quant(Quantized { weight, scales, biases, spec });
            let f = |a: crate::mlx::Array| -> Vec<f32> { a.to_vec().unwrap() };
            let want = f(expert_apply_with(&q, 2, &x, None).unwrap());
            let got = f(expert_apply_with(&q, 2, &x, Some(8)).unwrap());
            // 9 rows needed: the quantized path again, bit for bit.
            assert_eq!(f(expert_apply_with(&q, 2, &x, Some(9)).unwrap()), want);
            let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(d < 1e-4, "{mode:?} {bits}-bit: dequantized expert differs by {d}");
            // And it is that expert's, not another's.
            let other = f(expert_apply_with(&q, 1, &x, Some(8)).unwrap());
            assert!(other.iter().zip(&got).any(|(a, b)| (a - b).abs() > 1e-2));
        }
    }

    /// A prompt's pass handed to MLX every few layers as it is built
    /// (`MLX_LFM_PREFILL_OVERLAP`) computes what the whole pass at once
    /// computes, dense and MoE, one prompt and a batched prefill.
    #[test]
    fn prefill_overlap_changes_nothing() {
        for preset in [Preset::Tiny, Preset::TinyMoe] {
            let dir = std::env::temp_dir().join(format!("mlxlfm-overlap-{preset:?}-{}", std::process::id()));
            fixture::generate(&FixtureSpec::new(preset), &dir).unwrap();
            let mut m = load_model(&dir, &LoadOptions::default()).unwrap().model;
            let prompt: Vec<u32> = (0..40).map(|i| (i * 13 + 3) % 500 + 1).collect();
            let other: Vec<u32> = (0..23).map(|i| (i * 7 + 5) % 400 + 2).collect();
            let mut run = |overlap: usize| -> (Vec<f32>, Vec<f32>) {
                m.prefill_overlap = overlap;
                let mut c = m.new_cache();
                let one: Vec<f32> = prefill(&m, &mut c, &prompt, 16).unwrap().to_vec().unwrap();
                let (mut a, mut b) = (m.new_cache(), m.new_cache());
                let rows: Vec<f32> = m.prefill_rows(&[&prompt, &other], &mut [&mut a, &mut b]).unwrap().to_vec().unwrap();
                (one, rows)
            };
            let want = run(0);
            for n in [1, 3] {
                assert_eq!(run(n), want, "{preset:?}: a prefill handed to MLX every {n} layers differs");
            }
            std::fs::remove_dir_all(&dir).ok();
        }
    }

    /// A prompt's stacked projections run part by part
    /// (`MLX_LFM_PREFILL_SPLIT`) compute what one product cut into views
    /// computes: dense and MoE, float32 and 4-bit, one prompt (in chunks of
    /// more than 32 rows and a last one of fewer) and a batched prefill.
    #[test]
    fn prefill_split_products_match_one_product() {
        use crate::convert::{convert, ConvertRecipe};
        use crate::fixture::DType;
        use crate::mlx::QuantMode;
        for (preset, q4) in [(Preset::Tiny, false), (Preset::Tiny, true), (Preset::TinyMoe, false), (Preset::TinyMoe, true)] {
            let base = std::env::temp_dir().join(format!("mlxlfm-split-{preset:?}-{q4}-{}", std::process::id()));
            let mut spec = FixtureSpec::new(preset);
            spec.dtype = DType::F32;
            fixture::generate(&spec, &base).unwrap();
            let dir = if q4 {
                let q = base.with_extension("q4");
                convert(&base, &q, &ConvertRecipe::quantized(QuantMode::Affine, Some(4), Some(32)).unwrap()).unwrap();
                q
            } else {
                base.clone()
            };
            let m = load_model(&dir, &LoadOptions::default()).unwrap().model;
            let prompt: Vec<u32> = (0..90).map(|i| (i * 13 + 3) % 500 + 1).collect();
            let other: Vec<u32> = (0..41).map(|i| (i * 7 + 5) % 400 + 2).collect();
            let run = || -> (Vec<f32>, Vec<f32>) {
                let mut c = m.new_cache();
                let one: Vec<f32> = prefill(&m, &mut c, &prompt, 64).unwrap().to_vec().unwrap();
                let (mut a, mut b) = (m.new_cache(), m.new_cache());
                let rows: Vec<f32> = m.prefill_rows(&[&prompt, &other], &mut [&mut a, &mut b]).unwrap().to_vec().unwrap();
                (one, rows)
            };
            let want = run();
            let got = crate::kernels::with_opt_in_one("MLX_LFM_PREFILL_SPLIT", run);
            for (what, g, w) in [("one prompt", &got.0, &want.0), ("batched", &got.1, &want.1)] {
                let top = w.iter().fold(1f32, |m, v| m.max(v.abs()));
                let d = g.iter().zip(w).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / top;
                assert!(d < 1e-5, "{preset:?} (4-bit: {q4}) {what}: part-by-part products differ by {d}");
            }
            std::fs::remove_dir_all(&base).ok();
            std::fs::remove_dir_all(&dir).ok();
        }
    }

    /// The host-grouped prefill (the GPU default) computes what MLX's sorted
    /// gather kernels compute.
    #[test]
    fn grouped_prefill_matches_gathered() {
        let dir = std::env::temp_dir().join(format!("mlxlfm-moe-grouped-{}", std::process::id()));
        fixture::generate(&FixtureSpec::new(Preset::TinyMoe), &dir).unwrap();
        let mut m = load_model(&dir, &LoadOptions::default()).unwrap().model;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 13 + 3) % 500 + 1).collect();
        let mut run = |grouped: bool| -> Vec<f32> {
            for l in m.layers.iter_mut() {
                if let FeedForward::Moe(moe) = &mut l.feed_forward {
                    moe.grouped_prefill = grouped;
                }
            }
            let mut c = m.new_cache();
            prefill(&m, &mut c, &prompt, 64).unwrap().to_vec().unwrap()
        };
        let (a, b) = (run(false), run(true));
        let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(d < 1e-4, "grouped vs gathered prefill logits differ by {d}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A bf16 MoE quantized at group 64 keeps its experts' 32-wide
    /// down_proj dense (too narrow to quantize) beside quantized gate/up.
    /// On MLX's CPU backend, whose gather_mm is float32-only, it failed
    /// with "[GatherMM::eval] Currently only supports float32"; now its
    /// prefill through the sorted gather equals the per-expert matmuls of
    /// the grouped prefill (to bf16 rounding), and it decodes.
    #[test]
    fn quantized_bf16_moe_with_dense_experts_runs_on_cpu() {
        use crate::convert::{convert, ConvertRecipe};
        use crate::fixture::DType;
        use crate::mlx::{Dtype, QuantMode};
        let base = std::env::temp_dir().join(format!("mlxlfm-moe-mixed-{}", std::process::id()));
        let (src, dir) = (base.join("src"), base.join("q4"));
        let mut spec = FixtureSpec::new(Preset::TinyMoe);
        spec.dtype = DType::BF16;
        fixture::generate(&spec, &src).unwrap();
        convert(&src, &dir, &ConvertRecipe::quantized(QuantMode::Affine, Some(4), Some(64)).unwrap()).unwrap();
        let prompt: Vec<u32> = (0..70).map(|i| (i * 17 + 5) % 500 + 1).collect();
        let mut m = load_model(&dir, &LoadOptions::default()).unwrap().model;
        let mixed = m.layers.iter().any(|l| match &l.feed_forward {
            FeedForward::Moe(moe) => matches!(moe.down_proj, super::Weight::Dense(_)) && !moe.cpu_non_f32(),
            _ => false,
        });
        assert!(mixed, "the fixture no longer mixes dense and quantized experts");
        let mut run = |grouped: bool| -> Vec<f32> {
            for l in m.layers.iter_mut() {
                if let FeedForward::Moe(moe) = &mut l.feed_forward {
                    moe.grouped_prefill = grouped;
                }
            }
            let mut c = m.new_cache();
            let logits = prefill(&m, &mut c, &prompt, 512).unwrap();
            let ids = crate::mlx::Array::from_slice(&[7u32], &[1, 1]).unwrap();
            let next = m.forward(&ids, &mut c, true).unwrap().astype(Dtype::Float32).unwrap().to_vec::<f32>().unwrap();
            assert!(next.iter().all(|x| x.is_finite()));
            logits.astype(Dtype::Float32).unwrap().to_vec().unwrap()
        };
        let (gathered, grouped) = (run(false), run(true));
        let scale = grouped.iter().fold(0f32, |a, x| a.max(x.abs()));
        let d = gathered.iter().zip(&grouped).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(d <= 0.02 * scale, "sorted-gather vs grouped prefill logits differ by {d} (scale {scale})");
        std::fs::remove_dir_all(&base).ok();
    }
}
