//! A fresh prompt's pass as a pure function of arrays, what the compiled
//! prefill traces (src/compiled/prefill.rs): no cache before the prompt, so
//! every attention layer attends over its own K/V and every conv layer
//! starts from zeros; the K/V and the conv inputs are outputs, written into
//! the sequence's real cache afterwards ([`SeqPass::store`]).

use super::{ConvShape, ForwardCache, Offset, SeqPass};
use crate::error::{Error, Result};
use crate::mlx::{self, Array, Mask};

/// The pass over a prompt at position 0. `stored` holds, in layer order,
/// each attention layer's K and V (`[1, kv_heads, T, head_dim]`, after
/// RoPE) and each conv layer's padded input (`[1, keep + T, D]`).
#[derive(Default)]
pub struct FreshPass {
    pub stored: Vec<Array>,
}

impl ForwardCache for FreshPass {
    fn offset(&self) -> Offset<'_> {
        Offset::Int(0)
    }

    fn attend(&mut self, _layer: usize, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        self.stored.push(k.clone());
        self.stored.push(v.clone());
        // What a flat or paged pass attends over from position 0: exactly
        // this call's K/V, causally.
        mlx::sdpa(q, k, v, scale, Mask::Causal)
    }

    fn conv_state(&mut self, _layer: usize, shape: ConvShape) -> Result<Array> {
        shape.zeros()
    }

    fn conv_update(&mut self, _layer: usize, padded: &Array, _keep: i32) -> Result<()> {
        self.stored.push(padded.clone());
        Ok(())
    }
}

/// Writes a [`FreshPass`]'s outputs for the first `n` tokens of a prompt
/// (the pass may have run right-padded past them: padding follows the
/// tokens, so causal attention and the causal conv kept it out of theirs)
/// into `pass`, a pass over a fresh sequence of `n` tokens, layer by layer
/// as `attn_layers` says; then the pass's own bookkeeping (position, paged
/// blocks and conv snapshots) as an ordinary prefill leaves it.
pub fn store_fresh(mut pass: SeqPass<'_>, attn_layers: &[bool], stored: Vec<Array>, n: usize, keep: i32) -> Result<()> {
    let want: usize = attn_layers.iter().map(|&a| if a { 2 } else { 1 }).sum();
    if stored.len() != want {
        return Err(Error::mlx(format!("a fresh prompt's pass returned {} arrays, expected {want}", stored.len())));
    }
    let n = n as i32;
    let mut it = stored.into_iter();
    for (layer, &attn) in attn_layers.iter().enumerate() {
        let mut next = |axis: i32, len: i32| -> Result<Array> {
            let a = it.next().expect("counted above");
            if a.dim(axis) == len {
                Ok(a)
            } else {
                a.slice_axis(axis, 0, len)
            }
        };
        if attn {
            let (k, v) = (next(2, n)?, next(2, n)?);
            pass.store(layer, &k, &v)?;
        } else {
            let padded = next(1, keep + n)?;
            pass.conv_update(layer, &padded, keep)?;
        }
    }
    pass.finish()
}
