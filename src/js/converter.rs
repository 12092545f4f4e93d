//! `convert`: an LFM2 / LFM2-MoE checkpoint to an (optionally quantized)
//! MLX-layout checkpoint, off the JS thread. The work is crate::convert's.

use super::args::{self, rejected};
use super::convert::{int_option, QuantizationInfo};
use super::model::js_error;
use crate::convert::{self, ConvertRecipe, OverrideAction, QuantOverride};
use crate::error::Error;
use crate::mlx::{runtime, Dtype, QuantMode};
use napi::bindgen_prelude::*;
use napi_derive::napi;
use std::path::PathBuf;

#[napi(object)]
pub struct QuantOverrideOptions {
    /// Module path pattern: `*` matches anything; a pattern matches a path
    /// as a whole or as a dot-separated tail (`feed_forward.gate` names
    /// every router). The last matching override wins.
    pub pattern: String,
    /// Leave matching modules unquantized.
    pub skip: Option<bool>,
    pub bits: Option<f64>,
    pub group_size: Option<f64>,
    /// Defaults to the global mode.
    #[napi(ts_type = "'affine' | 'mxfp4' | 'mxfp8' | 'nvfp4'")]
    pub mode: Option<String>,
}

const OVERRIDE_KEYS: &[&str] = &["pattern", "skip", "bits", "groupSize", "mode"];

#[napi(object)]
pub struct ConvertOptions {
    /// "affine", "mxfp4", "mxfp8" or "nvfp4". Quantization happens when
    /// mode, bits or groupSize is given (mode defaults to "affine").
    #[napi(ts_type = "'affine' | 'mxfp4' | 'mxfp8' | 'nvfp4'")]
    pub mode: Option<String>,
    /// Defaults per mode: affine 4, mxfp4 4, mxfp8 8, nvfp4 4.
    pub bits: Option<f64>,
    /// Defaults per mode: affine 64, mxfp4 32, mxfp8 32, nvfp4 16.
    pub group_size: Option<f64>,
    /// Cast float tensors (never expert_bias): "float32", "float16" or "bfloat16".
    #[napi(ts_type = "'float32' | 'float16' | 'bfloat16' | 'f32' | 'f16' | 'bf16'")]
    pub dtype: Option<String>,
    /// Per-module rules, as objects or as `PATH=BITS[:GROUP[:MODE]]` / `PATH=skip` strings.
    pub overrides: Option<Vec<Either<String, QuantOverrideOptions>>>,
    /// Largest safetensors shard in bytes (default 5 GiB, as mlx-lm).
    pub max_shard_bytes: Option<f64>,
}

const CONVERT_OPTION_KEYS: &[&str] = &["mode", "bits", "groupSize", "dtype", "overrides", "maxShardBytes"];

/// A quantization width or group size: a small integer, never wrapped.
fn small_int(name: &str, v: Option<f64>) -> Result<Option<i32>> {
    Ok(int_option(name, v, 1, 1 << 16)?.map(|n| n as i32))
}

#[napi(object)]
pub struct QuantSpecInfo {
    #[napi(ts_type = "'affine' | 'mxfp4' | 'mxfp8' | 'nvfp4'")]
    pub mode: String,
    pub bits: i32,
    pub group_size: i32,
}

#[napi(object)]
pub struct UnquantizedModule {
    pub path: String,
    pub reason: String,
}

#[napi(object)]
pub struct ConvertReport {
    pub out_dir: String,
    #[napi(ts_type = "'lfm2' | 'lfm2_moe'")]
    pub model_type: String,
    /// The source's layout.
    #[napi(ts_type = "'hf' | 'mlx'")]
    pub source_layout: String,
    /// Dtype of the unquantized float weights written.
    #[napi(ts_type = "'float32' | 'float16' | 'bfloat16'")]
    pub dtype: String,
    /// The recipe's global format; absent when not quantized.
    pub global_quantization: Option<QuantSpecInfo>,
    /// Formats used, with how many modules use each.
    pub quantization: Vec<QuantizationInfo>,
    pub quantized_modules: u32,
    /// Quantizable modules left unquantized, and why.
    pub unquantized: Vec<UnquantizedModule>,
    /// Source tensors not written (a tied model's lm_head.weight).
    pub dropped: Vec<String>,
    pub tensors: u32,
    pub parameters: f64,
    pub weight_bytes: f64,
    pub bits_per_weight: f64,
    /// Files written, and those copied from the source.
    pub files: Vec<String>,
    pub copied_files: Vec<String>,
}

fn mode(s: &str, what: &str) -> crate::Result<QuantMode> {
    QuantMode::parse(s)
        .ok_or_else(|| Error::invalid(format!("{what} `{s}` is not valid; use affine, mxfp4, mxfp8 or nvfp4")))
}

fn recipe(o: Option<ConvertOptions>) -> Result<ConvertRecipe> {
    recipe_checked(o).map_err(|e| match e {
        Checked::Js(e) => e,
        Checked::Engine(e) => js_error(e),
    })
}

/// Errors from our own checks (already JS errors) or the crate's.
enum Checked {
    Js(napi::Error),
    Engine(Error),
}

impl From<Error> for Checked {
    fn from(e: Error) -> Self {
        Checked::Engine(e)
    }
}

impl From<napi::Error> for Checked {
    fn from(e: napi::Error) -> Self {
        Checked::Js(e)
    }
}

