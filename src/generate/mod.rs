//! Generation: chunked prefill, a decode loop that keeps the device busy
//! (step t+1 is queued before token t is read back, as mlx-lm does),
//! sampling, stop conditions and honest timing.

pub mod constraint;
pub mod sampler;
pub mod stop;
pub mod timing;

use crate::compiled::CompiledStep;
use crate::error::{Error, Result};
use crate::mlx::{async_eval, Array};
use crate::model::{Lfm2Model, ModelCache};
use crate::text::{StreamDecoder, Tokenizer};
use constraint::{Constraint, Guide, ToolWatch};
use sampler::{Sampler, SamplingParams};
use std::collections::HashSet;
use std::time::Instant;
use stop::StopStrings;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// maxTokens reached.
    Length,
    /// The caller cancelled.
    Abort,
    /// The constraint (schema, grammar) allowed no further token, or the
    /// parser failed: the output is incomplete.
    Constraint,
}

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Constraint => "constraint",
        }
    }
}

#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (benchmarks, parity tests).
    pub ignore_eos: bool,
    pub prefill_chunk: usize,
    /// A request whose prompt is longer fails before any compute (a
    /// server's bound on what one request may cost, below the context).
    pub max_prompt_tokens: Option<usize>,
    /// What the output must match (compiled into a [`constraint::Constraint`]
    /// before any compute).
    pub grammar: Option<constraint::Grammar>,
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 256,
            sampling: SamplingParams::default(),
            stop: vec![],
            ignore_eos: false,
            prefill_chunk: 2048,
            max_prompt_tokens: None,
            grammar: None,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct Metrics {
    pub ttft_ms: f64,
    /// Prompt tokens actually run (a prefix-cache hit's tokens excluded).
    pub prefill_tokens: usize,
    /// Prompt tokens taken from the prefix cache instead of being run.
    pub cached_tokens: usize,
    pub prefill_ms: f64,
    pub prefill_tokens_per_second: f64,
    pub decode_tokens: usize,
    pub decode_ms: f64,
    pub decode_tokens_per_second: f64,
    pub total_ms: f64,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub text: String,
    /// Completion token ids (end-of-sequence token excluded).
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    pub prompt_tokens: usize,
    /// Tokens the model produced, including a final end-of-sequence token.
    pub completion_tokens: usize,
    pub metrics: Metrics,
    /// One entry per completion token (when `logprobs` was asked for).
    pub logprobs: Option<Vec<TokenLogprob>>,
}

/// A generated token's log-probability (see `sampler` for which
/// distribution) and the most likely alternatives at its step.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    /// The token alone, decoded (special tokens spelled out; a token that
    /// holds part of a character shows U+FFFD).
    pub text: String,
    pub logprob: f32,
    /// Most likely first.
    pub top: Vec<(u32, String, f32)>,
}

/// What a caller hears during generation; returning false cancels.
pub trait Observer {
    fn on_text(&mut self, _delta: &str) -> bool {
        true
    }
    /// A completion token's log-probabilities (when asked for), heard
    /// before the text it adds.
    fn on_logprob(&mut self, _entry: &TokenLogprob) {}
    /// Polled between steps (prefill chunks and decode steps).
    fn cancelled(&mut self) -> bool {
        false
    }
    /// Called once the generation is over, before its result is delivered.
    fn finished(&mut self) {}
}

pub struct NoObserver;
impl Observer for NoObserver {}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Runs `prompt` through the model in chunks; returns the last position's
/// logits (`[1, V]`), lazily. Intermediate chunks are evaluated so memory
/// stays bounded by one chunk's activations.
pub fn prefill(model: &Lfm2Model, cache: &mut ModelCache, prompt: &[u32], chunk: usize) -> Result<Array> {
    match prefill_observed(model, cache, prompt, chunk, &mut NoObserver)? {
        Prefill::Done(logits) => Ok(logits),
        Prefill::Cancelled { .. } => Err(Error::invalid("prefill was cancelled")),
    }
}

/// How a cancellable prefill ended.
pub enum Prefill {
    /// The last position's logits (`[1, V]`), lazy.
    Done(Array),
    /// `observer.cancelled()` said stop before this many tokens had run.
    Cancelled { tokens_run: usize },
}

/// [`prefill`] that asks `observer.cancelled()` before every chunk (so an
/// abort during a long prompt stops within one chunk). A cancelled prefill
/// leaves `cache` partly filled; callers drop it.
pub fn prefill_observed(
    model: &Lfm2Model,
    cache: &mut ModelCache,
    prompt: &[u32],
    chunk: usize,
    observer: &mut dyn Observer,
) -> Result<Prefill> {
    let mut run = PrefillRun::new(model, cache, prompt, chunk)?;
    loop {
        if observer.cancelled() {
            return Ok(Prefill::Cancelled { tokens_run: run.tokens_run() });
        }
        if let Some(logits) = run.step(model, cache, prompt)? {
            return Ok(Prefill::Done(logits));
        }
    }
}

/// A prompt prefilled one chunk at a time (so a scheduler can run decode
/// steps of other requests in between).
pub struct PrefillRun {
    start: usize,
    cached: usize,
    chunk: usize,
}

