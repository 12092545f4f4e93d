//! The caches: everything a forward pass reads and writes besides the
//! weights. The layers (src/model/lfm2.rs) see only [`ForwardCache`], the
//! way mlx-lm's layers see only `update_and_fetch`: which kind of cache a
//! call runs over (flat, quantized, paged, a decode batch's stacked rows)
//! is decided here, never in a layer.
//!
//! - `flat.rs`: [`KvCache`], one attention layer's K/V for one sequence
//!   (or its quantized codes, src/kvquant), and the decode mask.
//! - `sequence.rs`: [`ModelCache`], one sequence's caches and its position,
//!   and [`SeqPass`], the pass over it (prefill chunks and eager decode).
//! - `paged.rs`: the block pool shared by a model's sequences, with
//!   prefix reuse, and a sequence's block table ([`PagedSeq`]).
//! - `batch.rs`: [`DecodeBatch`], the running sequences stacked row by row,
//!   and [`StackedPass`], the pass of one decode step over stacked state:
//!   the compiled step (src/compiled) and the uncompiled one.
//! - `rows.rs`: [`RowsPass`], one eager decode step over several
//!   sequences' own caches, and [`PrefillRows`], right-padded prompts
//!   prefilled together.
//! - `fresh.rs`: [`fresh::FreshPass`], a fresh prompt's pass as a pure
//!   function (the compiled prefill's), and how its outputs reach a cache.

pub mod batch;
pub mod bucket;
pub mod flat;
pub mod fresh;
pub mod paged;
pub mod rows;
pub mod sequence;
#[cfg(test)]
mod tests;

pub use batch::{BatchShape, DecodeBatch, Member, StackedPass};
pub use flat::{decode_mask, KvCache, KV_STEP};
pub use paged::{PagedConfig, PagedPool, PagedSeq, PagedStats, SharedPool};
pub use rows::{PrefillRows, RowsPass};
pub use sequence::{LayerCache, ModelCache, SeqPass};

use crate::error::{Error, Result};
use crate::mlx::{concatenate, zeros, Array, Dtype};

/// Where a call's tokens sit, for RoPE.
pub enum Offset<'a> {
    /// Every row at the same position.
    Int(i32),
    /// An int32 array: a scalar (one sequence, the position an input of a
    /// compiled step) or one position per row.
    Array(&'a Array),
}

/// The conv states after each of `taps` (positions 1..=T of the call) in
/// one gather: row j of `padded` is input j - keep, so the state after j
/// inputs is rows j..j+keep. `[B, taps * keep, D]`.
pub fn tap_states(padded: &Array, taps: &[i32], keep: i32) -> Result<Array> {
    let rows: Vec<i32> = taps.iter().flat_map(|&j| j..j + keep).collect();
    padded.take(&Array::from_slice(&rows, &[rows.len() as i32])?, 1)
}

/// What an empty conv state looks like (`[batch, keep, dim]`).
#[derive(Clone, Copy)]
pub struct ConvShape {
    pub batch: i32,
    pub keep: i32,
    pub dim: i32,
    pub dtype: Dtype,
}

impl ConvShape {
    /// Zeros of this shape, made and evaluated once and then kept (the
    /// last few shapes, per thread, one array each): a fresh prompt's pass reads them in
    /// every conv layer, where making them anew put two nodes a layer into
    /// its graph (a broadcast and a fill launch). Nothing writes them in
    /// place: MLX donates only buffers nothing else holds.
    pub fn zeros(&self) -> Result<Array> {
        // (The device too: a thread may run models on either, and a kept
        // array belongs to the stream that made it.)
        let key = (self.batch, self.keep, self.dim, self.dtype, crate::mlx::runtime::default_device() == crate::mlx::runtime::DeviceType::Gpu);
        if let Some(z) = KEPT_ZEROS.with(|k| k.borrow().0.iter().find(|(at, _)| *at == key).map(|(_, z)| z.clone())) {
            return Ok(z);
        }
        let z = zeros(&[self.batch, self.keep, self.dim], self.dtype)?;
        // (Queued, not waited for: the pass that asked goes on building.
        // Where MLX refuses, e.g. inside a function transformation, the
        // zeros stay nodes of that graph and are not kept.)
        if crate::mlx::async_eval(&[&z]).is_err() {
            return Ok(z);
        }
        KEPT_ZEROS.with(|k| {
            let mut k = k.borrow_mut();
            if k.0.len() >= KEPT_SHAPES {
                k.0.remove(0);
            }
            k.0.push((key, z.clone()));
        });
        Ok(z)
    }
}

/// Conv-state shapes whose zeros a thread keeps (a batch size each, in
/// practice).
const KEPT_SHAPES: usize = 16;

