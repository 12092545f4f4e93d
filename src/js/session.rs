//! `ChatSession`: a conversation with a model that keeps its history.
//!
//! Each turn renders the system prompt, the history and the new message with
//! the chat template and runs it on the model's worker. The paged prefix
//! cache (the model's, shared by every request) finds the conversation so
//! far, so a turn runs only its new tokens; the session's history only
//! grows by completed turns, which keeps its prompts prefixes of each other.

use super::args::{self, classed, rejected};
use super::convert::{
    generate_params, to_chat_messages, ChatMessage, GenerateOptions, OptionValues, ToolCall, GENERATE_OPTION_KEYS,
    MESSAGE_KEYS,
};
use super::model::{generate_options, js_error, run_request, run_stream, Job, OnDone, Outcome};
use super::stream::{Abort, GenerationStream};
use crate::engine::worker::ModelWorker;
use crate::error::Error;
use napi::bindgen_prelude::*;
use napi_derive::napi;
use parking_lot::Mutex;
use serde_json::{json, Value};
use std::sync::Arc;

#[napi(object, object_to_js = false)]
pub struct SessionOptions<'env> {
    /// The system prompt, sent first on every turn.
    pub system: Option<String>,
    /// Tools (OpenAI function shape) offered on every turn; a turn's own
    /// `tools` option replaces them for that turn.
    #[napi(ts_type = "Array<FunctionTool>")]
    pub tools: Option<Vec<serde_json::Value>>,
    /// Generation options for every turn; a turn's options override them
    /// one by one. (A `signal` belongs to a turn, not here.)
    pub defaults: Option<GenerateOptions<'env>>,
    /// Earlier conversation to continue from (without the system prompt).
    pub messages: Option<Vec<ChatMessage>>,
}

#[napi(object, object_to_js = false)]
pub struct LoadSessionOptions<'env> {
    /// Generation options for every turn (see `SessionOptions.defaults`).
    pub defaults: Option<GenerateOptions<'env>>,
}

/// What `session.save()` resolves with.
#[napi(object)]
pub struct SaveResult {
    /// Tokens of history whose state the file holds.
    pub tokens: u32,
    /// The file's size.
    pub bytes: f64,
}

/// `SessionOptions`' keys as JS spells them (`defaults` holds
/// `GenerateOptions`' keys, `messages` messages).
pub const SESSION_OPTION_KEYS: &[&str] = &["system", "tools", "defaults", "messages"];

struct SessionState {
    system: Option<String>,
    tools: Option<Vec<Value>>,
    defaults: OptionValues,
    history: Vec<ChatMessage>,
    /// A turn is in flight.
    busy: bool,
    /// Bumped by `reset()`, so a turn that was in flight then is not recorded.
    epoch: u64,
    /// A restored session's state kept on the worker for its next turn.
    resume: Option<u64>,
}

/// A conversation with one model. Turns run one at a time: `send` while a
/// turn is in flight rejects.
#[napi]
pub struct ChatSession {
    worker: Arc<ModelWorker>,
    tokenizer: Arc<crate::text::Tokenizer>,
    state: Arc<Mutex<SessionState>>,
}

fn message(role: &str, content: String) -> ChatMessage {
    ChatMessage { role: role.into(), content: Some(content), tool_calls: None, tool_call_id: None, name: None }
}

fn tool_call_json(c: &ToolCall) -> Value {
    json!({ "id": c.id, "type": c.kind, "function": { "name": c.function.name, "arguments": c.function.arguments } })
}

fn err(msg: impl Into<String>) -> napi::Error {
    js_error(Error::invalid(msg.into()))
}

/// A validated turn, ready to run.
struct Turn {
    job: Job,
    on_done: OnDone,
    resume: Option<u64>,
}

