//! Per-layer K/V codecs, all MLX ops on the default device.
//!
//! Tensors are `[B, kv_heads, T, head_dim]`; a codec turns them into a few
//! arrays `[B, kv_heads, T, *]` (so a cache slices and writes every part
//! along axis 2 alike) and back.
//!
//! - Affine (mlx-lm's QuantizedKVCache idea): `mx.quantize` over groups of 64
//!   (32 when head_dim is not a multiple of 64; a head_dim that is not a
//!   multiple of 32 is zero-padded to one). Parts: packed weights, scales,
//!   biases (scales/biases in the model's dtype).
//! - RotorQuant: `r = ||x||`, `y = R x / r`, per coordinate the nearest of 8
//!   Lloyd-Max levels / sqrt(head_dim), norm correction, 3-bit codes. Parts:
//!   the codes (`lo` uint16 and `hi` uint8 words, see pack.rs) and the fp16
//!   norm. Decoding (two table gathers and two multiplies) yields the
//!   reconstruction in the rotated space (`norm · c`); attention rotates the
//!   query into that space (`q Rᵀ`, i.e. `R q`) and the output back (`o R`),
//!   which equals attending over `Rᵀ ĉ` because `R` is orthogonal.

use super::pack;
use super::rotor::{boundaries, centroids, HostRotation, LEVELS};
use super::{KvKind, Rotation};
use crate::error::{Error, Result};
use crate::mlx::{concatenate, quantize, where_, zeros, Array, Dtype, QuantMode, QuantSpec};
use std::cell::RefCell;

thread_local! {
    /// The unpacking tables (2 MB), built once per thread and shared by
    /// every layer's codec.
    static TABLES: RefCell<Option<(Array, Array)>> = const { RefCell::new(None) };
}

fn shared_tables() -> Result<(Array, Array)> {
    TABLES.with(|t| {
        let mut t = t.borrow_mut();
        if t.is_none() {
            let (a, b) = pack::tables([LEVELS[4], LEVELS[5], LEVELS[6], LEVELS[7]])?;
            crate::mlx::eval(&[&a, &b])?;
            *t = Some((a, b));
        }
        Ok(t.clone().unwrap())
    })
}

#[derive(Clone)]
pub struct RotorParts {
    pub rotation: Rotation,
    /// `Rᵀ` (`[n, n]` f32): `x Rᵀ` is `R x` for row vectors.
    rt: Array,
    /// `R`: `y R` is `Rᵀ y`.
    r: Array,
    /// The 8 levels for this block size (f32).
    table: Array,
    /// The 7 decision boundaries (f32).
    bounds: Array,
    /// `pack::tables`: magnitudes per `lo` word, signs per `hi` byte.
    tables: (Array, Array),
}

#[derive(Clone)]
pub struct Codec {
    pub kind: KvKind,
    pub head_dim: usize,
    rotor: Option<RotorParts>,
}

impl Codec {
    /// A codec for one attention layer's head size. Every size works: the
    /// affine codec pads to a multiple of 32, the 3-bit codes to 8 lanes,
    /// and the quaternion rotation leaves the last `head_dim % 4` values as
    /// they are.
    pub fn new(kind: KvKind, head_dim: usize) -> Result<Codec> {
        if head_dim == 0 {
            return Err(Error::config("a KV codec needs head_dim >= 1"));
        }
        let rotor = match kind {
            KvKind::Default => return Err(Error::invalid("the default KV cache has no codec")),
            KvKind::Affine { bits } => {
                if !matches!(bits, 2 | 3 | 4 | 5 | 6 | 8) {
                    return Err(Error::config(format!("affine KV quantization does not support {bits} bits")));
                }
                None
            }
            KvKind::Rotor(rotation) => {
                let h = HostRotation::new(rotation, head_dim);
                let n = head_dim as i32;
                let c = centroids(head_dim).map(|v| v as f32);
                let b = boundaries(head_dim).map(|v| v as f32);
                Some(RotorParts {
                    rotation,
                    rt: Array::from_slice(&h.transpose_f32(), &[n, n])?,
                    r: Array::from_slice(&h.matrix_f32(), &[n, n])?,
                    table: Array::from_slice(&c, &[8])?,
                    bounds: Array::from_slice(&b, &[7])?,
                    tables: shared_tables()?,
                })
            }
        };
        Ok(Codec { kind, head_dim, rotor })
    }

    /// Whether decoded tensors live in a rotated space (the query must be
    /// passed through [`Codec::to_space`] and the output through
    /// [`Codec::from_space`]).
    pub fn rotates(&self) -> bool {
        self.rotor.is_some()
    }

    fn padded(&self) -> usize {
        self.head_dim.div_ceil(32) * 32
    }

    fn affine_spec(&self, bits: i32) -> QuantSpec {
        let g = if self.padded().is_multiple_of(64) { 64 } else { 32 };
        QuantSpec { mode: QuantMode::Affine, bits, group_size: g }
    }

    /// Bytes one head vector takes once quantized (all parts), for a model
    /// running in `dtype` (affine scales and biases use it).
    pub fn bytes_per_vector(&self, dtype: Dtype) -> usize {
        match self.kind {
            KvKind::Affine { bits } => {
                let p = self.padded();
                let groups = p / self.affine_spec(bits).group_size as usize;
                p * bits as usize / 8 + 2 * groups * dtype.size()
            }
            KvKind::Rotor(_) => pack::code_bytes(self.head_dim) + 2,
            KvKind::Default => self.head_dim * dtype.size(),
        }
    }

