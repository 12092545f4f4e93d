'use strict';
// The host allocator the `mlx-lfm` command runs under on Linux. A decode
// step's host time is mostly MLX's per-node bookkeeping, much of it glibc's
// malloc and free; mimalloc in their place decoded the 350M 1.54x and the
// 8B-A1B 1.30x as fast on the H200 (session 21's paired A/B). The addon
// cannot swap the allocator of a running process (libc's malloc is bound
// before any addon loads), so the command relaunches itself once with the
// library the platform package ships beside its .node (scripts/mimalloc.cjs
// builds it) in LD_PRELOAD. A program that requires the package gets the
// same with `node -r mlx-lfm/allocator.cjs app.js` (relaunchSync), or sets
// LD_PRELOAD="$(npx mlx-lfm allocator)" itself.
//
// MLX_LFM_ALLOCATOR=system keeps glibc's; MLX_LFM_ALLOCATOR=/path/lib.so
// preloads that library instead.
const { spawn, spawnSync } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');

const LIBRARY = 'libmimalloc.so';
// Set in the relaunched process: never relaunch twice, whatever the loader did.
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
  if (!asked || asked === 'system') return null;
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
  const want = preloadPath(env);
  if (!want.path) return null;
  const current = (env.LD_PRELOAD || '').split(/[\s:]+/).filter(Boolean);
  if (current.some((p) => p === want.path || /malloc/i.test(path.basename(p)))) return null;
  return { ...env, [MARK]: String(process.pid), LD_PRELOAD: [want.path, ...current].join(':') };
}

/**
 * Runs this command again as a child with the allocator preloaded and
 * resolves with its exit (code, or the signal that ended it); returns
 * null where relaunchEnv() says there is nothing to do. Signals sent to
 * this process go to the child, which owns the terminal's work.
 */
function relaunch(argv = process.argv.slice(1), env = process.env) {
  const childEnv = relaunchEnv(env);
  if (!childEnv) return null;
  const child = spawn(process.execPath, [...process.execArgv, ...argv], { stdio: 'inherit', env: childEnv });
  // A terminal's Ctrl-C (SIGINT) and Ctrl-\ (SIGQUIT) reach the whole
  // foreground group, the child included: sent again it would be a second
  // Ctrl-C (serve stops on the first and dies on the second). Other
  // signals, and those two without a terminal, are this process's alone.
  // (isatty, not process.stdin: the stream would be this process's to
  // read, and stdin is the child's.)
  const tty = require('node:tty').isatty(0);
  const forward = {};
  for (const sig of ['SIGINT', 'SIGTERM', 'SIGHUP', 'SIGQUIT']) {
    forward[sig] = () => {
      if (!(tty && (sig === 'SIGINT' || sig === 'SIGQUIT'))) child.kill(sig);
    };
    process.on(sig, forward[sig]);
  }
  return new Promise((resolve, reject) => {
    child.on('error', reject);
    child.on('exit', (code, signal) => {
      for (const [sig, f] of Object.entries(forward)) process.off(sig, f);
      resolve({ code, signal });
    });
  });
}

/**
 * In the relaunched process: stop (SIGTERM, the graceful path) once the
 * command that relaunched it is gone. A SIGKILL to that command (the OOM
 * killer, `kill -9`, a test's cleanup) cannot be forwarded, and a server
 * left running without it would hold its port with no one to stop it.
 */
function followParent(env = process.env) {
  const parent = Number(env[MARK]);
  // The mark is this process's alone: the processes it starts (serve's
  // follow ranks) have another parent and would stop at once. They find
  // the library in LD_PRELOAD and do not relaunch.
  delete env[MARK];
  if (!Number.isInteger(parent) || parent <= 1) return;
  const timer = setInterval(() => {
    if (process.ppid !== parent) {
      clearInterval(timer);
      process.kill(process.pid, 'SIGTERM');
    }
  }, 500);
  timer.unref();
}

/**
 * For `node -r mlx-lfm/allocator.cjs app.js`: before the program's first
 * line, run it again under the allocator and exit as it exits. Blocking
 * (a preload cannot keep the program from starting otherwise), so this
 * process cannot forward signals: a terminal's reach both, and the child's
 * followParent() stops it when this one is killed.
 */
function relaunchSync(argv = process.argv.slice(1), env = process.env) {
  const childEnv = relaunchEnv(env);
  if (!childEnv) return;
  const r = spawnSync(process.execPath, [...process.execArgv, ...argv], { stdio: 'inherit', env: childEnv });
  if (r.error) throw new Error(`mlx-lfm: could not relaunch under ${childEnv.LD_PRELOAD}: ${r.error.message}`);
  if (r.signal) process.kill(process.pid, r.signal);
  process.exit(r.status ?? 1);
}

module.exports = { preloadPath, refusal, relaunchEnv, relaunch, relaunchSync, followParent, LIBRARY, MARK };
