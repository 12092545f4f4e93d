//! Serving a tensor-parallel model: rank 0 decides, the other ranks
//! follow. Every rank must run the same computations in the same order (each
//! holds part of every layer, and the layers' all_sums pair up across
//! ranks), but only rank 0 hears requests, cancellations and clients. So
//! rank 0's worker broadcasts each thing it is about to do (a request with
//! its prompt tokens and parameters, a scheduler step, a replayed job, the
//! end) through MLX's own collectives, and every answer its requests'
//! observers give (cancelled, a client gone) is broadcast at the moment the
//! scheduler asks for it; the followers' workers run the same scheduler on
//! those. What depends on timing on rank 0 (which requests had arrived by a
//! step) thus reaches the followers as data, and the rest is the same code
//! on the same inputs.

use super::{Engine, Request, Scheduler};
use crate::error::{Error, Result};
use crate::generate::sampler::SamplingParams;
use crate::generate::{GenerateParams, Observer};
use crate::mlx::distributed::Group;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What rank 0 is about to do, as the followers replay it.
pub enum Command {
    /// A request that passed its preparation on rank 0.
    Generate { prompt: Vec<u32>, params: GenerateParams },
    /// One scheduler step (the next prefill work, then a decode step).
    Step,
    ClearPrefixCache,
    WarmUp,
    Logits(Vec<u32>),
    /// Rank 0's model is closed: the followers' loops end.
    Close,
}

fn params_json(p: &GenerateParams) -> Value {
    let s = &p.sampling;
    json!({
        "maxTokens": p.max_tokens, "stop": p.stop, "ignoreEos": p.ignore_eos, "prefillChunk": p.prefill_chunk,
        "maxPromptTokens": p.max_prompt_tokens,
        "temperature": s.temperature, "topK": s.top_k, "topP": s.top_p, "minP": s.min_p,
        "repetitionPenalty": s.repetition_penalty, "repetitionContextSize": s.repetition_context_size, "seed": s.seed,
        "presencePenalty": s.presence_penalty, "frequencyPenalty": s.frequency_penalty, "logitBias": s.logit_bias,
        "logprobs": s.logprobs, "topLogprobs": s.top_logprobs, "grammar": p.grammar,
    })
}

fn params_from(v: &Value) -> Result<GenerateParams> {
    let bad = || Error::mlx(format!("rank 0 sent parameters this rank cannot read: {v}"));
    let u = |k: &str| v[k].as_u64().map(|x| x as usize).ok_or_else(bad);
    let f = |k: &str| v[k].as_f64().map(|x| x as f32).ok_or_else(bad);
    Ok(GenerateParams {
        max_tokens: u("maxTokens")?,
        stop: serde_json::from_value(v["stop"].clone()).map_err(|_| bad())?,
        ignore_eos: v["ignoreEos"].as_bool().ok_or_else(bad)?,
        prefill_chunk: u("prefillChunk")?,
        max_prompt_tokens: v["maxPromptTokens"].as_u64().map(|x| x as usize),
        sampling: SamplingParams {
            temperature: f("temperature")?,
            top_k: u("topK")?,
            top_p: f("topP")?,
            min_p: f("minP")?,
            repetition_penalty: v["repetitionPenalty"].as_f64().map(|x| x as f32),
            repetition_context_size: u("repetitionContextSize")?,
            seed: v["seed"].as_u64(),
            presence_penalty: f("presencePenalty")?,
            frequency_penalty: f("frequencyPenalty")?,
            logit_bias: serde_json::from_value(v["logitBias"].clone()).map_err(|_| bad())?,
            logprobs: v["logprobs"].as_bool().ok_or_else(bad)?,
            top_logprobs: u("topLogprobs")?,
        },
        // A constraint runs on every rank (each masks the same logits).
        grammar: serde_json::from_value(v["grammar"].clone()).map_err(|_| bad())?,
    })
}

impl Command {
    fn to_json(&self) -> Value {
        match self {
            Command::Generate { prompt, params } => json!({ "k": "generate", "prompt": prompt, "params": params_json(params) }),
            Command::Step => json!({ "k": "step" }),
            Command::ClearPrefixCache => json!({ "k": "clear" }),
            Command::WarmUp => json!({ "k": "warm" }),
            Command::Logits(ids) => json!({ "k": "logits", "ids": ids }),
            Command::Close => json!({ "k": "close" }),
        }
    }

    fn from_json(v: &Value) -> Result<Command> {
        let ids = |k: &str| -> Result<Vec<u32>> {
            serde_json::from_value(v[k].clone()).map_err(|e| Error::mlx(format!("rank 0 sent bad token ids: {e}")))
        };
        Ok(match v["k"].as_str() {
            Some("generate") => Command::Generate { prompt: ids("prompt")?, params: params_from(&v["params"])? },
            Some("step") => Command::Step,
            Some("clear") => Command::ClearPrefixCache,
            Some("warm") => Command::WarmUp,
            Some("logits") => Command::Logits(ids("ids")?),
            Some("close") => Command::Close,
            _ => return Err(Error::mlx(format!("rank 0 sent a command this rank does not know: {v}"))),
        })
    }
}

