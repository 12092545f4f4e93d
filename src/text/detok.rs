//! Incremental detokenization for streaming output.
//!
//! Each step decodes only a small window of recent tokens: a *prefix* (the
//! tokens whose text was emitted by the previous step, kept for context so
//! that decoders which look at neighbouring tokens, like SentencePiece's
//! leading-space handling, behave as in a full decode) plus the tokens not
//! yet emitted. The new text is the window's text minus the prefix's text.
//! While the window's text ends in U+FFFD (a UTF-8 sequence split across
//! tokens) nothing is emitted, so a multi-byte character never comes out in
//! halves.

use super::tokenizer::Tokenizer;
use crate::error::{Error, Result};
use std::sync::Arc;

/// Give up waiting for a character to complete after this many held tokens.
/// Any valid UTF-8 character is complete within 4 byte-level tokens, so
/// reaching this means the model is producing invalid byte sequences; their
/// replacement characters are then emitted (as a full decode would show them).
const MAX_HELD_TOKENS: usize = 16;

pub struct StreamDecoder {
    tokenizer: Arc<tokenizers::Tokenizer>,
    skip_special_tokens: bool,
    /// The decode window: `window[..read]` is the prefix (already emitted),
    /// `window[read..]` the tokens whose text is still pending.
    window: Vec<u32>,
    read: usize,
    /// Decoded text of `window[..read]`.
    prefix_text: String,
    /// Everything emitted so far.
    emitted: String,
    tokens_seen: usize,
}

impl std::fmt::Debug for StreamDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamDecoder")
            .field("tokens_seen", &self.tokens_seen)
            .field("pending", &(self.window.len() - self.read))
            .field("emitted_len", &self.emitted.len())
            .finish()
    }
}

impl StreamDecoder {
    pub fn new(tokenizer: &Tokenizer, skip_special_tokens: bool) -> StreamDecoder {
        StreamDecoder {
            tokenizer: tokenizer.inner.clone(),
            skip_special_tokens,
            window: Vec::with_capacity(16),
            read: 0,
            prefix_text: String::new(),
            emitted: String::new(),
            tokens_seen: 0,
        }
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, self.skip_special_tokens)
            .map_err(|e| Error::text(format!("tokenizer failed to decode streamed tokens: {e}")))
    }

    /// The part of `text` after the prefix's text.
    fn new_part<'a>(&self, text: &'a str) -> &'a str {
        if let Some(rest) = text.strip_prefix(self.prefix_text.as_str()) {
            return rest;
        }
        // The decoder rewrote the prefix given more context (rare: e.g.
        // cleanup rules). Resume after the longest common prefix.
        let mut common = 0;
        for ((i, a), b) in text.char_indices().zip(self.prefix_text.chars()) {
            if a != b {
                break;
            }
            common = i + a.len_utf8();
        }
        &text[common..]
    }

    /// Emits the pending text of the current window and makes the pending
    /// tokens the next prefix.
    fn emit(&mut self, text: &str) -> Result<String> {
        let out = self.new_part(text).to_string();
        self.emitted.push_str(&out);
        self.window.drain(..self.read);
        self.read = self.window.len();
        self.prefix_text = if self.window.is_empty() {
            String::new()
        } else {
            self.decode(&self.window)?
        };
        Ok(out)
    }

    /// Adds one token; returns the text it completed (possibly empty).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.window.push(id);
        self.tokens_seen += 1;
        let text = self.decode(&self.window)?;
        let held = self.window.len() - self.read;
        if text.ends_with('\u{FFFD}') && held < MAX_HELD_TOKENS {
            return Ok(String::new());
        }
        // Nothing new (e.g. a skipped special token): keep the prefix short.
        self.emit(&text)
    }

    /// Flushes whatever is still held back (an incomplete trailing sequence
    /// comes out as U+FFFD, exactly as a full decode shows it).
    pub fn finish(&mut self) -> Result<String> {
        if self.read == self.window.len() {
            return Ok(String::new());
        }
        let text = self.decode(&self.window)?;
        self.emit(&text)
    }

    /// Everything emitted so far.
    pub fn text(&self) -> &str {
        &self.emitted
    }

    /// Number of tokens pushed so far.
    pub fn token_count(&self) -> usize {
        self.tokens_seen
    }

    /// Whether some pushed tokens' text is being held back.
    pub fn has_pending(&self) -> bool {
        self.read < self.window.len()
    }

    #[cfg(test)]
    pub(super) fn window_len(&self) -> usize {
        self.window.len()
    }

    /// Forgets all state (for reuse on a new sequence).
    pub fn reset(&mut self) {
        self.window.clear();
        self.read = 0;
        self.prefix_text.clear();
        self.emitted.clear();
        self.tokens_seen = 0;
    }
}