impl PrefillRun {
    /// Checks the prompt's ids, then attaches the longest cached prefix
    /// (paged caches; at least one token is always left to run, for the
    /// logits).
    pub fn new(model: &Lfm2Model, cache: &mut ModelCache, prompt: &[u32], chunk: usize) -> Result<PrefillRun> {
        if prompt.is_empty() {
            return Err(Error::invalid("the prompt has no tokens"));
        }
        model.check_token_ids(prompt)?;
        // A cache restored from a saved session already holds a prefix of
        // the prompt (the caller checked which).
        let cached = if cache.restored > 0 && cache.pos == cache.restored && cache.pos < prompt.len() {
            cache.pos
        } else {
            cache.attach_prefix(prompt)?
        };
        Ok(PrefillRun { start: cached, cached, chunk: chunk.max(1) })
    }

    pub fn tokens_run(&self) -> usize {
        self.start - self.cached
    }

    /// Runs the next chunk; the last position's logits (`[1, V]`, lazy)
    /// once the whole prompt has run. Intermediate chunks are evaluated so
    /// memory stays bounded by one chunk's activations.
    pub fn step(&mut self, model: &Lfm2Model, cache: &mut ModelCache, prompt: &[u32]) -> Result<Option<Array>> {
        self.step_with(model, None, cache, prompt)
    }

    /// [`PrefillRun::step`], a whole fresh prompt through `compiled`'s
    /// compiled pass where it serves it (`MLX_LFM_COMPILED_PREFILL`).
    pub fn step_with(
        &mut self,
        model: &Lfm2Model,
        compiled: Option<&CompiledStep>,
        cache: &mut ModelCache,
        prompt: &[u32],
    ) -> Result<Option<Array>> {
        let fresh = compiled.and_then(|c| c.fresh.as_ref());
        if let Some(f) = fresh.filter(|f| self.start == 0 && f.serves(model, cache, prompt.len(), self.chunk)) {
            if let Some(logits) = f.run(model, cache, prompt)? {
                self.start = prompt.len();
                return Ok(Some(logits));
            }
        }
        let (start, end) = (self.start, (self.start + self.chunk).min(prompt.len()));
        let ids = Array::from_slice(&prompt[start..end], &[1, (end - start) as i32])?;
        if end == prompt.len() {
            let logits = model.forward(&ids, cache, true)?;
            cache.note_tokens(&prompt[start..end]);
            self.start = end;
            return Ok(Some(logits.reshape(&[1, -1])?));
        }
        model.forward_hidden(&ids, cache)?;
        cache.eval_state()?;
        cache.note_tokens(&prompt[start..end]);
        self.start = end;
        Ok(None)
    }
}

/// Runs decode steps on the compiled path while it works; the first failure
/// is kept (for the caller to report once) and the rest of the request, and
/// every later step, runs eager.
pub struct Stepper<'a> {
    pub model: &'a Lfm2Model,
    compiled: Option<&'a CompiledStep>,
    pub failure: Option<Error>,
}

impl<'a> Stepper<'a> {
    pub fn new(model: &'a Lfm2Model, compiled: Option<&'a CompiledStep>) -> Self {
        Stepper { model, compiled, failure: None }
    }

    /// Logits `[1, V]` for one token `ids` (`[1, 1]`), advancing `cache`.
    pub fn step(&mut self, ids: &Array, cache: &mut ModelCache) -> Result<Array> {
        let t = Instant::now();
        let r = self.step_inner(ids, cache);
        timing::build(t);
        r
    }

    fn step_inner(&mut self, ids: &Array, cache: &mut ModelCache) -> Result<Array> {
        if let Some(c) = self.compiled {
            let pos = cache.pos;
            match c.step(self.model, ids, cache, true) {
                Ok(l) => return Ok(l),
                // The step failed after the cache took the token (its paged
                // bookkeeping): running it again eagerly would store it twice.
                Err(e) if cache.pos != pos => return Err(e),
                Err(e) => {
                    self.failure = Some(e);
                    self.compiled = None;
                }
            }
        }
        self.model.forward(ids, cache, true)?.reshape(&[1, -1])
    }
}

