//! The checkpoint's tokenizer: `tokenizer.json` through the `tokenizers`
//! crate plus the Hugging Face side files (`tokenizer_config.json`,
//! `chat_template.jinja`, `special_tokens_map.json`) for special tokens and
//! the chat template.

use super::chat_template::{ChatMessage, ChatTemplate};
use crate::error::{Error, Result};
use serde_json::Value as Json;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// A loaded tokenizer. Cloning is cheap (the vocabulary is shared).
#[derive(Clone)]
pub struct Tokenizer {
    pub(crate) inner: Arc<tokenizers::Tokenizer>,
    dir: PathBuf,
    bos_token: Option<String>,
    eos_token: Option<String>,
    pad_token: Option<String>,
    unk_token: Option<String>,
    eos_ids: Vec<u32>,
    special_ids: Arc<HashSet<u32>>,
    vocab_size: usize,
    chat_template: Option<Arc<str>>,
    /// The compiled chat template, built on first use (a broken template must
    /// not stop raw-prompt generation).
    compiled: Arc<OnceLock<Result<Arc<ChatTemplate>>>>,
    /// The text of every special (control) token, longest first.
    special_texts: Arc<Vec<String>>,
    /// The same tokenizer with special tokens encoded as plain text (for
    /// text that came from messages), built on first use.
    literal: Arc<OnceLock<tokenizers::Tokenizer>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

/// A special-token field: a plain string or an AddedToken object
/// (`{"content": "...", "__type": "AddedToken", ...}`); `null` means unset.
fn token_field(value: Option<&Json>) -> Option<String> {
    match value? {
        Json::String(s) => Some(s.clone()),
        Json::Object(map) => map
            .get("content")
            .and_then(Json::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// `chat_template` is either a string or a list of `{name, template}`:
/// take the one named "default", else the first.
fn template_field(value: Option<&Json>, file: &Path) -> Result<Option<String>> {
    match value {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some(s.clone())),
        Some(Json::Array(items)) => {
            let named = |item: &Json| -> Option<(String, String)> {
                let name = item.get("name")?.as_str()?.to_string();
                let template = item.get("template")?.as_str()?.to_string();
                Some((name, template))
            };
            let mut first = None;
            for item in items {
                let Some((name, template)) = named(item) else {
                    return Err(Error::load(format!(
                        "{}: chat_template list entries must be {{\"name\": ..., \"template\": ...}} objects",
                        file.display()
                    )));
                };
                if name == "default" {
                    return Ok(Some(template));
                }
                first.get_or_insert(template);
            }
            Ok(first)
        }
        Some(other) => Err(Error::load(format!(
            "{}: chat_template must be a string or a list of named templates, not {}",
            file.display(),
            json_kind(other)
        ))),
    }
}

fn json_kind(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "an object",
    }
}

/// Reads and parses an optional JSON file; `Ok(None)` when it does not exist.
fn read_optional_json(path: &Path) -> Result<Option<serde_json::Map<String, Json>>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::load(format!("cannot read {}: {e}", path.display()))),
    };
    match serde_json::from_str::<Json>(&text) {
        Ok(Json::Object(map)) => Ok(Some(map)),
        Ok(other) => Err(Error::load(format!(
            "{}: expected a JSON object, found {}",
            path.display(),
            json_kind(&other)
        ))),
        Err(e) => Err(Error::load(format!("cannot parse {}: {e}", path.display()))),
    }
}

