//! Flat per-sequence caches: a KV cache per attention layer that grows in
//! fixed steps (one allocation per `step` tokens, never a concatenate per
//! token), and the short-conv state per conv layer.

use crate::error::Result;
use super::paged::{PagedSeq, SharedPool};
use crate::mlx::{arange, concatenate, eval, zeros, Array, Dtype};

/// Tokens added to a KV cache's capacity each time it fills up.
pub const KV_STEP: usize = 256;

#[derive(Clone, Default)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    pub offset: usize,
    /// A quantized cache (the `kvCache` load option) replaces the flat
    /// buffers when set; `offset` mirrors its length. Eager decode only.
    pub quant: Option<Box<crate::kvquant::QuantKvCache>>,
}

impl KvCache {
    fn capacity(&self) -> usize {
        self.keys.as_ref().map(|k| k.dim(2) as usize).unwrap_or(0)
    }

    /// Makes room for `t` more tokens, growing by whole `KV_STEP`s.
    fn reserve(&mut self, t: usize, like_k: &Array, like_v: &Array) -> Result<()> {
        let prev = self.offset;
        if self.keys.is_some() && prev + t <= self.capacity() {
            return Ok(());
        }
        let (b, h, dk, dv) = (like_k.dim(0), like_k.dim(1), like_k.dim(3), like_v.dim(3));
        let n_steps = t.div_ceil(KV_STEP) as i32;
        let new_k = zeros(&[b, h, n_steps * KV_STEP as i32, dk], like_k.dtype())?;
        let new_v = zeros(&[b, h, n_steps * KV_STEP as i32, dv], like_v.dtype())?;
        match (self.keys.take(), self.values.take()) {
            (Some(ok), Some(ov)) => {
                let (ok, ov) = if prev % KV_STEP != 0 {
                    (ok.slice_axis(2, 0, prev as i32)?, ov.slice_axis(2, 0, prev as i32)?)
                } else {
                    (ok, ov)
                };
                self.keys = Some(concatenate(&[&ok, &new_k], 2)?);
                self.values = Some(concatenate(&[&ov, &new_v], 2)?);
            }
            _ => {
                self.keys = Some(new_k);
                self.values = Some(new_v);
            }
        }
        Ok(())
    }

    /// Writes `k`, `v` (`[B, kv_heads, T, head_dim]`) at the current offset
    /// (also a decode batch or batched prefill handing a sequence its rows).
    pub fn append(&mut self, k: &Array, v: &Array) -> Result<()> {
        let t = k.dim(2) as usize;
        self.reserve(t, k, v)?;
        let prev = self.offset as i32;
        self.offset += t;
        let end = self.offset as i32;
        let (b, h) = (k.dim(0), k.dim(1));
        let nk = self.keys.as_ref().unwrap().slice_update(k, &[0, 0, prev, 0], &[b, h, end, k.dim(3)])?;
        let nv = self.values.as_ref().unwrap().slice_update(v, &[0, 0, prev, 0], &[b, h, end, v.dim(3)])?;
        self.keys = Some(nk);
        self.values = Some(nv);
        Ok(())
    }

    /// Appends `k`, `v` and returns views of everything cached so far
    /// (multi-token steps: prefill).
    pub fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        self.append(k, v)?;
        let end = self.offset as i32;
        Ok((self.keys.as_ref().unwrap().slice_axis(2, 0, end)?, self.values.as_ref().unwrap().slice_axis(2, 0, end)?))
    }

    /// Appends one token's `k`, `v` and returns the whole buffers with a
    /// boolean mask of the filled positions (`[1, 1, 1, capacity]`). Decode
    /// attends over fixed-size buffers so the compiled step (cpp/decode.cpp)
    /// keeps static shapes; the eager step does the same so both agree
    /// byte for byte.
    pub fn update_decode(&mut self, k: &Array, v: &Array) -> Result<(Array, Array, Array)> {
        self.append(k, v)?;
        let cap = self.capacity() as i32;
        let mask = decode_mask(cap, self.offset as i32 - 1)?;
        Ok((self.keys.clone().unwrap(), self.values.clone().unwrap(), mask))
    }

    /// For the compiled step: make room for one more token and hand out the
    /// buffers. `like` (one token's K/V shape and dtype) is only built when
    /// the buffers must grow, so a plain step allocates nothing here.
    pub fn buffers_for_step(&mut self, like: impl FnOnce() -> Result<Array>) -> Result<(Array, Array)> {
        if self.quant.is_some() {
            return Err(crate::error::Error::invalid("the compiled decode step cannot run over a quantized KV cache"));
        }
        if self.keys.is_none() || self.offset + 1 > self.capacity() {
            let l = like()?;
            self.reserve(1, &l, &l)?;
        }
        Ok((self.keys.clone().unwrap(), self.values.clone().unwrap()))
    }

    /// Takes back the buffers the compiled step wrote one token into.
    pub fn commit_step(&mut self, keys: Array, values: Array) {
        self.keys = Some(keys);
        self.values = Some(values);
        self.offset += 1;
    }

    /// The flat cache's used K and V (`[B, kv_heads, offset, head_dim]`);
    /// None when empty or quantized.
    pub fn contents(&self) -> Result<Option<(Array, Array)>> {
        match (&self.keys, &self.values, &self.quant) {
            (Some(k), Some(v), None) if self.offset > 0 => {
                let end = self.offset as i32;
                Ok(Some((k.slice_axis(2, 0, end)?, v.slice_axis(2, 0, end)?)))
            }
            _ => Ok(None),
        }
    }

    /// Bytes held (the allocated capacity, not just the used part).
    pub fn nbytes(&self) -> usize {
        self.keys.as_ref().map(|a| a.nbytes()).unwrap_or(0)
            + self.values.as_ref().map(|a| a.nbytes()).unwrap_or(0)
            + self.quant.as_ref().map(|q| q.nbytes()).unwrap_or(0)
    }

    /// Bytes of the used positions only (allocated capacity aside).
    pub fn used_bytes(&self) -> usize {
        if let Some(q) = &self.quant {
            return q.used_bytes();
        }
        let cap = self.capacity();
        if cap == 0 {
            return 0;
        }
        self.nbytes() / cap * self.offset
    }

    pub fn arrays(&self) -> Vec<&Array> {
        let mut v: Vec<&Array> = self.keys.iter().chain(self.values.iter()).collect();
        if let Some(q) = &self.quant {
            v.extend(q.arrays());
        }
        v
    }
}

