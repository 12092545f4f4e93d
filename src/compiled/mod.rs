//! The compiled decode path: `mx::compile` over the model's own Rust decode
//! step ([`Lfm2Model::decode_step`], the same layers every other path runs),
//! through the bridge's compile of a callback. MLX traces the step once per
//! input shape signature (batch rows, cache capacity) and afterwards replays
//! the fused graph: one call per token, with the K/V buffers and conv states
//! passed in and returned so the graph is pure and MLX can update the
//! buffers in place.

use crate::cache::{DecodeBatch, LayerCache, ModelCache};
use crate::error::{Error, Result};
use crate::mlx::{self, Array, Dtype};
use crate::model::Lfm2Model;
use std::cell::Cell;
use std::rc::Rc;

mod positions;
pub mod prefill;
pub use prefill::CompiledPrefill;
use positions::Positions;

/// Decode batches of every size from 2 to 16 over caches up to 4k positions
/// stay traced; beyond, traces start over (see src/mlx/compile.rs).
pub const MAX_TRACES: usize = 256;

/// `mx::compile` over a function of one loaded model (the decode step, a
/// fresh prompt's pass). The model is reached through a slot set only while
/// a call runs: the trace reads the weights through it (and keeps them as
/// the graph's constants), so the traces serve only the model they were
/// built from.
pub(crate) struct ModelFn {
    f: mlx::Compiled,
    current: Rc<Cell<*const Lfm2Model>>,
    model_id: u64,
}

impl ModelFn {
    /// `what` names the function in errors; `max_traces` distinct input
    /// shapes are kept traced.
    pub(crate) fn new(
        model: &Lfm2Model,
        what: &'static str,
        max_traces: usize,
        body: impl Fn(&Lfm2Model, &[Array]) -> Result<Vec<Array>> + 'static,
    ) -> Result<ModelFn> {
        let current: Rc<Cell<*const Lfm2Model>> = Rc::new(Cell::new(std::ptr::null()));
        let seen = current.clone();
        let f = mlx::Compiled::bounded(
            move |ins| {
                let p = seen.get();
                if p.is_null() {
                    return Err(Error::mlx(format!("{what} was traced outside a call")));
                }
                // SAFETY: `p` is set only for the duration of `call`, from a
                // live `&Lfm2Model` that outlives the call.
                body(unsafe { &*p }, ins)
            },
            false,
            max_traces,
        )?;
        Ok(ModelFn { f, current, model_id: model.id })
    }

    pub(crate) fn call(&self, model: &Lfm2Model, ins: &[&Array]) -> Result<Vec<Array>> {
        if model.id != self.model_id {
            return Err(Error::invalid("this compiled function belongs to another model"));
        }
        // Cleared however the call ends (a panic unwinding through it too).
        struct Current<'a>(&'a Cell<*const Lfm2Model>);
        impl Drop for Current<'_> {
            fn drop(&mut self) {
                self.0.set(std::ptr::null());
            }
        }
        self.current.set(model);
        let _clear = Current(&self.current);
        self.f.call(ins)
    }

    pub(crate) fn traces(&self) -> usize {
        self.f.traces()
    }

    pub(crate) fn serves(&self, model: &Lfm2Model) -> bool {
        model.id == self.model_id
    }
}

static KV_IN_PLACE_STEPS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many lone steps took the step that writes the K/V buffers in place
/// ([`CompiledStep::step`]): the greedy test's evidence that its run did.
pub fn kv_in_place_steps() -> usize {
    KV_IN_PLACE_STEPS.load(std::sync::atomic::Ordering::Relaxed)
}

/// The compiled step of one loaded model. Not Send: it lives on the model's
/// worker thread, like every other MLX object of that model.
pub struct CompiledStep {
    f: ModelFn,
    /// The step that writes a lone sequence's K/V buffers in place (a flat
    /// cache's, or a paged sequence's decode mirrors: `MLX_LFM_KV_IN_PLACE`,
    /// src/kernels/qkv_fused.rs `kv_in_place`): its own traces, since a
    /// batch's rows take the other.
    f_kv: Option<ModelFn>,
    /// The compiled pass of a fresh prompt, where it is switched on
    /// ([`prefill`]).
    pub fresh: Option<CompiledPrefill>,
    /// A lone sequence's position each step, out of MLX's managed pool.
    positions: Positions,
}

