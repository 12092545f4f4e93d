// Implementation of the C ABI declared in mlxb.h.
//
// Every entry point that runs MLX code goes through MLXB_TRY so that C++
// exceptions become an error code plus a thread-local message, never an
// unwinding across the FFI boundary (which would abort the Node process).
#include "mlxb.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "mlx/compile_impl.h"
#include "mlx/primitives.h"
#include "mlx/mlx.h"
#include "mlxb_internal.h"

namespace mx = mlx::core;

struct mlxb_fn_s {
  std::function<std::vector<mx::array>(const std::vector<mx::array>&)> f;
  std::uintptr_t id = 0;
};

struct mlxb_arrays_s {
  std::vector<mx::array> v;
};

namespace {

thread_local std::string g_last_error;

}  // namespace

namespace mlxb {

void set_error(const char* msg) { g_last_error = msg ? msg : "unknown error"; }

mx::Dtype to_dtype(int code) {
  switch (code) {
    case MLXB_BOOL: return mx::bool_;
    case MLXB_UINT8: return mx::uint8;
    case MLXB_UINT16: return mx::uint16;
    case MLXB_UINT32: return mx::uint32;
    case MLXB_UINT64: return mx::uint64;
    case MLXB_INT8: return mx::int8;
    case MLXB_INT16: return mx::int16;
    case MLXB_INT32: return mx::int32;
    case MLXB_INT64: return mx::int64;
    case MLXB_FLOAT16: return mx::float16;
    case MLXB_FLOAT32: return mx::float32;
    case MLXB_FLOAT64: return mx::float64;
    case MLXB_BFLOAT16: return mx::bfloat16;
    case MLXB_COMPLEX64: return mx::complex64;
  }
  throw std::invalid_argument("mlx-lfm bridge: unknown dtype code " + std::to_string(code));
}

int from_dtype(mx::Dtype d) {
  switch (d.val()) {
    case mx::Dtype::Val::bool_: return MLXB_BOOL;
    case mx::Dtype::Val::uint8: return MLXB_UINT8;
    case mx::Dtype::Val::uint16: return MLXB_UINT16;
    case mx::Dtype::Val::uint32: return MLXB_UINT32;
    case mx::Dtype::Val::uint64: return MLXB_UINT64;
    case mx::Dtype::Val::int8: return MLXB_INT8;
    case mx::Dtype::Val::int16: return MLXB_INT16;
    case mx::Dtype::Val::int32: return MLXB_INT32;
    case mx::Dtype::Val::int64: return MLXB_INT64;
    case mx::Dtype::Val::float16: return MLXB_FLOAT16;
    case mx::Dtype::Val::float32: return MLXB_FLOAT32;
    case mx::Dtype::Val::float64: return MLXB_FLOAT64;
    case mx::Dtype::Val::bfloat16: return MLXB_BFLOAT16;
    case mx::Dtype::Val::complex64: return MLXB_COMPLEX64;
  }
  return -1;
}

}  // namespace mlxb

using mlxb::A;
using mlxb::wrap;

namespace {

mx::Shape shape_of(const int32_t* s, int n) { return mx::Shape(s, s + n); }

std::optional<mx::array> opt(mlxb_array a) {
  if (a == nullptr) return std::nullopt;
  return A(a);
}

std::vector<mx::array> vec_of(const mlxb_array* arrs, size_t n) {
  std::vector<mx::array> v;
  v.reserve(n);
  for (size_t i = 0; i < n; ++i) v.push_back(A(arrs[i]));
  return v;
}

std::optional<int> opt_int(int v) { return v > 0 ? std::optional<int>(v) : std::nullopt; }

template <typename T>
mx::array typed_from(const void* data, mx::Shape shape, mx::Dtype dt) {
  return mx::array(static_cast<const T*>(data), std::move(shape), dt);
}

}  // namespace