/// A message as saved in a session file.
fn message_json(m: &ChatMessage) -> Value {
    json!({ "role": m.role, "content": m.content, "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id, "name": m.name })
}

fn message_from_json(v: &Value) -> crate::Result<ChatMessage> {
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(String::from);
    let role = s("role").ok_or_else(|| Error::invalid("a saved message has no role"))?;
    let tool_calls = match v.get("tool_calls") {
        Some(Value::Array(a)) => Some(a.clone()),
        _ => None,
    };
    Ok(ChatMessage { role, content: s("content"), tool_calls, tool_call_id: s("tool_call_id"), name: s("name") })
}

impl ChatSession {
    pub fn new(worker: Arc<ModelWorker>, tokenizer: Arc<crate::text::Tokenizer>, options: Option<Unknown<'_>>) -> Result<ChatSession> {
        // The nested objects are checked from the raw object, which the
        // typed conversion below would not show.
        if let Some(raw) = options.filter(|o| o.get_type().is_ok_and(|t| t == ValueType::Object)) {
            // SAFETY: checked to be an object of the current call's environment.
            let obj = unsafe { Object::from_napi_value(raw.value().env, raw.raw()) }?;
            let _: Option<GenerateOptions> = args::options(obj.get("defaults")?, "defaults", GENERATE_OPTION_KEYS)?;
            if let Some(m) = obj.get::<Unknown>("messages")?.filter(|m| m.get_type().is_ok_and(|t| t != ValueType::Undefined)) {
                args::messages::<ChatMessage>(&m, "messages", MESSAGE_KEYS)?;
            }
        }
        let options: Option<SessionOptions> = args::options(options, "", SESSION_OPTION_KEYS)?;
        let mut state = SessionState {
            system: None,
            tools: None,
            defaults: OptionValues::default(),
            history: vec![],
            busy: false,
            epoch: 0,
            resume: None,
        };
        if let Some(o) = options {
            if o.defaults.as_ref().is_some_and(|d| d.signal.is_some()) {
                return Err(err("defaults.signal is not supported: pass a signal to each send() instead"));
            }
            state.defaults = OptionValues::from_options(o.defaults.as_ref());
            // Validate the defaults now rather than on the first turn.
            generate_params(&state.defaults)?;
            state.system = o.system;
            state.tools = o.tools;
            if let Some(m) = o.messages {
                to_chat_messages(m.clone())?;
                state.history = m;
            }
        }
        Ok(ChatSession { worker, tokenizer, state: Arc::new(Mutex::new(state)) })
    }

    /// Checks the turn, marks the session busy and builds the work.
    fn begin(&self, input: Option<Unknown>, options: &Option<GenerateOptions<'_>>) -> Result<Turn> {
        let user = match input.filter(|v| v.get_type().is_ok_and(|t| t != ValueType::Undefined && t != ValueType::Null)) {
            None => None,
            Some(v) if v.get_type()? == ValueType::String => Some(message("user", args::value(&v, "input", "a string")?)),
            Some(v) => Some(args::message::<ChatMessage>(&v, "the message", MESSAGE_KEYS)?),
        };
        let mut s = self.state.lock();
        if s.busy {
            return Err(err("a turn is already in progress on this session; wait for it (or abort it) first"));
        }
        if user.is_none() && s.history.is_empty() {
            return Err(err("the session has no messages yet: send() needs a message"));
        }
        let mut values = s.defaults.overlay(&OptionValues::from_options(options.as_ref()));
        if values.tools.is_none() {
            values.tools = s.tools.clone();
        }
        let params = generate_params(&values)?;
        let tools = values.tools_value();
        let mut all: Vec<ChatMessage> = Vec::with_capacity(s.history.len() + 2);
        if let Some(sys) = &s.system {
            all.push(message("system", sys.clone()));
        }
        all.extend(s.history.iter().cloned());
        all.extend(user.iter().cloned());
        let messages = to_chat_messages(all)?;
        let trusted = values.trusted();
        s.busy = true;
        let epoch = s.epoch;
        let state = self.state.clone();
        let on_done: OnDone = Box::new(move |r: &Outcome| {
            let mut s = state.lock();
            if s.epoch != epoch {
                return;
            }
            s.busy = false;
            let Ok(r) = r else { return }; // a failed turn leaves the history as it was
            let tool_calls = r.tool_calls.as_ref().map(|c| c.iter().map(tool_call_json).collect::<Vec<_>>());
            if r.finish_reason == "abort" && r.text.is_empty() && tool_calls.is_none() {
                return; // aborted before it said anything: as if never sent
            }
            s.history.extend(user);
            let mut reply = message("assistant", r.text.clone());
            reply.tool_calls = tool_calls;
            s.history.push(reply);
        });
        let tokenizer = self.tokenizer.clone();
        let job: Job = Box::new(move || Ok((super::model::chat_prompt(&tokenizer, &messages, tools.as_ref(), trusted)?, params)));
        let resume = s.resume.take();
        Ok(Turn { job, on_done, resume })
    }

    /// `loadSession`'s options: only `defaults`.
    pub(crate) fn load_defaults(options: Option<Unknown<'_>>) -> Result<OptionValues> {
        if let Some(raw) = options.filter(|o| o.get_type().is_ok_and(|t| t == ValueType::Object)) {
            // SAFETY: checked to be an object of the current call's environment.
            let obj = unsafe { Object::from_napi_value(raw.value().env, raw.raw()) }?;
            let _: Option<GenerateOptions> = args::options(obj.get("defaults")?, "defaults", GENERATE_OPTION_KEYS)?;
        }
        let options: Option<LoadSessionOptions> = args::options(options, "", &["defaults"])?;
        let defaults = options.as_ref().and_then(|o| o.defaults.as_ref());
        if defaults.is_some_and(|d| d.signal.is_some()) {
            return Err(err("defaults.signal is not supported: pass a signal to each send() instead"));
        }
        let values = OptionValues::from_options(defaults);
        generate_params(&values)?;
        Ok(values)
    }

    /// A session restored by `loadSession` (on the worker thread).
    pub(crate) fn restored(
        worker: Arc<ModelWorker>,
        tokenizer: Arc<crate::text::Tokenizer>,
        defaults: OptionValues,
        loaded: crate::engine::session_file::Loaded,
    ) -> crate::Result<ChatSession> {
        let app = &loaded.app;
        let parsed = (|| -> crate::Result<SessionState> {
            let history = match app.get("messages") {
                Some(Value::Array(a)) => a.iter().map(message_from_json).collect::<crate::Result<Vec<_>>>()?,
                _ => return Err(Error::invalid("the session file's metadata has no messages")),
            };
            let tools = match app.get("tools") {
                Some(Value::Array(a)) => Some(a.clone()),
                _ => None,
            };
            let system = app.get("system").and_then(Value::as_str).map(String::from);
            Ok(SessionState { system, tools, defaults, history, busy: false, epoch: 0, resume: loaded.resume })
        })();
        match parsed {
            Ok(state) => Ok(ChatSession { worker, tokenizer, state: Arc::new(Mutex::new(state)) }),
            Err(e) => {
                if let Some(id) = loaded.resume {
                    worker.run(move |eng| Ok(eng.drop_resume(id)), |_: crate::Result<()>| {});
                }
                Err(e)
            }
        }
    }

    /// Lets go of a kept restored state.
    fn drop_resume(&self, id: Option<u64>) {
        if let Some(id) = id {
            self.worker.run(move |eng| Ok(eng.drop_resume(id)), |_: crate::Result<()>| {});
        }
    }

    /// Undoes `begin` when the turn could not even be queued.
    fn abandon(&self) {
        self.state.lock().busy = false;
    }
}

#[napi]
impl ChatSession {
    /// Sends a user message (a string, or a whole message such as
    /// `{ role: 'tool', ... }`) and generates the reply; without one, replies
    /// to the history as it is (after `addToolResult`). The message and the
    /// reply (with its tool calls) join the history once the turn is over.
    /// A failed turn leaves the history unchanged; an aborted one keeps the
    /// partial reply (or nothing, if it was aborted before any text).
    #[napi(
        ts_args_type = "input?: string | ChatMessage | undefined | null, options?: GenerateOptions | undefined | null",
        ts_return_type = "Promise<ChatResult>"
    )]
    pub fn send<'e>(&self, env: &'e Env, input: Option<Unknown<'e>>, options: Option<Unknown<'e>>) -> Result<Object<'e>> {
        let begun = generate_options(options).and_then(|options| Ok((self.begin(input, &options)?, options)));
        let (turn, options) = match begun {
            Ok(x) => x,
            Err(e) => return rejected(env, e),
        };
        let started = Abort::watch(env, options.as_ref().and_then(|o| o.signal.as_ref()))
            .and_then(|abort| run_request(&self.worker, env, abort, true, turn.job, Some(turn.on_done), turn.resume));
        match started {
            Ok(p) => Ok(p),
            Err(e) => {
                self.abandon();
                rejected(env, e)
            }
        }
    }

    /// `send()` as a stream of events (see `Lfm2Model.chatStream`).
    #[napi(ts_args_type = "input?: string | ChatMessage | undefined | null, options?: GenerateOptions | undefined | null")]
    pub fn send_stream<'e>(&self, env: &'e Env, input: Option<Unknown<'e>>, options: Option<Unknown<'e>>) -> Result<GenerationStream> {
        let options = generate_options(options).map_err(|e| classed(env, e))?;
        let turn = self.begin(input, &options).map_err(|e| classed(env, e))?;
        let started = Abort::watch(env, options.as_ref().and_then(|o| o.signal.as_ref()))
            .and_then(|abort| run_stream(&self.worker, env, abort, true, turn.job, Some(turn.on_done), turn.resume));
        if started.is_err() {
            self.abandon();
        }
        started.map_err(|e| classed(env, e))
    }

    /// Adds the result of a tool call from the history (by its id) as a
    /// `tool` message; then `send()` lets the model answer with it.
    /// Non-string content is sent as JSON.
    #[napi(ts_args_type = "toolCallId: string, content: string | object")]
    pub fn add_tool_result(&self, tool_call_id: String, content: Value) -> Result<()> {
        let mut s = self.state.lock();
        if s.busy {
            return Err(err("a turn is in progress on this session; add tool results once it is over"));
        }
        let name = s
            .history
            .iter()
            .rev()
            .filter(|m| m.role == "assistant")
            .filter_map(|m| m.tool_calls.as_ref())
            .flatten()
            .find(|c| c.get("id").and_then(Value::as_str) == Some(tool_call_id.as_str()))
            .map(|c| c.pointer("/function/name").and_then(Value::as_str).unwrap_or_default().to_string());
        let Some(name) = name else {
            return Err(err(format!("no tool call with id `{tool_call_id}` in this session's history")));
        };
        let content = match content {
            Value::String(s) => s,
            other => serde_json::to_string(&other).unwrap_or_default(),
        };
        let mut m = message("tool", content);
        m.tool_call_id = Some(tool_call_id);
        m.name = (!name.is_empty()).then_some(name);
        s.history.push(m);
        Ok(())
    }

    /// The conversation so far: the system prompt (if any) first, then every
    /// completed turn, tool calls and tool results included.
    #[napi(getter)]
    pub fn history(&self) -> Vec<ChatMessage> {
        let s = self.state.lock();
        s.system.iter().map(|sys| message("system", sys.clone())).chain(s.history.iter().cloned()).collect()
    }

    /// Forgets the conversation (the system prompt, tools and defaults stay).
    /// A turn in flight still resolves but is not recorded.
    #[napi]
    pub fn reset(&self) {
        let mut s = self.state.lock();
        s.history.clear();
        s.epoch += 1;
        s.busy = false;
        let resume = s.resume.take();
        drop(s);
        self.drop_resume(resume);
    }

    /// Saves the conversation and the model's state at its end to `file`
    /// (written to a temporary name, then renamed into place), for
    /// `model.loadSession(file)` in this or a later process. With the paged
    /// cache the state usually comes from the prefix cache; with flat
    /// caches the history is run through the model once. Rejects while a
    /// turn is in flight.
    #[napi(ts_args_type = "file: string", ts_return_type = "Promise<SaveResult>")]
    pub fn save<'e>(&self, env: &'e Env, file: Unknown<'e>) -> Result<Object<'e>> {
        let prepared = args::value::<String>(&file, "file", "a string (a file path)").and_then(|file| {
            let s = self.state.lock();
            if s.busy {
                return Err(err("a turn is in progress on this session; save it once the turn is over"));
            }
            if s.history.is_empty() {
                return Err(err("the session has no history yet: send() a message before saving"));
            }
            let mut all: Vec<ChatMessage> = s.system.iter().map(|sys| message("system", sys.clone())).collect();
            all.extend(s.history.iter().cloned());
            let messages = to_chat_messages(all)?;
            let app = json!({
                "system": s.system,
                "tools": s.tools,
                "messages": s.history.iter().map(message_json).collect::<Vec<_>>(),
            });
            Ok((file, messages, s.tools.clone().map(Value::Array), s.defaults.trusted(), app))
        });
        let (file, messages, tools, trusted, app) = match prepared {
            Ok(x) => x,
            Err(e) => return rejected(env, e),
        };
        let (deferred, promise) = env.create_deferred()?;
        let tokenizer = self.tokenizer.clone();
        self.worker.run(
            move |eng| {
                // The history as the next turn's prompt begins (no generation prompt).
                let tokens = tokenizer.apply_chat_template_with(&messages, tools.as_ref(), false, None, trusted)?;
                eng.save_session(&tokens, &app, std::path::Path::new(&file))
            },
            move |r| match r {
                Ok(saved) => deferred.resolve(move |_| Ok(SaveResult { tokens: saved.tokens as u32, bytes: saved.bytes as f64 })),
                Err(e) => deferred.reject(js_error(e)),
            },
        );
        Ok(promise)
    }
}

impl Drop for ChatSession {
    fn drop(&mut self) {
        let resume = self.state.lock().resume.take();
        self.drop_resume(resume);
    }
}
