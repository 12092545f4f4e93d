//! The per-projection quant-info registry.
//!
//! Built once per model at load. A projection is quantized exactly when its
//! `<path>.scales` tensor exists (the authoritative signal); its mode, bits
//! and group size come from the config entry for that path, falling back to
//! the global `quantization` block. Nothing ever infers a mode from tensor
//! shapes. Every quantized dispatch (eager or compiled) reads this registry.

use super::weights::TensorStore;
use crate::error::{Error, Result};
use crate::mlx::{QuantMode, QuantSpec};
use serde_json::{Map, Value};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Default)]
pub struct QuantRegistry {
    entries: BTreeMap<String, QuantSpec>,
}

fn spec_from(obj: &Map<String, Value>, what: &str, default_mode: QuantMode) -> Result<QuantSpec> {
    let mode = match obj.get("mode") {
        None | Some(Value::Null) => default_mode,
        Some(Value::String(s)) => QuantMode::parse(s).ok_or_else(|| {
            Error::config(format!("{what}: unknown quantization mode `{s}` (valid: affine, mxfp4, mxfp8, nvfp4)"))
        })?,
        Some(v) => return Err(Error::config(format!("{what}: `mode` must be a string, found {v}"))),
    };
    let int = |k: &str, d: Option<i32>| -> Result<i32> {
        match obj.get(k) {
            Some(v) => v
                .as_i64()
                .map(|x| x as i32)
                .ok_or_else(|| Error::config(format!("{what}: `{k}` must be an integer, found {v}"))),
            None => d.ok_or_else(|| Error::config(format!("{what}: `{k}` is missing"))),
        }
    };
    // MLX's defaults per mode, used when the config leaves a field out.
    let d = default_spec(mode);
    let spec = QuantSpec { mode, bits: int("bits", Some(d.bits))?, group_size: int("group_size", Some(d.group_size))? };
    validate_spec(&spec).map_err(|m| Error::config(format!("{what}: {m}")))?;
    Ok(spec)
}

/// MLX's default bits and group size for `mode` (mlx.nn's `_defaults_for_mode`).
pub fn default_spec(mode: QuantMode) -> QuantSpec {
    let (bits, group_size) = match mode {
        QuantMode::Affine => (4, 64),
        QuantMode::Mxfp4 => (4, 32),
        QuantMode::Mxfp8 => (8, 32),
        QuantMode::Nvfp4 => (4, 16),
    };
    QuantSpec { mode, bits, group_size }
}

/// The combinations MLX's kernels accept.
pub fn validate_spec(s: &QuantSpec) -> std::result::Result<(), String> {
    let ok = match s.mode {
        QuantMode::Affine => [2, 3, 4, 5, 6, 8].contains(&s.bits) && [32, 64, 128].contains(&s.group_size),
        QuantMode::Mxfp4 => s.bits == 4 && s.group_size == 32,
        QuantMode::Mxfp8 => s.bits == 8 && s.group_size == 32,
        QuantMode::Nvfp4 => s.bits == 4 && s.group_size == 16,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{} with bits={} group_size={} is not supported (affine: bits 2,3,4,5,6,8 and group 32/64/128; \
             mxfp4: 4/32; mxfp8: 8/32; nvfp4: 4/16)",
            s.mode.name(),
            s.bits,
            s.group_size
        ))
    }
}

impl QuantRegistry {
    pub fn build(quantization: Option<&Map<String, Value>>, store: &TensorStore) -> Result<QuantRegistry> {
        let mut entries = BTreeMap::new();
        let mut paths: Vec<String> =
            store.names().filter_map(|n| n.strip_suffix(".scales").map(str::to_string)).collect();
        paths.sort();
        if paths.is_empty() {
            return Ok(QuantRegistry { entries });
        }
        let q = quantization.ok_or_else(|| {
            Error::load(format!(
                "`{}.scales` marks a quantized projection, but config.json has no `quantization` block",
                paths[0]
            ))
        })?;
        let global_mode = match q.get("mode") {
            None | Some(Value::Null) => QuantMode::Affine,
            Some(Value::String(s)) => QuantMode::parse(s).ok_or_else(|| {
                Error::config(format!("quantization.mode `{s}` is unknown (valid: affine, mxfp4, mxfp8, nvfp4)"))
            })?,
            Some(v) => return Err(Error::config(format!("quantization.mode must be a string, found {v}"))),
        };
        for path in paths {
            let spec = match q.get(&path) {
                Some(Value::Bool(false)) => {
                    return Err(Error::load(format!(
                        "projection `{path}` has a .scales tensor but config.json's quantization turns it off"
                    )))
                }
                // A per-module entry without `mode` is affine (mlx-lm writes routers that way).
                Some(Value::Object(o)) => spec_from(o, &format!("quantization[\"{path}\"]"), QuantMode::Affine)?,
                _ => spec_from(q, "quantization", global_mode)?,
            };
            let has_biases = store.has(&format!("{path}.biases"));
            if has_biases != spec.mode.has_biases() {
                return Err(Error::load(format!(
                    "projection `{path}` is configured as {} but {} a .biases tensor",
                    spec.mode.name(),
                    if has_biases { "has" } else { "lacks" }
                )));
            }
            entries.insert(path, spec);
        }
        Ok(QuantRegistry { entries })
    }

    pub fn get(&self, path: &str) -> Option<QuantSpec> {
        self.entries.get(path).copied()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Distinct formats with how many projections use each, for info().
    pub fn summary(&self) -> Vec<(QuantSpec, usize)> {
        let mut m: BTreeMap<(String, i32, i32), (QuantSpec, usize)> = BTreeMap::new();
        for s in self.entries.values() {
            let e = m.entry((s.mode.name().to_string(), s.bits, s.group_size)).or_insert((*s, 0));
            e.1 += 1;
        }
        m.into_values().collect()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &QuantSpec)> {
        self.entries.iter()
    }
}