extern "C" {

const char* mlxb_last_error(void) { return g_last_error.c_str(); }
const char* mlxb_version(void) { return mx::version(); }
void mlxb_set_error(const char* msg) { mlxb::set_error(msg); }

// ---- array lifecycle ------------------------------------------------------------
void mlxb_array_free(mlxb_array a) { delete a; }
mlxb_array mlxb_array_clone(mlxb_array a) { return wrap(A(a)); }
int mlxb_array_ndim(mlxb_array a) { return static_cast<int>(A(a).ndim()); }
void mlxb_array_shape(mlxb_array a, int32_t* out) {
  const auto& s = A(a).shape();
  for (size_t i = 0; i < s.size(); ++i) out[i] = s[i];
}
int mlxb_array_dtype(mlxb_array a) { return mlxb::from_dtype(A(a).dtype()); }
size_t mlxb_array_size(mlxb_array a) { return A(a).size(); }
size_t mlxb_array_nbytes(mlxb_array a) { return A(a).nbytes(); }

int mlxb_array_from_data(const void* data, const int32_t* shape, int ndim, int dtype, mlxb_array* out) {
  MLXB_TRY({
    auto dt = mlxb::to_dtype(dtype);
    auto sh = shape_of(shape, ndim);
    switch (dt.val()) {
      case mx::Dtype::Val::bool_: *out = wrap(typed_from<bool>(data, sh, dt)); break;
      case mx::Dtype::Val::uint8: *out = wrap(typed_from<uint8_t>(data, sh, dt)); break;
      case mx::Dtype::Val::uint16: *out = wrap(typed_from<uint16_t>(data, sh, dt)); break;
      case mx::Dtype::Val::uint32: *out = wrap(typed_from<uint32_t>(data, sh, dt)); break;
      case mx::Dtype::Val::uint64: *out = wrap(typed_from<uint64_t>(data, sh, dt)); break;
      case mx::Dtype::Val::int8: *out = wrap(typed_from<int8_t>(data, sh, dt)); break;
      case mx::Dtype::Val::int16: *out = wrap(typed_from<int16_t>(data, sh, dt)); break;
      case mx::Dtype::Val::int32: *out = wrap(typed_from<int32_t>(data, sh, dt)); break;
      case mx::Dtype::Val::int64: *out = wrap(typed_from<int64_t>(data, sh, dt)); break;
      case mx::Dtype::Val::float16: *out = wrap(typed_from<mx::float16_t>(data, sh, dt)); break;
      case mx::Dtype::Val::float32: *out = wrap(typed_from<float>(data, sh, dt)); break;
      case mx::Dtype::Val::float64: *out = wrap(typed_from<double>(data, sh, dt)); break;
      case mx::Dtype::Val::bfloat16: *out = wrap(typed_from<mx::bfloat16_t>(data, sh, dt)); break;
      case mx::Dtype::Val::complex64: *out = wrap(typed_from<mx::complex64_t>(data, sh, dt)); break;
    }
  })
}

int mlxb_array_scalar(double value, int dtype, mlxb_array* out) {
  // Converted on the host at construction: no graph node, so scalars made here
  // and inside compiled functions are the same constants.
  MLXB_TRY({ *out = wrap(mx::array(value, mlxb::to_dtype(dtype))); })
}

int mlxb_array_to_host(mlxb_array a, void* dst, size_t len) {
  MLXB_TRY({
    // Evaluate (or wait for an async_eval of) the array itself first: adding a
    // `contiguous` node before that would queue it behind whatever was
    // scheduled since (the next decode step) and serialize host and device.
    mx::array c = A(a);
    c.eval();
    if (!c.flags().row_contiguous || c.data_size() != c.size()) {
      c = mx::contiguous(c);
      c.eval();
    }
    if (c.nbytes() != len) {
      throw std::invalid_argument("to_host: destination holds " + std::to_string(len) + " bytes but the array has " +
                                  std::to_string(c.nbytes()));
    }
    if (len > 0) std::memcpy(dst, c.data<uint8_t>(), len);
  })
}

int mlxb_eval(const mlxb_array* arrs, size_t n) { MLXB_TRY({ mx::eval(vec_of(arrs, n)); }) }
int mlxb_async_eval(const mlxb_array* arrs, size_t n) { MLXB_TRY({ mx::async_eval(vec_of(arrs, n)); }) }

int mlxb_graph_ops(const mlxb_array* arrs, size_t n, char* buf, size_t len, size_t* needed) {
  MLXB_TRY({
    // Iterative DFS (a step's graph is thousands of nodes deep in places).
    // A node is its primitive applied to its inputs: the outputs of one
    // node share both (counted once), while each call of a compiled
    // function in a graph replays the traced primitive over other inputs
    // (each its own node, though the primitive is shared).
    std::unordered_set<std::uintptr_t> seen_arrays;
    std::set<std::vector<std::uintptr_t>> seen_nodes;
    std::map<std::string, size_t> counts;
    std::vector<mx::array> stack = vec_of(arrs, n);
    while (!stack.empty()) {
      mx::array a = std::move(stack.back());
      stack.pop_back();
      if (!seen_arrays.insert(a.id()).second) continue;
      if (!a.has_primitive() || a.status() != mx::array::Status::unscheduled) continue;
      std::vector<std::uintptr_t> node{a.primitive_id()};
      for (const auto& in : a.inputs()) node.push_back(in.id());
      if (seen_nodes.insert(std::move(node)).second) {
        counts[a.primitive().name()]++;
        // MLXB_GRAPH_DUMP=1: each node on stderr (primitive, output shape,
        // inputs' shapes and producers), to find where a step's views and
        // launches come from on a backend only reachable by a batch job.
        if (len > 0 && std::getenv("MLXB_GRAPH_DUMP")) {  // (the sizing call prints nothing)
          std::string line = std::string(a.primitive().name()) + " out[";
          for (auto d : a.shape()) line += std::to_string(d) + ",";
          line += "] in";
          for (const auto& in : a.inputs()) {
            line += " [";
            for (auto d : in.shape()) line += std::to_string(d) + ",";
            line += in.has_primitive() && in.status() == mx::array::Status::unscheduled ? std::string("]<") + in.primitive().name() : "]";
          }
          fprintf(stderr, "NODE %s\n", line.c_str());
        }
      }
      for (const auto& in : a.inputs()) stack.push_back(in);
    }
    std::vector<std::pair<std::string, size_t>> v(counts.begin(), counts.end());
    std::stable_sort(v.begin(), v.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
    std::string text;
    for (const auto& [name, c] : v) text += name + " " + std::to_string(c) + "\n";
    *needed = text.size() + 1;
    if (len > 0) {
      size_t m = std::min(len - 1, text.size());
      std::memcpy(buf, text.data(), m);
      buf[m] = 0;
    }
  })
}

// ---- files ------------------------------------------------------------------------
int mlxb_load_safetensors(const char* path, void* ctx, mlxb_named_array_cb on_array, mlxb_kv_cb on_meta) {
  MLXB_TRY({
    auto loaded = mx::load_safetensors(std::string(path));
    for (auto& [name, arr] : loaded.first) on_array(ctx, name.c_str(), wrap(arr));
    if (on_meta) {
      for (auto& [k, v] : loaded.second) on_meta(ctx, k.c_str(), v.c_str());
    }
  })
}

int mlxb_save_safetensors(const char* path, const char* const* names, const mlxb_array* arrs, size_t n,
                          const char* const* meta_keys, const char* const* meta_vals, size_t n_meta) {
  MLXB_TRY({
    std::unordered_map<std::string, mx::array> m;
    for (size_t i = 0; i < n; ++i) m.insert({names[i], A(arrs[i])});
    std::unordered_map<std::string, std::string> meta;
    for (size_t i = 0; i < n_meta; ++i) meta[meta_keys[i]] = meta_vals[i];
    mx::save_safetensors(std::string(path), m, meta);
  })
}

// ---- shape and indexing -------------------------------------------------------------
int mlxb_astype(mlxb_array a, int dtype, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::astype(A(a), mlxb::to_dtype(dtype))); })
}
int mlxb_view(mlxb_array a, int dtype, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::view(A(a), mlxb::to_dtype(dtype))); })
}
int mlxb_reshape(mlxb_array a, const int32_t* shape, int ndim, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::reshape(A(a), shape_of(shape, ndim))); })
}
int mlxb_transpose(mlxb_array a, const int32_t* axes, int n, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::transpose(A(a), std::vector<int>(axes, axes + n))); })
}
int mlxb_expand_dims(mlxb_array a, int axis, mlxb_array* out) { MLXB_TRY({ *out = wrap(mx::expand_dims(A(a), axis)); }) }
int mlxb_squeeze(mlxb_array a, int axis, mlxb_array* out) { MLXB_TRY({ *out = wrap(mx::squeeze(A(a), axis)); }) }
int mlxb_broadcast_to(mlxb_array a, const int32_t* shape, int ndim, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::broadcast_to(A(a), shape_of(shape, ndim))); })
}
int mlxb_contiguous(mlxb_array a, mlxb_array* out) { MLXB_TRY({ *out = wrap(mx::contiguous(A(a))); }) }
int mlxb_slice(mlxb_array a, const int32_t* start, const int32_t* stop, const int32_t* strides, int n,
               mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::slice(A(a), shape_of(start, n), shape_of(stop, n), shape_of(strides, n))); })
}
int mlxb_slice_update(mlxb_array src, mlxb_array update, const int32_t* start, const int32_t* stop, int n,
                      mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::slice_update(A(src), A(update), shape_of(start, n), shape_of(stop, n))); })
}
int mlxb_slice_update_dyn(mlxb_array src, mlxb_array update, mlxb_array start, const int32_t* axes, int n,
                          mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::slice_update(A(src), A(update), A(start), std::vector<int>(axes, axes + n))); })
}
int mlxb_scatter(mlxb_array a, const mlxb_array* indices, const int32_t* axes, int n, mlxb_array updates,
                 mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::scatter(A(a), vec_of(indices, n), A(updates), std::vector<int>(axes, axes + n))); })
}
int mlxb_concatenate(const mlxb_array* arrs, size_t n, int axis, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::concatenate(vec_of(arrs, n), axis)); })
}
int mlxb_stack(const mlxb_array* arrs, size_t n, int axis, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::stack(vec_of(arrs, n), axis)); })
}
// `inputs` as new arrays (the same buffers, no copy) evaluated only after
// `deps`: an order MLX's graph does not otherwise see, e.g. a buffer a
// kernel wrote in place while producing another output.
int mlxb_depends(const mlxb_array* inputs, size_t n, const mlxb_array* deps, size_t m, mlxb_array* outs) {
  MLXB_TRY({
    auto v = mx::depends(vec_of(inputs, n), vec_of(deps, m));
    for (size_t i = 0; i < v.size() && i < n; ++i) outs[i] = wrap(v[i]);
  })
}
int mlxb_split_equal(mlxb_array a, int parts, int axis, mlxb_array* outs) {
  MLXB_TRY({
    auto v = mx::split(A(a), parts, axis);
    for (size_t i = 0; i < v.size(); ++i) outs[i] = wrap(v[i]);
  })
}
int mlxb_split_at(mlxb_array a, const int* indices, int n, int axis, mlxb_array* outs) {
  MLXB_TRY({
    auto v = mx::split(A(a), mx::Shape(indices, indices + n), axis);
    for (size_t i = 0; i < v.size(); ++i) outs[i] = wrap(v[i]);
  })
}
int mlxb_take(mlxb_array a, mlxb_array indices, int axis, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::take(A(a), A(indices), axis)); })
}
int mlxb_take_along_axis(mlxb_array a, mlxb_array indices, int axis, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::take_along_axis(A(a), A(indices), axis)); })
}
int mlxb_put_along_axis(mlxb_array a, mlxb_array indices, mlxb_array values, int axis, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::put_along_axis(A(a), A(indices), A(values), axis)); })
}
int mlxb_zeros(const int32_t* shape, int ndim, int dtype, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::zeros(shape_of(shape, ndim), mlxb::to_dtype(dtype))); })
}
int mlxb_full(const int32_t* shape, int ndim, double value, int dtype, mlxb_array* out) {
  MLXB_TRY({
    auto dt = mlxb::to_dtype(dtype);
    *out = wrap(mx::full(shape_of(shape, ndim), mx::array(value, dt), dt));
  })
}
int mlxb_arange(double start, double stop, double step, int dtype, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::arange(start, stop, step, mlxb::to_dtype(dtype))); })
}
int mlxb_where(mlxb_array cond, mlxb_array a, mlxb_array b, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::where(A(cond), A(a), A(b))); })
}

