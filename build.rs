//! Build script: provisions MLX, compiles our C++ bridge against it, and sets
//! the RUNPATH that lets the built `.node` (and test/bench binaries) find
//! libmlx without LD_LIBRARY_PATH.
//!
//! MLX comes from the pinned PyPI wheels (`mlx-cpu`, `mlx-cuda-13`,
//! `mlx-metal`), installed with pip into `.mlx/<backend>-<version>/` the first
//! time a build needs it. `MLX_DIR` points the build at an MLX the user
//! already has instead (a wheel install dir, or a CMake install prefix).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

const MLX_VERSION: &str = "0.32.4";
const BACKENDS: &[&str] = &["cpu", "cuda", "metal"];

fn main() {
    println!("cargo:rerun-if-env-changed=MLX_DIR");
    println!("cargo:rerun-if-env-changed=MLX_LFM_BACKEND");
    println!("cargo:rerun-if-env-changed=MLX_LFM_PYTHON");
    println!("cargo:rerun-if-changed=cpp");

    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());

    let mlx = match env::var("MLX_DIR") {
        Ok(dir) if !dir.is_empty() => locate(Path::new(&dir)).unwrap_or_else(|| {
            fail(&format!(
                "MLX_DIR={dir} does not hold an MLX install: expected mlx/include/mlx/mlx.h and \
                 mlx/lib/libmlx.* (a pip --target dir) or include/mlx/mlx.h and lib/libmlx.* (a CMake prefix)."
            ))
        }),
        _ => {
            let backend = backend(&target_os);
            let dir = manifest.join(".mlx").join(format!("{backend}-{MLX_VERSION}"));
            if locate(&dir).is_none() {
                provision(&backend, &dir);
            }
            locate(&dir).unwrap_or_else(|| {
                fail(&format!("pip finished but {} still holds no libmlx", dir.display()))
            })
        }
    };

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .include(&mlx.include)
        .include("cpp")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-sign-compare")
        .opt_level(2);
    build.file("cpp/mlxb.cpp");
    build.compile("mlxb");

    println!("cargo:rustc-link-search=native={}", mlx.lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    if target_os == "macos" {
        // The npm platform package puts the wheel's mlx/ folder next to the .node.
        println!("cargo:rustc-link-arg=-Wl,-rpath,@loader_path/mlx/lib");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", mlx.lib.display());
    } else {
        println!("cargo:rustc-link-arg=-Wl,-rpath,$ORIGIN/mlx/lib");
        println!("cargo:rustc-link-arg=-Wl,-rpath,{}", mlx.lib.display());
    }
    println!("cargo:rustc-env=MLX_LFM_MLX_LIB_DIR={}", mlx.lib.display());

    napi_build::setup();
}

struct MlxPaths {
    include: PathBuf,
    lib: PathBuf,
}

fn locate(dir: &Path) -> Option<MlxPaths> {
    for (inc, lib) in [("mlx/include", "mlx/lib"), ("include", "lib")] {
        let include = dir.join(inc);
        let lib = dir.join(lib);
        let has_lib = ["libmlx.so", "libmlx.dylib"].iter().any(|n| lib.join(n).exists());
        if include.join("mlx/mlx.h").exists() && has_lib {
            return Some(MlxPaths { include, lib });
        }
    }
    None
}

fn backend(target_os: &str) -> String {
    match env::var("MLX_LFM_BACKEND") {
        Ok(b) if !b.is_empty() => {
            if !BACKENDS.contains(&b.as_str()) {
                fail(&format!("MLX_LFM_BACKEND={b} is not valid; use one of: {}", BACKENDS.join(", ")));
            }
            if b == "metal" && target_os != "macos" {
                fail("MLX_LFM_BACKEND=metal needs macOS; on Linux use cpu or cuda");
            }
            if b != "metal" && target_os == "macos" {
                fail(&format!("MLX_LFM_BACKEND={b} is not available on macOS; use metal"));
            }
            b
        }
        _ => if target_os == "macos" { "metal".into() } else { "cpu".into() },
    }
}

fn wheel(backend: &str) -> String {
    let name = match backend {
        "cuda" => "mlx-cuda-13",
        "metal" => "mlx-metal",
        _ => "mlx-cpu",
    };
    format!("{name}=={MLX_VERSION}")
}

fn provision(backend: &str, dir: &Path) {
    let python = env::var("MLX_LFM_PYTHON").unwrap_or_else(|_| "python3".into());
    let pkg = wheel(backend);
    let how = format!(
        "  {python} -m pip install --no-deps --target {} {pkg}\n\
         or point the build at an existing MLX {MLX_VERSION} with MLX_DIR=/path/to/it",
        dir.display()
    );
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    eprintln!("mlx-lfm: installing {pkg} into {} (one time)", dir.display());
    let status = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps", "--target"])
        .arg(&tmp)
        .arg(&pkg)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => fail(&format!("`{python} -m pip install {pkg}` failed ({s}). To install MLX by hand run:\n{how}")),
        Err(e) => fail(&format!(
            "could not run `{python}` ({e}); mlx-lfm needs Python 3 with pip to fetch the MLX wheel.\n\
             Install Python 3 and pip, then run:\n{how}"
        )),
    }
    // Move into place only when complete, so an interrupted install is retried.
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir.parent().unwrap()).ok();
    if let Err(e) = std::fs::rename(&tmp, dir) {
        fail(&format!("could not move {} to {}: {e}", tmp.display(), dir.display()));
    }
}

fn fail(msg: &str) -> ! {
    eprintln!("\nmlx-lfm build error: {msg}\n");
    panic!("mlx-lfm build error: {msg}");
}
