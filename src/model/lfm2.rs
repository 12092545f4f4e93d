//! The LFM2 model family: embedding, hybrid short-conv / attention decoder
//! layers, final norm and tied head. The sparse-MoE feed-forward of
//! LFM2-MoE lives in lfm2_moe.rs; everything else is shared.
//!
//! This is the one definition of the model: prefill (chunked, batched,
//! paged), eager decode, the eager batch and the compiled step (which
//! traces [`Lfm2Model::decode_step`]) all run [`Lfm2Model::hidden`] over a
//! [`ForwardCache`] (src/cache), which alone knows what kind of cache the
//! call runs over.

use crate::cache::paged::PoolShape;
use crate::cache::{
    BatchShape, ConvShape, ForwardCache, LayerCache, ModelCache, Offset, PagedConfig, PagedPool, PrefillRows, RowsPass,
    SharedPool, StackedPass,
};
use parking_lot::Mutex;
use std::sync::Arc;
use super::activations::swiglu;
use super::config::ModelConfig;
use super::linear::{reduce, Embedding, Linear, Normed, Projections, Shard, Split, Weight};
use super::lfm2_moe::SparseMoe;
use super::quant::QuantRegistry;
use super::weights::TensorStore;
use crate::error::{Error, Result};
use crate::mlx::{self, concatenate, Array, Dtype};

pub struct Attention {
    /// q, k and v (stacked into one matmul where they can be).
    pub qkv: Projections,
    pub out_proj: Linear,
    pub q_norm: Array,
    pub k_norm: Array,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub head_dim: i32,
    pub scale: f32,
    pub rope_theta: f32,
    pub eps: f32,
    /// Tensor parallel: this rank's heads only; out_proj's partial sums are
    /// joined over the group.
    pub shard: Option<Shard>,
    /// The one-launch q/k/v stage's counters (`kernels::qkv_fused`), made
    /// on the device once: only that kernel, on this layer, touches them.
    fused_counters: Array,
}

impl Attention {
    /// Over several ranks each keeps a contiguous group of KV heads and the
    /// query heads that read them (q/k/v column-sharded, out_proj
    /// row-sharded): a query head's KV head stays on its rank.
    fn load(st: &mut TensorStore, reg: &QuantRegistry, p: &str, c: &ModelConfig, shard: Option<&Shard>) -> Result<Attention> {
        let (d, hd) = (c.hidden_size, c.head_dim);
        let (cols, rows) = match shard {
            Some(s) => (Split::Out { shard: s, chunks: 1 }, Split::In(s)),
            None => (Split::Whole, Split::Whole),
        };
        let ranks = shard.map(|s| s.size).unwrap_or(1);
        Ok(Attention {
            qkv: Projections::new(vec![
                Linear::load_split(st, reg, &format!("{p}.q_proj"), d, c.num_heads * hd, false, cols)?,
                Linear::load_split(st, reg, &format!("{p}.k_proj"), d, c.num_kv_heads * hd, false, cols)?,
                Linear::load_split(st, reg, &format!("{p}.v_proj"), d, c.num_kv_heads * hd, false, cols)?,
            ])?,
            out_proj: Linear::load_split(st, reg, &format!("{p}.out_proj"), c.num_heads * hd, d, false, rows)?,
            q_norm: st.get_shaped(&format!("{p}.q_layernorm.weight"), &[hd as i32])?,
            k_norm: st.get_shaped(&format!("{p}.k_layernorm.weight"), &[hd as i32])?,
            n_heads: (c.num_heads / ranks) as i32,
            n_kv_heads: (c.num_kv_heads / ranks) as i32,
            head_dim: hd as i32,
            scale: (hd as f32).powf(-0.5),
            rope_theta: c.rope_theta,
            eps: c.norm_eps,
            shard: shard.cloned(),
            // (Counters, and room for the q/k/v stage's scratch row,
            // MLX_LFM_SCRATCH_IN_STATE, and its split form's words,
            // MLX_LFM_QKV_SPLIT.)
            fused_counters: crate::kernels::stages::new_counters_of(crate::kernels::qkv_fused::state_words(
                d,
                c.num_heads / ranks + 2 * (c.num_kv_heads / ranks),
            ))?,
        })
    }

    /// q, k, v (`[B, heads, T, head_dim]`) from the projections `qkv` of a
    /// `[B, T, D]` input, after the norms, with RoPE at `offset`.
    fn project(&self, qkv: Vec<Array>, offset: Offset) -> Result<(Array, Array, Array)> {
        // (A decode step's rows `[B, width]`: one token each, see `decode_rows`.)
        let (b, t) = if qkv[0].ndim() == 2 { (qkv[0].dim(0), 1) } else { (qkv[0].dim(0), qkv[0].dim(1)) };
        let hd = self.head_dim;
        use crate::kernels::qk_norm_rope;
        if t == 1 && qk_norm_rope::available(&qkv[0], &qkv[1], &self.q_norm, &self.k_norm, hd) {
            // Any other offset keeps MLX's rope rather than failing the step.
            let offsets = match offset {
                Offset::Int(off) => Some(Array::from_slice(&[off], &[1])?),
                Offset::Array(offs) => qk_norm_rope::offset_served(offs, b).then(|| offs.clone()),
            };
            if let Some(offsets) = offsets {
                let (q, k) = qk_norm_rope::qk_norm_rope(&qkv[0], &qkv[1], &self.q_norm, &self.k_norm, &offsets, hd, self.eps, self.rope_theta)?;
                let v = qkv[2].reshape(&[b, self.n_kv_heads, 1, hd])?;
                return Ok((q, k, v));
            }
        }
        let (q, k, v) = if t == 1 {
            // One token: `[B, 1, heads, hd]` and `[B, heads, 1, hd]` are the
            // same layout, so a reshape gives the heads-first shape with no
            // transpose node (a decode step's host cost is its node count,
            // src/generate/timing.rs); the norms run over the same rows.
            let q = qkv[0].reshape(&[b, self.n_heads, 1, hd])?;
            let k = qkv[1].reshape(&[b, self.n_kv_heads, 1, hd])?;
            let v = qkv[2].reshape(&[b, self.n_kv_heads, 1, hd])?;
            (mlx::rms_norm(&q, Some(&self.q_norm), self.eps)?, mlx::rms_norm(&k, Some(&self.k_norm), self.eps)?, v)
        } else {
            let q = qkv[0].reshape(&[b, t, self.n_heads, hd])?;
            let k = qkv[1].reshape(&[b, t, self.n_kv_heads, hd])?;
            let v = qkv[2].reshape(&[b, t, self.n_kv_heads, hd])?;
            let q = mlx::rms_norm(&q, Some(&self.q_norm), self.eps)?.transpose(&[0, 2, 1, 3])?;
            let k = mlx::rms_norm(&k, Some(&self.k_norm), self.eps)?.transpose(&[0, 2, 1, 3])?;
            (q, k, v.transpose(&[0, 2, 1, 3])?)
        };
        let (q, k) = match offset {
            Offset::Int(off) => (
                mlx::rope(&q, hd, false, self.rope_theta, 1.0, off)?,
                mlx::rope(&k, hd, false, self.rope_theta, 1.0, off)?,
            ),
            Offset::Array(offs) => (
                mlx::rope_dyn(&q, hd, false, self.rope_theta, 1.0, offs)?,
                mlx::rope_dyn(&k, hd, false, self.rope_theta, 1.0, offs)?,
            ),
        };
        Ok((q, k, v))
    }

