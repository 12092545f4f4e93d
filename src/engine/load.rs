//! Load policy: how a checkpoint directory becomes an [`Engine`]: the
//! options, which cache (paged or flat, quantized KV), which decode path
//! (compiled or eager, and why), the stop tokens, and what `info()` says.

use super::fingerprint::Fingerprint;
use super::Engine;
use crate::cache::paged::{self, PagedConfig};
use crate::compiled::CompiledStep;
use crate::error::{Error, Result};
use crate::kvquant::KvCacheConfig;
use crate::mlx::{runtime, Dtype};
use crate::model::config::token_ids;
use crate::model::lfm2::Operator;
use crate::model::{load_model, Lfm2Model, LoadOptions, Progress};
use crate::text::Tokenizer;
use parking_lot::Mutex;
use serde_json::Value;
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, Clone, Default)]
pub struct EngineOptions {
    pub dtype: Option<Dtype>,
    /// Tokens per prefill chunk (default 2048).
    pub prefill_chunk: Option<usize>,
    /// "cpu" or "gpu"; default: MLX's default device.
    pub device: Option<runtime::DeviceType>,
    /// Force a decode path; default: compiled when eligible.
    pub decode_path: Option<DecodePath>,
    /// KV cache storage (`default`, `affine4`, `affine8`, `rotorquant`, ...;
    /// see `kvquant::VALID_NAMES`); default: MLX_LFM_KV_CACHE, else `default`.
    pub kv_cache: Option<String>,
    /// `rotorquant-adaptive`: attention layers kept in full precision at
    /// each end (default `kvquant::DEFAULT_FULL_PRECISION_LAYERS`).
    pub kv_cache_full_precision_layers: Option<usize>,
    /// Paged KV cache with prefix reuse (true) or flat caches (false);
    /// wins over config.json's `use_block_paged_cache`. Default: paged for
    /// unquantized checkpoints, flat for quantized ones.
    pub paged_cache: Option<bool>,
    /// Tokens per paged block (default `paged::DEFAULT_BLOCK_SIZE`, or
    /// config.json `paged_block_size`).
    pub paged_block_size: Option<usize>,
    /// Paged pool budget in MiB (default `paged::DEFAULT_BUDGET_MB`, or
    /// config.json `paged_cache_budget_mb`).
    pub paged_cache_budget_mb: Option<usize>,
    /// Lowers the context length below config.json's
    /// `max_position_embeddings` (prompt plus generated tokens).
    pub context_length: Option<usize>,
    /// A directory for the paged prefix cache's disk tier (blocks evicted
    /// from memory and every published block at close, found again by a
    /// later process); None: memory only.
    pub prefix_cache_dir: Option<PathBuf>,
    /// The disk tier's budget in MiB (default `DEFAULT_DISK_MB`).
    pub prefix_cache_disk_mb: Option<usize>,
    /// Told the bytes of weights evaluated so far (see `model::Progress`).
    pub progress: Option<Progress>,
    /// Tensor parallel: the group this process is one rank of; it loads
    /// and runs only its shard. None (or a group of one): the whole model.
    pub group: Option<crate::mlx::distributed::Group>,
    /// Tensor parallel by backend name: join the group this process was
    /// started in (when `group` is not given).
    pub distributed: Option<String>,
}

/// The prefix cache's default disk budget (MiB).
pub const DEFAULT_DISK_MB: usize = 4096;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodePath {
    Compiled,
    Eager,
}

/// Reads a boolean MLX_LFM_* variable; anything but the listed values is an
/// error (a typo must not silently change behaviour).
pub fn env_flag(name: &str) -> Result<Option<bool>> {
    let read = match crate::knobs::overridden(name) {
        Some(v) => v.ok_or(std::env::VarError::NotPresent),
        None => std::env::var(name),
    };
    match read {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(_) => Err(Error::config(format!("{name} is not valid UTF-8; use 0 or 1"))),
        Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
            "" => Ok(None),
            "1" | "true" | "yes" | "on" => Ok(Some(true)),
            "0" | "false" | "no" | "off" => Ok(Some(false)),
            _ => Err(Error::config(format!("{name}={v} is not valid; use 1/true/yes/on or 0/false/no/off"))),
        },
    }
}

#[derive(Debug, Clone)]
pub struct QuantSummary {
    pub mode: String,
    pub bits: i32,
    pub group_size: i32,
    pub projections: usize,
}

