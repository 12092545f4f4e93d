//! LFM2 tool calls: the model writes
//! `<|tool_call_start|>[name(arg=value, ...), other(...)]<|tool_call_end|>`
//! with Python-literal values. This module
//!
//! - splits generated text into plain text and tool-call regions, also
//!   incrementally ([`ToolCallSplitter`], so a stream never shows the markup);
//! - parses a region into calls with JSON arguments ([`parse_calls`]), also
//!   accepting the JSON form (`[{"name": ..., "arguments": {...}}]`) that
//!   LFM2 writes when its system prompt asks for JSON;
//! - renders OpenAI-shaped `tool_calls` back into LFM2's text, for chat
//!   templates that do not render `tool_calls` themselves ([`inline_tool_calls`]).
//!
//! Malformed calls are reported with the raw text and a message naming the
//! problem and its offset; nothing is dropped silently.

use super::chat_template::ChatMessage;
use crate::error::{Error, Result};
use serde_json::{Map, Number, Value};
use std::borrow::Cow;

pub const TOOL_CALL_START: &str = "<|tool_call_start|>";
pub const TOOL_CALL_END: &str = "<|tool_call_end|>";

/// Deepest nesting of lists/dicts accepted in arguments.
const MAX_DEPTH: usize = 128;

/// One parsed call: the function name and its arguments (a JSON object).
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

impl ParsedCall {
    /// The arguments as a JSON string (OpenAI's `function.arguments`).
    pub fn arguments_json(&self) -> String {
        serde_json::to_string(&self.arguments).unwrap_or_else(|_| "{}".into())
    }
}

/// A tool-call region that could not be parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCallError {
    /// The region exactly as generated, markers included.
    pub raw: String,
    pub message: String,
}

/// Generated text split into what the user reads and the tool calls.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolOutput {
    /// The text outside tool-call markers.
    pub text: String,
    pub calls: Vec<ParsedCall>,
    pub errors: Vec<ToolCallError>,
}

/// Splits text that arrives in pieces into plain text (returned as it
/// becomes safe to show) and tool-call regions (kept). A tail that could be
/// the start of `<|tool_call_start|>` is held back until it is decided.
#[derive(Debug, Clone, Default)]
pub struct ToolCallSplitter {
    pending: String,
    in_call: bool,
    text: String,
    /// Region contents between the markers; `true` when closed.
    regions: Vec<(String, bool)>,
}

/// Length of the longest proper prefix of `marker` that `s` ends with.
fn held_prefix(s: &str, marker: &str) -> usize {
    let max = (marker.len() - 1).min(s.len());
    (1..=max).rev().find(|&l| s.ends_with(&marker[..l])).unwrap_or(0)
}

impl ToolCallSplitter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds generated text; returns the plain text that is now safe to show.
    pub fn push(&mut self, delta: &str) -> String {
        self.pending.push_str(delta);
        let mut out = String::new();
        loop {
            if self.in_call {
                match self.pending.find(TOOL_CALL_END) {
                    Some(j) => {
                        let inner = self.pending[..j].to_string();
                        self.pending.drain(..j + TOOL_CALL_END.len());
                        self.regions.push((inner, true));
                        self.in_call = false;
                    }
                    None => break,
                }
            } else {
                match self.pending.find(TOOL_CALL_START) {
                    Some(i) => {
                        out.push_str(&self.pending[..i]);
                        self.pending.drain(..i + TOOL_CALL_START.len());
                        self.in_call = true;
                    }
                    None => {
                        // The marker is ASCII, so the held tail starts on a char boundary.
                        let keep = held_prefix(&self.pending, TOOL_CALL_START);
                        let emit = self.pending.len() - keep;
                        out.push_str(&self.pending[..emit]);
                        self.pending.drain(..emit);
                        break;
                    }
                }
            }
        }
        self.text.push_str(&out);
        out
    }

    /// Ends the text: returns the held-back plain text, and records a call
    /// region that was never closed.
    pub fn finish(&mut self) -> String {
        let pending = std::mem::take(&mut self.pending);
        if self.in_call {
            self.in_call = false;
            self.regions.push((pending, false));
            String::new()
        } else {
            self.text.push_str(&pending);
            pending
        }
    }

    /// Whether a tool-call region has started.
    pub fn saw_tool_call(&self) -> bool {
        self.in_call || !self.regions.is_empty()
    }

    /// The plain text emitted so far.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Parses the regions seen (call after [`finish`](Self::finish)).
    pub fn into_output(self) -> ToolOutput {
        let mut out = ToolOutput { text: self.text, ..Default::default() };
        for (inner, closed) in self.regions {
            if !closed {
                out.errors.push(ToolCallError {
                    raw: format!("{TOOL_CALL_START}{inner}"),
                    message: format!("the tool call is not closed with {TOOL_CALL_END} (generation ended inside it)"),
                });
                continue;
            }
            match parse_calls(&inner) {
                Ok(calls) => out.calls.extend(calls),
                Err(message) => out.errors.push(ToolCallError {
                    raw: format!("{TOOL_CALL_START}{inner}{TOOL_CALL_END}"),
                    message,
                }),
            }
        }
        out
    }
}

