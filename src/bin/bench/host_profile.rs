//! Where the host's time goes, sampled in process: the device machine has
//! no perf, nsys or gdb, and cuda-gdb takes ~40 s an attach there (session
//! 17). A CPU-time timer (`ITIMER_PROF`) interrupts whichever thread is
//! running; the handler keeps that thread's id and the interrupted
//! instruction's address, and `report` names each address by the nearest
//! exported symbol of its library (`dladdr`: libmlx's C++ functions are
//! exported; our own frames show as the bench's). Leaf addresses only (no
//! stack walk): a self-time profile, by function and by library. The
//! timer fires on the kernel's tick, so asking for more than its rate
//! (often 250 Hz) gives fewer samples; the measured reps include their
//! prompt's prefill (a few percent of a 512-token decode).

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
mod imp {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};

    const CAP: usize = 1 << 17;
    static IPS: [AtomicU64; CAP] = [const { AtomicU64::new(0) }; CAP];
    static TIDS: [AtomicU32; CAP] = [const { AtomicU32::new(0) }; CAP];
    static N: AtomicUsize = AtomicUsize::new(0);

    extern "C" fn on_prof(_sig: libc::c_int, _info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
        // Only async-signal-safe work here: a syscall and atomic stores.
        let i = N.fetch_add(1, Ordering::Relaxed);
        if i >= CAP || ctx.is_null() {
            return;
        }
        // SAFETY: the kernel hands an SA_SIGINFO handler the interrupted
        // thread's ucontext_t.
        let rip = unsafe { (*(ctx as *const libc::ucontext_t)).uc_mcontext.gregs[libc::REG_RIP as usize] } as u64;
        let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u32;
        IPS[i].store(rip, Ordering::Relaxed);
        TIDS[i].store(tid, Ordering::Relaxed);
    }

    fn timer(us: i64) {
        let tv = libc::timeval { tv_sec: us / 1_000_000, tv_usec: us % 1_000_000 };
        let it = libc::itimerval { it_interval: tv, it_value: tv };
        // SAFETY: plain syscall with a valid struct.
        unsafe { libc::setitimer(libc::ITIMER_PROF, &it, std::ptr::null_mut()) };
    }

    pub fn start(hz: u32) {
        N.store(0, Ordering::Relaxed);
        // SAFETY: installs a handler that touches only atomics and gettid.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_prof as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(libc::SIGPROF, &sa, std::ptr::null_mut());
        }
        timer(1_000_000 / hz.clamp(1, 10_000) as i64);
    }

    /// Stops sampling (a late signal is ignored, not fatal) and tallies the
    /// samples of thread `main_tid` and of the others.
    pub fn report(main_tid: u32) -> serde_json::Value {
        timer(0);
        // SAFETY: restoring a signal's disposition.
        unsafe { libc::signal(libc::SIGPROF, libc::SIG_IGN) };
        let n = N.load(Ordering::Relaxed).min(CAP);
        let (mut by_fn, mut by_lib, mut other_lib) = (HashMap::new(), HashMap::new(), HashMap::new());
        let mut names: HashMap<u64, (String, Option<String>, u64)> = HashMap::new();
        // Every sample of the decoding thread by library and offset in it:
        // `bench/h200/symbolize.py` names them from the library's own
        // symbol table (the wheel's libmlx.so keeps one; dladdr reads only
        // the exported ones, so `by_function` can only guess).
        let mut unnamed: HashMap<String, HashMap<u64, usize>> = HashMap::new();
        let mut mine = 0usize;
        for i in 0..n {
            let ip = IPS[i].load(Ordering::Relaxed);
            let tid = TIDS[i].load(Ordering::Relaxed);
            let (lib, sym, offset) = names.entry(ip).or_insert_with(|| name(ip)).clone();
            if tid == main_tid {
                mine += 1;
                *unnamed.entry(lib.clone()).or_default().entry(offset).or_insert(0) += 1;
                let key = format!("{lib} {}", sym.as_deref().unwrap_or("?"));
                *by_fn.entry(key).or_insert(0usize) += 1;
                *by_lib.entry(lib).or_insert(0usize) += 1;
            } else {
                *other_lib.entry(lib).or_insert(0usize) += 1;
            }
        }
        let top = |m: HashMap<String, usize>, k: usize| -> Vec<(String, usize)> {
            let mut v: Vec<_> = m.into_iter().collect();
            v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
            v.truncate(k);
            v
        };
        let unnamed: HashMap<String, Vec<(String, usize)>> = unnamed
            .into_iter()
            .map(|(lib, offs)| {
                let mut v: Vec<(String, usize)> = offs.into_iter().map(|(o, c)| (format!("{o:#x}"), c)).collect();
                v.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
                v.truncate(2000);
                (lib, v)
            })
            .collect();
        serde_json::json!({
            "samples": n, "decoding_thread_samples": mine, "dropped": N.load(Ordering::Relaxed).saturating_sub(CAP),
            "by_function": top(by_fn, 60), "by_library": top(by_lib, 12), "other_threads_by_library": top(other_lib, 12),
            "offsets": unnamed,
        })
    }

    /// The library, nearest exported symbol (mangled) and offset in the
    /// library of `ip`.
    fn name(ip: u64) -> (String, Option<String>, u64) {
        // SAFETY: dladdr reads the loader's tables; the strings it returns
        // live as long as the library stays loaded (it does: we copy them now).
        unsafe {
            let mut info: libc::Dl_info = std::mem::zeroed();
            if libc::dladdr(ip as *const libc::c_void, &mut info) == 0 {
                return ("?".into(), None, ip);
            }
            let s = |p: *const libc::c_char| (!p.is_null()).then(|| std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned());
            let lib = s(info.dli_fname).unwrap_or_else(|| "?".into());
            let lib = lib.rsplit('/').next().unwrap_or(&lib).to_string();
            let offset = ip.wrapping_sub(info.dli_fbase as u64);
            // The nearest exported symbol can lie far below an internal
            // function (libmlx hides many): named only when it starts within
            // 64 KiB, else left to the offset.
            let near = !info.dli_saddr.is_null() && ip.wrapping_sub(info.dli_saddr as u64) < 1 << 16;
            (lib, s(info.dli_sname).filter(|_| near), offset)
        }
    }
}

#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
pub use imp::{report, start};

/// This thread's kernel id (the decoding thread's, when the bench asks).
#[cfg(all(target_os = "linux", target_arch = "x86_64"))]
pub fn this_thread() -> u32 {
    // SAFETY: a plain syscall.
    unsafe { libc::syscall(libc::SYS_gettid) as u32 }
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
pub fn start(_hz: u32) {}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
pub fn report(_main_tid: u32) -> serde_json::Value {
    serde_json::json!({"error": "the host profile samples on Linux x86_64 only"})
}

#[cfg(not(all(target_os = "linux", target_arch = "x86_64")))]
pub fn this_thread() -> u32 {
    0
}