    /// A decode step's q, k, v from the stacked projection in one kernel
    /// (`kernels::qk_norm_rope::qkv_norm_rope`: the split, its reshapes, the
    /// norms and the ropes, seven nodes, become one), or a prompt's with
    /// the prefill kernel on (`MLX_LFM_QKV_PREFILL_KERNEL`): `(s, (q, k,
    /// v))`, or None where it does not serve (the caller takes `project`).
    #[allow(clippy::type_complexity)]
    fn project_stacked(&self, x: &Normed, offset: Offset) -> Result<Option<(Array, (Array, Array, Array))>> {
        use crate::kernels::qk_norm_rope;
        let heads = (self.n_heads, self.n_kv_heads, self.head_dim);
        let wanted = |h: &Array| {
            qk_norm_rope::qkv_wanted(h, heads.0, heads.1, heads.2) || qk_norm_rope::qkv_prefill_wanted(h, heads.0, heads.1, heads.2)
        };
        if !self.stacked_qkv() || !wanted(x.h) {
            return Ok(None);
        }
        let Some(offsets) = Self::offsets(x, &offset)? else { return Ok(None) };
        // The norm, the projection and the heads' norm + RoPE in one launch
        // (a lone sequence's decode on CUDA; MLX_LFM_QKV_FUSED=0 off).
        if let Some(p) = self.fused_projection(x) {
            use crate::kernels::qkv_fused;
            if qkv_fused::available(x, p, &self.q_norm, &self.k_norm, heads, &offsets) {
                let consts = (self.eps, self.rope_theta);
                let (s, q, k, v) = qkv_fused::forward(x, p, &self.q_norm, &self.k_norm, heads, &offsets, consts, &self.fused_counters)?;
                return Ok(Some((s, (q, k, v))));
            }
        }
        let Some((s, y)) = self.qkv.forward_normed_stacked(x)? else { return Ok(None) };
        if !qk_norm_rope::qkv_available(&y, &self.q_norm, &self.k_norm, heads.0, heads.1, heads.2) {
            // (Another output dtype than the input's: the stock path, from the product made.)
            let widths = self.qkv.stacked_widths().expect("checked above");
            return Ok(Some((s, self.project(crate::model::linear::split_widths(&y, widths)?, offset)?)));
        }
        let qkv = qk_norm_rope::qkv_norm_rope(&y, &self.q_norm, &self.k_norm, &offsets, heads, self.eps, self.rope_theta)?;
        Ok(Some((s, qkv)))
    }

    /// The RoPE offset as the q/k/v kernels read it (`[1]` or one a row,
    /// int32); None where they do not serve it.
    fn offsets(x: &Normed, offset: &Offset) -> Result<Option<Array>> {
        use crate::kernels::qk_norm_rope;
        Ok(match *offset {
            Offset::Int(off) => Some(Array::from_slice(&[off], &[1])?),
            Offset::Array(offs) if qk_norm_rope::offset_served(offs, x.h.dim(0)) => Some(offs.clone()),
            Offset::Array(_) => None,
        })
    }

    /// Whether q, k and v are one stacked projection, in that order and
    /// these heads' widths.
    fn stacked_qkv(&self) -> bool {
        let (q, kv) = (self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim);
        self.qkv.stacked_widths().is_some_and(|w| w == [q, kv, kv])
    }

    /// The stacked projection as the one-launch q/k/v stage reads it,
    /// where that stage is on and `x` is a decode step's rows.
    fn fused_projection(&self, x: &Normed) -> Option<crate::kernels::qkv_fused::Projection<'_>> {
        use crate::kernels::qkv_fused::{self, Projection};
        match &self.qkv {
            Projections::Stacked { linear: Linear { weight, bias: None, .. }, .. }
                if qkv_fused::enabled_here() && x.h.ndim() == 2 && self.stacked_qkv() =>
            {
                Some(match weight {
                    Weight::Quant(q) => Projection::Quant(q),
                    Weight::Dense(w) => Projection::Dense(w),
                })
            }
            _ => None,
        }
    }

    /// A lone sequence's decode row whose new K and V the one-launch q/k/v
    /// stage writes into the cache's buffers itself
    /// (`MLX_LFM_KV_IN_PLACE`, src/kernels/qkv_fused.rs `kv_in_place`):
    /// `(the residual sum, the heads' output [1, heads * head_dim])`, or
    /// None where the cache or the kernel does not serve it.
    fn attend_written(&self, x: &Normed, layer: usize, cache: &mut dyn ForwardCache) -> Result<Option<(Array, Array)>> {
        use crate::kernels::qkv_fused;
        // (A prompt's pass, a batch's rows, or the first layer's norm with
        // no residual to add, which the one-launch stage never serves: not
        // the in-place step's, and no refusal worth noting.)
        if !qkv_fused::kv_in_place() || x.h.ndim() != 2 || x.h.dim(0) != 1 || x.r.is_none() {
            return Ok(None);
        }
        // (A pass that hands out no buffers is not the in-place step: the
        // other step's trace, made beside it at load, asks too.)
        let Some((kc, vc)) = cache.kv_buffers(layer) else { return Ok(None) };
        let refused = |why: &'static str| {
            qkv_fused::note_refusal(why);
            Ok(None)
        };
        // (As `project_stacked` asks before the one-launch stage: with the
        // q/k/v norm + RoPE kernel off, the other step keeps the stock
        // path, and so does this one.)
        if !crate::kernels::qk_norm_rope::qkv_wanted(x.h, self.n_heads, self.n_kv_heads, self.head_dim) {
            return refused("the q/k/v norm + RoPE kernel does not serve the row");
        }
        let Some(p) = self.fused_projection(x) else { return refused("the projection is not the q/k/v stage's") };
        let Some(offsets) = Self::offsets(x, &cache.offset())? else { return refused("the offset is not the stage's") };
        let heads = (self.n_heads, self.n_kv_heads, self.head_dim);
        // (Only a kernel that takes q reads the written row in order: MLX's
        // CUDA graphs order a kernel after another only by the buffers it
        // names as outputs, and the write names none. The masked fallback
        // may copy the buffers first.)
        let q_dims = (1, self.n_heads, self.head_dim);
        if !crate::kernels::decode_attention::upto_serves(x.h.dtype(), q_dims, &kc, &vc, &offsets) {
            return refused("the position-bounded attention kernel does not serve the buffers");
        }
        if let Some(why) = qkv_fused::refusal_into(x, p, &self.q_norm, &self.k_norm, heads, &offsets, &kc, &vc) {
            return refused(why);
        }
        let consts = (self.eps, self.rope_theta);
        let (s, q) = qkv_fused::forward_into(x, p, &self.q_norm, &self.k_norm, heads, &offsets, consts, &self.fused_counters, (&kc, &vc))?;
        Ok(Some((s, cache.attend_written_rows(layer, &q, self.scale)?)))
    }

    /// `[B, heads, T, head_dim]` attention output back to `[B, T, D]`
    /// (a decode step's rows take [`ForwardCache::attend_rows`] instead).
    fn output(&self, o: &Array) -> Result<Array> {
        let (b, t) = (o.dim(0), o.dim(2));
        let width = self.n_heads * self.head_dim;
        // (One token: the same layout either way, see `project`.)
        let o = match t {
            1 => o.reshape(&[b, 1, width])?,
            _ => o.transpose(&[0, 2, 1, 3])?.reshape(&[b, t, width])?,
        };
        reduce(&self.shard, self.out_proj.forward(&o)?)
    }

    /// Attention layer `layer` over whatever cache the pass runs on, on
    /// the pending norm `x`: `(its residual sum, the output)`.
    fn forward(&self, x: &Normed, layer: usize, cache: &mut dyn ForwardCache) -> Result<(Array, Array)> {
        if let Some((s, o)) = self.attend_written(x, layer, cache)? {
            return Ok((s, reduce(&self.shard, self.out_proj.forward(&o)?)?));
        }
        let (s, (q, k, v)) = match self.project_stacked(x, cache.offset())? {
            Some(done) => done,
            None => {
                let (s, qkv) = self.qkv.forward_normed(x)?;
                (s, self.project(qkv, cache.offset())?)
            }
        };
        if x.h.ndim() == 2 {
            // A decode step's rows: `[B, heads * head_dim]` from the cache.
            let o = cache.attend_rows(layer, &q, &k, &v, self.scale)?;
            return Ok((s, reduce(&self.shard, self.out_proj.forward(&o)?)?));
        }
        let o = cache.attend(layer, &q, &k, &v, self.scale)?;
        Ok((s, self.output(&o)?))
    }

    /// A decode step's rows (`x.h` `[B, D]`) up to out_proj: `(the residual
    /// sum, the heads' output [B, heads * head_dim])`, for a launch that
    /// joins out_proj to what follows.
    fn attend_rows_raw(&self, x: &Normed, layer: usize, cache: &mut dyn ForwardCache) -> Result<(Array, Array)> {
        if let Some(done) = self.attend_written(x, layer, cache)? {
            return Ok(done);
        }
        let (s, (q, k, v)) = match self.project_stacked(x, cache.offset())? {
            Some(done) => done,
            None => {
                let (s, qkv) = self.qkv.forward_normed(x)?;
                (s, self.project(qkv, cache.offset())?)
            }
        };
        Ok((s, cache.attend_rows(layer, &q, &k, &v, self.scale)?))
    }

    /// out_proj as the joined launch reads it (no bias); None otherwise.
    fn stage_out_proj(&self) -> Option<crate::kernels::conv_layer_fused::OutProj<'_>> {
        use crate::kernels::conv_layer_fused::OutProj;
        match (&self.out_proj.weight, &self.out_proj.bias) {
            (Weight::Quant(q), None) => Some(OutProj::Quant(q)),
            (Weight::Dense(w), None) => Some(OutProj::Dense(w)),
            _ => None,
        }
    }
}

