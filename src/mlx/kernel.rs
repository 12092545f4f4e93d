//! Custom GPU kernels through MLX's own custom-kernel API
//! (`mlx::core::fast::cuda_kernel`): MLX JIT-compiles the kernel at its first
//! use, schedules it on the stream like any other op, and traces it inside a
//! compiled function. Only the CUDA backend runs these; callers decide
//! through [`cuda_kernels_enabled`] and keep the stock ops everywhere else.

use super::array::{check, Array, Dtype};
use super::ffi::{self, ArraysHandle, Handle, KernelHandle};
use super::runtime;
use crate::error::{Error, Result};
use std::ffi::CString;
use std::os::raw::c_int;

/// A compile-time constant handed to the kernel's source.
#[derive(Clone, Copy, Debug)]
pub enum TemplateArg {
    Int(i32),
    Bool(bool),
    Dtype(Dtype),
}

/// One CUDA kernel: its body and the names of its inputs and outputs.
pub struct CudaKernel {
    raw: KernelHandle,
    name: String,
    /// Its texts' files, where MLX got include lines
    /// (by default; `MLX_LFM_KERNEL_TEXT=inline` keeps them inline, src/mlx/kernel_text.rs).
    files: Option<super::kernel_text::KernelFiles>,
}

/// The name MLX gets for a kernel: `name`, then a hash of its whole text
/// (inputs, outputs, body, header) and of `mlx`, the MLX version that wraps
/// it in its own signature and headers. MLX keeps a compiled kernel in
/// memory for the process and on disk in its PTX cache
/// (`MLX_PTX_CACHE_DIR`, else `$TMPDIR/mlx/<version>/ptx`, which outlives
/// the process), under a module name: the MLX 0.32.4 wheel's
/// `CustomKernel::eval_gpu` (its disassembly, session 33) makes that name
/// from the kernel's name and a hash of the text it was given, at every
/// dispatch; earlier MLX took the name and template values alone, and
/// with the text in files (src/mlx/kernel_text.rs) MLX's text is include
/// lines. This hash, in the name and in the files' names, is what keeps a
/// kernel whose body changed (an upgrade of this package, a switch that
/// rewrites its text) from running the cubin an earlier body left, with
/// another argument list or other arithmetic, however MLX names it. The
/// base name stays a prefix, so profilers still find a kernel by it.
pub fn module_name(name: &str, inputs: &[&str], outputs: &[&str], source: &str, header: &str, mlx: &str) -> String {
    use std::hash::{Hash, Hasher};
    // (std's SipHash with its fixed keys: the same text gives the same name
    // in every process; a new toolchain may change it, which only costs a
    // compile.)
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (name, inputs, outputs, source, header, mlx).hash(&mut h);
    format!("{name}_{:016x}", h.finish())
}

/// The template values that name a call's operand dtypes, `LFM_IO0`, ...:
/// MLX writes a kernel's signature from its operands' dtypes but keys the
/// compiled kernel by name and template values only, so two calls with the
/// same template values and other operand dtypes would share the first
/// one's cubin. Each value packs seven operands' dtype codes, four bits
/// each (inputs, then outputs): short, as MLX hashes and copies a kernel's
/// name (these values in it) at every launch, on the host that bounds a
/// decode step. Six values, 42 operands: the conv layer joined to its MoE
/// has 34 (its 4-bit form: 23 inputs, 11 outputs), which four refused, so
/// on the GPU it never built (session 31) while the CPU, never asked to
/// make it, could not tell.
const IO_NAMES: [&str; 6] = ["LFM_IO0", "LFM_IO1", "LFM_IO2", "LFM_IO3", "LFM_IO4", "LFM_IO5"];
const IO_PER_VALUE: usize = 7;

/// The most operands (inputs and outputs) a kernel may have.
pub(crate) const MAX_OPERANDS: usize = IO_NAMES.len() * IO_PER_VALUE;

fn io_values(operands: usize) -> usize {
    operands.div_ceil(IO_PER_VALUE)
}

