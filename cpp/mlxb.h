// mlx-lfm's bridge over the MLX C++ API.
//
// A plain C ABI so Rust can call it without bindgen. Every function that can
// fail returns 0 on success and non-zero on failure; the failure's text (MLX's
// own exception message) is then available from mlxb_last_error() on the same
// thread. No C++ exception ever crosses this boundary.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct mlxb_array_s* mlxb_array;
typedef struct mlxb_fn_s* mlxb_fn;

// Dtype codes shared with src/mlx/dtype.rs.
enum {
  MLXB_BOOL = 0,
  MLXB_UINT8 = 1,
  MLXB_UINT16 = 2,
  MLXB_UINT32 = 3,
  MLXB_UINT64 = 4,
  MLXB_INT8 = 5,
  MLXB_INT16 = 6,
  MLXB_INT32 = 7,
  MLXB_INT64 = 8,
  MLXB_FLOAT16 = 9,
  MLXB_FLOAT32 = 10,
  MLXB_FLOAT64 = 11,
  MLXB_BFLOAT16 = 12,
  MLXB_COMPLEX64 = 13,
};

const char* mlxb_last_error(void);
const char* mlxb_version(void);

// ---- array lifecycle and metadata -------------------------------------------
void mlxb_array_free(mlxb_array a);
mlxb_array mlxb_array_clone(mlxb_array a);
int mlxb_array_ndim(mlxb_array a);
void mlxb_array_shape(mlxb_array a, int32_t* out);  // out has ndim slots
int mlxb_array_dtype(mlxb_array a);
size_t mlxb_array_size(mlxb_array a);
size_t mlxb_array_nbytes(mlxb_array a);

int mlxb_array_from_data(const void* data, const int32_t* shape, int ndim, int dtype, mlxb_array* out);
int mlxb_array_scalar(double value, int dtype, mlxb_array* out);
// Evaluates `a` and copies its elements (row-major) into `dst` (`len` bytes).
int mlxb_array_to_host(mlxb_array a, void* dst, size_t len);

int mlxb_eval(const mlxb_array* arrs, size_t n);
int mlxb_async_eval(const mlxb_array* arrs, size_t n);
// The primitives an evaluation of `arrs` would run (the graph not yet
// evaluated, each multi-output primitive once), as "name count" lines,
// most frequent first, into `buf` (truncated to `len`); `*needed` is the
// full text's length plus one.
int mlxb_graph_ops(const mlxb_array* arrs, size_t n, char* buf, size_t len, size_t* needed);

// ---- files -------------------------------------------------------------------
typedef void (*mlxb_named_array_cb)(void* ctx, const char* name, mlxb_array a);
typedef void (*mlxb_kv_cb)(void* ctx, const char* key, const char* value);
int mlxb_load_safetensors(const char* path, void* ctx, mlxb_named_array_cb on_array, mlxb_kv_cb on_meta);
int mlxb_save_safetensors(const char* path, const char* const* names, const mlxb_array* arrs, size_t n,
                          const char* const* meta_keys, const char* const* meta_vals, size_t n_meta);

// ---- shape and indexing ops --------------------------------------------------
int mlxb_astype(mlxb_array a, int dtype, mlxb_array* out);
int mlxb_view(mlxb_array a, int dtype, mlxb_array* out);
int mlxb_reshape(mlxb_array a, const int32_t* shape, int ndim, mlxb_array* out);
int mlxb_transpose(mlxb_array a, const int32_t* axes, int n, mlxb_array* out);
int mlxb_expand_dims(mlxb_array a, int axis, mlxb_array* out);
int mlxb_squeeze(mlxb_array a, int axis, mlxb_array* out);
int mlxb_broadcast_to(mlxb_array a, const int32_t* shape, int ndim, mlxb_array* out);
int mlxb_contiguous(mlxb_array a, mlxb_array* out);
int mlxb_slice(mlxb_array a, const int32_t* start, const int32_t* stop, const int32_t* strides, int n, mlxb_array* out);
int mlxb_slice_update(mlxb_array src, mlxb_array update, const int32_t* start, const int32_t* stop, int n,
                      mlxb_array* out);
