use crate::mlx::runtime;
use super::args;
use napi::bindgen_prelude::{Env, Float32Array, Object, Unknown};
use napi_derive::napi;

#[napi(object)]
pub struct MemoryInfo {
    /// Bytes held by live MLX arrays.
    pub active_bytes: f64,
    /// Highest `activeBytes` since start (or the last reset).
    pub peak_bytes: f64,
    /// Freed buffers MLX keeps for reuse.
    pub cache_bytes: f64,
    /// MLX's memory limit (a guideline for graph evaluation).
    pub limit_bytes: f64,
    /// The device's total memory when MLX reports it, else 0.
    pub device_total_bytes: f64,
}

#[napi(object)]
pub struct MlxInfo {
    /// MLX library version, e.g. "0.32.4".
    pub version: String,
    /// Which libmlx build is loaded.
    #[napi(ts_type = "'cpu' | 'cuda' | 'metal'")]
    pub backend: String,
    /// MLX's default device.
    #[napi(ts_type = "'cpu' | 'gpu'")]
    pub default_device: String,
    pub device_name: String,
    pub memory: MemoryInfo,
    /// Which native package was loaded: "mlx-lfm-linux-x64-gnu-cuda",
    /// "mlx-lfm-linux-x64-gnu", ..., or "local build" (a `.node` next to
    /// the package, as `npm run build` leaves it).
    pub binding: Option<String>,
    /// Why that one (e.g. "MLX_LFM_BACKEND=cpu", "the CUDA package is
    /// installed and an NVIDIA GPU is present", or why CUDA was not used).
    pub binding_reason: Option<String>,
    /// The library this process's `malloc` comes from: the C library's
    /// (e.g. "/lib/x86_64-linux-gnu/libc.so.6"), or mimalloc's where it
    /// serves malloc, as the `mlx-lfm` command arranges on Linux (a
    /// "libmimalloc.so" path then; another preloaded allocator is not
    /// recognised and reads as the C library's). Absent where the loader
    /// cannot say.
    pub allocator: Option<String>,
}

/// Facts about the MLX runtime this addon is linked against.
#[napi]
pub fn mlx_info() -> MlxInfo {
    let m = runtime::memory();
    MlxInfo {
        version: runtime::version(),
        backend: runtime::backend().name().to_string(),
        default_device: match runtime::default_device() {
            runtime::DeviceType::Cpu => "cpu".into(),
            runtime::DeviceType::Gpu => "gpu".into(),
        },
        device_name: runtime::device_name(),
        // Filled in by main.cjs, which chose the package before loading it.
        binding: None,
        binding_reason: None,
        allocator: runtime::malloc_library(),
        memory: MemoryInfo {
            active_bytes: m.active as f64,
            peak_bytes: m.peak as f64,
            cache_bytes: m.cache as f64,
            limit_bytes: m.limit as f64,
            device_total_bytes: m.device_total as f64,
        },
    }
}

/// Multiplies two float32 matrices with MLX, off the JS thread (a
/// self-check of the native stack; shape errors come back as MLX's message).
#[napi(
    ts_args_type = "a: Float32Array, aShape: Array<number>, b: Float32Array, bShape: Array<number>",
    ts_return_type = "Promise<Float32Array>"
)]
pub fn mlx_matmul<'e>(env: &'e Env, a: Unknown<'e>, a_shape: Unknown<'e>, b: Unknown<'e>, b_shape: Unknown<'e>) -> napi::Result<Object<'e>> {
    let shape = |v: &Unknown, name: &str| -> napi::Result<Vec<i32>> {
        let dims: Vec<f64> = args::value(v, name, "an array of dimensions")?;
        dims.iter()
            .enumerate()
            .map(|(i, &d)| Ok(super::convert::int_option(&format!("{name}[{i}]"), Some(d), 0, i32::MAX as u64)?.unwrap_or(0) as i32))
            .collect()
    };
    let checked = (|| {
        let a: Float32Array = args::value(&a, "a", "a Float32Array")?;
        let b: Float32Array = args::value(&b, "b", "a Float32Array")?;
        Ok((a.to_vec(), shape(&a_shape, "aShape")?, b.to_vec(), shape(&b_shape, "bShape")?))
    })();
    let (a, a_shape, b, b_shape) = match checked {
        Ok(x) => x,
        Err(e) => return args::rejected(env, e),
    };
    super::model::off_thread(env, move || {
        crate::mlx::runtime::use_new_stream()?;
        let x = crate::mlx::Array::from_slice(&a, &a_shape)?;
        let y = crate::mlx::Array::from_slice(&b, &b_shape)?;
        let v: Vec<f32> = x.matmul(&y)?.to_vec()?;
        Ok(Float32Array::new(v))
    })
}