/// The primitives one single-sequence greedy decode step hands MLX, by
/// name, most frequent first (see [`crate::mlx::graph_ops`]): the step
/// (compiled when `compiled` is given), the draw and its finiteness flag,
/// the cache's new state, after a prefill of `prompt` and two steps (the
/// first step after a prefill builds what later ones reuse, such as a paged
/// cache's decode mirrors gathered from its pool: 4 more nodes a K or V
/// buffer, counted until session 13). Each is encoded and launched by the
/// host one at a time, and on CUDA that host work is what bounds the decode
/// rate (`timing`), so their count is the step's cost.
pub fn decode_step_ops(model: &Lfm2Model, compiled: Option<&CompiledStep>, prompt: &[u32]) -> Result<Vec<(String, usize)>> {
    let mut cache = model.new_cache();
    let logits = prefill(model, &mut cache, prompt, prompt.len().max(1))?;
    let mut sampler = Sampler::new(SamplingParams::default(), prompt)?;
    let token = sampler.sample(&logits)?;
    crate::mlx::eval(&[&token])?;
    cache.eval_state()?;
    let mut stepper = Stepper::new(model, compiled);
    // One step from `token`, run and evaluated: its draw, and with `count`
    // the primitives of its graph.
    let mut step = |token: &Array, count: bool| -> Result<(Array, Vec<(String, usize)>)> {
        let l = stepper.step(&token.reshape(&[1, 1])?, &mut cache)?;
        if let Some(e) = stepper.failure.take() {
            return Err(e);
        }
        // (As `Sequence::draw` draws: the fused kernel where it serves.)
        let fused = if sampler.is_greedy() { crate::kernels::argmax_finite::argmax_finite(&l)? } else { None };
        let (next, finite) = match fused {
            Some(pair) => pair,
            None => (sampler.sample(&l)?, sampler::finite_rows(&l)?),
        };
        let fresh = cache.take_fresh();
        let mut outs: Vec<&Array> = vec![&next, &finite];
        outs.extend(fresh.iter());
        outs.extend(cache.arrays());
        let ops = if count { crate::mlx::graph_ops(&outs)? } else { vec![] };
        // (The token's graph first, as `queue_tokens` queues it: a block's
        // copy into the pool must not share a graph with a step that wrote
        // its rows in place.)
        crate::mlx::eval(&[&next, &finite])?;
        crate::mlx::eval(&outs)?;
        drop(outs);
        Ok((next, ops))
    };
    let (token, _) = step(&token, false)?;
    let (token, _) = step(&token, false)?;
    Ok(step(&token, true)?.1)
}

/// Generates a completion for `prompt` on a fresh cache (`guide`: for a
/// request with a grammar).
#[allow(clippy::too_many_arguments)]
pub fn generate(
    stepper: &mut Stepper,
    guide: Option<&Guide>,
    tokenizer: &Tokenizer,
    eos: &HashSet<u32>,
    prompt: &[u32],
    params: &GenerateParams,
    observer: &mut dyn Observer,
    started: Instant,
) -> Result<Generation> {
    let mut cache = stepper.model.new_cache();
    generate_with_cache(stepper, guide, &mut cache, tokenizer, eos, prompt, params, observer, started)
}

#[allow(clippy::too_many_arguments)]
pub fn generate_with_cache(
    stepper: &mut Stepper,
    guide: Option<&Guide>,
    cache: &mut ModelCache,
    tokenizer: &Tokenizer,
    eos: &HashSet<u32>,
    prompt: &[u32],
    params: &GenerateParams,
    observer: &mut dyn Observer,
    started: Instant,
) -> Result<Generation> {
    let owned = std::mem::replace(cache, ModelCache::new(&[]));
    let mut seq = match Sequence::start(stepper.model, stepper.compiled, guide, owned, tokenizer, prompt, params, observer, started)? {
        Started::Running(s) => s,
        Started::Finished(g, c) => {
            *cache = c;
            return Ok(g);
        }
    };
    let mut go = seq.deliver_first(eos, observer)?;
    while go {
        // Queue the next step before reading this token back.
        let next = if seq.wants_next() {
            let ids = seq.y.reshape(&[1, 1])?;
            let l = stepper.step(&ids, &mut seq.cache)?;
            Some(seq.sample(&l)?)
        } else {
            None
        };
        go = seq.accept(next, eos, observer)?;
    }
    let (g, c) = seq.finish(observer)?;
    *cache = c;
    Ok(g)
}

/// A request whose prompt is being prefilled, a chunk per
/// [`Pending::advance`].
pub struct Pending {
    cache: ModelCache,
    run: PrefillRun,
    prompt: Vec<u32>,
    sampler: Sampler,
    constraint: Option<Constraint>,
    watch: Option<ToolWatch>,
    params: GenerateParams,
    started: Instant,
    prefill_start: Instant,
}

/// What one [`Pending::advance`] left.
pub enum Advance {
    More(Pending),
    Done(Started),
}

impl Pending {
    /// `guide`: the model's vocabulary for a request with a grammar
    /// (compiled here, before any compute).
    pub fn new(
        model: &Lfm2Model,
        guide: Option<&Guide>,
        mut cache: ModelCache,
        prompt: Vec<u32>,
        params: &GenerateParams,
        started: Instant,
    ) -> Result<Pending> {
        if params.max_tokens == 0 {
            return Err(Error::invalid("maxTokens must be at least 1"));
        }
        // Checked before any compute: positions past the context would run
        // (RoPE does not stop there) but mean nothing.
        if let Some(max) = params.max_prompt_tokens.filter(|&m| prompt.len() > m) {
            return Err(Error::invalid(format!(
                "the prompt has {} tokens, more than maxPromptTokens ({max}); shorten the prompt",
                prompt.len()
            )));
        }
        let ctx = model.context_length;
        if prompt.len().saturating_add(params.max_tokens) > ctx {
            return Err(Error::invalid(format!(
                "the prompt has {} tokens and asks for up to {} more, beyond the model's context length of {ctx} \
                 tokens; shorten the prompt or lower maxTokens",
                prompt.len(),
                params.max_tokens
            )));
        }
        let prefill_start = Instant::now();
        let run = PrefillRun::new(model, &mut cache, &prompt, params.prefill_chunk)?;
        params.sampling.validate_vocab(model.config.vocab_size)?;
        let sampler = Sampler::new(params.sampling.clone(), &prompt)?;
        let (mut constraint, mut watch) = (None, None);
        match (&params.grammar, guide) {
            (None, _) => {}
            (Some(g @ constraint::Grammar::ToolCallsAuto { .. }), Some(guide)) => watch = Some(ToolWatch::new(guide, g)?),
            (Some(g), Some(guide)) => constraint = Some(Constraint::compile(guide, g)?),
            (Some(g), None) => return Err(Error::invalid(format!("{} is not available on this path", g.option_name()))),
        }
        Ok(Pending { cache, run, prompt, sampler, constraint, watch, params: params.clone(), started, prefill_start })
    }

