//! Checkpoint converter: an LFM2 / LFM2-MoE checkpoint (Hugging Face or MLX
//! layout, any float dtype) in, an MLX-layout checkpoint that mlx-lm 0.32.2
//! loads out, optionally cast and quantized.
//!
//! It does what `mlx_lm.convert` does for these models:
//! - mlx-lm's `sanitize`: the depthwise conv kernel becomes `[D, L, 1]`; for
//!   `lfm2_moe` the `w1/w2/w3` names become `gate_proj/down_proj/up_proj` and
//!   per-expert tensors are stacked into `feed_forward.switch_mlp.*`;
//! - the optional cast of float tensors (never `expert_bias`, as mlx-lm's
//!   lfm2_moe `cast_predicate` says), before quantizing;
//! - quantization with MLX's own `quantize` of exactly the modules mlx-lm
//!   quantizes: Linear / Embedding / SwitchLinear weights whose last dim is
//!   divisible by the global group size, with the model's `quant_predicate`
//!   (lfm2_moe: the router `feed_forward.gate` at group 64 / 8 bits) and the
//!   recipe's per-module overrides (which play the part of a user predicate);
//! - `config.json` with `quantization` and `quantization_config` blocks in
//!   mlx-lm's format (global `group_size`/`bits`/`mode` plus an entry per
//!   module whose predicate returned parameters), safetensors with
//!   `{"format": "mlx"}` metadata plus `model.safetensors.index.json`.
//!
//! Differences from mlx-lm, on purpose: the dtype is kept unless the recipe
//! names one (mlx-lm falls back to config.json's `torch_dtype`); tokenizer
//! files are copied byte for byte (mlx-lm re-saves them through
//! transformers); config.json is the source's plus the quantization blocks
//! (mlx-lm also copies generation_config.json's `eos_token_id` into it);
//! an already-quantized source is refused.
//!
//! No Node types here.

use crate::error::{Error, ErrorKind, Result};
use crate::mlx::{self, Array, Dtype, QuantMode, QuantSpec};
use crate::model::config::{ModelConfig, ModelType};
use crate::model::quant::{default_spec, validate_spec};
use crate::model::weights::TensorStore;
use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

#[cfg(test)]
mod tests;

/// Files copied from the source directory when present.
pub const COPIED_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
];

/// mlx-lm's shard limit (`MAX_FILE_SIZE_GB`).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5 << 30;

// ---------------------------------------------------------------------------
// Recipe
// ---------------------------------------------------------------------------

/// What an override does to the modules its pattern matches.
#[derive(Debug, Clone, PartialEq)]
pub enum OverrideAction {
    /// Leave the module unquantized.
    Skip,
    /// Quantize with these fields replaced. A field left out comes from the
    /// global spec when the mode is the global one, else from MLX's defaults
    /// for that mode.
    Quantize { mode: Option<QuantMode>, bits: Option<i32>, group_size: Option<i32> },
}

/// A per-module rule. `pattern` is matched against module paths such as
/// `model.layers.3.feed_forward.gate`: `*` matches any run of characters
/// (dots included), and a pattern matches a path when it matches the whole
/// path or a part of it that starts after a dot (so `feed_forward.gate`
/// matches every layer's router but not `feed_forward.gate_proj`). When
/// several overrides match a module, the last one wins.
#[derive(Debug, Clone, PartialEq)]
pub struct QuantOverride {
    pub pattern: String,
    pub action: OverrideAction,
}

