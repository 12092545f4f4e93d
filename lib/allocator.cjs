'use strict';
// The host allocator the `mlx-lfm` command runs under on Linux. A decode
// step's host time is mostly MLX's per-node bookkeeping, much of it glibc's
// malloc and free; mimalloc in their place decoded the 350M 1.54x and the
// 8B-A1B 1.30x as fast on the H200 (session 21's paired A/B). The addon
// cannot swap the allocator of a running process (libc's malloc is bound
// before any addon loads), so the command replaces itself once (execve:
// the same process, its pid, signals and exit status) with itself run with
// the library the platform package ships beside its .node
// (scripts/mimalloc.cjs builds it) in LD_PRELOAD. A program that requires
// the package gets the same with `node -r mlx-lfm/allocator.cjs app.js`,
// or sets LD_PRELOAD="$(npx mlx-lfm allocator)" itself.
//
// MLX_LFM_ALLOCATOR=system keeps glibc's; MLX_LFM_ALLOCATOR=/path/lib.so
// preloads that library instead.
const fs = require('node:fs');
const path = require('node:path');

const LIBRARY = 'libmimalloc.so';
// Set for the replacing program: never relaunch twice, whatever the loader did.
const MARK = 'MLX_LFM_ALLOCATOR_RELAUNCHED';

/** The preload library beside the .node the package would load, or null. */
function bundled() {
  let node;
  try {
    node = require('./backend.cjs').choose().path;
  } catch {
    return null;
  }
  const lib = node && path.join(path.dirname(node), LIBRARY);
  return lib && fs.existsSync(lib) ? lib : null;
}

/**
 * What a relaunch would preload: { path } or { path: null, reason }.
 * Linux only: macOS's allocator is another design and is left alone.
 */
function preloadPath(env = process.env) {
  if (process.platform !== 'linux') return { path: null, reason: `no allocator is preloaded on ${process.platform}` };
  const want = env.MLX_LFM_ALLOCATOR;
  if (want === 'system') return { path: null, reason: 'MLX_LFM_ALLOCATOR=system' };
  let lib;
  if (want) {
    lib = path.resolve(want);
    if (!fs.existsSync(lib)) return { path: null, reason: `MLX_LFM_ALLOCATOR=${want}: no such file` };
  } else {
    lib = bundled();
    if (!lib) return { path: null, reason: `no ${LIBRARY} beside the native addon (node scripts/mimalloc.cjs builds it)` };
  }
  // The loader splits LD_PRELOAD at spaces and colons.
  if (/[\s:]/.test(lib)) return { path: null, reason: `${lib}: a space or colon in the path cannot go into LD_PRELOAD` };
  return { path: lib };
}

/**
 * Why a library named by hand (MLX_LFM_ALLOCATOR=PATH) cannot be
 * preloaded, or null: such a library is an error, not a silent run on
 * glibc's malloc.
 */
function refusal(env = process.env) {
  const asked = env.MLX_LFM_ALLOCATOR;
  if (!asked || asked === 'system' || process.platform !== 'linux') return null;
  return preloadPath(env).reason || null;
}

/**
 * The environment a relaunch under the allocator runs with, or null where
 * there is nothing to do: not Linux, opted out, already relaunched, no
 * library, or an allocator already preloaded (ours, or one the user chose:
 * jemalloc, tcmalloc, a distro's mimalloc; theirs stands).
 */
function relaunchEnv(env = process.env) {
  if (env[MARK]) return null;
  // A debugger attached (or waiting) holds this process: the replacement
  // would lose it.
  const inspecting = [...process.execArgv, ...(env.NODE_OPTIONS || '').split(/\s+/)].some((a) => a.startsWith('--inspect'));
  if (inspecting || require('node:inspector').url()) return null;
  const want = preloadPath(env);
  if (!want.path) return null;
  const current = (env.LD_PRELOAD || '').split(/[\s:]+/).filter(Boolean);
  if (current.some((p) => p === want.path || /malloc/i.test(path.basename(p)))) return null;
  return { ...env, [MARK]: '1', LD_PRELOAD: [want.path, ...current].join(':') };
}

/**
 * Replaces this process (execve) with the same program and arguments run
 * under the allocator; returns false where relaunchEnv() says there is
 * nothing to do, or where the replacement could not be made (the program
 * then goes on with the allocator it has, saying why on stderr). Throws
 * where refusal() names a problem. Node >= 22.15 has process.execve; older
 * ones use the addon's (loading it first).
 */
function execUnder(argv = process.argv.slice(1), env = process.env) {
  const refused = refusal(env);
  if (refused) throw new Error(refused);
  const next = relaunchEnv(env);
  if (!next) return false;
  const args = [process.execPath, ...process.execArgv, ...argv];
  try {
    if (typeof process.execve === 'function') {
      process.execve(process.execPath, args, next);
    } else {
      const vars = Object.entries(next).filter(([, v]) => v !== undefined).map(([k, v]) => `${k}=${v}`);
      require('../main.cjs').__execWithEnv(process.execPath, args, vars);
    }
  } catch (e) {
    console.error(`mlx-lfm: warning: could not restart under ${next.LD_PRELOAD.split(':')[0]} (${e.message}); running with the C library's malloc`);
  }
  return false;
}

module.exports = { preloadPath, refusal, relaunchEnv, execUnder, LIBRARY, MARK };