/// The double-gated short convolution ("LIV" operator).
pub struct ShortConv {
    pub in_proj: Linear,
    pub out_proj: Linear,
    /// Depthwise kernel in MLX layout `[D, L, 1]`.
    pub conv_weight: Array,
    /// The same weights as `[D, L]`, what the fused decode step reads.
    pub conv_weight_dl: Array,
    pub conv_bias: Option<Array>,
    pub kernel: i32,
    /// Channels this rank convolves (all of them on one rank).
    pub dim: i32,
    pub shard: Option<Shard>,
    /// The one-launch layer's counters (`kernels::conv_fused`), made on
    /// the device once: only that kernel, on this layer, touches them.
    fused_counters: Array,
}

impl ShortConv {
    /// The conv is depthwise, so over several ranks each keeps a slice of
    /// the channels: its part of in_proj's B, C and x blocks, of the conv
    /// kernel and bias, and of out_proj's inputs (row-sharded).
    fn load(st: &mut TensorStore, reg: &QuantRegistry, p: &str, c: &ModelConfig, shard: Option<&Shard>) -> Result<ShortConv> {
        let d = c.hidden_size as i32;
        let l = c.conv_kernel as i32;
        let name = format!("{p}.conv.weight");
        let w = st.get(&name)?;
        // Hugging Face stores [D, 1, L]; MLX expects [D, L, 1].
        let w = match w.shape().as_slice() {
            [dd, 1, ll] if *dd == d && *ll == l => w.transpose(&[0, 2, 1])?,
            [dd, ll, 1] if *dd == d && *ll == l => w,
            s => {
                return Err(Error::load(format!(
                    "tensor `{name}` has shape {s:?}, expected [{d}, 1, {l}] (Hugging Face) or [{d}, {l}, 1] (MLX)"
                )))
            }
        };
        let conv_bias = if c.conv_bias { Some(st.get_shaped(&format!("{p}.conv.bias"), &[d])?) } else { None };
        let (cols, rows, local) = match shard {
            Some(s) => (Split::Out { shard: s, chunks: 3 }, Split::In(s), s.part("hidden_size (conv channels)", d as usize)? as i32),
            None => (Split::Whole, Split::Whole, d),
        };
        // This rank's channels (a gather: the full kernel can be freed).
        let channels = |a: Array| -> Result<Array> {
            match shard {
                Some(s) => {
                    let idx: Vec<i32> = (s.rank as i32 * local..(s.rank as i32 + 1) * local).collect();
                    a.take(&Array::from_slice(&idx, &[local])?, 0)
                }
                None => Ok(a),
            }
        };
        let w = channels(w)?;
        Ok(ShortConv {
            in_proj: Linear::load_split(st, reg, &format!("{p}.in_proj"), d as usize, 3 * d as usize, c.conv_bias, cols)?,
            out_proj: Linear::load_split(st, reg, &format!("{p}.out_proj"), d as usize, d as usize, c.conv_bias, rows)?,
            conv_weight_dl: w.reshape(&[local, l])?,
            conv_weight: w,
            conv_bias: conv_bias.map(channels).transpose()?,
            kernel: l,
            dim: local,
            shard: shard.cloned(),
            // (Counters, and room for the one-launch conv layer's scratch
            // rows: MLX_LFM_SCRATCH_IN_STATE.)
            fused_counters: crate::kernels::stages::new_counters_of(crate::kernels::conv_fused::state_words(d as usize, local as usize))?,
        })
    }

    /// Conv layer `layer` on the pending norm `x`: `(its residual sum, the
    /// output)`; the conv state comes from and goes back to the cache.
    /// `zero`: a row of zeros the one-launch layer may take as the residual
    /// where `x` has none (the first layer, `conv_fused::first_layer`).
    fn forward(&self, x: &Normed, layer: usize, cache: &mut dyn ForwardCache, zero: Option<&Array>) -> Result<(Array, Array)> {
        if crate::model::linear::split_products(x.h) {
            // A prompt: B, C and x as three products, each contiguous.
            let (s, y) = x.compute()?;
            let parts = self.in_proj.forward_parts(&y, &[self.dim; 3])?;
            let prev = self.prev_state(&y, layer, cache)?;
            return Ok((s, self.conv_parts(&parts, &prev, layer, cache)?));
        }
        use crate::kernels::{conv_fused, short_conv};
        // The whole layer in one launch (a lone sequence's decode on
        // CUDA; MLX_LFM_CONV_FUSED=0 off): the state is asked of the cache here, once,
        // and kept for the paths below where it does not serve.
        let same = |a: &Array| a.dtype() == x.h.dtype();
        // (The first layer over a residual of zeros, where that is on: only
        // the one-launch kernel takes it; the paths below keep `x`.)
        let zeroed;
        let xf = match (x.r, zero) {
            (None, Some(z)) if conv_fused::first_layer() => {
                zeroed = Normed { h: x.h, r: Some(z), w: x.w, eps: x.eps, eps_array: x.eps_array };
                &zeroed
            }
            _ => x,
        };
        let whole = if conv_fused::enabled_here() { self.stage_projections(xf) } else { None };
        let mut asked = None;
        if let Some(p) = whole {
            let prev = self.prev_state(x.h, layer, cache)?;
            if conv_fused::available(xf, p, &prev, &self.conv_weight_dl, self.has_bias()) {
                let (s, out, next) = conv_fused::forward(xf, p, &prev, &self.conv_weight_dl, &self.fused_counters)?;
                cache.conv_step_update(layer, &prev, &next)?;
                return Ok((s, reduce(&self.shard, out)?));
            }
            asked = Some(prev);
        }
        // The fused in_proj reads the normed row in the residual's dtype:
        // the norm's weight and the residual it adds of that dtype too, so
        // that the norm does not promote it (`same`, above).
        let fused = match (&self.in_proj.weight, &self.in_proj.bias) {
            (Weight::Dense(w), None) if short_conv::gemv_enabled() && same(x.w) && x.r.is_none_or(same) => Some(w),
            _ => None,
        };
        // (The state is asked of the cache once: before in_proj where the
        // fold may take it, after it otherwise.)
        let early = match asked {
            Some(prev) => Some(prev),
            None => fused.map(|_| self.prev_state(x.h, layer, cache)).transpose()?,
        };
        if let (Some(w), Some(prev)) = (fused, &early) {
            if short_conv::gemv_available(x.h, w, prev, &self.conv_weight_dl, self.conv_bias.is_some()) {
                // Decode on CUDA with the fused in_proj: the product and the
                // step in one launch, from the normed row.
                let (s, y) = x.compute()?;
                let (next, out) = short_conv::conv_gemv_step(&y, w, prev, &self.conv_weight_dl)?;
                cache.conv_step_update(layer, prev, &next)?;
                return Ok((s, reduce(&self.shard, self.out_proj.forward(&out)?)?));
            }
        }
        let (s, bcx) = self.in_proj.forward_normed(x)?;
        let prev = match early {
            Some(prev) => prev,
            None => self.prev_state(&bcx, layer, cache)?,
        };
        Ok((s, self.conv(&bcx, &prev, layer, cache)?))
    }

