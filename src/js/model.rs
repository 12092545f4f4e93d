//! The `Lfm2Model` class. Every call validates its arguments on the JS
//! thread, then queues the work on the model's worker thread and returns a
//! promise that the worker settles; the event loop is never blocked.

use crate::engine::lockstep;
use super::args::{self, classed, rejected};
use super::convert::{
    aborted_result, generate_params, to_cache_stats, to_chat_messages, to_chat_reply, to_chat_result, to_model_info,
    ChatMessage, ChatResult, GenerateOptions, LoadOptions, ModelInfo, OptionValues, GENERATE_OPTION_KEYS, LOAD_OPTION_KEYS,
    MESSAGE_KEYS,
};
use super::session::ChatSession;
use super::stream::{release_hook_when_done, Abort, FlagObserver, GenerationStream, StreamObserver, StreamShared};
use crate::engine::worker::ModelWorker;
use crate::engine;
use crate::generate::Generation;
use crate::text::tool_calls::ToolCallSplitter;
use napi::bindgen_prelude::*;
use napi_derive::napi;
use std::path::PathBuf;
use std::sync::Arc;

/// What a request resolves with, seen by a completion hook (a session's history).
pub(crate) type Outcome = std::result::Result<ChatResult, crate::Error>;
pub(crate) type OnDone = Box<dyn FnOnce(&Outcome) + Send>;

/// A request's preparation on the worker: its prompt tokens and parameters
/// (the generation itself is scheduled with the other running requests).
/// Builds a request's prompt and parameters: run by the model's render
/// thread, off the worker (src/engine/worker.rs).
pub(crate) type Job = Box<dyn FnOnce() -> crate::Result<(Vec<u32>, crate::generate::GenerateParams)> + Send>;

/// Runs `job` on the worker and returns the promise of its result. An
/// already-aborted request resolves at once without queueing.
pub(crate) fn run_request<'e>(
    worker: &ModelWorker,
    env: &'e Env,
    abort: Abort,
    chat: bool,
    job: Job,
    on_done: Option<OnDone>,
    resume: Option<u64>,
) -> Result<Object<'e>> {
    let (deferred, promise) = env.create_deferred()?;
    let Abort { flag, hook } = abort;
    let convert = if chat { to_chat_reply } else { to_chat_result };
    let reply = move |r: Outcome| {
        if let Some(cb) = on_done {
            cb(&r);
        }
        deferred.resolve(move |env| {
            if let Some(h) = hook {
                h.release(&env);
            }
            r.map_err(js_error)
        });
    };
    if flag.load(std::sync::atomic::Ordering::SeqCst) {
        reply(Ok(aborted_result()));
        return Ok(promise);
    }
    worker.generate(engine::Request {
        prepare: None,
        render: Some(job),
        observer: Box::new(FlagObserver(flag)),
        reply: Some(Box::new(move |r: crate::Result<Generation>| reply(r.map(convert)))),
        resume,
    });
    Ok(promise)
}

/// Runs `job` on the worker, streaming its text.
pub(crate) fn run_stream(
    worker: &ModelWorker,
    env: &Env,
    abort: Abort,
    chat: bool,
    job: Job,
    on_done: Option<OnDone>,
    resume: Option<u64>,
) -> Result<GenerationStream> {
    let Abort { flag, hook } = abort;
    let shared = StreamShared::new(flag.clone());
    if let Some(cb) = on_done {
        shared.on_finish(cb);
    }
    release_hook_when_done(env, &shared, hook)?;
    if flag.load(std::sync::atomic::Ordering::SeqCst) {
        shared.finish(Ok(aborted_result()));
        return Ok(GenerationStream::new(shared));
    }
    let convert = if chat { to_chat_reply } else { to_chat_result };
    let feed = shared.clone();
    let done = shared.clone();
    worker.generate(engine::Request {
        prepare: None,
        render: Some(job),
        observer: Box::new(StreamObserver { shared: feed, splitter: chat.then(ToolCallSplitter::new) }),
        reply: Some(Box::new(move |r: crate::Result<Generation>| done.finish(r.map(convert)))),
        resume,
    });
    Ok(GenerationStream::new(shared))
}

