//! The compiled decode path: registers a loaded model's weights (and its
//! quant registry's per-projection formats) with the C++ decode step once,
//! then runs one compiled call per token over the model's flat caches.

use crate::error::{Error, Result};
use crate::mlx::{self, Array, Dtype};
use crate::model::cache::LayerCache;
use crate::model::lfm2::{FeedForward, Operator};
use crate::model::lfm2_moe::SparseMoe;
use crate::model::linear::{Linear, Weight};
use crate::model::batch::DecodeBatch;
use crate::model::{Lfm2Model, ModelCache};

/// The C++ decoder for one loaded model. Not Send: it lives on the model's
/// worker thread, like every other MLX object of that model.
pub struct CompiledDecoder {
    handle: mlx::DecoderHandle,
}

fn add_weight(d: &mlx::DecoderHandle, name: &str, a: &Array) -> Result<()> {
    d.add_weight(name, a)
}

fn add_projection(d: &mlx::DecoderHandle, path: &str, w: &Weight) -> Result<()> {
    match w {
        Weight::Dense(a) => add_weight(d, &format!("{path}.weight"), a),
        Weight::Quant(q) => {
            add_weight(d, &format!("{path}.weight"), &q.weight)?;
            add_weight(d, &format!("{path}.scales"), &q.scales)?;
            if let Some(b) = &q.biases {
                add_weight(d, &format!("{path}.biases"), b)?;
            }
            d.set_quant(path, q.spec)
        }
    }
}

fn add_linear(d: &mlx::DecoderHandle, path: &str, l: &Linear) -> Result<()> {
    add_projection(d, path, &l.weight)?;
    if let Some(b) = &l.bias {
        add_weight(d, &format!("{path}.bias"), b)?;
    }
    Ok(())
}

fn add_moe(d: &mlx::DecoderHandle, p: &str, m: &SparseMoe) -> Result<()> {
    add_linear(d, &format!("{p}gate"), &m.gate)?;
    if let Some(b) = &m.expert_bias {
        add_weight(d, &format!("{p}expert_bias"), b)?;
    }
    add_projection(d, &format!("{p}eg"), &m.gate_proj)?;
    add_projection(d, &format!("{p}eu"), &m.up_proj)?;
    add_projection(d, &format!("{p}ed"), &m.down_proj)
}

impl CompiledDecoder {
    pub fn new(model: &Lfm2Model) -> Result<CompiledDecoder> {
        Self::with_config(model, |_| {})
    }

    /// `tweak` edits the C++ config before use (tests break it on purpose).
    pub(crate) fn with_config(model: &Lfm2Model, tweak: impl Fn(&mut mlx::DecoderConfig)) -> Result<CompiledDecoder> {
        let c = &model.config;
        let moe_layers: Vec<bool> = (0..c.num_layers).map(|i| c.is_moe_layer(i)).collect();
        let first_moe = model.layers.iter().find_map(|l| match &l.feed_forward {
            FeedForward::Moe(m) => Some(m),
            _ => None,
        });
        let cfg = mlx::DecoderConfig {
            num_layers: c.num_layers as i32,
            hidden_size: c.hidden_size as i32,
            num_heads: c.num_heads as i32,
            num_kv_heads: c.num_kv_heads as i32,
            head_dim: c.head_dim as i32,
            conv_kernel: c.conv_kernel as i32,
            norm_eps: c.norm_eps,
            rope_theta: c.rope_theta,
            attn_scale: (c.head_dim as f32).powf(-0.5),
            num_experts: c.moe.as_ref().map(|m| m.num_experts as i32).unwrap_or(0),
            experts_per_token: c.moe.as_ref().map(|m| m.experts_per_token as i32).unwrap_or(0),
            norm_topk_prob: c.moe.as_ref().map(|m| m.norm_topk_prob as i32).unwrap_or(0),
            routed_scaling_factor: c.moe.as_ref().map(|m| m.routed_scaling_factor).unwrap_or(1.0),
            cpu_non_f32_experts: first_moe.map(|m| m.cpu_non_f32() as i32).unwrap_or(0),
            // Decode batches of every size from 2 to 16 over caches up to
            // 4k positions stay traced; beyond, traces start over.
            max_traces: 256,
        };
        let mut cfg = cfg;
        tweak(&mut cfg);
        let d = mlx::DecoderHandle::new(&cfg, &c.attn_layers, &moe_layers)?;
        add_projection(&d, "embed", &model.embed.weight)?;
        if let Some(h) = &model.lm_head {
            add_linear(&d, "lm_head", h)?;
        }
        add_weight(&d, "final_norm", &model.final_norm)?;
        for (i, l) in model.layers.iter().enumerate() {
            let p = format!("L{i}.");
            add_weight(&d, &format!("{p}op_norm"), &l.operator_norm)?;
            add_weight(&d, &format!("{p}ffn_norm"), &l.ffn_norm)?;
            match &l.operator {
                Operator::Attention(a) => {
                    add_linear(&d, &format!("{p}q"), &a.q_proj)?;
                    add_linear(&d, &format!("{p}k"), &a.k_proj)?;
                    add_linear(&d, &format!("{p}v"), &a.v_proj)?;
                    add_linear(&d, &format!("{p}o"), &a.out_proj)?;
                    add_weight(&d, &format!("{p}q_norm"), &a.q_norm)?;
                    add_weight(&d, &format!("{p}k_norm"), &a.k_norm)?;
                }
                Operator::Conv(cv) => {
                    add_linear(&d, &format!("{p}in"), &cv.in_proj)?;
                    add_linear(&d, &format!("{p}out"), &cv.out_proj)?;
                    add_weight(&d, &format!("{p}conv_w"), &cv.conv_weight)?;
                    if let Some(b) = &cv.conv_bias {
                        add_weight(&d, &format!("{p}conv_b"), b)?;
                    }
                }
            }
            match &l.feed_forward {
                FeedForward::Dense(m) => {
                    add_linear(&d, &format!("{p}w1"), &m.w1)?;
                    add_linear(&d, &format!("{p}w2"), &m.w2)?;
                    add_linear(&d, &format!("{p}w3"), &m.w3)?;
                }
                FeedForward::Moe(m) => add_moe(&d, &p, m)?,
            }
        }
        d.finalize()?;
        Ok(CompiledDecoder { handle: d })
    }