    /// in_proj and out_proj as the one-launch kernels read them (both
    /// quantized, or both dense in the activations' dtype), where the
    /// pending norm's residual and weight are of that dtype too.
    fn stage_projections(&self, x: &Normed) -> Option<crate::kernels::stages::Projections<'_>> {
        use crate::kernels::stages::Projections;
        let same = |a: &Array| a.dtype() == x.h.dtype();
        if !(x.r.is_some_and(same) && same(x.w)) {
            return None;
        }
        match (&self.in_proj.weight, &self.out_proj.weight) {
            (Weight::Quant(wi), Weight::Quant(wo)) => Some(Projections::Quant(wi, wo)),
            (Weight::Dense(wi), Weight::Dense(wo)) if same(wi) && same(wo) => Some(Projections::Dense(wi, wo)),
            _ => None,
        }
    }

    /// Whether the conv or either projection has a bias (the one-launch
    /// kernels serve none).
    fn has_bias(&self) -> bool {
        self.conv_bias.is_some() || self.in_proj.bias.is_some() || self.out_proj.bias.is_some()
    }

    /// The conv state before this pass, for inputs of `like`'s batch and dtype.
    fn prev_state(&self, like: &Array, layer: usize, cache: &mut dyn ForwardCache) -> Result<Array> {
        let shape = ConvShape { batch: like.dim(0), keep: self.kernel - 1, dim: self.dim, dtype: like.dtype() };
        cache.conv_state(layer, shape)
    }

    fn conv(&self, bcx: &Array, prev: &Array, layer: usize, cache: &mut dyn ForwardCache) -> Result<Array> {
        if crate::kernels::short_conv::available(bcx, prev, &self.conv_weight_dl, self.conv_bias.is_some()) {
            // Decode on CUDA: everything between the two projections in one
            // launch.
            let (next, y) = crate::kernels::short_conv::conv_step(bcx, prev, &self.conv_weight_dl)?;
            cache.conv_step_update(layer, prev, &next)?;
            return reduce(&self.shard, self.out_proj.forward(&y)?);
        }
        if crate::kernels::short_conv::prefill_available(bcx, prev, &self.conv_weight_dl, self.conv_bias.is_some()) {
            // A prompt on CUDA (opt-in): the gates, the window and the conv
            // over every position in one launch; the caches keep their
            // state from the window as from the stock path's.
            let (padded, y) = crate::kernels::short_conv::conv_prefill(bcx, prev, &self.conv_weight_dl)?;
            cache.conv_update(layer, &padded, self.kernel - 1)?;
            return reduce(&self.shard, self.out_proj.forward(&y)?);
        }
        self.conv_stock(bcx, prev, layer, cache)
    }

    fn conv_stock(&self, bcx: &Array, prev: &Array, layer: usize, cache: &mut dyn ForwardCache) -> Result<Array> {
        self.conv_parts(&bcx.split_equal(3, -1)?, prev, layer, cache)
    }

    /// The gated conv over in_proj's B, C and x blocks.
    fn conv_parts(&self, parts: &[Array], prev: &Array, layer: usize, cache: &mut dyn ForwardCache) -> Result<Array> {
        let keep = self.kernel - 1;
        // A decode step's rows (`[B, D]`, see `decode_rows`) are one time
        // step each: the window and the conv run over `[B, L, D]` as ever.
        let rows = parts[0].ndim() == 2;
        let mut bx = parts[0].mul(&parts[2])?;
        if rows {
            bx = bx.expand_dims(1)?;
        }
        let padded = concatenate(&[prev, &bx], 1)?;
        cache.conv_update(layer, &padded, keep)?;
        let mut conv = mlx::conv1d(&padded, &self.conv_weight, 1, 0, 1, self.dim)?;
        if let Some(b) = &self.conv_bias {
            conv = conv.add(b)?;
        }
        if rows {
            conv = conv.squeeze(1)?;
        }
        let y = parts[1].mul(&conv)?;
        reduce(&self.shard, self.out_proj.forward(&y)?)
    }
}

/// SwiGLU: `w2(silu(w1 x) * w3 x)`.
pub struct Mlp {
    /// w1 and w3 (stacked into one matmul where they can be).
    pub w13: Projections,
    pub w2: Linear,
    /// Tensor parallel: w1/w3 column-sharded, w2 row-sharded.
    pub shard: Option<Shard>,
    /// The one-launch feed-forward's counters (`kernels::ffn_fused`), made
    /// on the device once: only that kernel, on this layer, touches them.
    fused_counters: Array,
}