/// Splits a whole generated text into plain text and parsed tool calls.
pub fn parse_output(text: &str) -> ToolOutput {
    let mut s = ToolCallSplitter::new();
    s.push(text);
    s.finish();
    s.into_output()
}

/// What a tool-call region or an argument holds while parsing.
enum Item {
    Value(Value),
    Call(ParsedCall),
}

struct Parser<'a> {
    s: &'a str,
    i: usize,
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

fn describe(c: Option<char>) -> String {
    match c {
        None => "the end".into(),
        Some(c) => format!("`{c}`"),
    }
}

impl<'a> Parser<'a> {
    fn err<T>(&self, msg: impl std::fmt::Display) -> std::result::Result<T, String> {
        Err(format!("{msg} at offset {}", self.i))
    }

    fn peek(&self) -> Option<char> {
        self.s[self.i..].chars().next()
    }

    fn peek_at(&self, n: usize) -> Option<char> {
        self.s[self.i..].chars().nth(n)
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.i += c.len_utf8();
        Some(c)
    }

    fn ws(&mut self) {
        while let Some(c) = self.peek() {
            if c.is_whitespace() {
                self.i += c.len_utf8();
            } else {
                break;
            }
        }
    }

    fn eat(&mut self, c: char) -> bool {
        if self.peek() == Some(c) {
            self.i += c.len_utf8();
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: char, context: &str) -> std::result::Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            self.err(format!("expected `{c}` {context}, found {}", describe(self.peek())))
        }
    }

    /// A function name: an identifier, also with `.` and `-` inside
    /// (OpenAI allows `-` in names; `.` for namespaced tools).
    fn name(&mut self) -> Option<&'a str> {
        let start = self.i;
        match self.peek() {
            Some(c) if is_ident_start(c) => {
                self.bump();
            }
            _ => return None,
        }
        while let Some(c) = self.peek() {
            if is_ident_char(c) || c == '.' || c == '-' {
                self.bump();
            } else {
                break;
            }
        }
        Some(&self.s[start..self.i])
    }

    /// A value, or a call `name(...)` where calls are allowed.
    fn item(&mut self, depth: usize, calls_allowed: bool) -> std::result::Result<Item, String> {
        self.ws();
        if depth > MAX_DEPTH {
            return self.err(format!("nesting deeper than {MAX_DEPTH} levels"));
        }
        let start = self.i;
        match self.peek() {
            None => self.err("expected a value, found the end"),
            Some('"') | Some('\'') => Ok(Item::Value(Value::String(self.string()?))),
            Some('[') => {
                self.bump();
                Ok(Item::Value(Value::Array(self.sequence(']', depth)?)))
            }
            Some('(') => {
                self.bump();
                let (items, trailing_comma) = self.sequence_with_comma(')', depth)?;
                // `(x)` is x in Python; `(x,)` and `(x, y)` are tuples (lists in JSON).
                if items.len() == 1 && !trailing_comma {
                    Ok(Item::Value(items.into_iter().next().unwrap_or(Value::Null)))
                } else {
                    Ok(Item::Value(Value::Array(items)))
                }
            }
            Some('{') => {
                self.bump();
                Ok(Item::Value(self.dict(depth)?))
            }
            Some(c) if c.is_ascii_digit() || c == '-' || c == '+' || c == '.' => Ok(Item::Value(self.number()?)),
            Some(c) if is_ident_start(c) => {
                let name = self.name().unwrap_or_default();
                let after_name = self.i;
                self.ws();
                if self.peek() == Some('(') {
                    if !calls_allowed {
                        self.i = start;
                        return self.err(format!("a call `{name}(...)` is not allowed as an argument value"));
                    }
                    self.bump();
                    let arguments = self.arguments(name, depth)?;
                    return Ok(Item::Call(ParsedCall { name: name.to_string(), arguments }));
                }
                self.i = after_name;
                match name {
                    "True" | "true" => Ok(Item::Value(Value::Bool(true))),
                    "False" | "false" => Ok(Item::Value(Value::Bool(false))),
                    "None" | "null" => Ok(Item::Value(Value::Null)),
                    "inf" | "nan" | "Infinity" | "NaN" => {
                        self.i = start;
                        self.err(format!("`{name}` cannot be represented in JSON"))
                    }
                    _ => {
                        self.i = start;
                        self.err(format!("unexpected name `{name}` (strings need quotes)"))
                    }
                }
            }
            Some(c) => self.err(format!("expected a value, found `{c}`")),
        }
    }

    fn value(&mut self, depth: usize) -> std::result::Result<Value, String> {
        match self.item(depth, false)? {
            Item::Value(v) => Ok(v),
            Item::Call(_) => self.err("a call is not allowed here"),
        }
    }

    fn sequence(&mut self, close: char, depth: usize) -> std::result::Result<Vec<Value>, String> {
        Ok(self.sequence_with_comma(close, depth)?.0)
    }

    /// Items up to `close`; also tells whether a comma followed the last item.
    fn sequence_with_comma(&mut self, close: char, depth: usize) -> std::result::Result<(Vec<Value>, bool), String> {
        let mut items = Vec::new();
        let mut trailing = false;
        loop {
            self.ws();
            if self.eat(close) {
                return Ok((items, trailing));
            }
            if !items.is_empty() && !trailing {
                return self.err(format!("expected `,` or `{close}`, found {}", describe(self.peek())));
            }
            items.push(self.value(depth + 1)?);
            self.ws();
            trailing = self.eat(',');
        }
    }

    fn dict(&mut self, depth: usize) -> std::result::Result<Value, String> {
        let mut map = Map::new();
        let mut need_comma = false;
        loop {
            self.ws();
            if self.eat('}') {
                return Ok(Value::Object(map));
            }
            if need_comma {
                return self.err(format!("expected `,` or `}}` in a dict, found {}", describe(self.peek())));
            }
            let key_at = self.i;
            let key = match self.peek() {
                Some('"') | Some('\'') => self.string()?,
                Some(c) if is_ident_start(c) => {
                    // A bare key (JavaScript style) or a literal used as key.
                    let name = self.name().unwrap_or_default();
                    match name {
                        "True" => "true".into(),
                        "False" => "false".into(),
                        "None" => "null".into(),
                        n => n.to_string(),
                    }
                }
                Some(c) if c.is_ascii_digit() || c == '-' || c == '+' || c == '.' => match self.number()? {
                    Value::Number(n) => n.to_string(),
                    _ => String::new(),
                },
                other => return self.err(format!("expected a dict key, found {}", describe(other))),
            };
            self.ws();
            self.expect(':', "after a dict key")?;
            let v = self.value(depth + 1)?;
            if map.insert(key.clone(), v).is_some() {
                self.i = key_at;
                return self.err(format!("duplicate dict key `{key}`"));
            }
            self.ws();
            need_comma = !self.eat(',');
        }
    }

    /// `name=value, ...)` after a call's `(`.
    fn arguments(&mut self, fname: &str, depth: usize) -> std::result::Result<Map<String, Value>, String> {
        let mut map = Map::new();
        let mut need_comma = false;
        loop {
            self.ws();
            if self.eat(')') {
                return Ok(map);
            }
            if need_comma {
                return self.err(format!("expected `,` or `)` in the arguments of `{fname}`, found {}", describe(self.peek())));
            }
            let at = self.i;
            let is_name = matches!(self.peek(), Some(c) if is_ident_start(c));
            let arg = if is_name { self.name() } else { None };
            let after = self.i;
            self.ws();
            let named = match arg {
                Some(a) if self.peek() == Some('=') && self.peek_at(1) != Some('=') => Some(a),
                _ => None,
            };
            let Some(arg) = named else {
                self.i = if is_name { at } else { after };
                return self.err(format!(
                    "positional argument in the call to `{fname}` (LFM2 tool calls name every argument: name=value)"
                ));
            };
            if arg.contains('.') || arg.contains('-') {
                self.i = at;
                return self.err(format!("`{arg}` is not a valid argument name"));
            }
            self.bump(); // '='
            let v = self.value(depth + 1)?;
            if map.insert(arg.to_string(), v).is_some() {
                self.i = at;
                return self.err(format!("argument `{arg}` given twice in the call to `{fname}`"));
            }
            self.ws();
            need_comma = !self.eat(',');
        }
    }

    fn hex(&mut self, n: usize) -> std::result::Result<u32, String> {
        let start = self.i;
        let digits = self.s.get(self.i..self.i + n).filter(|d| d.chars().all(|c| c.is_ascii_hexdigit()));
        match digits {
            Some(d) => {
                self.i += n;
                u32::from_str_radix(d, 16).map_err(|e| format!("{e} at offset {start}"))
            }
            None => self.err(format!("expected {n} hex digits in an escape")),
        }
    }

    /// A string in single, double or triple quotes with Python (and JSON) escapes.
    fn string(&mut self) -> std::result::Result<String, String> {
        let start = self.i;
        let Some(q) = self.bump() else { return self.err("expected a string") };
        let triple = self.s[self.i..].starts_with(&format!("{q}{q}"));
        if triple {
            self.i += 2;
        }
        let mut out = String::new();
        // A high surrogate from `\uD83D` waiting for its low half.
        let mut high: Option<u32> = None;
        loop {
            let Some(c) = self.bump() else {
                self.i = start;
                return self.err("unterminated string starting");
            };
            if c == q {
                if !triple {
                    break;
                }
                if self.s[self.i..].starts_with(&format!("{q}{q}")) {
                    self.i += 2;
                    break;
                }
                out.push(c);
                continue;
            }
            if c != '\\' {
                if high.take().is_some() {
                    out.push('\u{FFFD}'); // a high surrogate escape without its low half
                }
                out.push(c);
                continue;
            }
            let esc_at = self.i - 1;
            let Some(e) = self.bump() else {
                self.i = start;
                return self.err("unterminated string starting");
            };
            let code = match e {
                'n' => Some('\n' as u32),
                't' => Some('\t' as u32),
                'r' => Some('\r' as u32),
                'b' => Some(0x08),
                'f' => Some(0x0c),
                'v' => Some(0x0b),
                'a' => Some(0x07),
                '0' => Some(0),
                '\\' | '\'' | '"' | '/' => Some(e as u32),
                '\n' => None, // line continuation
                'x' => Some(self.hex(2)?),
                'u' => Some(self.hex(4)?),
                'U' => Some(self.hex(8)?),
                other => {
                    // Python keeps unknown escapes as written.
                    out.push('\\');
                    out.push(other);
                    None
                }
            };
            let Some(code) = code else { continue };
            if (0xD800..0xDC00).contains(&code) {
                if high.replace(code).is_some() {
                    out.push('\u{FFFD}');
                }
                continue;
            }
            if (0xDC00..0xE000).contains(&code) {
                match high.take() {
                    Some(h) => {
                        let cp = 0x10000 + ((h - 0xD800) << 10) + (code - 0xDC00);
                        out.push(char::from_u32(cp).unwrap_or('\u{FFFD}'));
                    }
                    None => out.push('\u{FFFD}'),
                }
                continue;
            }
            if high.take().is_some() {
                out.push('\u{FFFD}');
            }
            match char::from_u32(code) {
                Some(ch) => out.push(ch),
                None => {
                    self.i = esc_at;
                    return self.err(format!("escape for code point {code:#x} is not a valid character"));
                }
            }
        }
        if high.is_some() {
            out.push('\u{FFFD}');
        }
        Ok(out)
    }

    fn number(&mut self) -> std::result::Result<Value, String> {
        let start = self.i;
        if matches!(self.peek(), Some('-') | Some('+')) {
            self.bump();
        }
        let mut digits = 0;
        let mut float = false;
        while let Some(c) = self.peek() {
            if c.is_ascii_digit() || c == '_' {
                digits += c.is_ascii_digit() as usize;
                self.bump();
            } else if c == '.' && !float {
                float = true;
                self.bump();
            } else {
                break;
            }
        }
        if digits == 0 {
            let rest: String = self.s[start..].chars().take(8).collect();
            self.i = start;
            if rest.trim_start_matches(['-', '+']).starts_with(|c: char| c.is_alphabetic()) {
                return self.err(format!("`{}` cannot be represented in JSON", rest.trim_end_matches(|c: char| !c.is_alphanumeric())));
            }
            return self.err("expected a number");
        }
        if matches!(self.peek(), Some('e') | Some('E')) {
            let save = self.i;
            self.bump();
            if matches!(self.peek(), Some('-') | Some('+')) {
                self.bump();
            }
            if matches!(self.peek(), Some(c) if c.is_ascii_digit()) {
                float = true;
                while matches!(self.peek(), Some(c) if c.is_ascii_digit()) {
                    self.bump();
                }
            } else {
                self.i = save;
            }
        }
        if matches!(self.peek(), Some(c) if is_ident_char(c)) {
            return self.err(format!("unexpected {} after a number", describe(self.peek())));
        }
        let text: String = self.s[start..self.i].chars().filter(|&c| c != '_').collect();
        let text = text.strip_prefix('+').unwrap_or(&text);
        if !float {
            if let Ok(n) = text.parse::<i64>() {
                return Ok(Value::Number(n.into()));
            }
            if let Ok(n) = text.parse::<u64>() {
                return Ok(Value::Number(n.into()));
            }
        }
        match text.parse::<f64>().ok().and_then(Number::from_f64) {
            Some(n) => Ok(Value::Number(n)),
            None => {
                self.i = start;
                self.err(format!("`{text}` is not a finite number"))
            }
        }
    }
}

