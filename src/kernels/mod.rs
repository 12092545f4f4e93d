//! Fused CUDA kernels for the steps where a profile showed MLX's stock ops
//! losing (one launch where the stock graph takes several small ones). Each
//! runs only on MLX's CUDA backend ([`crate::mlx::kernel::cuda_kernels_enabled`]),
//! each has a test against the stock-op path that runs where CUDA is and is
//! skipped elsewhere, and every other backend keeps the stock ops.

pub mod add_rms_norm;
pub mod argmax_finite;
pub mod conv_fused;
pub mod conv_layer_fused;
pub mod decode_attention;
pub mod ffn_fused;
pub mod gemv;
pub mod moe_experts;
pub mod moe_fused;
pub mod moe_gemm;
pub mod moe_router;
pub mod moe_sort;
pub mod norm_gemv;
pub mod qk_norm_rope;
pub mod quant_embed;
pub mod qkv_fused;
pub mod quant_gemv;
pub mod short_conv;
pub mod stages;

#[cfg(test)]
pub(crate) mod tests;

use std::sync::OnceLock;

thread_local! {
    /// Whether a test turned every opt-in kernel on for this thread.
    static FORCED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// The one opt-in kernel a test turned on for this thread (its variable).
    static FORCED_ONE: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
    /// The one default kernel a test turned off for this thread (its variable).
    static OFF_ONE: std::cell::Cell<Option<&'static str>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with every opt-in kernel on on this thread, without their
/// environment variables (the kernel tests; other tests in the process keep
/// the defaults).
pub fn with_opt_in<R>(f: impl FnOnce() -> R) -> R {
    crate::mlx::kernel::with_thread_flag(&FORCED, true, f)
}

/// A default kernel's source with a variant's substitutions made in order
/// (each `(was, now)`; `kernel_variant_substitutions_each_land` checks every
/// `was` is there, so a variant cannot silently equal its default).
pub(crate) fn substituted(source: &str, subs: &[(&str, &str)]) -> String {
    subs.iter().fold(source.to_string(), |src, (was, now)| src.replace(was, now))
}

/// Whether an opt-in kernel is on: `var=1`, read once into `cell`, or a
/// test's [`with_opt_in`]. Kernels stay opt-in until their A/B on the GPU
/// they were written for says they win (`bench/h200/run.py ab`).
pub(crate) fn opt_in(var: &str, cell: &OnceLock<bool>) -> bool {
    forced(var) || crate::knobs::cached(var, cell, |v| v == Some("1"))
}

/// Whether a test turned `var`'s kernel on for this thread.
pub(crate) fn forced(var: &str) -> bool {
    FORCED.with(|c| c.get()) || forced_alone(var)
}

/// Whether a test turned `var`'s kernel on alone ([`with_opt_in_one`]), not
/// with every opt-in: for a variant that would take the place of others
/// under [`with_opt_in`] (the chunked decode attention before the split
/// and the shared scores).
pub(crate) fn forced_alone(var: &str) -> bool {
    FORCED_ONE.with(|c| c.get() == Some(var))
}

/// Whether a kernel adopted as a default is on: unless `var=0` (read once
/// into `cell`); a test's [`with_opt_in`] or [`with_opt_in_one`] asks for
/// it as for an opt-in one.
fn opt_out(var: &str, cell: &OnceLock<bool>) -> bool {
    forced(var) || crate::knobs::cached(var, cell, |v| v != Some("0"))
}

/// A switch whose default depends on the operands: `Some(true)` where
/// `var=1` or a test turned it on ([`with_opt_in`], [`with_opt_in_one`]),
/// `Some(false)` where `var=0`, `None` (read once into `cell`) where the
/// variable is unset and the caller's own rule decides.
pub(crate) fn switch(var: &str, cell: &OnceLock<Option<bool>>) -> Option<bool> {
    if forced(var) {
        return Some(true);
    }
    if OFF_ONE.with(|c| c.get() == Some(var)) {
        return Some(false);
    }
    crate::knobs::cached(var, cell, |v| match v {
        Some("1") => Some(true),
        Some("0") => Some(false),
        _ => None,
    })
}

/// A change adopted as a default where our CUDA kernels run (the H200's
/// paired A/B and greedy test ran it there; other backends were never
/// timed with it): on there unless `var=0`, on anywhere with `var=1` (a
/// CPU test) or a test's opt-in. Asks the backend each time, not once, so a
/// test's [`crate::mlx::kernel::with_stock_ops`] builds the stock graph.
pub(crate) fn cuda_default(var: &str, cell: &OnceLock<Option<bool>>) -> bool {
    switch(var, cell).unwrap_or_else(crate::mlx::kernel::cuda_kernels_enabled)
}

/// One token a row: `[B, 1, width]`, or a decode step's rows `[B, width]`
/// (the same memory; see `model::lfm2::decode_rows`).
pub(crate) fn one_token(a: &crate::mlx::Array) -> bool {
    match a.ndim() {
        3 => a.dim(1) == 1,
        2 => true,
        _ => false,
    }
}

/// Runs `f` with the one default kernel that `var` switches off on this
/// thread, the other defaults kept (a test comparing a default kernel's
/// output with the stock draw it replaced, everything else equal).
pub fn with_default_off_one<R>(var: &'static str, f: impl FnOnce() -> R) -> R {
    crate::mlx::kernel::with_thread_flag(&OFF_ONE, Some(var), f)
}

/// Runs `f` with the one opt-in kernel that `var` switches on on this
/// thread (a test that must tell which opt-in kernel departs).
pub fn with_opt_in_one<R>(var: &'static str, f: impl FnOnce() -> R) -> R {
    crate::mlx::kernel::with_thread_flag(&FORCED_ONE, Some(var), f)
}
