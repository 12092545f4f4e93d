//! The LFM2 model family: embedding, hybrid short-conv / attention decoder
//! layers, final norm and tied head. The sparse-MoE feed-forward of
//! LFM2-MoE lives in lfm2_moe.rs; everything else is shared.

use super::cache::{decode_mask, LayerCache, ModelCache};
use super::paged::{self, PagedConfig, PagedPool, PagedSeq, PoolShape, SharedPool};
use parking_lot::Mutex;
use std::sync::Arc;
use super::config::ModelConfig;
use super::linear::{Embedding, Linear};
use super::lfm2_moe::SparseMoe;
use super::quant::QuantRegistry;
use super::weights::TensorStore;
use crate::error::{Error, Result};
use crate::mlx::{self, concatenate, zeros, Array, Dtype, Mask};

pub struct Attention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub out_proj: Linear,
    pub q_norm: Array,
    pub k_norm: Array,
    pub n_heads: i32,
    pub n_kv_heads: i32,
    pub head_dim: i32,
    pub scale: f32,
    pub rope_theta: f32,
    pub eps: f32,
}

impl Attention {
    fn load(st: &mut TensorStore, reg: &QuantRegistry, p: &str, c: &ModelConfig) -> Result<Attention> {
        let (d, hd) = (c.hidden_size, c.head_dim);
        Ok(Attention {
            q_proj: Linear::load(st, reg, &format!("{p}.q_proj"), d, c.num_heads * hd, false)?,
            k_proj: Linear::load(st, reg, &format!("{p}.k_proj"), d, c.num_kv_heads * hd, false)?,
            v_proj: Linear::load(st, reg, &format!("{p}.v_proj"), d, c.num_kv_heads * hd, false)?,
            out_proj: Linear::load(st, reg, &format!("{p}.out_proj"), c.num_heads * hd, d, false)?,
            q_norm: st.get_shaped(&format!("{p}.q_layernorm.weight"), &[hd as i32])?,
            k_norm: st.get_shaped(&format!("{p}.k_layernorm.weight"), &[hd as i32])?,
            n_heads: c.num_heads as i32,
            n_kv_heads: c.num_kv_heads as i32,
            head_dim: hd as i32,
            scale: (hd as f32).powf(-0.5),
            rope_theta: c.rope_theta,
            eps: c.norm_eps,
        })
    }

    /// q, k, v (`[B, heads, T, head_dim]`) after the norms, with RoPE at
    /// `offset`: an int for every row, or an array of one offset per row
    /// (batched decode).
    fn project(&self, x: &Array, offset: RopeOffset) -> Result<(Array, Array, Array)> {
        let (b, t) = (x.dim(0), x.dim(1));
        let hd = self.head_dim;
        let q = self.q_proj.forward(x)?.reshape(&[b, t, self.n_heads, hd])?;
        let k = self.k_proj.forward(x)?.reshape(&[b, t, self.n_kv_heads, hd])?;
        let v = self.v_proj.forward(x)?.reshape(&[b, t, self.n_kv_heads, hd])?;
        let q = mlx::rms_norm(&q, Some(&self.q_norm), self.eps)?.transpose(&[0, 2, 1, 3])?;
        let k = mlx::rms_norm(&k, Some(&self.k_norm), self.eps)?.transpose(&[0, 2, 1, 3])?;
        let v = v.transpose(&[0, 2, 1, 3])?;
        let (q, k) = match offset {
            RopeOffset::Int(off) => (
                mlx::rope(&q, hd, false, self.rope_theta, 1.0, off)?,
                mlx::rope(&k, hd, false, self.rope_theta, 1.0, off)?,
            ),
            RopeOffset::PerRow(offs) => (
                mlx::rope_dyn(&q, hd, false, self.rope_theta, 1.0, offs)?,
                mlx::rope_dyn(&k, hd, false, self.rope_theta, 1.0, offs)?,
            ),
        };
        Ok((q, k, v))
    }

    /// `[B, heads, T, head_dim]` attention output back to `[B, T, D]`.
    fn output(&self, o: &Array) -> Result<Array> {
        let (b, t) = (o.dim(0), o.dim(2));
        let o = o.transpose(&[0, 2, 1, 3])?.reshape(&[b, t, self.n_heads * self.head_dim])?;
        self.out_proj.forward(&o)
    }

