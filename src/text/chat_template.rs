//! Chat templates: a checkpoint's Jinja template rendered with minijinja the
//! way Hugging Face transformers renders it (`trim_blocks`, `lstrip_blocks`,
//! loop controls, Python string/dict methods, `raise_exception`, a
//! `json.dumps`-compatible `tojson`, `strftime_now`).

use super::pyjson::{self, DumpOptions};
use super::strftime;
use crate::error::{Error, Result};
use minijinja::value::{Kwargs, Rest};
use minijinja::{Environment, ErrorKind as MjErrorKind, Value};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, OnceLock};

/// The LFM2 chat template (ChatML with `<|startoftext|>`, a system turn that
/// also carries the tool list, and wrapped tool responses). Fixture
/// checkpoints ship it as their `chat_template`.
pub const LFM2_CHAT_TEMPLATE: &str = include_str!("lfm2_template.jinja");

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message as the template sees it. `None` fields are left out of
/// the message object entirely (templates test them with `is defined` /
/// `'key' in message`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// A string, or a list of content parts (`[{"type": "text", "text": ...}]`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    /// A message with a plain string content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: Some(serde_json::Value::String(content.into())),
            ..Default::default()
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
    pub fn tool(content: impl Into<String>) -> Self {
        Self::new("tool", content)
    }
}

/// Marks an error raised by the template's own `raise_exception(...)`.
#[derive(Debug)]
struct RaisedException(String);

impl fmt::Display for RaisedException {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedException {}

/// A compiled chat template. Compile once, render many times; cheap to share
/// behind an `Arc` (it is `Send + Sync`).
pub struct ChatTemplate {
    env: Environment<'static>,
    source: Arc<str>,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .finish()
    }
}

/// Hugging Face's `tojson(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`; positional arguments follow that order.
fn tojson_filter(
    value: &Value,
    args: Rest<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    const NAMES: [&str; 4] = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > NAMES.len() {
        return Err(minijinja::Error::new(
            MjErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments (ensure_ascii, indent, separators, sort_keys)",
        ));
    }
    let mut slots: [Option<Value>; 4] = Default::default();
    for (i, v) in args.iter().enumerate() {
        slots[i] = Some(v.clone());
    }
    for (i, name) in NAMES.iter().enumerate() {
        if let Some(v) = kwargs.get::<Option<Value>>(name)? {
            if slots[i].is_some() {
                return Err(minijinja::Error::new(
                    MjErrorKind::InvalidOperation,
                    format!("tojson got multiple values for argument '{name}'"),
                ));
            }
            slots[i] = Some(v);
        }
    }
    kwargs.assert_all_used()?;
    let given = |v: &Option<Value>| {
        v.as_ref()
            .filter(|v| !v.is_none() && !v.is_undefined())
            .cloned()
    };

    let indent = match given(&slots[1]) {
        None => None,
        Some(v) if v.as_str().is_some() => Some(v.as_str().unwrap_or_default().to_string()),
        Some(v) => match v.as_i64() {
            Some(n) => Some(" ".repeat(n.max(0) as usize)),
            None => {
                return Err(minijinja::Error::new(
                    MjErrorKind::InvalidOperation,
                    format!(
                        "tojson: indent must be an integer or a string, not {}",
                        v.kind()
                    ),
                ))
            }
        },
    };
    let mut opts = DumpOptions::with_indent(indent);
    if let Some(v) = given(&slots[0]) {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = given(&slots[2]) {
        let parts: Vec<Value> = v.try_iter()?.collect();
        match parts.as_slice() {
            [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                opts.item_separator = item.as_str().unwrap_or_default().to_string();
                opts.key_separator = key.as_str().unwrap_or_default().to_string();
            }
            _ => {
                return Err(minijinja::Error::new(
                    MjErrorKind::InvalidOperation,
                    "tojson: separators must be a pair of strings (item_separator, key_separator)",
                ))
            }
        }
    }
    if let Some(v) = given(&slots[3]) {
        opts.sort_keys = v.is_true();
    }
    pyjson::dumps(value, &opts).map(Value::from_safe_string)
}

fn raise_exception(message: Option<Value>) -> std::result::Result<Value, minijinja::Error> {
    let msg = match message {
        Some(v) => match v.as_str() {
            Some(s) => s.to_string(),
            None => v.to_string(),
        },
        None => "raise_exception() called".to_string(),
    };
    Err(
        minijinja::Error::new(MjErrorKind::InvalidOperation, msg.clone())
            .with_source(RaisedException(msg)),
    )
}

fn strftime_now(format: String) -> String {
    strftime::format(&strftime::DateTime::now_local(), &format)
}

/// The message of a `raise_exception(...)` somewhere in the error chain.
fn raised_message(err: &minijinja::Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(r) = e.downcast_ref::<RaisedException>() {
            return Some(r.0.clone());
        }
        cur = e.source();
    }
    None
}

/// Turns a minijinja error into our `Text` error, with the template line.
/// Template instructions one render may run. LFM2's own template spends a
/// few hundred per message and a few thousand per tool; this leaves room
/// for conversations thousands of messages long, and stops a runaway loop
/// within well under a second.
pub const TEMPLATE_FUEL: u64 = 20_000_000;

