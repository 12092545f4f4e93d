//! Owned MLX array handles and their dtype/shape API.

use super::ffi::{self, Handle};
use crate::error::{Error, Result};
use std::ffi::CStr;
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum Dtype {
    Bool = 0,
    Uint8 = 1,
    Uint16 = 2,
    Uint32 = 3,
    Uint64 = 4,
    Int8 = 5,
    Int16 = 6,
    Int32 = 7,
    Int64 = 8,
    Float16 = 9,
    Float32 = 10,
    Float64 = 11,
    Bfloat16 = 12,
    Complex64 = 13,
}

impl Dtype {
    pub fn from_code(c: i32) -> Dtype {
        use Dtype::*;
        match c {
            0 => Bool,
            1 => Uint8,
            2 => Uint16,
            3 => Uint32,
            4 => Uint64,
            5 => Int8,
            6 => Int16,
            7 => Int32,
            8 => Int64,
            9 => Float16,
            10 => Float32,
            11 => Float64,
            12 => Bfloat16,
            _ => Complex64,
        }
    }
    pub fn size(self) -> usize {
        use Dtype::*;
        match self {
            Bool | Uint8 | Int8 => 1,
            Uint16 | Int16 | Float16 | Bfloat16 => 2,
            Uint32 | Int32 | Float32 => 4,
            Uint64 | Int64 | Float64 | Complex64 => 8,
        }
    }
    pub fn is_float(self) -> bool {
        matches!(self, Dtype::Float16 | Dtype::Float32 | Dtype::Float64 | Dtype::Bfloat16)
    }
    /// Safetensors / numpy-style names.
    pub fn name(self) -> &'static str {
        use Dtype::*;
        match self {
            Bool => "bool",
            Uint8 => "uint8",
            Uint16 => "uint16",
            Uint32 => "uint32",
            Uint64 => "uint64",
            Int8 => "int8",
            Int16 => "int16",
            Int32 => "int32",
            Int64 => "int64",
            Float16 => "float16",
            Float32 => "float32",
            Float64 => "float64",
            Bfloat16 => "bfloat16",
            Complex64 => "complex64",
        }
    }
    pub fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "float32" | "f32" => Dtype::Float32,
            "float16" | "f16" => Dtype::Float16,
            "bfloat16" | "bf16" => Dtype::Bfloat16,
            _ => return None,
        })
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reads the bridge's thread-local error text after a failed call.
pub(crate) fn last_error() -> Error {
    let msg = unsafe { CStr::from_ptr(ffi::mlxb_last_error()) }.to_string_lossy().into_owned();
    Error::mlx(msg)
}

/// Turns a bridge status code into a Result.
#[inline]
pub(crate) fn check(rc: i32) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(last_error())
    }
}

/// Runs a bridge call that writes one new handle and wraps it.
#[inline]
pub(crate) fn make(f: impl FnOnce(*mut Handle) -> i32) -> Result<Array> {
    let mut h: Handle = std::ptr::null_mut();
    check(f(&mut h))?;
    Ok(Array(h))
}

/// An owned reference to an MLX array (MLX arrays are themselves refcounted
/// graph nodes, so cloning is cheap and shares the buffer).
pub struct Array(pub(crate) Handle);

impl Drop for Array {
    fn drop(&mut self) {
        unsafe { ffi::mlxb_array_free(self.0) }
    }
}

impl Clone for Array {
    fn clone(&self) -> Self {
        Array(unsafe { ffi::mlxb_array_clone(self.0) })
    }
}

impl fmt::Debug for Array {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Array({:?}, {})", self.shape(), self.dtype())
    }
}

