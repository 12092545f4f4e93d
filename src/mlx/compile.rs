//! `mx::compile` over a Rust closure: MLX traces the closure once per input
//! shape signature and replays the fused graph afterwards.

use super::array::{check, Array};
use super::ffi::{self, FnHandle, Handle};
use crate::error::Result;
use std::ffi::CString;
use std::os::raw::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

type TraceFn = dyn Fn(&[Array]) -> Result<Vec<Array>>;

/// A compiled function. It keeps its closure alive for as long as MLX may
/// re-trace it (a new input shape triggers a new trace).
pub struct Compiled {
    handle: FnHandle,
    _closure: Box<Box<TraceFn>>,
}

extern "C" fn trampoline(
    ctx: *mut c_void,
    ins: *const Handle,
    n_in: usize,
    outs: *mut Handle,
    cap_out: usize,
    n_out: *mut usize,
) -> c_int {
    let f = unsafe { &*(ctx as *const Box<TraceFn>) };
    // Inputs are borrowed: clone them into owned handles for the closure.
    let inputs: Vec<Array> =
        (0..n_in).map(|i| Array(unsafe { ffi::mlxb_array_clone(*ins.add(i)) })).collect();
    let res = catch_unwind(AssertUnwindSafe(|| f(&inputs)));
    let msg = match res {
        Ok(Ok(v)) if v.len() <= cap_out => {
            for (i, a) in v.into_iter().enumerate() {
                unsafe { *outs.add(i) = a.handle() };
                std::mem::forget(a);
                unsafe { *n_out = i + 1 };
            }
            return 0;
        }
        Ok(Ok(v)) => format!("compiled closure returned {} outputs (at most {cap_out})", v.len()),
        Ok(Err(e)) => e.message,
        Err(_) => "compiled closure panicked".to_string(),
    };
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    unsafe { ffi::mlxb_set_error(c.as_ptr()) };
    1
}

impl Compiled {
    pub fn new(f: impl Fn(&[Array]) -> Result<Vec<Array>> + 'static, shapeless: bool) -> Result<Compiled> {
        let closure: Box<Box<TraceFn>> = Box::new(Box::new(f));
        let mut handle: FnHandle = std::ptr::null_mut();
        let ctx = &*closure as *const Box<TraceFn> as *mut c_void;
        check(unsafe { ffi::mlxb_compile(trampoline, ctx, shapeless as c_int, &mut handle) })?;
        Ok(Compiled { handle, _closure: closure })
    }

    pub fn call(&self, inputs: &[&Array]) -> Result<Vec<Array>> {
        let hs: Vec<Handle> = inputs.iter().map(|a| a.handle()).collect();
        let mut outs: Vec<Handle> = vec![std::ptr::null_mut(); 64];
        let mut n = 0usize;
        check(unsafe { ffi::mlxb_fn_call(self.handle, hs.as_ptr(), hs.len(), outs.as_mut_ptr(), outs.len(), &mut n) })?;
        Ok(outs.into_iter().take(n).map(Array).collect())
    }
}

impl Drop for Compiled {
    fn drop(&mut self) {
        unsafe { ffi::mlxb_fn_free(self.handle) }
    }
}
