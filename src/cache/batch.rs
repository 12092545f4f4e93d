//! Decode batches: the caches of the sequences decoding together, stacked
//! row by row, so that one compiled step (src/compiled) advances them all
//! with as many ops as a single sequence takes (each row's K/V written at its
//! own position by one scatter per buffer, one attention call over all rows).
//! [`StackedPass`] is that step's cache: K/V buffers and conv states passed
//! in as arrays and returned new, which keeps the compiled graph pure.
//!
//! While a sequence is in a batch its K/V and conv states live here, and
//! only here: a flat cache gives up its buffers when it joins, a paged one
//! its decode mirrors (the pool keeps what was flushed), so batching does
//! not hold the running K/V twice. The sequence's own [`ModelCache`] keeps
//! its position and paged bookkeeping. [`DecodeBatch::sync`] writes a row
//! back from position `synced` on: when the sequence leaves (finishes,
//! pauses, or the batch dissolves) and, for a paged cache, whenever it fills
//! a block (the block goes straight to the pool and the conv snapshot after
//! it is kept, exactly as after a single-sequence step). Members change only
//! between steps; joining appends rows, leaving removes them, so a steady
//! batch rebuilds nothing.

use super::flat::{KvCache, KV_STEP};
use super::sequence::{LayerCache, ModelCache};
use super::{ConvShape, ForwardCache, Offset};
use crate::error::{Error, Result};
use crate::mlx::{arange, concatenate, zeros, Array, Dtype};

/// One running sequence as the batch sees it: its id, whether it takes the
/// next step, and its cache.
pub struct Member<'a> {
    pub id: u64,
    pub wanted: bool,
    pub cache: &'a mut ModelCache,
}

struct Row {
    id: u64,
    /// Positions of this row the sequence's own cache holds (a flat cache:
    /// its buffers; a paged one: the pool).
    synced: usize,
}

/// The shape facts a batch needs to make empty rows.
#[derive(Clone, Copy)]
pub struct BatchShape {
    pub kv_heads: i32,
    pub head_dim: i32,
    pub conv_keep: i32,
    pub hidden: i32,
    pub dtype: Dtype,
}

#[derive(Default)]
pub struct DecodeBatch {
    rows: Vec<Row>,
    /// Positions every row's K/V buffers hold (a multiple of `KV_STEP`).
    cap: usize,
    /// In the compiled step's input order: K then V of each attention layer
    /// (`[B, kv_heads, cap, head_dim]`), the state of each conv layer
    /// (`[B, L-1, hidden]`).
    state: Vec<Array>,
    /// The last step's greedy tokens (`[B]`) with the rows they were
    /// for: when the rows are the same, the next step's ids are them, with
    /// no host round trip (no per-row copies, no upload).
    carry: Option<(Vec<u64>, Array)>,
    /// The positions the last step took: each row's as the host counted it,
    /// and the device array the step's were a view of (see
    /// [`DecodeBatch::positions_for`]).
    positions_used: Option<(Vec<i32>, Array)>,
    /// Ones as long as the kept positions array, made on the GPU once:
    /// stepping the positions on adds them (a scalar `1` made by the host
    /// each step would be read from the managed pool, as the positions were).
    ones: Option<Array>,
    /// Position arrays made from host data (tests check when it happens).
    #[cfg(test)]
    uploads: usize,
}

/// The fewest positions a batch's position array holds (16 bytes: out of
/// MLX's managed scalar pool, see [`DecodeBatch::positions_for`]).
const POSITIONS_MIN: usize = 4;

/// The first `b` of `src`'s positions (a view where it is longer).
fn positions_view(src: &Array, b: usize) -> Result<Array> {
    if src.size() == b {
        Ok(src.clone())
    } else {
        src.slice_axis(0, 0, b as i32)
    }
}

/// Whether a cache can decode inside a stacked batch (a quantized KV cache
/// cannot: its codes are not plain K/V buffers).
pub fn stackable(cache: &ModelCache) -> bool {
    cache.layers.iter().all(|l| !matches!(l, LayerCache::Attention(kv) if kv.quant.is_some()))
}

