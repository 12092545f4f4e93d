// Shared by the bridge's translation units (the op bridge now, the compiled
// decode step later): the handle layout and the dtype mapping.
#pragma once

#include "mlx/mlx.h"
#include "mlxb.h"

struct mlxb_array_s {
  mlx::core::array a;
};

namespace mlxb {

inline const mlx::core::array& A(mlxb_array h) { return h->a; }
inline mlxb_array wrap(mlx::core::array a) { return new mlxb_array_s{std::move(a)}; }

void set_error(const char* msg);
mlx::core::Dtype to_dtype(int code);
int from_dtype(mlx::core::Dtype d);

}  // namespace mlxb