fn recipe_checked(o: Option<ConvertOptions>) -> std::result::Result<ConvertRecipe, Checked> {
    let Some(o) = o else { return Ok(ConvertRecipe::default()) };
    let bits = small_int("bits", o.bits)?;
    let group_size = small_int("groupSize", o.group_size)?;
    let mut r = if o.mode.is_some() || bits.is_some() || group_size.is_some() {
        let m = mode(o.mode.as_deref().unwrap_or("affine"), "mode")?;
        ConvertRecipe::quantized(m, bits, group_size)?
    } else {
        ConvertRecipe::default()
    };
    if let Some(d) = o.dtype {
        r.dtype = Some(
            Dtype::parse(&d).ok_or_else(|| Error::invalid(format!("dtype `{d}` is not valid; use float32, float16 or bfloat16")))?,
        );
    }
    for (i, x) in o.overrides.unwrap_or_default().into_iter().enumerate() {
        r.overrides.push(match x {
            Either::A(s) => QuantOverride::parse(&s)?,
            Either::B(x) => {
                let action = if x.skip.unwrap_or(false) {
                    if x.bits.is_some() || x.group_size.is_some() || x.mode.is_some() {
                        return Err(Error::invalid(format!(
                            "overrides[{i}] (`{}`) sets skip together with bits/groupSize/mode",
                            x.pattern
                        ))
                        .into());
                    }
                    OverrideAction::Skip
                } else {
                    OverrideAction::Quantize {
                        mode: x.mode.as_deref().map(|m| mode(m, &format!("overrides[{i}].mode"))).transpose()?,
                        bits: small_int(&format!("overrides[{i}].bits"), x.bits)?,
                        group_size: small_int(&format!("overrides[{i}].groupSize"), x.group_size)?,
                    }
                };
                if x.pattern.trim().is_empty() {
                    return Err(Error::invalid(format!("overrides[{i}].pattern is empty")).into());
                }
                QuantOverride { pattern: x.pattern, action }
            }
        });
    }
    r.max_shard_bytes = int_option("maxShardBytes", o.max_shard_bytes, 1, 1 << 53)?;
    r.validate()?;
    Ok(r)
}

/// The options, with the keys of each override object checked too.
fn convert_options(v: Option<Unknown>) -> Result<Option<ConvertOptions>> {
    if let Some(raw) = v.as_ref().filter(|o| o.get_type().is_ok_and(|t| t == ValueType::Object)) {
        // SAFETY: checked to be an object of the current call's environment.
        let obj = unsafe { Object::from_napi_value(raw.value().env, raw.raw()) }?;
        if let Some(list) = obj.get::<Unknown>("overrides")?.filter(args::is_array) {
            // SAFETY: checked to be an array.
            let arr = unsafe { Array::from_napi_value(list.value().env, list.raw()) }?;
            for i in 0..arr.len() {
                if let Some(x) = arr.get::<Unknown>(i)?.filter(|x| x.get_type().is_ok_and(|t| t == ValueType::Object)) {
                    args::message::<QuantOverrideOptions>(&x, &format!("overrides[{i}]"), OVERRIDE_KEYS)?;
                }
            }
        }
    }
    args::options(v, "", CONVERT_OPTION_KEYS)
}

fn report(r: convert::ConvertReport) -> ConvertReport {
    ConvertReport {
        out_dir: r.out_dir.display().to_string(),
        model_type: r.model_type,
        source_layout: r.source_layout,
        dtype: r.dtype,
        global_quantization: r.quantization.map(|q| QuantSpecInfo { mode: q.mode.name().into(), bits: q.bits, group_size: q.group_size }),
        quantization: r
            .formats
            .iter()
            .map(|(s, n)| QuantizationInfo { mode: s.mode.name().into(), bits: s.bits, group_size: s.group_size, projections: *n as u32 })
            .collect(),
        quantized_modules: r.modules.iter().filter(|m| m.spec.is_some()).count() as u32,
        unquantized: r
            .modules
            .iter()
            .filter(|m| m.spec.is_none())
            .map(|m| UnquantizedModule { path: m.path.clone(), reason: m.reason.clone().unwrap_or_default() })
            .collect(),
        dropped: r.dropped,
        tensors: r.tensors as u32,
        parameters: r.parameters as f64,
        weight_bytes: r.weight_bytes as f64,
        bits_per_weight: r.bits_per_weight,
        files: r.files,
        copied_files: r.copied_files,
    }
}

/// Converts the LFM2 / LFM2-MoE checkpoint in `src` (Hugging Face or MLX
/// layout) into an MLX-layout checkpoint in `out` (new or empty), cast and
/// quantized as `options` say, the way mlx-lm's converter does. Runs off
/// the JS thread.
#[napi(
    ts_args_type = "src: string, out: string, options?: ConvertOptions | undefined | null",
    ts_return_type = "Promise<ConvertReport>"
)]
pub fn convert<'e>(env: &'e Env, src: Unknown<'e>, out: Unknown<'e>, options: Option<Unknown<'e>>) -> Result<Object<'e>> {
    let checked = (|| {
        let src: String = args::value(&src, "src", "a string (a checkpoint directory)")?;
        let out: String = args::value(&out, "out", "a string (a directory)")?;
        Ok((src, out, recipe(convert_options(options)?)?))
    })();
    let (src, out, recipe) = match checked {
        Ok(x) => x,
        Err(e) => return rejected(env, e),
    };
    let (deferred, promise) = env.create_deferred()?;
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            runtime::use_new_stream()?;
            convert::convert(&PathBuf::from(src), &PathBuf::from(out), &recipe)
        }))
        .unwrap_or_else(|_| Err(Error::mlx("the converter panicked")));
        match r {
            Ok(r) => deferred.resolve(move |_| Ok(report(r))),
            Err(e) => deferred.reject(js_error(e)),
        }
    });
    Ok(promise)
}