// ---- elementwise and reductions ---------------------------------------------------------
int mlxb_unary(int op, mlxb_array a_, mlxb_array* out) {
  MLXB_TRY({
    const auto& a = A(a_);
    switch (op) {
      case MLXB_NEG: *out = wrap(mx::negative(a)); break;
      case MLXB_EXP: *out = wrap(mx::exp(a)); break;
      case MLXB_LOG: *out = wrap(mx::log(a)); break;
      case MLXB_SIGMOID: *out = wrap(mx::sigmoid(a)); break;
      case MLXB_ABS: *out = wrap(mx::abs(a)); break;
      case MLXB_SQRT: *out = wrap(mx::sqrt(a)); break;
      case MLXB_RSQRT: *out = wrap(mx::rsqrt(a)); break;
      case MLXB_SQUARE: *out = wrap(mx::square(a)); break;
      case MLXB_LOGICAL_NOT: *out = wrap(mx::logical_not(a)); break;
      case MLXB_SILU: *out = wrap(mx::multiply(a, mx::sigmoid(a))); break;
      case MLXB_STOP_GRADIENT: *out = wrap(mx::stop_gradient(a)); break;
      case MLXB_FLOOR: *out = wrap(mx::floor(a)); break;
      case MLXB_ERF: *out = wrap(mx::erf(a)); break;
      case MLXB_TANH: *out = wrap(mx::tanh(a)); break;
      default: throw std::invalid_argument("mlx-lfm bridge: unknown unary op " + std::to_string(op));
    }
  })
}

