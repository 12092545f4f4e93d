//! The first rows a lone sequence's dense feed-forward reads, asked of L2
//! while the layer's operator runs (`MLX_LFM_FFN_PREFETCH`, opt-in,
//! session 46, not yet run on a GPU). An attention layer's launches before
//! its feed-forward (the q/k/v stage, the attention, out_proj: ~30 µs of
//! the 1.2B's step a layer, session 45) read ~22 MB, a third of what DRAM
//! could deliver in that time, and the feed-forward after them then reads
//! its ~100 MB from DRAM alone (~40 µs). One block of a launch ordered
//! after the layer's input hands L2 bulk prefetches (sm_90's
//! `cp.async.bulk.prefetch.L2`: no registers, no waiting) for the start of
//! w1's and of w3's rows in the stacked `[2F, D]` weight, the rows the
//! feed-forward's first gate blocks walk first (src/kernels/stages.rs:
//! output j reads rows j and F + j, the tickets in order), and ends. The
//! operator's input depends on it (`depends`), which keeps it in the graph
//! and puts it before the operator in MLX's order; MLX's CUDA graph links
//! nodes only by the buffers they read and write, so nothing waits for it:
//! it runs once the layer's input is made, beside the operator. Nothing
//! read changes: the step's bits are the same. Below sm_90, or where the
//! weight is not 16-byte aligned, the launch asks nothing.

use crate::error::{Error, Result};
use crate::mlx::kernel::{cuda_kernels_enabled, CudaKernel, TemplateArg};
use crate::mlx::{self, Array, Dtype};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// Threads of the one block (each asks for its chunks in turn).
const THREADS: i32 = 128;

/// Bytes a prefetch instruction asks for.
const CHUNK: i64 = 64 * 1024;

const SOURCE: &str = r#"
#if __CUDA_ARCH__ >= 900
  const unsigned long long base = static_cast<unsigned long long>(__cvta_generic_to_global(w));
  const long long offs[2] = {0ll, static_cast<long long>(OFF1_16) * 16};
  const long long len = static_cast<long long>(LEN_16) * 16;
  if ((base & 15ull) == 0) {
    for (int r = 0; r < 2; r++) {
      for (long long c = static_cast<long long>(threadIdx.x) * CHUNK; c < len; c += static_cast<long long>(blockDim.x) * CHUNK) {
        const unsigned n = static_cast<unsigned>(len - c < CHUNK ? len - c : CHUNK);
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(base + offs[r] + c), "r"(n) : "memory");
      }
    }
  }
#endif
  if (threadIdx.x == 0) done[0] = 0;
"#;

/// Which layers' feed-forwards are asked for.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Reach {
    /// After attention layers (their operator leaves DRAM idle most).
    Attention,
    /// After every layer's operator (conv layers too).
    All,
}

/// `MLX_LFM_FFN_PREFETCH=1|attention` or `=all`; a test's opt-in asks for
/// `all`.
pub fn reach() -> Option<Reach> {
    static SET: OnceLock<Option<Reach>> = OnceLock::new();
    if super::forced("MLX_LFM_FFN_PREFETCH") {
        return Some(Reach::All);
    }
    crate::knobs::cached("MLX_LFM_FFN_PREFETCH", &SET, |v| match v.map(str::trim) {
        Some("1") | Some("attention") => Some(Reach::Attention),
        Some("all") => Some(Reach::All),
        _ => None,
    })
}

/// `MLX_LFM_FFN_PREFETCH_MB` (default 16, 1 to 48): the bytes asked for a
/// layer, half from w1's rows and half from w3's (H100 and H200: 50 MB of
/// L2, which the operator's own reads share).
fn budget() -> i64 {
    static MB: OnceLock<i64> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_FFN_PREFETCH_MB", &MB, |v| {
        v.and_then(|v| v.trim().parse::<i64>().ok()).filter(|m| (1..=48).contains(m)).unwrap_or(16)
    }) << 20
}

/// `(offset of w3's rows, bytes asked of each half)` in 16-byte units for a
/// stacked `[2F, D]` weight of `elem` bytes an element holding `budget`
/// bytes in all; None where there is nothing to ask or a figure overflows
/// the kernel's int32 template values.
pub fn ranges(rows: i64, cols: i64, elem: i64, budget: i64) -> Option<(i32, i32)> {
    if rows <= 0 || rows % 2 != 0 || cols <= 0 || elem <= 0 || budget <= 0 {
        return None;
    }
    let half = (rows / 2).checked_mul(cols)?.checked_mul(elem)?;
    // (The second half starts 16-byte aligned where the first's bytes are
    // a multiple of 16, which a dense weight's rows of 8+ elements are.)
    if half % 16 != 0 {
        return None;
    }
    let each = (budget / 2).min(half) / 16;
    if each == 0 {
        return None;
    }
    Some((i32::try_from(half / 16).ok()?, i32::try_from(each).ok()?))
}

