'use strict';
// Chooses which native package to load, before napi-rs's generated loader
// (index.cjs) runs. On Linux x64 two flavours can be installed: the CPU
// package (MLX's CPU build) and the CUDA one (MLX's CUDA 13 build, which
// needs an NVIDIA GPU and the CUDA 13 libraries). The CUDA one is preferred
// when it is installed and a GPU is present; MLX_LFM_BACKEND=cpu|cuda
// decides instead. A CUDA package that cannot load (libraries missing)
// falls back to the CPU one, and the reason is kept for mlxInfo().
const fs = require('node:fs');
const path = require('node:path');

const root = path.resolve(__dirname, '..');

const PLATFORMS = {
  'linux-x64': 'linux-x64-gnu',
  'linux-arm64': 'linux-arm64-gnu',
  'darwin-arm64': 'darwin-arm64',
};

function resolvePackage(name) {
  try {
    const dir = path.dirname(require.resolve(`${name}/package.json`, { paths: [root] }));
    const main = JSON.parse(fs.readFileSync(path.join(dir, 'package.json'), 'utf8')).main;
    return path.join(dir, main);
  } catch {
    return null;
  }
}

function nvidiaGpuPresent() {
  // The driver's files: no process spawned, nothing loaded.
  return fs.existsSync('/proc/driver/nvidia/version') || fs.existsSync('/dev/nvidia0');
}

/** { path, package, reason }: `path` null means napi's own loader decides. */
function choose(env = process.env) {
  const platform = PLATFORMS[`${process.platform}-${process.arch}`];
  if (!platform) {
    return { path: null, package: null, reason: `no prebuilt package for ${process.platform}-${process.arch}` };
  }
  const local = path.join(root, `mlx-lfm.${platform}.node`);
  const want = (env.MLX_LFM_BACKEND || '').toLowerCase();
  if (want && !['cpu', 'cuda', 'metal'].includes(want)) {
    throw new Error(`MLX_LFM_BACKEND=${env.MLX_LFM_BACKEND} is not valid: use cpu or cuda (or leave it unset)`);
  }
  if (fs.existsSync(local)) {
    return { path: local, package: 'local build', reason: `a built ${path.basename(local)} is next to the package` };
  }
  const cpuName = `mlx-lfm-${platform}`;
  const cudaName = `mlx-lfm-${platform}-cuda`;
  const cpu = resolvePackage(cpuName);
  const cuda = platform === 'linux-x64-gnu' ? resolvePackage(cudaName) : null;
  const cpuChoice = (reason) => ({ path: cpu, package: cpu ? cpuName : null, reason, fallback: null });
  if (want === 'cpu') return cpuChoice('MLX_LFM_BACKEND=cpu');
  if (want === 'cuda') {
    if (!cuda) {
      throw new Error(`MLX_LFM_BACKEND=cuda, but ${cudaName} is not installed: npm install ${cudaName}`);
    }
    return { path: cuda, package: cudaName, reason: 'MLX_LFM_BACKEND=cuda', fallback: null };
  }
  // MLX_LFM_NVIDIA_GPU=1|0 overrides the detection (tests; containers that
  // hide the driver's files).
  const gpu = env.MLX_LFM_NVIDIA_GPU !== undefined ? env.MLX_LFM_NVIDIA_GPU === '1' : nvidiaGpuPresent();
  if (cuda && gpu) {
    return {
      path: cuda,
      package: cudaName,
      reason: 'the CUDA package is installed and an NVIDIA GPU is present',
      fallback: cpu ? cpuChoice : null,
    };
  }
  if (cuda) return cpuChoice('the CUDA package is installed but no NVIDIA GPU was found');
  if (!cpu) return { path: null, package: null, reason: `${cpuName} is not installed`, fallback: null };
  return cpuChoice(`${cudaName} is not installed`);
}

/** Loads index.cjs with the chosen binary; returns [binding, choice]. */
function load() {
  const choice = choose();
  const attempt = (c) => {
    const key = 'NAPI_RS_NATIVE_LIBRARY_PATH';
    const before = process.env[key];
    // napi's loader reads this variable; restore it at once so no other
    // napi-rs package in the process sees our path.
    if (c.path) process.env[key] = c.path;
    try {
      // Loaded first on its own for a precise error (index.cjs would only
      // say it found no binding); Node caches it for index.cjs's require.
      if (c.path) require(c.path);
      return require(path.join(root, 'index.cjs'));
    } finally {
      if (before === undefined) delete process.env[key];
      else process.env[key] = before;
    }
  };
  try {
    return [attempt(choice), choice];
  } catch (e) {
    if (!choice.fallback && choice.package && choice.package.endsWith('-cuda')) {
      // Nothing to fall back to: say what the CUDA build needs, not only
      // which library the dynamic loader missed.
      const first = (e && e.message ? e.message : String(e)).split('\n')[0];
      throw new Error(
        `${choice.package} could not load (${first}): MLX's CUDA build needs the NVIDIA driver and the CUDA 13 ` +
          'libraries (cuBLAS, cuDNN 9, NCCL, NVRTC, cuFFT, cuSOLVER) on LD_LIBRARY_PATH, and no CPU package ' +
          `(${choice.package.replace(/-cuda$/, '')}) is installed to fall back to`,
      );
    }
    if (!choice.fallback) throw e;
    // index.cjs failed half way: let the retry evaluate it afresh.
    delete require.cache[require.resolve(path.join(root, 'index.cjs'))];
    const first = (e && e.message ? e.message : String(e)).split('\n')[0];
    const cpu = choice.fallback(`${choice.package} could not load (${first}); using the CPU package`);
    return [attempt(cpu), cpu];
  }
}

module.exports = { choose, load, PLATFORMS };