impl CompiledStep {
    /// Builds the step and traces it once for a lone sequence at the first
    /// cache capacity (the shape the first decode step uses), so a model
    /// whose step cannot be built fails here, at load, not at its first
    /// token. Nothing is evaluated.
    pub fn new(model: &Lfm2Model) -> Result<CompiledStep> {
        let step = Self::build(model, MAX_TRACES, false)?;
        let c = &model.config;
        let cap = crate::cache::KV_STEP as i32;
        let mut ins = vec![mlx::zeros(&[1, 1], Dtype::Uint32)?, step.positions.at(0)?];
        for &attn in &c.attn_layers {
            if attn {
                for _ in 0..2 {
                    ins.push(mlx::zeros(&[1, model.local_kv_heads(), cap, c.head_dim as i32], model.dtype)?);
                }
            } else {
                ins.push(mlx::zeros(&[1, c.conv_kernel as i32 - 1, model.local_conv_dim()], model.dtype)?);
            }
        }
        step.run(model, &ins, true, false)?;
        if step.f_kv.is_some() {
            step.run(model, &ins, true, true)?;
        }
        let fresh = CompiledPrefill::for_model(model)?;
        Ok(CompiledStep { fresh, ..step })
    }

    /// `max_traces` distinct input shapes kept traced; `fail` makes every
    /// trace fail (tests of the eager fallback).
    pub(crate) fn build(model: &Lfm2Model, max_traces: usize, fail: bool) -> Result<CompiledStep> {
        let f = ModelFn::new(model, "the compiled decode step", max_traces, move |m, ins| {
            if fail {
                return Err(Error::mlx("compiled decode: failure injected by a test"));
            }
            m.decode_step(ins)
        })?;
        // (Where the q/k/v stage runs: on CUDA. Elsewhere its trace would
        // be the other one's, a second trace at load for nothing.)
        let f_kv = if crate::kernels::qkv_fused::kv_in_place() && crate::kernels::qkv_fused::enabled_here() {
            Some(ModelFn::new(model, "the compiled decode step writing K/V in place", max_traces, move |m, ins| {
                if fail {
                    return Err(Error::mlx("compiled decode: failure injected by a test"));
                }
                m.decode_step_writing_kv(ins)
            })?)
        } else {
            None
        };
        Ok(CompiledStep { f, f_kv, fresh: None, positions: Positions::default() })
    }

    /// Runs the step: compiled, or (`compiled = false`, to prove the
    /// compiled step exact) the same function called directly.
    /// (`kv_in_place`: the step that writes the K/V buffers itself,
    /// [`CompiledStep::f_kv`].)
    fn run(&self, model: &Lfm2Model, ins: &[Array], compiled: bool, kv_in_place: bool) -> Result<Vec<Array>> {
        if !compiled {
            return if kv_in_place { model.decode_step_writing_kv(ins) } else { model.decode_step(ins) };
        }
        let refs: Vec<&Array> = ins.iter().collect();
        match (&self.f_kv, kv_in_place) {
            (Some(f), true) => f.call(model, &refs),
            _ => self.f.call(model, &refs),
        }
    }

    /// Whether a lone sequence's step takes the step that writes the K/V
    /// buffers in place ([`CompiledStep::f_kv`]).
    pub fn writes_kv_in_place(&self) -> bool {
        self.f_kv.is_some()
    }

    /// Input shapes traced now.
    pub fn traces(&self) -> usize {
        self.f.traces()
    }