// Writes `update` into `src` at `start` (an int array, one entry per axis in
// `axes`): the position can be an input of a compiled function.
int mlxb_slice_update_dyn(mlxb_array src, mlxb_array update, mlxb_array start, const int32_t* axes, int n,
                          mlxb_array* out);
int mlxb_scatter(mlxb_array a, const mlxb_array* indices, const int32_t* axes, int n, mlxb_array updates,
                 mlxb_array* out);
int mlxb_concatenate(const mlxb_array* arrs, size_t n, int axis, mlxb_array* out);
int mlxb_depends(const mlxb_array* inputs, size_t n, const mlxb_array* deps, size_t m, mlxb_array* outs);
int mlxb_stack(const mlxb_array* arrs, size_t n, int axis, mlxb_array* out);
int mlxb_split_equal(mlxb_array a, int parts, int axis, mlxb_array* outs);
// `a` cut along `axis` before each of the `n` ascending `indices`: n + 1
// parts, one graph node (slices would be one each).
int mlxb_split_at(mlxb_array a, const int* indices, int n, int axis, mlxb_array* outs);
int mlxb_take(mlxb_array a, mlxb_array indices, int axis, mlxb_array* out);
int mlxb_take_along_axis(mlxb_array a, mlxb_array indices, int axis, mlxb_array* out);
int mlxb_put_along_axis(mlxb_array a, mlxb_array indices, mlxb_array values, int axis, mlxb_array* out);
int mlxb_zeros(const int32_t* shape, int ndim, int dtype, mlxb_array* out);
int mlxb_full(const int32_t* shape, int ndim, double value, int dtype, mlxb_array* out);
int mlxb_arange(double start, double stop, double step, int dtype, mlxb_array* out);
int mlxb_where(mlxb_array cond, mlxb_array a, mlxb_array b, mlxb_array* out);

// ---- elementwise and reductions ----------------------------------------------
enum {
  MLXB_NEG = 0, MLXB_EXP, MLXB_LOG, MLXB_SIGMOID, MLXB_ABS, MLXB_SQRT, MLXB_RSQRT, MLXB_SQUARE,
  MLXB_LOGICAL_NOT, MLXB_SILU, MLXB_STOP_GRADIENT, MLXB_FLOOR, MLXB_ERF, MLXB_TANH,
};
int mlxb_unary(int op, mlxb_array a, mlxb_array* out);

enum {
  MLXB_ADD = 0, MLXB_SUB, MLXB_MUL, MLXB_DIV, MLXB_MAXIMUM, MLXB_MINIMUM, MLXB_POWER, MLXB_EQ, MLXB_NE,
  MLXB_LT, MLXB_LE, MLXB_GT, MLXB_GE, MLXB_LOGICAL_AND, MLXB_LOGICAL_OR, MLXB_FLOOR_DIVIDE, MLXB_REMAINDER,
};
int mlxb_binary(int op, mlxb_array a, mlxb_array b, mlxb_array* out);

enum { MLXB_SUM = 0, MLXB_MEAN, MLXB_MAX, MLXB_MIN, MLXB_PROD, MLXB_LOGSUMEXP };
int mlxb_reduce(int op, mlxb_array a, const int32_t* axes, int n, int keepdims, mlxb_array* out);
int mlxb_argmax(mlxb_array a, int axis, int keepdims, mlxb_array* out);
int mlxb_argmin(mlxb_array a, int axis, int keepdims, mlxb_array* out);
int mlxb_softmax(mlxb_array a, int axis, int precise, mlxb_array* out);
int mlxb_argpartition(mlxb_array a, int kth, int axis, mlxb_array* out);
int mlxb_topk(mlxb_array a, int k, int axis, mlxb_array* out);
int mlxb_sort(mlxb_array a, int axis, mlxb_array* out);
int mlxb_argsort(mlxb_array a, int axis, mlxb_array* out);
int mlxb_cumsum(mlxb_array a, int axis, int reverse, int inclusive, mlxb_array* out);
int mlxb_clip(mlxb_array a, double lo, double hi, mlxb_array* out);

