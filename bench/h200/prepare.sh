#!/bin/bash
# Here, before the device calls of bench/h200/run.py: stages MLX's CUDA wheel
# (split in two to fit the 64 MiB a call may carry), the llama.cpp source that
# node-llama-cpp 3.22.1 ships with llama.cpp's converter, and our release
# mlx-lfm-bench (built against the CPU wheel's headers; on the device the CUDA
# libmlx of the same version is found through LD_LIBRARY_PATH).
set -eu
top=$(git rev-parse --show-toplevel); cd "$top"
shared=${MLX_LFM_SHARED:-$top/../shared}
[ -f .device/a/cuda.part.aa ] || bash "$shared/tools/stage-mlx-cuda.sh"
[ -f .device/llama/llsrc.tgz ] || bash "$shared/tools/llama-anchor/prepare.sh"
# mlx-lm's wheel apart from MLX's (only the rounds' mlx-lm needs it), so
# that the kernel tests' call, .device/b with .device/tests, fits 64 MiB.
if ls .device/b/mlx_lm-*.whl > /dev/null 2>&1; then mkdir -p .device/lm && mv .device/b/mlx_lm-*.whl .device/lm/; fi
cargo build --release --target x86_64-unknown-linux-gnu --bin mlx-lfm-bench
mkdir -p .device/bin
cp target/x86_64-unknown-linux-gnu/release/mlx-lfm-bench .device/bin/ && strip .device/bin/mlx-lfm-bench
# The commit these binaries are of (run.py's save-ptx names it).
git rev-parse --short HEAD > .device/bin/COMMIT
# mimalloc to preload in the `mimalloc` A/B variant (~200 KB).
[ -f .device/bin/libmimalloc.so ] || bash bench/h200/mimalloc.sh
# The library's test binary: the fused kernels' tests run on the device.
mkdir -p .device/tests && rm -f .device/tests/mlx_lfm-*
t=$(cargo test --release --target x86_64-unknown-linux-gnu --lib --no-run --message-format=json 2>/dev/null |
  python3 -c 'import sys, json; print([j["executable"] for j in map(json.loads, sys.stdin) if j.get("executable")][0])')
# Gzipped (~15 MB to ~6): plain, it with .device/b and the tree came within
# 0.3 MB of what a call carries and session 48's call was refused; run.py's
# test_binary() unpacks it there.
cp "$t" .device/tests/ && strip .device/tests/mlx_lfm-* && gzip -f .device/tests/mlx_lfm-*
du -sh .device/a .device/b .device/llama .device/bin .device/tests
[ -d .device/lm ] && du -sh .device/lm || true
# A session's compiled kernels, brought back by run.py's save-ptx (see restore_ptx).
[ -d .device/ptx ] && du -sh .device/ptx || true
