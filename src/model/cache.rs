//! Flat per-sequence caches: a KV cache per attention layer that grows in
//! fixed steps (one allocation per `step` tokens, never a concatenate per
//! token), and the short-conv state per conv layer.

use crate::error::Result;
use crate::mlx::{concatenate, zeros, Array};

/// Tokens added to a KV cache's capacity each time it fills up.
pub const KV_STEP: usize = 256;

#[derive(Clone, Default)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    pub offset: usize,
}

impl KvCache {
    fn capacity(&self) -> usize {
        self.keys.as_ref().map(|k| k.dim(2) as usize).unwrap_or(0)
    }

    /// Appends `k`, `v` (`[B, kv_heads, T, head_dim]`) and returns views of
    /// everything cached so far.
    pub fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let t = k.dim(2) as usize;
        let prev = self.offset;
        if self.keys.is_none() || prev + t > self.capacity() {
            let (b, h, dk, dv) = (k.dim(0), k.dim(1), k.dim(3), v.dim(3));
            let n_steps = t.div_ceil(KV_STEP) as i32;
            let new_k = zeros(&[b, h, n_steps * KV_STEP as i32, dk], k.dtype())?;
            let new_v = zeros(&[b, h, n_steps * KV_STEP as i32, dv], v.dtype())?;
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
        }
        self.offset = prev + t;
        let keys = self.keys.as_ref().unwrap();
        let values = self.values.as_ref().unwrap();
        let (b, h) = (k.dim(0), k.dim(1));
        let end = self.offset as i32;
        let nk = keys.slice_update(k, &[0, 0, prev as i32, 0], &[b, h, end, k.dim(3)])?;
        let nv = values.slice_update(v, &[0, 0, prev as i32, 0], &[b, h, end, v.dim(3)])?;
        let out = (nk.slice_axis(2, 0, end)?, nv.slice_axis(2, 0, end)?);
        self.keys = Some(nk);
        self.values = Some(nv);
        Ok(out)
    }

    /// Bytes held (the allocated capacity, not just the used part).
    pub fn nbytes(&self) -> usize {
        self.keys.as_ref().map(|a| a.nbytes()).unwrap_or(0) + self.values.as_ref().map(|a| a.nbytes()).unwrap_or(0)
    }

    pub fn arrays(&self) -> Vec<&Array> {
        self.keys.iter().chain(self.values.iter()).collect()
    }
}

#[derive(Clone)]
pub enum LayerCache {
    Attention(KvCache),
    /// The last `L-1` rows of `B*x` (`[B, L-1, D]`); None before the first token.
    Conv(Option<Array>),
}

/// All caches of one sequence.
#[derive(Clone)]
pub struct ModelCache {
    pub layers: Vec<LayerCache>,
    /// Tokens run through the model so far (the next token's position).
    pub pos: usize,
}

impl ModelCache {
    pub fn new(attn_layers: &[bool]) -> ModelCache {
        ModelCache {
            layers: attn_layers
                .iter()
                .map(|&a| if a { LayerCache::Attention(KvCache::default()) } else { LayerCache::Conv(None) })
                .collect(),
            pos: 0,
        }
    }

    pub fn nbytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Attention(kv) => kv.nbytes(),
                LayerCache::Conv(s) => s.as_ref().map(|a| a.nbytes()).unwrap_or(0),
            })
            .sum()
    }

    /// Every array the cache holds (to evaluate them together).
    pub fn arrays(&self) -> Vec<&Array> {
        self.layers
            .iter()
            .flat_map(|l| match l {
                LayerCache::Attention(kv) => kv.arrays(),
                LayerCache::Conv(s) => s.iter().collect(),
            })
            .collect()
    }
}