    /// Runs the next prefill chunk (after asking `observer` whether to go
    /// on); after the last one, samples the first token.
    /// `compiled`: the model's compiled path, whose compiled prefill (where
    /// switched on) takes a whole fresh prompt.
    pub fn advance(
        mut self,
        model: &Lfm2Model,
        compiled: Option<&CompiledStep>,
        tokenizer: &Tokenizer,
        observer: &mut dyn Observer,
    ) -> Result<Advance> {
        if observer.cancelled() {
            let mut g = cancelled_in_prefill(self.prompt.len(), self.run.tokens_run(), self.prefill_start, self.started);
            g.metrics.cached_tokens = self.cache.cached_tokens();
            return Ok(Advance::Done(Started::Finished(g, self.cache)));
        }
        let Some(logits) = self.run.step_with(model, compiled, &mut self.cache, &self.prompt)? else {
            return Ok(Advance::More(self));
        };
        Ok(Advance::Done(self.into_running(&logits, tokenizer)?))
    }

    /// The whole prompt when this request can be prefilled in a batch with
    /// others (`prefill_together`): nothing run yet, nothing taken from the
    /// prefix cache, the prompt within one chunk, full-precision KV.
    pub fn batchable_prompt(&self) -> Option<&[u32]> {
        let fresh = self.run.start == 0 && self.run.cached == 0 && self.prompt.len() <= self.run.chunk;
        (fresh && crate::cache::batch::stackable(&self.cache)).then_some(self.prompt.as_slice())
    }

    /// Takes the paged blocks the whole prompt needs now (before a batched
    /// prefill, so a request the pool cannot hold fails alone).
    pub fn reserve_prompt(&mut self) -> Result<()> {
        let pos = self.cache.pos;
        match self.cache.paged.as_mut() {
            Some(seq) => seq.reserve(pos, self.prompt.len() - pos),
            None => Ok(()),
        }
    }

    /// Samples the first token from the prompt's last logits (`[1, V]`).
    fn into_running(self, logits: &Array, tokenizer: &Tokenizer) -> Result<Started> {
        let cached_tokens = self.cache.cached_tokens();
        let mut cache = self.cache;
        let mut sampler = self.sampler;
        let mut constraint = self.constraint;
        let mut watch = self.watch;
        let y = match (constraint.as_mut(), watch.as_mut()) {
            (Some(c), _) => {
                let mask = c.mask()?.ok_or_else(|| Error::invalid("the constraint allows no first token"))?;
                sampler.draw_processed(&Constraint::apply(&sampler.process(logits)?, &mask)?)?
            }
            (None, Some(w)) => {
                let l = sampler.process(logits)?;
                w.stash = Some(l.clone());
                sampler.draw_processed(&l)?
            }
            (None, None) => sampler.sample(logits)?,
        };
        let finite = sampler::finite_rows(logits)?;
        let lp = sampler.take_logprobs();
        let mut queued = vec![&y, &finite];
        queued.extend(lp.iter().flat_map(|l| l.arrays()));
        queue_tokens(&queued, &mut [&mut cache])?;
        let params = self.params;
        Ok(Started::Running(Sequence {
            cache,
            y,
            y_finite: Some(finite),
            next_finite: None,
            y_logprobs: lp,
            next_logprobs: None,
            logprobs: params.sampling.logprobs.then(Vec::new),
            tokenizer: tokenizer.clone(),
            sampler,
            constraint,
            watch,
            stops: StopStrings::new(&params.stop),
            decoder: StreamDecoder::new(tokenizer, false),
            text: String::new(),
            streamed: 0,
            tokens: vec![],
            completion_tokens: 0,
            finish: FinishReason::Length,
            hit_stop_string: false,
            prompt_len: self.prompt.len(),
            cached_tokens,
            max_tokens: params.max_tokens,
            ignore_eos: params.ignore_eos,
            started: self.started,
            prefill_start: self.prefill_start,
            first_token_at: None,
            last_token_at: None,
            delivered: None,
        }))
    }
}