/// (Items of any name lifetime, so they chain after a caller's own.)
pub(crate) fn dtype_args<'a, 's>(
    inputs: &'a [&'a Array],
    outputs: &'a [(&'a [i32], Dtype)],
) -> impl Iterator<Item = (&'s str, TemplateArg)> + 'a {
    let mut codes = inputs.iter().map(|a| a.dtype() as i32).chain(outputs.iter().map(|(_, d)| *d as i32));
    (0..io_values(inputs.len() + outputs.len())).map(move |i| {
        let packed = codes.by_ref().take(IO_PER_VALUE).fold(0, |acc, d| (acc << 4) | (d & 15));
        (IO_NAMES[i], TemplateArg::Int(packed))
    })
}

/// The body as MLX gets it: the dtype values read once (`(void)`), since
/// NVRTC warns of a constant never used.
fn with_io_reads(source: &str, operands: usize) -> String {
    let reads: String = IO_NAMES[..io_values(operands)].iter().map(|n| format!("(void){n};")).collect();
    format!("{reads}\n{source}")
}

// The handle is an immutable MLX function object; MLX itself is driven by
// one thread per model, which is what calls it.
unsafe impl Send for CudaKernel {}
unsafe impl Sync for CudaKernel {}

impl CudaKernel {
    pub fn new(name: &str, inputs: &[&str], outputs: &[&str], source: &str, header: &str) -> Result<CudaKernel> {
        let cs = |s: &str| CString::new(s).map_err(|_| Error::invalid(format!("kernel {name}: a NUL in its text")));
        let ins: Vec<CString> = inputs.iter().map(|s| cs(s)).collect::<Result<_>>()?;
        let outs: Vec<CString> = outputs.iter().map(|s| cs(s)).collect::<Result<_>>()?;
        let in_p: Vec<*const std::os::raw::c_char> = ins.iter().map(|c| c.as_ptr()).collect();
        let out_p: Vec<*const std::os::raw::c_char> = outs.iter().map(|c| c.as_ptr()).collect();
        let operands = inputs.len() + outputs.len();
        if io_values(operands) > IO_NAMES.len() {
            return Err(Error::invalid(format!("kernel {name}: {operands} operands (at most {MAX_OPERANDS})")));
        }
        let source = with_io_reads(source, operands);
        let module = module_name(name, inputs, outputs, &source, header, &runtime::version());
        let files = if super::kernel_text::in_files() {
            super::kernel_text::folder().and_then(|dir| {
                super::kernel_text::KernelFiles::write(dir, &module, inputs, &source, header)
                    .map_err(|e| eprintln!("mlx-lfm: kernel {name}: its text stays inline: {e}"))
                    .ok()
            })
        } else {
            None
        };
        let (text, head) = match &files {
            Some(f) => (f.source.as_str(), f.header_line.as_str()),
            None => (source.as_str(), header),
        };
        let (n, src, hdr) = (cs(&module)?, cs(text)?, cs(head)?);
        let mut raw: KernelHandle = std::ptr::null_mut();
        check(unsafe {
            ffi::mlxb_cuda_kernel(n.as_ptr(), in_p.as_ptr(), in_p.len(), out_p.as_ptr(), out_p.len(), src.as_ptr(), hdr.as_ptr(), &mut raw)
        })?;
        Ok(CudaKernel { raw, name: name.to_string(), files })
    }

    /// Runs the kernel (lazily, as any op): `outputs` are (shape, dtype),
    /// `grid` counts threads (MLX divides by `block`).
    pub fn call(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        grid: [i32; 3],
        block: [i32; 3],
        template: &[(&str, TemplateArg)],
    ) -> Result<Vec<Array>> {
        if let Some(f) = &self.files {
            // (A template value never compiled before makes NVRTC read the
            // files again, at this call's first evaluation.)
            f.ensure().map_err(|e| Error::invalid(format!("kernel {}: its text's files: {e}", self.name)))?;
        }
        let hs: Vec<Handle> = inputs.iter().map(|a| a.handle()).collect();
        let shapes: Vec<i32> = outputs.iter().flat_map(|(s, _)| s.iter().copied()).collect();
        let ndims: Vec<c_int> = outputs.iter().map(|(s, _)| s.len() as c_int).collect();
        let dtypes: Vec<c_int> = outputs.iter().map(|(_, d)| *d as c_int).collect();
        let template: Vec<(&str, TemplateArg)> = template.iter().copied().chain(dtype_args(inputs, outputs)).collect();
        let names: Vec<CString> = template
            .iter()
            .map(|(n, _)| CString::new(*n).map_err(|_| Error::invalid(format!("kernel {}: a NUL in a template name", self.name))))
            .collect::<Result<_>>()?;
        let name_p: Vec<*const std::os::raw::c_char> = names.iter().map(|c| c.as_ptr()).collect();
        let kinds: Vec<c_int> = template
            .iter()
            .map(|(_, a)| match a {
                TemplateArg::Int(_) => 0,
                TemplateArg::Bool(_) => 1,
                TemplateArg::Dtype(_) => 2,
            })
            .collect();
        let values: Vec<c_int> = template
            .iter()
            .map(|(_, a)| match a {
                TemplateArg::Int(v) => *v,
                TemplateArg::Bool(b) => *b as c_int,
                TemplateArg::Dtype(d) => *d as c_int,
            })
            .collect();
        let mut outs: ArraysHandle = std::ptr::null_mut();
        check(unsafe {
            ffi::mlxb_kernel_call(
                self.raw,
                hs.as_ptr(),
                hs.len(),
                shapes.as_ptr(),
                ndims.as_ptr(),
                dtypes.as_ptr(),
                outputs.len(),
                grid.as_ptr(),
                block.as_ptr(),
                name_p.as_ptr(),
                kinds.as_ptr(),
                values.as_ptr(),
                template.len(),
                &mut outs,
            )
        })
        .map_err(|e| e.context(format!("custom kernel {}", self.name)))?;
        let n = unsafe { ffi::mlxb_arrays_len(outs) };
        let v = (0..n).map(|i| Array(unsafe { ffi::mlxb_arrays_take(outs, i) })).collect();
        unsafe { ffi::mlxb_arrays_free(outs) };
        Ok(v)
    }
}

impl Drop for CudaKernel {
    fn drop(&mut self) {
        unsafe { ffi::mlxb_kernel_free(self.raw) }
    }
}

/// Our CUDA kernels run only where they were written and tested: MLX's
/// CUDA backend with the GPU as the default device. `MLX_LFM_KERNELS=0`
/// turns them off (the stock ops then run, as on every other backend).
pub fn cuda_kernels_enabled() -> bool {
    // Read once: the eager path asks twice per layer per token.
    static CUDA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let cuda = crate::knobs::cached("MLX_LFM_KERNELS", &CUDA, |v| {
        !matches!(v, Some("0")) && runtime::backend() == runtime::Backend::Cuda
    });
    cuda && !STOCK_ONLY.with(|s| s.get()) && runtime::default_device() == runtime::DeviceType::Gpu
}

thread_local! {
    static STOCK_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether this thread runs the stock ops as they were before any change
/// of ours to a graph's shape (`MLX_LFM_KERNELS=0`, or a test's
/// [`with_stock_ops`]), on any backend: what the fused gate
/// (src/model/activations.rs) asks, so that the stock path a test or an
/// A/B compares against is the three ops it replaced.
pub fn stock_ops_only() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    STOCK_ONLY.with(|s| s.get()) || crate::knobs::cached("MLX_LFM_KERNELS", &OFF, |v| matches!(v, Some("0")))
}

/// Runs `f` with our kernels off on this thread (tests compare both paths
/// in one process; a model's traces keep what was on when they were built).
pub fn with_stock_ops<R>(f: impl FnOnce() -> R) -> R {
    with_thread_flag(&STOCK_ONLY, true, f)
}

/// Runs `f` with the thread-local `flag` set to `value`, restored after
/// (also when `f` panics, so a failed test leaves the next one as it was).
pub(crate) fn with_thread_flag<T: Copy + 'static, R>(
    flag: &'static std::thread::LocalKey<std::cell::Cell<T>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Reset<T: Copy + 'static>(&'static std::thread::LocalKey<std::cell::Cell<T>>, T);
    impl<T: Copy + 'static> Drop for Reset<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _reset = Reset(flag, flag.with(|c| c.replace(value)));
    f()
}
