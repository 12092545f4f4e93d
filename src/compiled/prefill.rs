//! A fresh prompt's pass compiled (opt-in, `MLX_LFM_COMPILED_PREFILL`):
//! `mx::compile` over the model's own layers ([`Lfm2Model::hidden_traced`]
//! over a [`FreshPass`]), traced once per length bucket, the prompt
//! right-padded to its bucket as [`crate::cache::PrefillRows`] pads a batch.
//!
//! Why: on CUDA a 512-token prompt of the dense models hands MLX about 416
//! primitives (session 16's `--prefill-ops`), each built op by op through
//! the bridge and then encoded, and the 350M's P=512 prefill runs at
//! 0.66-0.84x llama.cpp's while its GPU work is a fraction of its time. A
//! compiled pass is replayed (no op-by-op build) and MLX fuses its
//! elementwise chains (the gates, the residual adds) into single kernels.
//! Only for prompts that start a sequence (nothing cached, no prefix
//! taken), of 2 tokens or more, whose bucket fits the largest bucket and
//! the prefill chunk, on one device, and where no layer would read anything
//! back to the host for the bucket's rows (a MoE layer grouping many rows
//! by expert on the host: non-f32 experts on the CPU, or on CUDA experts
//! the grouped GEMM kernel does not serve; `Layer::traceable_prefill`). A
//! bucket whose trace fails anyway is reported once and takes the eager
//! pass from then on. Off until the H200's A/B times it.

use crate::cache::fresh::{store_fresh, FreshPass};
use crate::cache::{ModelCache, KV_STEP};
use crate::error::{Error, Result};
use crate::mlx::Array;
use crate::model::Lfm2Model;
use super::ModelFn;
use std::cell::{Cell, RefCell};
use std::collections::HashSet;

/// The smallest bucket: shorter prompts pad to it.
const MIN_BUCKET: usize = 16;

/// The largest prompt served from `MLX_LFM_COMPILED_PREFILL`: `1` for
/// 512, a number for that many tokens (rounded up to a power of two, at
/// most [`KV_STEP`] * 16), unset or `0` for none.
pub fn max_tokens() -> usize {
    match crate::knobs::var("MLX_LFM_COMPILED_PREFILL").as_deref().map(str::trim) {
        None | Some("") | Some("0") => 0,
        Some("1") => 512,
        Some(v) => v.parse::<usize>().map(|n| n.clamp(MIN_BUCKET, KV_STEP * 16).next_power_of_two()).unwrap_or(0),
    }
}

/// The padded length a prompt of `n` tokens runs at: powers of two from
/// [`MIN_BUCKET`], so a few traces serve every length.
pub fn bucket(n: usize, max: usize) -> Option<usize> {
    (n >= 1 && n <= max).then(|| n.next_power_of_two().max(MIN_BUCKET).min(max))
}

/// The compiled fresh-prompt pass of one loaded model (on its worker
/// thread, like the compiled step that holds it).
pub struct CompiledPrefill {
    f: ModelFn,
    max: usize,
    /// Buckets whose trace failed: the eager pass serves them from then on.
    failed: RefCell<HashSet<usize>>,
    /// Prompts prefilled here.
    runs: Cell<usize>,
}

impl CompiledPrefill {
    /// None where the switch is off or the model is not served (see the
    /// module note).
    pub fn for_model(model: &Lfm2Model) -> Result<Option<CompiledPrefill>> {
        Self::build(model, max_tokens(), false)
    }

    /// For buckets up to `max` tokens; `fail` makes every trace fail (the
    /// fallback's test).
    pub(crate) fn build(model: &Lfm2Model, max: usize, fail: bool) -> Result<Option<CompiledPrefill>> {
        if max == 0 || model.world_size() > 1 {
            return Ok(None);
        }
        // (One trace a bucket: a handful; bounded so `traces` counts them.)
        let f = ModelFn::new(model, "the compiled prefill", 64, move |m, ins| {
            if fail {
                return Err(Error::mlx("compiled prefill: failure injected by a test"));
            }
            fresh_pass(m, &ins[0])
        })?;
        Ok(Some(CompiledPrefill { f, max, failed: RefCell::new(HashSet::new()), runs: Cell::new(0) }))
    }

