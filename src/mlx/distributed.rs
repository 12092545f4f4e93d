//! MLX's distributed layer (`mlx::core::distributed`): a process group and
//! its collectives. Every byte between ranks goes through MLX's backends
//! (`ring` over TCP, `nccl`, `jaccl`, `mpi`); there is no transport here.
//! Collectives are lazy ops like any other: every rank must build the same
//! graph and evaluate it in the same order, or the group deadlocks.

use super::array::{check, make, Array, Dtype, Element};
use super::ffi::{self, GroupHandle};
use crate::error::{Error, Result};
use std::ffi::CString;
use std::sync::Arc;
use std::time::Duration;

/// The backends MLX knows by name.
pub const BACKENDS: &[&str] = &["ring", "nccl", "jaccl", "mpi", "any"];

struct Handle(GroupHandle);

// The group is an immutable shared_ptr inside MLX; its backend serializes
// the traffic itself.
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        unsafe { ffi::mlxb_group_free(self.0) }
    }
}

/// A group of processes that run collectives together. Cheap to clone.
#[derive(Clone)]
pub struct Group {
    handle: Arc<Handle>,
    rank: usize,
    size: usize,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group(rank {} of {})", self.rank, self.size)
    }
}

fn backend_name(backend: &str) -> Result<CString> {
    if !BACKENDS.contains(&backend) {
        return Err(Error::invalid(format!("distributed backend `{backend}` is not one of {}", BACKENDS.join(", "))));
    }
    Ok(CString::new(backend).expect("backend names have no NUL"))
}

/// Whether this MLX build has `backend`.
pub fn is_available(backend: &str) -> bool {
    match backend_name(backend) {
        Ok(b) => unsafe { ffi::mlxb_dist_is_available(b.as_ptr()) != 0 },
        Err(_) => false,
    }
}

impl Group {
    /// Joins the group `backend`'s environment describes (ring:
    /// `MLX_HOSTFILE` and `MLX_RANK`). Blocks until every rank has joined;
    /// MLX's ring backend waits forever for a rank that never starts, so
    /// callers that must not hang use [`Group::init_within`].
    pub fn init(backend: &str) -> Result<Group> {
        let name = backend_name(backend)?;
        let mut h: GroupHandle = std::ptr::null_mut();
        check(unsafe { ffi::mlxb_dist_init(name.as_ptr(), 1, &mut h) })
            .map_err(|e| e.context(format!("joining the `{backend}` distributed group")))?;
        let handle = Arc::new(Handle(h));
        let (rank, size) = unsafe { (ffi::mlxb_group_rank(h), ffi::mlxb_group_size(h)) };
        let (rank, size) = (rank.max(0) as usize, size.max(1) as usize);
        if size > 1 {
            watchdog::arm(rank, size);
        }
        Ok(Group { handle, rank, size })
    }

    /// [`Group::init`] that gives up after `timeout`: a rank that never
    /// joins is an error here, not a hang. On timeout the joining thread
    /// is left blocked inside MLX (it cannot be cancelled); the process
    /// should report the error and exit.
    pub fn init_within(backend: &str, timeout: Duration) -> Result<Group> {
        backend_name(backend)?;
        let (tx, rx) = std::sync::mpsc::channel();
        let b = backend.to_string();
        std::thread::Builder::new()
            .name("mlx-lfm-dist-init".into())
            .spawn(move || {
                let _ = tx.send(Group::init(&b));
            })
            .map_err(|e| Error::mlx(format!("cannot start the thread that joins the group: {e}")))?;
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(_) => Err(Error::mlx(format!(
                "the `{backend}` distributed group did not form within {} s: a rank never joined (check that every \
                 rank started, and MLX_HOSTFILE / MLX_RANK)",
                timeout.as_secs()
            ))),
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    fn raw(&self) -> GroupHandle {
        self.handle.0
    }

    /// Elementwise sum of `x` over every rank (every rank gets the sum).
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_all_sum(x.handle(), self.raw(), o) })
    }

    pub fn all_max(&self, x: &Array) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_all_max(x.handle(), self.raw(), o) })
    }

    /// Every rank's `x` concatenated along axis 0, in rank order.
    pub fn all_gather(&self, x: &Array) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_all_gather(x.handle(), self.raw(), o) })
    }

    /// Sends `x` to rank `dst`; the result must be evaluated to send.
    pub fn send(&self, x: &Array, dst: usize) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_dist_send(x.handle(), dst as i32, self.raw(), o) })
    }

    /// Receives an array of `shape` and `dtype` from rank `src`.
    pub fn recv(&self, shape: &[i32], dtype: Dtype, src: usize) -> Result<Array> {
        make(|o| unsafe { ffi::mlxb_dist_recv(shape.as_ptr(), shape.len() as i32, dtype as i32, src as i32, self.raw(), o) })
    }

    /// Rank 0's `x` on every rank, lazily (an all_sum to which the other
    /// ranks add zeros). Same shape and dtype on every rank. The zeros are
    /// made from `x` (a select, so a NaN in it stays out) so that they come
    /// after whatever `x` needs: with plain zeros this all_sum could run
    /// before the collectives `x` depends on on one rank and after them on
    /// another, and the group would deadlock.
    pub fn broadcast_array(&self, x: &Array) -> Result<Array> {
        if self.rank == 0 {
            self.all_sum(x)
        } else {
            let never = Array::from_slice(&[false], &[1])?;
            let zero = Array::scalar(0.0, x.dtype())?;
            self.all_sum(&super::where_(&never, x, &zero)?)
        }
    }

    /// Rank 0's `values` on every rank (the others pass what they like, of
    /// the same length: it is ignored): an all_sum to which only rank 0
    /// contributes, so it is exact for integers.
    pub fn broadcast<T: Element>(&self, values: &[T]) -> Result<Vec<T>> {
        let n = values.len() as i32;
        let x = if self.rank == 0 { Array::from_slice(values, &[n])? } else { super::zeros(&[n], T::DTYPE)? };
        self.all_sum(&x)?.to_vec()
    }

    /// Rank 0's bytes on every rank, whatever their length (the others'
    /// `bytes` are ignored): the length first, then the bytes packed into
    /// int32 words.
    pub fn broadcast_bytes(&self, bytes: &[u8]) -> Result<Vec<u8>> {
        let len = self.broadcast(&[if self.rank == 0 { bytes.len() as i32 } else { 0 }])?[0];
        if len < 0 {
            return Err(Error::mlx(format!("rank 0 broadcast a negative length {len}")));
        }
        let len = len as usize;
        let words = len.div_ceil(4);
        let mut packed = vec![0i32; words];
        if self.rank == 0 {
            for (i, c) in bytes.chunks(4).enumerate() {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                packed[i] = i32::from_le_bytes(w);
            }
        }
        let got = if words == 0 { vec![] } else { self.broadcast(&packed)? };
        let mut out = Vec::with_capacity(words * 4);
        for w in got {
            out.extend_from_slice(&w.to_le_bytes());
        }
        out.truncate(len);
        Ok(out)
    }
}

