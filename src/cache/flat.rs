//! The flat KV cache: one attention layer's K/V for one sequence, in
//! buffers that grow in fixed steps (one allocation per `KV_STEP` tokens,
//! never a concatenate per token), or, with a quantized `kvCache`, the
//! codes of src/kvquant in their place.

use crate::error::Result;
use crate::mlx::{arange, concatenate, zeros, Array, Dtype};

/// Tokens added to a KV cache's capacity each time it fills up.
pub const KV_STEP: usize = 256;

/// One attention layer's K/V. It keeps no length of its own: the sequence's
/// position ([`super::ModelCache::pos`]) is the one counter, passed in as
/// `len` (the positions held before the call).
#[derive(Clone, Default)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    /// A quantized cache (the `kvCache` load option) replaces the flat
    /// buffers when set. Eager decode only.
    pub quant: Option<Box<crate::kvquant::QuantKvCache>>,
}

impl KvCache {
    fn capacity(&self) -> usize {
        self.keys.as_ref().map(|k| k.dim(2) as usize).unwrap_or(0)
    }

    /// Makes room for `t` more tokens after `len`, growing by whole `KV_STEP`s.
    fn reserve(&mut self, len: usize, t: usize, like_k: &Array, like_v: &Array) -> Result<()> {
        if self.keys.is_some() && len + t <= self.capacity() {
            return Ok(());
        }
        let (b, h, dk, dv) = (like_k.dim(0), like_k.dim(1), like_k.dim(3), like_v.dim(3));
        let n_steps = t.div_ceil(KV_STEP) as i32;
        let new_k = zeros(&[b, h, n_steps * KV_STEP as i32, dk], like_k.dtype())?;
        let new_v = zeros(&[b, h, n_steps * KV_STEP as i32, dv], like_v.dtype())?;
        match (self.keys.take(), self.values.take()) {
            (Some(ok), Some(ov)) => {
                let (ok, ov) = if !len.is_multiple_of(KV_STEP) {
                    (ok.slice_axis(2, 0, len as i32)?, ov.slice_axis(2, 0, len as i32)?)
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

    /// Writes `k`, `v` (`[B, kv_heads, T, head_dim]`) at position `len`
    /// (also a decode batch or batched prefill handing a sequence its rows).
    pub fn append(&mut self, len: usize, k: &Array, v: &Array) -> Result<()> {
        let t = k.dim(2) as usize;
        self.reserve(len, t, k, v)?;
        let (start, end) = (len as i32, (len + t) as i32);
        let (b, h) = (k.dim(0), k.dim(1));
        let nk = self.keys.as_ref().unwrap().slice_update(k, &[0, 0, start, 0], &[b, h, end, k.dim(3)])?;
        let nv = self.values.as_ref().unwrap().slice_update(v, &[0, 0, start, 0], &[b, h, end, v.dim(3)])?;
        self.keys = Some(nk);
        self.values = Some(nv);
        Ok(())
    }

    /// Appends `k`, `v` at `len` and returns views of everything cached so
    /// far (multi-token steps: prefill).
    pub fn update_and_fetch(&mut self, len: usize, k: &Array, v: &Array) -> Result<(Array, Array)> {
        self.append(len, k, v)?;
        let end = (len + k.dim(2) as usize) as i32;
        Ok((self.keys.as_ref().unwrap().slice_axis(2, 0, end)?, self.values.as_ref().unwrap().slice_axis(2, 0, end)?))
    }

    /// Appends one token's `k`, `v` at `len` and returns the whole buffers
    /// with a boolean mask of the filled positions (`[1, 1, 1, capacity]`).
    /// Decode attends over fixed-size buffers so the compiled step keeps
    /// static shapes; the eager step does the same so both agree byte for
    /// byte.
    pub fn update_decode(&mut self, len: usize, k: &Array, v: &Array) -> Result<(Array, Array, Array)> {
        self.append(len, k, v)?;
        let cap = self.capacity() as i32;
        let mask = decode_mask(cap, len as i32)?;
        Ok((self.keys.clone().unwrap(), self.values.clone().unwrap(), mask))
    }

    /// Stores this call's `k`, `v` after `len` positions and attends `q`
    /// over everything cached: causal for several tokens (prefill), masked
    /// fixed-size buffers for one (decode), or the quantized cache's own
    /// attention.
    pub fn attend(&mut self, len: usize, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        if let Some(qc) = self.quant.as_deref_mut() {
            // Deferred prefill, quantize on insert during decode; see src/kvquant/cache.rs.
            if qc.offset() != len {
                return Err(crate::error::Error::invalid(format!(
                    "quantized KV cache holds {} positions, its sequence {len}",
                    qc.offset()
                )));
            }
            qc.attend(q, k, v, scale)
        } else if q.dim(2) > 1 {
            let (k, v) = self.update_and_fetch(len, k, v)?;
            // (The keys run from position 0, the query's rows are the last
            // of them: a bucket pads both alike.)
            super::bucket::causal(q, &k, &v, scale)
        } else {
            let (k, v, mask) = self.update_decode(len, k, v)?;
            crate::kernels::decode_attention::sdpa_masked(q, &k, &v, scale, &mask)
        }
    }

    /// For the compiled step: make room for the token after `len` and hand
    /// out the buffers. `like` (one token's K/V shape and dtype) is only
    /// built when the buffers must grow, so a plain step allocates nothing
    /// here.
    pub fn buffers_for_step(&mut self, len: usize, like: impl FnOnce() -> Result<Array>) -> Result<(Array, Array)> {
        if self.quant.is_some() {
            return Err(crate::error::Error::invalid("the compiled decode step cannot run over a quantized KV cache"));
        }
        if self.keys.is_none() || len + 1 > self.capacity() {
            let l = like()?;
            self.reserve(len, 1, &l, &l)?;
        }
        Ok((self.keys.clone().unwrap(), self.values.clone().unwrap()))
    }

    /// A copy whose K/V buffers are its own (`x * 1`: every value's bits,
    /// a new buffer): a kernel may write a buffer in place
    /// (src/kernels/qkv_fused.rs `kv_in_place`), which a shared one would
    /// show the other cache too.
    /// (Evaluated here: a lazy copy would be taken only where it is first
    /// read, after the buffers it copies may have been written again.)
    /// (The buffers first, in an evaluation of their own: one a step
    /// wrote in place is an array MLX orders after that step's q/k/v
    /// launch, but within one CUDA graph a copy of it would not be.)
    pub fn deep_clone(&self) -> Result<KvCache> {
        let held: Vec<&Array> = self.keys.iter().chain(self.values.iter()).collect();
        if !held.is_empty() {
            crate::mlx::eval(&held)?;
        }
        let own = |b: &Option<Array>| b.as_ref().map(|b| b.mul_scalar(1.0)).transpose();
        let (keys, values) = (own(&self.keys)?, own(&self.values)?);
        let made: Vec<&Array> = keys.iter().chain(values.iter()).collect();
        if !made.is_empty() {
            crate::mlx::eval(&made)?;
        }
        Ok(KvCache { keys, values, quant: self.quant.clone() })
    }

    /// Takes back the buffers the compiled step wrote one token into.
    pub fn commit_step(&mut self, keys: Array, values: Array) {
        self.keys = Some(keys);
        self.values = Some(values);
    }

    /// The used K and V of a flat cache holding `len` positions
    /// (`[B, kv_heads, len, head_dim]`); None when empty or quantized.
    pub fn contents(&self, len: usize) -> Result<Option<(Array, Array)>> {
        match (&self.keys, &self.values, &self.quant) {
            (Some(k), Some(v), None) if len > 0 => {
                let end = len as i32;
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

    /// Bytes of `len` used positions (allocated capacity aside).
    pub fn used_bytes(&self, len: usize) -> usize {
        if let Some(q) = &self.quant {
            return q.used_bytes();
        }
        let cap = self.capacity();
        if cap == 0 {
            return 0;
        }
        self.nbytes() / cap * len
    }

    pub fn arrays(&self) -> Vec<&Array> {
        let mut v: Vec<&Array> = self.keys.iter().chain(self.values.iter()).collect();
        if let Some(q) = &self.quant {
            v.extend(q.arrays());
        }
        v
    }
}

/// `[1, 1, 1, cap]`: true at positions `0..=pos`.
pub fn decode_mask(cap: i32, pos: i32) -> Result<Array> {
    arange(0.0, cap as f64, 1.0, Dtype::Int32)?.lt(&Array::scalar(pos as f64 + 1.0, Dtype::Int32)?)?.reshape(&[1, 1, 1, cap])
}