/// The shapes this thread keeps zeros for now.
#[cfg(test)]
pub(crate) fn kept_zero_shapes() -> usize {
    KEPT_ZEROS.with(|k| k.borrow().0.len())
}

/// A kept array's key: its shape `[batch, keep, dim]`, dtype, and whether
/// it was made on the GPU.
type ZerosKey = (i32, i32, i32, Dtype, bool);

struct KeptZeros(Vec<(ZerosKey, Array)>);

impl Drop for KeptZeros {
    // At a thread's exit (the process's too) MLX's own statics may be gone
    // already: the few kept arrays are left to the process rather than
    // released into them.
    fn drop(&mut self) {
        for (_, a) in self.0.drain(..) {
            std::mem::forget(a);
        }
    }
}

thread_local! {
    static KEPT_ZEROS: std::cell::RefCell<KeptZeros> = const { std::cell::RefCell::new(KeptZeros(Vec::new())) };
}

/// The cache one forward pass writes through. `layer` is the decoder
/// layer's index in the model.
pub trait ForwardCache {
    /// The RoPE offset of this call's tokens.
    fn offset(&self) -> Offset<'_>;

    /// Stores attention layer `layer`'s K/V for this call (`[B, kv_heads,
    /// T, head_dim]`, after RoPE) and attends `q` over everything the cache
    /// holds for the layer. Returns `[B, heads, T, head_dim]`.
    fn attend(&mut self, layer: usize, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array>;

    /// [`ForwardCache::attend`] for a decode step's rows (one token a row):
    /// `[B, heads * head_dim]`, what the output projection reads. A cache
    /// whose attention kernel can write that shape itself spares the step
    /// the reshape node after it (one an attention layer and token).
    fn attend_rows(&mut self, layer: usize, q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
        let o = self.attend(layer, q, k, v, scale)?;
        o.reshape(&[o.dim(0), o.dim(1) * o.dim(3)])
    }

    /// Attention layer `layer`'s K/V buffers (`[1, kv_heads, cap,
    /// head_dim]`, room made for this call's token) for a kernel that writes
    /// the token's K and V into them itself, in place, at the offset
    /// (src/kernels/qkv_fused.rs `kv_in_place`): only a cache whose buffers
    /// nothing else reads in the pass (a lone sequence's compiled step over
    /// a flat cache or a paged sequence's decode mirrors); `None`
    /// elsewhere. After such a write the layer calls
    /// [`ForwardCache::attend_written_rows`], not `attend`.
    fn kv_buffers(&mut self, _layer: usize) -> Option<(Array, Array)> {
        None
    }

    /// [`ForwardCache::attend_rows`] over buffers a kernel already wrote
    /// this call's K and V into ([`ForwardCache::kv_buffers`]).
    fn attend_written_rows(&mut self, _layer: usize, _q: &Array, _scale: f32) -> Result<Array> {
        Err(Error::invalid("this cache does not hand its K/V buffers to a kernel"))
    }

    /// Conv layer `layer`'s state before this call (`[B, keep, D]`; zeros
    /// before the first token).
    fn conv_state(&mut self, layer: usize, shape: ConvShape) -> Result<Array>;

    /// Conv layer `layer`'s padded input (`[B, keep + T, D]`, the old state
    /// first): the cache keeps the state after the call (the last `keep`
    /// rows) and whatever else it needs (snapshots at block ends).
    fn conv_update(&mut self, layer: usize, padded: &Array, keep: i32) -> Result<()>;

    /// Conv layer `layer`'s state after a one-token call (`[B, keep, D]`,
    /// what [`ForwardCache::conv_update`] keeps of that call's padded input),
    /// as the fused decode step writes it: a cache that keeps only the state
    /// takes it as it is, sparing the step a slice node a conv layer; one
    /// that needs the padded input (snapshots, a fresh pass's store) gets it
    /// back from `prev`, the state before the call.
    fn conv_step_update(&mut self, layer: usize, prev: &Array, next: &Array) -> Result<()> {
        let padded = padded_from_step(prev, next)?;
        self.conv_update(layer, &padded, next.dim(1))
    }
}

/// A one-token call's padded input `[prev; x]` from the state before it and
/// the state after it (`next` is `prev`'s last keep - 1 rows, then `x`).
pub fn padded_from_step(prev: &Array, next: &Array) -> Result<Array> {
    if prev.shape() != next.shape() || prev.ndim() != 3 || prev.dim(1) < 1 {
        return Err(Error::invalid(format!(
            "conv states before and after a step must both be [B, keep >= 1, D], got {:?} and {:?}",
            prev.shape(),
            next.shape()
        )));
    }
    concatenate(&[&prev.slice_axis(1, 0, 1)?, next], 1)
}