int mlxb_binary(int op, mlxb_array a_, mlxb_array b_, mlxb_array* out) {
  MLXB_TRY({
    const auto& a = A(a_);
    const auto& b = A(b_);
    switch (op) {
      case MLXB_ADD: *out = wrap(mx::add(a, b)); break;
      case MLXB_SUB: *out = wrap(mx::subtract(a, b)); break;
      case MLXB_MUL: *out = wrap(mx::multiply(a, b)); break;
      case MLXB_DIV: *out = wrap(mx::divide(a, b)); break;
      case MLXB_MAXIMUM: *out = wrap(mx::maximum(a, b)); break;
      case MLXB_MINIMUM: *out = wrap(mx::minimum(a, b)); break;
      case MLXB_POWER: *out = wrap(mx::power(a, b)); break;
      case MLXB_EQ: *out = wrap(mx::equal(a, b)); break;
      case MLXB_NE: *out = wrap(mx::not_equal(a, b)); break;
      case MLXB_LT: *out = wrap(mx::less(a, b)); break;
      case MLXB_LE: *out = wrap(mx::less_equal(a, b)); break;
      case MLXB_GT: *out = wrap(mx::greater(a, b)); break;
      case MLXB_GE: *out = wrap(mx::greater_equal(a, b)); break;
      case MLXB_LOGICAL_AND: *out = wrap(mx::logical_and(a, b)); break;
      case MLXB_LOGICAL_OR: *out = wrap(mx::logical_or(a, b)); break;
      case MLXB_FLOOR_DIVIDE: *out = wrap(mx::floor_divide(a, b)); break;
      case MLXB_REMAINDER: *out = wrap(mx::remainder(a, b)); break;
      default: throw std::invalid_argument("mlx-lfm bridge: unknown binary op " + std::to_string(op));
    }
  })
}