/// Prefills requests together (each [`Pending::batchable_prompt`]) in one
/// right-padded forward ([`Lfm2Model::prefill_rows`]) and samples each
/// one's first token.
pub fn prefill_together(model: &Lfm2Model, tokenizer: &Tokenizer, mut ps: Vec<Pending>) -> Result<Vec<Started>> {
    let prompts: Vec<Vec<u32>> = ps
        .iter()
        .map(|p| p.batchable_prompt().map(|x| x.to_vec()).ok_or_else(|| Error::invalid("request cannot be prefilled in a batch")))
        .collect::<Result<_>>()?;
    let ids: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let mut caches: Vec<&mut ModelCache> = ps.iter_mut().map(|p| &mut p.cache).collect();
    let logits = model.prefill_rows(&ids, &mut caches)?;
    drop(caches);
    ps.into_iter()
        .enumerate()
        .map(|(i, mut p)| {
            p.cache.note_tokens(&prompts[i]);
            p.run.start = prompts[i].len();
            p.into_running(&logits.slice_axis(0, i as i32, i as i32 + 1)?, tokenizer)
        })
        .collect()
}

/// How [`Sequence::start`] ended.
pub enum Started {
    /// Prefill done, the first token sampled (not yet read back).
    Running(Sequence),
    /// Cancelled during prefill: the result, and the cache.
    Finished(Generation, ModelCache),
}

/// One request's generation as a state machine, so a single request
/// ([`generate_with_cache`]) and a batch of them (the engine's continuous
/// batching) share the same sampling, stop and streaming logic.
pub struct Sequence {
    pub cache: ModelCache,
    /// The sampled token not yet read back.
    pub y: Array,
    /// Whether the logits `y` was drawn from were all finite (1) or not (0).
    y_finite: Option<Array>,
    /// The same for the token of the step queued after `y`.
    next_finite: Option<Array>,
    /// The log-probabilities of `y`'s draw, and of the next (when asked for).
    y_logprobs: Option<sampler::LogprobArrays>,
    next_logprobs: Option<sampler::LogprobArrays>,
    logprobs: Option<Vec<TokenLogprob>>,
    /// For the text of log-probability entries.
    tokenizer: Tokenizer,
    sampler: Sampler,
    /// With a grammar: the step's token is drawn in `accept`, once the
    /// token before it is read back and the parser has computed the mask
    /// (while the device runs the step's forward); the step hands over its
    /// processed logits instead of a token.
    constraint: Option<Constraint>,
    /// `toolChoice: 'auto'`: starts a constraint at a tool call's start marker.
    watch: Option<ToolWatch>,
    stops: StopStrings,
    decoder: StreamDecoder,
    text: String,
    streamed: usize,
    tokens: Vec<u32>,
    completion_tokens: usize,
    finish: FinishReason,
    hit_stop_string: bool,
    prompt_len: usize,
    cached_tokens: usize,
    max_tokens: usize,
    ignore_eos: bool,
    started: Instant,
    prefill_start: Instant,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    /// The pending token, already read and handed over by
    /// [`Sequence::deliver_first`].
    delivered: Option<Delivered>,
}

/// What [`Sequence::deliver`] made of the pending token, for
/// [`Sequence::accept`] to finish once a step may have been queued after it.
struct Delivered {
    tok: u32,
    /// The generation goes on (`finish` says why not).
    go: bool,
    /// The constraint is whole after this token.
    complete: bool,
    /// The token opened an 'auto' tool call.
    opened: bool,
}

impl Sequence {
    /// Prefills `prompt` into `cache` and samples the first token.
    #[allow(clippy::too_many_arguments)]
    pub fn start(
        model: &Lfm2Model,
        compiled: Option<&CompiledStep>,
        guide: Option<&Guide>,
        cache: ModelCache,
        tokenizer: &Tokenizer,
        prompt: &[u32],
        params: &GenerateParams,
        observer: &mut dyn Observer,
        started: Instant,
    ) -> Result<Started> {
        let mut p = Pending::new(model, guide, cache, prompt.to_vec(), params, started)?;
        loop {
            match p.advance(model, compiled, tokenizer, observer)? {
                Advance::More(next) => p = next,
                Advance::Done(s) => return Ok(s),
            }
        }
    }

    /// Whether a step after the pending token is needed.
    pub fn wants_next(&self) -> bool {
        let pending = usize::from(self.delivered.is_none());
        self.completion_tokens + pending < self.max_tokens
    }

    /// Samples the next token from `logits` (`[1, V]`) and queues it with
    /// whatever the cache built alongside.
    pub fn sample(&mut self, logits: &Array) -> Result<Array> {
        let t = Instant::now();
        let n = self.draw(logits)?;
        let extras = self.pending_extras();
        let mut queued = vec![&n];
        queued.extend(extras.iter());
        timing::build(t);
        dispatch_step(&queued, &mut [&mut self.cache], &timing::SINGLE)?;
        Ok(n)
    }

