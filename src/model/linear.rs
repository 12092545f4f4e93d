//! Linear projections and the token embedding, dense or quantized as the
//! quant registry says.

use super::quant::QuantRegistry;
use super::weights::TensorStore;
use crate::error::{Error, Result};
use crate::mlx::{self, Array, Dtype, QuantSpec};

#[derive(Clone)]
pub struct Quantized {
    pub weight: Array,
    pub scales: Array,
    pub biases: Option<Array>,
    pub spec: QuantSpec,
}

#[derive(Clone)]
pub enum Weight {
    /// `[out, in]`, used as `x @ w.T`.
    Dense(Array),
    Quant(Quantized),
}

/// Loads `<path>.weight` of logical shape `lead ++ [out, in]`, quantized when
/// the registry lists `path`.
pub fn load_weight(store: &mut TensorStore, reg: &QuantRegistry, path: &str, lead: &[i32], out: i32, inp: i32) -> Result<Weight> {
    let shape = |last: i32| -> Vec<i32> { lead.iter().copied().chain([out, last]).collect() };
    match reg.get(path) {
        None => Ok(Weight::Dense(store.get_shaped(&format!("{path}.weight"), &shape(inp))?)),
        Some(spec) => {
            if inp % spec.group_size != 0 || (inp * spec.bits) % 32 != 0 {
                return Err(Error::load(format!(
                    "projection `{path}` has input width {inp}, which {} with group_size {} cannot pack",
                    spec.mode.name(),
                    spec.group_size
                )));
            }
            let weight = store.raw_shaped(&format!("{path}.weight"), &shape(inp * spec.bits / 32))?;
            if weight.dtype() != Dtype::Uint32 {
                return Err(Error::load(format!(
                    "quantized weight `{path}.weight` must be uint32, found {}",
                    weight.dtype()
                )));
            }
            let groups = inp / spec.group_size;
            // mx/nv fp formats store scales as uint8 (e8m0 / e4m3): keep them raw.
            let scales = store.raw_shaped(&format!("{path}.scales"), &shape(groups))?;
            let scales_ok = if spec.mode.has_biases() { scales.dtype().is_float() } else { scales.dtype() == Dtype::Uint8 };
            if !scales_ok {
                return Err(Error::load(format!(
                    "quantized scales `{path}.scales` have dtype {}, which {} does not use ({})",
                    scales.dtype(),
                    spec.mode.name(),
                    if spec.mode.has_biases() { "a floating-point dtype" } else { "uint8" }
                )));
            }
            let biases = if spec.mode.has_biases() {
                Some(store.get_shaped(&format!("{path}.biases"), &shape(groups))?)
            } else {
                None
            };
            Ok(Weight::Quant(Quantized { weight, scales, biases, spec }))
        }
    }
}

impl Weight {
    pub fn spec(&self) -> Option<QuantSpec> {
        match self {
            Weight::Dense(_) => None,
            Weight::Quant(q) => Some(q.spec),
        }
    }

    /// `x @ w.T`.
    pub fn apply(&self, x: &Array) -> Result<Array> {
        match self {
            Weight::Dense(w) => x.matmul(&w.t()?),
            Weight::Quant(q) => mlx::quantized_matmul(x, &q.weight, &q.scales, q.biases.as_ref(), true, q.spec),
        }
    }

    /// Logical element count (for parameter counts).
    pub fn params(&self) -> usize {
        match self {
            Weight::Dense(w) => w.size(),
            Weight::Quant(q) => q.weight.size() * 32 / q.spec.bits as usize,
        }
    }

    pub fn arrays(&self) -> Vec<&Array> {
        match self {
            Weight::Dense(w) => vec![w],
            Weight::Quant(q) => {
                let mut v = vec![&q.weight, &q.scales];
                v.extend(q.biases.as_ref());
                v
            }
        }
    }
}

#[derive(Clone)]
pub struct Linear {
    pub weight: Weight,
    pub bias: Option<Array>,
}

impl Linear {
    pub fn load(store: &mut TensorStore, reg: &QuantRegistry, path: &str, inp: usize, out: usize, bias: bool) -> Result<Linear> {
        let weight = load_weight(store, reg, path, &[], out as i32, inp as i32)?;
        let bias = if bias { Some(store.get_shaped(&format!("{path}.bias"), &[out as i32])?) } else { None };
        Ok(Linear { weight, bias })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        match (&self.weight, &self.bias) {
            (Weight::Dense(w), Some(b)) => mlx::addmm(b, x, &w.t()?, 1.0, 1.0),
            (w, None) => w.apply(x),
            (w, Some(b)) => w.apply(x)?.add(b),
        }
    }

    pub fn arrays(&self) -> Vec<&Array> {
        let mut v = self.weight.arrays();
        v.extend(self.bias.as_ref());
        v
    }
}

/// Token embedding; also the tied LM head.
#[derive(Clone)]
pub struct Embedding {
    pub weight: Weight,
    pub dtype: Dtype,
}

impl Embedding {
    /// `dtype` is what a quantized table dequantizes to (the model's compute dtype).
    pub fn load(store: &mut TensorStore, reg: &QuantRegistry, path: &str, vocab: usize, dim: usize, dtype: Dtype) -> Result<Embedding> {
        let weight = load_weight(store, reg, path, &[], vocab as i32, dim as i32)?;
        let dtype = match &weight {
            Weight::Dense(w) => w.dtype(),
            Weight::Quant(_) => dtype,
        };
        Ok(Embedding { weight, dtype })
    }

    /// Rows for `ids` (any shape) -> `ids.shape ++ [dim]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match &self.weight {
            Weight::Dense(w) => w.take(ids, 0),
            Weight::Quant(q) => {
                let w = q.weight.take(ids, 0)?;
                let s = q.scales.take(ids, 0)?;
                let b = q.biases.as_ref().map(|b| b.take(ids, 0)).transpose()?;
                mlx::dequantize(&w, &s, b.as_ref(), q.spec, Some(self.dtype))
            }
        }
    }

    /// The tied head: `x @ E.T`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        self.weight.apply(x)
    }
}