int mlxb_reduce(int op, mlxb_array a_, const int32_t* axes_, int n, int keepdims, mlxb_array* out) {
  MLXB_TRY({
    const auto& a = A(a_);
    std::vector<int> axes(axes_, axes_ + n);
    if (n == 0) {
      for (int i = 0; i < static_cast<int>(a.ndim()); ++i) axes.push_back(i);
    }
    bool kd = keepdims != 0;
    switch (op) {
      case MLXB_SUM: *out = wrap(mx::sum(a, axes, kd)); break;
      case MLXB_MEAN: *out = wrap(mx::mean(a, axes, kd)); break;
      case MLXB_MAX: *out = wrap(mx::max(a, axes, kd)); break;
      case MLXB_MIN: *out = wrap(mx::min(a, axes, kd)); break;
      case MLXB_PROD: *out = wrap(mx::prod(a, axes, kd)); break;
      case MLXB_LOGSUMEXP: *out = wrap(mx::logsumexp(a, axes, kd)); break;
      default: throw std::invalid_argument("mlx-lfm bridge: unknown reduction " + std::to_string(op));
    }
  })
}
int mlxb_argmax(mlxb_array a, int axis, int keepdims, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::argmax(A(a), axis, keepdims != 0)); })
}
int mlxb_argmin(mlxb_array a, int axis, int keepdims, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::argmin(A(a), axis, keepdims != 0)); })
}
int mlxb_softmax(mlxb_array a, int axis, int precise, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::softmax(A(a), axis, precise != 0)); })
}
int mlxb_argpartition(mlxb_array a, int kth, int axis, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::argpartition(A(a), kth, axis)); })
}
int mlxb_topk(mlxb_array a, int k, int axis, mlxb_array* out) { MLXB_TRY({ *out = wrap(mx::topk(A(a), k, axis)); }) }
int mlxb_sort(mlxb_array a, int axis, mlxb_array* out) { MLXB_TRY({ *out = wrap(mx::sort(A(a), axis)); }) }
int mlxb_argsort(mlxb_array a, int axis, mlxb_array* out) { MLXB_TRY({ *out = wrap(mx::argsort(A(a), axis)); }) }
int mlxb_cumsum(mlxb_array a, int axis, int reverse, int inclusive, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::cumsum(A(a), axis, reverse != 0, inclusive != 0)); })
}
int mlxb_clip(mlxb_array a, double lo, double hi, mlxb_array* out) {
  MLXB_TRY({
    auto dt = A(a).dtype();
    *out = wrap(mx::clip(A(a), mx::array(lo, dt), mx::array(hi, dt)));
  })
}

