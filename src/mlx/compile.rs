//! `mx::compile` over a Rust closure: MLX traces the closure once per input
//! shape signature and replays the fused graph afterwards.
//!
//! Each [`Compiled`] has a compile id of its own (the bridge's function
//! object), erased when it is dropped. MLX keeps every trace for as long as
//! the id lives and scans them on each call, so a function called with
//! ever new shapes (decode batches of changing size over growing caches)
//! would collect traces without end: past `max_traces` distinct input
//! signatures all traces are dropped and the shapes in use are traced again.

use super::array::{check, Array};
use super::ffi::{self, ArraysHandle, FnHandle, Handle};
use crate::error::Result;
use std::cell::RefCell;
use std::collections::HashSet;
use std::ffi::CString;
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

type TraceFn = dyn Fn(&[Array]) -> Result<Vec<Array>>;

/// MLX keeps every compiled function's traces in one map for the process,
/// unsynchronised (a function's first call inserts its entry, a drop
/// erases it), while each loaded model drives MLX from its own worker
/// thread: every call, clear and drop of a compiled function holds this
/// lock. Reentrant: a trace runs the model's code, which may call another
/// compiled function (the feed-forward's gate) on the same thread; nothing
/// under it waits on another thread (tensor-parallel ranks are processes).
static COMPILE_CACHE: parking_lot::ReentrantMutex<()> = parking_lot::const_reentrant_mutex(());

/// A compiled function. It keeps its closure alive for as long as MLX may
/// re-trace it (a new input shape triggers a new trace).
pub struct Compiled {
    handle: FnHandle,
    _closure: Box<Box<TraceFn>>,
    max_traces: usize,
    /// Input signatures (shape and dtype of every input) traced so far.
    traced: RefCell<HashSet<Vec<i32>>>,
}

extern "C" fn trampoline(ctx: *mut c_void, ins: *const Handle, n_in: usize, outs: ArraysHandle) -> c_int {
    let f = unsafe { &*(ctx as *const Box<TraceFn>) };
    // Inputs are borrowed: clone them into owned handles for the closure.
    let inputs: Vec<Array> = (0..n_in).map(|i| Array(unsafe { ffi::mlxb_array_clone(*ins.add(i)) })).collect();
    let res = catch_unwind(AssertUnwindSafe(|| f(&inputs)));
    let msg = match res {
        Ok(Ok(v)) => {
            for a in &v {
                if unsafe { ffi::mlxb_arrays_push(outs, a.handle()) } != 0 {
                    return 1; // the bridge set the error
                }
            }
            return 0;
        }
        Ok(Err(e)) => e.message,
        Err(_) => "compiled closure panicked".to_string(),
    };
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    unsafe { ffi::mlxb_set_error(c.as_ptr()) };
    1
}

impl Compiled {
    /// No bound on traces (a function called with a few fixed shapes).
    pub fn new(f: impl Fn(&[Array]) -> Result<Vec<Array>> + 'static, shapeless: bool) -> Result<Compiled> {
        Self::bounded(f, shapeless, usize::MAX)
    }

    /// At most `max_traces` input signatures kept traced (at least one).
    pub fn bounded(f: impl Fn(&[Array]) -> Result<Vec<Array>> + 'static, shapeless: bool, max_traces: usize) -> Result<Compiled> {
        let closure: Box<Box<TraceFn>> = Box::new(Box::new(f));
        let mut handle: FnHandle = std::ptr::null_mut();
        let ctx = &*closure as *const Box<TraceFn> as *mut c_void;
        check(unsafe { ffi::mlxb_compile(trampoline, ctx, shapeless as c_int, &mut handle) })?;
        Ok(Compiled { handle, _closure: closure, max_traces: max_traces.max(1), traced: RefCell::new(HashSet::new()) })
    }

    pub fn call(&self, inputs: &[&Array]) -> Result<Vec<Array>> {
        let mut new_sig = None;
        if self.max_traces != usize::MAX {
            // Every input's rank, dimensions and dtype, flattened (one
            // allocation per call: this runs for every token).
            let mut sig: Vec<i32> = Vec::with_capacity(inputs.len() * 6);
            for a in inputs {
                let shape = a.shape();
                sig.push(shape.len() as i32);
                sig.extend(shape);
                sig.push(a.dtype() as i32);
            }
            let mut traced = self.traced.borrow_mut();
            if !traced.contains(&sig) {
                if traced.len() >= self.max_traces {
                    let _cache = COMPILE_CACHE.lock();
                    check(unsafe { ffi::mlxb_fn_clear(self.handle) })?;
                    traced.clear();
                }
                new_sig = Some(sig);
            }
        }
        let hs: Vec<Handle> = inputs.iter().map(|a| a.handle()).collect();
        let mut outs: ArraysHandle = std::ptr::null_mut();
        {
            let _cache = COMPILE_CACHE.lock();
            check(unsafe { ffi::mlxb_fn_call(self.handle, hs.as_ptr(), hs.len(), &mut outs) })?;
        }
        // Counted once traced: a failed trace leaves nothing behind to bound.
        if let Some(sig) = new_sig {
            self.traced.borrow_mut().insert(sig);
        }
        let n = unsafe { ffi::mlxb_arrays_len(outs) };
        let v = (0..n).map(|i| Array(unsafe { ffi::mlxb_arrays_take(outs, i) })).collect();
        unsafe { ffi::mlxb_arrays_free(outs) };
        Ok(v)
    }

    /// Input signatures traced now (tests check the bound).
    pub fn traces(&self) -> usize {
        self.traced.borrow().len()
    }
}

impl Drop for Compiled {
    fn drop(&mut self) {
        let _cache = COMPILE_CACHE.lock();
        unsafe { ffi::mlxb_fn_free(self.handle) }
    }
}
