//! Array operations. Thin and lazy: each builds a graph node; nothing runs
//! until eval (or a host read).

use super::array::{check, make, Array, Dtype};
use super::ffi::{self, Handle};
use crate::error::{Error, Result};
use std::ffi::CString;
use std::ptr::null_mut;

fn opt(a: Option<&Array>) -> Handle {
    a.map(|a| a.handle()).unwrap_or(null_mut())
}

fn handles(arrs: &[&Array]) -> Vec<Handle> {
    arrs.iter().map(|a| a.handle()).collect()
}

fn cstr(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::invalid(format!("string {s:?} contains a NUL byte")))
}

#[repr(i32)]
#[derive(Clone, Copy)]
enum Unary {
    Neg = 0,
    Exp,
    Log,
    Sigmoid,
    Abs,
    Sqrt,
    Rsqrt,
    Square,
    LogicalNot,
    Silu,
    StopGradient,
    Floor,
    Erf,
    Tanh,
}

#[repr(i32)]
#[derive(Clone, Copy)]
enum Binary {
    Add = 0,
    Sub,
    Mul,
    Div,
    Maximum,
    Minimum,
    Power,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    LogicalAnd,
    LogicalOr,
    FloorDivide,
    Remainder,
}

#[repr(i32)]
#[derive(Clone, Copy)]
enum Reduce {
    Sum = 0,
    Mean,
    Max,
    Min,
    Prod,
    LogSumExp,
}

macro_rules! unary_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(pub fn $name(&self) -> Result<Array> {
            make(|o| unsafe { ffi::mlxb_unary(Unary::$op as i32, self.handle(), o) })
        })*
    };
}
macro_rules! binary_methods {
    ($($name:ident, $scalar:ident => $op:ident),* $(,)?) => {
        $(pub fn $name(&self, other: &Array) -> Result<Array> {
            make(|o| unsafe { ffi::mlxb_binary(Binary::$op as i32, self.handle(), other.handle(), o) })
        }
        /// With a scalar of this array's own dtype (no type promotion).
        pub fn $scalar(&self, v: f64) -> Result<Array> {
            self.$name(&Array::scalar(v, self.dtype())?)
        })*
    };
}
macro_rules! reduce_methods {
    ($($name:ident => $op:ident),* $(,)?) => {
        $(/// Reduces over `axes` (all axes when empty).
        pub fn $name(&self, axes: &[i32], keepdims: bool) -> Result<Array> {
            make(|o| unsafe {
                ffi::mlxb_reduce(Reduce::$op as i32, self.handle(), axes.as_ptr(), axes.len() as i32, keepdims as i32, o)
            })
        })*
    };
}

