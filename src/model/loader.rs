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
use std::sync::Arc;

/// Told `(loaded_bytes, total_bytes)` of the weights as they are evaluated;
/// answers whether to go on (false stops the load with an error, e.g. when
/// the JS callback behind it threw). Called on the loading thread, so it
/// must hand the numbers on and return, never wait for JS.
#[derive(Clone)]
pub struct Progress(pub Arc<dyn Fn(usize, usize) -> bool + Send + Sync>);

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress(..)")
    }
}

#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Cast floating-point weights to this dtype (default: keep the checkpoint's).
    pub dtype: Option<Dtype>,
    pub progress: Option<Progress>,
    /// Tensor parallel: load this rank's shard for this group (a group of
    /// one loads the whole model, as without one).
    pub group: Option<crate::mlx::distributed::Group>,
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
    let shard = opts.group.as_ref().filter(|g| g.size() > 1).map(|g| super::linear::Shard::new(g.clone()));
    let model = Lfm2Model::load(&mut store, config, registry, shard)?;
    let (weight_files, unused_tensors) = (store.files.clone(), store.unused());
    // The store holds every tensor as read; the model may hold a derived
    // array instead (projections stacked into one, a cast). Dropped before
    // anything is evaluated, the tensors read only to be stacked are freed
    // chunk by chunk, so peak memory stays about that of the weights.
    drop(store);
    let arrays = model.arrays();
    // Sizes are known before anything is read (the arrays are lazy), so the
    // total is exact from the first report; it counts the weights as held
    // (stacked, cast), which is what the load brings into memory.
    let total: usize = arrays.iter().map(|a| a.nbytes()).sum();
    let mut loaded = 0;
    let report = |loaded: usize| match &opts.progress {
        Some(p) if !(p.0)(loaded, total) => Err(Error::load("loading stopped: the progress callback failed")),
        _ => Ok(()),
    };
    report(0)?;
    // Evaluate in small slices: an I/O error names a point of failure
    // early, and only a few stacked projections' source tensors are alive
    // at once (LFM2-350M bf16, 709 MB of weights: peak at load with
    // slices of 8: 728 MB, against 873 MB with slices of 64).
    for chunk in arrays.chunks(8) {
        eval(chunk).map_err(|e| e.context(format!("reading weights from {}", dir.display())))?;
        loaded += chunk.iter().map(|a| a.nbytes()).sum::<usize>();
        report(loaded)?;
    }
    eval(&model.weight_views()).map_err(|e| e.context(format!("reading weights from {}", dir.display())))?;
    // What the stacked tensors were read into went to MLX's buffer cache.
    crate::mlx::runtime::clear_cache();
    Ok(LoadedModel { weight_files, unused_tensors, model, dir: dir.to_path_buf(), weight_bytes: total })
}
