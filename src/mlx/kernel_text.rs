//! A custom kernel's text kept in files that MLX's compile includes (the
//! default since session 39; `MLX_LFM_KERNEL_TEXT=inline`: the text itself,
//! as before).
//!
//! Why: MLX 0.32.4's CUDA `CustomKernel::eval_gpu` names a kernel's module
//! by its name and a hash of its whole generated source, at every dispatch
//! (its disassembly in the wheel's libmlx.so: a `_Hash_bytes` over the
//! source before `get_jit_module`). Our one-launch layers are 34-44 KB of
//! text each in their 4-bit forms (22-29 KB dense), 47 of them a step of
//! the 8B-A1B, ~1.95 MB hashed a token: session 33's host profile
//! put 25% of the decoding thread's samples in `_Hash_bytes`. With the body
//! and the header in files, MLX holds and hashes two `#include` lines
//! instead; NVRTC reads the files at the kernel's first compile (session
//! 33: NVRTC 13 compiles an absolute `#include` inside a function body to
//! the same PTX as the text inline).
//!
//! The files are named by the kernel's module name (its name and a hash of
//! its whole text, [`super::kernel::module_name`]), so MLX's own name for
//! the module (its name and the hash of the include lines) changes with
//! the text, and its PTX cache never serves an old body. They live in a
//! folder of the user's own (`$TMPDIR/mlx-lfm-kernels-<uid>`, mode 0700,
//! refused if it is anyone else's or open to others: a kernel's text is
//! code the GPU runs), written whole under a temporary name and renamed.
//! Where that fails, the text goes inline.
//!
//! Adopted in session 39 (an H100) because it changes nothing the GPU
//! runs and only cuts the host's work: NVRTC makes the same PTX of every
//! kernel build, byte for byte, either way (`nvrtc-check.py --files`,
//! session 33), its GPU tests passed (a kernel's bits both ways; the wide
//! MoE fixture's greedy sets with every kernel so), and session 38's A/B
//! measured the 8B-A1B's host dispatch at 553-560 µs a token with the
//! files against 1,014-1,020 inline. That A/B's decode (0.94 / 1.13, two
//! reps) could not tell, its host being fast enough for the GPU to bound
//! the step; session 39's host was not (the 8B-A1B's step waited 12-230 µs
//! a token on the GPU after 1.1-1.5 ms of dispatch), and there the host's
//! time is the step's.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// Whether kernels' texts go into files: unless `MLX_LFM_KERNEL_TEXT=inline`.
pub fn in_files() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    crate::knobs::cached("MLX_LFM_KERNEL_TEXT", &ON, |v| !matches!(v.map(str::trim), Some("inline")))
}

/// A kernel's texts in their files, and what MLX gets instead.
pub struct KernelFiles {
    body: (PathBuf, String),
    header: Option<(PathBuf, String)>,
    /// The body as MLX gets it: the include, after a comment naming the
    /// operands whose shapes the body reads (MLX passes an input's
    /// `_shape`, `_strides`, `_ndim` only where its source names them).
    pub source: String,
    /// The header as MLX gets it (empty where the kernel has none).
    pub header_line: String,
    /// When the files were last seen (seconds since the epoch).
    checked: AtomicU64,
}

/// How often a kernel's call checks that its files are still there (a
/// temporary folder's cleaner may remove them while a server runs; a
/// template value never compiled before makes NVRTC read them again).
const RECHECK_SECS: u64 = 60;

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

