//! Constrained decoding with llguidance: a JSON schema, a Lark grammar, a
//! regular expression, or LFM2's tool-call syntax restricts which tokens
//! may come next. The parser runs on the CPU; its mask is applied as -inf
//! on the disallowed logits before the draw (see `Sequence`: the mask for
//! step t+1 is computed while the device runs that step's forward).
//!
//! The vocabulary is handed to llguidance as each token's bytes (built here
//! from our tokenizer, so llguidance's own tokenizers integration, which
//! pins another `tokenizers` version, is not needed).

use crate::error::{Error, Result};
use crate::mlx::{self, Array, Dtype};
use crate::text::tool_calls::{TOOL_CALL_END, TOOL_CALL_START};
use crate::text::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};
use std::sync::Arc;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// What the output must match.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Grammar {
    /// A JSON schema (generated compactly unless its `x-guidance` says otherwise).
    JsonSchema(Value),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// A regular expression the whole output matches.
    Regex(String),
    /// One or more LFM2 tool calls (the JSON form between the tool-call
    /// markers) to these tools: (name, JSON schema of the arguments).
    /// `single`: exactly one call.
    ToolCalls { tools: Vec<(String, Value)>, single: bool },
    /// Free output, but a tool call the model starts (its start marker) is
    /// completed under the tools' schemas (`toolChoice: 'auto'`).
    ToolCallsAuto { tools: Vec<(String, Value)> },
}

impl Grammar {
    /// The option the caller set, for messages.
    pub fn option_name(&self) -> &'static str {
        match self {
            Grammar::JsonSchema(_) => "jsonSchema",
            Grammar::Lark(_) => "grammar",
            Grammar::Regex(_) => "regex",
            Grammar::ToolCalls { .. } | Grammar::ToolCallsAuto { .. } => "toolChoice",
        }
    }
}

/// Compact JSON (no free whitespace) unless the schema says otherwise:
/// what OpenAI's structured outputs produce, and fewer tokens. It also
/// bounds the output: llguidance's flexible whitespace is an unbounded run
/// at every gap, which a weak model can fill until maxTokens.
/// `true` (any JSON) becomes `{}` to carry the option: llguidance reads
/// `x-guidance` only from a top-level object.
fn compact(schema: Value) -> Value {
    let mut schema = if schema == Value::Bool(true) { json!({}) } else { schema };
    if let Value::Object(m) = &mut schema {
        m.entry("x-guidance").or_insert_with(|| json!({ "whitespace_flexible": false }));
    }
    schema
}

/// A model's vocabulary as llguidance sees it, and the parser factory over
/// it (built once per model, on first use).
pub struct Guide {
    factory: ParserFactory,
    vocab: usize,
    tool_start: Option<u32>,
    tool_end: Option<u32>,
}

struct Vocab {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| self.tokenizer.encode(s, false).unwrap_or_default())
    }
}

/// GPT-2's byte-level alphabet: the character each byte is written as in
/// a byte-level BPE vocabulary.
fn byte_level_chars() -> std::collections::HashMap<char, u8> {
    let mut map = std::collections::HashMap::new();
    let mut next = 256u32;
    for b in 0..=255u8 {
        let c = b as char;
        let printable = matches!(c, '!'..='~' | '\u{a1}'..='\u{ac}' | '\u{ae}'..='\u{ff}');
        if printable {
            map.insert(c, b);
        } else {
            map.insert(char::from_u32(next).expect("in range"), b);
            next += 1;
        }
    }
    map
}

fn is_byte_level(d: &tokenizers::DecoderWrapper) -> bool {
    match d {
        tokenizers::DecoderWrapper::ByteLevel(_) => true,
        tokenizers::DecoderWrapper::Sequence(s) => s.get_decoders().iter().any(is_byte_level),
        _ => false,
    }
}

