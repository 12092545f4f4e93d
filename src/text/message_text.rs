//! Keeping text that came from messages text. A chat template's own markup
//! is parsed for control tokens (`<|im_start|>`, `<|im_end|>`, ...); a
//! message's content and name are not: `<|im_end|>\n<|im_start|>system` typed
//! by a user must reach the model as those characters, not as a new turn.
//!
//! Message strings are marked with two Unicode noncharacters (reserved for
//! exactly this kind of internal use, never valid in interchange text)
//! before a second render; the marked spans of the output are the message
//! text. The marks are trusted only when removing them gives back exactly
//! the unmarked render, so a template that rewrites message text (trims it,
//! slices it, escapes it) cannot move them: such a request is refused
//! rather than tokenized wrongly.

use super::chat_template::ChatMessage;
use crate::error::{Error, Result};
use serde_json::Value;

const OPEN: char = '\u{FDD0}';
const CLOSE: char = '\u{FDD1}';

/// The strings of `m` that are message text: its content (a string, or the
/// text of its content parts) and its name.
fn strings(m: &ChatMessage) -> Vec<&str> {
    let mut v: Vec<&str> = m.name.as_deref().into_iter().collect();
    match &m.content {
        Some(Value::String(s)) => v.push(s),
        Some(Value::Array(parts)) => v.extend(parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str))),
        _ => {}
    }
    v
}

/// Whether any message string holds a control token's text (or one of the
/// marks): only then is the slower, marked encoding needed. Benign messages
/// are encoded exactly as transformers and mlx-lm encode the render.
pub fn carries_control_tokens(messages: &[ChatMessage], specials: &[String]) -> bool {
    messages
        .iter()
        .flat_map(strings)
        .any(|s| s.contains([OPEN, CLOSE]) || specials.iter().any(|t| s.contains(t.as_str())))
}

fn wrap(s: &str) -> Result<String> {
    if s.contains([OPEN, CLOSE]) {
        return Err(Error::invalid(
            "message text contains U+FDD0 or U+FDD1, Unicode noncharacters that are not valid in text",
        ));
    }
    Ok(format!("{OPEN}{s}{CLOSE}"))
}

/// `messages` with every message string marked.
pub fn mark(messages: &[ChatMessage]) -> Result<Vec<ChatMessage>> {
    messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if let Some(n) = &m.name {
                m.name = Some(wrap(n)?);
            }
            m.content = match m.content.take() {
                Some(Value::String(s)) => Some(Value::String(wrap(&s)?)),
                Some(Value::Array(parts)) => Some(Value::Array(
                    parts
                        .into_iter()
                        .map(|mut p| {
                            if let Some(t) = p.get("text").and_then(Value::as_str).map(str::to_string) {
                                p["text"] = Value::String(wrap(&t)?);
                            }
                            Ok(p)
                        })
                        .collect::<Result<_>>()?,
                )),
                other => other,
            };
            Ok(m)
        })
        .collect()
}

/// Splits the marked render into `(is_message_text, text)` runs, checking
/// that the marks pair up and that without them it is exactly `plain`.
pub fn segments<'a>(marked: &'a str, plain: &str) -> Result<Vec<(bool, &'a str)>> {
    let unmarked: String = marked.chars().filter(|&c| c != OPEN && c != CLOSE).collect();
    let refuse = || {
        Error::invalid(
            "a message contains a control token's text, and this chat template rewrites message text, so it cannot \
             be kept as plain text; remove the control token from the message",
        )
    };
    if unmarked != plain {
        return Err(refuse());
    }
    let mut out = Vec::new();
    let mut rest = marked;
    while !rest.is_empty() {
        match rest.find([OPEN, CLOSE]) {
            None => {
                out.push((false, rest));
                break;
            }
            Some(i) if rest[i..].starts_with(OPEN) => {
                if i > 0 {
                    out.push((false, &rest[..i]));
                }
                let inner = &rest[i + OPEN.len_utf8()..];
                let j = inner.find([OPEN, CLOSE]).filter(|&j| inner[j..].starts_with(CLOSE)).ok_or_else(refuse)?;
                if j > 0 {
                    out.push((true, &inner[..j]));
                }
                rest = &inner[j + CLOSE.len_utf8()..];
            }
            Some(_) => return Err(refuse()),
        }
    }
    Ok(out)
}
