'use strict';
// The H200 benchmark's driver (bench/h200/run.py) runs only on a lent
// device, 30 minutes a session: its own logic (which ncu kernels belong to
// which kernel-bench arm, the PTX cache it carries between sessions, the
// background GGUF chain a round waits for, ncu's per-instruction page) is
// tested here, on any machine,
// by its Python tests (stdlib only, no GPU).
const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { spawnSync } = require('node:child_process');
const fs = require('node:fs');

// (Not helpers.cjs: these tests need no addon.)
const root = path.join(__dirname, '..');

test('the H200 driver keeps its kernel attribution, PTX cache, GGUF chain and source pages straight', () => {
  const file = path.join(root, 'bench', 'h200', 'test_run.py');
  // Every test the file defines ran (none skipped by a loader error).
  const defined = (fs.readFileSync(file, 'utf8').match(/^    def test_/gm) || []).length;
  assert.ok(defined >= 14, `only ${defined} tests defined`);
  const r = spawnSync(process.env.MLX_LFM_PYTHON || 'python3', [file], {
    cwd: root,
    encoding: 'utf8',
    timeout: 120_000,
  });
  assert.equal(r.error, undefined);
  assert.equal(r.status, 0, r.stdout + r.stderr);
  assert.match(r.stderr, new RegExp(`Ran ${defined} tests`));
});
