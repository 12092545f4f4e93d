//! config.json of LFM2 / LFM2-MoE checkpoints, validated into the shape facts
//! the engine needs. Every rejection names the field and the bad value.

use crate::error::{Error, Result};
use serde_json::{Map, Value};
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelType {
    Lfm2,
    Lfm2Moe,
}

impl ModelType {
    pub fn name(self) -> &'static str {
        match self {
            ModelType::Lfm2 => "lfm2",
            ModelType::Lfm2Moe => "lfm2_moe",
        }
    }

    /// Also accepts `dense` / `moe` and `-` for `_` (command-line spellings).
    pub fn parse(s: &str) -> Result<ModelType> {
        match s.trim().to_ascii_lowercase().replace('-', "_").as_str() {
            "lfm2" | "dense" => Ok(ModelType::Lfm2),
            "lfm2_moe" | "moe" => Ok(ModelType::Lfm2Moe),
            _ => Err(Error::invalid(format!("unknown model type {s:?} (expected lfm2 or lfm2_moe)"))),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub experts_per_token: usize,
    pub moe_ff_dim: usize,
    pub num_dense_layers: usize,
    pub norm_topk_prob: bool,
    pub use_expert_bias: bool,
    pub routed_scaling_factor: f32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub model_type: ModelType,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub norm_eps: f32,
    pub conv_bias: bool,
    pub conv_kernel: usize,
    /// Dense feed-forward width after the auto-adjust rule.
    pub ff_dim: usize,
    pub rope_theta: f32,
    pub max_position_embeddings: usize,
    /// true where layer i is attention, false where it is a short conv.
    pub attn_layers: Vec<bool>,
    pub tie_word_embeddings: bool,
    pub moe: Option<MoeConfig>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The raw `quantization` block, interpreted by the quant registry.
    pub quantization: Option<Map<String, Value>>,
    pub raw: Map<String, Value>,
}

/// The largest value each size field may take. Far above any LFM2 release
/// (and small enough that every derived shape fits MLX's i32 dimensions and
/// no buffer sized from it is absurd), checked before anything is allocated
/// or cast: a config.json is input, and a hostile one must be an error, not
/// an allocation that aborts the process.
pub const LIMITS: &[(&str, u64)] = &[
    ("vocab_size", 1 << 24),
    ("hidden_size", 1 << 16),
    ("block_dim", 1 << 16),
    ("num_hidden_layers", 1024),
    ("num_attention_heads", 4096),
    ("num_key_value_heads", 4096),
    ("conv_L_cache", 1024),
    ("block_ff_dim", 1 << 20),
    ("intermediate_size", 1 << 20),
    ("block_multiple_of", 1 << 16),
    ("max_position_embeddings", 1 << 27),
    ("num_experts", 4096),
    ("num_experts_per_tok", 256),
    ("num_dense_layers", 1024),
    ("moe_intermediate_size", 1 << 20),
];

fn limit(k: &str) -> u64 {
    LIMITS.iter().find(|(n, _)| *n == k).map(|(_, l)| *l).unwrap_or(i32::MAX as u64)
}

struct Fields<'a> {
    m: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn get(&self, k: &str) -> Option<&'a Value> {
        self.m.get(k).filter(|v| !v.is_null())
    }
    /// A non-negative integer no larger than the field's limit ([`LIMITS`]).
    fn usize_opt(&self, k: &str) -> Result<Option<usize>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) if n <= limit(k) => Ok(Some(n as usize)),
                Some(n) => Err(Error::config(format!(
                    "config.json field `{k}` is {n}, more than the {} this engine accepts",
                    limit(k)
                ))),
                None => Err(Error::config(format!("config.json field `{k}` must be a non-negative integer, found {v}"))),
            },
        }
    }
    fn usize_req(&self, k: &str) -> Result<usize> {
        self.usize_opt(k)?.ok_or_else(|| Error::config(format!("config.json is missing required field `{k}`")))
    }
    fn positive(&self, k: &str) -> Result<usize> {
        let n = self.usize_req(k)?;
        if n == 0 {
            return Err(Error::config(format!("config.json field `{k}` must be positive, found 0")));
        }
        Ok(n)
    }
    /// A number that stays finite as the f32 the model computes with.
    fn f64_opt(&self, k: &str) -> Result<Option<f64>> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if (x as f32).is_finite() => Ok(Some(x)),
                Some(x) => Err(Error::config(format!("config.json field `{k}` is {x:?}, which is not finite as a float32"))),
                None => Err(Error::config(format!("config.json field `{k}` must be a number, found {v}"))),
            },
        }
    }
    fn bool_or(&self, k: &str, default: bool) -> Result<bool> {
        match self.get(k) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(Error::config(format!("config.json field `{k}` must be true or false, found {v}"))),
        }
    }
}