impl DecodeBatch {
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Member ids in row order.
    pub fn ids(&self) -> Vec<u64> {
        self.rows.iter().map(|r| r.id).collect()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.rows.iter().any(|r| r.id == id)
    }

    /// Brings the batch to exactly the wanted members (at least two; fewer
    /// dissolves it, every row written back). Rows of members that are not
    /// wanted are written back and removed; rows of ids not among `members`
    /// at all are removed (their sequences are gone). New members are
    /// appended, and every row gets room for one more position. Every
    /// wanted cache must have had `reserve_token`.
    pub fn reconcile(&mut self, shape: &BatchShape, members: &mut [Member]) -> Result<()> {
        let wanted = members.iter().filter(|m| m.wanted).count();
        let mut keep = Vec::with_capacity(self.rows.len());
        for (i, row) in self.rows.iter().enumerate() {
            match members.iter_mut().find(|m| m.id == row.id) {
                Some(m) if m.wanted && wanted >= 2 => keep.push(i as i32),
                Some(m) => Self::write_back(&self.state, i, row.synced, m.cache, m.cache.pos)?,
                None => {}
            }
        }
        if wanted < 2 {
            *self = DecodeBatch::default();
            return Ok(());
        }
        if keep.len() < self.rows.len() {
            let idx = Array::from_slice(&keep, &[keep.len() as i32])?;
            self.state = self.state.iter().map(|a| a.take(&idx, 0)).collect::<Result<_>>()?;
            let mut rows = std::mem::take(&mut self.rows);
            self.rows = keep.iter().map(|&i| std::mem::replace(&mut rows[i as usize], Row { id: 0, synced: 0 })).collect();
            if self.rows.is_empty() {
                self.state.clear();
            }
        }
        let need = members.iter().filter(|m| m.wanted).map(|m| m.cache.pos + 1).max().unwrap_or(1);
        let cap = need.div_ceil(KV_STEP) * KV_STEP;
        if cap > self.cap {
            self.grow(cap)?;
        } else if cap < self.cap {
            // The longest rows left: attend over no more than the rest need.
            for a in self.state.iter_mut().filter(|a| a.ndim() == 4) {
                *a = a.slice_axis(2, 0, cap as i32)?;
            }
            self.cap = cap;
        }
        let mut joins: Vec<Vec<Array>> = vec![];
        let present = self.ids();
        for m in members.iter_mut().filter(|m| m.wanted && !present.contains(&m.id)) {
            let (row, synced) = Self::take_row(shape, m.cache, self.cap)?;
            joins.push(row);
            self.rows.push(Row { id: m.id, synced });
        }
        if !joins.is_empty() {
            let n = joins[0].len();
            let mut state = Vec::with_capacity(n);
            for j in 0..n {
                let mut parts: Vec<&Array> = self.state.get(j).into_iter().collect();
                parts.extend(joins.iter().map(|r| &r[j]));
                state.push(concatenate(&parts, 0)?);
            }
            self.state = state;
        }
        Ok(())
    }

    /// Widens every row's K/V to `cap` positions.
    fn grow(&mut self, cap: usize) -> Result<()> {
        let add = (cap - self.cap) as i32;
        if !self.rows.is_empty() {
            for a in self.state.iter_mut() {
                if a.ndim() == 4 {
                    let z = zeros(&[a.dim(0), a.dim(1), add, a.dim(3)], a.dtype())?;
                    *a = concatenate(&[a, &z], 2)?;
                }
            }
        }
        self.cap = cap;
        Ok(())
    }

