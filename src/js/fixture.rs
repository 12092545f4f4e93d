//! `generateFixture`: writes a deterministic random-weight LFM2 checkpoint
//! (tests, the README demo and benchmarks use it; no real weights needed).

use super::args::{self, rejected};
use super::convert::int_option;
use super::model::js_error;
use crate::fixture::{self, AttnStyle, DType, FixtureSpec, Layout, Preset};
use napi::bindgen_prelude::*;
use napi_derive::napi;
use std::path::PathBuf;

#[napi(object)]
pub struct FixtureOptions {
    /// "tiny" (default), "tiny-moe", "lfm2-350m", "lfm2-1.2b" or "lfm2-8b-a1b".
    #[napi(ts_type = "'tiny' | 'tiny-moe' | 'lfm2-350m' | 'lfm2-1.2b' | 'lfm2-8b-a1b'")]
    pub preset: Option<String>,
    /// "f32" (default), "bf16" or "f16".
    #[napi(ts_type = "'f32' | 'bf16' | 'f16' | 'float32' | 'float16' | 'bfloat16'")]
    pub dtype: Option<String>,
    /// "hf" (default) or "mlx".
    #[napi(ts_type = "'hf' | 'mlx'")]
    pub layout: Option<String>,
    /// An integer from 0 to 2^32 - 1 (default 0).
    pub seed: Option<f64>,
    /// Split weights into shards of at most this many bytes.
    pub max_shard_bytes: Option<f64>,
    /// "full_attn_idxs" (default), "layer_types" or "both".
    #[napi(ts_type = "'full_attn_idxs' | 'layer_types' | 'both'")]
    pub attn_style: Option<String>,
    /// Put rope_theta in rope_parameters instead of the top level.
    pub rope_in_parameters: Option<bool>,
    /// Leave num_key_value_heads out of config.json.
    pub omit_num_key_value_heads: Option<bool>,
}

/// `FixtureOptions`' keys as JS spells them.
const FIXTURE_OPTION_KEYS: &[&str] =
    &["preset", "dtype", "layout", "seed", "maxShardBytes", "attnStyle", "ropeInParameters", "omitNumKeyValueHeads"];

fn spec(o: Option<FixtureOptions>) -> Result<FixtureSpec> {
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
    let mut s = FixtureSpec::new(Preset::parse(o.preset.as_deref().unwrap_or("tiny")).map_err(js_error)?);
    if let Some(d) = o.dtype {
        s.dtype = DType::parse(&d).map_err(js_error)?;
    }
    if let Some(l) = o.layout {
        s.layout = Layout::parse(&l).map_err(js_error)?;
    }
    s.seed = int_option("seed", o.seed, 0, u32::MAX as u64)?.unwrap_or(0);
    s.max_shard_bytes = int_option("maxShardBytes", o.max_shard_bytes, 1, 1 << 53)?;
    if let Some(a) = o.attn_style {
        s.attn_style = match a.as_str() {
            "full_attn_idxs" => AttnStyle::FullAttnIdxs,
            "layer_types" => AttnStyle::LayerTypes,
            "both" => AttnStyle::Both,
            _ => {
                return Err(js_error(crate::Error::invalid(format!(
                    "attnStyle `{a}` is not valid; use full_attn_idxs, layer_types or both"
                ))))
            }
        };
    }
    s.rope_in_parameters = o.rope_in_parameters.unwrap_or(false);
    s.omit_num_key_value_heads = o.omit_num_key_value_heads.unwrap_or(false);
    Ok(s)
}

/// Writes a random-weight checkpoint with a trained tokenizer and an
/// LFM2-style chat template into `dir`. Runs off the JS thread.
#[napi(ts_args_type = "dir: string, options?: FixtureOptions | undefined | null", ts_return_type = "Promise<void>")]
pub fn generate_fixture<'e>(env: &'e Env, dir: Unknown<'e>, options: Option<Unknown<'e>>) -> Result<Object<'e>> {
    let checked = args::value::<String>(&dir, "dir", "a string (a directory)")
        .and_then(|dir| Ok((dir, spec(args::options(options, "", FIXTURE_OPTION_KEYS)?)?)));
    let (dir, spec) = match checked {
        Ok(x) => x,
        Err(e) => return rejected(env, e),
    };
    let (deferred, promise) = env.create_deferred()?;
    std::thread::spawn(move || match fixture::generate(&spec, &PathBuf::from(dir)) {
        Ok(()) => deferred.resolve(|_| Ok(())),
        Err(e) => deferred.reject(js_error(e)),
    });
    Ok(promise)
}