fn convert_error(err: &minijinja::Error, source: &str, stage: &str) -> Error {
    if err.kind() == MjErrorKind::OutOfFuel {
        return Error::text(format!(
            "the chat template did not finish rendering within its limit of {TEMPLATE_FUEL} steps (a runaway loop, or \
             far too many messages or tools)"
        ));
    }
    let location = match err.line() {
        Some(line) => {
            let text = source
                .lines()
                .nth(line.saturating_sub(1))
                .unwrap_or("")
                .trim();
            let mut snippet: String = text.chars().take(160).collect();
            if text.chars().count() > 160 {
                snippet.push('…');
            }
            if snippet.is_empty() {
                format!(" (template line {line})")
            } else {
                format!(" (template line {line}: `{snippet}`)")
            }
        }
        None => String::new(),
    };
    if let Some(msg) = raised_message(err) {
        return Error::text(format!(
            "chat template raised an exception: {msg}{location}"
        ));
    }
    let mut detail = match err.detail() {
        Some(d) => format!("{}: {d}", err.kind()),
        None => err.kind().to_string(),
    };
    // Keep the underlying cause (e.g. a failing filter's own error).
    let mut cur = std::error::Error::source(err);
    while let Some(e) = cur {
        detail.push_str(&format!(": {e}"));
        cur = e.source();
    }
    Error::text(format!("chat template {stage} error: {detail}{location}"))
}

fn check_reserved(extra: Option<&serde_json::Map<String, serde_json::Value>>) -> Result<()> {
    if let Some(extra) = extra {
        for key in ["messages", "tools", "add_generation_prompt"] {
            if extra.contains_key(key) {
                return Err(Error::invalid(format!(
                    "chat template kwargs may not set `{key}`; pass it through its own argument"
                )));
            }
        }
    }
    Ok(())
}

impl ChatTemplate {
    /// Compiles `source`. Syntax errors become `Text` errors naming the line.
    pub fn new(source: impl Into<String>) -> Result<Self> {
        let source: String = source.into();
        let mut env = Environment::new();
        // transformers compiles with trim_blocks=True, lstrip_blocks=True and
        // Jinja's default keep_trailing_newline=False.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        // A render is bounded: a template (or messages) that loops for ever
        // fails instead of holding the model's thread and every request
        // queued behind it.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_filter("tojson", tojson_filter);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        let shared: Arc<str> = Arc::from(source.as_str());
        env.add_template_owned(TEMPLATE_NAME, source)
            .map_err(|e| convert_error(&e, &shared, "syntax"))?;
        Ok(ChatTemplate {
            env,
            source: shared,
        })
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders the conversation. `bos`/`eos` become `bos_token`/`eos_token`
    /// (left undefined when `None`); `extra` adds template kwargs (and may
    /// override `bos_token`/`eos_token`, as in transformers).
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        bos: Option<&str>,
        eos: Option<&str>,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String> {
        let mut specials = Vec::with_capacity(2);
        if let Some(b) = bos {
            specials.push(("bos_token", b));
        }
        if let Some(e) = eos {
            specials.push(("eos_token", e));
        }
        self.render_with(messages, tools, add_generation_prompt, &specials, extra)
    }

    /// Like [`render`](Self::render) with any number of special-token
    /// variables (`bos_token`, `eos_token`, `pad_token`, ...).
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        special_tokens: &[(&str, &str)],
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String> {
        check_reserved(extra)?;
        let mut ctx: BTreeMap<String, Value> = BTreeMap::new();
        for (name, value) in special_tokens {
            ctx.insert((*name).to_string(), Value::from(*value));
        }
        // transformers always passes `tools` and `documents` (None when absent).
        ctx.insert("documents".into(), Value::from(()));
        if let Some(extra) = extra {
            for (k, v) in extra {
                ctx.insert(k.clone(), Value::from_serialize(v));
            }
        }
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "tools".into(),
            match tools {
                Some(serde_json::Value::Null) | None => Value::from(()),
                Some(t) => Value::from_serialize(t),
            },
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| convert_error(&e, &self.source, "syntax"))?;
        template
            .render(Value::from_iter(ctx))
            .map_err(|e| convert_error(&e, &self.source, "render"))
    }
}

/// Compiled templates shared by [`render_chat`], keyed by source text.
fn template_cache() -> &'static Mutex<HashMap<Arc<str>, Arc<ChatTemplate>>> {
    static CACHE: OnceLock<Mutex<HashMap<Arc<str>, Arc<ChatTemplate>>>> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

const TEMPLATE_CACHE_CAPACITY: usize = 16;

/// Compiles `source` or fetches it from the process-wide cache.
pub fn compile_cached(source: &str) -> Result<Arc<ChatTemplate>> {
    if let Some(t) = template_cache().lock().get(source) {
        return Ok(t.clone());
    }
    // Compile outside the lock; a concurrent duplicate compile is harmless.
    let compiled = Arc::new(ChatTemplate::new(source)?);
    let mut cache = template_cache().lock();
    if cache.len() >= TEMPLATE_CACHE_CAPACITY {
        cache.clear();
    }
    cache.insert(compiled.source.clone(), compiled.clone());
    Ok(compiled)
}

/// Renders `template` (compiled once per distinct text, then cached) with
/// the conversation, like transformers' `apply_chat_template(tokenize=False)`.
pub fn render_chat(
    template: &str,
    messages: &[ChatMessage],
    tools: Option<&serde_json::Value>,
    add_generation_prompt: bool,
    bos: Option<&str>,
    eos: Option<&str>,
    extra: Option<&serde_json::Map<String, serde_json::Value>>,
) -> Result<String> {
    compile_cached(template)?.render(messages, tools, add_generation_prompt, bos, eos, extra)
}
