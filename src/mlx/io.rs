//! Safetensors files through MLX's own (lazy) reader and writer.

use super::array::{check, Array};
use super::ffi::{self, Handle};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::os::raw::{c_char, c_void};
use std::path::Path;

struct LoadCtx {
    arrays: Vec<(String, Array)>,
    meta: HashMap<String, String>,
}

extern "C" fn on_array(ctx: *mut c_void, name: *const c_char, a: Handle) {
    let ctx = unsafe { &mut *(ctx as *mut LoadCtx) };
    let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
    ctx.arrays.push((name, Array(a)));
}

extern "C" fn on_meta(ctx: *mut c_void, k: *const c_char, v: *const c_char) {
    let ctx = unsafe { &mut *(ctx as *mut LoadCtx) };
    let k = unsafe { CStr::from_ptr(k) }.to_string_lossy().into_owned();
    let v = unsafe { CStr::from_ptr(v) }.to_string_lossy().into_owned();
    ctx.meta.insert(k, v);
}

fn path_cstr(path: &Path) -> Result<CString> {
    CString::new(path.to_string_lossy().as_bytes())
        .map_err(|_| Error::invalid(format!("path {} contains a NUL byte", path.display())))
}

/// Opens a safetensors file; the arrays read their bytes lazily on first eval.
pub fn load_safetensors(path: &Path) -> Result<(Vec<(String, Array)>, HashMap<String, String>)> {
    let p = path_cstr(path)?;
    let mut ctx = LoadCtx { arrays: Vec::new(), meta: HashMap::new() };
    check(unsafe { ffi::mlxb_load_safetensors(p.as_ptr(), &mut ctx as *mut _ as *mut c_void, on_array, Some(on_meta)) })
        .map_err(|e| e.context(path.display()))?;
    Ok((ctx.arrays, ctx.meta))
}

/// Writes arrays (evaluating them) and string metadata to a safetensors file.
pub fn save_safetensors(path: &Path, arrays: &[(String, Array)], meta: &[(String, String)]) -> Result<()> {
    let p = path_cstr(path)?;
    let to_c = |s: &str| CString::new(s).map_err(|_| Error::invalid(format!("name {s:?} contains a NUL byte")));
    let names: Vec<CString> = arrays.iter().map(|(n, _)| to_c(n)).collect::<Result<_>>()?;
    let name_ptrs: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let hs: Vec<Handle> = arrays.iter().map(|(_, a)| a.handle()).collect();
    let keys: Vec<CString> = meta.iter().map(|(k, _)| to_c(k)).collect::<Result<_>>()?;
    let vals: Vec<CString> = meta.iter().map(|(_, v)| to_c(v)).collect::<Result<_>>()?;
    let kp: Vec<*const c_char> = keys.iter().map(|c| c.as_ptr()).collect();
    let vp: Vec<*const c_char> = vals.iter().map(|c| c.as_ptr()).collect();
    check(unsafe {
        ffi::mlxb_save_safetensors(p.as_ptr(), name_ptrs.as_ptr(), hs.as_ptr(), hs.len(), kp.as_ptr(), vp.as_ptr(), kp.len())
    })
    .map_err(|e| e.context(path.display()))
}