    /// [`Sequence::sample`] without queueing the work: a batch queues all
    /// its rows' tokens at once (see [`queue_tokens`]), with
    /// [`Sequence::pending_extras`].
    pub fn draw(&mut self, logits: &Array) -> Result<Array> {
        if self.is_greedy() {
            // The argmax and the finiteness flag in one kernel where it
            // serves (CUDA, opt-in): plain greedy has no logprobs, window
            // or key to keep.
            if let Some((token, finite)) = crate::kernels::argmax_finite::argmax_finite(logits)? {
                self.next_finite = Some(finite);
                self.next_logprobs = None;
                return Ok(token);
            }
        }
        self.next_finite = Some(sampler::finite_rows(logits)?);
        if self.constraint.is_some() {
            // Drawn in `accept` (see `constraint`): the forward runs now.
            return self.sampler.process(logits);
        }
        if let Some(w) = self.watch.as_mut() {
            let l = self.sampler.process(logits)?;
            w.stash = Some(l.clone());
            let n = self.sampler.draw_processed(&l)?;
            self.next_logprobs = self.sampler.take_logprobs();
            return Ok(n);
        }
        let n = self.sampler.sample(logits)?;
        self.next_logprobs = self.sampler.take_logprobs();
        Ok(n)
    }

    /// For a token drawn outside [`Sequence::draw`] (a batch's shared
    /// argmax): whether its logits were finite (`[1]`, see
    /// `sampler::finite_rows`).
    pub fn set_finite(&mut self, finite: Array) {
        self.next_finite = Some(finite);
    }

    /// What was computed with the token just drawn and is read with it
    /// (its finiteness flag, its log-probabilities), to queue with it.
    pub fn pending_extras(&self) -> Vec<Array> {
        let mut v: Vec<Array> = self.next_finite.iter().cloned().collect();
        v.extend(self.next_logprobs.iter().flat_map(|l| l.arrays()).cloned());
        v
    }

    pub fn is_greedy(&self) -> bool {
        self.sampler.is_greedy() && self.constraint.is_none() && self.watch.is_none()
    }

    /// The read and the delivery of the pending token: what needs no step after it.
    fn deliver(&mut self, eos: &HashSet<u32>, observer: &mut dyn Observer) -> Result<Delivered> {
        let t = Instant::now();
        let tok: u32 = self.y.item()?;
        if self.completion_tokens > 0 {
            // (The first token's wait is the prefill's.)
            timing::wait(t);
        }
        if let Some(f) = self.y_finite.take() {
            if f.item::<u32>()? == 0 {
                return Err(Error::mlx(format!(
                    "the model produced non-finite logits (NaN or infinity) at generation step {}: its weights or \
                     the computation are broken",
                    self.completion_tokens + 1
                )));
            }
        }
        let stop = Delivered { tok, go: false, complete: false, opened: false };
        let now = Instant::now();
        self.first_token_at.get_or_insert(now);
        self.last_token_at = Some(now);
        self.completion_tokens += 1;
        if !self.ignore_eos && eos.contains(&tok) {
            self.finish = FinishReason::Stop;
            return Ok(stop);
        }
        let mut complete = false;
        if let Some(c) = self.constraint.as_mut() {
            if c.commit(tok).is_err() {
                self.finish = FinishReason::Constraint;
                return Ok(stop);
            }
            complete = c.is_done();
        }
        // 'auto' tools: the model opened a call; the token drawn after the
        // marker (freely, already queued) is drawn again under the call's grammar.
        let opened = self.constraint.is_none() && self.watch.as_ref().is_some_and(|w| w.start == tok);
        self.tokens.push(tok);
        if let Some(lp) = self.y_logprobs.take() {
            let entry = self.logprob_entry(tok, &lp)?;
            observer.on_logprob(&entry);
            if let Some(all) = self.logprobs.as_mut() {
                all.push(entry);
            }
        }
        let piece = self.decoder.push(tok)?;
        self.text.push_str(&piece);
        if let Some(at) = self.stops.find(&self.text) {
            self.text.truncate(at);
            self.finish = FinishReason::Stop;
            self.hit_stop_string = true;
            return Ok(stop);
        }
        let safe = self.stops.safe_len(&self.text);
        if safe > self.streamed {
            let go_on = observer.on_text(&self.text[self.streamed..safe]);
            self.streamed = safe; // delivered either way
            if !go_on {
                self.finish = FinishReason::Abort;
                return Ok(stop);
            }
        }
        if observer.cancelled() {
            self.finish = FinishReason::Abort;
            return Ok(stop);
        }
        Ok(Delivered { tok, go: true, complete, opened })
    }

    /// Reads the pending token back and hands it to `observer` before any
    /// step is queued after it, so the time to the first token (and the
    /// prefill figure) holds the prompt's work alone, not the host's build
    /// of the next step. Returns whether the generation goes on; either
    /// way [`Sequence::accept`] finishes the token (then with no read).
    pub fn deliver_first(&mut self, eos: &HashSet<u32>, observer: &mut dyn Observer) -> Result<bool> {
        let d = self.deliver(eos, observer)?;
        let go = d.go;
        self.delivered = Some(d);
        Ok(go)
    }