impl Mlp {
    fn load(st: &mut TensorStore, reg: &QuantRegistry, p: &str, d: usize, ff: usize, shard: Option<&Shard>) -> Result<Mlp> {
        // LFM2 names them w1/w2/w3; LFM2-MoE checkpoints converted by mlx-lm use gate/down/up_proj.
        let names = if st.has(&format!("{p}.gate_proj.weight")) {
            ["gate_proj", "down_proj", "up_proj"]
        } else {
            ["w1", "w2", "w3"]
        };
        let (cols, rows) = match shard {
            Some(s) => (Split::Out { shard: s, chunks: 1 }, Split::In(s)),
            None => (Split::Whole, Split::Whole),
        };
        Ok(Mlp {
            w13: Projections::new(vec![
                Linear::load_split(st, reg, &format!("{p}.{}", names[0]), d, ff, false, cols)?,
                Linear::load_split(st, reg, &format!("{p}.{}", names[2]), d, ff, false, cols)?,
            ])?,
            w2: Linear::load_split(st, reg, &format!("{p}.{}", names[1]), ff, d, false, rows)?,
            shard: shard.cloned(),
            // (Counters, and room for the one-launch feed-forward's scratch
            // rows: MLX_LFM_SCRATCH_IN_STATE.)
            fused_counters: crate::kernels::stages::new_counters_of(crate::kernels::ffn_fused::state_words(d, ff))?,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        if let Some(h) = self.fused_gate(x)? {
            return reduce(&self.shard, self.w2.forward(&h)?);
        }
        let gu = self.w13.forward(x)?;
        reduce(&self.shard, self.w2.forward(&swiglu(&gu[0], &gu[1])?)?)
    }

    /// On the pending norm `x`: `(its residual sum, the output)`, the add,
    /// the norm, w1/w3 and the gate in one launch where the fused kernel
    /// serves them (a stacked dense w1/w3).
    pub fn forward_normed(&self, x: &Normed) -> Result<(Array, Array)> {
        use crate::kernels::{ffn_fused, norm_gemv};
        // The whole feed-forward in one launch (a lone sequence's
        // decode on CUDA; MLX_LFM_FFN_FUSED=0 off).
        if let Some(p) = self.stage_projections().filter(|&p| ffn_fused::available(x, p)) {
            let (s, out) = ffn_fused::forward(x, p, &self.fused_counters)?;
            return Ok((s, reduce(&self.shard, out)?));
        }
        if let (Some(k), Some(w)) = (x.kernel_input(), self.stacked_dense_w13()) {
            if norm_gemv::swiglu_available(&k, w) {
                let (s, h) = norm_gemv::norm_gemv_swiglu(&k, w)?;
                return Ok((s, reduce(&self.shard, self.w2.forward(&h)?)?));
            }
        }
        let (s, y) = x.compute()?;
        Ok((s, self.forward(&y)?))
    }

    /// Decode on CUDA with the GEMV kernel on: w1/w3 and the gate in one
    /// launch (src/kernels/gemv.rs), when they are one stacked dense weight.
    fn fused_gate(&self, x: &Array) -> Result<Option<Array>> {
        use crate::kernels::gemv;
        match self.stacked_dense_w13() {
            Some(w) if gemv::swiglu_available(x, w) => gemv::gemv_swiglu(x, w).map(Some),
            _ => Ok(None),
        }
    }

    /// The stacked w1/w3 and w2 as the one-launch kernels read them (both
    /// dense or both quantized, no biases); None otherwise.
    fn stage_projections(&self) -> Option<crate::kernels::stages::Projections<'_>> {
        use crate::kernels::stages::Projections;
        match (self.stacked_w13(), &self.w2) {
            (Some(Weight::Dense(w13)), Linear { weight: Weight::Dense(w2), bias: None, .. }) => Some(Projections::Dense(w13, w2)),
            (Some(Weight::Quant(w13)), Linear { weight: Weight::Quant(w2), bias: None, .. }) => Some(Projections::Quant(w13, w2)),
            _ => None,
        }
    }

    /// w1 and w3 as one dense `[2F, D]` weight without a bias, what the
    /// fused gate kernels read; None otherwise.
    fn stacked_dense_w13(&self) -> Option<&Array> {
        match self.stacked_w13() {
            Some(Weight::Dense(w)) => Some(w),
            _ => None,
        }
    }

    /// w1 and w3 as one `[2F, D]` weight (dense or quantized) without a
    /// bias; None otherwise.
    fn stacked_w13(&self) -> Option<&Weight> {
        match &self.w13 {
            Projections::Stacked { linear: Linear { weight, bias: None, .. }, widths } if widths.len() == 2 && widths[0] == widths[1] => Some(weight),
            _ => None,
        }
    }
}

/// Opt-in (`MLX_LFM_DECODE_ROWS=1`): a decode step (the compiled and the
/// stacked batch step, [`Lfm2Model::decode_step`]) runs its residual
/// stream as `[B, D]` rows, not `[B, 1, D]`. MLX's matmul folds a 3-D input
/// to 2-D and back around every dense projection (a Flatten and an
/// Unflatten: 130 of the 1.2B's ~390 nodes a step on the H200, each ~1 µs
/// of a host-bound step's build and dispatch); 2-D rows need neither, and
/// the GPU runs the same kernels. On CUDA by default since session 14 (the
/// H200's greedy test kept the stock tokens; paired A/B: decode +4% on the
/// 8B-A1B, whose MoE rows lose their reshapes, and +4-8% on the dense models
/// where the one-batch matmul is off: with it on, it already spares those
/// views), `MLX_LFM_DECODE_ROWS=0` off, `=1` on elsewhere (the CPU test).
pub(crate) fn decode_rows() -> bool {
    static ON: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    crate::kernels::cuda_default("MLX_LFM_DECODE_ROWS", &ON)
}

/// Layers a prompt's pass builds before handing them to MLX:
/// `MLX_LFM_PREFILL_OVERLAP` (0 when out of range), else 2 for a MoE model
/// where our CUDA kernels run, else 0 (the whole pass at once). In session
/// 14's paired A/B on the H200 the MoE's 512-token prefill (thousands of
/// launches, built on the host while the GPU idles) gained 8-14% in each of
/// five reps with N = 2 (3-10% with 4); the dense models' lost up to 14%
/// (the 350M 14% and 10% at N = 2 and 4, the 1.2B 7% at N = 2: their pass
/// is short, and a hand-off costs more than the overlap gives).
fn prefill_overlap_layers(moe: bool) -> usize {
    static N: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    crate::knobs::cached("MLX_LFM_PREFILL_OVERLAP", &N, |v| {
        v.map(|v| v.trim().parse::<usize>().ok().filter(|&n| n <= 1024).unwrap_or(0))
    })
    .unwrap_or_else(|| if moe && crate::mlx::kernel::cuda_kernels_enabled() { 2 } else { 0 })
}

pub enum Operator {
    Attention(Attention),
    Conv(ShortConv),
}

pub enum FeedForward {
    Dense(Mlp),
    Moe(SparseMoe),
}

pub struct Layer {
    pub operator: Operator,
    pub feed_forward: FeedForward,
    pub operator_norm: Array,
    pub ffn_norm: Array,
    /// The one-launch conv layer's counters (`kernels::conv_layer_fused`),
    /// made on the device once: only that kernel, on this layer, touches
    /// them.
    fused_counters: Array,
}

impl Layer {
    /// The feed-forward or MoE as the joined launches read it; None where
    /// they do not (or under tensor parallelism: a rank's row is reduced
    /// before the norm).
    fn stage_tail(&self) -> Option<crate::kernels::conv_layer_fused::Tail<'_>> {
        use crate::kernels::conv_layer_fused::Tail;
        match &self.feed_forward {
            FeedForward::Dense(m) if m.shard.is_none() => m.stage_projections().map(Tail::Ffn),
            FeedForward::Moe(m) => m.stage_moe().map(Tail::Moe),
            FeedForward::Dense(_) => None,
        }
    }

    /// An attention layer's out_proj joined to the feed-forward or MoE after
    /// it (decode on CUDA, `MLX_LFM_CONV_LAYER_FUSED=1`), on the pending norm
    /// `x`: the attention as usual up to its heads' output, then one launch
    /// (`kernels::conv_layer_fused::forward_out`); None where that launch
    /// does not serve the layer (asked before anything is built).
    fn attention_with_ffn(&self, x: &Normed, index: usize, cache: &mut dyn ForwardCache) -> Result<Option<(Array, Array)>> {
        use crate::kernels::conv_layer_fused as fused;
        let Operator::Attention(a) = &self.operator else { return Ok(None) };
        if !fused::enabled_here() || a.shard.is_some() || x.h.ndim() != 2 || x.h.dim(0) != 1 {
            return Ok(None);
        }
        let (Some(out_proj), Some(tail)) = (a.stage_out_proj(), self.stage_tail()) else { return Ok(None) };
        if !fused::available_out(x.h, a.n_heads * a.head_dim, out_proj, &self.ffn_norm, tail, x.eps_array) {
            return Ok(None);
        }
        let (s, o) = a.attend_rows_raw(x, index, cache)?;
        let l = fused::OutLayer { row: &o, r: &s, out_proj, ffn_norm: &self.ffn_norm, tail, eps: x.eps, eps_array: x.eps_array };
        let done = fused::forward_out(&l, &self.fused_counters)?;
        Ok(Some((done.s2, done.out)))
    }