impl Guide {
    /// `vocab`: the model's output width (at least the tokenizer's);
    /// `eos`: the tokens that end a generation (allowed once the grammar is complete).
    pub fn new(tokenizer: &Tokenizer, vocab: usize, eos: &[u32]) -> Result<Guide> {
        let inner = tokenizer.inner();
        if !inner.get_decoder().is_some_and(is_byte_level) {
            return Err(Error::invalid("constrained decoding needs a byte-level BPE tokenizer; this model's tokenizer is not one"));
        }
        let Some(&first_eos) = eos.first() else {
            return Err(Error::invalid("constrained decoding needs an end-of-sequence token; this model has none"));
        };
        let chars = byte_level_chars();
        let added = inner.get_added_tokens_decoder();
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                if let Some(a) = added.get(&id) {
                    // Control tokens (and any added `<...>` token, as
                    // llguidance's own integration does) are never text:
                    // a grammar names them by id.
                    if a.special || tokenizer.is_special(id) || (a.content.starts_with('<') && a.content.ends_with('>')) {
                        let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                        b.extend_from_slice(a.content.as_bytes());
                        return b;
                    }
                    return a.content.as_bytes().to_vec();
                }
                match inner.id_to_token(id) {
                    Some(t) => t.chars().map(|c| chars.get(&c).copied()).collect::<Option<Vec<u8>>>().unwrap_or_default(),
                    // Rows past the tokenizer (padding): never allowed as text.
                    None => {
                        let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                        b.extend_from_slice(format!("<[pad{id}]>").as_bytes());
                        b
                    }
                }
            })
            .collect();
        let info = TokRxInfo::new(vocab as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(Vocab { trie, tokenizer: tokenizer.clone() });
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| Error::invalid(format!("constrained decoding could not start: {e}")))?;
        factory.quiet();
        Ok(Guide {
            factory,
            vocab,
            tool_start: tokenizer.token_to_id(TOOL_CALL_START),
            tool_end: tokenizer.token_to_id(TOOL_CALL_END),
        })
    }

    fn top_level(&self, g: &Grammar) -> Result<TopLevelGrammar> {
        Ok(match g {
            Grammar::JsonSchema(s) => {
                if !s.is_object() && !s.is_boolean() {
                    return Err(Error::invalid("jsonSchema must be a JSON schema (an object)"));
                }
                TopLevelGrammar::from_json_schema(compact(s.clone()))
            }
            Grammar::Lark(l) => TopLevelGrammar::from_lark(l.clone()),
            Grammar::Regex(r) => TopLevelGrammar::from_regex(r),
            Grammar::ToolCalls { tools, .. } | Grammar::ToolCallsAuto { tools } => {
                let single = matches!(g, Grammar::ToolCalls { single: true, .. });
                let (Some(start), Some(end)) = (self.tool_start, self.tool_end) else {
                    return Err(Error::invalid(format!(
                        "toolChoice needs the tokenizer's {TOOL_CALL_START} and {TOOL_CALL_END} tokens; this model has none"
                    )));
                };
                if tools.is_empty() {
                    return Err(Error::invalid("toolChoice needs `tools` to choose from"));
                }
                let calls: Vec<Value> = tools
                    .iter()
                    .map(|(name, params)| {
                        json!({
                            "type": "object",
                            "properties": { "name": { "const": name }, "arguments": params },
                            "required": ["name", "arguments"],
                            "additionalProperties": false,
                        })
                    })
                    .collect();
                let mut list = json!({ "type": "array", "items": { "anyOf": calls }, "minItems": 1 });
                if single {
                    list["maxItems"] = json!(1);
                }
                let schema = serde_json::to_string(&compact(list)).map_err(|e| Error::invalid(e.to_string()))?;
                // 'auto' takes over after the model wrote the start marker.
                let opening = if matches!(g, Grammar::ToolCallsAuto { .. }) { String::new() } else { format!("<[{start}]> ") };
                TopLevelGrammar::from_lark(format!("start: {opening}%json {schema} <[{end}]>"))
            }
        })
    }
}

/// One request's parser state.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
    /// The next step's allowed tokens, when computed before they are asked
    /// for: the first step's when compiling (to catch a grammar nothing can
    /// satisfy before any compute), a batch row's by [`Constraint::prepare`].
    ready: Option<Result<Option<Vec<bool>>>>,
    /// The token [`Constraint::prepare`] committed, and how that went (what
    /// the matching [`Constraint::commit`] reports).
    committed: Option<(u32, Result<()>)>,
}