// ---- linear algebra and quantization ------------------------------------------------------
int mlxb_matmul(mlxb_array a, mlxb_array b, mlxb_array* out) { MLXB_TRY({ *out = wrap(mx::matmul(A(a), A(b))); }) }
int mlxb_addmm(mlxb_array c, mlxb_array a, mlxb_array b, float alpha, float beta, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::addmm(A(c), A(a), A(b), alpha, beta)); })
}
int mlxb_quantize(mlxb_array w, int group_size, int bits, const char* mode, mlxb_array* outs, int* n_out) {
  MLXB_TRY({
    auto v = mx::quantize(A(w), opt_int(group_size), opt_int(bits), std::string(mode));
    for (size_t i = 0; i < v.size(); ++i) outs[i] = wrap(v[i]);
    *n_out = static_cast<int>(v.size());
  })
}
int mlxb_dequantize(mlxb_array w, mlxb_array scales, mlxb_array biases, int group_size, int bits, const char* mode,
                    int dtype, mlxb_array* out) {
  MLXB_TRY({
    std::optional<mx::Dtype> dt = dtype >= 0 ? std::optional<mx::Dtype>(mlxb::to_dtype(dtype)) : std::nullopt;
    *out = wrap(mx::dequantize(A(w), A(scales), opt(biases), opt_int(group_size), opt_int(bits), std::string(mode),
                               std::nullopt, dt));
  })
}
int mlxb_quantized_matmul(mlxb_array x, mlxb_array w, mlxb_array scales, mlxb_array biases, int transpose,
                          int group_size, int bits, const char* mode, mlxb_array* out) {
  MLXB_TRY({
    *out = wrap(mx::quantized_matmul(A(x), A(w), A(scales), opt(biases), transpose != 0, opt_int(group_size),
                                     opt_int(bits), std::string(mode)));
  })
}
int mlxb_gather_mm(mlxb_array a, mlxb_array b, mlxb_array lhs_idx, mlxb_array rhs_idx, int sorted, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::gather_mm(A(a), A(b), opt(lhs_idx), opt(rhs_idx), sorted != 0)); })
}
int mlxb_gather_qmm(mlxb_array x, mlxb_array w, mlxb_array scales, mlxb_array biases, mlxb_array lhs_idx,
                    mlxb_array rhs_idx, int transpose, int group_size, int bits, const char* mode, int sorted,
                    mlxb_array* out) {
  MLXB_TRY({
    *out = wrap(mx::gather_qmm(A(x), A(w), A(scales), opt(biases), opt(lhs_idx), opt(rhs_idx), transpose != 0,
                               opt_int(group_size), opt_int(bits), std::string(mode), std::nullopt, sorted != 0));
  })
}

// ---- neural-network kernels ----------------------------------------------------------------
int mlxb_rms_norm(mlxb_array x, mlxb_array weight, float eps, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::fast::rms_norm(A(x), opt(weight), eps)); })
}
int mlxb_rope(mlxb_array x, int dims, int traditional, float base, float scale, int offset, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::fast::rope(A(x), dims, traditional != 0, base, scale, offset)); })
}
int mlxb_rope_dyn(mlxb_array x, int dims, int traditional, float base, float scale, mlxb_array offset,
                  mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::fast::rope(A(x), dims, traditional != 0, base, scale, A(offset))); })
}
int mlxb_sdpa(mlxb_array q, mlxb_array k, mlxb_array v, float scale, const char* mask_mode, mlxb_array mask,
              mlxb_array* out) {
  MLXB_TRY({
    *out = wrap(mx::fast::scaled_dot_product_attention(A(q), A(k), A(v), scale, std::string(mask_mode ? mask_mode : ""),
                                                       opt(mask)));
  })
}
int mlxb_conv1d(mlxb_array x, mlxb_array w, int stride, int padding, int dilation, int groups, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::conv1d(A(x), A(w), stride, padding, dilation, groups)); })
}

// ---- distributed -------------------------------------------------------------------------
struct mlxb_group_s {
  mx::distributed::Group g;
};

int mlxb_dist_is_available(const char* backend) {
  try {
    return mx::distributed::is_available(backend) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}
int mlxb_dist_init(const char* backend, int strict, mlxb_group* out) {
  MLXB_TRY({ *out = new mlxb_group_s{mx::distributed::init(strict != 0, backend)}; })
}
void mlxb_group_free(mlxb_group g) { delete g; }
int mlxb_group_rank(mlxb_group g) { return g->g.rank(); }
int mlxb_group_size(mlxb_group g) { return g->g.size(); }
int mlxb_all_sum(mlxb_array x, mlxb_group g, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::distributed::all_sum(A(x), g->g)); })
}
int mlxb_all_max(mlxb_array x, mlxb_group g, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::distributed::all_max(A(x), g->g)); })
}
int mlxb_all_gather(mlxb_array x, mlxb_group g, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::distributed::all_gather(A(x), g->g)); })
}
int mlxb_dist_send(mlxb_array x, int dst, mlxb_group g, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::distributed::send(A(x), dst, g->g)); })
}
int mlxb_dist_recv(const int32_t* shape, int ndim, int dtype, int src, mlxb_group g, mlxb_array* out) {
  MLXB_TRY({
    mx::Shape s(shape, shape + ndim);
    *out = wrap(mx::distributed::recv(s, mlxb::to_dtype(dtype), src, g->g));
  })
}