    /// A conv layer and its dense feed-forward or MoE in one launch (decode
    /// on CUDA, `MLX_LFM_CONV_LAYER_FUSED=1`), on the pending norm `x`:
    /// `(the residual sum after the feed-forward's norm, its output)`, the
    /// conv state asked of and handed back to the cache; None where the
    /// kernel does not serve the layer (the two parts then run as usual).
    fn conv_with_ffn(&self, x: &Normed, index: usize, cache: &mut dyn ForwardCache) -> Result<Option<(Array, Array)>> {
        use crate::kernels::conv_layer_fused as fused;
        let Operator::Conv(c) = &self.operator else { return Ok(None) };
        // (Under tensor parallelism out_proj's row is reduced across the
        // ranks before the feed-forward's norm: two launches there.)
        if !fused::enabled_here() || c.shard.is_some() || x.h.ndim() != 2 || x.h.dim(0) != 1 {
            return Ok(None);
        }
        let Some(conv) = c.stage_projections(x) else { return Ok(None) };
        // The feed-forward as the kernel reads it, then the state (asked
        // of the cache only where the layer may be served).
        use fused::Tail;
        let Some(tail) = self.stage_tail() else { return Ok(None) };
        let prev = c.prev_state(x.h, index, cache)?;
        let (cw, ffn_norm, bias) = (&c.conv_weight_dl, &self.ffn_norm, c.has_bias());
        let done = match tail {
            Tail::Ffn(ffn) => {
                let l = fused::ConvLayer { x, conv, state: &prev, cw, ffn_norm, ffn };
                if !fused::available(&l, bias) {
                    return Ok(None);
                }
                fused::forward(&l, &self.fused_counters)?
            }
            Tail::Moe(moe) => {
                let l = fused::ConvMoeLayer { x, conv, state: &prev, cw, ffn_norm, moe };
                if !fused::available_moe(&l, bias) {
                    return Ok(None);
                }
                fused::forward_moe(&l, &self.fused_counters)?
            }
        };
        cache.conv_step_update(index, &prev, &done.next)?;
        Ok(Some((done.s2, done.out)))
    }

    /// Whether a prompt's pass of `rows` tokens (`d` wide, in `dt`) over
    /// this layer can be traced: a MoE layer may group many rows by expert
    /// on the host ([`SparseMoe::prefill_traceable`]).
    pub fn traceable_prefill(&self, rows: i32, d: i32, dt: Dtype) -> bool {
        match &self.feed_forward {
            FeedForward::Moe(m) => m.prefill_traceable(rows, d, dt),
            FeedForward::Dense(_) => true,
        }
    }

    /// The operator (short conv or attention) of decoder layer `index` on
    /// its normed input.
    fn operator(&self, x: &Normed, index: usize, cache: &mut dyn ForwardCache, zero: Option<&Array>) -> Result<(Array, Array)> {
        match &self.operator {
            Operator::Attention(a) => a.forward(x, index, cache),
            Operator::Conv(c) => c.forward(x, index, cache, zero),
        }
    }

    /// The feed-forward on the pending norm `x`: `(its residual sum, the
    /// output)`. The MoE's router and experts both read the norm: computed
    /// on its own there, or (a decode step's rows, a CUDA default) in the
    /// router's launch, which hands it to the experts.
    fn feed_forward(&self, x: &Normed) -> Result<(Array, Array)> {
        match &self.feed_forward {
            FeedForward::Dense(m) => m.forward_normed(x),
            FeedForward::Moe(m) => {
                if let Some(n) = x.kernel_input().filter(|n| n.h.ndim() == 2) {
                    if let Some(done) = m.forward_normed(&n, x.eps)? {
                        return Ok(done);
                    }
                }
                let (s, y) = x.compute()?;
                Ok((s, m.forward(&y)?))
            }
        }
    }
}

pub struct Lfm2Model {
    /// Unique in the process: names the model a compiled step was traced from.
    pub id: u64,
    pub config: ModelConfig,
    pub embed: Embedding,
    pub layers: Vec<Layer>,
    pub final_norm: Array,
    /// Only when embeddings are not tied.
    pub lm_head: Option<Linear>,
    pub registry: QuantRegistry,
    /// The dtype activations run in.
    pub dtype: Dtype,
    /// Per layer, the codec of a quantized KV cache (`kvCache` load option);
    /// `None` for conv layers and full-precision attention layers. Empty: all
    /// flat. Set with [`Lfm2Model::set_kv_cache`].
    pub kv_codecs: Vec<Option<crate::kvquant::Codec>>,
    /// Positions a sequence may use (prompt and generated tokens):
    /// `max_position_embeddings`, or less with the `contextLength` load
    /// option.
    pub context_length: usize,
    /// `config.norm_eps` as a float32 `[1]` array, for the fused add +
    /// RMSNorm kernel.
    pub norm_eps: Array,
    /// `[1, hidden_size]` zeros in the activations' dtype, made whole once
    /// (not a broadcast, which a kernel's input would copy at each step):
    /// the first layer's residual for the one-launch conv layer
    /// (`MLX_LFM_CONV_FIRST_FUSED`).
    pub zero_row: Array,
    /// The paged KV pool every new cache draws from; None: flat caches.
    /// Set with [`Lfm2Model::use_paged_cache`].
    pub paged: Option<SharedPool>,
    /// This process's part of a tensor-parallel model (None on one rank):
    /// its layers hold only their heads, channels and expert widths, and
    /// its caches only those heads' K/V and those channels' conv state.
    pub shard: Option<Shard>,
    /// Layers a prompt's pass builds before it hands them to MLX to run
    /// (0: the whole pass at once; see [`prefill_overlap_layers`]).
    pub prefill_overlap: usize,
}