// A batch's rows are prepared on other threads (see `prepare_rows`).
const _: () = {
    const fn send<T: Send>() {}
    send::<Constraint>()
};

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

impl Constraint {
    /// Compiles `g`; a bad grammar or schema is an error naming its option.
    pub fn compile(guide: &Guide, g: &Grammar) -> Result<Constraint> {
        let name = g.option_name();
        let bad = |e: String| Error::invalid(format!("{name} is not valid: {e}"));
        let parser = guide.factory.create_parser(guide.top_level(g)?).map_err(|e| bad(e.to_string()))?;
        let mut c = Constraint { matcher: Matcher::new(Ok(parser)), vocab: guide.vocab, ready: None, committed: None };
        if let Some(e) = c.matcher.get_error() {
            return Err(bad(e));
        }
        match c.allowed()? {
            Some(m) => c.ready = Some(Ok(Some(m))),
            None => return Err(bad("no output can satisfy it (no token may start it)".into())),
        }
        Ok(c)
    }

    /// The tokens allowed next; None when there are none.
    fn allowed(&mut self) -> Result<Option<Vec<bool>>> {
        let vob = self.matcher.compute_mask_or_eos().map_err(|e| Error::invalid(format!("constrained decoding failed: {e}")))?;
        if vob.is_zero() {
            return Ok(None);
        }
        let mut bits = vec![false; self.vocab];
        vob.iter_set_entries(|i| {
            if i < bits.len() {
                bits[i] = true;
            }
        });
        Ok(Some(bits))
    }

    /// The mask of the next step (`[1, V]` bool), or None when no token is
    /// allowed (the constraint cannot be continued).
    pub fn mask(&mut self) -> Result<Option<Array>> {
        let bits = match self.ready.take() {
            Some(r) => r?,
            None => self.allowed()?,
        };
        bits.map(|b| Array::from_slice(&b, &[1, self.vocab as i32])).transpose()
    }

    /// `logits` with the disallowed tokens at -inf.
    pub fn apply(logits: &Array, mask: &Array) -> Result<Array> {
        mlx::where_(mask, logits, &Array::scalar(f64::NEG_INFINITY, Dtype::Float32)?.astype(logits.dtype())?)
    }

    /// Advances past a drawn token. An error means the token was not
    /// allowed (the parser is then stuck).
    pub fn commit(&mut self, tok: u32) -> Result<()> {
        if let Some((done, r)) = self.committed.take() {
            return match done == tok {
                true => r,
                false => Err(Error::invalid(format!(
                    "constrained decoding failed: token {done} was committed ahead, not {tok} (internal error)"
                ))),
            };
        }
        self.matcher.consume_token(tok).map_err(|e| Error::invalid(format!("constrained decoding failed: {e}")))
    }

    /// Commits `tok` now and, when `then_mask` and the grammar goes on,
    /// computes the next step's allowed tokens: a batch row's CPU work, run
    /// on another thread before the worker handles the rows one by one
    /// (their [`Constraint::commit`] of `tok` and [`Constraint::mask`] then
    /// hand over what was done here). llguidance's matcher turns a panic of
    /// its own into an error, so a row's failure stays the row's.
    pub fn prepare(&mut self, tok: u32, then_mask: bool) {
        let r = self.commit(tok);
        self.ready = (then_mask && r.is_ok() && !self.is_done()).then(|| self.allowed());
        self.committed = Some((tok, r));
    }