/// Token ids in config/generation_config may be an int or a list of ints.
pub fn token_ids(v: Option<&Value>, field: &str, file: &str) -> Result<Vec<u32>> {
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Number(n)) => n
            .as_u64()
            .and_then(|x| u32::try_from(x).ok())
            .map(|x| vec![x])
            .ok_or_else(|| Error::config(format!("{file} field `{field}` must be a token id, found {n}"))),
        Some(Value::Array(a)) if a.len() <= 1024 => a
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|x| u32::try_from(x).ok())
                    .ok_or_else(|| Error::config(format!("{file} field `{field}` has an entry {x} that is not a token id")))
            })
            .collect(),
        Some(Value::Array(a)) => Err(Error::config(format!("{file} field `{field}` lists {} ids, more than 1024", a.len()))),
        Some(v) => Err(Error::config(format!("{file} field `{field}` must be an id or a list of ids, found {v}"))),
    }
}

/// The LFM2 rule for the dense feed-forward width.
pub fn adjusted_ff_dim(ff: usize, auto_adjust: bool, multiplier: Option<f64>, multiple_of: usize) -> usize {
    if !auto_adjust {
        return ff;
    }
    let mut ff = (2 * ff) / 3;
    if let Some(m) = multiplier {
        ff = (m * ff as f64) as usize;
    }
    let m = multiple_of.max(1);
    m * ff.div_ceil(m)
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<ModelConfig> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| Error::load(format!("cannot read {}: {e}", path.display())))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::config(format!("{} is not valid JSON: {e}", path.display())))?;
        match v {
            Value::Object(m) => Self::from_map(m),
            _ => Err(Error::config(format!("{} must hold a JSON object", path.display()))),
        }
    }

    pub fn from_map(m: Map<String, Value>) -> Result<ModelConfig> {
        let f = Fields { m: &m };
        let model_type = match f.get("model_type").and_then(Value::as_str) {
            Some("lfm2") => ModelType::Lfm2,
            Some("lfm2_moe") => ModelType::Lfm2Moe,
            Some(other) => {
                return Err(Error::config(format!("unknown model_type `{other}` (supported: lfm2, lfm2_moe)")))
            }
            None => return Err(Error::config("config.json has no `model_type` (expected lfm2 or lfm2_moe)")),
        };
        let vocab_size = f.positive("vocab_size")?;
        let hidden_size = f.positive("hidden_size")?;
        let num_layers = f.positive("num_hidden_layers")?;
        let num_heads = f.positive("num_attention_heads")?;
        let num_kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
        if num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(Error::config(format!(
                "num_key_value_heads ({num_kv_heads}) must be positive and divide num_attention_heads ({num_heads})"
            )));
        }
        if hidden_size % num_heads != 0 {
            return Err(Error::config(format!(
                "hidden_size ({hidden_size}) is not divisible by num_attention_heads ({num_heads})"
            )));
        }
        let head_dim = hidden_size / num_heads;
        if let Some(block_dim) = f.usize_opt("block_dim")? {
            if block_dim != hidden_size {
                return Err(Error::config(format!("block_dim ({block_dim}) differs from hidden_size ({hidden_size})")));
            }
        }
        let norm_eps = f.f64_opt("norm_eps")?.unwrap_or(1e-5);
        if !((norm_eps as f32) > 0.0 && norm_eps < 1.0) {
            return Err(Error::config(format!("norm_eps must be in (0, 1), found {norm_eps}")));
        }
        let conv_kernel = f.usize_opt("conv_L_cache")?.unwrap_or(3);
        if conv_kernel < 2 {
            return Err(Error::config(format!("conv_L_cache must be at least 2, found {conv_kernel}")));
        }
        let ff_dim = match model_type {
            ModelType::Lfm2 => {
                let raw = match f.usize_opt("block_ff_dim")? {
                    Some(n) => n,
                    None => f.usize_opt("intermediate_size")?.ok_or_else(|| {
                        Error::config("config.json needs `block_ff_dim` or `intermediate_size` for the feed-forward width")
                    })?,
                };
                let multiplier = f.f64_opt("block_ffn_dim_multiplier")?;
                if let Some(m) = multiplier.filter(|m| !(*m > 0.0 && *m <= 16.0)) {
                    return Err(Error::config(format!("block_ffn_dim_multiplier must be in (0, 16], found {m:?}")));
                }
                adjusted_ff_dim(
                    raw,
                    f.bool_or("block_auto_adjust_ff_dim", false)?,
                    multiplier,
                    f.usize_opt("block_multiple_of")?.unwrap_or(256),
                )
            }
            // LFM2-MoE dense layers use intermediate_size as is.
            ModelType::Lfm2Moe => f.positive("intermediate_size")?,
        };
        if ff_dim == 0 || ff_dim as u64 > limit("intermediate_size") {
            return Err(Error::config(format!("the feed-forward width works out to {ff_dim}")));
        }
        let rope_theta = match f.get("rope_parameters").and_then(|r| r.get("rope_theta")) {
            Some(v) => v
                .as_f64()
                .ok_or_else(|| Error::config(format!("rope_parameters.rope_theta must be a number, found {v}")))?,
            None => f.f64_opt("rope_theta")?.unwrap_or(1_000_000.0),
        };
        if !(rope_theta > 0.0 && rope_theta <= 1e12) {
            return Err(Error::config(format!("rope_theta must be in (0, 1e12], found {rope_theta}")));
        }
        let attn_layers = Self::attention_layers(&f, num_layers)?;
        let moe = match model_type {
            ModelType::Lfm2 => None,
            ModelType::Lfm2Moe => {
                let num_experts = f.positive("num_experts")?;
                let experts_per_token = f.positive("num_experts_per_tok")?;
                if experts_per_token > num_experts {
                    return Err(Error::config(format!(
                        "num_experts_per_tok ({experts_per_token}) exceeds num_experts ({num_experts})"
                    )));
                }
                let num_dense_layers = f.usize_opt("num_dense_layers")?.unwrap_or(0);
                if num_dense_layers > num_layers {
                    return Err(Error::config(format!(
                        "num_dense_layers ({num_dense_layers}) exceeds num_hidden_layers ({num_layers})"
                    )));
                }
                Some(MoeConfig {
                    num_experts,
                    experts_per_token,
                    moe_ff_dim: f.positive("moe_intermediate_size")?,
                    num_dense_layers,
                    norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
                    use_expert_bias: f.bool_or("use_expert_bias", true)?,
                    routed_scaling_factor: match f.f64_opt("routed_scaling_factor")?.unwrap_or(1.0) {
                        x if x > 0.0 && x <= 1e6 => x as f32,
                        x => return Err(Error::config(format!("routed_scaling_factor must be in (0, 1e6], found {x}"))),
                    },
                })
            }
        };
        let quantization = match f.get("quantization").or_else(|| f.get("quantization_config")) {
            None => None,
            Some(Value::Object(q)) => Some(q.clone()),
            Some(v) => return Err(Error::config(format!("`quantization` must be an object, found {v}"))),
        };
        let bos_token_id = token_ids(f.get("bos_token_id"), "bos_token_id", "config.json")?.first().copied();
        let eos_token_ids = token_ids(f.get("eos_token_id"), "eos_token_id", "config.json")?;
        for &id in eos_token_ids.iter().chain(bos_token_id.iter()) {
            if id as usize >= vocab_size {
                return Err(Error::config(format!("token id {id} in config.json is outside vocab_size {vocab_size}")));
            }
        }
        Ok(ModelConfig {
            model_type,
            vocab_size,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            norm_eps: norm_eps as f32,
            conv_bias: f.bool_or("conv_bias", false)?,
            conv_kernel,
            ff_dim,
            rope_theta: rope_theta as f32,
            max_position_embeddings: f.usize_opt("max_position_embeddings")?.unwrap_or(128_000),
            attn_layers,
            tie_word_embeddings: f.bool_or("tie_word_embeddings", true)?,
            moe,
            bos_token_id,
            eos_token_ids,
            quantization,
            raw: m.clone(),
        })
    }

    fn attention_layers(f: &Fields, n: usize) -> Result<Vec<bool>> {
        let mut attn = vec![false; n];
        if let Some(v) = f.get("full_attn_idxs") {
            let list = v
                .as_array()
                .ok_or_else(|| Error::config(format!("full_attn_idxs must be a list of layer indices, found {v}")))?;
            for x in list {
                let i = x.as_u64().ok_or_else(|| Error::config(format!("full_attn_idxs has a non-integer entry {x}")))?;
                if i >= n as u64 {
                    return Err(Error::config(format!(
                        "full_attn_idxs entry {i} is out of range for num_hidden_layers {n}"
                    )));
                }
                attn[i as usize] = true;
            }
        } else if let Some(v) = f.get("layer_types") {
            let list = v.as_array().ok_or_else(|| Error::config(format!("layer_types must be a list, found {v}")))?;
            if list.len() != n {
                return Err(Error::config(format!(
                    "layer_types has {} entries but num_hidden_layers is {n}",
                    list.len()
                )));
            }
            for (i, t) in list.iter().enumerate() {
                match t.as_str() {
                    Some("full_attention") => attn[i] = true,
                    Some("conv") => {}
                    _ => {
                        return Err(Error::config(format!(
                            "layer_types[{i}] is {t}; expected \"full_attention\" or \"conv\""
                        )))
                    }
                }
            }
        } else {
            return Err(Error::config("config.json needs `full_attn_idxs` or `layer_types` to say which layers are attention"));
        }
        Ok(attn)
    }

    pub fn num_attention_layers(&self) -> usize {
        self.attn_layers.iter().filter(|&&a| a).count()
    }

    /// Whether layer i's feed-forward is a sparse MoE block.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| i >= m.num_dense_layers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Map<String, Value> {
        json!({
            "model_type": "lfm2", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "norm_eps": 1e-5, "conv_bias": false,
            "conv_L_cache": 3, "block_dim": 64, "block_ff_dim": 256, "block_multiple_of": 32,
            "block_ffn_dim_multiplier": 1.0, "block_auto_adjust_ff_dim": true, "full_attn_idxs": [1, 3],
            "rope_theta": 10000.0, "eos_token_id": 7
        })
        .as_object()
        .unwrap()
        .clone()
    }

    #[test]
    fn parses_and_adjusts_ff() {
        let c = ModelConfig::from_map(base()).unwrap();
        // int(2*256/3) = 170 -> *1.0 -> round up to 32 -> 192
        assert_eq!(c.ff_dim, 192);
        assert_eq!(c.attn_layers, vec![false, true, false, true]);
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.eos_token_ids, vec![7]);
        // The released 1.2B: 12288 -> 8192 (int(2*12288/3) = 8192, multiple of 256)
        assert_eq!(adjusted_ff_dim(12288, true, Some(1.0), 256), 8192);
        assert_eq!(adjusted_ff_dim(6656, true, Some(1.0), 256), 4608);
    }

    #[test]
    fn layer_types_rope_parameters_and_default_kv_heads() {
        let mut m = base();
        m.remove("full_attn_idxs");
        m.remove("num_key_value_heads");
        m.remove("rope_theta");
        m.insert("layer_types".into(), json!(["conv", "full_attention", "conv", "conv"]));
        m.insert("rope_parameters".into(), json!({"rope_theta": 5000.0, "rope_type": "default"}));
        let c = ModelConfig::from_map(m).unwrap();
        assert_eq!(c.attn_layers, vec![false, true, false, false]);
        assert_eq!(c.num_kv_heads, 4);
        assert_eq!(c.rope_theta, 5000.0);
    }

    #[test]
    fn bad_values_name_the_field() {
        let mut m = base();
        m.insert("model_type".into(), json!("llama"));
        assert!(ModelConfig::from_map(m).unwrap_err().message.contains("unknown model_type `llama`"));
        let mut m = base();
        m.insert("num_key_value_heads".into(), json!(3));
        assert!(ModelConfig::from_map(m).unwrap_err().message.contains("num_key_value_heads (3)"));
        let mut m = base();
        m.insert("full_attn_idxs".into(), json!([9]));
        assert!(ModelConfig::from_map(m).unwrap_err().message.contains("entry 9 is out of range"));
        let mut m = base();
        m.insert("hidden_size".into(), json!("64"));
        assert!(ModelConfig::from_map(m).unwrap_err().message.contains("`hidden_size`"));
        let mut m = base();
        m.remove("vocab_size");
        assert!(ModelConfig::from_map(m).unwrap_err().message.contains("missing required field `vocab_size`"));
        let mut m = base();
        m.insert("layer_types".into(), json!(["conv"]));
        m.remove("full_attn_idxs");
        assert!(ModelConfig::from_map(m).unwrap_err().message.contains("layer_types has 1 entries"));
    }

    /// Sizes are bounded before anything is allocated or cast (no abort on
    /// 1e9 layers, no i32 wrap of 2^32 + 1024), floats must stay finite.
    #[test]
    fn absurd_sizes_and_floats_are_rejected_by_name() {
        let cases: Vec<(&str, Value, &str)> = vec![
            ("num_hidden_layers", json!(1_000_000_000u64), "`num_hidden_layers` is 1000000000, more than the 1024"),
            ("vocab_size", json!((1u64 << 32) + 1024), "`vocab_size` is 4294968320"),
            ("hidden_size", json!((1u64 << 32) + 64), "`hidden_size` is 4294967360"),
            ("conv_L_cache", json!(1u64 << 40), "`conv_L_cache` is 1099511627776"),
            ("block_ff_dim", json!(1u64 << 33), "`block_ff_dim` is 8589934592"),
            ("max_position_embeddings", json!(u64::MAX), "`max_position_embeddings` is 18446744073709551615"),
            ("rope_theta", json!(1e300), "`rope_theta` is 1e300, which is not finite"),
            ("rope_theta", json!(-1.0), "rope_theta must be in (0, 1e12]"),
            ("norm_eps", json!(1e-300), "norm_eps must be in (0, 1)"),
            ("block_ffn_dim_multiplier", json!(1e30), "block_ffn_dim_multiplier must be in (0, 16]"),
            ("eos_token_id", json!((1u64 << 32) + 5), "must be a token id, found 4294967301"),
            ("eos_token_id", json!([1, 2.5]), "has an entry 2.5 that is not a token id"),
            ("full_attn_idxs", json!([1, u64::MAX]), "entry 18446744073709551615 is out of range"),
        ];
        for (k, v, want) in cases {
            let mut m = base();
            m.insert(k.into(), v.clone());
            let err = ModelConfig::from_map(m).expect_err(&format!("{k} = {v} was accepted")).message;
            assert!(err.contains(want), "{k} = {v}: {err}");
        }
        let mut m = base();
        m.insert("model_type".into(), json!("lfm2_moe"));
        m.insert("intermediate_size".into(), json!(128));
        m.insert("moe_intermediate_size".into(), json!(64));
        m.insert("num_experts".into(), json!(1u64 << 31));
        m.insert("num_experts_per_tok".into(), json!(2));
        let err = ModelConfig::from_map(m).unwrap_err().message;
        assert!(err.contains("`num_experts` is 2147483648"), "{err}");
    }
}