#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub path: PathBuf,
    pub model_type: String,
    pub layer_kinds: Vec<String>,
    pub dtype: String,
    pub quantization: Vec<QuantSummary>,
    /// "paged", "flat" or "quantized".
    pub cache_kind: String,
    /// Why that cache was chosen.
    pub cache_reason: String,
    pub paged_block_size: Option<usize>,
    pub paged_cache_budget_mb: Option<usize>,
    /// The kvCache setting in effect ("default", "rotorquant-adaptive", ...).
    pub kv_cache: String,
    /// Per attention layer (in layer order): what its KV cache stores
    /// ("default" = full precision, "affine4", "rotorquant-dense", ...).
    pub kv_cache_layers: Vec<String>,
    /// KV cache bytes one token takes over all attention layers (batch 1).
    pub kv_bytes_per_token: usize,
    pub decode_path: String,
    pub decode_path_reason: String,
    /// Positions a request may use (prompt plus generated tokens).
    pub context_length: usize,
    pub parameter_count: usize,
    pub weight_bytes: usize,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_experts: Option<usize>,
    pub experts_per_token: Option<usize>,
    pub eos_token_ids: Vec<u32>,
    pub has_chat_template: bool,
    /// The model fingerprint's hash (see fingerprint.rs).
    pub fingerprint: String,
    pub backend: String,
    pub device: String,
    /// Ranks the model is split over (1: one process) and this one's rank.
    pub world_size: usize,
    pub rank: usize,
}

fn generation_config_eos(dir: &Path) -> Result<Vec<u32>> {
    let p = dir.join("generation_config.json");
    if !p.exists() {
        return Ok(vec![]);
    }
    let text = std::fs::read_to_string(&p)?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| Error::config(format!("{} is not valid JSON: {e}", p.display())))?;
    token_ids(v.get("eos_token_id"), "eos_token_id", "generation_config.json")
}

/// KV bytes per token over all attention layers (batch 1), as stored.
pub fn kv_bytes_per_token(model: &Lfm2Model) -> usize {
    model
        .layers
        .iter()
        .enumerate()
        .filter_map(|(i, l)| match &l.operator {
            Operator::Attention(a) => {
                let per_vector = match model.kv_codecs.get(i).and_then(|c| c.as_ref()) {
                    Some(codec) => codec.bytes_per_vector(model.dtype),
                    None => a.head_dim as usize * model.dtype.size(),
                };
                Some(2 * a.n_kv_heads as usize * per_vector)
            }
            Operator::Conv(_) => None,
        })
        .sum()
}

fn config_field<'a>(model: &'a Lfm2Model, k: &str) -> Option<&'a Value> {
    model.config.raw.get(k).filter(|v| !v.is_null())
}

fn config_usize(model: &Lfm2Model, k: &str) -> Result<Option<usize>> {
    match config_field(model, k) {
        None => Ok(None),
        Some(v) => v
            .as_u64()
            .filter(|&n| n > 0)
            .map(|n| Some(n as usize))
            .ok_or_else(|| Error::config(format!("config.json field `{k}` must be a positive integer, found {v}"))),
    }
}

/// Paged or flat, and why. An explicit choice (load option, then
/// config.json `use_block_paged_cache`) always wins; unset: paged for
/// unquantized checkpoints, flat for quantized ones (the registry, built
/// from the `.scales` tensors, says which).
fn choose_cache(model: &Lfm2Model, opts: &EngineOptions, kv: &KvCacheConfig) -> Result<(Option<PagedConfig>, String)> {
    let from_config = match config_field(model, "use_block_paged_cache") {
        None => None,
        Some(Value::Bool(b)) => Some(*b),
        Some(v) => return Err(Error::config(format!("config.json field `use_block_paged_cache` must be true or false, found {v}"))),
    };
    let (paged, reason) = match (opts.paged_cache, from_config) {
        (Some(p), _) => (p, format!("useBlockPagedCache: {p} (load option)")),
        (None, Some(p)) => (p, format!("use_block_paged_cache: {p} in config.json")),
        (None, None) if kv.kind.is_quantized() => {
            (false, format!("kvCache `{}` keeps K/V quantized in per-sequence caches", kv.name))
        }
        (None, None) if !model.registry.is_empty() => (
            false,
            "default for quantized checkpoints: flat per-sequence caches (no prefix reuse); set useBlockPagedCache to \
             change"
                .to_string(),
        ),
        (None, None) => (true, "default for unquantized checkpoints: paged blocks with prefix reuse".to_string()),
    };
    if !paged {
        return Ok((None, reason));
    }
    if kv.kind.is_quantized() {
        return Err(Error::config(format!(
            "the paged KV cache ({reason}) cannot be combined with kvCache `{}`; choose one",
            kv.name
        )));
    }
    let block_size = match opts.paged_block_size {
        Some(b) => b,
        None => config_usize(model, "paged_block_size")?.unwrap_or(paged::DEFAULT_BLOCK_SIZE),
    };
    let mb = match opts.paged_cache_budget_mb {
        Some(b) => b,
        None => config_usize(model, "paged_cache_budget_mb")?.unwrap_or(paged::DEFAULT_BUDGET_MB),
    };
    let cfg = PagedConfig { block_size, budget_bytes: mb.saturating_mul(1 << 20) };
    cfg.validate()?;
    Ok((Some(cfg), reason))
}