impl Array {
    unary_methods!(
        neg => Neg, exp => Exp, log => Log, sigmoid => Sigmoid, abs => Abs, sqrt => Sqrt, rsqrt => Rsqrt,
        square => Square, logical_not => LogicalNot, silu => Silu, stop_gradient => StopGradient,
        floor => Floor, erf => Erf, tanh => Tanh,
    );
    binary_methods!(
        add, add_scalar => Add, sub, sub_scalar => Sub, mul, mul_scalar => Mul, div, div_scalar => Div,
        maximum, maximum_scalar => Maximum, minimum, minimum_scalar => Minimum, power, power_scalar => Power,
        eq, eq_scalar => Eq, ne, ne_scalar => Ne, lt, lt_scalar => Lt, le, le_scalar => Le,
        gt, gt_scalar => Gt, ge, ge_scalar => Ge, logical_and, logical_and_scalar => LogicalAnd,
        logical_or, logical_or_scalar => LogicalOr, floor_divide, floor_divide_scalar => FloorDivide,
        remainder, remainder_scalar => Remainder,
    );
    reduce_methods!(sum => Sum, mean => Mean, max => Max, min => Min, prod => Prod, logsumexp => LogSumExp);

    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        make(|o| unsafe { ffi::mlxb_astype(self.handle(), dtype as i32, o) })
    }
    /// Reinterprets the bytes as another dtype.
    pub fn view(&self, dtype: Dtype) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_view(self.handle(), dtype as i32, o) })
    }
    pub fn reshape(&self, shape: &[i32]) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_reshape(self.handle(), shape.as_ptr(), shape.len() as i32, o) })
    }
    pub fn transpose(&self, axes: &[i32]) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_transpose(self.handle(), axes.as_ptr(), axes.len() as i32, o) })
    }
    /// Swaps the last two axes.
    pub fn t(&self) -> Result<Array> {
        let n = self.ndim() as i32;
        let mut axes: Vec<i32> = (0..n).collect();
        axes.swap((n - 1) as usize, (n - 2) as usize);
        self.transpose(&axes)
    }
    pub fn expand_dims(&self, axis: i32) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_expand_dims(self.handle(), axis, o) })
    }
    pub fn squeeze(&self, axis: i32) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_squeeze(self.handle(), axis, o) })
    }
    pub fn broadcast_to(&self, shape: &[i32]) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_broadcast_to(self.handle(), shape.as_ptr(), shape.len() as i32, o) })
    }
    pub fn contiguous(&self) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_contiguous(self.handle(), o) })
    }
    /// `a[start:stop:strides]` over every axis.
    pub fn slice(&self, start: &[i32], stop: &[i32], strides: &[i32]) -> Result<Array> {
        if start.len() != stop.len() || start.len() != strides.len() {
            return Err(Error::invalid("slice: start/stop/strides lengths differ"));
        }
        make(|o| unsafe {
            ffi::mlxb_slice(self.handle(), start.as_ptr(), stop.as_ptr(), strides.as_ptr(), start.len() as i32, o)
        })
    }
    /// `a[..., start:stop, ...]` along one axis.
    pub fn slice_axis(&self, axis: i32, start: i32, stop: i32) -> Result<Array> {
        let shape = self.shape();
        let n = shape.len();
        let ax = if axis < 0 { n as i32 + axis } else { axis } as usize;
        let mut lo = vec![0; n];
        let mut hi = shape.clone();
        lo[ax] = start;
        hi[ax] = stop;
        self.slice(&lo, &hi, &vec![1; n])
    }
    /// Writes `update` into `self[start:stop]` (functional: returns the new array).
    pub fn slice_update(&self, update: &Array, start: &[i32], stop: &[i32]) -> Result<Array> {
        make(|o| unsafe {
            ffi::mlxb_slice_update(self.handle(), update.handle(), start.as_ptr(), stop.as_ptr(), start.len() as i32, o)
        })
    }
    /// `slice_update` at a start held in an int array (one entry per axis
    /// in `axes`), so the position can be an input of a compiled function.
    pub fn slice_update_dyn(&self, update: &Array, start: &Array, axes: &[i32]) -> Result<Array> {
        make(|o| unsafe {
            ffi::mlxb_slice_update_dyn(self.handle(), update.handle(), start.handle(), axes.as_ptr(), axes.len() as i32, o)
        })
    }
    /// Writes `updates` at the points `indices` name along `axes` (one index
    /// array per axis, broadcast together).
    pub fn scatter(&self, indices: &[&Array], axes: &[i32], updates: &Array) -> Result<Array> {
        if indices.len() != axes.len() {
            return Err(Error::invalid("scatter takes one index array per axis"));
        }
        let hs: Vec<Handle> = indices.iter().map(|a| a.handle()).collect();
        make(|o| unsafe { ffi::mlxb_scatter(self.handle(), hs.as_ptr(), axes.as_ptr(), axes.len() as i32, updates.handle(), o) })
    }
    pub fn split_equal(&self, parts: usize, axis: i32) -> Result<Vec<Array>> {
        let mut hs: Vec<Handle> = vec![null_mut(); parts];
        check(unsafe { ffi::mlxb_split_equal(self.handle(), parts as i32, axis, hs.as_mut_ptr()) })?;
        Ok(hs.into_iter().map(Array).collect())
    }
    /// Cut along `axis` before each of the ascending `indices`: one part
    /// more than indices, from one node of the graph.
    pub fn split_at(&self, indices: &[i32], axis: i32) -> Result<Vec<Array>> {
        if indices.windows(2).any(|w| w[0] > w[1]) {
            return Err(Error::invalid(format!("split_at: indices {indices:?} are not ascending")));
        }
        let mut hs: Vec<Handle> = vec![null_mut(); indices.len() + 1];
        check(unsafe { ffi::mlxb_split_at(self.handle(), indices.as_ptr(), indices.len() as i32, axis, hs.as_mut_ptr()) })?;
        Ok(hs.into_iter().map(Array).collect())
    }
    pub fn take(&self, indices: &Array, axis: i32) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_take(self.handle(), indices.handle(), axis, o) })
    }
    pub fn take_along_axis(&self, indices: &Array, axis: i32) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_take_along_axis(self.handle(), indices.handle(), axis, o) })
    }
    pub fn put_along_axis(&self, indices: &Array, values: &Array, axis: i32) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_put_along_axis(self.handle(), indices.handle(), values.handle(), axis, o) })
    }
    pub fn argmax(&self, axis: i32, keepdims: bool) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_argmax(self.handle(), axis, keepdims as i32, o) })
    }
    pub fn argmin(&self, axis: i32, keepdims: bool) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_argmin(self.handle(), axis, keepdims as i32, o) })
    }
    pub fn softmax(&self, axis: i32, precise: bool) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_softmax(self.handle(), axis, precise as i32, o) })
    }
    pub fn argpartition(&self, kth: i32, axis: i32) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_argpartition(self.handle(), kth, axis, o) })
    }
    pub fn topk(&self, k: i32, axis: i32) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_topk(self.handle(), k, axis, o) })
    }
    pub fn sort(&self, axis: i32) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_sort(self.handle(), axis, o) })
    }
    pub fn argsort(&self, axis: i32) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_argsort(self.handle(), axis, o) })
    }
    pub fn cumsum(&self, axis: i32, reverse: bool, inclusive: bool) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_cumsum(self.handle(), axis, reverse as i32, inclusive as i32, o) })
    }
    pub fn clip(&self, lo: f64, hi: f64) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_clip(self.handle(), lo, hi, o) })
    }
    pub fn matmul(&self, other: &Array) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_matmul(self.handle(), other.handle(), o) })
    }
}