    /// One sequence's cache as batch rows (`[1, ...]` per state slot), its
    /// K/V padded with zeros to `cap` positions. The cache gives up its own
    /// K/V copy (flat buffers, paged mirrors, after flushing them to the
    /// pool); returns the rows and how many positions the cache still holds.
    fn take_row(shape: &BatchShape, cache: &mut ModelCache, cap: usize) -> Result<(Vec<Array>, usize)> {
        let pos = cache.pos;
        let pad = |k: Array| -> Result<Array> {
            let have = k.dim(2) as usize;
            if have == cap {
                return Ok(k);
            }
            let z = zeros(&[1, k.dim(1), (cap - have) as i32, k.dim(3)], k.dtype())?;
            concatenate(&[&k, &z], 2)
        };
        let empty = || zeros(&[1, shape.kv_heads, cap as i32, shape.head_dim], shape.dtype);
        if let Some(seq) = cache.paged.as_mut() {
            if pos > 0 {
                seq.ensure_views(pos, pos)?;
            }
        }
        let mut out = vec![];
        for lc in &cache.layers {
            match lc {
                LayerCache::Attention(kv) => {
                    if kv.quant.is_some() {
                        return Err(Error::invalid("a quantized KV cache cannot join a stacked decode batch"));
                    }
                    match kv.contents(pos)? {
                        Some((k, v)) => {
                            out.push(pad(k)?);
                            out.push(pad(v)?);
                        }
                        None => {
                            out.push(empty()?);
                            out.push(empty()?);
                        }
                    }
                }
                LayerCache::Paged(i) => {
                    let seq = cache.paged.as_ref().ok_or_else(|| Error::invalid("paged layer without a paged sequence"))?;
                    match seq.view(*i) {
                        Some((k, v)) if pos > 0 => {
                            out.push(pad(k.slice_axis(2, 0, pos as i32)?)?);
                            out.push(pad(v.slice_axis(2, 0, pos as i32)?)?);
                        }
                        _ => {
                            out.push(empty()?);
                            out.push(empty()?);
                        }
                    }
                }
                LayerCache::Conv(s) => out.push(match s {
                    Some(s) => s.clone(),
                    None => zeros(&[1, shape.conv_keep, shape.hidden], shape.dtype)?,
                }),
            }
        }
        let synced = match cache.paged.as_mut() {
            Some(seq) => {
                seq.drop_views(pos)?;
                seq.flushed()
            }
            None => {
                for lc in cache.layers.iter_mut() {
                    if let LayerCache::Attention(kv) = lc {
                        *kv = KvCache::default();
                    }
                }
                0
            }
        };
        Ok((out, synced))
    }

    /// Writes row `i`'s positions `synced..upto` back (flat: into the
    /// cache's buffers; paged: into its blocks in the pool) and its conv
    /// states.
    fn write_back(state: &[Array], i: usize, synced: usize, cache: &mut ModelCache, upto: usize) -> Result<()> {
        let r = i as i32;
        let cols = |a: &Array| a.slice(&[r, 0, synced as i32, 0], &[r + 1, a.dim(1), upto as i32, a.dim(3)], &[1, 1, 1, 1]);
        let mut slot = 0;
        for li in 0..cache.layers.len() {
            match &mut cache.layers[li] {
                LayerCache::Attention(_) | LayerCache::Paged(_) => {
                    if upto > synced {
                        cache.store_kv(li, synced, &cols(&state[slot])?, &cols(&state[slot + 1])?)?;
                    }
                    slot += 2;
                }
                LayerCache::Conv(s) => {
                    *s = Some(state[slot].slice_axis(0, r, r + 1)?);
                    slot += 1;
                }
            }
        }
        // Evaluated with the step, so the copies do not pile up as graphs.
        let mut fresh: Vec<Array> = vec![];
        for lc in &cache.layers {
            if let LayerCache::Attention(kv) = lc {
                if upto > synced {
                    fresh.extend(kv.arrays().into_iter().cloned());
                }
            }
        }
        if let Some(seq) = cache.paged.as_mut() {
            fresh.extend(seq.pool.lock().layer_arrays().into_iter().cloned());
            if upto > synced {
                seq.wrote(upto, true)?;
            }
        }
        for a in fresh {
            cache.push_fresh(a);
        }
        Ok(())
    }

