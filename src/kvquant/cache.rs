//! The quantized KV cache of one attention layer, with deferred prefill.
//!
//! Two regions, `offset = quantized + pending`:
//! - a quantized prefix (the codec's parts, `[B, H, capacity, *]` each);
//! - a full-precision pending tail (`[B, H, capacity, head_dim]`).
//!
//! Multi-token calls (prefill chunks) append to the pending tail and attend
//! over it exactly: a prompt is never quantized while it is being read. The
//! first single-token call (a decode step) quantizes everything pending in
//! one batch, then quantizes its own token on insert; from then on every
//! token is quantized as it arrives. A single-token call on an empty cache
//! (a warm-up, or a one-token prompt) stays pending, so it cannot switch
//! deferral off for a prompt that follows. The phase is per cache object:
//! nothing global.
//!
//! Both regions grow geometrically (x1.5, in whole `KV_STEP`s) and are written
//! with `slice_update`, so appending is amortised O(n): no concatenate per
//! chunk. `stats` counts the reallocations and the tokens they copied.

use super::codec::Codec;
use crate::error::{Error, Result};
use crate::mlx::{concatenate, sdpa, zeros, Array, Dtype, Mask};
use crate::cache::KV_STEP;

/// Counters for the amortisation and deferral tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Region (re)allocations (all of K's and V's buffers of the pending or
    /// the quantized region count as one).
    pub allocations: usize,
    /// Tokens copied from an old region into a grown one.
    pub copied_tokens: usize,
    /// Times the pending tail was quantized in one batch.
    pub bulk_quantizations: usize,
    /// Tokens that went through the quantizer.
    pub quantized_tokens: usize,
}

/// Which regions hold tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Empty,
    /// Only full-precision tokens (a prefill not yet followed by decode).
    Pending,
    /// Only quantized tokens.
    Live,
    /// A quantized prefix and a pending tail (a new prompt after decoding).
    Mixed,
}

/// A snapshot of the cache's contents, trimmed to the used length.
#[derive(Clone)]
pub struct QuantKvState {
    /// Codec parts of K then V (`[B, H, quantized, *]`), empty when none.
    pub keys: Vec<Array>,
    pub values: Vec<Array>,
    pub quantized: usize,
    /// Full-precision K and V (`[B, H, pending, head_dim]`).
    pub pending: Option<(Array, Array)>,
    pub pending_len: usize,
}

/// What attention reads: K and V for the whole cache, and whether they live
/// in the codec's rotated space.
pub struct Fetched {
    pub keys: Array,
    pub values: Array,
    pub rotated: bool,
}

#[derive(Clone)]
pub struct QuantKvCache {
    codec: Codec,
    kq: Vec<Array>,
    vq: Vec<Array>,
    q_len: usize,
    q_cap: usize,
    kp: Option<Array>,
    vp: Option<Array>,
    p_len: usize,
    p_cap: usize,
    pub stats: CacheStats,
}

/// Capacity for `needed` tokens growing from `cap`: x1.5 at least, in
/// whole `KV_STEP`s.
fn grown(cap: usize, needed: usize) -> usize {
    needed.max(cap + cap / 2).div_ceil(KV_STEP) * KV_STEP
}

fn dims(a: &Array) -> (i32, i32, i32) {
    (a.dim(0), a.dim(1), a.dim(-1))
}

/// Writes `x` into `buf` at tokens `at..at + T`.
fn write_at(buf: &Array, x: &Array, at: usize) -> Result<Array> {
    let (b, h, d) = dims(x);
    let t = x.dim(2);
    buf.slice_update(x, &[0, 0, at as i32, 0], &[b, h, at as i32 + t, d])
}

/// A buffer shaped like `like` (any T) with `cap` tokens, holding `old`'s
/// first `len` tokens.
fn regrow(old: Option<&Array>, len: usize, cap: usize, like: &Array) -> Result<Array> {
    let (b, h, d) = dims(like);
    let fresh = zeros(&[b, h, cap as i32, d], like.dtype())?;
    match old {
        Some(o) if len > 0 => write_at(&fresh, &o.slice_axis(2, 0, len as i32)?, 0),
        _ => Ok(fresh),
    }
}

