//! One sequence's caches ([`ModelCache`]: per attention layer a flat,
//! quantized or paged KV cache, per conv layer its state, and the one
//! position counter), and [`SeqPass`], the [`ForwardCache`] a forward pass
//! over that sequence writes through.

use super::flat::{decode_mask, KvCache};
use super::paged::{self, PagedSeq, SharedPool};
use super::{ConvShape, ForwardCache, Offset};
use crate::error::{Error, Result};
use crate::mlx::{eval, Array};

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
    /// Positions restored from a saved session (a flat cache's counterpart
    /// of the prefix cache's hit), reported as cached tokens.
    pub restored: usize,
}

/// A decode step that filled a block copied it from the mirror into the
/// pool; the pool's arrays are evaluated with the token, right after it
/// (src/generate `queue_tokens`: a later graph than the step's). Left lazy,
/// each pool array would chain every flush of the request, each holding the
/// decode mirror of its step alive (memory quadratic in the reply's length,
/// kept until the next prefill happened to evaluate the pool).
fn queue_flushed_block(fresh: &mut Vec<Array>, seq: &PagedSeq) {
    fresh.extend(seq.pool.lock().layer_arrays().into_iter().cloned());
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
            restored: 0,
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
        ModelCache { layers, pos: 0, paged: Some(PagedSeq::new(pool)), fresh: vec![], restored: 0 }
    }

    /// A copy of a flat cache (paged sequences share blocks by prefix
    /// instead; copying one is refused).
    pub fn try_clone(&self) -> Result<ModelCache> {
        if self.paged.is_some() {
            return Err(crate::error::Error::invalid("a paged cache cannot be copied; share its prefix instead"));
        }
        let layers = self
            .layers
            .iter()
            .map(|l| match l {
                LayerCache::Attention(kv) => kv.deep_clone().map(LayerCache::Attention),
                other => Ok(other.clone()),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ModelCache { layers, pos: self.pos, paged: None, fresh: vec![], restored: self.restored })
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
            Some(seq) => seq.ensure_views(pos, pos + 1),
            None => Ok(()),
        }
    }

    /// Makes room for one more token: a paged sequence gets the block it
    /// needs (the pool refuses when every block is held by a running
    /// request). Enough before a step of a stacked decode batch
    /// (src/cache/batch.rs), whose rows are the sequences' K/V.
    pub fn reserve_token(&mut self) -> Result<()> {
        let pos = self.pos;
        if let Some(seq) = self.paged.as_mut() {
            seq.reserve(pos, 1)?;
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
        seq.wrote(pos, false)?;
        if !pos.is_multiple_of(seq.block_size()) {
            return Ok(());
        }
        let snap = super::paged::snapshot_of(&conv_states(&self.layers))?;
        seq.keep_snapshot(pos, snap.clone());
        self.fresh.push(snap);
        queue_flushed_block(&mut self.fresh, seq);
        Ok(())
    }

    /// At the end of a request: lets a paged cache keep the sequence's exact
    /// end (its partial block and conv states) for a prompt that continues
    /// it. A no-op for flat caches.
    pub fn keep_tail(&mut self) -> Result<()> {
        let states = conv_states(&self.layers);
        match self.paged.as_mut() {
            Some(seq) => seq.keep_tail(self.pos, &states),
            None => Ok(()),
        }
    }

    /// Tokens the last [`ModelCache::attach_prefix`] took from the cache.
    pub fn cached_tokens(&self) -> usize {
        self.paged.as_ref().map(|s| s.cached_tokens).unwrap_or(self.restored)
    }

    /// Tells a paged cache the ids of tokens just run (prefill chunks, and
    /// decoded tokens once read back) so full blocks can be published.
    pub fn note_tokens(&mut self, ids: &[u32]) {
        if let Some(seq) = self.paged.as_mut() {
            seq.note_tokens(ids);
            seq.publish_ready(self.pos);
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
                LayerCache::Attention(kv) => kv.used_bytes(self.pos),
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

impl ModelCache {
    /// Writes `k`/`v` (`[1, kv_heads, T, head_dim]`) for positions
    /// `start..start+T` of attention layer `layer` (a batched prefill or a
    /// decode batch handing the sequence its rows), without attending.
    /// Flat caches append (`start` is their length).
    pub fn store_kv(&mut self, layer: usize, start: usize, k: &Array, v: &Array) -> Result<()> {
        match &mut self.layers[layer] {
            LayerCache::Attention(kv) => kv.append(start, k, v),
            LayerCache::Paged(ord) => {
                let seq = self.paged.as_ref().ok_or_else(|| Error::invalid("paged layer without a paged sequence"))?;
                paged::write_prefill(&mut seq.pool.lock(), seq, *ord, start, k, v)
            }
            LayerCache::Conv(_) => Err(Error::invalid("cache layout does not match the model's layers")),
        }
    }

    /// Starts a forward pass of `t` tokens from the current position. A
    /// paged sequence gets its blocks for them first (an exhausted pool
    /// fails before anything is written), and the attention table (prefill)
    /// or decode mirrors and mask (one token) once for all layers.
    pub fn pass(&mut self, t: usize) -> Result<SeqPass<'_>> {
        let start = self.pos;
        let (mut table, mut mask, mut taps) = (None, None, vec![]);
        if let Some(seq) = self.paged.as_mut() {
            seq.reserve(start, t)?;
            let bs = seq.block_size();
            // Conv states are snapshot after every block this pass fills.
            taps = ((start / bs + 1) * bs..=start + t).step_by(bs).map(|p| (p - start) as i32).collect();
            if t == 1 {
                seq.ensure_views(start, start + 1)?;
                mask = Some(decode_mask(seq.view_cap() as i32, start as i32)?);
            } else {
                seq.drop_views(start)?;
                table = Some(seq.table(start + t, false)?);
            }
        }
        Ok(SeqPass { cache: self, start, t, table, mask, taps, tapped: vec![] })
    }
}

/// A forward pass over one sequence: layers attend over and extend its
/// caches. [`SeqPass::finish`] advances the position and does the paged
/// bookkeeping once the layers have run.
pub struct SeqPass<'a> {
    cache: &'a mut ModelCache,
    start: usize,
    t: usize,
    /// Paged prefill: the pool blocks of positions `0..start + t`.
    table: Option<Array>,
    /// Paged decode: the mask over the decode mirrors.
    mask: Option<Array>,
    /// Positions (1..=t) of this call after which conv states are kept.
    taps: Vec<i32>,
    /// Per conv layer, its states at every tap (`[1, taps * keep, D]`).
    tapped: Vec<Array>,
}

impl SeqPass<'_> {
    fn attend_paged(&mut self, ord: usize, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        let seq = self.cache.paged.as_mut().ok_or_else(|| Error::invalid("paged attention layer without a paged sequence"))?;
        let start = self.start;
        match (&self.table, &self.mask) {
            (Some(tb), _) => {
                paged::write_prefill(&mut seq.pool.lock(), seq, ord, start, k, v)?;
                if start == 0 {
                    // From position 0 this call's K/V are the whole sequence:
                    // attend over them directly (the values the blocks now hold).
                    return super::bucket::causal(q, k, v, scale);
                }
                let end = (start + self.t) as i32;
                let pool = seq.pool.lock();
                let kg = paged::gather(pool.keys(ord), tb)?.slice_axis(2, 0, end)?;
                let vg = paged::gather(pool.values(ord), tb)?.slice_axis(2, 0, end)?;
                drop(pool);
                // (A later chunk, or a prompt after a reused prefix: the
                // bucket pads the keys and the query alike.)
                super::bucket::causal(q, &kg, &vg, scale)
            }
            // One token: written into the decode mirror, attended with the
            // mask (the shapes and ops of the flat decode and the compiled
            // step); full blocks reach the pool in `finish`.
            (None, Some(mask)) => {
                let (vk, vv) = seq.view(ord).ok_or_else(|| Error::invalid("paged decode without its mirrors"))?;
                let (s, h, hd) = (start as i32, k.dim(1), k.dim(3));
                let vk = vk.slice_update(k, &[0, 0, s, 0], &[1, h, s + 1, hd])?;
                let vv = vv.slice_update(v, &[0, 0, s, 0], &[1, h, s + 1, hd])?;
                let o = crate::kernels::decode_attention::sdpa_masked(q, &vk, &vv, scale, mask)?;
                seq.set_view(ord, (vk, vv));
                Ok(o)
            }
            (None, None) => Err(Error::invalid("paged attention needs a table or a decode mask")),
        }
    }

    /// Advances the position; a paged sequence counts the new positions,
    /// copies a block a decode step filled into the pool and keeps the conv
    /// snapshots after every block this pass filled.
    pub fn finish(self) -> Result<()> {
        let SeqPass { cache, start, t, taps, tapped, .. } = self;
        cache.pos += t;
        let Some(seq) = cache.paged.as_mut() else { return Ok(()) };
        seq.wrote(cache.pos, t > 1)?;
        if t == 1 && cache.pos % seq.block_size() == 0 {
            queue_flushed_block(&mut cache.fresh, seq);
        }
        if taps.is_empty() {
            return Ok(());
        }
        let keep = seq.conv_keep();
        // [conv_layers, 1, taps * keep, D]: every layer's tapped states.
        let layers: Vec<&Array> = tapped.iter().collect();
        let all = if layers.is_empty() { None } else { Some(paged::snapshot_of(&layers)?) };
        let mut snaps = vec![];
        for (i, &j) in taps.iter().enumerate() {
            let snap = match &all {
                Some(a) => a.slice_axis(2, i as i32 * keep, (i as i32 + 1) * keep)?,
                None => paged::snapshot_of(&[])?,
            };
            seq.keep_snapshot(start + j as usize, snap.clone());
            snaps.push(snap);
        }
        cache.fresh.extend(snaps);
        Ok(())
    }

    /// Writes attention layer `layer`'s K/V for this call (`[1, kv_heads,
    /// t, head_dim]`) without attending: a compiled fresh prefill
    /// ([`super::fresh`]) attended already.
    pub fn store(&mut self, layer: usize, k: &Array, v: &Array) -> Result<()> {
        if k.dim(2) as usize != self.t || v.dim(2) as usize != self.t {
            return Err(Error::invalid(format!("layer {layer}: K/V of {} positions for a pass of {}", k.dim(2), self.t)));
        }
        match &mut self.cache.layers[layer] {
            LayerCache::Attention(kv) if kv.quant.is_none() => kv.append(self.start, k, v),
            LayerCache::Attention(_) => Err(Error::invalid("a quantized KV cache takes its prefill through attention")),
            LayerCache::Paged(ord) => {
                let ord = *ord;
                let seq = self.cache.paged.as_mut().ok_or_else(|| Error::invalid("paged attention layer without a paged sequence"))?;
                paged::write_prefill(&mut seq.pool.lock(), seq, ord, self.start, k, v)
            }
            LayerCache::Conv(_) => Err(Error::invalid("cache layout does not match the model's layers")),
        }
    }
}

