//! Process-level MLX facts and knobs: version, backend, device, memory.

use super::array::check;
use super::ffi;
use crate::error::{Error, Result};
use std::ffi::CStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Cpu,
    Cuda,
    Metal,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Metal => "metal",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceType {
    Cpu,
    Gpu,
}

pub fn version() -> String {
    unsafe { CStr::from_ptr(ffi::mlxb_version()) }.to_string_lossy().into_owned()
}

/// Which libmlx build is loaded: a GPU-capable libmlx is Metal on macOS and
/// CUDA elsewhere; without a GPU it is the CPU build.
pub fn backend() -> Backend {
    if unsafe { ffi::mlxb_gpu_available() } == 0 {
        Backend::Cpu
    } else if cfg!(target_os = "macos") {
        Backend::Metal
    } else {
        Backend::Cuda
    }
}

pub fn default_device() -> DeviceType {
    if unsafe { ffi::mlxb_default_device() } == 1 {
        DeviceType::Gpu
    } else {
        DeviceType::Cpu
    }
}

pub fn set_default_device(d: DeviceType) -> Result<()> {
    if d == DeviceType::Gpu && unsafe { ffi::mlxb_gpu_available() } == 0 {
        return Err(Error::invalid("device 'gpu' requested but this libmlx has no GPU backend (it is the CPU build)"));
    }
    check(unsafe { ffi::mlxb_set_default_device(if d == DeviceType::Gpu { 1 } else { 0 }) })
}

/// Gives the calling thread its own stream on the default device.
pub fn use_new_stream() -> Result<()> {
    check(unsafe { ffi::mlxb_use_new_stream() })
}

pub fn synchronize() -> Result<()> {
    check(unsafe { ffi::mlxb_synchronize() })
}

pub fn device_name() -> String {
    let mut buf = vec![0u8; 256];
    if unsafe { ffi::mlxb_device_name(buf.as_mut_ptr() as *mut _, buf.len()) } != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// The file of the allocator that serves this process's `malloc`: the C
/// library's unless another was preloaded. MLX's host bookkeeping per
/// graph node is allocation-heavy, so which allocator serves it moves
/// decode speed on CUDA (bench/results/2026-12-04-h200-session21.raw.jsonl):
/// a figure that does not say which one ran says half.
///
/// Asked of a fresh block, not of `malloc`'s address: an executable that
/// takes that address (node does) makes its own PLT entry the symbol's
/// address, and the loader would name the executable. mimalloc, the one
/// allocator we preload, answers for its blocks (`mi_is_in_heap_region`);
/// otherwise the block is the C library's.
pub fn malloc_library() -> Option<String> {
    // SAFETY: dlsym and dladdr read the loader's tables; the file name
    // dladdr returns lives while its library stays loaded, and is copied at
    // once; the block is freed by the allocator that gave it.
    unsafe {
        let file = |f: *mut libc::c_void| -> Option<String> {
            let mut info: libc::Dl_info = std::mem::zeroed();
            if f.is_null() || libc::dladdr(f, &mut info) == 0 || info.dli_fname.is_null() {
                return None;
            }
            Some(CStr::from_ptr(info.dli_fname).to_string_lossy().into_owned())
        };
        let owns = libc::dlsym(libc::RTLD_DEFAULT, c"mi_is_in_heap_region".as_ptr());
        if !owns.is_null() {
            let is_in: extern "C" fn(*const libc::c_void) -> bool = std::mem::transmute(owns);
            let block = libc::malloc(64);
            let mine = !block.is_null() && is_in(block);
            libc::free(block);
            if mine {
                return file(owns);
            }
        }
        // A function of the C library that executables do not take the
        // address of, to name its file.
        #[cfg(target_os = "linux")]
        let libc_fn = c"gnu_get_libc_version";
        #[cfg(not(target_os = "linux"))]
        let libc_fn = c"malloc_zone_malloc";
        file(libc::dlsym(libc::RTLD_DEFAULT, libc_fn.as_ptr()))
    }
}

#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryInfo {
    pub active: usize,
    pub peak: usize,
    pub cache: usize,
    pub limit: usize,
    pub device_total: usize,
}

pub fn memory() -> MemoryInfo {
    unsafe {
        MemoryInfo {
            active: ffi::mlxb_get_active_memory(),
            peak: ffi::mlxb_get_peak_memory(),
            cache: ffi::mlxb_get_cache_memory(),
            limit: ffi::mlxb_get_memory_limit(),
            device_total: ffi::mlxb_device_total_memory(),
        }
    }
}

pub fn reset_peak_memory() {
    unsafe { ffi::mlxb_reset_peak_memory() }
}
pub fn clear_cache() {
    unsafe { ffi::mlxb_clear_cache() }
}
/// Returns the previous limit.
pub fn set_memory_limit(bytes: usize) -> Result<usize> {
    let mut prev = 0;
    check(unsafe { ffi::mlxb_set_memory_limit(bytes, &mut prev) })?;
    Ok(prev)
}
pub fn set_cache_limit(bytes: usize) -> Result<usize> {
    let mut prev = 0;
    check(unsafe { ffi::mlxb_set_cache_limit(bytes, &mut prev) })?;
    Ok(prev)
}
/// Metal only (macOS 15+): bytes kept resident. Elsewhere MLX ignores it.
pub fn set_wired_limit(bytes: usize) -> Result<usize> {
    let mut prev = 0;
    check(unsafe { ffi::mlxb_set_wired_limit(bytes, &mut prev) })?;
    Ok(prev)
}