    /// One decode step for token `ids` (`[1, 1]`): returns logits `[1, V]`
    /// and advances `cache`. `compiled = false` runs the same graph without
    /// `mx::compile` (used to prove the compiled step exact). A flat cache
    /// passes its K/V buffers; a paged one its decode mirrors (the same
    /// shapes: one compiled function serves both).
    pub fn step(&self, model: &Lfm2Model, ids: &Array, cache: &mut ModelCache, compiled: bool) -> Result<Array> {
        let c = &model.config;
        cache.begin_decode_token()?;
        let pos = Array::scalar(cache.pos as f64, Dtype::Int32)?;
        let mut ins: Vec<Array> = vec![ids.clone(), pos];
        let kv_shape = [1, c.num_kv_heads as i32, 1, c.head_dim as i32];
        for lc in cache.layers.iter_mut() {
            match lc {
                LayerCache::Attention(kv) => {
                    let (k, v) = kv.buffers_for_step(|| mlx::zeros(&kv_shape, model.dtype))?;
                    ins.push(k);
                    ins.push(v);
                }
                LayerCache::Paged(i) => {
                    let seq = cache.paged.as_ref().ok_or_else(|| Error::invalid("paged layer without a paged sequence"))?;
                    let (k, v) = &seq.views[*i];
                    ins.push(k.clone());
                    ins.push(v.clone());
                }
                LayerCache::Conv(s) => ins.push(conv_state(model, s)?),
            }
        }
        let refs: Vec<&Array> = ins.iter().collect();
        let outs = self.handle.step(compiled, &refs)?;
        drop(refs);
        if outs.len() != ins.len() - 1 {
            return Err(Error::mlx(format!("compiled decode returned {} arrays, expected {}", outs.len(), ins.len() - 1)));
        }
        // Let go of the old buffers before the step runs, so MLX can update
        // them in place; only now, with the whole step built, is the cache
        // touched.
        drop(ins);
        let mut it = outs.into_iter();
        let logits = it.next().unwrap();
        for lc in cache.layers.iter_mut() {
            match lc {
                LayerCache::Attention(kv) => {
                    let k = it.next().unwrap();
                    let v = it.next().unwrap();
                    kv.commit_step(k, v);
                }
                LayerCache::Paged(i) => {
                    let kv = (it.next().unwrap(), it.next().unwrap());
                    cache.paged.as_mut().expect("checked above").views[*i] = kv;
                }
                LayerCache::Conv(s) => *s = Some(it.next().unwrap()),
            }
        }
        cache.end_decode_token()?;
        Ok(logits)
    }

    /// One step for every row of `batch` (members in row order): `ids`
    /// `[B, 1]`, `positions` (int32 `[B]`) each row's position. Returns logits `[B, V]`;
    /// the batch holds the new state. The caches' own bookkeeping
    /// (`begin/end_decode_token`) is the caller's.
    pub fn step_batch(&self, ids: &Array, positions: &Array, batch: &mut DecodeBatch, compiled: bool) -> Result<Array> {
        let b = positions.size();
        if b != batch.len() || ids.dim(0) as usize != b {
            return Err(Error::invalid("batched decode: ids, positions and batch rows differ in number"));
        }
        let state = batch.take_state();
        let n = state.len();
        let mut ins: Vec<Array> = vec![ids.clone(), positions.clone()];
        ins.extend(state);
        let refs: Vec<&Array> = ins.iter().collect();
        let outs = self.handle.step(compiled, &refs);
        drop(refs);
        let outs = match outs {
            Ok(o) if o.len() == n + 1 => o,
            // Nothing ran: the batch gets its state back untouched.
            Ok(o) => {
                batch.put_state(ins.split_off(2));
                return Err(Error::mlx(format!("compiled decode returned {} arrays, expected {}", o.len(), n + 1)));
            }
            Err(e) => {
                batch.put_state(ins.split_off(2));
                return Err(e);
            }
        };
        drop(ins);
        let mut it = outs.into_iter();
        let logits = it.next().unwrap();
        batch.put_state(it.collect());
        Ok(logits)
    }
}

fn conv_state(model: &Lfm2Model, s: &Option<Array>) -> Result<Array> {
    let c = &model.config;
    match s {
        Some(s) => Ok(s.clone()),
        None => mlx::zeros(&[1, c.conv_kernel as i32 - 1, c.hidden_size as i32], model.dtype),
    }
}

#[cfg(test)]
mod tests;