/// The watchdog for a group whose peer died. MLX's ring backend fails the
/// collectives in flight when a peer's connection drops, but ones queued
/// after that wait forever, and so does the eval that caught the error
/// (it synchronizes the stream before rethrowing; seen with 0.32.4). Such a
/// process can only end. So once a group of more than one rank exists,
/// every eval is timed, and one that has not returned within the timeout
/// (`MLX_LFM_TP_TIMEOUT_S`, default 300 s; a rank that is alive never
/// takes that long over one prefill chunk or decode step) ends the process
/// with a message saying why, instead of hanging the caller forever.
pub mod watchdog {
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
    use std::sync::OnceLock;
    use std::time::{Duration, Instant};

    static ACTIVE: AtomicBool = AtomicBool::new(false);
    /// Evals in progress, and when the oldest began (ms since `epoch()`).
    static DEPTH: AtomicUsize = AtomicUsize::new(0);
    static SINCE_MS: AtomicU64 = AtomicU64::new(0);
    static STARTED: OnceLock<()> = OnceLock::new();

    fn epoch() -> Instant {
        static E: OnceLock<Instant> = OnceLock::new();
        *E.get_or_init(Instant::now)
    }

    fn now_ms() -> u64 {
        epoch().elapsed().as_millis() as u64 + 1
    }

    pub fn timeout() -> Duration {
        let s = std::env::var("MLX_LFM_TP_TIMEOUT_S").ok().and_then(|v| v.trim().parse::<u64>().ok()).filter(|&s| s > 0);
        Duration::from_secs(s.unwrap_or(300))
    }

    /// Starts the watchdog (once per process): `rank` of `size` names
    /// this process in its message.
    pub fn arm(rank: usize, size: usize) {
        STARTED.get_or_init(|| {
            epoch();
            let limit = timeout();
            ACTIVE.store(true, SeqCst);
            std::thread::Builder::new()
                .name("mlx-lfm-tp-watchdog".into())
                .spawn(move || loop {
                    std::thread::sleep(Duration::from_millis(250));
                    let since = SINCE_MS.load(SeqCst);
                    if since != 0 && now_ms().saturating_sub(since) > limit.as_millis() as u64 {
                        eprintln!(
                            "mlx-lfm: rank {rank} of {size}: a computation over the tensor-parallel group has not \
                             finished in {} s: another rank died or stopped answering (MLX_LFM_TP_TIMEOUT_S sets \
                             this limit). The group cannot recover; exiting.",
                            limit.as_secs()
                        );
                        std::process::exit(75);
                    }
                })
                .ok();
        });
    }

    /// Marks an eval in progress until dropped (nothing without a group).
    pub struct Guard(bool);

    #[inline]
    pub fn enter() -> Guard {
        if !ACTIVE.load(Relaxed) {
            return Guard(false);
        }
        if DEPTH.fetch_add(1, SeqCst) == 0 {
            SINCE_MS.store(now_ms(), SeqCst);
        }
        Guard(true)
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            if self.0 && DEPTH.fetch_sub(1, SeqCst) == 1 {
                SINCE_MS.store(0, SeqCst);
            }
        }
    }
}