/// Element types that can cross to and from host memory.
pub trait Element: Copy + Default {
    const DTYPE: Dtype;
}
impl Element for f32 {
    const DTYPE: Dtype = Dtype::Float32;
}
impl Element for i32 {
    const DTYPE: Dtype = Dtype::Int32;
}
impl Element for u32 {
    const DTYPE: Dtype = Dtype::Uint32;
}
impl Element for u8 {
    const DTYPE: Dtype = Dtype::Uint8;
}
impl Element for i64 {
    const DTYPE: Dtype = Dtype::Int64;
}
impl Element for bool {
    const DTYPE: Dtype = Dtype::Bool;
}

impl Array {
    pub(crate) fn handle(&self) -> Handle {
        self.0
    }

    /// Copies `data` (host, row-major) into a new array.
    pub fn from_slice<T: Element>(data: &[T], shape: &[i32]) -> Result<Array> {
        Self::from_bytes(
            unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) },
            shape,
            T::DTYPE,
        )
    }

    /// Copies raw little-endian bytes of `dtype` into a new array.
    pub fn from_bytes(bytes: &[u8], shape: &[i32], dtype: Dtype) -> Result<Array> {
        let n: i64 = shape.iter().map(|&d| d as i64).product();
        if shape.iter().any(|&d| d < 0) || n as usize * dtype.size() != bytes.len() {
            return Err(Error::invalid(format!(
                "array of shape {shape:?} and dtype {dtype} needs {} bytes, got {}",
                n.max(0) as usize * dtype.size(),
                bytes.len()
            )));
        }
        make(|o| unsafe {
            ffi::mlxb_array_from_data(bytes.as_ptr() as *const _, shape.as_ptr(), shape.len() as i32, dtype as i32, o)
        })
    }

    pub fn scalar(v: f64, dtype: Dtype) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_array_scalar(v, dtype as i32, o) })
    }

    pub fn ndim(&self) -> usize {
        unsafe { ffi::mlxb_array_ndim(self.0) as usize }
    }
    pub fn shape(&self) -> Vec<i32> {
        let mut s = vec![0i32; self.ndim()];
        unsafe { ffi::mlxb_array_shape(self.0, s.as_mut_ptr()) };
        s
    }
    /// Size of one axis; negative axes count from the end.
    pub fn dim(&self, axis: i32) -> i32 {
        let s = self.shape();
        let i = if axis < 0 { s.len() as i32 + axis } else { axis };
        s[i as usize]
    }
    pub fn dtype(&self) -> Dtype {
        Dtype::from_code(unsafe { ffi::mlxb_array_dtype(self.0) })
    }
    pub fn size(&self) -> usize {
        unsafe { ffi::mlxb_array_size(self.0) }
    }
    pub fn nbytes(&self) -> usize {
        unsafe { ffi::mlxb_array_nbytes(self.0) }
    }

    pub fn eval(&self) -> Result<()> {
        eval(&[self])
    }

    /// Evaluates and copies the elements out, converting to `T`'s dtype first.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>> {
        let a = if self.dtype() == T::DTYPE { self.clone() } else { self.astype(T::DTYPE)? };
        tally(&[&a])?;
        let mut out = vec![T::default(); a.size()];
        check(unsafe {
            let _watch = super::distributed::watchdog::enter();
            ffi::mlxb_array_to_host(a.0, out.as_mut_ptr() as *mut _, out.len() * std::mem::size_of::<T>())
        })?;
        Ok(out)
    }

    /// Evaluates and copies the raw bytes (in the array's own dtype).
    pub fn to_bytes(&self) -> Result<Vec<u8>> {
        tally(&[self])?;
        let mut out = vec![0u8; self.nbytes()];
        let _watch = super::distributed::watchdog::enter();
        check(unsafe { ffi::mlxb_array_to_host(self.0, out.as_mut_ptr() as *mut _, out.len()) })?;
        Ok(out)
    }

    /// The single element of a size-1 array.
    pub fn item<T: Element>(&self) -> Result<T> {
        if self.size() != 1 {
            return Err(Error::invalid(format!("item() on an array of shape {:?}", self.shape())));
        }
        Ok(self.to_vec::<T>()?[0])
    }
}

