//! `parseToolCalls`: the parser chat results use, callable on any text.

use super::convert::{to_tool_call_errors, to_tool_calls, ParsedToolCalls};
use crate::text::tool_calls::parse_output;
use napi_derive::napi;

/// Splits LFM2 output into plain text and tool calls, exactly as `chat()`
/// does with a reply: `<|tool_call_start|>[name(arg=value, ...)]<|tool_call_end|>`
/// regions (Python-literal values, or the JSON form) become OpenAI-shaped
/// calls with fresh ids; regions that do not parse are reported with their
/// raw text and what is wrong.
#[napi]
pub fn parse_tool_calls(text: String) -> ParsedToolCalls {
    let out = parse_output(&text);
    ParsedToolCalls { text: out.text, tool_calls: to_tool_calls(out.calls), tool_call_errors: to_tool_call_errors(out.errors) }
}
