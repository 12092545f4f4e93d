//! Replacing the process with another program (execve), for the CLI's
//! relaunch under the allocator it ships (lib/allocator.cjs): Node gained
//! `process.execve` only in 22.15 / 23.11, and a relaunch as a child would
//! leave a parent between the command and its signals and exit status.

use napi_derive::napi;
use std::ffi::CString;

fn c_strings(what: &str, items: &[String]) -> napi::Result<Vec<CString>> {
    items
        .iter()
        .enumerate()
        .map(|(i, s)| {
            CString::new(s.as_bytes())
                .map_err(|_| napi::Error::from_reason(format!("{what}[{i}] holds a NUL byte")))
        })
        .collect()
}

/// Internal (the CLI's allocator relaunch): replaces this process with
/// `file`, run with `argv` and `env` ("KEY=value" strings). Returns only
/// on failure, with the system's reason.
#[napi(js_name = "__execWithEnv")]
pub fn exec_with_env(file: String, argv: Vec<String>, env: Vec<String>) -> napi::Result<()> {
    let path = CString::new(file.as_bytes()).map_err(|_| napi::Error::from_reason("file holds a NUL byte"))?;
    let args = c_strings("argv", &argv)?;
    let vars = c_strings("env", &env)?;
    let mut arg_ptrs: Vec<*const libc::c_char> = args.iter().map(|s| s.as_ptr()).collect();
    arg_ptrs.push(std::ptr::null());
    let mut env_ptrs: Vec<*const libc::c_char> = vars.iter().map(|s| s.as_ptr()).collect();
    env_ptrs.push(std::ptr::null());
    // Node marks every descriptor close-on-exec at start, stdin, stdout
    // and stderr included: the program must inherit those three (as
    // Node's own process.execve arranges), or it would start with
    // /dev/null for them.
    for fd in 0..3 {
        // SAFETY: fcntl on a descriptor number; a closed one fails harmlessly.
        unsafe {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags >= 0 {
                libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC);
            }
        }
    }
    // SAFETY: every pointer is into a CString that outlives the call, and
    // both arrays end with a null pointer, as execve requires.
    unsafe { libc::execve(path.as_ptr(), arg_ptrs.as_ptr(), env_ptrs.as_ptr()) };
    Err(napi::Error::from_reason(format!("execve {file}: {}", std::io::Error::last_os_error())))
}