    fn forward(&self, x: &Array, cache: &mut super::cache::KvCache) -> Result<Array> {
        let (q, k, v) = self.project(x, RopeOffset::Int(cache.offset as i32))?;
        let o = self.attend_flat(&q, &k, &v, cache)?;
        self.output(&o)
    }

    /// Attention over a flat (or quantized) cache, appending k/v.
    fn attend_flat(&self, q: &Array, k: &Array, v: &Array, cache: &mut super::cache::KvCache) -> Result<Array> {
        if let Some(qc) = cache.quant.as_deref_mut() {
            // Quantized KV cache (kvCache load option): deferred prefill,
            // quantize on insert during decode; see src/kvquant/cache.rs.
            let o = qc.attend(q, k, v, self.scale)?;
            cache.offset = qc.offset();
            Ok(o)
        } else if q.dim(2) > 1 {
            let (k, v) = cache.update_and_fetch(k, v)?;
            mlx::sdpa(q, &k, &v, self.scale, Mask::Causal)
        } else {
            let (k, v, mask) = cache.update_decode(k, v)?;
            mlx::sdpa(q, &k, &v, self.scale, Mask::Array(&mask))
        }
    }

    /// One decode token over a paged sequence's mirror for `layer`.
    #[allow(clippy::too_many_arguments)]
    fn attend_mirror(&self, q: &Array, k: &Array, v: &Array, seq: &mut PagedSeq, layer: usize, pos: usize, mask: &Array) -> Result<Array> {
        let (vk, vv) = &seq.views[layer];
        let (s, h, hd) = (pos as i32, self.n_kv_heads, self.head_dim);
        let vk = vk.slice_update(k, &[0, 0, s, 0], &[1, h, s + 1, hd])?;
        let vv = vv.slice_update(v, &[0, 0, s, 0], &[1, h, s + 1, hd])?;
        let o = mlx::sdpa(q, &vk, &vv, self.scale, Mask::Array(mask))?;
        seq.views[layer] = (vk, vv);
        Ok(o)
    }

    /// Attention over the paged pool. Prefill writes its K/V into the
    /// sequence's blocks and attends over exactly the used blocks (gathered,
    /// causal); decode writes the token into the sequence's decode mirror
    /// and attends over it with `mask` (the same shapes and ops as the flat
    /// decode and the compiled step); full blocks reach the pool after the
    /// step.
    #[allow(clippy::too_many_arguments)]
    fn forward_paged(
        &self,
        x: &Array,
        pool: &mut PagedPool,
        seq: &mut PagedSeq,
        layer: usize,
        start: usize,
        table: Option<&Array>,
        mask: Option<&Array>,
    ) -> Result<Array> {
        let t = x.dim(1);
        let (q, k, v) = self.project(x, RopeOffset::Int(start as i32))?;
        let o = match (table, mask) {
            // From position 0 this call's K/V are the whole sequence: attend
            // over them directly (the same values the blocks now hold).
            (Some(_), _) if start == 0 => {
                paged::write_prefill(pool, seq, layer, start, &k, &v)?;
                mlx::sdpa(&q, &k, &v, self.scale, Mask::Causal)?
            }
            (Some(tb), _) => {
                paged::write_prefill(pool, seq, layer, start, &k, &v)?;
                let end = (start + t as usize) as i32;
                let kg = paged::gather(pool.keys(layer), tb)?.slice_axis(2, 0, end)?;
                let vg = paged::gather(pool.values(layer), tb)?.slice_axis(2, 0, end)?;
                mlx::sdpa(&q, &kg, &vg, self.scale, Mask::Causal)?
            }
            (None, Some(m)) => self.attend_mirror(&q, &k, &v, seq, layer, start, m)?,
            (None, None) => return Err(Error::invalid("paged attention needs a table or a decode mask")),
        };
        self.output(&o)
    }
}

enum RopeOffset<'a> {
    Int(i32),
    PerRow(&'a Array),
}

/// The double-gated short convolution ("LIV" operator).
pub struct ShortConv {
    pub in_proj: Linear,
    pub out_proj: Linear,
    /// Depthwise kernel in MLX layout `[D, L, 1]`.
    pub conv_weight: Array,
    pub conv_bias: Option<Array>,
    pub kernel: i32,
    pub dim: i32,
}