fn kernel() -> Option<&'static CudaKernel> {
    static K: OnceLock<Option<CudaKernel>> = OnceLock::new();
    K.get_or_init(|| CudaKernel::new("lfm_l2_prefetch", &["after", "w"], &["done"], SOURCE, "").ok()).as_ref()
}

static BUILT: AtomicUsize = AtomicUsize::new(0);

/// How many prefetch launches this process has put into graphs (the
/// greedy test's evidence that a run took them).
pub fn built() -> usize {
    BUILT.load(Ordering::Relaxed)
}

/// The prefetch of the stacked dense gate weight `w13` (`[2F, D]`),
/// ordered after `after` (the layer's input), for a feed-forward after an
/// attention layer's operator or (`attention` false) a conv layer's: its
/// one-element output, on which the feed-forward's input should depend;
/// None where it does not serve (off, not CUDA, not dense, nothing to ask).
pub fn launch(after: &Array, w13: &Array, attention: bool) -> Result<Option<Array>> {
    let Some(on) = reach() else { return Ok(None) };
    if on == Reach::Attention && !attention {
        return Ok(None);
    }
    if !cuda_kernels_enabled() || w13.ndim() != 2 || !w13.dtype().is_float() {
        return Ok(None);
    }
    let elem = w13.dtype().size() as i64;
    let Some((off1, each)) = ranges(w13.dim(0) as i64, w13.dim(1) as i64, elem, budget()) else { return Ok(None) };
    let Some(k) = kernel() else { return Ok(None) };
    let template = [
        ("OFF1_16", TemplateArg::Int(off1)),
        ("LEN_16", TemplateArg::Int(each)),
        ("CHUNK", TemplateArg::Int(CHUNK as i32)),
    ];
    // (The weight's first row stands for it: the kernel reads the pointer
    // only, and MLX counts an input's elements toward cutting its graphs.
    // A row of a row-contiguous weight is a view, not a copy. The output is
    // 16 bytes: MLX keeps arrays under 16 bytes in managed memory.)
    let row = w13.slice_axis(0, 0, 1)?;
    let mut outs = k.call(&[after, &row], &[(&[4], Dtype::Int32)], [THREADS, 1, 1], [THREADS, 1, 1], &template)?;
    BUILT.fetch_add(1, Ordering::Relaxed);
    Ok(Some(outs.pop().ok_or_else(|| Error::mlx("the L2 prefetch: missing output"))?))
}

/// `x` (the same buffer) depending on `done`, the prefetch launch's output.
pub fn after(x: &Array, done: &Array) -> Result<Array> {
    mlx::depends(&[x], &[done])?.pop().ok_or_else(|| Error::mlx("depends: missing output"))
}

#[cfg(test)]
mod tests {
    use super::{ranges, reach, Reach};
    use crate::knobs::with_overrides;

    /// The two halves' ranges: the 1.2B's `[16384, 2048]` bf16 weight at 16
    /// MB asks 8 MB of each half, which starts 32 MB in; a budget past a
    /// half asks the half; nothing for odd or empty shapes or a half that
    /// is not 16-byte aligned.
    #[test]
    fn each_half_gets_half_the_budget() {
        let mb = 1i64 << 20;
        assert_eq!(ranges(16384, 2048, 2, 16 * mb), Some(((32 * mb / 16) as i32, (8 * mb / 16) as i32)));
        assert_eq!(ranges(64, 8, 2, 16 * mb), Some((32, 32)));
        assert_eq!(ranges(16384, 2048, 4, 48 * mb), Some(((64 * mb / 16) as i32, (24 * mb / 16) as i32)));
        assert_eq!(ranges(15, 2048, 2, mb), None);
        assert_eq!(ranges(0, 2048, 2, mb), None);
        assert_eq!(ranges(2, 3, 2, mb), None);
        assert_eq!(ranges(16384, 2048, 2, 8), None);
        assert_eq!(ranges(1 << 40, 1 << 20, 2, mb), None);
    }

    #[test]
    fn the_switch_names_its_reach() {
        for (v, want) in [("1", Some(Reach::Attention)), ("attention", Some(Reach::Attention)), ("all", Some(Reach::All)), ("0", None), ("yes", None)] {
            with_overrides(&[("MLX_LFM_FFN_PREFETCH".to_string(), Some(v.to_string()))], || assert_eq!(reach(), want, "{v:?}"));
        }
        crate::kernels::with_opt_in_one("MLX_LFM_FFN_PREFETCH", || assert_eq!(reach(), Some(Reach::All)));
    }
}
