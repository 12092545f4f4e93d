//! `generateFixture`: writes a deterministic random-weight LFM2 checkpoint
//! (tests, the README demo and benchmarks use it; no real weights needed).

use super::model::js_error;
use crate::fixture::{self, AttnStyle, DType, FixtureSpec, Layout, Preset};
use napi::bindgen_prelude::*;
use napi_derive::napi;
use std::path::PathBuf;

#[napi(object)]
pub struct FixtureOptions {
    /// "tiny" (default), "tiny-moe", "lfm2-350m", "lfm2-1.2b" or "lfm2-8b-a1b".
    pub preset: Option<String>,
    /// "f32" (default), "bf16" or "f16".
    pub dtype: Option<String>,
    /// "hf" (default) or "mlx".
    pub layout: Option<String>,
    pub seed: Option<u32>,
    /// Split weights into shards of at most this many bytes.
    pub max_shard_bytes: Option<f64>,
    /// "full_attn_idxs" (default), "layer_types" or "both".
    pub attn_style: Option<String>,
    /// Put rope_theta in rope_parameters instead of the top level.
    pub rope_in_parameters: Option<bool>,
    /// Leave num_key_value_heads out of config.json.
    pub omit_num_key_value_heads: Option<bool>,
}

fn spec(o: Option<FixtureOptions>) -> crate::Result<FixtureSpec> {
    let o = o.unwrap_or(FixtureOptions {
        preset: None,
        dtype: None,
        layout: None,
        seed: None,
        max_shard_bytes: None,
        attn_style: None,
        rope_in_parameters: None,
        omit_num_key_value_heads: None,
    });
    let mut s = FixtureSpec::new(Preset::parse(o.preset.as_deref().unwrap_or("tiny"))?);
    if let Some(d) = o.dtype {
        s.dtype = DType::parse(&d)?;
    }
    if let Some(l) = o.layout {
        s.layout = Layout::parse(&l)?;
    }
    s.seed = o.seed.unwrap_or(0) as u64;
    if let Some(b) = o.max_shard_bytes {
        if !(b >= 1.0) {
            return Err(crate::Error::invalid(format!("maxShardBytes must be >= 1, got {b}")));
        }
        s.max_shard_bytes = Some(b as u64);
    }
    if let Some(a) = o.attn_style {
        s.attn_style = match a.as_str() {
            "full_attn_idxs" => AttnStyle::FullAttnIdxs,
            "layer_types" => AttnStyle::LayerTypes,
            "both" => AttnStyle::Both,
            _ => {
                return Err(crate::Error::invalid(format!(
                    "attnStyle `{a}` is not valid; use full_attn_idxs, layer_types or both"
                )))
            }
        };
    }
    s.rope_in_parameters = o.rope_in_parameters.unwrap_or(false);
    s.omit_num_key_value_heads = o.omit_num_key_value_heads.unwrap_or(false);
    Ok(s)
}

/// Writes a random-weight checkpoint with a trained tokenizer and an
/// LFM2-style chat template into `dir`. Runs off the JS thread.
#[napi(ts_return_type = "Promise<void>")]
pub fn generate_fixture(env: &Env, dir: String, options: Option<FixtureOptions>) -> Result<Object<'_>> {
    let spec = spec(options).map_err(js_error)?;
    let (deferred, promise) = env.create_deferred()?;
    std::thread::spawn(move || match fixture::generate(&spec, &PathBuf::from(dir)) {
        Ok(()) => deferred.resolve(|_| Ok(())),
        Err(e) => deferred.reject(js_error(e)),
    });
    Ok(promise)
}