thread_local! {
    /// While [`count_ops`] runs on this thread: the primitives each eval
    /// was handed, by name.
    static COUNTED: std::cell::RefCell<Option<std::collections::BTreeMap<String, usize>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f`, counting by name the primitives of every graph that
/// [`eval`], [`async_eval`] and the host reads hand MLX on this thread
/// meanwhile (each node once: an evaluated node is not walked again; a host
/// read's own copy to a contiguous layout, where MLX makes one, is not
/// counted). A pass that evaluates as it goes (a prefill's chunks, the
/// overlap's layers) is counted whole; what `f` leaves unevaluated is the
/// caller's to count with [`graph_ops`]. A `count_ops` inside `f` keeps its
/// own tally, which the outer one does not include.
pub fn count_ops<R>(f: impl FnOnce() -> R) -> (R, Vec<(String, usize)>) {
    /// Puts the outer tally back even if `f` panics (else this thread
    /// would walk every later graph).
    struct Restore(Option<Option<std::collections::BTreeMap<String, usize>>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(outer) = self.0.take() {
                COUNTED.with(|c| *c.borrow_mut() = outer);
            }
        }
    }
    let mut restore = Restore(Some(COUNTED.with(|c| c.borrow_mut().replace(Default::default()))));
    let r = f();
    let outer = restore.0.take().expect("set above");
    let counts = COUNTED.with(|c| std::mem::replace(&mut *c.borrow_mut(), outer)).unwrap_or_default();
    let mut v: Vec<(String, usize)> = counts.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    (r, v)
}

/// Adds `arrays`' unevaluated primitives to [`count_ops`]'s tally, if one runs.
fn tally(arrays: &[&Array]) -> Result<()> {
    if COUNTED.with(|c| c.borrow().is_none()) {
        return Ok(());
    }
    let ops = graph_ops(arrays)?;
    COUNTED.with(|c| {
        if let Some(m) = c.borrow_mut().as_mut() {
            for (name, n) in ops {
                *m.entry(name).or_default() += n;
            }
        }
    });
    Ok(())
}

pub fn eval(arrays: &[&Array]) -> Result<()> {
    tally(arrays)?;
    let hs: Vec<Handle> = arrays.iter().map(|a| a.0).collect();
    let _watch = super::distributed::watchdog::enter();
    check(unsafe { ffi::mlxb_eval(hs.as_ptr(), hs.len()) })
}

/// The primitives evaluating `arrays` would run (their graph not yet
/// evaluated; a multi-output primitive once), by name, most frequent first:
/// what MLX encodes and launches one by one, the host's cost of a step.
pub fn graph_ops(arrays: &[&Array]) -> Result<Vec<(String, usize)>> {
    let hs: Vec<Handle> = arrays.iter().map(|a| a.0).collect();
    let mut needed = 0usize;
    check(unsafe { ffi::mlxb_graph_ops(hs.as_ptr(), hs.len(), std::ptr::null_mut(), 0, &mut needed) })?;
    let mut buf = vec![0u8; needed.max(1)];
    check(unsafe { ffi::mlxb_graph_ops(hs.as_ptr(), hs.len(), buf.as_mut_ptr() as *mut _, buf.len(), &mut needed) })?;
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end])
        .lines()
        .map(|l| {
            let (name, n) = l.rsplit_once(' ').ok_or_else(|| Error::mlx(format!("graph_ops: bad line {l:?}")))?;
            Ok((name.to_string(), n.parse().map_err(|_| Error::mlx(format!("graph_ops: bad count in {l:?}")))?))
        })
        .collect()
}

pub fn async_eval(arrays: &[&Array]) -> Result<()> {
    tally(arrays)?;
    let hs: Vec<Handle> = arrays.iter().map(|a| a.0).collect();
    let _watch = super::distributed::watchdog::enter();
    check(unsafe { ffi::mlxb_async_eval(hs.as_ptr(), hs.len()) })
}
