// Shared by the JS tests: fixtures generated once per run, and the mlx-lm
// reference (pinned, CPU) run as a subprocess.
'use strict';
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { spawn, spawnSync } = require('node:child_process');
const addon = require('../main.cjs');

const root = path.resolve(__dirname, '..');
const fixtureRoot = path.join(os.tmpdir(), `mlx-lfm-test-${process.pid}`);
process.on('exit', () => fs.rmSync(fixtureRoot, { recursive: true, force: true }));

const made = new Map();
/** A generated checkpoint directory for `options` (cached per process). */
async function fixture(name, options = {}) {
  if (!made.has(name)) {
    const dir = path.join(fixtureRoot, name);
    made.set(name, addon.generateFixture(dir, options).then(() => dir));
  }
  return made.get(name);
}

/** A writable copy of a fixture, for tests that damage it. */
async function fixtureCopy(name, options, copyName) {
  const src = await fixture(name, options);
  const dst = path.join(fixtureRoot, copyName);
  fs.rmSync(dst, { recursive: true, force: true });
  fs.cpSync(src, dst, { recursive: true });
  return dst;
}

function pyref() {
  const dir = process.env.MLX_LFM_PYREF || path.join(root, '.pyref');
  if (!fs.existsSync(path.join(dir, 'mlx_lm'))) {
    throw new Error(`the mlx-lm reference is not installed at ${dir}; run the tests through \`npm test\`, which installs it`);
  }
  return dir;
}

/** Runs scripts/ref/mlx_lm_ref.py with one JSON request; returns its answer. */
function reference(request) {
  const r = spawnSync(process.env.MLX_LFM_PYTHON || 'python3', [path.join(root, 'scripts', 'ref', 'mlx_lm_ref.py')], {
    input: JSON.stringify(request),
    env: { ...process.env, PYTHONPATH: pyref(), TOKENIZERS_PARALLELISM: 'false' },
    encoding: 'utf8',
    maxBuffer: 1 << 30,
  });
  if (r.status !== 0) throw new Error(`mlx-lm reference failed:\n${r.stderr}`);
  return JSON.parse(r.stdout);
}

function maxAbsDiff(a, b) {
  if (a.length !== b.length) throw new Error(`length ${a.length} vs ${b.length}`);
  let m = 0;
  for (let i = 0; i < a.length; i++) m = Math.max(m, Math.abs(a[i] - b[i]));
  return m;
}

/**
 * `mlx-lfm serve ARGS` in a child process, once it prints the URL it serves
 * at: `{ child, url, exited, log }`, where `exited` resolves with its exit
 * code and `log()` is its stderr so far.
 */
async function startServe(args, env = {}) {
  const child = spawn(process.execPath, [path.join(root, 'cli.cjs'), 'serve', ...args], {
    stdio: ['ignore', 'ignore', 'pipe'],
    env: { ...process.env, ...env },
  });
  let stderr = '';
  const exited = new Promise((resolve) => child.once('exit', (code) => resolve(code)));
  const url = await new Promise((resolve, reject) => {
    child.stderr.on('data', (d) => {
      stderr += d;
      const m = /serving \S+ at (http:\/\/\S+)/.exec(stderr);
      if (m) resolve(m[1]);
    });
    child.once('exit', (code) => reject(new Error(`serve exited with ${code}: ${stderr}`)));
  });
  return { child, url, exited, log: () => stderr };
}

module.exports = { addon, fixture, fixtureCopy, reference, maxAbsDiff, root, startServe };
