//! Generation: chunked prefill, a decode loop that keeps the device busy
//! (step t+1 is queued before token t is read back, as mlx-lm does),
//! sampling, stop conditions and honest timing.

pub mod sampler;
pub mod stop;

use crate::compiled::CompiledDecoder;
use crate::error::{Error, Result};
use crate::mlx::{async_eval, Array};
use crate::model::{Lfm2Model, ModelCache};
use crate::text::{StreamDecoder, Tokenizer};
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
}

impl FinishReason {
    pub fn name(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
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
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 256,
            sampling: SamplingParams::default(),
            stop: vec![],
            ignore_eos: false,
            prefill_chunk: 2048,
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
}

/// What a caller hears during generation; returning false cancels.
pub trait Observer {
    fn on_text(&mut self, _delta: &str) -> bool {
        true
    }
    /// Polled between steps (prefill chunks and decode steps).
    fn cancelled(&mut self) -> bool {
        false
    }
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
    if prompt.is_empty() {
        return Err(Error::invalid("the prompt has no tokens"));
    }
    let vocab = model.config.vocab_size as u32;
    if let Some(&bad) = prompt.iter().find(|&&t| t >= vocab) {
        return Err(Error::invalid(format!("token id {bad} is out of range for vocab_size {vocab}")));
    }
    let chunk = chunk.max(1);
    // A paged cache starts from the longest cached prefix (at least one
    // token is always left to run, for the logits).
    let cached = cache.attach_prefix(prompt)?;
    let mut start = cached;
    loop {
        if observer.cancelled() {
            return Ok(Prefill::Cancelled { tokens_run: start - cached });
        }
        let end = (start + chunk).min(prompt.len());
        let ids = Array::from_slice(&prompt[start..end], &[1, (end - start) as i32])?;
        if end == prompt.len() {
            let logits = model.forward(&ids, cache, true)?;
            cache.note_tokens(&prompt[start..end]);
            return Ok(Prefill::Done(logits.reshape(&[1, -1])?));
        }
        model.forward_hidden(&ids, cache)?;
        cache.eval_state()?;
        cache.note_tokens(&prompt[start..end]);
        start = end;
    }
}

/// Runs decode steps on the compiled path while it works; the first failure
/// is kept (for the caller to report once) and the rest of the request, and
/// every later step, runs eager.
pub struct Stepper<'a> {
    pub model: &'a Lfm2Model,
    compiled: Option<&'a CompiledDecoder>,
    pub failure: Option<Error>,
}

impl<'a> Stepper<'a> {
    pub fn new(model: &'a Lfm2Model, compiled: Option<&'a CompiledDecoder>) -> Self {
        Stepper { model, compiled, failure: None }
    }

    /// Logits `[1, V]` for one token `ids` (`[1, 1]`), advancing `cache`.
    pub fn step(&mut self, ids: &Array, cache: &mut ModelCache) -> Result<Array> {
        if let Some(c) = self.compiled {
            match c.step(self.model, ids, cache, true) {
                Ok(l) => return Ok(l),
                Err(e) => {
                    self.failure = Some(e);
                    self.compiled = None;
                }
            }
        }
        self.model.forward(ids, cache, true)?.reshape(&[1, -1])
    }
}

/// Generates a completion for `prompt` on a fresh cache.
pub fn generate(
    stepper: &mut Stepper,
    tokenizer: &Tokenizer,
    eos: &HashSet<u32>,
    prompt: &[u32],
    params: &GenerateParams,
    observer: &mut dyn Observer,
    started: Instant,
) -> Result<Generation> {
    let mut cache = stepper.model.new_cache();
    generate_with_cache(stepper, &mut cache, tokenizer, eos, prompt, params, observer, started)
}