// ---- linear algebra and quantization -------------------------------------------
int mlxb_matmul(mlxb_array a, mlxb_array b, mlxb_array* out);
int mlxb_addmm(mlxb_array c, mlxb_array a, mlxb_array b, float alpha, float beta, mlxb_array* out);
// outs receives weight, scales and (affine only) biases; *n_out says how many.
int mlxb_quantize(mlxb_array w, int group_size, int bits, const char* mode, mlxb_array* outs, int* n_out);
int mlxb_dequantize(mlxb_array w, mlxb_array scales, mlxb_array biases /*nullable*/, int group_size, int bits,
                    const char* mode, int dtype /*-1: default*/, mlxb_array* out);
int mlxb_quantized_matmul(mlxb_array x, mlxb_array w, mlxb_array scales, mlxb_array biases /*nullable*/,
                          int transpose, int group_size, int bits, const char* mode, mlxb_array* out);
int mlxb_gather_mm(mlxb_array a, mlxb_array b, mlxb_array lhs_idx /*nullable*/, mlxb_array rhs_idx /*nullable*/,
                   int sorted, mlxb_array* out);
int mlxb_gather_qmm(mlxb_array x, mlxb_array w, mlxb_array scales, mlxb_array biases /*nullable*/,
                    mlxb_array lhs_idx /*nullable*/, mlxb_array rhs_idx /*nullable*/, int transpose, int group_size,
                    int bits, const char* mode, int sorted, mlxb_array* out);

// ---- neural-network kernels ---------------------------------------------------
int mlxb_rms_norm(mlxb_array x, mlxb_array weight /*nullable*/, float eps, mlxb_array* out);
int mlxb_rope(mlxb_array x, int dims, int traditional, float base, float scale, int offset, mlxb_array* out);
int mlxb_rope_dyn(mlxb_array x, int dims, int traditional, float base, float scale, mlxb_array offset,
                  mlxb_array* out);
int mlxb_sdpa(mlxb_array q, mlxb_array k, mlxb_array v, float scale, const char* mask_mode,
              mlxb_array mask /*nullable*/, mlxb_array* out);
int mlxb_conv1d(mlxb_array x, mlxb_array w, int stride, int padding, int dilation, int groups, mlxb_array* out);

// ---- random --------------------------------------------------------------------
int mlxb_random_key(uint64_t seed, mlxb_array* out);
int mlxb_random_split(mlxb_array key, mlxb_array* out_a, mlxb_array* out_b);
int mlxb_random_categorical(mlxb_array logits, int axis, mlxb_array key /*nullable*/, mlxb_array* out);
int mlxb_random_uniform(const int32_t* shape, int ndim, int dtype, mlxb_array key /*nullable*/, mlxb_array* out);
int mlxb_random_normal(const int32_t* shape, int ndim, int dtype, float loc, float scale, mlxb_array key /*nullable*/,
                       mlxb_array* out);

// ---- distributed (mlx::core::distributed) ------------------------------------------
// A process group; collectives over it are ordinary lazy ops.
typedef struct mlxb_group_s* mlxb_group;
// 1 when MLX was built with `backend` ("ring", "nccl", "jaccl", "mpi", "any").
int mlxb_dist_is_available(const char* backend);
// Joins the group the backend's environment describes (for ring: MLX_HOSTFILE
// and MLX_RANK). strict: fail rather than fall back to a group of one.
int mlxb_dist_init(const char* backend, int strict, mlxb_group* out);
void mlxb_group_free(mlxb_group g);
int mlxb_group_rank(mlxb_group g);
int mlxb_group_size(mlxb_group g);
int mlxb_all_sum(mlxb_array x, mlxb_group g, mlxb_array* out);
int mlxb_all_max(mlxb_array x, mlxb_group g, mlxb_array* out);
int mlxb_all_gather(mlxb_array x, mlxb_group g, mlxb_array* out);
int mlxb_dist_send(mlxb_array x, int dst, mlxb_group g, mlxb_array* out);
int mlxb_dist_recv(const int32_t* shape, int ndim, int dtype, int src, mlxb_group g, mlxb_array* out);