/// The conv layers' current states, in layer order.
fn conv_states(layers: &[LayerCache]) -> Vec<&Array> {
    layers
        .iter()
        .filter_map(|l| match l {
            LayerCache::Conv(Some(s)) => Some(s),
            _ => None,
        })
        .collect()
}

/// `[1, 1, 1, cap]`: true at positions `0..=pos`.
pub fn decode_mask(cap: i32, pos: i32) -> Result<Array> {
    arange(0.0, cap as f64, 1.0, Dtype::Int32)?.lt(&Array::scalar(pos as f64 + 1.0, Dtype::Int32)?)?.reshape(&[1, 1, 1, cap])
}

#[derive(Clone)]
pub enum LayerCache {
    Attention(KvCache),
    /// An attention layer whose K/V live in the paged pool
    /// ([`ModelCache::paged`]); the index is the layer's attention ordinal.
    Paged(usize),
    /// The last `L-1` rows of `B*x` (`[B, L-1, D]`); None before the first token.
    Conv(Option<Array>),
}

/// All caches of one sequence.
pub struct ModelCache {
    pub layers: Vec<LayerCache>,
    /// Tokens run through the model so far (the next token's position).
    pub pos: usize,
    /// The sequence's block table when its attention layers are paged.
    pub paged: Option<PagedSeq>,
    /// Arrays built during the last forward pass that nothing downstream
    /// depends on (conv snapshots): evaluated with the step's own outputs.
    fresh: Vec<Array>,
}

impl ModelCache {
    pub fn new(attn_layers: &[bool]) -> ModelCache {
        ModelCache {
            layers: attn_layers
                .iter()
                .map(|&a| if a { LayerCache::Attention(KvCache::default()) } else { LayerCache::Conv(None) })
                .collect(),
            pos: 0,
            paged: None,
            fresh: vec![],
        }
    }

    /// A cache whose attention layers live in `pool`.
    pub fn new_paged(attn_layers: &[bool], pool: SharedPool) -> ModelCache {
        let mut ordinal = 0;
        let layers = attn_layers
            .iter()
            .map(|&a| {
                if a {
                    ordinal += 1;
                    LayerCache::Paged(ordinal - 1)
                } else {
                    LayerCache::Conv(None)
                }
            })
            .collect();
        ModelCache { layers, pos: 0, paged: Some(PagedSeq::new(pool)), fresh: vec![] }
    }

    /// A copy of a flat cache (paged sequences share blocks by prefix
    /// instead; copying one is refused).
    pub fn try_clone(&self) -> Result<ModelCache> {
        if self.paged.is_some() {
            return Err(crate::error::Error::invalid("a paged cache cannot be copied; share its prefix instead"));
        }
        Ok(ModelCache { layers: self.layers.clone(), pos: self.pos, paged: None, fresh: vec![] })
    }

    /// On an empty paged cache: takes the longest cached prefix of
    /// `prompt` (K/V blocks and the conv states after them). Returns the
    /// number of tokens that need not run.
    pub fn attach_prefix(&mut self, prompt: &[u32]) -> Result<usize> {
        let Some(seq) = self.paged.as_mut() else { return Ok(0) };
        if self.pos != 0 {
            return Ok(0);
        }
        let (n, snap) = seq.attach(prompt)?;
        if n == 0 {
            return Ok(0);
        }
        self.restore_conv_states(&snap.expect("a prefix hit carries a conv snapshot"))?;
        self.pos = n;
        Ok(n)
    }