    /// Whether this prompt of `n` tokens over `cache` runs here.
    pub fn serves(&self, model: &Lfm2Model, cache: &ModelCache, n: usize, chunk: usize) -> bool {
        // (One token is a decode-shaped pass: a paged cache writes it
        // through its decode mirrors, not the pool.)
        let Some(t) = bucket(n, self.max).filter(|&t| n >= 2 && t <= chunk) else { return false };
        let d = model.config.hidden_size as i32;
        self.f.serves(model)
            && cache.pos == 0
            && !self.failed.borrow().contains(&t)
            && crate::cache::batch::stackable(cache)
            && model.layers.iter().all(|l| l.traceable_prefill(t as i32, d, model.dtype))
    }

    /// Prefills `prompt` into the fresh `cache`: the last position's logits
    /// `[1, V]` (lazy). `Ok(None)` where the compiled pass could not be
    /// built (reported once; its bucket stays off from then on): nothing
    /// was written and the caller runs the eager pass.
    pub fn run(&self, model: &Lfm2Model, cache: &mut ModelCache, prompt: &[u32]) -> Result<Option<Array>> {
        let (t, ids) = self.padded(prompt)?;
        let outs = match self.f.call(model, &[&ids]) {
            Ok(o) if !o.is_empty() => o,
            Ok(_) => return Ok(self.fail(t, Error::mlx("the compiled prefill returned nothing"))),
            Err(e) => return Ok(self.fail(t, e)),
        };
        let last = store(model, cache, prompt, outs)?;
        self.runs.set(self.runs.get() + 1);
        Ok(Some(last))
    }

    /// What [`Self::run`] computes, over the same padded rows, op by op
    /// (not compiled, not counted): a GPU test's reference with the
    /// compiled pass's row count, where MLX may pick other kernels for the
    /// bucket's rows than for the prompt's own (a 5-token prompt pads to 16).
    #[cfg(test)]
    pub(crate) fn run_uncompiled(&self, model: &Lfm2Model, cache: &mut ModelCache, prompt: &[u32]) -> Result<Array> {
        let (_, ids) = self.padded(prompt)?;
        let outs = fresh_pass(model, &ids)?;
        store(model, cache, prompt, outs)
    }

    /// The prompt's bucket and its ids padded to it `[1, bucket]`.
    fn padded(&self, prompt: &[u32]) -> Result<(usize, Array)> {
        let n = prompt.len();
        let t = bucket(n, self.max).ok_or_else(|| Error::invalid(format!("a prompt of {n} tokens has no bucket")))?;
        let mut ids = prompt.to_vec();
        // (Padding with token 0, a valid id: it follows the prompt, so no
        // real position sees it.)
        ids.resize(t, 0);
        Ok((t, Array::from_slice(&ids, &[1, t as i32])?))
    }

    fn fail(&self, bucket: usize, e: Error) -> Option<Array> {
        if self.failed.borrow_mut().insert(bucket) {
            eprintln!(
                "mlx-lfm: the compiled prefill failed for prompts padded to {bucket} tokens ({}); they take the eager pass from now on",
                e.message
            );
        }
        None
    }

    /// Prompts prefilled here so far.
    pub fn runs(&self) -> usize {
        self.runs.get()
    }

    /// Length buckets traced now.
    pub fn traces(&self) -> usize {
        self.f.traces()
    }
}

/// The function each bucket traces: the padded rows' hidden states, then
/// what each layer keeps for the cache ([`FreshPass`]'s order).
fn fresh_pass(m: &Lfm2Model, ids: &Array) -> Result<Vec<Array>> {
    let mut pass = FreshPass::default();
    let h = m.hidden_traced(ids, &mut pass)?;
    let mut out = vec![h];
    out.extend(pass.stored);
    Ok(out)
}

/// Writes a fresh pass's outputs `outs` (from [`fresh_pass`]) for the
/// prompt's `n` real rows into `cache`: the last row's logits `[1, V]`.
fn store(model: &Lfm2Model, cache: &mut ModelCache, prompt: &[u32], mut outs: Vec<Array>) -> Result<Array> {
    let n = prompt.len();
    if outs.is_empty() {
        return Err(Error::mlx("the prefill pass returned nothing"));
    }
    let h = outs.remove(0);
    let stored = outs;
    let keep = model.config.conv_kernel as i32 - 1;
    let pass = cache.pass(n)?;
    store_fresh(pass, &model.config.attn_layers, stored, n, keep)?;
    cache.note_tokens(prompt);
    let last = h.slice_axis(1, n as i32 - 1, n as i32)?;
    model.head(&last)?.reshape(&[1, -1])
}
