// The bridge's handle layout, dtype mapping and error macro (kept apart from
// mlxb.cpp so a custom-kernel translation unit can share them).
#pragma once

#include "mlx/mlx.h"
#include "mlxb.h"

struct mlxb_array_s {
  mlx::core::array a;
};

// Wraps an entry point's body: C++ exceptions become a non-zero return and
// the thread's error text, never an unwinding across the C ABI.
#define MLXB_TRY(...)                                        \
  try {                                                      \
    __VA_ARGS__;                                             \
    return 0;                                                \
  } catch (const std::exception& e) {                        \
    mlxb::set_error(e.what());                               \
    return 1;                                                \
  } catch (...) {                                            \
    mlxb::set_error("unknown C++ exception inside MLX");     \
    return 1;                                                \
  }

namespace mlxb {

inline const mlx::core::array& A(mlxb_array h) { return h->a; }
inline mlxb_array wrap(mlx::core::array a) { return new mlxb_array_s{std::move(a)}; }

void set_error(const char* msg);
mlx::core::Dtype to_dtype(int code);
int from_dtype(mlx::core::Dtype d);

}  // namespace mlxb