/// A dict in the JSON form `{"name": ..., "arguments": {...}}` as a call.
fn call_from_dict(v: Value) -> std::result::Result<ParsedCall, String> {
    let Value::Object(mut m) = v else {
        return Err("expected a function call like name(arg=value)".into());
    };
    let name = match m.remove("name") {
        Some(Value::String(s)) if !s.is_empty() => s,
        _ => return Err("a tool call object needs a non-empty string `name`".into()),
    };
    let args = m.remove("arguments").or_else(|| m.remove("parameters"));
    let arguments = match args {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(a)) => a,
        Some(Value::String(s)) => match serde_json::from_str::<Value>(&s) {
            Ok(Value::Object(a)) => a,
            _ => return Err(format!("the arguments of `{name}` are a string that is not a JSON object")),
        },
        Some(_) => return Err(format!("the arguments of `{name}` must be an object")),
    };
    Ok(ParsedCall { name, arguments })
}

/// Parses the text between the tool-call markers: `[call, call, ...]`, a
/// single call without brackets, or the JSON form.
pub fn parse_calls(inner: &str) -> std::result::Result<Vec<ParsedCall>, String> {
    let mut p = Parser { s: inner, i: 0 };
    p.ws();
    if p.peek().is_none() {
        return Err("the tool call is empty".into());
    }
    let mut calls = Vec::new();
    let push = |item: Item, calls: &mut Vec<ParsedCall>| -> std::result::Result<(), String> {
        match item {
            Item::Call(c) => calls.push(c),
            Item::Value(v) => calls.push(call_from_dict(v)?),
        }
        Ok(())
    };
    if p.eat('[') {
        let mut need_comma = false;
        loop {
            p.ws();
            if p.eat(']') {
                break;
            }
            if need_comma {
                return p.err(format!("expected `,` or `]` between calls, found {}", describe(p.peek())));
            }
            let at = p.i;
            let item = p.item(0, true)?;
            push(item, &mut calls).map_err(|m| format!("{m} at offset {at}"))?;
            p.ws();
            need_comma = !p.eat(',');
        }
    } else {
        let at = p.i;
        let item = p.item(0, true)?;
        push(item, &mut calls).map_err(|m| format!("{m} at offset {at}"))?;
    }
    p.ws();
    if p.peek().is_some() {
        return p.err(format!("unexpected {} after the calls", describe(p.peek())));
    }
    if calls.is_empty() {
        return Err("the tool call list is empty".into());
    }
    Ok(calls)
}