impl QuantKvCache {
    pub fn new(codec: Codec) -> QuantKvCache {
        QuantKvCache {
            codec,
            kq: vec![],
            vq: vec![],
            q_len: 0,
            q_cap: 0,
            kp: None,
            vp: None,
            p_len: 0,
            p_cap: 0,
            stats: CacheStats::default(),
        }
    }

    /// A cache in the pending phase holding full-precision `k`, `v`: exactly
    /// what a deferred prefill of those tokens leaves behind.
    pub fn with_pending(codec: Codec, k: &Array, v: &Array) -> Result<QuantKvCache> {
        let mut c = QuantKvCache::new(codec);
        let n = k.dim(2) as usize;
        c.restore(&QuantKvState {
            keys: vec![],
            values: vec![],
            quantized: 0,
            pending: if n > 0 { Some((k.clone(), v.clone())) } else { None },
            pending_len: n,
        })?;
        Ok(c)
    }

    pub fn codec(&self) -> &Codec {
        &self.codec
    }

    pub fn offset(&self) -> usize {
        self.q_len + self.p_len
    }

    pub fn quantized_len(&self) -> usize {
        self.q_len
    }

    pub fn pending_len(&self) -> usize {
        self.p_len
    }

    pub fn phase(&self) -> Phase {
        match (self.q_len > 0, self.p_len > 0) {
            (false, false) => Phase::Empty,
            (false, true) => Phase::Pending,
            (true, false) => Phase::Live,
            (true, true) => Phase::Mixed,
        }
    }

    /// Appends full-precision `k`, `v` to the pending tail.
    fn append_pending(&mut self, k: &Array, v: &Array) -> Result<()> {
        let t = k.dim(2) as usize;
        if self.kp.is_none() || self.p_len + t > self.p_cap {
            let cap = grown(self.p_cap, self.p_len + t);
            self.kp = Some(regrow(self.kp.as_ref(), self.p_len, cap, k)?);
            self.vp = Some(regrow(self.vp.as_ref(), self.p_len, cap, v)?);
            self.p_cap = cap;
            self.stats.allocations += 1;
            self.stats.copied_tokens += self.p_len;
        }
        self.kp = Some(write_at(self.kp.as_ref().unwrap(), k, self.p_len)?);
        self.vp = Some(write_at(self.vp.as_ref().unwrap(), v, self.p_len)?);
        self.p_len += t;
        Ok(())
    }

    /// Quantizes `k`, `v` and writes them after the quantized prefix.
    fn insert_quantized(&mut self, k: &Array, v: &Array) -> Result<()> {
        let t = k.dim(2) as usize;
        let ke = self.codec.encode(k)?;
        let ve = self.codec.encode(v)?;
        if self.kq.is_empty() || self.q_len + t > self.q_cap {
            let cap = grown(self.q_cap, self.q_len + t);
            let mut nk = Vec::with_capacity(ke.len());
            let mut nv = Vec::with_capacity(ve.len());
            for (i, part) in ke.iter().enumerate() {
                nk.push(regrow(self.kq.get(i), self.q_len, cap, part)?);
            }
            for (i, part) in ve.iter().enumerate() {
                nv.push(regrow(self.vq.get(i), self.q_len, cap, part)?);
            }
            self.stats.allocations += 1;
            self.stats.copied_tokens += self.q_len;
            self.kq = nk;
            self.vq = nv;
            self.q_cap = cap;
        }
        for (buf, part) in self.kq.iter_mut().zip(&ke) {
            *buf = write_at(buf, part, self.q_len)?;
        }
        for (buf, part) in self.vq.iter_mut().zip(&ve) {
            *buf = write_at(buf, part, self.q_len)?;
        }
        self.q_len += t;
        self.stats.quantized_tokens += t;
        Ok(())
    }