pub fn concatenate(arrs: &[&Array], axis: i32) -> Result<Array> {
    let hs = handles(arrs);
    make(|o| unsafe { ffi::mlxb_concatenate(hs.as_ptr(), hs.len(), axis, o) })
}
/// `inputs` again (the same buffers, no copy), evaluated only after
/// `deps`: for a buffer a kernel wrote in place while making one of `deps`,
/// so that whatever reads it later reads it after the write.
pub fn depends(inputs: &[&Array], deps: &[&Array]) -> Result<Vec<Array>> {
    if inputs.is_empty() || deps.is_empty() {
        return Err(Error::invalid("depends takes at least one input and one dependency"));
    }
    let (hs, ds) = (handles(inputs), handles(deps));
    let mut outs: Vec<Handle> = vec![std::ptr::null_mut(); inputs.len()];
    check(unsafe { ffi::mlxb_depends(hs.as_ptr(), hs.len(), ds.as_ptr(), ds.len(), outs.as_mut_ptr()) })?;
    if outs.iter().any(|h| h.is_null()) {
        return Err(Error::mlx("depends returned fewer arrays than it was given"));
    }
    Ok(outs.into_iter().map(Array).collect())
}
pub fn stack(arrs: &[&Array], axis: i32) -> Result<Array> {
    let hs = handles(arrs);
    make(|o| unsafe { ffi::mlxb_stack(hs.as_ptr(), hs.len(), axis, o) })
}
pub fn zeros(shape: &[i32], dtype: Dtype) -> Result<Array> {
    make(|o| unsafe { ffi::mlxb_zeros(shape.as_ptr(), shape.len() as i32, dtype as i32, o) })
}
pub fn full(shape: &[i32], value: f64, dtype: Dtype) -> Result<Array> {
    make(|o| unsafe { ffi::mlxb_full(shape.as_ptr(), shape.len() as i32, value, dtype as i32, o) })
}
pub fn arange(start: f64, stop: f64, step: f64, dtype: Dtype) -> Result<Array> {
    make(|o| unsafe { ffi::mlxb_arange(start, stop, step, dtype as i32, o) })
}
pub fn where_(cond: &Array, a: &Array, b: &Array) -> Result<Array> {
    make(|o| unsafe { ffi::mlxb_where(cond.handle(), a.handle(), b.handle(), o) })
}
/// `beta * c + alpha * (a @ b)`.
pub fn addmm(c: &Array, a: &Array, b: &Array, alpha: f32, beta: f32) -> Result<Array> {
    make(|o| unsafe { ffi::mlxb_addmm(c.handle(), a.handle(), b.handle(), alpha, beta, o) })
}