impl QuantOverride {
    /// Parses the command line form `PATH=BITS[:GROUP[:MODE]]` or `PATH=skip`.
    pub fn parse(s: &str) -> Result<QuantOverride> {
        let bad = |why: &str| {
            Error::invalid(format!("override `{s}` is not valid: {why} (expected PATH=BITS[:GROUP[:MODE]] or PATH=skip)"))
        };
        let (pattern, value) = s.split_once('=').ok_or_else(|| bad("no `=`"))?;
        let pattern = pattern.trim();
        if pattern.is_empty() {
            return Err(bad("the module pattern is empty"));
        }
        let value = value.trim();
        if value.eq_ignore_ascii_case("skip") {
            return Ok(QuantOverride { pattern: pattern.into(), action: OverrideAction::Skip });
        }
        let parts: Vec<&str> = value.split(':').map(str::trim).collect();
        if parts.len() > 3 {
            return Err(bad("too many `:` fields"));
        }
        let int = |t: &str, what: &str| -> Result<i32> {
            t.parse::<i32>().ok().filter(|n| *n > 0).ok_or_else(|| bad(&format!("{what} `{t}` is not a positive integer")))
        };
        let bits = Some(int(parts[0], "bits")?);
        let group_size = match parts.get(1) {
            Some(g) if !g.is_empty() => Some(int(g, "group size")?),
            _ => None,
        };
        let mode = match parts.get(2) {
            Some(m) if !m.is_empty() => {
                Some(QuantMode::parse(m).ok_or_else(|| bad(&format!("mode `{m}` is unknown (valid: affine, mxfp4, mxfp8, nvfp4)")))?)
            }
            _ => None,
        };
        Ok(QuantOverride { pattern: pattern.into(), action: OverrideAction::Quantize { mode, bits, group_size } })
    }