impl ShortConv {
    fn load(st: &mut TensorStore, reg: &QuantRegistry, p: &str, c: &ModelConfig) -> Result<ShortConv> {
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
        Ok(ShortConv {
            in_proj: Linear::load(st, reg, &format!("{p}.in_proj"), d as usize, 3 * d as usize, c.conv_bias)?,
            out_proj: Linear::load(st, reg, &format!("{p}.out_proj"), d as usize, d as usize, c.conv_bias)?,
            conv_weight: w,
            conv_bias: if c.conv_bias { Some(st.get_shaped(&format!("{p}.conv.bias"), &[d])?) } else { None },
            kernel: l,
            dim: d,
        })
    }

    /// `taps`: positions j (1..=T) of this call after which the state is
    /// also wanted (paged-cache snapshots at block boundaries); those
    /// states go to `tapped` as one `[1, taps * keep, D]` array.
    fn forward(&self, x: &Array, state: &mut Option<Array>, taps: &[i32], tapped: &mut Vec<Array>) -> Result<Array> {
        let bcx = self.in_proj.forward(x)?;
        let parts = bcx.split_equal(3, -1)?;
        let bx = parts[0].mul(&parts[2])?;
        let keep = self.kernel - 1;
        let prev = match state.take() {
            Some(s) => s,
            None => zeros(&[bx.dim(0), keep, self.dim], bx.dtype())?,
        };
        let padded = concatenate(&[&prev, &bx], 1)?;
        let n = padded.dim(1);
        // Row j of `padded` is input j - keep, so the state after j inputs
        // is rows j..j+keep.
        if !taps.is_empty() {
            // One gather of every tap's rows (a kernel per layer, not per tap).
            let rows: Vec<i32> = taps.iter().flat_map(|&j| j..j + keep).collect();
            let idx = Array::from_slice(&rows, &[rows.len() as i32])?;
            tapped.push(padded.take(&idx, 1)?);
        }
        *state = Some(padded.slice_axis(1, n - keep, n)?);
        let mut conv = mlx::conv1d(&padded, &self.conv_weight, 1, 0, 1, self.dim)?;
        if let Some(b) = &self.conv_bias {
            conv = conv.add(b)?;
        }
        let y = parts[1].mul(&conv)?;
        self.out_proj.forward(&y)
    }
}

/// SwiGLU: `w2(silu(w1 x) * w3 x)`.
pub struct Mlp {
    pub w1: Linear,
    pub w2: Linear,
    pub w3: Linear,
}