/// A JSON value written as a Python literal (what LFM2 writes in calls).
fn write_py(v: &Value, out: &mut String) {
    match v {
        Value::Null => out.push_str("None"),
        Value::Bool(true) => out.push_str("True"),
        Value::Bool(false) => out.push_str("False"),
        Value::Number(n) => out.push_str(&n.to_string()),
        // JSON string escapes are valid Python string escapes.
        Value::String(s) => out.push_str(&serde_json::to_string(s).unwrap_or_default()),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py(x, out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                write_py(x, out);
            }
            out.push('}');
        }
    }
}

/// LFM2's text for calls: `<|tool_call_start|>[f(a=1), g()]<|tool_call_end|>`.
pub fn render_calls(calls: &[ParsedCall]) -> String {
    let mut out = String::from(TOOL_CALL_START);
    out.push('[');
    for (i, c) in calls.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        out.push_str(&c.name);
        out.push('(');
        for (j, (k, v)) in c.arguments.iter().enumerate() {
            if j > 0 {
                out.push_str(", ");
            }
            out.push_str(k);
            out.push('=');
            write_py(v, &mut out);
        }
        out.push(')');
    }
    out.push(']');
    out.push_str(TOOL_CALL_END);
    out
}

/// Reads OpenAI-shaped tool calls (`{id, type, function: {name, arguments}}`,
/// `arguments` a JSON string or an object; `{name, arguments}` also accepted).
pub fn calls_from_openai(tool_calls: &Value, what: &str) -> Result<Vec<ParsedCall>> {
    let Value::Array(items) = tool_calls else {
        return Err(Error::invalid(format!("{what} must be a list")));
    };
    items
        .iter()
        .enumerate()
        .map(|(i, item)| {
            let f = item.get("function").unwrap_or(item);
            let name = match f.get("name") {
                Some(Value::String(s)) if !s.is_empty() => s.clone(),
                _ => return Err(Error::invalid(format!("{what}[{i}].function.name must be a non-empty string"))),
            };
            let arguments = match f.get("arguments") {
                None | Some(Value::Null) => Map::new(),
                Some(Value::Object(m)) => m.clone(),
                Some(Value::String(s)) if s.trim().is_empty() => Map::new(),
                Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                    Ok(Value::Object(m)) => m,
                    Ok(_) => return Err(Error::invalid(format!("{what}[{i}].function.arguments must be a JSON object"))),
                    Err(e) => return Err(Error::invalid(format!("{what}[{i}].function.arguments is not valid JSON: {e}"))),
                },
                Some(_) => return Err(Error::invalid(format!("{what}[{i}].function.arguments must be a JSON string or an object"))),
            };
            Ok(ParsedCall { name, arguments })
        })
        .collect()
}