fn read_optional_text(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(t) => Ok(Some(t)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::load(format!("cannot read {}: {e}", path.display()))),
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json` plus the optional side files.
    ///
    /// The chat template comes from `chat_template.jinja` when present
    /// (newer transformers save it there and prefer it), else from
    /// `tokenizer_config.json`'s `chat_template`, else from
    /// `chat_template.json`. bos/eos/pad/unk come from `tokenizer_config.json`,
    /// falling back to `special_tokens_map.json`.
    pub fn load(dir: &Path) -> Result<Tokenizer> {
        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.is_file() {
            return Err(Error::load(format!(
                "tokenizer file {} not found (the checkpoint needs a Hugging Face tokenizer.json)",
                tokenizer_path.display()
            )));
        }
        let inner = tokenizers::Tokenizer::from_file(&tokenizer_path)
            .map_err(|e| Error::load(format!("cannot parse {}: {e}", tokenizer_path.display())))?;

        let config_path = dir.join("tokenizer_config.json");
        let config = read_optional_json(&config_path)?.unwrap_or_default();
        let map_path = dir.join("special_tokens_map.json");
        let special_map = read_optional_json(&map_path)?.unwrap_or_default();
        let special =
            |key: &str| token_field(config.get(key)).or_else(|| token_field(special_map.get(key)));

        let jinja_path = dir.join("chat_template.jinja");
        let mut chat_template = read_optional_text(&jinja_path)?;
        if chat_template.is_none() {
            chat_template = template_field(config.get("chat_template"), &config_path)?;
        }
        if chat_template.is_none() {
            let path = dir.join("chat_template.json");
            if let Some(map) = read_optional_json(&path)? {
                chat_template = template_field(map.get("chat_template"), &path)?;
            }
        }

        let mut tok = Tokenizer::from_parts(
            inner,
            special("bos_token"),
            special("eos_token"),
            chat_template,
        );
        tok.dir = dir.to_path_buf();
        tok.pad_token = special("pad_token");
        tok.unk_token = special("unk_token");
        Ok(tok)
    }

    /// Builds a tokenizer from an in-memory `tokenizers::Tokenizer`.
    pub fn from_parts(
        inner: tokenizers::Tokenizer,
        bos_token: Option<String>,
        eos_token: Option<String>,
        chat_template: Option<String>,
    ) -> Tokenizer {
        let specials: Vec<(u32, String)> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, tok)| tok.special && !tok.content.is_empty())
            .map(|(id, tok)| (id, tok.content))
            .collect();
        let special_ids: HashSet<u32> = specials.iter().map(|(id, _)| *id).collect();
        let mut special_texts: Vec<String> = specials.into_iter().map(|(_, t)| t).collect();
        special_texts.sort_by_key(|t| std::cmp::Reverse(t.len()));
        let vocab_size = inner.get_vocab_size(true);
        let eos_ids = eos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .into_iter()
            .collect();
        Tokenizer {
            inner: Arc::new(inner),
            dir: PathBuf::new(),
            bos_token,
            eos_token,
            pad_token: None,
            unk_token: None,
            eos_ids,
            special_ids: Arc::new(special_ids),
            vocab_size,
            chat_template: chat_template.map(Arc::from),
            compiled: Arc::new(OnceLock::new()),
            special_texts: Arc::new(special_texts),
            literal: Arc::new(OnceLock::new()),
        }
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The directory this tokenizer was loaded from (empty for `from_parts`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| Error::text(format!("tokenizer failed to encode text: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner.decode(ids, skip_special_tokens).map_err(|e| {
            Error::text(format!(
                "tokenizer failed to decode {} token(s): {e}",
                ids.len()
            ))
        })
    }

    /// Encodes a raw prompt for generation, as mlx-lm does: special tokens
    /// (the BOS) are added unless the tokenizer has a BOS token and the
    /// prompt already starts with it.
    pub fn encode_for_generation(&self, prompt: &str) -> Result<Vec<u32>> {
        let add_special = match self.bos_token.as_deref() {
            Some(bos) if !bos.is_empty() => !prompt.starts_with(bos),
            _ => true,
        };
        self.encode(prompt, add_special)
    }

    /// [`Tokenizer::decode`] for ids from a caller: an id the tokenizer has
    /// no token for is an error naming it (decode itself skips it without a
    /// word, which generation relies on for a model's padded vocabulary).
    pub fn decode_checked(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        if let Some(&bad) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(Error::invalid(format!(
                "token id {bad} is not in the tokenizer's vocabulary ({} tokens)",
                self.vocab_size
            )));
        }
        self.decode(ids, skip_special_tokens)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    pub fn pad_token(&self) -> Option<&str> {
        self.pad_token.as_deref()
    }

    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token.as_deref().and_then(|t| self.token_to_id(t))
    }

    /// The configured eos token's id (empty when unset or not in the
    /// vocabulary). Nothing else (`<|im_end|>`, generation_config) is added here.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_ids.clone()
    }

    /// Whether `id` is an added token marked special.
    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Replaces the chat template (e.g. a caller-supplied one); `None` removes it.
    pub fn set_chat_template(&mut self, template: Option<String>) {
        self.chat_template = template.map(Arc::from);
        self.compiled = Arc::new(OnceLock::new());
    }

    fn compiled_template(&self) -> Result<Arc<ChatTemplate>> {
        let Some(source) = self.chat_template.as_deref() else {
            return Err(Error::text(
                "this checkpoint has no chat template (no chat_template.jinja and no chat_template \
                 in tokenizer_config.json); pass a raw prompt to generate() instead of messages",
            ));
        };
        self.compiled
            .get_or_init(|| ChatTemplate::new(source).map(Arc::new))
            .clone()
    }

    /// Renders the conversation with the checkpoint's chat template
    /// (`tokenize=False` in transformers terms).
    pub fn render_chat_template(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<String> {
        let template = self.compiled_template()?;
        // Structured assistant tool calls become LFM2's tool-call text when
        // the template does not render `tool_calls` itself.
        let messages = super::tool_calls::inline_tool_calls(messages, template.source())?;
        let messages = &messages[..];
        let mut specials: Vec<(&str, &str)> = Vec::with_capacity(4);
        for (name, value) in [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
            ("pad_token", &self.pad_token),
            ("unk_token", &self.unk_token),
        ] {
            if let Some(v) = value.as_deref() {
                specials.push((name, v));
            }
        }
        template.render_with(messages, tools, add_generation_prompt, &specials, extra)
    }

    /// Renders the chat template and encodes the result without adding
    /// special tokens (the template itself writes the BOS), as transformers
    /// and mlx-lm do.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
    ) -> Result<Vec<u32>> {
        self.apply_chat_template_with(messages, tools, add_generation_prompt, extra, false)
    }

    /// `apply_chat_template`, where `trusted` lets control tokens written in
    /// message text become the special tokens they spell (the render is
    /// encoded as one text, as transformers and mlx-lm do). For callers who
    /// wrote every message themselves; untrusted text must not get this.
    pub fn apply_chat_template_with(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        extra: Option<&serde_json::Map<String, serde_json::Value>>,
        trusted: bool,
    ) -> Result<Vec<u32>> {
        let text = self.render_chat_template(messages, tools, add_generation_prompt, extra)?;
        if trusted || !super::message_text::carries_control_tokens(messages, &self.special_texts) {
            return self.encode(&text, false);
        }
        // Some message holds a control token's text (`<|im_end|>` in user
        // content): render again with every message string marked, and
        // encode the marked spans with special tokens as plain text, so a
        // message can never end its turn or open a system one.
        let marked = super::message_text::mark(messages)?;
        let marked_text = self.render_chat_template(&marked, tools, add_generation_prompt, extra)?;
        let mut ids = Vec::new();
        for (literal, part) in super::message_text::segments(&marked_text, &text)? {
            if literal {
                let lit = self.literal.get_or_init(|| {
                    let mut t = (*self.inner).clone();
                    t.set_encode_special_tokens(true);
                    t
                });
                let enc = lit.encode(part, false).map_err(|e| Error::text(format!("tokenizer failed on message text: {e}")))?;
                ids.extend_from_slice(enc.get_ids());
            } else {
                ids.extend(self.encode(part, false)?);
            }
        }
        Ok(ids)
    }
}