impl ForwardCache for SeqPass<'_> {
    fn offset(&self) -> Offset<'_> {
        Offset::Int(self.start as i32)
    }

    fn attend(&mut self, layer: usize, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        match &mut self.cache.layers[layer] {
            LayerCache::Attention(kv) => kv.attend(self.start, q, k, v, scale),
            LayerCache::Paged(ord) => {
                let ord = *ord;
                self.attend_paged(ord, q, k, v, scale)
            }
            LayerCache::Conv(_) => Err(Error::invalid("cache layout does not match the model's layers")),
        }
    }

    fn conv_state(&mut self, layer: usize, shape: ConvShape) -> Result<Array> {
        match &mut self.cache.layers[layer] {
            // Cloned, not taken: a pass that fails halfway leaves the state
            // as it was (conv_update replaces it before anything runs).
            LayerCache::Conv(s) => match s.clone() {
                Some(s) => Ok(s),
                None => shape.zeros(),
            },
            _ => Err(Error::invalid("cache layout does not match the model's layers")),
        }
    }

    fn conv_update(&mut self, layer: usize, padded: &Array, keep: i32) -> Result<()> {
        if !self.taps.is_empty() {
            self.tapped.push(super::tap_states(padded, &self.taps, keep)?);
        }
        let n = padded.dim(1);
        match &mut self.cache.layers[layer] {
            LayerCache::Conv(s) => {
                *s = Some(padded.slice_axis(1, n - keep, n)?);
                Ok(())
            }
            _ => Err(Error::invalid("cache layout does not match the model's layers")),
        }
    }

    fn conv_step_update(&mut self, layer: usize, prev: &Array, next: &Array) -> Result<()> {
        if !self.taps.is_empty() {
            // A block ends here: the snapshot reads the padded input.
            let padded = super::padded_from_step(prev, next)?;
            return self.conv_update(layer, &padded, next.dim(1));
        }
        match &mut self.cache.layers[layer] {
            LayerCache::Conv(s) => {
                *s = Some(next.clone());
                Ok(())
            }
            _ => Err(Error::invalid("cache layout does not match the model's layers")),
        }
    }
}
