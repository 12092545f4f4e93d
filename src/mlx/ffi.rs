//! Raw declarations of the bridge's C ABI (cpp/mlxb.h). Only src/mlx uses them.
#![allow(non_camel_case_types)]

use std::os::raw::{c_char, c_int, c_void};

#[repr(C)]
pub struct mlxb_array_s {
    _p: [u8; 0],
}
#[repr(C)]
pub struct mlxb_fn_s {
    _p: [u8; 0],
}
#[repr(C)]
pub struct mlxb_arrays_s {
    _p: [u8; 0],
}
#[repr(C)]
pub struct mlxb_kernel_s {
    _p: [u8; 0],
}
#[repr(C)]
pub struct mlxb_group_s {
    _p: [u8; 0],
}
pub type GroupHandle = *mut mlxb_group_s;
pub type KernelHandle = *mut mlxb_kernel_s;
pub type Handle = *mut mlxb_array_s;
pub type FnHandle = *mut mlxb_fn_s;
pub type ArraysHandle = *mut mlxb_arrays_s;

pub type NamedArrayCb = extern "C" fn(ctx: *mut c_void, name: *const c_char, a: Handle);
pub type KvCb = extern "C" fn(ctx: *mut c_void, key: *const c_char, value: *const c_char);
pub type TraceCb = extern "C" fn(ctx: *mut c_void, ins: *const Handle, n_in: usize, outs: ArraysHandle) -> c_int;