impl Lfm2Model {
    /// Loads the model, or with `shard` this rank's part of it (the embedding,
    /// norms, head and MoE routers are replicated). A config that the group
    /// cannot split evenly is refused here, naming the field.
    pub fn load(st: &mut TensorStore, config: ModelConfig, registry: QuantRegistry, shard: Option<Shard>) -> Result<Lfm2Model> {
        let c = &config;
        let d = c.hidden_size;
        if let Some(s) = &shard {
            s.part("num_key_value_heads", c.num_kv_heads)?;
            s.part("num_attention_heads", c.num_heads)?;
            if c.attn_layers.iter().any(|a| !a) {
                s.part("hidden_size (conv channels)", c.hidden_size)?;
            }
            if (0..c.num_layers).any(|i| !c.is_moe_layer(i)) {
                s.part("the feed-forward width", c.ff_dim)?;
            }
            if let Some(m) = &c.moe {
                s.part("moe_intermediate_size", m.moe_ff_dim)?;
            }
        }
        let sh = shard.as_ref();
        let final_norm = st.get_shaped("model.embedding_norm.weight", &[d as i32])?;
        let dtype = final_norm.dtype();
        let embed = Embedding::load(st, &registry, "model.embed_tokens", c.vocab_size, d, dtype)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let operator = if c.attn_layers[i] {
                Operator::Attention(Attention::load(st, &registry, &format!("{p}.self_attn"), c, sh)?)
            } else {
                Operator::Conv(ShortConv::load(st, &registry, &format!("{p}.conv"), c, sh)?)
            };
            let feed_forward = if c.is_moe_layer(i) {
                FeedForward::Moe(SparseMoe::load(st, &registry, &format!("{p}.feed_forward"), c, sh)?)
            } else {
                FeedForward::Dense(Mlp::load(st, &registry, &format!("{p}.feed_forward"), d, c.ff_dim, sh)?)
            };
            layers.push(Layer {
                operator,
                feed_forward,
                operator_norm: st.get_shaped(&format!("{p}.operator_norm.weight"), &[d as i32])?,
                ffn_norm: st.get_shaped(&format!("{p}.ffn_norm.weight"), &[d as i32])?,
                fused_counters: crate::kernels::stages::new_counters_of(crate::kernels::conv_layer_fused::COUNTER_WORDS)?,
            });
        }
        let moe = c.moe.is_some();
        let lm_head = if c.tie_word_embeddings && !st.has("lm_head.weight") {
            None
        } else {
            Some(Linear::load(st, &registry, "lm_head", d, c.vocab_size, false)?)
        };
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let context_length = config.max_position_embeddings;
        let norm_eps = Array::from_slice(&[config.norm_eps], &[1])?;
        let zero_row = Array::from_slice(&vec![0f32; d], &[1, d as i32])?.astype(dtype)?;
        zero_row.eval()?;
        Ok(Lfm2Model {
            id,
            config,
            embed,
            layers,
            final_norm,
            lm_head,
            registry,
            dtype,
            kv_codecs: vec![],
            context_length,
            norm_eps,
            zero_row,
            paged: None,
            shard,
            prefill_overlap: prefill_overlap_layers(moe),
        })
    }

    /// The embedding and every decoder layer over `cache`, without the
    /// final norm and head: `[B, T, D]` for ids `[B, T]`. Every path runs
    /// through here.
    pub fn hidden(&self, ids: &Array, cache: &mut dyn ForwardCache) -> Result<Array> {
        let overlap = if ids.dim(1) > 1 { self.prefill_overlap } else { 0 };
        self.hidden_as(ids, cache, false, overlap)
    }

    /// [`Lfm2Model::hidden`] as a pure function of its inputs, what a
    /// compiled prefill traces: the whole pass at once (a traced pass
    /// cannot hand MLX its first layers while it is built).
    pub(crate) fn hidden_traced(&self, ids: &Array, cache: &mut dyn ForwardCache) -> Result<Array> {
        self.hidden_as(ids, cache, false, 0)
    }

    /// [`Lfm2Model::hidden`]; with `rows` (one token a row, ids `[B, 1]`)
    /// the residual stream runs as `[B, D]` and so is returned (see
    /// [`decode_rows`]).
    fn hidden_as(&self, ids: &Array, cache: &mut dyn ForwardCache, rows: bool, overlap: usize) -> Result<Array> {
        let eps = self.config.norm_eps;
        let mut h = if rows { self.embed.forward(&ids.reshape(&[ids.dim(0)])?)? } else { self.embed.forward(ids)? };
        // Each layer is `h + op(op_norm(h))`, then `+ ffn(ffn_norm(.))`;
        // the feed-forward's output is added where the next layer norms
        // it, so every residual add meets the norm that follows it.
        let mut pending: Option<Array> = None;
        let eps_array = &self.norm_eps;
        // `overlap`: a prompt's eager pass hands MLX its layers every
        // `overlap` layers as it builds them, so the device runs the first
        // layers while the host builds the rest (never a traced pass).
        for (i, layer) in self.layers.iter().enumerate() {
            let x = Normed { h: &h, r: pending.as_ref(), w: &layer.operator_norm, eps, eps_array };
            let joined = match layer.conv_with_ffn(&x, i, cache)? {
                Some(done) => Some(done),
                None => layer.attention_with_ffn(&x, i, cache)?,
            };
            let (h2, f) = match joined {
                Some(done) => done,
                None => {
                    let (h1, r) = layer.operator(&x, i, cache, Some(&self.zero_row))?;
                    let x = Normed { h: &h1, r: Some(&r), w: &layer.ffn_norm, eps, eps_array };
                    layer.feed_forward(&x)?
                }
            };
            if overlap > 0 && (i + 1) % overlap == 0 && i + 1 < self.layers.len() {
                mlx::async_eval(&[&h2, &f])?;
            }
            pending = Some(f);
            h = h2;
        }
        match pending {
            Some(f) => h.add(&f),
            None => Ok(h),
        }
    }

    /// The final norm and the LM head (tied to the embedding when there
    /// is none): logits `[B, T, V]` for hidden states `[B, T, D]`.
    pub fn head(&self, h: &Array) -> Result<Array> {
        let h = mlx::rms_norm(h, Some(&self.final_norm), self.config.norm_eps)?;
        let logits = match &self.lm_head {
            Some(head) => head.forward(&h)?,
            None => self.embed.as_linear(&h)?,
        };
        // Tensor parallel: every rank samples from rank 0's logits, so the
        // tokens are rank 0's even if a reduction rounded differently on
        // another rank (the others' own head is then never computed).
        match &self.shard {
            Some(s) => s.group.broadcast_array(&logits),
            None => Ok(logits),
        }
    }

    /// Runs `ids` (`[B, T]` int32) through the model, advancing `cache`.
    /// Returns logits for every position, or for the last only.
    pub fn forward(&self, ids: &Array, cache: &mut ModelCache, last_only: bool) -> Result<Array> {
        let mut h = self.forward_hidden(ids, cache)?;
        if last_only {
            let t = h.dim(1);
            h = h.slice_axis(1, t - 1, t)?;
        }
        self.head(&h)
    }

    /// The decoder stack over one sequence's cache: `[B, T, D]`.
    pub fn forward_hidden(&self, ids: &Array, cache: &mut ModelCache) -> Result<Array> {
        let mut pass = cache.pass(ids.dim(1) as usize)?;
        let h = self.hidden(ids, &mut pass)?;
        pass.finish()?;
        Ok(h)
    }

    /// Token ids the embedding has rows for.
    pub fn check_token_ids(&self, ids: &[u32]) -> Result<()> {
        let vocab = self.config.vocab_size as u32;
        match ids.iter().find(|&&id| id >= vocab) {
            Some(&bad) => Err(Error::invalid(format!("token id {bad} is out of range for vocab_size {vocab}"))),
            None => Ok(()),
        }
    }

    /// Prefills several fresh sequences together (nothing cached yet, each
    /// whole prompt in this one call): the prompts right-padded into one
    /// `[B, T]` pass ([`PrefillRows`]). Returns each row's last-token
    /// logits `[B, V]`.
    pub fn prefill_rows(&self, prompts: &[&[u32]], caches: &mut [&mut ModelCache]) -> Result<Array> {
        let b = prompts.len();
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let t = lens.iter().copied().max().unwrap_or(0);
        if b == 0 {
            return Err(Error::invalid("batched prefill takes one non-empty prompt per cache"));
        }
        for p in prompts {
            self.check_token_ids(p)?;
        }
        let mut pass = PrefillRows::new(caches, lens.clone())?;
        let mut padded = vec![0u32; b * t];
        for (i, p) in prompts.iter().enumerate() {
            padded[i * t..i * t + p.len()].copy_from_slice(p);
        }
        let ids = Array::from_slice(&padded, &[b as i32, t as i32])?;
        let h = self.hidden(&ids, &mut pass)?;
        pass.finish(self.config.conv_kernel as i32 - 1)?;
        let d = h.dim(2);
        let rows: Vec<i32> = lens.iter().enumerate().map(|(i, &n)| (i * t + n - 1) as i32).collect();
        let last = h.reshape(&[(b * t) as i32, d])?.take(&Array::from_slice(&rows, &[b as i32])?, 0)?.reshape(&[b as i32, 1, d])?;
        self.head(&last)?.reshape(&[b as i32, -1])
    }

    /// One eager decode step for several sequences at once (continuous
    /// batching): `ids` is `[B, 1]`, row i belonging to `caches[i]`. The
    /// projections, MLPs/MoE, conv and head run once for the batch; each
    /// row attends over its own cache ([`RowsPass`]). Returns logits
    /// `[B, V]` and advances every cache. The eager path's batch (and the
    /// only one for quantized KV caches); the compiled path stacks the
    /// caches instead ([`Lfm2Model::decode_step`] over a `DecodeBatch`).
    pub fn forward_batch(&self, ids: &Array, caches: &mut [&mut ModelCache]) -> Result<Array> {
        let b = caches.len();
        if ids.dim(0) as usize != b || ids.dim(1) != 1 {
            return Err(Error::invalid("batched decode takes one token per sequence"));
        }
        let mut pass = RowsPass::new(caches)?;
        let h = self.hidden(ids, &mut pass)?;
        pass.finish()?;
        self.head(&h)?.reshape(&[b as i32, -1])
    }

    /// One decode step as a pure function of arrays (what the compiled
    /// step traces, src/compiled): inputs token ids `[B, 1]`, positions (an
    /// int32 scalar for one sequence, int32 `[B]` for a batch), then the
    /// [`StackedPass`] state in layer order; outputs the logits `[B, V]`
    /// and the new state in the same order.
    pub fn decode_step(&self, ins: &[Array]) -> Result<Vec<Array>> {
        self.decode_step_as(ins, false)
    }

    /// [`Lfm2Model::decode_step`] for a lone sequence whose K/V buffers (a
    /// flat cache's, or a paged sequence's decode mirrors) nothing else
    /// holds or reads in the step: its attention layers' q/k/v kernel
    /// writes the token's K and V into them in place
    /// (src/kernels/qkv_fused.rs `kv_in_place`), and the step returns them
    /// the same, evaluated after that kernel.
    pub fn decode_step_writing_kv(&self, ins: &[Array]) -> Result<Vec<Array>> {
        self.decode_step_as(ins, true)
    }

    fn decode_step_as(&self, ins: &[Array], kv_in_place: bool) -> Result<Vec<Array>> {
        if ins.len() < 2 {
            return Err(Error::invalid("a decode step takes ids, positions and the state"));
        }
        let ids = &ins[0];
        let mut pass = StackedPass::new(&self.config.attn_layers, ins[1].clone(), ins[2..].to_vec())?;
        if kv_in_place {
            pass = pass.writing_in_place();
        }
        let rows = ids.ndim() == 2 && ids.dim(1) == 1 && decode_rows();
        let h = self.hidden_as(ids, &mut pass, rows, 0)?;
        let logits = self.head(&h)?;
        let logits = if rows { logits } else { logits.reshape(&[ids.dim(0), -1])? };
        let mut out = vec![logits];
        out.extend(pass.into_state());
        Ok(out)
    }

    /// The group size the model is split over (1: not split).
    pub fn world_size(&self) -> usize {
        self.shard.as_ref().map(|s| s.size).unwrap_or(1)
    }

    pub fn rank(&self) -> usize {
        self.shard.as_ref().map(|s| s.rank).unwrap_or(0)
    }

    /// KV heads this rank's caches hold.
    pub fn local_kv_heads(&self) -> i32 {
        (self.config.num_kv_heads / self.world_size()) as i32
    }

    /// Conv channels this rank's caches hold.
    pub fn local_conv_dim(&self) -> i32 {
        (self.config.hidden_size / self.world_size()) as i32
    }

    /// What a stacked decode batch needs to make empty rows.
    pub fn batch_shape(&self) -> BatchShape {
        let c = &self.config;
        BatchShape {
            kv_heads: self.local_kv_heads(),
            head_dim: c.head_dim as i32,
            conv_keep: c.conv_kernel as i32 - 1,
            hidden: self.local_conv_dim(),
            dtype: self.dtype,
        }
    }

    pub fn new_cache(&self) -> ModelCache {
        if let Some(pool) = &self.paged {
            return ModelCache::new_paged(&self.config.attn_layers, pool.clone());
        }
        let mut c = ModelCache::new(&self.config.attn_layers);
        for (lc, codec) in c.layers.iter_mut().zip(self.kv_codecs.iter()) {
            if let (LayerCache::Attention(kv), Some(codec)) = (lc, codec) {
                kv.quant = Some(Box::new(crate::kvquant::QuantKvCache::new(codec.clone())));
            }
        }
        c
    }

    /// Makes every later [`Lfm2Model::new_cache`] a paged one drawing on a
    /// new pool (`salt` keys its prefix index to this model).
    pub fn use_paged_cache(&mut self, cfg: PagedConfig, salt: u64) -> Result<SharedPool> {
        if !self.kv_codecs.is_empty() {
            return Err(Error::config("the paged KV cache cannot be combined with a quantized kvCache"));
        }
        let c = &self.config;
        let shape = PoolShape {
            attn_layers: c.num_attention_layers(),
            conv_layers: c.num_layers - c.num_attention_layers(),
            kv_heads: self.local_kv_heads(),
            head_dim: c.head_dim as i32,
            conv_keep: c.conv_kernel as i32 - 1,
            hidden: self.local_conv_dim(),
            dtype: self.dtype,
        };
        let pool = Arc::new(Mutex::new(PagedPool::new(cfg, shape, salt)?));
        self.paged = Some(pool.clone());
        Ok(pool)
    }

    /// Chooses the KV cache every later [`Lfm2Model::new_cache`] builds.
    /// Each attention layer gets a codec for its own head size. Returns the
    /// per-layer kinds (`None` for conv layers). On error nothing changes.
    pub fn set_kv_cache(&mut self, cfg: &crate::kvquant::KvCacheConfig) -> Result<Vec<Option<crate::kvquant::KvKind>>> {
        let kinds = cfg.layer_kinds(&self.config.attn_layers)?;
        let mut codecs = Vec::with_capacity(kinds.len());
        for (i, (layer, kind)) in self.layers.iter().zip(&kinds).enumerate() {
            codecs.push(match (&layer.operator, kind) {
                (Operator::Attention(a), Some(k)) if k.is_quantized() => Some(
                    crate::kvquant::Codec::new(*k, a.head_dim as usize)
                        .map_err(|e| e.context(format!("attention layer {i}")))?,
                ),
                _ => None,
            });
        }
        self.kv_codecs = if codecs.iter().any(|c| c.is_some()) { codecs } else { vec![] };
        Ok(kinds)
    }

    /// Views the model keeps of its weights (each conv kernel as `[D, L]`,
    /// what the CUDA conv step reads), evaluated at load after the weights:
    /// unevaluated, each was a reshape node in every decode step (one per
    /// conv layer in the H200's node dumps of session 14); not in
    /// [`Lfm2Model::arrays`], whose bytes they share.
    pub fn weight_views(&self) -> Vec<&Array> {
        self.layers
            .iter()
            .filter_map(|l| match &l.operator {
                Operator::Conv(c) => Some(&c.conv_weight_dl),
                Operator::Attention(_) => None,
            })
            .collect()
    }

    /// Every weight array, for evaluation at load and memory accounting.
    pub fn arrays(&self) -> Vec<&Array> {
        let mut v: Vec<&Array> = self.embed.weight.arrays();
        v.push(&self.final_norm);
        if let Some(h) = &self.lm_head {
            v.extend(h.arrays());
        }
        for l in &self.layers {
            v.push(&l.operator_norm);
            v.push(&l.ffn_norm);
            match &l.operator {
                Operator::Attention(a) => {
                    v.extend(a.qkv.arrays());
                    v.extend(a.out_proj.arrays());
                    v.push(&a.q_norm);
                    v.push(&a.k_norm);
                }
                Operator::Conv(c) => {
                    v.extend(c.in_proj.arrays());
                    v.extend(c.out_proj.arrays());
                    v.push(&c.conv_weight);
                    v.extend(c.conv_bias.as_ref());
                }
            }
            match &l.feed_forward {
                FeedForward::Dense(m) => {
                    v.extend(m.w13.arrays());
                    v.extend(m.w2.arrays());
                }
                FeedForward::Moe(m) => v.extend(m.arrays()),
            }
        }
        v
    }

    /// Logical parameter count (quantized weights counted unpacked).
    pub fn parameter_count(&self) -> usize {
        let mut n = self.embed.weight.params() + self.final_norm.size();
        if let Some(h) = &self.lm_head {
            n += h.weight.params();
        }
        for l in &self.layers {
            n += l.operator_norm.size() + l.ffn_norm.size();
            let lin = |p: &Linear| p.weight.params() + p.bias.as_ref().map(|b| b.size()).unwrap_or(0);
            n += match &l.operator {
                Operator::Attention(a) => {
                    a.qkv.params() + lin(&a.out_proj) + a.q_norm.size() + a.k_norm.size()
                }
                Operator::Conv(c) => {
                    lin(&c.in_proj) + lin(&c.out_proj) + c.conv_weight.size() + c.conv_bias.as_ref().map(|b| b.size()).unwrap_or(0)
                }
            };
            n += match &l.feed_forward {
                FeedForward::Dense(m) => m.w13.params() + lin(&m.w2),
                FeedForward::Moe(m) => m.parameter_count(),
            };
        }
        n
    }
}