/// For a chat template that does not mention `tool_calls` (LFM2's own
/// templates expect the calls inside the assistant's text, as the model wrote
/// them), rewrites assistant messages that carry structured `tool_calls` into
/// content `<|tool_call_start|>[...]<|tool_call_end|>` + their text. Templates
/// that render `tool_calls` themselves get the messages unchanged.
pub fn inline_tool_calls<'m>(messages: &'m [ChatMessage], template: &str) -> Result<Cow<'m, [ChatMessage]>> {
    let has_calls = |m: &ChatMessage| match &m.tool_calls {
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Null) | None => false,
        Some(_) => true,
    };
    if template.contains("tool_calls") || !messages.iter().any(has_calls) {
        return Ok(Cow::Borrowed(messages));
    }
    let mut out = messages.to_vec();
    for (i, m) in out.iter_mut().enumerate() {
        if !has_calls(m) {
            m.tool_calls = None;
            continue;
        }
        let calls = calls_from_openai(m.tool_calls.as_ref().unwrap_or(&Value::Null), &format!("messages[{i}].toolCalls"))?;
        let mut content = render_calls(&calls);
        match m.content.take() {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => content.push_str(&s),
            Some(other) => content.push_str(&serde_json::to_string(&other).unwrap_or_default()),
        }
        m.content = Some(Value::String(content));
        m.tool_calls = None;
    }
    Ok(Cow::Owned(out))
}