    /// One decode step for token `ids` (`[1, 1]`): returns logits `[1, V]`
    /// and advances `cache`. A flat cache passes its K/V buffers; a paged
    /// one its decode mirrors (the same shapes: one compiled function serves
    /// both).
    pub fn step(&self, model: &Lfm2Model, ids: &Array, cache: &mut ModelCache, compiled: bool) -> Result<Array> {
        let c = &model.config;
        cache.begin_decode_token()?;
        let pos = cache.pos;
        let mut ins: Vec<Array> = vec![ids.clone(), self.positions.at(pos)?];
        let kv_shape = [1, model.local_kv_heads(), 1, c.head_dim as i32];
        for lc in cache.layers.iter_mut() {
            match lc {
                LayerCache::Attention(kv) => {
                    let (k, v) = kv.buffers_for_step(pos, || mlx::zeros(&kv_shape, model.dtype))?;
                    ins.push(k);
                    ins.push(v);
                }
                LayerCache::Paged(i) => {
                    let seq = cache.paged.as_ref().ok_or_else(|| Error::invalid("paged layer without a paged sequence"))?;
                    let (k, v) = seq.view(*i).ok_or_else(|| Error::invalid("paged decode without its mirrors"))?;
                    ins.push(k.clone());
                    ins.push(v.clone());
                }
                LayerCache::Conv(s) => ins.push(match s {
                    Some(s) => s.clone(),
                    None => mlx::zeros(&[1, c.conv_kernel as i32 - 1, model.local_conv_dim()], model.dtype)?,
                }),
            }
        }
        let n = ins.len();
        // (Every attention layer's buffers this sequence's own: a flat
        // cache's, or a paged sequence's decode mirrors, gathered for it.)
        // The kernel's writes are no node MLX orders anything by: the
        // attention after it reads the buffers through q, and the step
        // hands them back as arrays evaluated after q (`depends`,
        // src/cache/batch.rs `attend_written`). Within one CUDA graph MLX
        // orders kernels only by their outputs, so whatever reads the
        // written row after the step is in a later evaluation: the next
        // step, a growth's concatenate, and a filled block's copy into the
        // pool, which src/generate `queue_tokens` evaluates after the token.
        let kv_in_place = self.f_kv.is_some();
        if kv_in_place {
            KV_IN_PLACE_STEPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        // The inputs are dropped and the cache's old buffers replaced
        // below, before anything is evaluated (the token is queued by the
        // caller), so MLX can update the buffers in place. The cache's state
        // is only replaced once the whole step is built.
        let outs = self.run(model, &ins, compiled, kv_in_place);
        drop(ins);
        let outs = outs?;
        if outs.len() != n - 1 {
            return Err(Error::mlx(format!("compiled decode returned {} arrays, expected {}", outs.len(), n - 1)));
        }
        let mut it = outs.into_iter();
        let logits = it.next().expect("checked above");
        for lc in cache.layers.iter_mut() {
            match lc {
                LayerCache::Attention(kv) => {
                    let (k, v) = (it.next().expect("checked above"), it.next().expect("checked above"));
                    kv.commit_step(k, v);
                }
                LayerCache::Paged(i) => {
                    let kv = (it.next().expect("checked above"), it.next().expect("checked above"));
                    cache.paged.as_mut().expect("checked above").set_view(*i, kv);
                }
                LayerCache::Conv(s) => *s = Some(it.next().expect("checked above")),
            }
        }
        cache.end_decode_token()?;
        Ok(logits)
    }

    /// One step for every row of `batch` (members in row order): `ids`
    /// `[B, 1]`, `positions` (int32 `[B]`) each row's position. Returns
    /// logits `[B, V]`; the batch holds the new state. The caches' own
    /// bookkeeping is the caller's (`reserve_token` before,
    /// `DecodeBatch::end_token` for each row after; see the scheduler).
    pub fn step_batch(&self, model: &Lfm2Model, ids: &Array, positions: &Array, batch: &mut DecodeBatch, compiled: bool) -> Result<Array> {
        let b = positions.size();
        if b != batch.len() || ids.dim(0) as usize != b {
            return Err(Error::invalid("batched decode: ids, positions and batch rows differ in number"));
        }
        let state = batch.take_state();
        let n = state.len();
        let mut ins: Vec<Array> = vec![ids.clone(), positions.clone()];
        ins.extend(state);
        // (A batch writes its rows' K/V by scatter: its buffers are the
        // batch's, and each row has its own position.)
        let outs = match self.run(model, &ins, compiled, false) {
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
        // The old buffers go before anything is evaluated, so MLX can
        // update them in place.
        drop(ins);
        let mut it = outs.into_iter();
        let logits = it.next().expect("checked above");
        batch.put_state(it.collect());
        Ok(logits)
    }
}

#[cfg(test)]
mod tests;