    /// Quantizes `x` (`[B, H, T, head_dim]`).
    pub fn encode(&self, x: &Array) -> Result<Vec<Array>> {
        let n = self.head_dim as i32;
        match (&self.kind, &self.rotor) {
            (KvKind::Affine { bits }, _) => {
                let xp = pad_last(x, self.padded() as i32)?;
                let (w, s, b) = quantize(&xp, self.affine_spec(*bits))?;
                Ok(vec![w, s, b.expect("affine quantization returns biases")])
            }
            (KvKind::Rotor(_), Some(rp)) => {
                let xf = x.astype(Dtype::Float32)?;
                let r = xf.square()?.sum(&[-1], true)?.sqrt()?;
                let big = r.gt_scalar(1e-10)?;
                let u = where_(&big, &xf.div(&r.maximum_scalar(1e-30)?)?, &Array::scalar(0.0, Dtype::Float32)?)?;
                let y = u.matmul(&rp.rt)?;
                let idx = y.expand_dims(-1)?.gt(&rp.bounds)?.astype(Dtype::Int32)?.sum(&[-1], false)?;
                let c = rp.table.take(&idx, 0)?;
                let cn = c.square()?.sum(&[-1], true)?.sqrt()?;
                let norm = where_(&cn.gt_scalar(1e-10)?, &r.div(&cn.maximum_scalar(1e-30)?)?, &r)?.astype(Dtype::Float16)?;
                let l = pack::lanes(self.head_dim) as i32;
                let idx = if l > n { pad_last(&idx, l)? } else { idx };
                let (lo, hi) = pack::pack3(&idx)?;
                Ok(vec![lo, hi, norm])
            }
            _ => Err(Error::invalid("codec has no quantizer")),
        }
    }

    /// Reconstructs `[B, H, T, head_dim]` in `dtype` from [`Codec::encode`]'s
    /// parts; for RotorQuant in the rotated space.
    pub fn decode(&self, parts: &[Array], dtype: Dtype) -> Result<Array> {
        let n = self.head_dim as i32;
        let x = match (&self.kind, &self.rotor) {
            (KvKind::Affine { bits }, _) => {
                crate::mlx::dequantize(&parts[0], &parts[1], Some(&parts[2]), self.affine_spec(*bits), Some(dtype))?
            }
            (KvKind::Rotor(_), Some(rp)) => {
                let scale = parts[2].astype(Dtype::Float32)?.mul_scalar(1.0 / (self.head_dim as f64).sqrt())?;
                pack::unpack_scaled(&parts[0], &parts[1], &scale, &rp.tables)?.astype(dtype)?
            }
            _ => return Err(Error::invalid("codec has no dequantizer")),
        };
        if x.dim(-1) > n {
            x.slice_axis(-1, 0, n)
        } else {
            Ok(x)
        }
    }

    /// Whether [`Codec::quantized_attention`] applies (affine codecs).
    pub fn has_quantized_attention(&self) -> bool {
        matches!(self.kind, KvKind::Affine { .. })
    }

    /// Single-query attention straight from affine-quantized K and V parts
    /// (`[B, kv_heads, T, *]`): `softmax(q Kᵀ · scale) V` with both products
    /// as `quantized_matmul` (grouped-query heads share their K/V head).
    pub fn quantized_attention(&self, q: &Array, kp: &[Array], vp: &[Array], scale: f32) -> Result<Array> {
        let KvKind::Affine { bits } = self.kind else {
            return Err(Error::invalid("quantized attention needs an affine codec"));
        };
        let spec = self.affine_spec(bits);
        let (b, hq, t, d) = (q.dim(0), q.dim(1), q.dim(2), q.dim(3));
        let hkv = kp[0].dim(1);
        let p = self.padded() as i32;
        let q = pad_last(&q.mul_scalar(scale as f64)?, p)?.reshape(&[b, hkv, hq / hkv, t, p])?;
        let e = |a: &Array| a.expand_dims(2);
        let scores = crate::mlx::quantized_matmul(&q, &e(&kp[0])?, &e(&kp[1])?, Some(&e(&kp[2])?), true, spec)?;
        let probs = scores.softmax(-1, true)?;
        let o = crate::mlx::quantized_matmul(&probs, &e(&vp[0])?, &e(&vp[1])?, Some(&e(&vp[2])?), false, spec)?;
        let o = o.reshape(&[b, hq, t, p])?;
        if p > d {
            o.slice_axis(-1, 0, d)
        } else {
            Ok(o)
        }
    }

    /// Into the space decoded tensors live in (`x Rᵀ`, computed in f32).
    pub fn to_space(&self, x: &Array) -> Result<Array> {
        match &self.rotor {
            Some(rp) => x.astype(Dtype::Float32)?.matmul(&rp.rt)?.astype(x.dtype()),
            None => Ok(x.clone()),
        }
    }

    /// Back from that space (`y R`, computed in f32).
    pub fn from_space(&self, y: &Array) -> Result<Array> {
        match &self.rotor {
            Some(rp) => y.astype(Dtype::Float32)?.matmul(&rp.r)?.astype(y.dtype()),
            None => Ok(y.clone()),
        }
    }

    /// Original-space reconstruction (tests, studies).
    pub fn roundtrip(&self, x: &Array) -> Result<Array> {
        let d = self.decode(&self.encode(x)?, Dtype::Float32)?;
        self.from_space(&d)?.astype(x.dtype())
    }
}

/// Zero-pads the last axis to `to`.
fn pad_last(x: &Array, to: i32) -> Result<Array> {
    let n = x.dim(-1);
    if n == to {
        return Ok(x.clone());
    }
    let mut s = x.shape();
    *s.last_mut().unwrap() = to - n;
    concatenate(&[x, &zeros(&s, x.dtype())?], -1)
}