// ---- random ----------------------------------------------------------------------------------
int mlxb_random_key(uint64_t seed, mlxb_array* out) { MLXB_TRY({ *out = wrap(mx::random::key(seed)); }) }
int mlxb_random_split(mlxb_array key, mlxb_array* out_a, mlxb_array* out_b) {
  MLXB_TRY({
    auto [a, b] = mx::random::split(A(key));
    *out_a = wrap(a);
    *out_b = wrap(b);
  })
}
int mlxb_random_categorical(mlxb_array logits, int axis, mlxb_array key, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::random::categorical(A(logits), axis, opt(key))); })
}
int mlxb_random_uniform(const int32_t* shape, int ndim, int dtype, mlxb_array key, mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::random::uniform(shape_of(shape, ndim), mlxb::to_dtype(dtype), opt(key))); })
}
int mlxb_random_normal(const int32_t* shape, int ndim, int dtype, float loc, float scale, mlxb_array key,
                       mlxb_array* out) {
  MLXB_TRY({ *out = wrap(mx::random::normal(shape_of(shape, ndim), mlxb::to_dtype(dtype), loc, scale, opt(key))); })
}

// ---- compile -----------------------------------------------------------------------------------
int mlxb_arrays_push(mlxb_arrays v, mlxb_array a) { MLXB_TRY({ v->v.push_back(A(a)); }) }
size_t mlxb_arrays_len(mlxb_arrays v) { return v->v.size(); }
mlxb_array mlxb_arrays_take(mlxb_arrays v, size_t i) { return i < v->v.size() ? wrap(v->v[i]) : nullptr; }
void mlxb_arrays_free(mlxb_arrays v) { delete v; }

int mlxb_compile(mlxb_trace_cb cb, void* ctx, int shapeless, mlxb_fn* out) {
  MLXB_TRY({
    auto traced = [cb, ctx](const std::vector<mx::array>& ins) -> std::vector<mx::array> {
      std::vector<mlxb_array> handles;
      handles.reserve(ins.size());
      for (const auto& a : ins) handles.push_back(wrap(a));
      mlxb_arrays_s outs;
      int rc = cb(ctx, handles.data(), handles.size(), &outs);
      for (auto h : handles) delete h;
      if (rc != 0) throw std::runtime_error(g_last_error);
      return std::move(outs.v);
    };
    auto* f = new mlxb_fn_s();
    // The function's own address is its compile id: unique while it lives,
    // and erased (every trace dropped) when it is freed, so two models, or
    // a model loaded again at the same place, never share traces.
    f->id = reinterpret_cast<std::uintptr_t>(f);
    try {
      f->f = mx::detail::compile(std::function<std::vector<mx::array>(const std::vector<mx::array>&)>(traced), f->id,
                                 shapeless != 0);
    } catch (...) {
      delete f;
      throw;
    }
    *out = f;
  })
}

int mlxb_fn_call(mlxb_fn f, const mlxb_array* ins, size_t n_in, mlxb_arrays* out) {
  MLXB_TRY({
    auto res = f->f(vec_of(ins, n_in));
    *out = new mlxb_arrays_s{std::move(res)};
  })
}

int mlxb_fn_clear(mlxb_fn f) { MLXB_TRY({ mx::detail::compile_erase(mx::detail::compile_cache(), f->id); }) }

void mlxb_fn_free(mlxb_fn f) {
  if (!f) return;
  try {
    mx::detail::compile_erase(mx::detail::compile_cache(), f->id);
  } catch (...) {
  }
  delete f;
}

// ---- custom GPU kernels ----------------------------------------------------------------
struct mlxb_kernel_s {
  mx::fast::CustomKernelFunction f;
};

int mlxb_cuda_kernel(const char* name, const char* const* input_names, size_t n_in, const char* const* output_names,
                     size_t n_out, const char* source, const char* header, mlxb_kernel* out) {
  MLXB_TRY({
    std::vector<std::string> ins(input_names, input_names + n_in);
    std::vector<std::string> outs(output_names, output_names + n_out);
    auto f = mx::fast::cuda_kernel(name, ins, outs, source, header ? header : "", true, 0);
    *out = new mlxb_kernel_s{std::move(f)};
  })
}

