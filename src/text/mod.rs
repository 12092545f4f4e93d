//! Text side of the engine: the checkpoint's tokenizer, its chat template
//! (rendered like Hugging Face transformers does) and incremental
//! detokenization for streaming. Nothing here knows about Node.

pub mod chat_template;
pub mod detok;
mod message_text;
mod pyjson;
mod strftime;
pub mod tokenizer;
pub mod tool_calls;

pub use chat_template::{
    compile_cached, render_chat, ChatMessage, ChatTemplate, LFM2_CHAT_TEMPLATE,
};
pub use detok::StreamDecoder;
pub use tokenizer::Tokenizer;

#[cfg(test)]
mod tests;