extern "C" {
    pub fn mlxb_dist_is_available(backend: *const c_char) -> c_int;
    pub fn mlxb_dist_init(backend: *const c_char, strict: c_int, out: *mut GroupHandle) -> c_int;
    pub fn mlxb_group_free(g: GroupHandle);
    pub fn mlxb_group_rank(g: GroupHandle) -> c_int;
    pub fn mlxb_group_size(g: GroupHandle) -> c_int;
    pub fn mlxb_all_sum(x: Handle, g: GroupHandle, out: *mut Handle) -> c_int;
    pub fn mlxb_all_max(x: Handle, g: GroupHandle, out: *mut Handle) -> c_int;
    pub fn mlxb_all_gather(x: Handle, g: GroupHandle, out: *mut Handle) -> c_int;
    pub fn mlxb_dist_send(x: Handle, dst: c_int, g: GroupHandle, out: *mut Handle) -> c_int;
    pub fn mlxb_dist_recv(shape: *const i32, ndim: c_int, dtype: c_int, src: c_int, g: GroupHandle, out: *mut Handle) -> c_int;

    pub fn mlxb_last_error() -> *const c_char;
    pub fn mlxb_version() -> *const c_char;
    pub fn mlxb_set_error(msg: *const c_char);

    pub fn mlxb_array_free(a: Handle);
    pub fn mlxb_array_clone(a: Handle) -> Handle;
    pub fn mlxb_array_ndim(a: Handle) -> c_int;
    pub fn mlxb_array_shape(a: Handle, out: *mut i32);
    pub fn mlxb_array_dtype(a: Handle) -> c_int;
    pub fn mlxb_array_size(a: Handle) -> usize;
    pub fn mlxb_array_nbytes(a: Handle) -> usize;
    pub fn mlxb_array_from_data(data: *const c_void, shape: *const i32, ndim: c_int, dtype: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_array_scalar(v: f64, dtype: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_array_to_host(a: Handle, dst: *mut c_void, len: usize) -> c_int;
    pub fn mlxb_eval(arrs: *const Handle, n: usize) -> c_int;
    pub fn mlxb_async_eval(arrs: *const Handle, n: usize) -> c_int;
    pub fn mlxb_graph_ops(arrs: *const Handle, n: usize, buf: *mut c_char, len: usize, needed: *mut usize) -> c_int;

    pub fn mlxb_load_safetensors(path: *const c_char, ctx: *mut c_void, on_array: NamedArrayCb, on_meta: Option<KvCb>) -> c_int;
    pub fn mlxb_save_safetensors(
        path: *const c_char,
        names: *const *const c_char,
        arrs: *const Handle,
        n: usize,
        meta_keys: *const *const c_char,
        meta_vals: *const *const c_char,
        n_meta: usize,
    ) -> c_int;

    pub fn mlxb_astype(a: Handle, dtype: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_view(a: Handle, dtype: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_reshape(a: Handle, shape: *const i32, ndim: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_transpose(a: Handle, axes: *const i32, n: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_expand_dims(a: Handle, axis: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_squeeze(a: Handle, axis: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_broadcast_to(a: Handle, shape: *const i32, ndim: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_contiguous(a: Handle, out: *mut Handle) -> c_int;
    pub fn mlxb_slice(a: Handle, start: *const i32, stop: *const i32, strides: *const i32, n: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_slice_update(src: Handle, upd: Handle, start: *const i32, stop: *const i32, n: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_slice_update_dyn(src: Handle, upd: Handle, start: Handle, axes: *const i32, n: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_scatter(a: Handle, indices: *const Handle, axes: *const i32, n: c_int, updates: Handle, out: *mut Handle) -> c_int;
    pub fn mlxb_concatenate(arrs: *const Handle, n: usize, axis: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_depends(inputs: *const Handle, n: usize, deps: *const Handle, m: usize, outs: *mut Handle) -> c_int;
    pub fn mlxb_stack(arrs: *const Handle, n: usize, axis: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_split_equal(a: Handle, parts: c_int, axis: c_int, outs: *mut Handle) -> c_int;
    pub fn mlxb_split_at(a: Handle, indices: *const c_int, n: c_int, axis: c_int, outs: *mut Handle) -> c_int;
    pub fn mlxb_take(a: Handle, idx: Handle, axis: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_take_along_axis(a: Handle, idx: Handle, axis: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_put_along_axis(a: Handle, idx: Handle, vals: Handle, axis: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_zeros(shape: *const i32, ndim: c_int, dtype: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_full(shape: *const i32, ndim: c_int, v: f64, dtype: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_arange(start: f64, stop: f64, step: f64, dtype: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_where(c: Handle, a: Handle, b: Handle, out: *mut Handle) -> c_int;

    pub fn mlxb_unary(op: c_int, a: Handle, out: *mut Handle) -> c_int;
    pub fn mlxb_binary(op: c_int, a: Handle, b: Handle, out: *mut Handle) -> c_int;
    pub fn mlxb_reduce(op: c_int, a: Handle, axes: *const i32, n: c_int, keepdims: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_argmax(a: Handle, axis: c_int, keepdims: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_argmin(a: Handle, axis: c_int, keepdims: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_softmax(a: Handle, axis: c_int, precise: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_argpartition(a: Handle, kth: c_int, axis: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_topk(a: Handle, k: c_int, axis: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_sort(a: Handle, axis: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_argsort(a: Handle, axis: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_cumsum(a: Handle, axis: c_int, reverse: c_int, inclusive: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_clip(a: Handle, lo: f64, hi: f64, out: *mut Handle) -> c_int;

    pub fn mlxb_matmul(a: Handle, b: Handle, out: *mut Handle) -> c_int;
    pub fn mlxb_addmm(c: Handle, a: Handle, b: Handle, alpha: f32, beta: f32, out: *mut Handle) -> c_int;
    pub fn mlxb_quantize(w: Handle, group_size: c_int, bits: c_int, mode: *const c_char, outs: *mut Handle, n_out: *mut c_int) -> c_int;
    pub fn mlxb_dequantize(w: Handle, scales: Handle, biases: Handle, group_size: c_int, bits: c_int, mode: *const c_char, dtype: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_quantized_matmul(x: Handle, w: Handle, scales: Handle, biases: Handle, transpose: c_int, group_size: c_int, bits: c_int, mode: *const c_char, out: *mut Handle) -> c_int;
    pub fn mlxb_gather_mm(a: Handle, b: Handle, lhs: Handle, rhs: Handle, sorted: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_gather_qmm(x: Handle, w: Handle, scales: Handle, biases: Handle, lhs: Handle, rhs: Handle, transpose: c_int, group_size: c_int, bits: c_int, mode: *const c_char, sorted: c_int, out: *mut Handle) -> c_int;

    pub fn mlxb_rms_norm(x: Handle, w: Handle, eps: f32, out: *mut Handle) -> c_int;
    pub fn mlxb_rope(x: Handle, dims: c_int, traditional: c_int, base: f32, scale: f32, offset: c_int, out: *mut Handle) -> c_int;
    pub fn mlxb_rope_dyn(x: Handle, dims: c_int, traditional: c_int, base: f32, scale: f32, offset: Handle, out: *mut Handle) -> c_int;
    pub fn mlxb_sdpa(q: Handle, k: Handle, v: Handle, scale: f32, mask_mode: *const c_char, mask: Handle, out: *mut Handle) -> c_int;
    pub fn mlxb_conv1d(x: Handle, w: Handle, stride: c_int, padding: c_int, dilation: c_int, groups: c_int, out: *mut Handle) -> c_int;

    pub fn mlxb_random_key(seed: u64, out: *mut Handle) -> c_int;
    pub fn mlxb_random_split(key: Handle, a: *mut Handle, b: *mut Handle) -> c_int;
    pub fn mlxb_random_categorical(logits: Handle, axis: c_int, key: Handle, out: *mut Handle) -> c_int;
    pub fn mlxb_random_uniform(shape: *const i32, ndim: c_int, dtype: c_int, key: Handle, out: *mut Handle) -> c_int;
    pub fn mlxb_random_normal(shape: *const i32, ndim: c_int, dtype: c_int, loc: f32, scale: f32, key: Handle, out: *mut Handle) -> c_int;

    pub fn mlxb_arrays_push(v: ArraysHandle, a: Handle) -> c_int;
    pub fn mlxb_arrays_len(v: ArraysHandle) -> usize;
    pub fn mlxb_arrays_take(v: ArraysHandle, i: usize) -> Handle;
    pub fn mlxb_arrays_free(v: ArraysHandle);
    pub fn mlxb_compile(cb: TraceCb, ctx: *mut c_void, shapeless: c_int, out: *mut FnHandle) -> c_int;
    pub fn mlxb_fn_call(f: FnHandle, ins: *const Handle, n_in: usize, out: *mut ArraysHandle) -> c_int;
    pub fn mlxb_fn_clear(f: FnHandle) -> c_int;
    pub fn mlxb_fn_free(f: FnHandle);

    pub fn mlxb_cuda_kernel(
        name: *const c_char,
        input_names: *const *const c_char,
        n_in: usize,
        output_names: *const *const c_char,
        n_out: usize,
        source: *const c_char,
        header: *const c_char,
        out: *mut KernelHandle,
    ) -> c_int;
    pub fn mlxb_kernel_call(
        k: KernelHandle,
        ins: *const Handle,
        n_in: usize,
        out_shapes: *const i32,
        out_ndims: *const c_int,
        out_dtypes: *const c_int,
        n_out: usize,
        grid: *const i32,
        threadgroup: *const i32,
        targ_names: *const *const c_char,
        targ_kinds: *const c_int,
        targ_values: *const c_int,
        n_targ: usize,
        outs: *mut ArraysHandle,
    ) -> c_int;
    pub fn mlxb_kernel_free(k: KernelHandle);

    pub fn mlxb_get_active_memory() -> usize;
    pub fn mlxb_get_peak_memory() -> usize;
    pub fn mlxb_get_cache_memory() -> usize;
    pub fn mlxb_reset_peak_memory();
    pub fn mlxb_get_memory_limit() -> usize;
    pub fn mlxb_set_memory_limit(limit: usize, prev: *mut usize) -> c_int;
    pub fn mlxb_set_cache_limit(limit: usize, prev: *mut usize) -> c_int;
    pub fn mlxb_set_wired_limit(limit: usize, prev: *mut usize) -> c_int;
    pub fn mlxb_clear_cache();
    pub fn mlxb_default_device() -> c_int;
    pub fn mlxb_gpu_available() -> c_int;
    pub fn mlxb_set_default_device(t: c_int) -> c_int;
    pub fn mlxb_use_new_stream() -> c_int;
    pub fn mlxb_synchronize() -> c_int;
    pub fn mlxb_device_name(buf: *mut c_char, len: usize) -> c_int;
    pub fn mlxb_device_total_memory() -> usize;
}