    /// Quantizes the whole pending tail in one batch and drops its buffers.
    pub fn flush(&mut self) -> Result<()> {
        if self.p_len == 0 {
            return Ok(());
        }
        let k = self.kp.take().unwrap().slice_axis(2, 0, self.p_len as i32)?;
        let v = self.vp.take().unwrap().slice_axis(2, 0, self.p_len as i32)?;
        self.p_len = 0;
        self.p_cap = 0;
        self.stats.bulk_quantizations += 1;
        self.insert_quantized(&k, &v)
    }

    /// Adds `k`, `v` (`[B, H, T, head_dim]`, RoPE applied) and returns what
    /// attention reads for this call.
    pub fn update(&mut self, k: &Array, v: &Array) -> Result<Fetched> {
        self.store(k, v)?;
        self.fetch(k.dtype())
    }

    /// Adds `k`, `v`: pending for a prefill chunk (or a first token), else
    /// quantized after flushing anything pending.
    fn store(&mut self, k: &Array, v: &Array) -> Result<()> {
        if k.dim(-1) as usize != self.codec.head_dim || v.dim(-1) as usize != self.codec.head_dim {
            return Err(Error::invalid(format!(
                "KV cache codec is for head_dim {}, got keys {:?} and values {:?}",
                self.codec.head_dim,
                k.shape(),
                v.shape()
            )));
        }
        if k.dim(2) > 1 || self.offset() == 0 {
            self.append_pending(k, v)?;
        } else {
            self.flush()?;
            self.insert_quantized(k, v)?;
        }
        Ok(())
    }

    /// K and V over everything cached, in `dtype`.
    pub fn fetch(&self, dtype: Dtype) -> Result<Fetched> {
        let pend = |a: &Option<Array>| -> Result<Array> { a.as_ref().unwrap().slice_axis(2, 0, self.p_len as i32) };
        if self.q_len == 0 {
            if self.p_len == 0 {
                return Err(Error::invalid("the KV cache is empty"));
            }
            return Ok(Fetched { keys: pend(&self.kp)?, values: pend(&self.vp)?, rotated: false });
        }
        let part = |parts: &[Array]| -> Result<Vec<Array>> {
            parts.iter().map(|p| p.slice_axis(2, 0, self.q_len as i32)).collect()
        };
        let mut keys = self.codec.decode(&part(&self.kq)?, dtype)?;
        let mut values = self.codec.decode(&part(&self.vq)?, dtype)?;
        if self.p_len > 0 {
            keys = concatenate(&[&keys, &self.codec.to_space(&pend(&self.kp)?)?], 2)?;
            values = concatenate(&[&values, &self.codec.to_space(&pend(&self.vp)?)?], 2)?;
        }
        Ok(Fetched { keys, values, rotated: self.codec.rotates() })
    }

    /// One attention call: stores `k`, `v`, attends `q` over the cache
    /// (causal for multi-token queries) and returns `[B, heads, T, head_dim]`.
    pub fn attend(&mut self, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        let t = q.dim(2);
        self.store(k, v)?;
        if t == 1 && self.p_len == 0 && self.codec.has_quantized_attention() {
            // Decode over a live affine cache: scores and output straight
            // from the packed K/V with quantized matmuls (mlx-lm's way).
            let cut = |parts: &[Array]| -> Result<Vec<Array>> {
                parts.iter().map(|p| p.slice_axis(2, 0, self.q_len as i32)).collect()
            };
            return self.codec.quantized_attention(q, &cut(&self.kq)?, &cut(&self.vq)?, scale);
        }
        let f = self.fetch(k.dtype())?;
        // Several tokens: causal, through the attention buckets as the
        // plain caches' prompts (src/cache/bucket.rs: on CUDA a new length
        // would build a new cuDNN graph).
        let attend = |q: &Array| {
            if t > 1 {
                crate::cache::bucket::causal(q, &f.keys, &f.values, scale)
            } else {
                sdpa(q, &f.keys, &f.values, scale, Mask::None)
            }
        };
        if f.rotated {
            let o = attend(&self.codec.to_space(q)?)?;
            self.codec.from_space(&o)
        } else {
            attend(q)
        }
    }