    /// Writes back everything row `id` holds up to `upto` positions (its
    /// sequence leaves now, or a paged cache is about to flush a block).
    pub fn sync(&mut self, id: u64, cache: &mut ModelCache, upto: usize) -> Result<()> {
        let i = self.rows.iter().position(|r| r.id == id).ok_or_else(|| Error::invalid("sequence is not in the batch"))?;
        Self::write_back(&self.state, i, self.rows[i].synced, cache, upto)?;
        self.rows[i].synced = upto;
        Ok(())
    }

    /// After a stacked step: row `id`'s cache counts the token the step
    /// wrote; a paged row about to fill a block first takes the block (and
    /// the conv states after it) back into its own buffers, to publish it.
    pub fn end_token(&mut self, id: u64, cache: &mut ModelCache) -> Result<()> {
        if let Some(bs) = cache.paged.as_ref().map(|s| s.block_size()) {
            if (cache.pos + 1).is_multiple_of(bs) {
                let upto = cache.pos + 1;
                self.sync(id, cache, upto)?;
            }
        }
        cache.end_decode_token()
    }

    /// Keeps a step's greedy tokens for the next step.
    pub fn set_carry(&mut self, tokens: Array) {
        self.carry = Some((self.ids(), tokens));
    }

    /// The next step's ids (`[B, 1]`), when the last step drew every row
    /// greedily and the rows have not changed since.
    pub fn take_carry(&mut self) -> Result<Option<Array>> {
        match self.carry.take() {
            Some((rows, tokens)) if rows == self.ids() => Ok(Some(tokens.reshape(&[rows.len() as i32, 1])?)),
            _ => Ok(None),
        }
    }

    /// The rows' positions (`host`, in row order, as their caches count
    /// them) as a step's int32 `[B]` input. Where each is one past what the
    /// last step took (a batch stepping on, sampled or greedy), the GPU adds
    /// ones it made once to that step's array: nothing is made on the host
    /// each step. MLX 0.32.4's
    /// CUDA allocator keeps an array made from host data in managed memory
    /// whose pages move to the host when it writes them and back at the
    /// GPU's first read, and an array of at most 8 bytes (two rows'
    /// positions, also when the GPU adds one) in its managed scalar pool,
    /// read across the bus by each of the step's kernels that take the
    /// positions (src/compiled/positions.rs): so the array is padded to 16
    /// bytes and the step takes a view.
    pub fn positions_for(&mut self, host: &[i32]) -> Result<Array> {
        if let Some((prev, src)) = self.positions_used.take() {
            if prev.len() == host.len() && prev.iter().zip(host).all(|(p, h)| p.checked_add(1) == Some(*h)) {
                let n = src.size();
                let ones = match self.ones.take() {
                    Some(o) if o.size() == n => o,
                    _ => crate::mlx::full(&[n as i32], 1.0, Dtype::Int32)?,
                };
                let next = src.add(&ones)?;
                self.ones = Some(ones);
                let positions = positions_view(&next, host.len())?;
                self.positions_used = Some((host.to_vec(), next));
                return Ok(positions);
            }
        }
        let mut padded = host.to_vec();
        padded.resize(host.len().max(POSITIONS_MIN), 0);
        let src = Array::from_slice(&padded, &[padded.len() as i32])?;
        let positions = positions_view(&src, host.len())?;
        self.positions_used = Some((host.to_vec(), src));
        #[cfg(test)]
        {
            self.uploads += 1;
        }
        Ok(positions)
    }

    /// Hands the stacked state to a step (the batch holds no reference
    /// while it runs, so MLX can update the buffers in place).
    pub fn take_state(&mut self) -> Vec<Array> {
        std::mem::take(&mut self.state)
    }

    /// Takes back the state a step returned.
    pub fn put_state(&mut self, state: Vec<Array>) {
        self.state = state;
    }

    pub fn len(&self) -> usize {
        self.rows.len()
    }
}

