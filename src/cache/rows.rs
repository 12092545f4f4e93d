//! Several sequences in one forward pass, each keeping its own cache:
//! [`RowsPass`] (one eager decode step, row i attending over sequence i's
//! flat, quantized or paged cache) and [`PrefillRows`] (fresh prompts
//! right-padded into one `[B, T]` prefill, each row's K/V and conv states
//! landing in its own cache as a single prefill would leave them).

use super::paged;
use super::sequence::{ModelCache, SeqPass};
use super::{ConvShape, ForwardCache, Offset};
use crate::error::{Error, Result};
use crate::mlx::{self, concatenate, Array};

/// One decode token for each of several sequences: row i of the batch is
/// a [`SeqPass`] over `caches[i]`, so every row is stored and attended
/// exactly as it would be alone (the eager batch; the only one for
/// quantized KV caches).
pub struct RowsPass<'a> {
    rows: Vec<SeqPass<'a>>,
    offsets: Array,
}

impl<'a> RowsPass<'a> {
    pub fn new(caches: &'a mut [&mut ModelCache]) -> Result<RowsPass<'a>> {
        let offsets: Vec<i32> = caches.iter().map(|c| c.pos as i32).collect();
        let offsets = Array::from_slice(&offsets, &[offsets.len() as i32])?;
        let rows = caches.iter_mut().map(|c| c.pass(1)).collect::<Result<_>>()?;
        Ok(RowsPass { rows, offsets })
    }

    pub fn finish(self) -> Result<()> {
        self.rows.into_iter().try_for_each(|r| r.finish())
    }
}

fn row(a: &Array, i: usize) -> Result<Array> {
    a.slice_axis(0, i as i32, i as i32 + 1)
}

impl ForwardCache for RowsPass<'_> {
    fn offset(&self) -> Offset<'_> {
        Offset::Array(&self.offsets)
    }

    fn attend(&mut self, layer: usize, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        let mut outs = Vec::with_capacity(self.rows.len());
        for (i, r) in self.rows.iter_mut().enumerate() {
            outs.push(r.attend(layer, &row(q, i)?, &row(k, i)?, &row(v, i)?, scale)?);
        }
        let refs: Vec<&Array> = outs.iter().collect();
        concatenate(&refs, 0)
    }

    fn conv_state(&mut self, layer: usize, shape: ConvShape) -> Result<Array> {
        let one = ConvShape { batch: 1, ..shape };
        let states: Vec<Array> = self.rows.iter_mut().map(|r| r.conv_state(layer, one)).collect::<Result<_>>()?;
        let refs: Vec<&Array> = states.iter().collect();
        concatenate(&refs, 0)
    }

    fn conv_update(&mut self, layer: usize, padded: &Array, keep: i32) -> Result<()> {
        for (i, r) in self.rows.iter_mut().enumerate() {
            r.conv_update(layer, &row(padded, i)?, keep)?;
        }
        Ok(())
    }

    fn conv_step_update(&mut self, layer: usize, prev: &Array, next: &Array) -> Result<()> {
        for (i, r) in self.rows.iter_mut().enumerate() {
            r.conv_step_update(layer, &row(prev, i)?, &row(next, i)?)?;
        }
        Ok(())
    }
}

/// Fresh prompts prefilled together, right-padded into one `[B, T]` pass.
/// Padding sits after each row's tokens, so causal attention and the
/// causal conv never let it reach a real token. Conv states are gathered
/// after every row's last token and, for paged rows, after each of its
/// full blocks: one gather per layer for all of them.
pub struct PrefillRows<'a, 'c> {
    caches: &'a mut [&'c mut ModelCache],
    lens: Vec<usize>,
    taps: Vec<i32>,
    /// Per conv layer `[B, taps * keep, D]`.
    tapped: Vec<Array>,
}

impl<'a, 'c> PrefillRows<'a, 'c> {
    /// `lens[i]`: the length of row i's prompt. Every cache must be fresh,
    /// stackable, and (paged) hold the blocks for its prompt.
    pub fn new(caches: &'a mut [&'c mut ModelCache], lens: Vec<usize>) -> Result<PrefillRows<'a, 'c>> {
        if caches.len() != lens.len() || lens.contains(&0) {
            return Err(Error::invalid("batched prefill takes one non-empty prompt per cache"));
        }
        let mut taps: std::collections::BTreeSet<i32> = lens.iter().map(|&n| n as i32).collect();
        for (c, &n) in caches.iter_mut().zip(&lens) {
            if c.pos != 0 {
                return Err(Error::invalid("batched prefill takes fresh caches"));
            }
            if !super::batch::stackable(c) {
                return Err(Error::invalid("a quantized KV cache is prefilled alone"));
            }
            if let Some(seq) = c.paged.as_mut() {
                seq.reserve(0, n)?;
                let bs = seq.block_size();
                taps.extend((bs..=n).step_by(bs).map(|e| e as i32));
            }
        }
        Ok(PrefillRows { caches, lens, taps: taps.into_iter().collect(), tapped: vec![] })
    }

    /// Hands each row its conv states after its last token and, for a
    /// paged cache, the snapshots at its block ends, and sets its position.
    pub fn finish(self, keep: i32) -> Result<()> {
        let PrefillRows { caches, lens, taps, tapped } = self;
        // [conv layers, B, taps * keep, D]: a row's states after j tokens
        // are its slice at tap j, in the snapshot layout ([layers, 1, keep, D]).
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
                seq.wrote(n, true)?;
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
        Ok(())
    }
}

impl ForwardCache for PrefillRows<'_, '_> {
    fn offset(&self) -> Offset<'_> {
        Offset::Int(0)
    }

    fn attend(&mut self, layer: usize, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        let o = super::bucket::causal(q, k, v, scale)?;
        for (i, c) in self.caches.iter_mut().enumerate() {
            let (r, n) = (i as i32, self.lens[i] as i32);
            let mine = |a: &Array| a.slice(&[r, 0, 0, 0], &[r + 1, a.dim(1), n, a.dim(3)], &[1, 1, 1, 1]);
            c.store_kv(layer, 0, &mine(k)?, &mine(v)?)?;
        }
        Ok(o)
    }

    fn conv_state(&mut self, _layer: usize, shape: ConvShape) -> Result<Array> {
        shape.zeros()
    }

    fn conv_update(&mut self, _layer: usize, padded: &Array, keep: i32) -> Result<()> {
        self.tapped.push(super::tap_states(padded, &self.taps, keep)?);
        Ok(())
    }
}
