//! Safe Rust over our C++ bridge to MLX (cpp/). Nothing outside this module
//! touches raw handles.

mod array;
mod compile;
pub mod distributed;
mod ffi;
mod io;
pub mod kernel;
pub mod kernel_text;
mod ops;
pub mod runtime;

pub use array::{async_eval, count_ops, eval, graph_ops, Array, Dtype, Element};
pub use compile::Compiled;
pub use io::{load_safetensors, save_safetensors};
pub use ops::*;

#[cfg(test)]
mod tests;