    /// Sets every conv layer's state from a snapshot
    /// (`[conv_layers, 1, L-1, D]`, as `paged::snapshot_of` stacks them).
    pub fn restore_conv_states(&mut self, snap: &Array) -> Result<()> {
        let mut c = 0;
        for lc in self.layers.iter_mut() {
            if let LayerCache::Conv(s) = lc {
                let st = snap.slice_axis(0, c, c + 1)?;
                let (keep, d) = (st.dim(2), st.dim(3));
                *s = Some(st.reshape(&[1, keep, d])?);
                c += 1;
            }
        }
        Ok(())
    }

    /// Before a one-token decode step: a paged sequence gets room for the
    /// token and its decode mirrors (see PagedSeq::views).
    pub fn begin_decode_token(&mut self) -> Result<()> {
        self.reserve_token()?;
        let pos = self.pos;
        match self.paged.as_mut() {
            Some(seq) => seq.ensure_views(pos + 1),
            None => Ok(()),
        }
    }

    /// Makes room for one more token: a paged sequence gets the block it
    /// needs (the pool refuses when every block is held by a running
    /// request). Enough before a step of a stacked decode batch
    /// (model::batch), whose rows are the sequences' K/V.
    pub fn reserve_token(&mut self) -> Result<()> {
        let pos = self.pos;
        if let Some(seq) = self.paged.as_mut() {
            if seq.len != pos {
                return Err(crate::error::Error::invalid("paged cache length does not match the cache position"));
            }
            seq.reserve(1)?;
        }
        Ok(())
    }

    /// After a one-token decode step whose new conv states are in place:
    /// advances the position; a paged sequence copies a block that just
    /// filled into the pool and keeps the conv snapshot after it.
    pub fn end_decode_token(&mut self) -> Result<()> {
        self.pos += 1;
        let pos = self.pos;
        let Some(seq) = self.paged.as_mut() else { return Ok(()) };
        seq.len += 1;
        seq.after_decode_step()?;
        if pos % seq.block_size() != 0 {
            return Ok(());
        }
        let snap = super::paged::snapshot_of(&conv_states(&self.layers))?;
        seq.keep_snapshot(pos, snap.clone());
        self.fresh.push(snap);
        Ok(())
    }

    /// At the end of a request: lets a paged cache keep the sequence's exact
    /// end (its partial block and conv states) for a prompt that continues
    /// it. A no-op for flat caches.
    pub fn keep_tail(&mut self) -> Result<()> {
        let states = conv_states(&self.layers);
        match self.paged.as_mut() {
            Some(seq) => seq.keep_tail(&states),
            None => Ok(()),
        }
    }

    /// Tokens the last [`ModelCache::attach_prefix`] took from the cache.
    pub fn cached_tokens(&self) -> usize {
        self.paged.as_ref().map(|s| s.cached_tokens).unwrap_or(0)
    }

    /// Tells a paged cache the ids of tokens just run (prefill chunks, and
    /// decoded tokens once read back) so full blocks can be published.
    pub fn note_tokens(&mut self, ids: &[u32]) {
        if let Some(seq) = self.paged.as_mut() {
            seq.note_tokens(ids);
            seq.publish_ready();
        }
    }

    pub fn push_fresh(&mut self, a: Array) {
        self.fresh.push(a);
    }

    pub fn take_fresh(&mut self) -> Vec<Array> {
        std::mem::take(&mut self.fresh)
    }

    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Attention(kv) => kv.nbytes(),
                LayerCache::Paged(_) => 0,
                LayerCache::Conv(s) => s.as_ref().map(|a| a.nbytes()).unwrap_or(0),
            })
            .sum()
    }

    /// KV bytes of the used positions over all attention layers (allocated
    /// capacity aside; conv state excluded).
    pub fn kv_used_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Attention(kv) => kv.used_bytes(),
                LayerCache::Paged(_) | LayerCache::Conv(_) => 0,
            })
            .sum()
    }

    /// Every array the sequence holds (to evaluate them together); a paged
    /// cache's pools are listed by [`ModelCache::eval_state`].
    pub fn arrays(&self) -> Vec<&Array> {
        self.layers
            .iter()
            .flat_map(|l| match l {
                LayerCache::Attention(kv) => kv.arrays(),
                LayerCache::Paged(_) => vec![],
                LayerCache::Conv(s) => s.iter().collect(),
            })
            .chain(self.fresh.iter())
            .collect()
    }

    /// Evaluates everything the cache holds, the shared pool included
    /// (between prefill chunks, so memory stays bounded by one chunk).
    pub fn eval_state(&mut self) -> Result<()> {
        let pool = self.paged.as_ref().map(|s| s.pool.clone());
        let guard = pool.as_ref().map(|p| p.lock());
        let mut all = self.arrays();
        if let Some(g) = &guard {
            all.extend(g.layer_arrays());
        }
        eval(&all)?;
        drop(guard);
        self.fresh.clear();
        Ok(())
    }
}
