//! Quantized KV caches (GitHub issue 7): MLX affine 4/8-bit, and RotorQuant
//! (IsoQuant 3-bit: rotate each head vector, snap every coordinate to one of
//! 8 Lloyd-Max levels, keep one norm per head vector) with a quaternion or a
//! dense orthogonal rotation. See /docs/kv-cache-quantization.md for the spec.
//!
//! Layout of the module:
//! - `rotor.rs`: the 4-D quaternion rotation (IsoQuant's own) and the
//!   host-side reference quantizer used by the tests and the rotation study;
//! - `dense.rs`: a seeded random orthogonal rotation of the whole head vector;
//! - `pack.rs`: 3-bit index packing (device and host);
//! - `codec.rs`: the per-layer codecs that run on the device (MLX ops);
//! - `cache.rs`: the quantized KV cache with deferred prefill.
//!
//! Where the work happens: everything that runs per token is MLX ops on the
//! default device. Quantize: at the first decode step (the whole pending
//! prompt in one batch) and then once per inserted token. Dequantize: the
//! whole cached prefix once per attention call (the attention itself runs
//! on the dequantized K/V, like every known implementation). RotorQuant
//! attends in the rotated space: the query is rotated once and the output
//! rotated back once, so the cached K/V are never inverse-rotated.

pub mod cache;
pub mod codec;
pub mod dense;
pub mod pack;
pub mod rotor;

#[cfg(test)]
mod tests;

use crate::error::{Error, Result};
pub use cache::QuantKvCache;
pub use codec::Codec;

/// The rotation RotorQuant applies before snapping coordinates to levels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rotation {
    /// A seeded random orthogonal matrix over the whole head vector.
    Dense,
    /// Upstream IsoQuant: groups of 4 values rotated by fixed unit quaternions.
    Quaternion,
}

impl Rotation {
    /// The rotation `rotorquant` (no suffix) uses. Chosen by measurement
    /// (scripts/kv-quality.cjs `--study rotations`): on synthetic isotropic
    /// data both give the same error; on anisotropic / outlier-channel data
    /// the dense rotation's error stays at the isotropic level while the
    /// quaternion one grows several-fold; on this model's own K/V they tie
    /// or dense wins.
    pub const BEST: Rotation = Rotation::Dense;

    pub fn name(self) -> &'static str {
        match self {
            Rotation::Dense => "dense",
            Rotation::Quaternion => "quaternion",
        }
    }
}

/// What a KV cache stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKind {
    /// Full precision in the model's dtype (the flat cache; compiled decode).
    Default,
    /// MLX affine quantization, group 64 over head_dim.
    Affine { bits: i32 },
    /// IsoQuant 3-bit with the given rotation.
    Rotor(Rotation),
}

impl KvKind {
    pub fn is_quantized(self) -> bool {
        self != KvKind::Default
    }

    pub fn name(self) -> String {
        match self {
            KvKind::Default => "default".into(),
            KvKind::Affine { bits } => format!("affine{bits}"),
            KvKind::Rotor(r) => format!("rotorquant-{}", r.name()),
        }
    }
}

/// The accepted `kvCache` names, in the order error messages list them.
pub const VALID_NAMES: &[&str] = &[
    "default",
    "affine4",
    "affine8",
    "rotorquant",
    "rotorquant-dense",
    "rotorquant-quaternion",
    "rotorquant-adaptive",
];

/// Full-precision attention layers kept at each end by `rotorquant-adaptive`
/// when `kvCacheFullPrecisionLayers` is not given. Upstream's default is 4,
/// but LFM2 has only 6 attention layers (of 16 or 24), so 4 at each end
/// would keep every layer in full precision; 1 keeps the first and the last
/// attention layers exact and quantizes the 4 in between.
pub const DEFAULT_FULL_PRECISION_LAYERS: usize = 1;

/// A validated `kvCache` setting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCacheConfig {
    /// The name as given (after defaulting), e.g. "rotorquant-adaptive".
    pub name: String,
    pub kind: KvKind,
    /// Attention layers kept in full precision at each end (adaptive only).
    pub full_precision_layers: usize,
    pub adaptive: bool,
}

impl Default for KvCacheConfig {
    fn default() -> Self {
        KvCacheConfig { name: "default".into(), kind: KvKind::Default, full_precision_layers: 0, adaptive: false }
    }
}

fn valid_list() -> String {
    VALID_NAMES.join(", ")
}

