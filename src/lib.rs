//! mlx-lfm: LFM2 / LFM2-MoE on MLX for Node.js.
//!
//! Layout: `mlx` is the safe wrapper over our C++ bridge (cpp/, MLX ops and
//! compile, nothing of LFM2); `model` is the one definition of the model,
//! `cache` its caches behind one trait, `compiled` the compiled decode step
//! (mx::compile over the model's own Rust step), `engine` the load policy,
//! the scheduler and the model's worker thread, `generate` sampling and the
//! decode loop, `text` tokenizer and chat templates. None of them knows
//! Node: `js` is the napi glue and the only place napi types appear.

pub mod error;
pub mod mlx;

mod js;

pub use error::{Error, ErrorKind, Result};
pub mod fixture;
pub mod text;
pub mod engine;
pub mod generate;
pub mod model;
pub mod cache;
pub mod convert;
pub mod compiled;
pub mod kvquant;
pub mod kernels;
pub mod knobs;