// ---- compile ---------------------------------------------------------------------
// A list of arrays the bridge owns (a compiled function's outputs).
typedef struct mlxb_arrays_s* mlxb_arrays;
int mlxb_arrays_push(mlxb_arrays v, mlxb_array a);  // appends a reference; the caller keeps `a`
size_t mlxb_arrays_len(mlxb_arrays v);
mlxb_array mlxb_arrays_take(mlxb_arrays v, size_t i);  // a new handle to item i (NULL past the end)
void mlxb_arrays_free(mlxb_arrays v);

// The callback traces the function: it receives `n_in` input handles
// (borrowed) and appends its outputs to `outs` with mlxb_arrays_push (as many
// as it has). A non-zero return is an error whose text the callback wrote
// through mlxb_set_error.
typedef int (*mlxb_trace_cb)(void* ctx, const mlxb_array* ins, size_t n_in, mlxb_arrays outs);
// Each compiled function has a compile id of its own; MLX keeps one trace per
// input shape signature under it until mlxb_fn_clear or mlxb_fn_free.
int mlxb_compile(mlxb_trace_cb cb, void* ctx, int shapeless, mlxb_fn* out);
// `*out` is a new list of the outputs (free it with mlxb_arrays_free).
int mlxb_fn_call(mlxb_fn f, const mlxb_array* ins, size_t n_in, mlxb_arrays* out);
// Drops every trace of `f`; the next call traces again.
int mlxb_fn_clear(mlxb_fn f);
void mlxb_fn_free(mlxb_fn f);
void mlxb_set_error(const char* msg);

// ---- custom GPU kernels ------------------------------------------------------------
// MLX's fast::cuda_kernel: `source` is a kernel body over the named inputs and
// outputs, JIT-compiled by MLX at its first use. Only the CUDA backend runs it
// (elsewhere the call fails with MLX's message).
typedef struct mlxb_kernel_s* mlxb_kernel;
int mlxb_cuda_kernel(const char* name, const char* const* input_names, size_t n_in, const char* const* output_names,
                     size_t n_out, const char* source, const char* header, mlxb_kernel* out);
// Outputs: `n_out` shapes concatenated in `out_shapes` (`out_ndims[i]` dims
// each) with dtypes `out_dtypes`; grid and threadgroup as MLX takes them (grid
// in threads). Template arguments: kind 0 int, 1 bool, 2 dtype code. `*outs`
// is a new list (free it with mlxb_arrays_free).
int mlxb_kernel_call(mlxb_kernel k, const mlxb_array* ins, size_t n_in, const int32_t* out_shapes,
                     const int* out_ndims, const int* out_dtypes, size_t n_out, const int32_t* grid,
                     const int32_t* threadgroup, const char* const* targ_names, const int* targ_kinds,
                     const int* targ_values, size_t n_targ, mlxb_arrays* outs);
void mlxb_kernel_free(mlxb_kernel k);

// ---- memory, devices and streams -------------------------------------------------
size_t mlxb_get_active_memory(void);
size_t mlxb_get_peak_memory(void);
size_t mlxb_get_cache_memory(void);
void mlxb_reset_peak_memory(void);
size_t mlxb_get_memory_limit(void);
int mlxb_set_memory_limit(size_t limit, size_t* previous);
int mlxb_set_cache_limit(size_t limit, size_t* previous);
int mlxb_set_wired_limit(size_t limit, size_t* previous);
void mlxb_clear_cache(void);

// Device type codes: 0 = cpu, 1 = gpu.
int mlxb_default_device(void);
int mlxb_gpu_available(void);
int mlxb_set_default_device(int device_type);
// Gives the calling thread a stream of its own on the default device, so that
// a model's worker thread never shares MLX's default stream with another.
int mlxb_use_new_stream(void);
int mlxb_synchronize(void);
// Writes the device's name into buf (NUL-terminated, truncated to len).
int mlxb_device_name(char* buf, size_t len);
size_t mlxb_device_total_memory(void);


#ifdef __cplusplus
}
#endif
