#!/bin/bash
# Runs the packed CUDA npm package from Node on the H200 (issue 17, item 7):
# installs the root and CUDA tarballs with npm (offline: the device reaches no
# registry; the other optional platform packages are skipped as npm skips any
# optional dependency it cannot fetch), then loads, chats, benchmarks and
# serves through the installed package exactly as a user's app would.
#
# Here:   npm run package -- --cuda --out /tmp/dist   then   bash bench/h200/node-package.sh prepare
# Device, back to back (the machine keeps /tmp only while warm):
#   1. carry [".device/np1"]:  bash bench/h200/node-package.sh stage
#   2. carry [".device/np2"]:  bash bench/h200/node-package.sh run
set -eu
top=$(cd "$(dirname "$0")/../.." && pwd)
case "${1:-}" in
prepare)
  dist=${DIST:-/tmp/dist}
  cd "$top"; rm -rf .device/np1 .device/np2; mkdir -p .device/np1 .device/np2
  n=$(dirname "$(dirname "$(readlink -f "$(command -v node)")")")
  # Node and its npm, as this machine has them (Node 20, glibc x64).
  tar -C "$n" -cJf .device/np1/node.tar.xz bin/node lib/node_modules/npm
  ( cd .device/np1 && split -b 38000000 "$dist"/mlx-lfm-linux-x64-gnu-cuda-*.tgz cuda.tgz.part. )
  mv .device/np1/cuda.tgz.part.a[b-z] .device/np2/
  cp "$dist"/mlx-lfm-0.1.0.tgz .device/np2/
  du -sh .device/np1 .device/np2 ;;
stage)
  mkdir -p /tmp/np && cp .device/np1/* /tmp/np/ && ls -la /tmp/np ;;
run)
  out=${OUT:-/tmp/np/out}; mkdir -p "$out"
  cd /tmp/np
  cat cuda.tgz.part.aa "$top"/.device/np2/cuda.tgz.part.a[b-z] > mlx-lfm-linux-x64-gnu-cuda-0.1.0.tgz
  mkdir -p node && tar -C node -xJf node.tar.xz
  export PATH=/tmp/np/node/bin:$PATH
  # Only the node binary and npm's folder travel (bin/npm is a link).
  npm() { node /tmp/np/node/lib/node_modules/npm/bin/npm-cli.js "$@"; }
  # The CUDA 13 libraries MLX's CUDA build links (cuBLAS, cuDNN, NCCL, NVRTC,
  # ...) from the device's pip-installed NVIDIA packages: what the CUDA
  # package's README asks a user to put on the library path. Not MLX itself:
  # the package carries its own libmlx.
  nv=$(python3 -c "import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]))")
  export LD_LIBRARY_PATH=$(ls -d "$nv"/nvidia/*/lib | tr '\n' ':')
  {
    echo "node $(node --version), npm $(npm --version)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    rm -rf app && mkdir app && cd app
    echo '{"name":"app","version":"1.0.0","private":true}' > package.json
    npm install --offline --cache /tmp/np/npm-cache --no-audit --no-fund \
      "$top"/.device/np2/mlx-lfm-0.1.0.tgz /tmp/np/mlx-lfm-linux-x64-gnu-cuda-0.1.0.tgz
    ls node_modules
    cp "$top"/bench/h200/node-package.cjs . && node node-package.cjs /tmp/np/models "$out/node-package.json"
    cli=node_modules/mlx-lfm/cli.cjs
    node $cli --version
    for p in compiled eager; do
      node $cli bench --model /tmp/np/models/lfm2-1.2b-bf16 --prompt-tokens 512 --gen 256 --reps 3 --decode-path $p
    done
  } 2>&1 | tee "$out/node-package.log" ;;
*) echo "usage: $0 prepare|stage|run" >&2; exit 2 ;;
esac
