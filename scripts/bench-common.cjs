// Shared by bench-turns.cjs and bench-concurrent.cjs: option parsing, the
// prompt-id formula (the same as src/bin/bench.rs `ids` and
// mlx_lm_ref.py `_ids`), the generated checkpoint to run on, and the mlx-lm
// peer (scripts/ref/mlx_lm_ref.py in $MLX_LFM_PYREF, default .pyref/).
'use strict';
const { spawnSync } = require('node:child_process');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

/**
 * Parses `--name value` options into a copy of `defaults`: numbers must be
 * positive integers, booleans are flags, strings are taken as given.
 */
function parseOptions(argv, defaults, usage) {
  const o = { ...defaults };
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === '--help') {
      console.log(usage);
      process.exit(0);
    }
    const key = a.startsWith('--') ? a.slice(2).replace(/-([a-z])/g, (_, c) => c.toUpperCase()) : null;
    if (!key || !(key in defaults)) throw new Error(`unknown option ${a}\n${usage}`);
    if (typeof defaults[key] === 'boolean') {
      o[key] = true;
      continue;
    }
    if (i + 1 >= argv.length) throw new Error(`${a} needs a value`);
    const v = argv[++i];
    if (typeof defaults[key] === 'number') {
      const n = Number(v);
      if (!Number.isInteger(n) || n < 1) throw new Error(`${a} wants a positive integer, got "${v}"`);
      o[key] = n;
    } else {
      o[key] = key === 'model' ? path.resolve(v) : v;
    }
  }
  return o;
}

function ids(n, vocab, salt) {
  const m = Math.min(vocab, 60000) - 10;
  const out = [];
  for (let i = 0; i < n; i++) out.push((((i * 2654435761) % 2 ** 32 + salt * 40503) % 2 ** 32) % m + 5);
  return out;
}

/** `o.model`, or the generated `o.preset`/`o.dtype` checkpoint (made once). */
async function checkpoint(addon, o) {
  if (o.model) return o.model;
  const dir = path.join(os.homedir(), '.cache', 'mlx-lfm', 'bench', `${o.preset}-${o.dtype}`);
  if (!fs.existsSync(path.join(dir, 'config.json'))) await addon.generateFixture(dir, { preset: o.preset, dtype: o.dtype, seed: 0 });
  return dir;
}

function vocabOf(dir) {
  return JSON.parse(fs.readFileSync(path.join(dir, 'config.json'), 'utf8')).vocab_size;
}

/** Runs one mlx_lm_ref.py request (`req.op`) and returns its JSON answer. */
function mlxLm(req) {
  const root = path.resolve(__dirname, '..');
  const pyref = process.env.MLX_LFM_PYREF || path.join(root, '.pyref');
  const r = spawnSync(process.env.MLX_LFM_PYTHON || 'python3', [path.join(root, 'scripts', 'ref', 'mlx_lm_ref.py')], {
    input: JSON.stringify(req),
    env: { ...process.env, PYTHONPATH: pyref, TOKENIZERS_PARALLELISM: 'false' },
    encoding: 'utf8',
    maxBuffer: 1 << 28,
  });
  if (r.status !== 0) throw new Error(`mlx-lm reference (${req.op}) failed:\n${(r.stderr || String(r.error)).slice(-4000)}`);
  return JSON.parse(r.stdout);
}

module.exports = { parseOptions, ids, checkpoint, vocabOf, mlxLm };