/// Validated arguments of a chat request.
struct ChatArgs {
    messages: Vec<crate::text::ChatMessage>,
    values: OptionValues,
    params: crate::generate::GenerateParams,
}

fn chat_job(a: ChatArgs, tokenizer: Arc<crate::text::Tokenizer>) -> Job {
    let tools = a.values.tools_value();
    let trusted = a.values.trusted();
    Box::new(move || Ok((chat_prompt(&tokenizer, &a.messages, tools.as_ref(), trusted)?, a.params)))
}

/// The prompt ids `chat()` runs for `messages`.
pub(crate) fn chat_prompt(
    tokenizer: &crate::text::Tokenizer,
    messages: &[crate::text::ChatMessage],
    tools: Option<&serde_json::Value>,
    trusted: bool,
) -> crate::Result<Vec<u32>> {
    if messages.is_empty() {
        return Err(crate::Error::invalid("messages is empty"));
    }
    tokenizer.apply_chat_template_with(messages, tools, true, None, trusted)
}

/// A method's generation options, checked for unknown keys.
pub(crate) fn generate_options<'e>(v: Option<Unknown<'e>>) -> Result<Option<GenerateOptions<'e>>> {
    args::options(v, "", GENERATE_OPTION_KEYS)
}

/// A chat's messages, checked for unknown fields.
pub(crate) fn chat_messages(v: &Unknown) -> Result<Vec<ChatMessage>> {
    args::messages(v, "messages", MESSAGE_KEYS)
}

fn generate_job(prompt: Either<String, Vec<u32>>, params: crate::generate::GenerateParams, tokenizer: Arc<crate::text::Tokenizer>) -> Job {
    Box::new(move || {
        let ids = match prompt {
            Either::A(s) => tokenizer.encode_for_generation(&s)?,
            Either::B(ids) => ids,
        };
        Ok((ids, params))
    })
}

/// A prompt as text or as token ids checked to be ids.
fn prompt_ids(prompt: &Unknown) -> Result<Either<String, Vec<u32>>> {
    if args::is_string(prompt) {
        return Ok(Either::A(args::value(prompt, "prompt", "a string")?));
    }
    Ok(Either::B(token_id_arg(prompt, "prompt")?))
}

/// Token ids from an argument.
fn token_id_arg(v: &Unknown, name: &str) -> Result<Vec<u32>> {
    super::convert::token_ids(name, args::numbers(v, name)?)
}

fn signal<'a, 'e>(options: &'a Option<GenerateOptions<'e>>) -> Option<&'a Object<'e>> {
    options.as_ref().and_then(|o| o.signal.as_ref())
}

pub(crate) fn js_error(e: crate::Error) -> napi::Error {
    napi::Error::new(Status::GenericFailure, e.to_string())
}

/// Runs `f` on a short-lived thread (tokenizer work that must not wait
/// behind a generation on the model's worker, nor block the event loop).
pub(crate) fn off_thread<'e, T: ToNapiValue + Send + 'static>(
    env: &'e Env,
    f: impl FnOnce() -> crate::Result<T> + Send + 'static,
) -> Result<Object<'e>> {
    let (deferred, promise) = env.create_deferred()?;
    std::thread::spawn(move || match f() {
        Ok(v) => deferred.resolve(move |_| Ok(v)),
        Err(e) => deferred.reject(js_error(e)),
    });
    Ok(promise)
}

/// A loaded LFM2 / LFM2-MoE model. Create it with `Lfm2Model.load(path)`.
#[napi]
pub struct Lfm2Model {
    worker: Arc<ModelWorker>,
    info: Arc<parking_lot::Mutex<engine::ModelInfo>>,
    tokenizer: Arc<crate::text::Tokenizer>,
}

/// Once per JS environment: free every model before the process exits
/// (see engine::worker::shutdown_all).
fn register_exit_hook(env: &Env) -> Result<()> {
    static REGISTERED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !REGISTERED.swap(true, std::sync::atomic::Ordering::SeqCst) {
        env.add_env_cleanup_hook((), |_| {
            crate::engine::worker::shutdown_all(std::time::Duration::from_secs(10));
        })?;
    }
    Ok(())
}