    /// Drops the last `n` tokens (the pending tail first); returns how many
    /// were dropped.
    pub fn trim(&mut self, n: usize) -> usize {
        let n = n.min(self.offset());
        let from_pending = n.min(self.p_len);
        self.p_len -= from_pending;
        self.q_len -= n - from_pending;
        n
    }

    /// The contents, trimmed to the used lengths.
    pub fn state(&self) -> Result<QuantKvState> {
        let cut = |parts: &[Array]| -> Result<Vec<Array>> {
            if self.q_len == 0 {
                return Ok(vec![]);
            }
            parts.iter().map(|p| p.slice_axis(2, 0, self.q_len as i32)).collect()
        };
        let pending = if self.p_len > 0 {
            Some((
                self.kp.as_ref().unwrap().slice_axis(2, 0, self.p_len as i32)?,
                self.vp.as_ref().unwrap().slice_axis(2, 0, self.p_len as i32)?,
            ))
        } else {
            None
        };
        Ok(QuantKvState { keys: cut(&self.kq)?, values: cut(&self.vq)?, quantized: self.q_len, pending, pending_len: self.p_len })
    }

    /// Replaces the contents with `s`: whatever region `s` lacks is dropped
    /// (restoring a live state drops the pending buffers and vice versa).
    pub fn restore(&mut self, s: &QuantKvState) -> Result<()> {
        let nparts = 3;
        let ok_parts = |p: &[Array], len: usize| {
            (len == 0 && p.is_empty()) || (p.len() == nparts && p.iter().all(|a| a.dim(2) as usize == len))
        };
        if !ok_parts(&s.keys, s.quantized) || !ok_parts(&s.values, s.quantized) {
            return Err(Error::invalid("KV cache state does not match this cache's codec"));
        }
        match &s.pending {
            Some((k, v)) if k.dim(2) as usize == s.pending_len && v.dim(2) as usize == s.pending_len && s.pending_len > 0 => {}
            None if s.pending_len == 0 => {}
            _ => return Err(Error::invalid("KV cache state's pending length does not match its arrays")),
        }
        self.kq = s.keys.iter().map(|a| a.contiguous()).collect::<Result<_>>()?;
        self.vq = s.values.iter().map(|a| a.contiguous()).collect::<Result<_>>()?;
        self.q_len = s.quantized;
        self.q_cap = s.quantized;
        match &s.pending {
            Some((k, v)) => {
                self.kp = Some(k.contiguous()?);
                self.vp = Some(v.contiguous()?);
            }
            None => {
                self.kp = None;
                self.vp = None;
            }
        }
        self.p_len = s.pending_len;
        self.p_cap = s.pending_len;
        Ok(())
    }

    /// Bytes of every buffer held (allocated capacity).
    pub fn nbytes(&self) -> usize {
        self.arrays().iter().map(|a| a.nbytes()).sum()
    }

    /// Bytes of the used part: quantized tokens at the codec's packed size,
    /// pending tokens at full precision.
    pub fn used_bytes(&self) -> usize {
        let per = |parts: &[Array]| -> usize {
            parts.iter().map(|a| if a.dim(2) > 0 { a.nbytes() / a.dim(2) as usize } else { 0 }).sum()
        };
        let pend = |a: &Option<Array>| a.as_ref().map(|a| a.nbytes() / a.dim(2).max(1) as usize).unwrap_or(0);
        (per(&self.kq) + per(&self.vq)) * self.q_len + (pend(&self.kp) + pend(&self.vp)) * self.p_len
    }

    pub fn arrays(&self) -> Vec<&Array> {
        self.kq.iter().chain(self.vq.iter()).chain(self.kp.iter()).chain(self.vp.iter()).collect()
    }
}