impl Mlp {
    fn load(st: &mut TensorStore, reg: &QuantRegistry, p: &str, d: usize, ff: usize) -> Result<Mlp> {
        // LFM2 names them w1/w2/w3; LFM2-MoE checkpoints converted by mlx-lm use gate/down/up_proj.
        let names = if st.has(&format!("{p}.gate_proj.weight")) {
            ["gate_proj", "down_proj", "up_proj"]
        } else {
            ["w1", "w2", "w3"]
        };
        Ok(Mlp {
            w1: Linear::load(st, reg, &format!("{p}.{}", names[0]), d, ff, false)?,
            w2: Linear::load(st, reg, &format!("{p}.{}", names[1]), ff, d, false)?,
            w3: Linear::load(st, reg, &format!("{p}.{}", names[2]), d, ff, false)?,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let g = self.w1.forward(x)?.silu()?;
        self.w2.forward(&g.mul(&self.w3.forward(x)?)?)
    }
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
}

impl Layer {
    /// `h + ffn(ffn_norm(h))`: the second half of every decoder layer.
    fn feed_forward_residual(&self, h: &Array, eps: f32) -> Result<Array> {
        let x = mlx::rms_norm(h, Some(&self.ffn_norm), eps)?;
        let f = match &self.feed_forward {
            FeedForward::Dense(m) => m.forward(&x)?,
            FeedForward::Moe(m) => m.forward(&x)?,
        };
        h.add(&f)
    }
}

pub struct Lfm2Model {
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
    /// The paged KV pool every new cache draws from; None: flat caches.
    /// Set with [`Lfm2Model::use_paged_cache`].
    pub paged: Option<SharedPool>,
}

impl Lfm2Model {
    pub fn load(st: &mut TensorStore, config: ModelConfig, registry: QuantRegistry) -> Result<Lfm2Model> {
        let c = &config;
        let d = c.hidden_size;
        let final_norm = st.get_shaped("model.embedding_norm.weight", &[d as i32])?;
        let dtype = final_norm.dtype();
        let embed = Embedding::load(st, &registry, "model.embed_tokens", c.vocab_size, d, dtype)?;
        let mut layers = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let operator = if c.attn_layers[i] {
                Operator::Attention(Attention::load(st, &registry, &format!("{p}.self_attn"), c)?)
            } else {
                Operator::Conv(ShortConv::load(st, &registry, &format!("{p}.conv"), c)?)
            };
            let feed_forward = if c.is_moe_layer(i) {
                FeedForward::Moe(SparseMoe::load(st, &registry, &format!("{p}.feed_forward"), c)?)
            } else {
                FeedForward::Dense(Mlp::load(st, &registry, &format!("{p}.feed_forward"), d, c.ff_dim)?)
            };
            layers.push(Layer {
                operator,
                feed_forward,
                operator_norm: st.get_shaped(&format!("{p}.operator_norm.weight"), &[d as i32])?,
                ffn_norm: st.get_shaped(&format!("{p}.ffn_norm.weight"), &[d as i32])?,
            });
        }
        let lm_head = if c.tie_word_embeddings && !st.has("lm_head.weight") {
            None
        } else {
            Some(Linear::load(st, &registry, "lm_head", d, c.vocab_size, false)?)
        };
        Ok(Lfm2Model { config, embed, layers, final_norm, lm_head, registry, dtype, kv_codecs: vec![], paged: None })
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

    /// The final norm and the LM head (tied to the embedding when there
    /// is none): logits `[B, T, V]` for hidden states `[B, T, D]`.
    fn head(&self, h: &Array) -> Result<Array> {
        let h = mlx::rms_norm(h, Some(&self.final_norm), self.config.norm_eps)?;
        match &self.lm_head {
            Some(head) => head.forward(&h),
            None => self.embed.as_linear(&h),
        }
    }

    /// The decoder stack without the final norm and head: `[B, T, D]`.
    pub fn forward_hidden(&self, ids: &Array, cache: &mut ModelCache) -> Result<Array> {
        let eps = self.config.norm_eps;
        let t = ids.dim(1) as usize;
        // Paged: blocks for the new positions first (an exhausted pool fails
        // before anything is written), the attention table and decode mask
        // once for all layers, and the block boundaries to snapshot at.
        let mut table = None;
        let mut mask = None;
        let mut taps: Vec<i32> = vec![];
        let start = cache.pos;
        if let Some(seq) = cache.paged.as_mut() {
            if seq.len != start {
                return Err(Error::invalid("paged cache length does not match the cache position"));
            }
            seq.reserve(t)?;
            let bs = seq.block_size();
            taps = ((start / bs + 1) * bs..=start + t).step_by(bs).map(|p| (p - start) as i32).collect();
            if t == 1 {
                seq.ensure_views(start + 1)?;
                mask = Some(decode_mask(seq.view_cap as i32, start as i32)?);
            } else {
                seq.drop_views()?;
                table = Some(seq.table(start + t, false)?);
            }
        }
        let pool_arc = cache.paged.as_ref().map(|s| s.pool.clone());
        let mut pool = pool_arc.as_ref().map(|p| p.lock());
        let mut tapped: Vec<Vec<Array>> = vec![];
        let mut h = self.embed.forward(ids)?;
        for (layer, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let x = mlx::rms_norm(&h, Some(&layer.operator_norm), eps)?;
            let r = match (&layer.operator, lc) {
                (Operator::Attention(a), LayerCache::Attention(kv)) => a.forward(&x, kv)?,
                (Operator::Attention(a), LayerCache::Paged(i)) => {
                    let (Some(p), Some(seq)) = (pool.as_deref_mut(), cache.paged.as_mut()) else {
                        return Err(Error::invalid("paged attention layer without a paged sequence"));
                    };
                    a.forward_paged(&x, p, seq, *i, start, table.as_ref(), mask.as_ref())?
                }
                (Operator::Conv(c), LayerCache::Conv(s)) => {
                    let mut got = vec![];
                    let y = c.forward(&x, s, &taps, &mut got)?;
                    if !taps.is_empty() {
                        tapped.push(got);
                    }
                    y
                }
                _ => return Err(Error::invalid("cache layout does not match the model's layers")),
            };
            h = layer.feed_forward_residual(&h.add(&r)?, eps)?;
        }
        drop(pool);
        if let Some(seq) = cache.paged.as_mut() {
            seq.len += t;
            if t == 1 {
                seq.after_decode_step()?;
            } else {
                seq.flushed = seq.len;
            }
            let mut snaps = vec![];
            // [conv_layers, 1, taps * keep, D]: every layer's tapped states.
            let layers: Vec<&Array> = tapped.iter().map(|per_layer| &per_layer[0]).collect();
            let all = if layers.is_empty() { None } else { Some(paged::snapshot_of(&layers)?) };
            let keep = self.config.conv_kernel as i32 - 1;
            for (i, &j) in taps.iter().enumerate() {
                let snap = match &all {
                    Some(a) => a.slice_axis(2, i as i32 * keep, (i as i32 + 1) * keep)?,
                    None => paged::snapshot_of(&[])?,
                };
                seq.keep_snapshot(start + j as usize, snap.clone());
                snaps.push(snap);
            }
            for s in snaps {
                cache.push_fresh(s);
            }
        }
        cache.pos += t;
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
    /// `[B, T]` forward. Padding sits after each row's tokens, so causal
    /// attention and the causal conv never let it reach a real token. Each
    /// row's K/V (its own positions only), its conv states after its last
    /// token and, for a paged cache, the conv snapshots at its block ends
    /// go to its own cache, as a single prefill would leave them. Returns
    /// each row's last-token logits `[B, V]`.
    pub fn prefill_rows(&self, prompts: &[&[u32]], caches: &mut [&mut ModelCache]) -> Result<Array> {
        let b = prompts.len();
        let lens: Vec<usize> = prompts.iter().map(|p| p.len()).collect();
        let t = lens.iter().copied().max().unwrap_or(0);
        if b == 0 || b != caches.len() || lens.contains(&0) {
            return Err(Error::invalid("batched prefill takes one non-empty prompt per cache"));
        }
        for (c, p) in caches.iter_mut().zip(prompts) {
            self.check_token_ids(p)?;
            if c.pos != 0 {
                return Err(Error::invalid("batched prefill takes fresh caches"));
            }
            if !super::batch::stackable(c) {
                return Err(Error::invalid("a quantized KV cache is prefilled alone"));
            }
            if let Some(seq) = c.paged.as_mut() {
                seq.reserve(p.len())?;
            }
        }
        // Conv states are wanted after every row's last token and, for
        // paged rows, after each of its full blocks: one gather per layer.
        let mut taps: std::collections::BTreeSet<i32> = lens.iter().map(|&n| n as i32).collect();
        for (c, &n) in caches.iter().zip(&lens) {
            if let Some(bs) = c.paged.as_ref().map(|s| s.block_size()) {
                taps.extend((bs..=n).step_by(bs).map(|e| e as i32));
            }
        }
        let taps: Vec<i32> = taps.into_iter().collect();
        let mut padded = vec![0u32; b * t];
        for (i, p) in prompts.iter().enumerate() {
            padded[i * t..i * t + p.len()].copy_from_slice(p);
        }
        let ids = Array::from_slice(&padded, &[b as i32, t as i32])?;
        let eps = self.config.norm_eps;
        let mut tapped: Vec<Array> = vec![];
        let mut h = self.embed.forward(&ids)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let x = mlx::rms_norm(&h, Some(&layer.operator_norm), eps)?;
            let r = match &layer.operator {
                Operator::Attention(a) => {
                    let (q, k, v) = a.project(&x, RopeOffset::Int(0))?;
                    let o = mlx::sdpa(&q, &k, &v, a.scale, Mask::Causal)?;
                    for (i, c) in caches.iter_mut().enumerate() {
                        let (r, n) = (i as i32, lens[i] as i32);
                        let row = |a: &Array| a.slice(&[r, 0, 0, 0], &[r + 1, a.dim(1), n, a.dim(3)], &[1, 1, 1, 1]);
                        let (kr, vr) = (row(&k)?, row(&v)?);
                        let c: &mut ModelCache = c;
                        match &mut c.layers[li] {
                            LayerCache::Attention(kv) => kv.append(&kr, &vr)?,
                            LayerCache::Paged(ord) => {
                                let seq = c.paged.as_ref().ok_or_else(|| Error::invalid("paged layer without a paged sequence"))?;
                                paged::write_prefill(&mut seq.pool.lock(), seq, *ord, 0, &kr, &vr)?;
                            }
                            LayerCache::Conv(_) => return Err(Error::invalid("cache layout does not match the model's layers")),
                        }
                    }
                    a.output(&o)?
                }
                Operator::Conv(cv) => {
                    let (mut state, mut got) = (None, vec![]);
                    let y = cv.forward(&x, &mut state, &taps, &mut got)?;
                    tapped.extend(got);
                    y
                }
            };
            h = layer.feed_forward_residual(&h.add(&r)?, eps)?;
        }
        // [conv layers, B, taps * keep, D]: a row's states after j tokens
        // are its slice at tap j, in the snapshot layout ([layers, 1, keep, D]).
        let keep = self.config.conv_kernel as i32 - 1;
        let refs: Vec<&Array> = tapped.iter().collect();
        let all = if refs.is_empty() { None } else { Some(mlx::stack(&refs, 0)?) };
        for (i, c) in caches.iter_mut().enumerate() {
            let n = lens[i];
            let states_after = |j: usize| -> Result<Array> {
                let Some(a) = &all else { return paged::snapshot_of(&[]) };
                let s = taps.iter().position(|&x| x == j as i32).expect("every wanted position is tapped") as i32 * keep;
                let r = i as i32;
                a.slice(&[0, r, s, 0], &[a.dim(0), r + 1, s + keep, a.dim(3)], &[1, 1, 1, 1])
            };
            c.restore_conv_states(&states_after(n)?)?;
            let mut snaps = vec![];
            if let Some(seq) = c.paged.as_mut() {
                seq.len = n;
                seq.flushed = n;
                for e in (seq.block_size()..=n).step_by(seq.block_size()) {
                    let snap = states_after(e)?;
                    seq.keep_snapshot(e, snap.clone());
                    snaps.push(snap);
                }
            }
            for s in snaps {
                c.push_fresh(s);
            }
            c.pos = n;
        }
        let d = h.dim(2);
        let rows: Vec<i32> = lens.iter().enumerate().map(|(i, &n)| (i * t + n - 1) as i32).collect();
        let last = h.reshape(&[(b * t) as i32, d])?.take(&Array::from_slice(&rows, &[b as i32])?, 0)?.reshape(&[b as i32, 1, d])?;
        self.head(&last)?.reshape(&[b as i32, -1])
    }

    /// One decode step for several sequences at once (continuous
    /// batching): `ids` is `[B, 1]`, row i belonging to `caches[i]`. The
    /// projections, MLPs/MoE, conv and head run once for the batch; each
    /// row attends over its own cache (flat, quantized or paged mirror) with
    /// its own position. Returns logits `[B, V]` and advances every cache.
    /// The eager path's batch (and the only one for quantized KV caches);
    /// the compiled path stacks the caches instead (model::batch).
    pub fn forward_batch(&self, ids: &Array, caches: &mut [&mut ModelCache]) -> Result<Array> {
        let eps = self.config.norm_eps;
        let b = caches.len();
        if ids.dim(0) as usize != b || ids.dim(1) != 1 {
            return Err(Error::invalid("batched decode takes one token per sequence"));
        }
        let positions: Vec<usize> = caches.iter().map(|c| c.pos).collect();
        // Per-row paged preparation and decode masks.
        let mut masks: Vec<Option<Array>> = Vec::with_capacity(b);
        for (c, &pos) in caches.iter_mut().zip(&positions) {
            c.begin_decode_token()?;
            masks.push(match c.paged.as_ref() {
                Some(seq) => Some(decode_mask(seq.view_cap as i32, pos as i32)?),
                None => None,
            });
        }
        let offsets: Vec<i32> = positions.iter().map(|&p| p as i32).collect();
        let offsets = Array::from_slice(&offsets, &[b as i32])?;
        let keep = self.config.conv_kernel as i32 - 1;
        let d = self.config.hidden_size as i32;
        let mut h = self.embed.forward(ids)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let x = mlx::rms_norm(&h, Some(&layer.operator_norm), eps)?;
            let r = match &layer.operator {
                Operator::Attention(a) => {
                    let (q, k, v) = a.project(&x, RopeOffset::PerRow(&offsets))?;
                    let mut outs = Vec::with_capacity(b);
                    for (i, c) in caches.iter_mut().enumerate() {
                        let r = |t: &Array| t.slice_axis(0, i as i32, i as i32 + 1);
                        let (qi, ki, vi) = (r(&q)?, r(&k)?, r(&v)?);
                        let c: &mut ModelCache = c;
                        let o = match &mut c.layers[li] {
                            LayerCache::Attention(kv) => a.attend_flat(&qi, &ki, &vi, kv)?,
                            LayerCache::Paged(idx) => {
                                let (idx, seq) = (*idx, c.paged.as_mut().expect("paged layer in a paged cache"));
                                a.attend_mirror(&qi, &ki, &vi, seq, idx, positions[i], masks[i].as_ref().unwrap())?
                            }
                            LayerCache::Conv(_) => return Err(Error::invalid("cache layout does not match the model's layers")),
                        };
                        outs.push(o);
                    }
                    let refs: Vec<&Array> = outs.iter().collect();
                    a.output(&concatenate(&refs, 0)?)?
                }
                Operator::Conv(cv) => {
                    let mut states = Vec::with_capacity(b);
                    for c in caches.iter() {
                        states.push(match &c.layers[li] {
                            LayerCache::Conv(Some(s)) => s.clone(),
                            LayerCache::Conv(None) => zeros(&[1, keep, d], self.dtype)?,
                            _ => return Err(Error::invalid("cache layout does not match the model's layers")),
                        });
                    }
                    let refs: Vec<&Array> = states.iter().collect();
                    let mut st = Some(concatenate(&refs, 0)?);
                    let y = cv.forward(&x, &mut st, &[], &mut vec![])?;
                    let st = st.expect("conv state after a step");
                    for (i, c) in caches.iter_mut().enumerate() {
                        c.layers[li] = LayerCache::Conv(Some(st.slice_axis(0, i as i32, i as i32 + 1)?));
                    }
                    y
                }
            };
            h = layer.feed_forward_residual(&h.add(&r)?, eps)?;
        }
        for c in caches.iter_mut() {
            c.end_decode_token()?;
        }
        self.head(&h)?.reshape(&[b as i32, -1])
    }

    /// What a stacked decode batch needs to make empty rows.
    pub fn batch_shape(&self) -> super::batch::BatchShape {
        let c = &self.config;
        super::batch::BatchShape {
            kv_heads: c.num_kv_heads as i32,
            head_dim: c.head_dim as i32,
            conv_keep: c.conv_kernel as i32 - 1,
            hidden: c.hidden_size as i32,
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
            kv_heads: c.num_kv_heads as i32,
            head_dim: c.head_dim as i32,
            conv_keep: c.conv_kernel as i32 - 1,
            hidden: c.hidden_size as i32,
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
                    for p in [&a.q_proj, &a.k_proj, &a.v_proj, &a.out_proj] {
                        v.extend(p.arrays());
                    }
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
                    for p in [&m.w1, &m.w2, &m.w3] {
                        v.extend(p.arrays());
                    }
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
                    lin(&a.q_proj) + lin(&a.k_proj) + lin(&a.v_proj) + lin(&a.out_proj) + a.q_norm.size() + a.k_norm.size()
                }
                Operator::Conv(c) => {
                    lin(&c.in_proj) + lin(&c.out_proj) + c.conv_weight.size() + c.conv_bias.as_ref().map(|b| b.size()).unwrap_or(0)
                }
            };
            n += match &l.feed_forward {
                FeedForward::Dense(m) => lin(&m.w1) + lin(&m.w2) + lin(&m.w3),
                FeedForward::Moe(m) => m.parameter_count(),
            };
        }
        n
    }
}