#[napi]
impl Lfm2Model {
    /// Loads a checkpoint directory (Hugging Face or MLX layout).
    #[napi(ts_args_type = "path: string, options?: LoadOptions | undefined | null", ts_return_type = "Promise<Lfm2Model>")]
    pub fn load<'e>(env: &'e Env, path: Unknown<'e>, options: Option<Unknown<'e>>) -> Result<Object<'e>> {
        let checked = args::value::<String>(&path, "path", "a string (a checkpoint directory)").and_then(|path| {
            let mut options: Option<LoadOptions> = args::options(options, "", LOAD_OPTION_KEYS)?;
            let reporter = match options.as_mut().and_then(|o| o.on_progress.take()) {
                Some(f) => Some(super::progress::Reporter::new(&f)?),
                None => None,
            };
            Ok((path, super::convert::engine_options(options)?, reporter))
        });
        let (path, mut opts, reporter) = match checked {
            Ok(x) => x,
            Err(e) => return rejected(env, e),
        };
        register_exit_hook(env)?;
        let (deferred, promise) = env.create_deferred()?;
        opts.progress = reporter.as_ref().map(|r| r.engine_progress());
        let settle = move |r: Result<_>| match r {
            Ok((worker, info, tokenizer)) => {
                deferred.resolve(move |_| Ok(Lfm2Model { worker: Arc::new(worker), info, tokenizer }))
            }
            Err(e) => deferred.reject(e),
        };
        ModelWorker::spawn(PathBuf::from(path), opts, move |r| match reporter {
            Some(reporter) => reporter.finish(r, settle),
            None => settle(r.map_err(js_error)),
        });
        Ok(promise)
    }

    /// Chats with the model: renders `messages` with the checkpoint's chat
    /// template and generates the assistant's reply. Tool calls in the reply
    /// come back parsed in `toolCalls` (their markup is not in `text`).
    #[napi(
        ts_args_type = "messages: Array<ChatMessage>, options?: GenerateOptions | undefined | null",
        ts_return_type = "Promise<ChatResult>"
    )]
    pub fn chat<'e>(&self, env: &'e Env, messages: Unknown<'e>, options: Option<Unknown<'e>>) -> Result<Object<'e>> {
        let (args, options) = match self.chat_args(&messages, options) {
            Ok(a) => a,
            Err(e) => return rejected(env, e),
        };
        let abort = match Abort::watch(env, signal(&options)) {
            Ok(a) => a,
            Err(e) => return rejected(env, e),
        };
        run_request(&self.worker, env, abort, true, chat_job(args, self.tokenizer.clone()), None, None)
    }

    /// `chat()` as a stream of events: `for await (const ev of model.chatStream(messages))`
    /// gives `{ type: 'text', text }` deltas, then `{ type: 'done', result }`.
    #[napi(ts_args_type = "messages: Array<ChatMessage>, options?: GenerateOptions | undefined | null")]
    pub fn chat_stream<'e>(&self, env: &'e Env, messages: Unknown<'e>, options: Option<Unknown<'e>>) -> Result<GenerationStream> {
        (|| {
            let (args, options) = self.chat_args(&messages, options)?;
            let abort = Abort::watch(env, signal(&options))?;
            run_stream(&self.worker, env, abort, true, chat_job(args, self.tokenizer.clone()), None, None)
        })()
        .map_err(|e| classed(env, e))
    }

    /// Raw completion without a chat template. A string is tokenized (adding
    /// the BOS token unless it is already there); an array of token ids is
    /// used exactly.
    #[napi(
        ts_args_type = "prompt: string | Array<number>, options?: GenerateOptions | undefined | null",
        ts_return_type = "Promise<ChatResult>"
    )]
    pub fn generate<'e>(&self, env: &'e Env, prompt: Unknown<'e>, options: Option<Unknown<'e>>) -> Result<Object<'e>> {
        let checked = self.generate_args(&prompt, options);
        let (prompt, params, options) = match checked {
            Ok(x) => x,
            Err(e) => return rejected(env, e),
        };
        let abort = match Abort::watch(env, signal(&options)) {
            Ok(a) => a,
            Err(e) => return rejected(env, e),
        };
        run_request(&self.worker, env, abort, false, generate_job(prompt, params, self.tokenizer.clone()), None, None)
    }

    /// `generate()` as a stream of events (see `chatStream`).
    #[napi(ts_args_type = "prompt: string | Array<number>, options?: GenerateOptions | undefined | null")]
    pub fn generate_stream<'e>(&self, env: &'e Env, prompt: Unknown<'e>, options: Option<Unknown<'e>>) -> Result<GenerationStream> {
        (|| {
            let (prompt, params, options) = self.generate_args(&prompt, options)?;
            let abort = Abort::watch(env, signal(&options))?;
            run_stream(&self.worker, env, abort, false, generate_job(prompt, params, self.tokenizer.clone()), None, None)
        })()
        .map_err(|e| classed(env, e))
    }

    /// A conversation that keeps its history (tool calls and results
    /// included) between turns. With the paged cache a turn finds the
    /// conversation so far in the prefix cache and runs only what is new
    /// (`metrics.cachedTokens`).
    #[napi(ts_args_type = "options?: SessionOptions | undefined | null")]
    pub fn create_session<'e>(&self, env: &'e Env, options: Option<Unknown<'e>>) -> Result<ChatSession> {
        (|| {
            self.open()?;
            ChatSession::new(self.worker.clone(), self.tokenizer.clone(), options)
        })()
        .map_err(|e| classed(env, e))
    }

    /// Restores a session saved with `session.save(file)`: its conversation,
    /// and the model's state at its end, so the next turn runs only what is
    /// new (`metrics.cachedTokens` is the restored length). The file must
    /// come from a model with the same fingerprint (`info().fingerprint`:
    /// config, weights, tokenizer, chat template, KV cache kind); another
    /// model's file, another format version or a damaged file is an error
    /// and nothing is loaded. `options.defaults` sets the generation
    /// defaults (they are not saved).
    #[napi(
        ts_args_type = "file: string, options?: LoadSessionOptions | undefined | null",
        ts_return_type = "Promise<ChatSession>"
    )]
    pub fn load_session<'e>(&self, env: &'e Env, file: Unknown<'e>, options: Option<Unknown<'e>>) -> Result<Object<'e>> {
        let checked = self.open().and_then(|_| {
            let file: String = args::value(&file, "file", "a string (a file path)")?;
            let defaults = ChatSession::load_defaults(options)?;
            Ok((file, defaults))
        });
        let (file, defaults) = match checked {
            Ok(x) => x,
            Err(e) => return rejected(env, e),
        };
        let (deferred, promise) = env.create_deferred()?;
        let (worker, tokenizer) = (self.worker.clone(), self.tokenizer.clone());
        self.worker.run(
            move |eng| eng.load_session(std::path::Path::new(&file)),
            move |r| match r.and_then(|l| ChatSession::restored(worker, tokenizer, defaults, l)) {
                Ok(session) => deferred.resolve(move |_| Ok(session)),
                Err(e) => deferred.reject(js_error(e)),
            },
        );
        Ok(promise)
    }

    /// The logits of the last position after running `tokenIds` (float32).
    #[napi(ts_args_type = "tokenIds: Array<number>", ts_return_type = "Promise<Float32Array>")]
    pub fn logits<'e>(&self, env: &'e Env, token_ids: Unknown<'e>) -> Result<Object<'e>> {
        let token_ids = match token_id_arg(&token_ids, "tokenIds") {
            Ok(t) => t,
            Err(e) => return rejected(env, e),
        };
        let (deferred, promise) = env.create_deferred()?;
        self.worker.run(
            move |eng| {
                if let Some(g) = eng.leader() {
                    lockstep::announce(&g, &lockstep::Command::Logits(token_ids.clone()))?;
                }
                eng.logits(&token_ids)
            },
            move |r| match r {
                Ok(v) => deferred.resolve(move |_| Ok(Float32Array::new(v))),
                Err(e) => deferred.reject(js_error(e)),
            },
        );
        Ok(promise)
    }

    /// Token ids for `text` (with the tokenizer's special tokens, e.g. BOS, unless
    /// `addSpecialTokens` is false).
    #[napi(
        ts_args_type = "text: string, addSpecialTokens?: boolean | undefined | null",
        ts_return_type = "Promise<number[]>"
    )]
    pub fn tokenize<'e>(&self, env: &'e Env, text: Unknown<'e>, add_special_tokens: Option<Unknown<'e>>) -> Result<Object<'e>> {
        let checked = self.open().and_then(|_| {
            let text: String = args::value(&text, "text", "a string")?;
            Ok((text, args::optional::<bool>(add_special_tokens, "addSpecialTokens", "a boolean")?))
        });
        let (text, add_special_tokens) = match checked {
            Ok(x) => x,
            Err(e) => return rejected(env, e),
        };
        let tok = self.tokenizer.clone();
        off_thread(env, move || tok.encode(&text, add_special_tokens.unwrap_or(true)))
    }

    /// Text for token ids (special tokens included unless `skipSpecialTokens`).
    #[napi(
        ts_args_type = "tokenIds: Array<number>, skipSpecialTokens?: boolean | undefined | null",
        ts_return_type = "Promise<string>"
    )]
    pub fn detokenize<'e>(&self, env: &'e Env, token_ids: Unknown<'e>, skip_special_tokens: Option<Unknown<'e>>) -> Result<Object<'e>> {
        let checked = self.open().and_then(|_| {
            let ids = token_id_arg(&token_ids, "tokenIds")?;
            Ok((ids, args::optional::<bool>(skip_special_tokens, "skipSpecialTokens", "a boolean")?))
        });
        let (token_ids, skip_special_tokens) = match checked {
            Ok(x) => x,
            Err(e) => return rejected(env, e),
        };
        let tok = self.tokenizer.clone();
        off_thread(env, move || tok.decode_checked(&token_ids, skip_special_tokens.unwrap_or(false)))
    }

    /// The prompt token ids `chat()` would run for `messages` (the checkpoint's
    /// chat template with the generation prompt appended).
    #[napi(
        ts_args_type = "messages: Array<ChatMessage>, options?: GenerateOptions | undefined | null",
        ts_return_type = "Promise<number[]>"
    )]
    pub fn apply_chat_template<'e>(&self, env: &'e Env, messages: Unknown<'e>, options: Option<Unknown<'e>>) -> Result<Object<'e>> {
        let a = match self.open().and_then(|_| self.chat_args(&messages, options)) {
            Ok((a, _)) => a,
            Err(e) => return rejected(env, e),
        };
        let tools = a.values.tools_value();
        let trusted = a.values.trusted();
        let tok = self.tokenizer.clone();
        off_thread(env, move || tok.apply_chat_template_with(&a.messages, tools.as_ref(), true, None, trusted))
    }

    /// The paged KV cache's counters, or null when this model uses flat
    /// caches. Runs after the requests queued before it.
    #[napi(ts_return_type = "Promise<CacheStats | null>")]
    pub fn cache_stats<'e>(&self, env: &'e Env) -> Result<Object<'e>> {
        let (deferred, promise) = env.create_deferred()?;
        self.worker.run(
            move |eng| Ok(eng.cache_stats_with_bytes()),
            move |r| match r {
                Ok(v) => deferred.resolve(move |_| Ok(v.map(|(s, b)| to_cache_stats(&s, b)))),
                Err(e) => deferred.reject(js_error(e)),
            },
        );
        Ok(promise)
    }

    /// Forgets every cached prefix no running request uses (the next
    /// request runs its whole prompt).
    #[napi(ts_return_type = "Promise<void>")]
    pub fn clear_prefix_cache<'e>(&self, env: &'e Env) -> Result<Object<'e>> {
        let (deferred, promise) = env.create_deferred()?;
        self.worker.run(
            move |eng| {
                if let Some(g) = eng.leader() {
                    lockstep::announce(&g, &lockstep::Command::ClearPrefixCache)?;
                }
                eng.clear_prefix_cache();
                Ok(())
            },
            move |r| match r {
                Ok(()) => deferred.resolve(|_| Ok(())),
                Err(e) => deferred.reject(js_error(e)),
            },
        );
        Ok(promise)
    }

    /// Runs two short throwaway generations (together, then one alone) so
    /// that the first real requests do not pay for building kernels and
    /// compiled steps (on CUDA the first batched step compiles kernels for
    /// many seconds the first time on a machine). Resolves with the
    /// milliseconds it took, or null when requests were running (then it
    /// does nothing). `mlx-lfm serve` calls it before listening.
    #[napi(ts_return_type = "Promise<number | null>")]
    pub fn warm_up<'e>(&self, env: &'e Env) -> Result<Object<'e>> {
        let (deferred, promise) = env.create_deferred()?;
        self.worker.run_scheduled(
            move |eng, sched| {
                if let Some(g) = eng.leader() {
                    lockstep::announce(&g, &lockstep::Command::WarmUp)?;
                }
                sched.warm_up(eng)
            },
            move |r| match r {
                Ok(ms) => deferred.resolve(move |_| Ok(ms)),
                Err(e) => deferred.reject(js_error(e)),
            },
        );
        Ok(promise)
    }

    /// On a rank other than 0 of a tensor-parallel model (loaded with
    /// `distributed`): runs rank 0's requests, as rank 0 announces them,
    /// until rank 0's model is closed (resolves) or the group fails
    /// (rejects). Rank 0 takes every request; a follower takes none of its
    /// own. Rejects on rank 0 and on a model of one process.
    #[napi(ts_return_type = "Promise<void>")]
    pub fn follow<'e>(&self, env: &'e Env) -> Result<Object<'e>> {
        let (deferred, promise) = env.create_deferred()?;
        self.worker.run_scheduled(
            move |eng, _| match eng.follower() {
                Some(g) => lockstep::follow(eng, &g),
                None => Err(crate::error::Error::invalid(
                    "follow() is for ranks other than 0 of a model loaded with `distributed`; this process takes requests itself",
                )),
            },
            move |r| match r {
                Ok(()) => deferred.resolve(|_| Ok(())),
                Err(e) => deferred.reject(js_error(e)),
            },
        );
        Ok(promise)
    }

    /// What was loaded and how it runs. Throws once the model is closed.
    #[napi]
    pub fn info(&self) -> Result<ModelInfo> {
        self.open()?;
        Ok(to_model_info(&self.info.lock()))
    }

    /// Ok while the model is open; "model closed" after `close()`.
    fn open(&self) -> Result<()> {
        if self.worker.is_closed() {
            return Err(js_error(crate::Error::new(crate::ErrorKind::Closed, "this model has been closed")));
        }
        Ok(())
    }

    /// Frees the model once queued requests finish; later calls reject.
    #[napi]
    pub fn close(&self) {
        self.worker.close();
    }

    /// Checks a chat's arguments (on the JS thread, before anything is queued).
    fn chat_args<'e>(&self, messages: &Unknown<'e>, options: Option<Unknown<'e>>) -> Result<(ChatArgs, Option<GenerateOptions<'e>>)> {
        let messages = to_chat_messages(chat_messages(messages)?)?;
        let options = generate_options(options)?;
        let values = OptionValues::from_options(options.as_ref());
        let params = generate_params(&values)?;
        Ok((ChatArgs { messages, values, params }, options))
    }

    /// Checks a completion's arguments.
    #[allow(clippy::type_complexity)]
    fn generate_args<'e>(
        &self,
        prompt: &Unknown<'e>,
        options: Option<Unknown<'e>>,
    ) -> Result<(Either<String, Vec<u32>>, crate::generate::GenerateParams, Option<GenerateOptions<'e>>)> {
        let options = generate_options(options)?;
        let params = generate_params(&OptionValues::from_options(options.as_ref()))?;
        Ok((prompt_ids(prompt)?, params, options))
    }
}