int mlxb_kernel_call(mlxb_kernel k, const mlxb_array* ins, size_t n_in, const int32_t* out_shapes,
                     const int* out_ndims, const int* out_dtypes, size_t n_out, const int32_t* grid,
                     const int32_t* threadgroup, const char* const* targ_names, const int* targ_kinds,
                     const int* targ_values, size_t n_targ, mlxb_arrays* outs) {
  MLXB_TRY({
    std::vector<mx::Shape> shapes;
    std::vector<mx::Dtype> dtypes;
    const int32_t* p = out_shapes;
    for (size_t i = 0; i < n_out; i++) {
      shapes.emplace_back(p, p + out_ndims[i]);
      p += out_ndims[i];
      dtypes.push_back(mlxb::to_dtype(out_dtypes[i]));
    }
    std::vector<std::pair<std::string, mx::fast::TemplateArg>> targs;
    for (size_t i = 0; i < n_targ; i++) {
      switch (targ_kinds[i]) {
        case 0: targs.emplace_back(targ_names[i], targ_values[i]); break;
        case 1: targs.emplace_back(targ_names[i], targ_values[i] != 0); break;
        case 2: targs.emplace_back(targ_names[i], mlxb::to_dtype(targ_values[i])); break;
        default: throw std::invalid_argument("mlx-lfm bridge: unknown template argument kind");
      }
    }
    auto res = k->f(vec_of(ins, n_in), shapes, dtypes, {grid[0], grid[1], grid[2]},
                    {threadgroup[0], threadgroup[1], threadgroup[2]}, targs, std::nullopt, false, {});
    *outs = new mlxb_arrays_s{std::move(res)};
  })
}

void mlxb_kernel_free(mlxb_kernel k) { delete k; }

// ---- memory, devices, streams -----------------------------------------------------------------
size_t mlxb_get_active_memory(void) { return mx::get_active_memory(); }
size_t mlxb_get_peak_memory(void) { return mx::get_peak_memory(); }
size_t mlxb_get_cache_memory(void) { return mx::get_cache_memory(); }
void mlxb_reset_peak_memory(void) { mx::reset_peak_memory(); }
size_t mlxb_get_memory_limit(void) { return mx::get_memory_limit(); }
int mlxb_set_memory_limit(size_t limit, size_t* previous) { MLXB_TRY({ *previous = mx::set_memory_limit(limit); }) }
int mlxb_set_cache_limit(size_t limit, size_t* previous) { MLXB_TRY({ *previous = mx::set_cache_limit(limit); }) }
int mlxb_set_wired_limit(size_t limit, size_t* previous) { MLXB_TRY({ *previous = mx::set_wired_limit(limit); }) }
void mlxb_clear_cache(void) {
  try {
    mx::clear_cache();
  } catch (...) {
  }
}

int mlxb_default_device(void) { return mx::default_device().type == mx::Device::gpu ? 1 : 0; }
int mlxb_gpu_available(void) {
  try {
    return mx::is_available(mx::Device(mx::Device::gpu)) ? 1 : 0;
  } catch (...) {
    return 0;
  }
}
int mlxb_set_default_device(int device_type) {
  MLXB_TRY({ mx::set_default_device(mx::Device(device_type == 1 ? mx::Device::gpu : mx::Device::cpu)); })
}
int mlxb_use_new_stream(void) { MLXB_TRY({ mx::set_default_stream(mx::new_stream(mx::default_device())); }) }
int mlxb_synchronize(void) { MLXB_TRY({ mx::synchronize(); }) }

int mlxb_device_name(char* buf, size_t len) {
  MLXB_TRY({
    const auto& info = mx::device_info(mx::default_device());
    std::string name = "unknown";
    auto it = info.find("device_name");
    if (it != info.end() && std::holds_alternative<std::string>(it->second)) name = std::get<std::string>(it->second);
    if (len > 0) {
      size_t n = std::min(len - 1, name.size());
      std::memcpy(buf, name.data(), n);
      buf[n] = 0;
    }
  })
}

size_t mlxb_device_total_memory(void) {
  try {
    const auto& info = mx::device_info(mx::default_device());
    for (const char* key : {"total_memory", "memory_size"}) {
      auto it = info.find(key);
      if (it != info.end() && std::holds_alternative<size_t>(it->second)) return std::get<size_t>(it->second);
    }
  } catch (...) {
  }
  return 0;
}

}  // extern "C"