/// How a lone sequence's decode step writes its token's K/V into the
/// buffers: a scatter at its position (the default on MLX's CUDA backend,
/// where it was measured), or a slice update at a dynamic start (the default
/// elsewhere; `MLX_LFM_KV_WRITE=scatter|slice` chooses). Both write the same values. On
/// MLX's CUDA backend the dynamic slice update is an offset kernel plus a
/// dynamic-offset copy that ncu timed at ~28 us per 1 KB token; the scatter
/// is one ~4.6 us kernel: a 1.2B step's GPU time 1,863 -> 1,550 us, 269 -> 257
/// kernels (bench/results/2026-12-02-h200-ncu-scatter.log against
/// 2026-12-02-h200-ncu-lfm2-1.2b-bf16.json, same build and checkpoint).
fn kv_write_scatter() -> bool {
    static SCATTER: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::knobs::cached("MLX_LFM_KV_WRITE", &SCATTER, |v| match v {
        Some("scatter") => true,
        Some("slice") => false,
        _ => crate::mlx::runtime::backend() == crate::mlx::runtime::Backend::Cuda,
    })
}

/// The cache of one decode step over stacked state: the step's inputs are
/// the token ids, the positions and, in layer order, the K and V buffers of
/// each attention layer (`[B, kv_heads, cap, head_dim]`) and the state of
/// each conv layer (`[B, L-1, hidden]`); its outputs are the logits and the
/// new state in the same order. One sequence passes an int32 scalar
/// position (its flat buffers or paged mirrors as the state); a batch
/// passes one position per row, and each row's token is written at its own
/// position by one scatter per buffer.
pub struct StackedPass {
    pos: Array,
    /// Per decoder layer, its first slot in `state`.
    slots: Vec<usize>,
    state: Vec<Array>,
    /// The attention mask over the buffers, built once per pass.
    mask: Option<Array>,
    /// The position as `[1]`, a slice update's start, made once per pass.
    start: Option<Array>,
    /// A batch's row indices `0..B`, made once per pass.
    rows: Option<Array>,
    /// Whether a kernel may write the token's K/V into the buffers in
    /// place ([`StackedPass::writing_in_place`]).
    in_place: bool,
}

impl StackedPass {
    pub fn new(attn_layers: &[bool], pos: Array, state: Vec<Array>) -> Result<StackedPass> {
        let mut slots = Vec::with_capacity(attn_layers.len());
        let mut n = 0;
        for &a in attn_layers {
            slots.push(n);
            n += if a { 2 } else { 1 };
        }
        if state.len() != n {
            return Err(Error::invalid(format!("a decode step takes {n} state arrays for this model, got {}", state.len())));
        }
        if pos.ndim() > 1 {
            return Err(Error::invalid("decode positions must be a scalar or one per row"));
        }
        Ok(StackedPass { pos, slots, state, mask: None, start: None, rows: None, in_place: false })
    }

    /// This pass hands its K/V buffers to a kernel that writes the token's
    /// K and V into them in place ([`ForwardCache::kv_buffers`]): a lone
    /// sequence (a scalar position) whose buffers nothing else holds or
    /// reads in the pass (the compiled step's caller's promise: a flat
    /// cache's buffers or a paged sequence's decode mirrors, each its own,
    /// src/compiled/mod.rs).
    pub fn writing_in_place(mut self) -> StackedPass {
        self.in_place = !self.per_row();
        self
    }

    /// The new state, in input order.
    pub fn into_state(self) -> Vec<Array> {
        self.state
    }

    fn per_row(&self) -> bool {
        self.pos.ndim() == 1
    }

    fn start(&mut self) -> Result<Array> {
        if self.start.is_none() {
            self.start = Some(self.pos.reshape(&[1])?);
        }
        Ok(self.start.clone().expect("set above"))
    }

    fn rows(&mut self, b: i32) -> Result<Array> {
        match &self.rows {
            Some(r) if r.dim(0) == b => Ok(r.clone()),
            _ => {
                // (Made at least 16 bytes wide and viewed, as the positions
                // are: out of MLX's managed scalar pool.)
                let n = (b as usize).max(POSITIONS_MIN);
                let r = positions_view(&arange(0.0, n as f64, 1.0, Dtype::Int32)?, b as usize)?;
                self.rows = Some(r.clone());
                Ok(r)
            }
        }
    }