impl KernelFiles {
    /// Writes `source` and `header` for the module `module` into `dir`.
    pub fn write(dir: &Path, module: &str, inputs: &[&str], source: &str, header: &str) -> std::io::Result<KernelFiles> {
        let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, what);
        if module.is_empty() || !module.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(invalid(format!("kernel module name {module:?}: not a plain file name")));
        }
        let body = dir.join(format!("{module}.body.cuh"));
        let head = dir.join(format!("{module}.head.cuh"));
        let quoted = |p: &Path| -> std::io::Result<String> {
            let s = p.to_str().ok_or_else(|| invalid(format!("{}: not UTF-8", p.display())))?;
            if s.contains(['"', '\\', '\n', '\r']) {
                return Err(invalid(format!("{s}: a character an #include line cannot hold")));
            }
            Ok(format!("#include \"{s}\"\n"))
        };
        let mut reads: Vec<String> = Vec::new();
        for n in inputs {
            for suffix in ["_shape", "_strides", "_ndim"] {
                let token = format!("{n}{suffix}");
                if source.contains(&token) {
                    reads.push(token);
                }
            }
        }
        let mut src = String::new();
        if !reads.is_empty() {
            src.push_str(&format!("// reads {}\n", reads.join(" ")));
        }
        src.push_str(&quoted(&body)?);
        let header_line = if header.is_empty() { String::new() } else { quoted(&head)? };
        let files = KernelFiles {
            body: (body, source.to_string()),
            header: (!header.is_empty()).then(|| (head, header.to_string())),
            source: src,
            header_line,
            checked: AtomicU64::new(0),
        };
        files.ensure_now()?;
        Ok(files)
    }

    fn ensure_now(&self) -> std::io::Result<()> {
        for (path, text) in std::iter::once(&self.body).chain(self.header.as_ref()) {
            write_if_changed(path, text)?;
        }
        self.checked.store(now_secs(), Ordering::Relaxed);
        Ok(())
    }

    /// Puts back any file that went missing, in a folder checked again
    /// (made anew if a cleaner took it; refused if it is no longer this
    /// user's own and closed, since NVRTC would compile what another user
    /// put there: the call then fails, naming why). Checked at most once a
    /// [`RECHECK_SECS`] while all is well, at every call while it is not.
    pub fn ensure(&self) -> std::io::Result<()> {
        if now_secs().saturating_sub(self.checked.load(Ordering::Relaxed)) < RECHECK_SECS {
            return Ok(());
        }
        if let Some(dir) = self.body.0.parent() {
            private_folder(dir)?;
        }
        self.ensure_now()
    }
}

/// `path` holding exactly `text`: left alone if it does, else written to a
/// temporary name beside it and renamed over it (another process writing
/// the same module writes the same bytes).
fn write_if_changed(path: &Path, text: &str) -> std::io::Result<()> {
    if std::fs::read(path).map(|b| b == text.as_bytes()).unwrap_or(false) {
        return Ok(());
    }
    let tmp = path.with_extension(format!("tmp.{}.{:x}", std::process::id(), now_nanos()));
    let result = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        std::fs::remove_file(&tmp).ok();
    }
    result
}

fn now_nanos() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0)
}

/// The folder for kernel texts: made once a process, `None` where it
/// cannot be made safely (then every kernel's text goes inline).
pub fn folder() -> Option<&'static Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("mlx-lfm-kernels-{}", user_id()?));
        match private_folder(&dir) {
            Ok(()) => Some(dir),
            Err(e) => {
                eprintln!("mlx-lfm: kernel texts stay inline: {}: {e}", dir.display());
                None
            }
        }
    })
    .as_deref()
}

#[cfg(unix)]
fn user_id() -> Option<u32> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    Some(unsafe { libc::geteuid() })
}

#[cfg(not(unix))]
fn user_id() -> Option<u32> {
    None
}

/// `dir` made (mode 0700) or checked: a real folder (no link), this user's,
/// closed to everyone else, in a parent others cannot rename it out of
/// (not writable by them, or sticky as /tmp is).
#[cfg(unix)]
pub fn private_folder(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let refuse = |why: &str| std::io::Error::new(std::io::ErrorKind::PermissionDenied, why.to_string());
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        let mode = std::fs::metadata(parent)?.mode();
        if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            return Err(refuse("its parent folder is writable by others and not sticky"));
        }
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    if !meta.file_type().is_dir() {
        return Err(refuse("not a folder (a link or a file)"));
    }
    if Some(meta.uid()) != user_id() {
        return Err(refuse("another user's folder"));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(refuse("open to other users"));
    }
    Ok(())
}

