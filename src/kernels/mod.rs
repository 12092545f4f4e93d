//! Fused CUDA kernels for the steps where a profile showed MLX's stock ops
//! losing (one launch where the stock graph takes several small ones). Each
//! runs only on MLX's CUDA backend ([`crate::mlx::kernel::cuda_kernels_enabled`]),
//! each has a test against the stock-op path that runs where CUDA is and is
//! skipped elsewhere, and every other backend keeps the stock ops.

pub mod add_rms_norm;
pub mod decode_attention;
pub mod gemv;
pub mod moe_router;
pub mod short_conv;

#[cfg(test)]
mod tests;
