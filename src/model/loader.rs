//! Loading a checkpoint directory into an Lfm2Model. All-or-nothing: the
//! model is assembled in locals and every weight is evaluated before it is
//! returned, so a failure leaves nothing half-loaded.

use super::config::ModelConfig;
use super::lfm2::Lfm2Model;
use super::quant::QuantRegistry;
use super::weights::TensorStore;
use crate::error::{Error, Result};
use crate::mlx::{eval, Dtype};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Cast floating-point weights to this dtype (default: keep the checkpoint's).
    pub dtype: Option<Dtype>,
}

pub struct LoadedModel {
    pub model: Lfm2Model,
    pub dir: PathBuf,
    pub weight_files: Vec<PathBuf>,
    pub unused_tensors: Vec<String>,
    pub weight_bytes: usize,
}

pub fn load_model(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    if !dir.is_dir() {
        return Err(Error::load(format!("model path {} is not a directory", dir.display())));
    }
    let cfg_path = dir.join("config.json");
    if !cfg_path.exists() {
        return Err(Error::load(format!("{} has no config.json", dir.display())));
    }
    let config = ModelConfig::from_file(&cfg_path)?;
    let mut store = TensorStore::open(dir, opts.dtype)?;
    let registry = QuantRegistry::build(config.quantization.as_ref(), &store)?;
    let model = Lfm2Model::load(&mut store, config, registry)?;
    let arrays = model.arrays();
    // Evaluate in slices so an I/O error names a point of failure early and
    // peak memory stays that of the weights.
    for chunk in arrays.chunks(64) {
        eval(chunk).map_err(|e| e.context(format!("reading weights from {}", dir.display())))?;
    }
    let weight_bytes = arrays.iter().map(|a| a.nbytes()).sum();
    Ok(LoadedModel {
        weight_files: store.files.clone(),
        unused_tensors: store.unused(),
        model,
        dir: dir.to_path_buf(),
        weight_bytes,
    })
}