    /// The output is complete: the grammar allows nothing more.
    pub fn is_done(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// [`Constraint::prepare`] for several batch rows at once on rayon's pool,
/// a row per thread: N constrained rows cost about one row's parser time a
/// step on a many-core host, not N. Pure CPU work (no MLX call).
pub fn prepare_rows(rows: &mut [(&mut Constraint, u32, bool)]) {
    let Some(((c, tok, then_mask), rest)) = rows.split_first_mut() else { return };
    rayon::in_place_scope(|s| {
        for (c, tok, then_mask) in rest.iter_mut() {
            s.spawn(move |_| c.prepare(*tok, *then_mask));
        }
        c.prepare(*tok, *then_mask);
    });
}

/// `toolChoice: 'auto'`: the parser for a tool call (compiled up front),
/// started when the model writes the start marker.
pub struct ToolWatch {
    pub start: u32,
    pub template: Constraint,
    /// The processed logits of the last free draw: redrawn under the mask
    /// when the token before it turns out to be the start marker.
    pub stash: Option<Array>,
}

impl ToolWatch {
    pub fn new(guide: &Guide, g: &Grammar) -> Result<ToolWatch> {
        let start = guide.tool_start.ok_or_else(|| Error::invalid(format!("toolChoice needs the tokenizer's {TOOL_CALL_START} token")))?;
        Ok(ToolWatch { start, template: Constraint::compile(guide, g)?, stash: None })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixture::{self, FixtureSpec, Preset, EOS_TOKEN_ID};

    /// The tiny fixture's tokenizer, its guide, and each token's text.
    fn setup(name: &str) -> (Guide, Tokenizer, Vec<String>) {
        let dir = std::env::temp_dir().join(format!("mlxlfm-constraint-{}-{name}", std::process::id()));
        std::fs::remove_dir_all(&dir).ok();
        let spec = FixtureSpec::new(Preset::Tiny);
        fixture::generate(&spec, &dir).unwrap();
        let tok = Tokenizer::load(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let guide = Guide::new(&tok, spec.vocab_size(), &[EOS_TOKEN_ID]).unwrap();
        let texts = (0..spec.vocab_size() as u32).map(|id| tok.decode(&[id], false).unwrap_or_default()).collect();
        (guide, tok, texts)
    }

    /// Walks `text` token by token under `schema`; at each point outside a
    /// string, the allowed tokens that open with whitespace. Asserts the
    /// constraint is complete exactly after the last token.
    fn walk(guide: &Guide, tok: &Tokenizer, texts: &[String], schema: Value, text: &str) -> Vec<String> {
        let mut c = Constraint::compile(guide, &Grammar::JsonSchema(schema)).unwrap();
        c.ready = None;
        let ids = tok.encode(text, false).unwrap();
        let mut spaced = vec![];
        for (k, &id) in ids.iter().enumerate() {
            assert!(!c.is_done(), "complete after {k} of {} tokens of {text}", ids.len());
            let so_far = tok.decode(&ids[..k], false).unwrap();
            let allowed = c.allowed().unwrap().expect("some token is allowed");
            assert!(allowed[id as usize], "{:?} not allowed after {so_far:?}", texts[id as usize]);
            if so_far.matches('"').count().is_multiple_of(2) {
                spaced.extend(
                    (0..allowed.len())
                        .filter(|&i| allowed[i] && texts[i].starts_with(char::is_whitespace))
                        .map(|i| format!("{:?} after {so_far:?}", texts[i])),
                );
            }
            c.commit(id).unwrap();
        }
        assert!(c.is_done(), "not complete after {text}");
        spaced
    }

    /// `response_format: json_object` is `{type: 'object'}`; `true` is any
    /// JSON. Both are compact (a random model cannot pad with whitespace
    /// forever) and end as soon as the value closes (nothing may follow).
    #[test]
    fn json_object_and_any_json_are_compact_and_end_when_the_value_closes() {
        let (guide, tok, texts) = setup("json-object");
        let text = r#"{"a":[1,{"b":null}],"c":"x y","d":-2.5e3,"e":true}"#;
        for schema in [json!({ "type": "object" }), json!(true)] {
            let spaced = walk(&guide, &tok, &texts, schema.clone(), text);
            assert!(spaced.is_empty(), "{schema}: whitespace allowed: {spaced:?}");
        }
        // The check can fail: whitespace the schema asks for is offered.
        let flexible = json!({ "type": "object", "x-guidance": { "whitespace_flexible": true } });
        assert!(!walk(&guide, &tok, &texts, flexible, text).is_empty());
        // An object is not any JSON: `[` cannot start json_object output.
        let c = Constraint::compile(&guide, &Grammar::JsonSchema(json!({ "type": "object" }))).unwrap();
        let first = c.ready.clone().unwrap().unwrap().unwrap();
        let starts: Vec<&str> = (0..first.len()).filter(|&i| first[i]).map(|i| texts[i].as_str()).collect();
        assert!(!starts.is_empty() && starts.iter().all(|t| t.starts_with('{')), "{starts:?}");
    }
}
