//! The model engine: configs, checkpoint loading, the LFM2 family and its
//! caches. No Node types here.

pub mod batch;
pub mod cache;
pub mod config;
pub mod lfm2;
pub mod lfm2_moe;
pub mod linear;
pub mod loader;
pub mod paged;
pub mod quant;
pub mod weights;

pub use cache::ModelCache;
pub use config::{ModelConfig, ModelType};
pub use lfm2::Lfm2Model;
pub use loader::{load_model, LoadOptions, LoadedModel};
