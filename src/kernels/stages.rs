//! The stages a one-launch layer hands on within one kernel
//! (src/kernels/moe_fused.rs, conv_fused.rs, ffn_fused.rs, qkv_fused.rs;
//! the design is moe_fused.rs's note): their device helpers, their
//! counters, the test's give-up variant of each kernel and a count of the
//! graphs each was put into.

use super::add_rms_norm::Walks;
use crate::error::{Error, Result};
use crate::mlx::kernel::CudaKernel;
use crate::mlx::{Array, Dtype};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

/// The waits, the staging loads, the tickets, the releases and the norm
/// stage every one-launch layer's kernel is built on.
pub(crate) const TICKET_HEADER: &str = r#"
#ifndef LFM_SPIN_LIMIT
#define LFM_SPIN_LIMIT (1 << 20)
#endif
// Waits (one thread) until *p >= v; 1 if it gave up. The acquire side of
// the stages' handoff: the fence after the value is seen orders what the
// block reads next after what the producer wrote before its release.
__device__ inline int lfm_wait_at_least(unsigned long long* p, unsigned long long v) {
  for (int i = 0; i < LFM_SPIN_LIMIT; i++) {
    if (*reinterpret_cast<volatile unsigned long long*>(p) >= v) {
      __threadfence();
      return 0;
    }
    __nanosleep(64);
  }
  return 1;
}
// n 16-byte runs from global memory another block wrote during this launch
// into shared memory, read at L2 (not a line L1 may hold from before).
__device__ inline void lfm_stage16(uint4* dst, const void* src, int n) {
  const uint4* s = reinterpret_cast<const uint4*>(src);
  for (int i = threadIdx.x; i < n; i += blockDim.x) dst[i] = __ldcg(s + i);
}
// The block's ticket (thread 0 takes it from the counter at st), for
// every thread: its launch (ticket / NB) and its part (ticket % NB).
template <int NB>
__device__ inline int lfm_take_part(unsigned long long* st, unsigned long long& launch) {
  __shared__ unsigned long long ticket;
  if (threadIdx.x == 0) ticket = atomicAdd(st, 1ull);
  __syncthreads();
  launch = ticket / NB;
  return static_cast<int>(ticket % NB);
}
// The release side: once the whole block has written its part, thread 0's
// fence, then the mark (at least v) or the count (one more).
__device__ inline void lfm_release_mark(unsigned long long* p, unsigned long long v) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicMax(p, v);
  }
}
__device__ inline void lfm_release_count(unsigned long long* p) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(p, 1ull);
  }
}
// Thread 0 waits for *p >= v, then (unless it gave up) for *p2 >= v2;
// every thread gets whether it gave up. (`late` is one variable a kernel:
// the second barrier lets a later call set it again.)
__device__ inline bool lfm_block_wait(unsigned long long* p, unsigned long long v, unsigned long long* p2,
                                      unsigned long long v2) {
  __shared__ int late;
  if (threadIdx.x == 0) {
    int l = lfm_wait_at_least(p, v);
    if (!l && p2) l = lfm_wait_at_least(p2, v2);
    late = l;
  }
  __syncthreads();
  const bool gave_up = late != 0;
  __syncthreads();
  return gave_up;
}
#if !LFM_NORM_IN_WIDER_BLOCK
#error "the fused layers' blocks are wider than the norm's: define LFM_NORM_IN_WIDER_BLOCK 1 before the add + RMSNorm code"
#endif
// The first stage of both fused layers: the residual add + RMSNorm of the
// row with the add + RMSNorm kernel's block of NBLK threads (its bits),
// the sum into s, the normed row into ys (shared) and yn (for the blocks
// after), and the whole block past its barrier.
template <typename T, int D, int NBLK>
__device__ inline void lfm_norm_stage(const T* h, const T* r, const T* wn, float eps, T* s, T* ys, T* yn) {
  if (lfm_aligned(h) && lfm_aligned(r) && lfm_aligned(wn) && lfm_aligned(s)) {
    lfm_add_rms_row<T, D, NBLK, true>(h, r, wn, eps, s, ys);
  } else {
    lfm_add_rms_row<T, D, NBLK, false>(h, r, wn, eps, s, ys);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < D; i += blockDim.x) yn[i] = ys[i];
  __syncthreads();
}
"#;

/// Shared memory a one-launch kernel's staged rows may take (48 KiB is
/// the static limit, with the stages' own few words beside them).
pub(crate) const MAX_STAGED: usize = 32 * 1024;

/// A layer's counters: four 64-bit counters, zero (eight uint32: MLX's
/// signature names the element type; the kernels read them as 64-bit).
/// Made once per layer and kept with it; only its own kernel's launches,
/// one after another, touch them. Made by an op and evaluated, so that on
/// CUDA they are device memory (an array the host writes is managed
/// memory, whose page the host could pull back).
pub fn new_counters() -> Result<Array> {
    let counters = crate::mlx::zeros(&[8], Dtype::Uint32)?;
    counters.eval()?;
    Ok(counters)
}

/// That `ctr` is a layer's counters ([`new_counters`]), for `what`.
pub(crate) fn check_counters(ctr: &Array, what: &str) -> Result<()> {
    if ctr.dtype() != Dtype::Uint32 || ctr.size() != 8 {
        return Err(Error::invalid(format!("{what}: its counters must be 8 uint32 (stages::new_counters)")));
    }
    Ok(())
}

/// `MLX_LFM_FUSED_NO_WAIT=1` (a test's knob): every wait gives up at once,
/// so a test sees the poisoned output a stuck stage would give (and the
/// counters still in step after it), not a hang.
fn no_wait() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_FUSED_NO_WAIT", &ON, |v| v == Some("1"))
}

/// A one-launch kernel's cells: with and without the give-up variant, each
/// for each walk of the add + RMSNorm code.
pub(crate) type Cells = [Walks; 2];

/// Empty [`Cells`] (for a kernel's static).
pub(crate) const fn cells() -> Cells {
    [const { [const { OnceLock::new() }; 2] }; 2]
}

/// The kernel `name` over `source` and `header()`, made once per cell: as
/// given, or (under [`no_wait`]) named `{name}_no_wait` with its waits
/// giving up at once.
pub(crate) fn kernel(
    cells: &'static Cells,
    name: &str,
    inputs: &[&str],
    outputs: &[&str],
    source: &str,
    header: impl FnOnce() -> String,
) -> Option<&'static CudaKernel> {
    let stuck = no_wait();
    super::add_rms_norm::for_walk(&cells[usize::from(stuck)], || {
        let (name, wait) = if stuck { (format!("{name}_no_wait"), "#define LFM_SPIN_LIMIT 0\n") } else { (name.to_string(), "") };
        CudaKernel::new(&super::add_rms_norm::kernel_name(&name), inputs, outputs, source, &format!("{wait}{}", header())).ok()
    })
}

/// How many graphs a one-launch kernel was put into in this process (the
/// greedy test's evidence that a run took its path).
pub(crate) struct Built(AtomicUsize);

impl Built {
    pub(crate) const fn new() -> Built {
        Built(AtomicUsize::new(0))
    }

    pub(crate) fn bump(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}