    /// Reads the pending token back and handles it; `next` is the token of
    /// the step queued after it (fed the pending one), if any. Returns
    /// whether the generation goes on (then `next` is pending).
    pub fn accept(&mut self, next: Option<Array>, eos: &HashSet<u32>, observer: &mut dyn Observer) -> Result<bool> {
        let d = match self.delivered.take() {
            Some(d) => d,
            None => self.deliver(eos, observer)?,
        };
        if next.is_some() {
            // The token was fed to the step just queued: a paged cache may
            // now publish the block it completes.
            self.cache.note_tokens(&[d.tok]);
        }
        if !d.go {
            return Ok(false);
        }
        let (complete, opened) = (d.complete, d.opened);
        if complete && self.watch.is_some() {
            // The call is whole; free text again. The step queued under
            // the constraint handed over its logits: draw from them freely.
            self.constraint = None;
            return match next {
                Some(n) => {
                    self.watch.as_mut().expect("watching").stash = Some(n.clone());
                    self.y = self.draw_queued(&n)?;
                    self.y_finite = self.next_finite.take();
                    Ok(true)
                }
                None => Ok(false),
            };
        }
        if complete {
            // The grammar allows nothing more: the output is whole.
            self.finish = FinishReason::Stop;
            return Ok(false);
        }
        if opened && next.is_some() {
            let w = self.watch.as_mut().expect("watching");
            let stash = w.stash.take().ok_or_else(|| Error::invalid("no logits kept for the tool call (internal error)"))?;
            self.constraint = Some(w.template.clone());
            self.next_logprobs = None;
            return self.advance_constrained(&stash);
        }
        match next {
            Some(n) if self.constraint.is_some() => self.advance_constrained(&n),
            Some(n) => {
                self.y = n;
                self.y_finite = self.next_finite.take();
                self.y_logprobs = self.next_logprobs.take();
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// For [`prepare_constrained`]: this row's constraint and the token
    /// read back for it, when the row is constrained and the token does not
    /// end it (an end-of-sequence token is never committed); `stepped`: a
    /// step was queued after the token, so its mask is wanted. A failed read
    /// is left for `accept`, which reads again and reports it.
    fn constraint_work(&mut self, eos: &HashSet<u32>, stepped: bool) -> Option<(&mut Constraint, u32, bool)> {
        if self.delivered.is_some() {
            // Committed already: `accept` goes on from there.
            return None;
        }
        let c = self.constraint.as_mut()?;
        let tok: u32 = self.y.item().ok()?;
        (self.ignore_eos || !eos.contains(&tok)).then_some((c, tok, stepped))
    }

    /// The next token drawn under the constraint from `logits`, or the
    /// end of the sequence when the constraint allows no token at all.
    fn advance_constrained(&mut self, logits: &Array) -> Result<bool> {
        match self.draw_constrained(logits)? {
            Some(y) => {
                self.y = y;
                self.y_finite = self.next_finite.take();
                Ok(true)
            }
            None => {
                self.finish = FinishReason::Constraint;
                Ok(false)
            }
        }
    }

    /// Draws the token from a step's processed `logits` under the
    /// constraint's mask and queues it; None when no token is allowed.
    fn draw_constrained(&mut self, logits: &Array) -> Result<Option<Array>> {
        let Some(mask) = self.constraint.as_mut().expect("constrained").mask()? else { return Ok(None) };
        self.draw_queued(&Constraint::apply(logits, &mask)?).map(Some)
    }

    /// Draws from processed `logits` in `accept` (after the token before it
    /// was read back) and queues the token with its log-probabilities.
    fn draw_queued(&mut self, logits: &Array) -> Result<Array> {
        let y = self.sampler.draw_processed(logits)?;
        self.y_logprobs = self.sampler.take_logprobs();
        let mut queued = vec![&y];
        queued.extend(self.y_logprobs.iter().flat_map(|l| l.arrays()));
        async_eval(&queued)?;
        Ok(y)
    }

    fn logprob_entry(&self, tok: u32, lp: &sampler::LogprobArrays) -> Result<TokenLogprob> {
        let (logprob, top) = lp.read()?;
        let text = |id: u32| self.tokenizer.decode(&[id], false);
        Ok(TokenLogprob {
            token: tok,
            text: text(tok)?,
            logprob,
            top: top.into_iter().map(|(id, l)| Ok((id, text(id)?, l))).collect::<Result<_>>()?,
        })
    }

    /// The result, and the cache (for callers that keep it).
    pub fn finish(mut self, observer: &mut dyn Observer) -> Result<(Generation, ModelCache)> {
        let mut finish = self.finish;
        if !self.hit_stop_string && finish != FinishReason::Abort {
            // Flush bytes the decoder held back (an unfinished character at
            // the end; an aborted request keeps whole characters only).
            self.text.push_str(&self.decoder.finish()?);
            if let Some(at) = self.stops.find(&self.text) {
                self.text.truncate(at);
                finish = FinishReason::Stop;
            }
        }
        if self.text.len() > self.streamed {
            observer.on_text(&self.text[self.streamed..]);
        }
        let last = self.last_token_at.unwrap_or_else(Instant::now);
        let first = self.first_token_at.unwrap_or(last);
        let prefill_ms = ms(first - self.prefill_start);
        let decode_ms = ms(last - first);
        let decode_tokens = self.completion_tokens.saturating_sub(1);
        let run = self.prompt_len - self.cached_tokens;
        let metrics = Metrics {
            ttft_ms: ms(first - self.started),
            prefill_tokens: run,
            cached_tokens: self.cached_tokens,
            prefill_ms,
            prefill_tokens_per_second: if prefill_ms > 0.0 { run as f64 / (prefill_ms / 1000.0) } else { 0.0 },
            decode_tokens,
            decode_ms,
            decode_tokens_per_second: if decode_ms > 0.0 { decode_tokens as f64 / (decode_ms / 1000.0) } else { 0.0 },
            total_ms: ms(self.started.elapsed()),
        };
        // The exact end of this conversation, for its next turn.
        self.cache.keep_tail()?;
        let g = Generation {
            text: self.text,
            tokens: self.tokens,
            finish_reason: finish,
            prompt_tokens: self.prompt_len,
            completion_tokens: self.completion_tokens,
            metrics,
            logprobs: self.logprobs,
        };
        Ok((g, self.cache))
    }
}

/// A batch step's constrained rows (each with whether a step was queued
/// after its pending token): their tokens are read back here, on the
/// worker (MLX stays on its thread), then committed and the next masks
/// computed for all rows at once on other threads
/// ([`constraint::prepare_rows`]); each row's [`Sequence::accept`] takes
/// over what was done, in row order as before, so tokens, draws and finish
/// reasons are those of the rows handled one by one. Fewer than two
/// constrained rows: nothing (the row does its work in `accept`, no thread
/// hop). Returns whether the rows were prepared.
pub fn prepare_constrained<'a>(rows: impl Iterator<Item = (&'a mut Sequence, bool)>, eos: &HashSet<u32>) -> bool {
    let rows: Vec<(&mut Sequence, bool)> = rows.filter(|(s, _)| s.constraint.is_some()).collect();
    if rows.len() < 2 {
        return false;
    }
    let mut work: Vec<_> = rows.into_iter().filter_map(|(s, stepped)| s.constraint_work(eos, stepped)).collect();
    constraint::prepare_rows(&mut work);
    true
}

/// Queues a decode step's tokens and what its caches built beside them (as
/// [`queue_tokens`] does) and, under [`timing::sync_steps`], waits for
/// them; `clock` counts both phases (the single-sequence loop's or the
/// stacked batch's), and under [`timing::count_nodes`] the nodes handed
/// MLX, walked outside the dispatch's time.
pub(crate) fn dispatch_step(tokens: &[&Array], caches: &mut [&mut ModelCache], clock: &timing::Clock) -> Result<()> {
    let mut t = Instant::now();
    let fresh: Vec<Array> = caches.iter_mut().flat_map(|c| c.take_fresh()).collect();
    if timing::count_nodes() {
        let walk = Instant::now();
        let mut all: Vec<&Array> = tokens.to_vec();
        all.extend(fresh.iter());
        let n: usize = crate::mlx::graph_ops(&all)?.iter().map(|(_, n)| n).sum();
        clock.nodes(n as u64);
        // (The walk is the count's time, not the dispatch's.)
        t += walk.elapsed();
    }
    queue_graphs(tokens, &fresh)?;
    clock.dispatch(t);
    if timing::sync_steps() {
        let t = Instant::now();
        crate::mlx::eval(tokens)?;
        clock.sync(t);
    }
    Ok(())
}

/// Queues the evaluation of drawn tokens, then of whatever their caches
/// built alongside (conv snapshots, rows written back, a filled paged
/// block copied into the pool), so nothing is left as an unevaluated graph.
/// Two evaluations, not one: a step that wrote its K/V rows in place
/// (src/kernels/qkv_fused.rs `kv_in_place`) did so in a kernel that names
/// the buffers as inputs, and MLX's CUDA backend orders the kernels of one
/// graph only by the buffers they name as outputs, so a block copy in the
/// token's graph could read the block's last row before the kernel wrote
/// it; each evaluation commits its own graph, which the stream runs in
/// order. (The copies come only at a block's end: 32 tokens by default.)
pub fn queue_tokens(tokens: &[&Array], caches: &mut [&mut ModelCache]) -> Result<()> {
    let fresh: Vec<Array> = caches.iter_mut().flat_map(|c| c.take_fresh()).collect();
    queue_graphs(tokens, &fresh)
}

fn queue_graphs(tokens: &[&Array], fresh: &[Array]) -> Result<()> {
    async_eval(tokens)?;
    if fresh.is_empty() {
        return Ok(());
    }
    async_eval(&fresh.iter().collect::<Vec<_>>())
}

/// The result of a request cancelled before its first token: no text, and
/// metrics for the prefill chunks that did run.
fn cancelled_in_prefill(prompt_tokens: usize, tokens_run: usize, prefill_start: Instant, started: Instant) -> Generation {
    let prefill_ms = ms(prefill_start.elapsed());
    Generation {
        text: String::new(),
        tokens: vec![],
        finish_reason: FinishReason::Abort,
        prompt_tokens,
        completion_tokens: 0,
        logprobs: None,
        metrics: Metrics {
            ttft_ms: 0.0,
            prefill_tokens: tokens_run,
            prefill_ms,
            prefill_tokens_per_second: if prefill_ms > 0.0 { tokens_run as f64 / (prefill_ms / 1000.0) } else { 0.0 },
            total_ms: ms(started.elapsed()),
            ..Default::default()
        },
    }
}