    /// `[B or 1, 1, 1, cap]`: each row's positions up to its own.
    fn mask(&mut self, b: i32, cap: i32) -> Result<Array> {
        if let Some(m) = &self.mask {
            if m.dim(3) == cap {
                return Ok(m.clone());
            }
        }
        let cols = arange(0.0, cap as f64, 1.0, Dtype::Int32)?;
        let upto = self.pos.add_scalar(1.0)?;
        let m = if self.per_row() {
            cols.reshape(&[1, cap])?.lt(&upto.reshape(&[b, 1])?)?.reshape(&[b, 1, 1, cap])?
        } else {
            cols.lt(&upto)?.reshape(&[1, 1, 1, cap])?
        };
        self.mask = Some(m.clone());
        Ok(m)
    }

    /// [`ForwardCache::attend`] (`rows_out`: as [`ForwardCache::attend_rows`]).
    fn attend_as(&mut self, layer: usize, q: &Array, k: &Array, v: &Array, scale: f32, rows_out: bool) -> Result<Array> {
        let slot = self.slots[layer];
        let b = self.state[slot].dim(0);
        // (Made once a pass, not once a layer: a node each.)
        let start = if self.per_row() || kv_write_scatter() { None } else { Some(self.start()?) };
        let rows = if self.per_row() { Some(self.rows(b)?) } else { None };
        let (kbuf, vbuf) = (&self.state[slot], &self.state[slot + 1]);
        let (h, hd) = (kbuf.dim(1), kbuf.dim(3));
        let (kn, vn) = if let Some(rows) = rows {
            let upd = |x: &Array| x.reshape(&[b, 1, h, 1, hd]);
            (
                kbuf.scatter(&[&rows, &self.pos], &[0, 2], &upd(k)?)?,
                vbuf.scatter(&[&rows, &self.pos], &[0, 2], &upd(v)?)?,
            )
        } else if kv_write_scatter() {
            // At the scalar position itself: the update keeps K's and V's
            // own rank, so neither they nor the position are reshaped (three
            // view nodes an attention layer and token).
            (kbuf.scatter(&[&self.pos], &[2], k)?, vbuf.scatter(&[&self.pos], &[2], v)?)
        } else {
            let start = start.expect("made above for the slice update");
            (kbuf.slice_update_dyn(k, &start, &[2])?, vbuf.slice_update_dyn(v, &start, &[2])?)
        };
        let o = self.attention(q, &kn, &vn, scale, rows_out)?;
        self.state[slot] = kn;
        self.state[slot + 1] = vn;
        Ok(o)
    }

    /// `q` over the buffers `kn` / `vn` that hold this token's K/V
    /// (`rows_out`: as [`ForwardCache::attend_rows`]).
    fn attention(&mut self, q: &Array, kn: &Array, vn: &Array, scale: f32, rows_out: bool) -> Result<Array> {
        use crate::kernels::decode_attention;
        if decode_attention::upto_available(q, kn, vn, &self.pos) {
            // (As rows: the kernel writes `[B, heads * head_dim]` itself.)
            return decode_attention::sdpa_upto(q, kn, vn, scale, &self.pos, rows_out);
        }
        let (b, cap) = (kn.dim(0), kn.dim(2));
        let mask = self.mask(b, cap)?;
        let o = decode_attention::sdpa_masked(q, kn, vn, scale, &mask)?;
        if rows_out {
            o.reshape(&[b, o.dim(1) * o.dim(3)])
        } else {
            Ok(o)
        }
    }