/// A fresh OpenAI-style call id (`call_` and 24 letters/digits).
pub fn new_call_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{SystemTime, UNIX_EPOCH};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    let mut x = nanos ^ COUNTER.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (std::process::id() as u64) << 32;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut id = String::from("call_");
    for _ in 0..24 {
        // SplitMix64 step.
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        id.push(ALPHABET[(z % ALPHABET.len() as u64) as usize] as char);
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn call(name: &str, args: Value) -> ParsedCall {
        ParsedCall { name: name.into(), arguments: args.as_object().cloned().unwrap() }
    }

    fn wrap(inner: &str) -> String {
        format!("{TOOL_CALL_START}{inner}{TOOL_CALL_END}")
    }

    #[test]
    fn single_call_with_simple_values() {
        let c = parse_calls(r#"[get_weather(location="Paris", days=3, metric=True, note=None)]"#).unwrap();
        assert_eq!(c, vec![call("get_weather", json!({"location": "Paris", "days": 3, "metric": true, "note": null}))]);
        assert_eq!(c[0].arguments_json(), r#"{"location":"Paris","days":3,"metric":true,"note":null}"#);
    }

    #[test]
    fn multiple_calls_and_whitespace() {
        let c = parse_calls(" [ a( x = 1 ,y='two' , ) ,\n\tb() , c(z=[]) ] \n").unwrap();
        assert_eq!(c, vec![call("a", json!({"x": 1, "y": "two"})), call("b", json!({})), call("c", json!({"z": []}))]);
    }

    #[test]
    fn nested_lists_dicts_and_tuples() {
        let c = parse_calls(r#"[f(a=[1, [2.5, -3e2], {"k": {'deep': [True, False, None]}}], b={1: 'x', key: "y"}, t=(1, 2), one=(5), single=(7,))]"#).unwrap();
        assert_eq!(
            c[0].arguments,
            json!({"a": [1, [2.5, -300.0], {"k": {"deep": [true, false, null]}}], "b": {"1": "x", "key": "y"}, "t": [1, 2], "one": 5, "single": [7]})
                .as_object()
                .cloned()
                .unwrap()
        );
    }

    #[test]
    fn literal_spellings() {
        let c = parse_calls("[f(a=true, b=false, c=null, d=None, e=True, g=False, h=+4, i=.5, j=1_000)]").unwrap();
        assert_eq!(c[0].arguments, json!({"a": true, "b": false, "c": null, "d": null, "e": true, "g": false, "h": 4, "i": 0.5, "j": 1000}).as_object().cloned().unwrap());
        let big = parse_calls("[f(n=18446744073709551615, m=123456789012345678901234567890)]").unwrap();
        assert_eq!(big[0].arguments["n"], json!(18446744073709551615u64));
        assert!(big[0].arguments["m"].is_f64());
    }

    #[test]
    fn string_escapes() {
        let c = parse_calls(r#"[f(a="line\nnext\t\"q\" \\ \u00e9 \x41 \/", b='it\'s', c="\ud83d\ude00", d="unknown \d kept", e="""tri"ple""", f='日本語 😀')]"#).unwrap();
        let a = &c[0].arguments;
        assert_eq!(a["a"], json!("line\nnext\t\"q\" \\ é A /"));
        assert_eq!(a["b"], json!("it's"));
        assert_eq!(a["c"], json!("😀"));
        assert_eq!(a["d"], json!("unknown \\d kept"));
        assert_eq!(a["e"], json!("tri\"ple"));
        assert_eq!(a["f"], json!("日本語 😀"));
        // A lone surrogate escape becomes U+FFFD rather than invalid text.
        let lone = parse_calls(r#"[f(a="x\ud83dy")]"#).unwrap();
        assert_eq!(lone[0].arguments["a"], json!("x\u{FFFD}y"));
    }

    #[test]
    fn json_form_and_bare_call() {
        let c = parse_calls(r#"[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": "{\"b\": [2]}"}]"#).unwrap();
        assert_eq!(c, vec![call("f", json!({"a": 1})), call("g", json!({"b": [2]}))]);
        let bare = parse_calls(r#"search(query="rust", limit=2)"#).unwrap();
        assert_eq!(bare, vec![call("search", json!({"query": "rust", "limit": 2}))]);
        let dotted = parse_calls("[tools.search-v2(q='x')]").unwrap();
        assert_eq!(dotted[0].name, "tools.search-v2");
    }

    #[test]
    fn malformed_inputs_name_the_problem() {
        let cases: &[(&str, &str)] = &[
            ("", "empty"),
            ("[]", "list is empty"),
            ("[f(a=1]", "expected `,` or `)`"),
            ("[f(a=1)", "expected `,` or `]`"),
            ("[f(a=\"open)]", "unterminated string"),
            ("[f(1, 2)]", "positional argument"),
            ("[f(a=1, a=2)]", "given twice"),
            ("[f(a=undefined_name)]", "unexpected name `undefined_name`"),
            ("[f(a=g(1))]", "not allowed as an argument value"),
            ("[f(a=inf)]", "cannot be represented in JSON"),
            ("[f(a=1e999)]", "not a finite number"),
            ("[f(a={'k' 1})]", "expected `:`"),
            ("[f(a={'k': 1, 'k': 2})]", "duplicate dict key"),
            ("[f(a=[1 2])]", "expected `,` or `]`"),
            ("[f(a=1)] trailing", "unexpected `t` after the calls"),
            ("[42]", "expected a function call"),
            ("[{\"arguments\": {}}]", "non-empty string `name`"),
            ("[f(a=12abc)]", "after a number"),
            ("[f(a=\"\\x4\")]", "hex digits"),
            ("[f(a==1)]", "positional argument"),
        ];
        for (input, want) in cases {
            let e = parse_calls(input).expect_err(input);
            assert!(e.contains(want), "{input:?}: {e:?} should mention {want:?}");
        }
        // Offsets point into the region.
        let e = parse_calls("[f(a=1, b=?)]").unwrap_err();
        assert!(e.ends_with("at offset 10"), "{e}");
        // Deep nesting is an error, not a stack overflow.
        let deep = format!("[f(a={}{})]", "[".repeat(500), "]".repeat(500));
        assert!(parse_calls(&deep).unwrap_err().contains("nesting deeper"));
    }

    #[test]
    fn output_split_keeps_text_outside_markers() {
        let text = format!("Let me check. {}\nThen more{}", wrap(r#"[get_weather(city="Oslo"), get_time(tz='CET')]"#), wrap("[f()]"));
        let out = parse_output(&text);
        assert_eq!(out.text, "Let me check. \nThen more");
        assert_eq!(out.calls.len(), 3);
        assert_eq!(out.calls[1], call("get_time", json!({"tz": "CET"})));
        assert!(out.errors.is_empty());
        let plain = parse_output("no calls here <|tool_call_end|> <|tool");
        assert_eq!(plain.text, "no calls here <|tool_call_end|> <|tool");
        assert!(plain.calls.is_empty() && plain.errors.is_empty());
    }

    #[test]
    fn malformed_and_unclosed_regions_are_reported() {
        let bad = wrap("[f(a=)]");
        let text = format!("A{bad}B{}C{}", wrap("[ok(x=1)]"), "<|tool_call_start|>[g(y=");
        let out = parse_output(&text);
        assert_eq!(out.text, "ABC");
        assert_eq!(out.calls, vec![call("ok", json!({"x": 1}))]);
        assert_eq!(out.errors.len(), 2);
        assert_eq!(out.errors[0].raw, bad);
        assert!(out.errors[0].message.contains("expected a value"), "{}", out.errors[0].message);
        assert_eq!(out.errors[1].raw, "<|tool_call_start|>[g(y=");
        assert!(out.errors[1].message.contains("not closed"));
    }

    #[test]
    fn splitter_streams_the_same_text_in_any_pieces() {
        let text = format!("héllo 😀 {}wörld <|tool_ <|tool_call_sta", wrap("[f(a='<|tool_call_end|')]"));
        let whole = parse_output(&text);
        for step in 1..12 {
            let mut s = ToolCallSplitter::new();
            let mut streamed = String::new();
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(step) {
                let piece: String = piece.iter().collect();
                let out = s.push(&piece);
                // Nothing that could start a marker is ever shown.
                assert!(!out.contains("<|tool_call_start|>"));
                streamed.push_str(&out);
            }
            streamed.push_str(&s.finish());
            let out = s.into_output();
            assert_eq!(streamed, whole.text, "step {step}");
            assert_eq!(out, whole, "step {step}");
        }
        assert_eq!(whole.text, "héllo 😀 wörld <|tool_ <|tool_call_sta");
        assert_eq!(whole.calls, vec![call("f", json!({"a": "<|tool_call_end|"}))]);
    }

    #[test]
    fn splitter_holds_a_possible_marker_start() {
        let mut s = ToolCallSplitter::new();
        assert_eq!(s.push("abc<|tool"), "abc");
        assert!(!s.saw_tool_call());
        assert_eq!(s.push("_call_start|>[f()]"), "");
        assert!(s.saw_tool_call());
        assert_eq!(s.push("<|tool_call_end|>done"), "done");
        assert_eq!(s.finish(), "");
        assert_eq!(s.into_output().calls, vec![call("f", json!({}))]);
    }

    #[test]
    fn render_round_trips_through_the_parser() {
        let calls = vec![
            call("get_weather", json!({"city": "Zürich \"quoted\"\n", "days": 2, "opts": {"unit": "C", "list": [1.5, null, true]}})),
            call("noop", json!({})),
        ];
        let text = render_calls(&calls);
        assert_eq!(
            text,
            "<|tool_call_start|>[get_weather(city=\"Zürich \\\"quoted\\\"\\n\", days=2, opts={\"unit\": \"C\", \"list\": [1.5, None, True]}), noop()]<|tool_call_end|>"
        );
        assert_eq!(parse_output(&text).calls, calls);
    }

    #[test]
    fn openai_tool_calls_are_read_and_inlined() {
        let tc = json!([{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}, {"name": "g", "arguments": {"b": "x"}}]);
        let calls = calls_from_openai(&tc, "toolCalls").unwrap();
        assert_eq!(calls, vec![call("f", json!({"a": 1})), call("g", json!({"b": "x"}))]);
        let bad = json!([{"function": {"name": "f", "arguments": "{not json"}}]);
        assert!(calls_from_openai(&bad, "m[1].toolCalls").unwrap_err().message.contains("m[1].toolCalls[0].function.arguments is not valid JSON"));

        let mut assistant = ChatMessage::assistant("Checking.");
        assistant.tool_calls = Some(tc.clone());
        let msgs = vec![ChatMessage::user("hi"), assistant, ChatMessage::tool("{\"ok\": true}")];
        let plain_template = "{% for m in messages %}{{ m.content }}{% endfor %}";
        let out = inline_tool_calls(&msgs, plain_template).unwrap();
        assert_eq!(
            out[1].content,
            Some(json!("<|tool_call_start|>[f(a=1), g(b=\"x\")]<|tool_call_end|>Checking."))
        );
        assert_eq!(out[1].tool_calls, None);
        // A template that renders tool_calls itself gets them as they are.
        let own = "{% for m in messages %}{{ m.tool_calls | tojson }}{% endfor %}";
        assert!(matches!(inline_tool_calls(&msgs, own).unwrap(), Cow::Borrowed(_)));
    }

    #[test]
    fn call_ids_look_like_openai_ids_and_differ() {
        let a = new_call_id();
        let b = new_call_id();
        assert!(a.starts_with("call_") && a.len() == 29 && a[5..].chars().all(|c| c.is_ascii_alphanumeric()));
        assert_ne!(a, b);
    }
}