#[allow(clippy::too_many_arguments)]
pub fn generate_with_cache(
    stepper: &mut Stepper,
    cache: &mut ModelCache,
    tokenizer: &Tokenizer,
    eos: &HashSet<u32>,
    prompt: &[u32],
    params: &GenerateParams,
    observer: &mut dyn Observer,
    started: Instant,
) -> Result<Generation> {
    if params.max_tokens == 0 {
        return Err(Error::invalid("maxTokens must be at least 1"));
    }
    let mut sampler = Sampler::new(params.sampling.clone(), prompt)?;
    let mut stops = StopStrings::new(&params.stop);
    let mut decoder = StreamDecoder::new(tokenizer, false);
    let mut text = String::new();
    let mut streamed = 0usize;
    let mut tokens: Vec<u32> = Vec::new();
    let mut completion_tokens = 0usize;
    let mut finish = FinishReason::Length;
    let mut hit_stop_string = false;

    let model = stepper.model;
    let prefill_start = Instant::now();
    let logits = match prefill_observed(model, cache, prompt, params.prefill_chunk, observer)? {
        Prefill::Done(logits) => logits,
        Prefill::Cancelled { tokens_run } => {
            let mut g = cancelled_in_prefill(prompt.len(), tokens_run, prefill_start, started);
            g.metrics.cached_tokens = cache.cached_tokens();
            return Ok(g);
        }
    };
    let cached_tokens = cache.cached_tokens();
    let mut y = sampler.sample(&logits)?;
    eval_with(&y, cache)?;
    let mut first_token_at: Option<Instant> = None;
    let mut last_token_at: Instant;

    loop {
        let produced = completion_tokens + 1;
        // Queue the next step before reading this token back.
        let next = if produced < params.max_tokens {
            let ids = y.reshape(&[1, 1])?;
            let l = stepper.step(&ids, cache)?;
            let n = sampler.sample(&l)?;
            eval_with(&n, cache)?;
            Some(n)
        } else {
            None
        };
        let tok: u32 = y.item()?;
        if next.is_some() {
            // `tok` was fed to the step just queued: a paged cache may now
            // publish the block it completes.
            cache.note_tokens(&[tok]);
        }
        let now = Instant::now();
        first_token_at.get_or_insert(now);
        last_token_at = now;
        completion_tokens = produced;
        if !params.ignore_eos && eos.contains(&tok) {
            finish = FinishReason::Stop;
            break;
        }
        tokens.push(tok);
        text.push_str(&decoder.push(tok)?);
        if let Some(at) = stops.find(&text) {
            text.truncate(at);
            finish = FinishReason::Stop;
            hit_stop_string = true;
            break;
        }
        let safe = stops.safe_len(&text);
        if safe > streamed {
            let go_on = observer.on_text(&text[streamed..safe]);
            streamed = safe; // delivered either way
            if !go_on {
                finish = FinishReason::Abort;
                break;
            }
        }
        if observer.cancelled() {
            finish = FinishReason::Abort;
            break;
        }
        match next {
            Some(n) => y = n,
            None => break,
        }
    }
    if !hit_stop_string && finish != FinishReason::Abort {
        // Flush bytes the decoder held back (an unfinished character at the
        // end; an aborted request keeps whole characters only).
        text.push_str(&decoder.finish()?);
        if let Some(at) = stops.find(&text) {
            text.truncate(at);
            finish = FinishReason::Stop;
        }
    }
    if text.len() > streamed {
        observer.on_text(&text[streamed..]);
    }
    let first = first_token_at.unwrap_or(last_token_at);
    let prefill_ms = ms(first - prefill_start);
    let decode_ms = ms(last_token_at - first);
    let decode_tokens = completion_tokens.saturating_sub(1);
    let run = prompt.len() - cached_tokens;
    let metrics = Metrics {
        ttft_ms: ms(first - started),
        prefill_tokens: run,
        cached_tokens,
        prefill_ms,
        prefill_tokens_per_second: if prefill_ms > 0.0 { run as f64 / (prefill_ms / 1000.0) } else { 0.0 },
        decode_tokens,
        decode_ms,
        decode_tokens_per_second: if decode_ms > 0.0 { decode_tokens as f64 / (decode_ms / 1000.0) } else { 0.0 },
        total_ms: ms(started.elapsed()),
    };
    Ok(Generation { text, tokens, finish_reason: finish, prompt_tokens: prompt.len(), completion_tokens, metrics })
}

/// Queues `y` together with whatever the cache built alongside it (conv
/// snapshots), so nothing is left as an unevaluated graph.
fn eval_with(y: &Array, cache: &mut ModelCache) -> Result<()> {
    let fresh = cache.take_fresh();
    let mut all: Vec<&Array> = vec![y];
    all.extend(fresh.iter());
    async_eval(&all)
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
