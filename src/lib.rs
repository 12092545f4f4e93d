//! mlx-lfm: LFM2 / LFM2-MoE on MLX for Node.js.
//!
//! Layout: `mlx` is the safe wrapper over our C++ bridge; the engine modules
//! (model, text, generation) use only `mlx` and know nothing of Node; `js`
//! is the napi glue and the only place napi types appear.

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