/// The parameters of one MLX quantization format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QuantSpec {
    pub mode: QuantMode,
    pub bits: i32,
    pub group_size: i32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantMode {
    Affine,
    Mxfp4,
    Mxfp8,
    Nvfp4,
}

impl QuantMode {
    pub const ALL: [QuantMode; 4] = [QuantMode::Affine, QuantMode::Mxfp4, QuantMode::Mxfp8, QuantMode::Nvfp4];
    pub fn name(self) -> &'static str {
        match self {
            QuantMode::Affine => "affine",
            QuantMode::Mxfp4 => "mxfp4",
            QuantMode::Mxfp8 => "mxfp8",
            QuantMode::Nvfp4 => "nvfp4",
        }
    }
    pub fn parse(s: &str) -> Option<QuantMode> {
        QuantMode::ALL.into_iter().find(|m| m.name() == s)
    }
    /// Only affine mode stores a `.biases` tensor.
    pub fn has_biases(self) -> bool {
        self == QuantMode::Affine
    }
}

/// Quantizes `w` along its last axis: (packed weight, scales, biases-if-affine).
pub fn quantize(w: &Array, q: QuantSpec) -> Result<(Array, Array, Option<Array>)> {
    let mode = cstr(q.mode.name())?;
    let mut hs: [Handle; 3] = [null_mut(); 3];
    let mut n = 0i32;
    check(unsafe { ffi::mlxb_quantize(w.handle(), q.group_size, q.bits, mode.as_ptr(), hs.as_mut_ptr(), &mut n) })?;
    let mut it = hs.into_iter().take(n as usize).map(Array);
    let wq = it.next().unwrap();
    let s = it.next().unwrap();
    Ok((wq, s, it.next()))
}

/// Whether `quantized_matmul` over rows of `k` must avoid MLX's kernel
/// (see there): on MLX's CUDA backend, the GPU the default device, and a
/// row within one group.
fn one_group_on_cuda(k: i32, q: QuantSpec) -> bool {
    use super::runtime::{backend, default_device, Backend, DeviceType};
    static CUDA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    k <= q.group_size && *CUDA.get_or_init(|| backend() == Backend::Cuda) && default_device() == DeviceType::Gpu
}

pub fn dequantize(w: &Array, scales: &Array, biases: Option<&Array>, q: QuantSpec, dtype: Option<Dtype>) -> Result<Array> {
    let mode = cstr(q.mode.name())?;
    make(|o| unsafe {
        ffi::mlxb_dequantize(
            w.handle(),
            scales.handle(),
            opt(biases),
            q.group_size,
            q.bits,
            mode.as_ptr(),
            dtype.map(|d| d as i32).unwrap_or(-1),
            o,
        )
    })
}

pub fn quantized_matmul(x: &Array, w: &Array, scales: &Array, biases: Option<&Array>, transpose: bool, q: QuantSpec) -> Result<Array> {
    if transpose && x.ndim() > 0 && one_group_on_cuda(x.dim(-1), q) {
        // MLX 0.32.4's CUDA backend serves a product whose rows fit one
        // quantization group (K <= group size, K a multiple of 64) with its
        // sm90 kernel, which on the H200 returned values of 1e35 and ran
        // differently each time (2026-12-03, `stock_quantized_moe_prefill_repeats`:
        // 8-bit g64 and 4-bit g64 at K = 64, 4-bit g128 at K = 128). No
        // LFM2 projection is that narrow, but a small fixture's are; the
        // weight is then at most a group wide, so dequantizing it costs
        // nothing and the matmul rounds as the quantized kernels do.
        let wd = dequantize(w, scales, biases, q, None)?;
        return x.matmul(&wd.t()?);
    }
    let mode = cstr(q.mode.name())?;
    make(|o| unsafe {
        ffi::mlxb_quantized_matmul(
            x.handle(),
            w.handle(),
            scales.handle(),
            opt(biases),
            transpose as i32,
            q.group_size,
            q.bits,
            mode.as_ptr(),
            o,
        )
    })
}

