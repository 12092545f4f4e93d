use crate::mlx::runtime;
use napi::bindgen_prelude::{Env, Float32Array, Object};
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
    /// Which libmlx build is loaded: "cpu", "cuda" or "metal".
    pub backend: String,
    /// MLX's default device: "cpu" or "gpu".
    pub default_device: String,
    pub device_name: String,
    pub memory: MemoryInfo,
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
#[napi(ts_return_type = "Promise<Float32Array>")]
pub fn mlx_matmul(
    env: &Env,
    a: Float32Array,
    a_shape: Vec<i32>,
    b: Float32Array,
    b_shape: Vec<i32>,
) -> napi::Result<Object<'_>> {
    let (a, b) = (a.to_vec(), b.to_vec());
    super::model::off_thread(env, move || {
        crate::mlx::runtime::use_new_stream()?;
        let x = crate::mlx::Array::from_slice(&a, &a_shape)?;
        let y = crate::mlx::Array::from_slice(&b, &b_shape)?;
        let v: Vec<f32> = x.matmul(&y)?.to_vec()?;
        Ok(Float32Array::new(v))
    })
}