/// Rank 0: tells the followers what comes next.
pub fn announce(group: &Group, cmd: &Command) -> Result<()> {
    group.broadcast_bytes(cmd.to_json().to_string().as_bytes()).map(|_| ())
}

/// A follower: what rank 0 does next.
pub fn next_command(group: &Group) -> Result<Command> {
    let bytes = group.broadcast_bytes(&[])?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|e| Error::mlx(format!("rank 0 sent an unreadable command: {e}")))?;
    Command::from_json(&v)
}

/// A request's observer whose every answer is rank 0's: rank 0 asks the
/// real one and broadcasts the answer; a follower (whose `inner` is a
/// placeholder) takes it. Both ranks' schedulers ask at the same points,
/// so the broadcasts pair up. A failed broadcast cancels (the group is
/// broken) and marks `broken`, so rank 0 answers the request with an error
/// rather than as a generation that ended (a stream would otherwise look
/// finished to its client).
pub struct Mirrored {
    pub inner: Box<dyn Observer + Send>,
    pub group: Group,
    pub broken: Arc<AtomicBool>,
}

impl Mirrored {
    /// Rank 0's `mine`, on every rank; `broken` when the group failed.
    fn agree(&self, mine: bool, broken: bool) -> bool {
        match self.group.broadcast(&[mine as i32]) {
            Ok(v) => v[0] != 0,
            Err(_) => {
                self.broken.store(true, Ordering::Relaxed);
                broken
            }
        }
    }
}

impl Observer for Mirrored {
    fn on_text(&mut self, delta: &str) -> bool {
        let mine = self.group.rank() != 0 || self.inner.on_text(delta);
        self.agree(mine, false)
    }
    fn cancelled(&mut self) -> bool {
        let mine = self.group.rank() == 0 && self.inner.cancelled();
        self.agree(mine, true)
    }
    fn finished(&mut self) {
        self.inner.finished();
    }
}

/// Rank 0's side of a request: its preparation (prompt and parameters) runs
/// here, before the followers hear of it; one that fails is answered and
/// never announced. Returns the request ready for the scheduler, observed
/// through a [`Mirrored`].
pub fn lead_request(e: &mut Engine, group: &Group, mut req: Request) -> Result<Option<Request>> {
    req.render_now();
    let prepared = match req.prepare.take() {
        Some(prepare) => prepare(e),
        None => Err(Error::invalid("a request with nothing to run")),
    };
    let (prompt, params) = match prepared {
        Ok(x) => x,
        Err(err) => {
            req.fail(err);
            return Ok(None);
        }
    };
    announce(group, &Command::Generate { prompt: prompt.clone(), params: params.clone() })?;
    let inner = std::mem::replace(&mut req.observer, Box::new(crate::generate::NoObserver));
    let broken = Arc::new(AtomicBool::new(false));
    req.observer = Box::new(Mirrored { inner, group: group.clone(), broken: broken.clone() });
    if let Some(reply) = req.reply.take() {
        req.reply = Some(Box::new(move |r: Result<crate::generate::Generation>| {
            if r.is_ok() && broken.load(Ordering::Relaxed) {
                reply(Err(Error::mlx(
                    "a rank of the tensor-parallel group failed during this request: the output stops where the group broke",
                )));
            } else {
                reply(r);
            }
        }));
    }
    req.prepare = Some(Box::new(move |_| Ok((prompt, params))));
    Ok(Some(req))
}

/// A follower's loop: replays rank 0's commands until it closes (Ok) or the
/// group fails (the error).
pub fn follow(e: &mut Engine, group: &Group) -> Result<()> {
    let mut sched = Scheduler::new();
    loop {
        match next_command(group)? {
            Command::Generate { prompt, params } => {
                let mut req = Request::tokens(prompt, params, |_| {});
                req.observer = Box::new(Mirrored {
                    inner: Box::new(crate::generate::NoObserver),
                    group: group.clone(),
                    broken: Arc::new(AtomicBool::new(false)),
                });
                sched.submit(e, req);
            }
            Command::Step => {
                sched.prefill_next(e);
                sched.step_active(e);
            }
            Command::ClearPrefixCache => e.clear_prefix_cache(),
            Command::WarmUp => {
                // Its outcome is rank 0's to report; a failure here shows
                // there as well, through the same collectives.
                let _ = sched.warm_up(e);
            }
            Command::Logits(ids) => {
                let _ = e.logits(&ids);
            }
            Command::Close => return Ok(()),
        }
    }
}