/// The cache part of the fingerprint: the compute dtype and what the KV
/// cache keeps per attention layer.
fn cache_identity(model: &Lfm2Model, paged: Option<PagedConfig>, kv_kinds: &[String]) -> String {
    let kind = match paged {
        Some(p) => format!("paged, {}-token blocks", p.block_size),
        None if kv_kinds.iter().any(|k| k != "default") => format!("flat, kvCache {}", kv_kinds.join("/")),
        None => "flat".to_string(),
    };
    format!("{} {kind}", model.dtype.name())
}

impl Engine {
    pub fn load(dir: &Path, opts: &EngineOptions) -> Result<Engine> {
        if !dir.is_dir() {
            return Err(Error::load(format!("model path {} is not a directory", dir.display())));
        }
        // Validated before anything else happens, so a bad name changes nothing.
        let kv_cfg = KvCacheConfig::resolve(opts.kv_cache.as_deref(), opts.kv_cache_full_precision_layers)?;
        if kv_cfg.kind.is_quantized() && opts.decode_path == Some(DecodePath::Compiled) {
            return Err(Error::config(format!(
                "decodePath `compiled` cannot be used with kvCache `{}`: the compiled step reads only the flat \
                 full-precision cache; use decodePath `eager` or leave it unset",
                kv_cfg.name
            )));
        }
        if opts.prefix_cache_dir.is_some() && (opts.group.is_some() || opts.distributed.is_some()) {
            // Each rank would keep its own share of every block on disk, and
            // a hit on one rank but not another (each directory's LRU is its
            // own) would send the ranks down different paths mid-collective.
            return Err(Error::config(
                "prefixCacheDir cannot be combined with tensor parallelism (distributed) yet: the ranks would have \
                 to agree on every disk hit",
            ));
        }
        if let Some(d) = opts.device {
            runtime::set_default_device(d)?;
        }
        let disabled = env_flag("MLX_LFM_DISABLE_COMPILED")?;
        let tokenizer = Arc::new(Tokenizer::load(dir)?);
        let group = match (&opts.group, &opts.distributed) {
            (Some(g), _) => Some(g.clone()),
            (None, Some(b)) => {
                Some(crate::mlx::distributed::Group::init_within(b, crate::mlx::distributed::watchdog::timeout())?)
            }
            (None, None) => None,
        };
        let loaded = load_model(dir, &LoadOptions { dtype: opts.dtype, progress: opts.progress.clone(), group })?;
        let mut model = loaded.model;
        if let Some(n) = opts.context_length {
            let max = model.config.max_position_embeddings;
            if n == 0 || n > max {
                return Err(Error::config(format!(
                    "contextLength {n} is out of range: this model's max_position_embeddings is {max}"
                )));
            }
            model.context_length = n;
        }
        let kv_kinds = model.set_kv_cache(&kv_cfg)?;
        let (paged_cfg, cache_reason) = choose_cache(&model, opts, &kv_cfg)?;
        let kv_names: Vec<String> = kv_kinds.iter().flatten().map(|k| k.name()).collect();
        let fingerprint = Fingerprint::compute(
            &loaded.dir,
            &loaded.weight_files,
            tokenizer.chat_template(),
            cache_identity(&model, paged_cfg, &kv_names),
        )?;
        if let Some(pc) = paged_cfg {
            // Salted by the fingerprint: blocks are only ever found by the
            // model (and cache layout) that wrote them.
            let pool = model.use_paged_cache(pc, fingerprint.salt())?;
            if let Some(dir) = &opts.prefix_cache_dir {
                let mb = opts.prefix_cache_disk_mb.unwrap_or(DEFAULT_DISK_MB);
                pool.lock().attach_disk(dir, (mb as u64) << 20, &fingerprint.hash)?;
            }
        } else if opts.prefix_cache_dir.is_some() {
            return Err(Error::config(format!(
                "prefixCacheDir needs the paged KV cache, and this model uses flat caches ({cache_reason})"
            )));
        }
        if opts.prefix_cache_disk_mb.is_some() && opts.prefix_cache_dir.is_none() {
            return Err(Error::config("prefixCacheDiskMb is set without prefixCacheDir; give the directory too"));
        }
        let c = &model.config;
        let mut eos: HashSet<u32> = c.eos_token_ids.iter().copied().collect();
        eos.extend(generation_config_eos(dir)?);
        eos.extend(tokenizer.eos_token_ids());
        if let Some(&bad) = eos.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::config(format!("end-of-sequence id {bad} is outside vocab_size {}", c.vocab_size)));
        }
        let (compiled, decode_path_reason) = if kv_cfg.kind.is_quantized() {
            (
                None,
                format!(
                    "kvCache `{}` keeps K/V quantized and the compiled step reads only the flat full-precision \
                     cache, so decode runs eager",
                    kv_cfg.name
                ),
            )
        } else {
            match (opts.decode_path, disabled) {
                (Some(DecodePath::Eager), _) => (None, "eager requested by the decodePath load option".to_string()),
                (None, Some(true)) => (None, "MLX_LFM_DISABLE_COMPILED=1".to_string()),
                (forced, _) => match CompiledStep::new(&model) {
                    Ok(d) => (
                        Some(d),
                        if forced.is_some() {
                            "compiled requested by the decodePath load option".to_string()
                        } else {
                            "default: the compiled step was built and traced for this model at load".to_string()
                        },
                    ),
                    Err(e) if forced.is_some() => return Err(e.context("the compiled decode path was requested but could not be built")),
                    Err(e) => (None, format!("the compiled step could not be built ({}); using eager", e.message)),
                },
            }
        };
        let mut eos_sorted: Vec<u32> = eos.iter().copied().collect();
        eos_sorted.sort();
        let info = ModelInfo {
            path: loaded.dir.clone(),
            model_type: c.model_type.name().to_string(),
            layer_kinds: c.attn_layers.iter().map(|&a| if a { "attention" } else { "conv" }.to_string()).collect(),
            dtype: model.dtype.name().to_string(),
            quantization: model
                .registry
                .summary()
                .into_iter()
                .map(|(s, n)| QuantSummary {
                    mode: s.mode.name().to_string(),
                    bits: s.bits,
                    group_size: s.group_size,
                    projections: n,
                })
                .collect(),
            cache_kind: if paged_cfg.is_some() {
                "paged"
            } else if kv_cfg.kind.is_quantized() {
                "quantized"
            } else {
                "flat"
            }
            .into(),
            cache_reason,
            paged_block_size: paged_cfg.map(|p| p.block_size),
            paged_cache_budget_mb: paged_cfg.map(|p| p.budget_bytes >> 20),
            kv_cache: kv_cfg.name.clone(),
            kv_cache_layers: kv_names,
            fingerprint: fingerprint.hash.clone(),
            kv_bytes_per_token: kv_bytes_per_token(&model),
            decode_path: if compiled.is_some() { "compiled" } else { "eager" }.into(),
            decode_path_reason,
            context_length: model.context_length,
            parameter_count: model.parameter_count(),
            weight_bytes: loaded.weight_bytes,
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            num_layers: c.num_layers,
            num_experts: c.moe.as_ref().map(|m| m.num_experts),
            experts_per_token: c.moe.as_ref().map(|m| m.experts_per_token),
            eos_token_ids: eos_sorted,
            has_chat_template: tokenizer.chat_template().is_some(),
            backend: runtime::backend().name().to_string(),
            device: match runtime::default_device() {
                runtime::DeviceType::Cpu => "cpu".into(),
                runtime::DeviceType::Gpu => "gpu".into(),
            },
            world_size: model.world_size(),
            rank: model.rank(),
        };
        Ok(Engine {
            model,
            compiled,
            tokenizer,
            eos,
            prefill_chunk: opts.prefill_chunk.unwrap_or(2048).max(1),
            info: Arc::new(Mutex::new(info)),
            guide: None,
            fingerprint,
            resumes: Default::default(),
            next_resume: 0,
        })
    }

}