impl KvCacheConfig {
    /// Parses a `kvCache` name and the optional full-precision layer count.
    /// `source` names where the value came from for the error message
    /// (e.g. "kvCache" or "MLX_LFM_KV_CACHE").
    pub fn parse(name: &str, full_precision_layers: Option<usize>, source: &str) -> Result<KvCacheConfig> {
        let (kind, adaptive) = match name {
            "default" => (KvKind::Default, false),
            "affine4" => (KvKind::Affine { bits: 4 }, false),
            "affine8" => (KvKind::Affine { bits: 8 }, false),
            "rotorquant" => (KvKind::Rotor(Rotation::BEST), false),
            "rotorquant-dense" => (KvKind::Rotor(Rotation::Dense), false),
            "rotorquant-quaternion" => (KvKind::Rotor(Rotation::Quaternion), false),
            "rotorquant-adaptive" => (KvKind::Rotor(Rotation::BEST), true),
            _ => {
                return Err(Error::config(format!("{source} `{name}` is not valid; use one of: {}", valid_list())));
            }
        };
        if full_precision_layers.is_some() && !adaptive {
            return Err(Error::config(format!(
                "kvCacheFullPrecisionLayers (MLX_LFM_KV_CACHE_FULL_PRECISION_LAYERS) only applies to kvCache \
                 `rotorquant-adaptive`, not `{name}`"
            )));
        }
        Ok(KvCacheConfig {
            name: name.to_string(),
            kind,
            full_precision_layers: if adaptive { full_precision_layers.unwrap_or(DEFAULT_FULL_PRECISION_LAYERS) } else { 0 },
            adaptive,
        })
    }

    /// Resolves the setting from the load options (they win) and the
    /// MLX_LFM_KV_CACHE / MLX_LFM_KV_CACHE_FULL_PRECISION_LAYERS variables.
    /// A set variable is always validated, so a typo never hides.
    pub fn resolve(option: Option<&str>, option_layers: Option<usize>) -> Result<KvCacheConfig> {
        let env_name = env_value("MLX_LFM_KV_CACHE")?;
        if let Some(n) = &env_name {
            KvCacheConfig::parse(n, None, "MLX_LFM_KV_CACHE")?;
        }
        let env_layers = match env_value("MLX_LFM_KV_CACHE_FULL_PRECISION_LAYERS")? {
            None => None,
            Some(v) => Some(v.parse::<usize>().map_err(|_| {
                Error::config(format!("MLX_LFM_KV_CACHE_FULL_PRECISION_LAYERS={v} is not valid; use a whole number >= 0"))
            })?),
        };
        let (name, source) = match (option, env_name) {
            (Some(n), _) => (n.to_string(), "kvCache"),
            (None, Some(n)) => (n, "MLX_LFM_KV_CACHE"),
            (None, None) => ("default".to_string(), "kvCache"),
        };
        KvCacheConfig::parse(&name, option_layers.or(env_layers), source)
    }

    /// Per layer: the kind of KV cache it gets (`None` for conv layers).
    /// Fails when adaptive would keep every attention layer in full precision.
    pub fn layer_kinds(&self, attn_layers: &[bool]) -> Result<Vec<Option<KvKind>>> {
        let attn: Vec<usize> = attn_layers.iter().enumerate().filter(|(_, &a)| a).map(|(i, _)| i).collect();
        let n = self.full_precision_layers;
        if self.adaptive && self.kind.is_quantized() && 2 * n >= attn.len() {
            return Err(Error::config(format!(
                "kvCache `{}` with kvCacheFullPrecisionLayers={n} would keep all {} attention layers in full precision \
                 (the first {n} and the last {n}); use at most {}",
                self.name,
                attn.len(),
                attn.len().saturating_sub(1) / 2
            )));
        }
        Ok(attn_layers
            .iter()
            .enumerate()
            .map(|(i, &a)| {
                if !a {
                    return None;
                }
                let rank = attn.iter().position(|&j| j == i).unwrap();
                let full = self.adaptive && (rank < n || rank >= attn.len() - n);
                Some(if full { KvKind::Default } else { self.kind })
            })
            .collect())
    }
}

fn env_value(name: &str) -> Result<Option<String>> {
    match std::env::var(name) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(_) => Err(Error::config(format!("{name} is not valid UTF-8"))),
        Ok(v) if v.trim().is_empty() => Ok(None),
        Ok(v) => Ok(Some(v.trim().to_string())),
    }
}
