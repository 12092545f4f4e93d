//! The model: configs, checkpoint loading, quantized projections and the
//! LFM2 family (lfm2.rs, with the MoE feed-forward in lfm2_moe.rs). Its
//! caches are in src/cache, its compiled step in src/compiled. No Node
//! types here.

pub mod activations;
pub mod config;
pub mod lfm2;
pub mod lfm2_moe;
pub mod linear;
pub mod loader;
pub mod quant;
pub mod weights;

pub use crate::cache::ModelCache;
pub use config::{ModelConfig, ModelType};
pub use lfm2::Lfm2Model;
pub use loader::{load_model, LoadOptions, LoadedModel, Progress};