#[cfg(not(unix))]
pub fn private_folder(_dir: &Path) -> std::io::Result<()> {
    Err(std::io::Error::new(std::io::ErrorKind::Unsupported, "kernel text files are kept on Unix only"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("mlxlfm-ktext-{tag}-{}", std::process::id()));
        std::fs::remove_dir_all(&d).ok();
        d
    }

    /// MLX gets two include lines; the files hold the texts exactly; the
    /// inputs whose shapes the body reads are named where MLX looks for
    /// them (its source), and only those.
    #[test]
    fn the_texts_go_into_files_and_mlx_gets_includes() {
        let dir = scratch("write");
        private_folder(&dir).unwrap();
        let body = "  const int H = q_shape[1];\n  out[0] = k[0] * H;\n";
        let header = "__device__ float f(float x) { return x; }\n";
        let f = KernelFiles::write(&dir, "lfm_x_00ff", &["q", "k", "kk"], body, header).unwrap();
        let b = dir.join("lfm_x_00ff.body.cuh");
        let h = dir.join("lfm_x_00ff.head.cuh");
        assert_eq!(std::fs::read_to_string(&b).unwrap(), body);
        assert_eq!(std::fs::read_to_string(&h).unwrap(), header);
        assert_eq!(f.source, format!("// reads q_shape\n#include \"{}\"\n", b.display()));
        assert_eq!(f.header_line, format!("#include \"{}\"\n", h.display()));
        // No header: no header file, nothing for MLX's header.
        let g = KernelFiles::write(&dir, "lfm_y_01", &["q"], "out[0] = 1;\n", "").unwrap();
        assert_eq!(g.header_line, "");
        assert!(!dir.join("lfm_y_01.head.cuh").exists());
        assert!(g.source.starts_with("#include"), "{}", g.source);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A file that went missing (a temporary folder's cleaner) or was
    /// changed is written again; names and paths an include cannot hold are
    /// refused (the text then stays inline).
    #[test]
    fn missing_files_come_back_and_odd_names_are_refused() {
        let dir = scratch("again");
        private_folder(&dir).unwrap();
        let f = KernelFiles::write(&dir, "lfm_z_02", &[], "out[0] = 2;\n", "").unwrap();
        let b = dir.join("lfm_z_02.body.cuh");
        std::fs::remove_file(&b).unwrap();
        f.ensure().unwrap();
        assert!(!b.exists(), "checked again only after RECHECK_SECS");
        f.checked.store(0, Ordering::Relaxed);
        f.ensure().unwrap();
        assert_eq!(std::fs::read_to_string(&b).unwrap(), "out[0] = 2;\n");
        std::fs::write(&b, "out[0] = 666;\n").unwrap();
        f.checked.store(0, Ordering::Relaxed);
        f.ensure().unwrap();
        assert_eq!(std::fs::read_to_string(&b).unwrap(), "out[0] = 2;\n");
        assert!(KernelFiles::write(&dir, "../x", &[], "x", "").is_err());
        assert!(KernelFiles::write(&dir, "", &[], "x", "").is_err());
        let quote = dir.join("a\"b");
        std::fs::create_dir_all(&quote).unwrap();
        assert!(KernelFiles::write(&quote, "lfm_q", &[], "x", "").is_err());
        // (No temporary file is left behind.)
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().filter_map(|e| e.ok()).map(|e| e.file_name()).collect();
        assert!(left.iter().all(|n| !n.to_string_lossy().contains(".tmp.")), "{left:?}");
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A folder a cleaner removed is made anew by the next check and its
    /// files written again; one that became open to others fails the check
    /// (the kernel's call then fails) instead of being written into.
    #[cfg(unix)]
    #[test]
    fn the_folder_is_checked_again_before_files_come_back() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("recheck");
        private_folder(&dir).unwrap();
        let f = KernelFiles::write(&dir, "lfm_w_03", &[], "out[0] = 3;\n", "__device__ int g() { return 3; }\n").unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        f.checked.store(0, Ordering::Relaxed);
        f.ensure().unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("lfm_w_03.body.cuh")).unwrap(), "out[0] = 3;\n");
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        std::fs::remove_file(dir.join("lfm_w_03.body.cuh")).unwrap();
        f.checked.store(0, Ordering::Relaxed);
        assert!(f.ensure().is_err(), "an open folder written into");
        assert!(!dir.join("lfm_w_03.body.cuh").exists());
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::fs::remove_dir_all(&dir).ok();
    }

    /// A folder whose parent others may write into, without the sticky
    /// bit, is refused (they could rename it away and put theirs there).
    #[cfg(unix)]
    #[test]
    fn a_folder_in_an_open_parent_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let parent = scratch("parent");
        std::fs::create_dir_all(&parent).unwrap();
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(private_folder(&parent.join("k")).is_err(), "an open parent without the sticky bit");
        std::fs::set_permissions(&parent, std::fs::Permissions::from_mode(0o1777)).unwrap();
        private_folder(&parent.join("k")).unwrap();
        std::fs::remove_dir_all(&parent).ok();
    }

    /// The folder must be this user's and closed to others: one open to
    /// everyone, or a link in its place, is refused.
    #[cfg(unix)]
    #[test]
    fn an_open_or_linked_folder_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("open");
        private_folder(&dir).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(private_folder(&dir).is_err(), "a folder open to others");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        private_folder(&dir).unwrap();
        let link = scratch("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        assert!(private_folder(&link).is_err(), "a link in the folder's place");
        std::fs::remove_file(&link).ok();
        std::fs::remove_dir_all(&dir).ok();
    }
}