pub fn gather_mm(a: &Array, b: &Array, lhs: Option<&Array>, rhs: Option<&Array>, sorted: bool) -> Result<Array> {
    make(|o| unsafe { ffi::mlxb_gather_mm(a.handle(), b.handle(), opt(lhs), opt(rhs), sorted as i32, o) })
}

#[allow(clippy::too_many_arguments)]
pub fn gather_qmm(
    x: &Array,
    w: &Array,
    scales: &Array,
    biases: Option<&Array>,
    lhs: Option<&Array>,
    rhs: Option<&Array>,
    transpose: bool,
    q: QuantSpec,
    sorted: bool,
) -> Result<Array> {
    let mode = cstr(q.mode.name())?;
    make(|o| unsafe {
        ffi::mlxb_gather_qmm(
            x.handle(),
            w.handle(),
            scales.handle(),
            opt(biases),
            opt(lhs),
            opt(rhs),
            transpose as i32,
            q.group_size,
            q.bits,
            mode.as_ptr(),
            sorted as i32,
            o,
        )
    })
}

pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array> {
    make(|o| unsafe { ffi::mlxb_rms_norm(x.handle(), opt(weight), eps, o) })
}

pub fn rope(x: &Array, dims: i32, traditional: bool, base: f32, scale: f32, offset: i32) -> Result<Array> {
    make(|o| unsafe { ffi::mlxb_rope(x.handle(), dims, traditional as i32, base, scale, offset, o) })
}

/// RoPE with the position offset given as an array (traceable by compile).
pub fn rope_dyn(x: &Array, dims: i32, traditional: bool, base: f32, scale: f32, offset: &Array) -> Result<Array> {
    make(|o| unsafe { ffi::mlxb_rope_dyn(x.handle(), dims, traditional as i32, base, scale, offset.handle(), o) })
}

/// Attention mask: none, MLX's causal mode (bottom-right aligned), or an array.
pub enum Mask<'a> {
    None,
    Causal,
    Array(&'a Array),
}

pub fn sdpa(q: &Array, k: &Array, v: &Array, scale: f32, mask: Mask) -> Result<Array> {
    let (mode, arr): (&[u8], Handle) = match mask {
        Mask::None => (b"\0", null_mut()),
        Mask::Causal => (b"causal\0", null_mut()),
        Mask::Array(a) => (b"array\0", a.handle()),
    };
    make(|o| unsafe { ffi::mlxb_sdpa(q.handle(), k.handle(), v.handle(), scale, mode.as_ptr() as *const _, arr, o) })
}

pub fn conv1d(x: &Array, w: &Array, stride: i32, padding: i32, dilation: i32, groups: i32) -> Result<Array> {
    make(|o| unsafe { ffi::mlxb_conv1d(x.handle(), w.handle(), stride, padding, dilation, groups, o) })
}

pub mod random {
    use super::*;
    pub fn key(seed: u64) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_random_key(seed, o) })
    }
    pub fn split(key: &Array) -> Result<(Array, Array)> {
        let mut a = null_mut();
        let mut b = null_mut();
        check(unsafe { ffi::mlxb_random_split(key.handle(), &mut a, &mut b) })?;
        Ok((Array(a), Array(b)))
    }
    pub fn categorical(logits: &Array, axis: i32, key: Option<&Array>) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_random_categorical(logits.handle(), axis, opt(key), o) })
    }
    pub fn uniform(shape: &[i32], dtype: Dtype, key: Option<&Array>) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_random_uniform(shape.as_ptr(), shape.len() as i32, dtype as i32, opt(key), o) })
    }
    pub fn normal(shape: &[i32], dtype: Dtype, loc: f32, scale: f32, key: Option<&Array>) -> Result<Array> {
        make(|o| unsafe {
            ffi::mlxb_random_normal(shape.as_ptr(), shape.len() as i32, dtype as i32, loc, scale, opt(key), o)
        })
    }
}