    /// The attention over buffers a kernel wrote this token's K/V into,
    /// in the launch that made `q`. The buffers go back as the step's
    /// outputs the same (no copy), as arrays MLX evaluates after `q`: the
    /// write is no node of its graph. (That orders MLX's own evaluation,
    /// not the kernels of one CUDA graph, which MLX orders only by the
    /// buffers a kernel names as outputs: a reader of the written row must
    /// be in a later evaluation, as src/generate `queue_tokens` puts a
    /// paged block's copy into the pool, or take `q`, as the attention
    /// here does.)
    fn attend_written(&mut self, layer: usize, q: &Array, scale: f32) -> Result<Array> {
        let slot = self.slots[layer];
        let (kbuf, vbuf) = (self.state[slot].clone(), self.state[slot + 1].clone());
        let o = self.attention(q, &kbuf, &vbuf, scale, true)?;
        let mut after = crate::mlx::depends(&[&kbuf, &vbuf], &[q])?.into_iter();
        let missing = || Error::mlx("depends: missing output");
        self.state[slot] = after.next().ok_or_else(missing)?;
        self.state[slot + 1] = after.next().ok_or_else(missing)?;
        Ok(o)
    }
}

impl ForwardCache for StackedPass {
    fn offset(&self) -> Offset<'_> {
        Offset::Array(&self.pos)
    }

    fn attend(&mut self, layer: usize, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        self.attend_as(layer, q, k, v, scale, false)
    }

    fn attend_rows(&mut self, layer: usize, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        self.attend_as(layer, q, k, v, scale, true)
    }

    fn kv_buffers(&mut self, layer: usize) -> Option<(Array, Array)> {
        let slot = *self.slots.get(layer)?;
        (self.in_place && slot + 1 < self.state.len()).then(|| (self.state[slot].clone(), self.state[slot + 1].clone()))
    }

    fn attend_written_rows(&mut self, layer: usize, q: &Array, scale: f32) -> Result<Array> {
        if !self.in_place {
            return Err(Error::invalid("this decode pass does not hand its K/V buffers to a kernel"));
        }
        self.attend_written(layer, q, scale)
    }

    fn conv_state(&mut self, layer: usize, _shape: ConvShape) -> Result<Array> {
        Ok(self.state[self.slots[layer]].clone())
    }

    fn conv_update(&mut self, layer: usize, padded: &Array, keep: i32) -> Result<()> {
        let n = padded.dim(1);
        self.state[self.slots[layer]] = padded.slice_axis(1, n - keep, n)?;
        Ok(())
    }

    fn conv_step_update(&mut self, layer: usize, _prev: &Array, next: &Array) -> Result<()> {
        self.state[self.slots[layer]] = next.clone();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(a: &Array) -> Vec<i32> {
        a.to_vec::<i32>().unwrap()
    }

    /// The positions a step takes are the host's numbers whichever way they
    /// were made: stepped on from the last step's array while each is one
    /// past it, uploaded anew where any is not (a row joined or left, a
    /// step failed, the rows went through another path meanwhile).
    #[test]
    fn positions_step_on_on_the_gpu_and_are_uploaded_when_they_do_not() {
        let mut b = DecodeBatch::default();
        // Each call's host positions and whether they are uploaded.
        let steps: [(&[i32], bool); 9] = [
            (&[5, 9], true),
            (&[6, 10], false),
            (&[7, 11], false),
            // A row two ahead.
            (&[8, 13], true),
            // A third row joins; then one leaves.
            (&[9, 14, 3], true),
            (&[10, 15, 4], false),
            (&[16, 5], true),
            // Wide batches need no padding.
            (&[0, 1, 2, 3, 4, 5], true),
            (&[1, 2, 3, 4, 5, 6], false),
        ];
        for (host, upload) in steps {
            let before = b.uploads;
            let p = b.positions_for(host).unwrap();
            assert_eq!(p.shape(), vec![host.len() as i32]);
            assert_eq!(values(&p), host.to_vec());
            assert_eq!(b.uploads - before, upload as usize, "{host:?}: uploaded {}", b.uploads - before);
            let (kept, src) = b.positions_used.clone().unwrap();
            assert_eq!(kept, host.to_vec());
            assert_eq!(src.size(), host.len().max(POSITIONS_MIN), "{host:?}: the array kept");
        }
    }
}