    /// The spec this override gives a module, given the global one.
    pub fn resolve(&self, global: QuantSpec) -> Result<Option<QuantSpec>> {
        let OverrideAction::Quantize { mode, bits, group_size } = &self.action else { return Ok(None) };
        let mode = mode.unwrap_or(global.mode);
        let base = if mode == global.mode { global } else { default_spec(mode) };
        let spec = QuantSpec { mode, bits: bits.unwrap_or(base.bits), group_size: group_size.unwrap_or(base.group_size) };
        validate_spec(&spec).map_err(|m| Error::invalid(format!("override for `{}`: {m}", self.pattern)))?;
        Ok(Some(spec))
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct ConvertRecipe {
    /// The global quantization; `None` converts without quantizing.
    pub quant: Option<QuantSpec>,
    /// Cast floating-point tensors (except `expert_bias`) to this dtype.
    pub dtype: Option<Dtype>,
    /// Per-module rules, applied in order (the last match wins).
    pub overrides: Vec<QuantOverride>,
    /// Largest safetensors shard; `None` is mlx-lm's 5 GiB.
    pub max_shard_bytes: Option<u64>,
}

impl ConvertRecipe {
    /// A recipe quantizing with `mode`, taking MLX's defaults for that mode
    /// where `bits` / `group_size` are not given.
    pub fn quantized(mode: QuantMode, bits: Option<i32>, group_size: Option<i32>) -> Result<ConvertRecipe> {
        let d = default_spec(mode);
        let r = ConvertRecipe {
            quant: Some(QuantSpec { mode, bits: bits.unwrap_or(d.bits), group_size: group_size.unwrap_or(d.group_size) }),
            ..Default::default()
        };
        r.validate()?;
        Ok(r)
    }

    pub fn validate(&self) -> Result<()> {
        match self.quant {
            Some(q) => {
                validate_spec(&q).map_err(Error::invalid)?;
                for o in &self.overrides {
                    o.resolve(q)?;
                }
            }
            None if !self.overrides.is_empty() => {
                return Err(Error::invalid(format!(
                    "override for `{}` needs a quantization mode: per-module overrides refine a quantized recipe",
                    self.overrides[0].pattern
                )))
            }
            None => {}
        }
        if let Some(dt) = self.dtype {
            if !matches!(dt, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16) {
                return Err(Error::invalid(format!("dtype {dt} is not valid; use float32, float16 or bfloat16")));
            }
        }
        if self.max_shard_bytes == Some(0) {
            return Err(Error::invalid("max_shard_bytes must be positive"));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Pattern matching
// ---------------------------------------------------------------------------

/// `*`-glob over bytes (no other metacharacters).
fn glob(p: &[u8], s: &[u8]) -> bool {
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, si));
            pi += 1;
        } else if pi < p.len() && p[pi] == s[si] {
            pi += 1;
            si += 1;
        } else if let Some((sp, ss)) = star {
            pi = sp + 1;
            si = ss + 1;
            star = Some((sp, ss + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// Whether an override pattern names the module at `path` (see [`QuantOverride`]).
pub fn pattern_matches(pattern: &str, path: &str) -> bool {
    let (p, s) = (pattern.as_bytes(), path.as_bytes());
    glob(p, s) || s.iter().enumerate().any(|(i, &c)| c == b'.' && glob(p, &s[i + 1..]))
}

// ---------------------------------------------------------------------------
// The checkpoint's tensors
// ---------------------------------------------------------------------------

/// Module classes mlx-lm's LFM2 models build (the ones with `to_quantized`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModuleKind {
    Linear,
    Embedding,
    /// Stacked experts `[E, out, in]`.
    SwitchLinear,
}

/// One tensor of the MLX-layout checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<i32>,
    /// Set on the `.weight` of a quantizable module.
    pub module: Option<ModuleKind>,
}

/// The tensors mlx-lm's model class for `c` has, in model order (MLX names
/// and shapes). `lm_head` is listed only for untied embeddings.
pub fn expected_tensors(c: &ModelConfig) -> Vec<TensorSpec> {
    let (d, hd) = (c.hidden_size as i32, c.head_dim as i32);
    let (h, kv) = (c.num_heads as i32, c.num_kv_heads as i32);
    let mut v = Vec::new();
    let mut put = |name: String, shape: Vec<i32>, module: Option<ModuleKind>| v.push(TensorSpec { name, shape, module });
    let lin = Some(ModuleKind::Linear);
    put("model.embed_tokens.weight".into(), vec![c.vocab_size as i32, d], Some(ModuleKind::Embedding));
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        if c.attn_layers[i] {
            let a = format!("{p}.self_attn");
            put(format!("{a}.q_proj.weight"), vec![h * hd, d], lin);
            put(format!("{a}.k_proj.weight"), vec![kv * hd, d], lin);
            put(format!("{a}.v_proj.weight"), vec![kv * hd, d], lin);
            put(format!("{a}.out_proj.weight"), vec![d, h * hd], lin);
            put(format!("{a}.q_layernorm.weight"), vec![hd], None);
            put(format!("{a}.k_layernorm.weight"), vec![hd], None);
        } else {
            let cv = format!("{p}.conv");
            put(format!("{cv}.conv.weight"), vec![d, c.conv_kernel as i32, 1], None);
            put(format!("{cv}.in_proj.weight"), vec![3 * d, d], lin);
            put(format!("{cv}.out_proj.weight"), vec![d, d], lin);
            if c.conv_bias {
                put(format!("{cv}.conv.bias"), vec![d], None);
                put(format!("{cv}.in_proj.bias"), vec![3 * d], None);
                put(format!("{cv}.out_proj.bias"), vec![d], None);
            }
        }
        let f = format!("{p}.feed_forward");
        match (&c.moe, c.is_moe_layer(i)) {
            (Some(m), true) => {
                let (e, mf) = (m.num_experts as i32, m.moe_ff_dim as i32);
                put(format!("{f}.gate.weight"), vec![e, d], lin);
                if m.use_expert_bias {
                    put(format!("{f}.expert_bias"), vec![e], None);
                }
                let sw = Some(ModuleKind::SwitchLinear);
                put(format!("{f}.switch_mlp.gate_proj.weight"), vec![e, mf, d], sw);
                put(format!("{f}.switch_mlp.up_proj.weight"), vec![e, mf, d], sw);
                put(format!("{f}.switch_mlp.down_proj.weight"), vec![e, d, mf], sw);
            }
            _ => {
                let ff = c.ff_dim as i32;
                // mlx-lm's lfm2 MLP keeps w1/w3/w2; lfm2_moe's is gate/up/down_proj.
                let [g, u, dn] = match c.model_type {
                    ModelType::Lfm2 => ["w1", "w3", "w2"],
                    ModelType::Lfm2Moe => ["gate_proj", "up_proj", "down_proj"],
                };
                put(format!("{f}.{g}.weight"), vec![ff, d], lin);
                put(format!("{f}.{u}.weight"), vec![ff, d], lin);
                put(format!("{f}.{dn}.weight"), vec![d, ff], lin);
            }
        }
        put(format!("{p}.operator_norm.weight"), vec![d], None);
        put(format!("{p}.ffn_norm.weight"), vec![d], None);
    }
    put("model.embedding_norm.weight".into(), vec![d], None);
    if !c.tie_word_embeddings {
        put("lm_head.weight".into(), vec![c.vocab_size as i32, d], lin);
    }
    v
}

/// mlx-lm's per-tensor renames for `model_type` (lfm2_moe only).
pub fn sanitized_name(model_type: ModelType, name: &str) -> String {
    let mut n = name.to_string();
    if model_type == ModelType::Lfm2Moe {
        for (old, new) in [("w1.weight", "gate_proj.weight"), ("w2.weight", "down_proj.weight"), ("w3.weight", "up_proj.weight")] {
            if n.contains(old) {
                n = n.replace(old, new);
            }
        }
    }
    n
}

/// Reads the source's tensors and applies mlx-lm's sanitize. Returns the
/// MLX-layout tensors by name, whether the source was in the HF layout, and
/// the names dropped (a tied model's redundant `lm_head.weight`).
fn sanitize(c: &ModelConfig, store: &mut TensorStore) -> Result<(BTreeMap<String, Array>, bool, Vec<String>)> {
    let mut names: Vec<String> = store.names().cloned().collect();
    names.sort();
    let mut out: BTreeMap<String, Array> = BTreeMap::new();
    let mut hf_layout = false;
    let mut dropped = Vec::new();
    for name in &names {
        let mut a = store.raw(name)?;
        if name == "lm_head.weight" && c.tie_word_embeddings {
            dropped.push(name.clone());
            continue;
        }
        if name.contains("conv.weight") {
            let s = a.shape();
            if s.len() == 3 && s[2] > s[1] {
                a = a.transpose(&[0, 2, 1])?;
                hf_layout = true;
            }
        }
        let new = sanitized_name(c.model_type, name);
        if let Some(_prev) = out.insert(new.clone(), a) {
            return Err(Error::load(format!("source has two tensors that both become `{new}` (one is `{name}`)")));
        }
    }
    if let Some(m) = &c.moe {
        for l in 0..c.num_layers {
            let p = format!("model.layers.{l}.feed_forward");
            for n in ["gate_proj", "down_proj", "up_proj"] {
                if !out.contains_key(&format!("{p}.experts.0.{n}.weight")) {
                    continue;
                }
                hf_layout = true;
                let mut experts = Vec::with_capacity(m.num_experts);
                for e in 0..m.num_experts {
                    let k = format!("{p}.experts.{e}.{n}.weight");
                    experts.push(out.remove(&k).ok_or_else(|| {
                        Error::load(format!("source checkpoint has `{p}.experts.0.{n}.weight` but no `{k}`"))
                    })?);
                }
                let refs: Vec<&Array> = experts.iter().collect();
                let stacked = mlx::stack(&refs, 0).map_err(|e| e.context(format!("stacking {p}.experts.*.{n}")))?;
                out.insert(format!("{p}.switch_mlp.{n}.weight"), stacked);
            }
        }
    }
    Ok((out, hf_layout, dropped))
}

// ---------------------------------------------------------------------------
// Quantization plan
// ---------------------------------------------------------------------------

/// What happens to one quantizable module.
#[derive(Debug, Clone, PartialEq)]
pub struct ModuleDecision {
    pub path: String,
    /// `None`: kept unquantized.
    pub spec: Option<QuantSpec>,
    /// The module's entry in config.json's quantization block, if it gets one.
    pub entry: Option<Value>,
    /// Why the module stays unquantized.
    pub reason: Option<String>,
}

/// The model class's own `quant_predicate` (mlx-lm): for lfm2_moe the router
/// is quantized at group 64 / 8 bits, written without a `mode` (= affine).
pub(crate) fn model_predicate(model_type: ModelType, path: &str) -> Option<Value> {
    match model_type {
        ModelType::Lfm2Moe if path.ends_with("feed_forward.gate") => Some(json!({"group_size": 64, "bits": 8})),
        _ => None,
    }
}

/// The spec a config entry stands for (entries without `mode` are affine,
/// which is what `to_quantized` defaults to).
fn entry_spec(entry: &Value) -> QuantSpec {
    let mode = entry.get("mode").and_then(Value::as_str).and_then(QuantMode::parse).unwrap_or(QuantMode::Affine);
    let d = default_spec(mode);
    let int = |k: &str, dflt: i32| entry.get(k).and_then(Value::as_i64).map(|x| x as i32).unwrap_or(dflt);
    QuantSpec { mode, bits: int("bits", d.bits), group_size: int("group_size", d.group_size) }
}

/// Decides every quantizable module, the way mlx-lm's `quantize_model`
/// does: a module whose last dim the *global* group size does not divide is
/// left alone; otherwise the last matching override (acting as mlx-lm's
/// user predicate) or else the model's own predicate may give it its own
/// parameters, which are then recorded in config.json. `modules` are
/// `(path, last dim)` pairs.
pub fn plan_quantization(model_type: ModelType, modules: &[(String, usize)], recipe: &ConvertRecipe) -> Result<Vec<ModuleDecision>> {
    recipe.validate()?;
    let Some(global) = recipe.quant else {
        return Ok(modules
            .iter()
            .map(|(p, _)| ModuleDecision { path: p.clone(), spec: None, entry: None, reason: Some("no quantization requested".into()) })
            .collect());
    };
    let mut used = vec![false; recipe.overrides.len()];
    let mut out = Vec::with_capacity(modules.len());
    for (path, last) in modules {
        let matched = recipe.overrides.iter().enumerate().rev().find(|(_, o)| pattern_matches(&o.pattern, path));
        if let Some((i, _)) = matched {
            used[i] = true;
        }
        if *last as i32 % global.group_size != 0 {
            out.push(ModuleDecision {
                path: path.clone(),
                spec: None,
                entry: None,
                reason: Some(format!("input width {last} is not a multiple of the group size {}", global.group_size)),
            });
            continue;
        }
        let (spec, entry) = match matched {
            Some((_, o)) => match o.resolve(global)? {
                None => {
                    out.push(ModuleDecision {
                        path: path.clone(),
                        spec: None,
                        entry: None,
                        reason: Some(format!("skipped by override `{}`", o.pattern)),
                    });
                    continue;
                }
                Some(s) => (s, Some(json!({"group_size": s.group_size, "bits": s.bits, "mode": s.mode.name()}))),
            },
            None => match model_predicate(model_type, path) {
                Some(e) => (entry_spec(&e), Some(e)),
                None => (global, None),
            },
        };
        if *last as i32 % spec.group_size != 0 {
            return Err(Error::invalid(format!(
                "module `{path}` has input width {last}, which its group size {} does not divide",
                spec.group_size
            )));
        }
        out.push(ModuleDecision { path: path.clone(), spec: Some(spec), entry, reason: None });
    }
    if let Some(i) = used.iter().position(|u| !u) {
        let example = modules.first().map(|(p, _)| p.as_str()).unwrap_or("model.embed_tokens");
        return Err(Error::invalid(format!(
            "override pattern `{}` matches no quantizable module (modules are named like `{example}`)",
            recipe.overrides[i].pattern
        )));
    }
    Ok(out)
}

/// config.json's `quantization` block: the global parameters followed by
/// one entry per module whose predicate returned parameters.
pub fn quantization_block(global: QuantSpec, decisions: &[ModuleDecision]) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("group_size".into(), json!(global.group_size));
    m.insert("bits".into(), json!(global.bits));
    m.insert("mode".into(), json!(global.mode.name()));
    for d in decisions {
        if let (Some(_), Some(e)) = (&d.spec, &d.entry) {
            m.insert(d.path.clone(), e.clone());
        }
    }
    m
}

/// The output config.json: the source's, without `_name_or_path`, with the
/// quantization blocks when quantized; keys sorted as mlx-lm writes them.
pub fn output_config(source: &Map<String, Value>, quantization: Option<Map<String, Value>>) -> Map<String, Value> {
    let mut c = source.clone();
    c.remove("_name_or_path");
    c.remove("quantization");
    c.remove("quantization_config");
    if let Some(q) = quantization {
        c.insert("quantization".into(), Value::Object(q.clone()));
        c.insert("quantization_config".into(), Value::Object(q));
    }
    let sorted: BTreeMap<String, Value> = c.into_iter().collect();
    sorted.into_iter().collect()
}

// ---------------------------------------------------------------------------
// The conversion
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
pub struct ConvertReport {
    pub out_dir: PathBuf,
    pub model_type: String,
    /// "hf" or "mlx": the source's layout.
    pub source_layout: String,
    /// Dtype of the unquantized float tensors written (the most common one).
    pub dtype: String,
    /// The global quantization, when quantized.
    pub quantization: Option<QuantSpec>,
    /// Each format used, with how many modules use it.
    pub formats: Vec<(QuantSpec, usize)>,
    /// Every quantizable module and what was done to it.
    pub modules: Vec<ModuleDecision>,
    /// Source tensors not written (a tied model's `lm_head.weight`).
    pub dropped: Vec<String>,
    pub tensors: usize,
    /// Logical parameters (quantized weights counted unpacked).
    pub parameters: u64,
    pub weight_bytes: u64,
    /// Weight bits per parameter (as mlx-lm reports it).
    pub bits_per_weight: f64,
    /// Weight files written, then the copied tokenizer / config files.
    pub files: Vec<String>,
    pub copied_files: Vec<String>,
}

fn io_error(what: String, e: std::io::Error) -> Error {
    Error::new(ErrorKind::Io, format!("{what}: {e}"))
}

/// Creates (or checks) the output directory; returns whether we created it.
fn prepare_out_dir(src: &Path, out: &Path) -> Result<bool> {
    if let (Ok(a), Ok(b)) = (src.canonicalize(), out.canonicalize()) {
        if a == b {
            return Err(Error::invalid(format!("output directory {} is the source directory", out.display())));
        }
    }
    let created = if out.exists() {
        if !out.is_dir() {
            return Err(Error::invalid(format!("output path {} exists and is not a directory", out.display())));
        }
        let mut entries = fs::read_dir(out).map_err(|e| io_error(format!("cannot read output directory {}", out.display()), e))?;
        if entries.next().is_some() {
            return Err(Error::invalid(format!(
                "output directory {} already exists and is not empty; remove it or choose another",
                out.display()
            )));
        }
        false
    } else {
        fs::create_dir_all(out).map_err(|e| io_error(format!("output directory {} cannot be created", out.display()), e))?;
        true
    };
    // Fail now, not after quantizing, when the directory is not writable.
    let probe = out.join(".mlx-lfm-write-test");
    fs::write(&probe, b"").map_err(|e| io_error(format!("output directory {} is not writable", out.display()), e))?;
    let _ = fs::remove_file(&probe);
    Ok(created)
}

/// Converts the checkpoint at `src` into `out` (created if missing; an
/// existing one must be empty). On failure nothing is left behind.
pub fn convert(src: &Path, out: &Path, recipe: &ConvertRecipe) -> Result<ConvertReport> {
    recipe.validate()?;
    if !src.is_dir() {
        return Err(Error::load(format!("source model path {} is not a directory", src.display())));
    }
    let cfg_path = src.join("config.json");
    if !cfg_path.is_file() {
        return Err(Error::load(format!("source {} has no config.json", src.display())));
    }
    let config = ModelConfig::from_file(&cfg_path)?;
    let mut store = TensorStore::open(src, None)?;
    if let Some(n) = store.names().find(|n| n.ends_with(".scales")) {
        return Err(Error::invalid(format!(
            "source {} is already quantized (it has `{n}`); convert from an unquantized checkpoint",
            src.display()
        )));
    }
    if config.quantization.is_some() {
        return Err(Error::invalid(format!(
            "source {}'s config.json has a quantization block; convert from an unquantized checkpoint",
            src.display()
        )));
    }
    let created = prepare_out_dir(src, out)?;
    let mut written: Vec<PathBuf> = Vec::new();
    let r = convert_into(src, out, recipe, &config, &mut store, &mut written);
    if r.is_err() {
        if created {
            let _ = fs::remove_dir_all(out);
        } else {
            for f in &written {
                let _ = fs::remove_file(f);
            }
        }
    }
    r
}

fn convert_into(
    src: &Path,
    out: &Path,
    recipe: &ConvertRecipe,
    config: &ModelConfig,
    store: &mut TensorStore,
    written: &mut Vec<PathBuf>,
) -> Result<ConvertReport> {
    let (mut tensors, hf_layout, dropped) = sanitize(config, store)?;
    let expected = expected_tensors(config);
    // Every expected tensor present with its shape, nothing unexpected.
    let expected_names: BTreeSet<&str> = expected.iter().map(|t| t.name.as_str()).collect();
    if let Some(extra) = tensors.keys().find(|k| !expected_names.contains(k.as_str())) {
        return Err(Error::load(format!(
            "source tensor `{extra}` (after mlx-lm's renames) is not part of a {} model with this config.json",
            config.model_type.name()
        )));
    }
    for t in &expected {
        let a = tensors.get(&t.name).ok_or_else(|| {
            let hint = if t.name.contains(".switch_mlp.") { " (or its per-expert `experts.{e}.*` tensors)" } else { "" };
            Error::load(format!("source checkpoint is missing tensor `{}`{hint}", t.name))
        })?;
        if a.shape() != t.shape {
            return Err(Error::load(format!("source tensor `{}` has shape {:?}, expected {:?}", t.name, a.shape(), t.shape)));
        }
        if !a.dtype().is_float() {
            return Err(Error::load(format!("source tensor `{}` has dtype {}, expected a float dtype", t.name, a.dtype())));
        }
    }

    // Cast (never expert_bias), then quantize.
    if let Some(dt) = recipe.dtype {
        for (name, a) in tensors.iter_mut() {
            if !name.contains("expert_bias") && a.dtype().is_float() && a.dtype() != dt {
                *a = a.astype(dt)?;
            }
        }
    }
    let modules: Vec<(String, usize)> = expected
        .iter()
        .filter(|t| t.module.is_some())
        .map(|t| (t.name.strip_suffix(".weight").unwrap().to_string(), *t.shape.last().unwrap() as usize))
        .collect();
    let decisions = plan_quantization(config.model_type, &modules, recipe)?;
    let mut quantized: BTreeMap<String, i32> = BTreeMap::new();
    for d in &decisions {
        let Some(spec) = d.spec else { continue };
        let wname = format!("{}.weight", d.path);
        let w = tensors.remove(&wname).expect("planned module has a weight");
        let (wq, s, b) = mlx::quantize(&w, spec).map_err(|e| e.context(format!("quantizing `{}` as {}", d.path, spec.mode.name())))?;
        tensors.insert(wname, wq);
        tensors.insert(format!("{}.scales", d.path), s);
        if let Some(b) = b {
            tensors.insert(format!("{}.biases", d.path), b);
        }
        quantized.insert(d.path.clone(), spec.bits);
    }
    let all: Vec<(String, Array)> = tensors.into_iter().collect(); // name order
    let mut params: u64 = 0;
    let mut float_counts: BTreeMap<&'static str, usize> = BTreeMap::new();
    for (name, a) in &all {
        let (module, leaf) = name.rsplit_once('.').unwrap_or(("", name));
        match (quantized.get(module), leaf) {
            (Some(bits), "weight") => params += (a.size() as u64) * 32 / *bits as u64,
            (Some(_), "scales" | "biases") => {}
            _ => {
                params += a.size() as u64;
                if a.dtype().is_float() && !name.contains("expert_bias") {
                    *float_counts.entry(a.dtype().name()).or_default() += a.size();
                }
            }
        }
    }
    let dtype = float_counts.iter().max_by_key(|(_, n)| **n).map(|(d, _)| d.to_string()).unwrap_or_default();

    // Shards in name order, like mlx-lm's make_shards over its own order.
    let limit = recipe.max_shard_bytes.unwrap_or(DEFAULT_MAX_SHARD_BYTES);
    let mut shards: Vec<Vec<(String, Array)>> = Vec::new();
    let mut size = 0u64;
    for (name, a) in all {
        let n = a.nbytes() as u64;
        if shards.is_empty() || size + n > limit {
            shards.push(Vec::new());
            size = 0;
        }
        size += n;
        shards.last_mut().unwrap().push((name, a));
    }
    let count = shards.len();
    let mut weight_map = Map::new();
    let mut total_bytes = 0u64;
    let mut files = Vec::new();
    let mut n_tensors = 0;
    for (i, shard) in shards.into_iter().enumerate() {
        let fname = if count > 1 { format!("model-{:05}-of-{:05}.safetensors", i + 1, count) } else { "model.safetensors".to_string() };
        let path = out.join(&fname);
        written.push(path.clone());
        mlx::save_safetensors(&path, &shard, &[("format".to_string(), "mlx".to_string())])
            .map_err(|e| e.context(format!("writing {}", path.display())))?;
        for (name, a) in &shard {
            total_bytes += a.nbytes() as u64;
            weight_map.insert(name.clone(), json!(fname));
        }
        n_tensors += shard.len();
        files.push(fname);
    }
    let index = json!({
        "metadata": {"total_size": total_bytes, "total_parameters": params},
        "weight_map": Value::Object(weight_map),
    });
    let index_path = out.join("model.safetensors.index.json");
    written.push(index_path.clone());
    write_json(&index_path, &index)?;
    files.push("model.safetensors.index.json".into());

    let qblock = recipe.quant.map(|g| quantization_block(g, &decisions));
    let cfg = output_config(&config.raw, qblock);
    let cfg_path = out.join("config.json");
    written.push(cfg_path.clone());
    write_json(&cfg_path, &Value::Object(cfg))?;
    files.push("config.json".into());

    let mut copied_files = Vec::new();
    for f in COPIED_FILES {
        let from = src.join(f);
        if from.is_file() {
            let to = out.join(f);
            written.push(to.clone());
            fs::copy(&from, &to).map_err(|e| io_error(format!("cannot copy {} to {}", from.display(), to.display()), e))?;
            copied_files.push(f.to_string());
        }
    }

    let mut formats: BTreeMap<(String, i32, i32), (QuantSpec, usize)> = BTreeMap::new();
    for d in &decisions {
        if let Some(s) = d.spec {
            formats.entry((s.mode.name().to_string(), s.bits, s.group_size)).or_insert((s, 0)).1 += 1;
        }
    }
    Ok(ConvertReport {
        out_dir: out.to_path_buf(),
        model_type: config.model_type.name().to_string(),
        source_layout: if hf_layout { "hf" } else { "mlx" }.to_string(),
        dtype,
        quantization: recipe.quant,
        formats: formats.into_values().collect(),
        modules: decisions,
        dropped,
        tensors: n_tensors,
        parameters: params,
        weight_bytes: total_bytes,
        bits_per_weight: if params > 0 { total_bytes as f64 * 8.0 / params as f64 } else { 0.0 },
        files,
        copied_files,
    })
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let mut s = serde_json::to_string_pretty(v).map_err(|e| Error::new(ErrorKind::Io, format!("{}: {e}", path.display())))?;
    s.push('\n');
    fs::write(path, s).map_err(|e| io_error(format!("cannot write {}", path.display()), e))
}
