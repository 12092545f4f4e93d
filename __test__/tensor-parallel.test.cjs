// Tensor parallelism from JavaScript: two Node processes, each loading the
// tiny checkpoint with `distributed: 'ring'` (MLX_HOSTFILE / MLX_RANK over
// loopback, as mlx.launch sets them), make the same calls and get what one
// process gets; info() says where each stands. (The Rust tests in
// src/engine/tp_tests.rs compare logits, paged caches, MoE and quantized
// models, a dead rank and an unsplittable config.)
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const net = require('node:net');
const os = require('node:os');
const path = require('node:path');
const { spawn } = require('node:child_process');
const { addon, fixture, root } = require('./helpers.cjs');

const TINY = { preset: 'tiny', dtype: 'f32' };
const GREEDY = { maxTokens: 32, ignoreEos: true };
const PROMPT = [5, 17, 300, 42, 8, 99, 250, 7, 61];
const MESSAGES = [{ role: 'user', content: 'Say something about rivers.' }];

// What every rank (and the single process) runs: sequential calls, so all
// ranks run the same computations in the same order.
const SCRIPT = `
const addon = require(${JSON.stringify(path.join(root, 'main.cjs'))});
(async () => {
  const opts = JSON.parse(process.argv[2]);
  const m = await addon.Lfm2Model.load(process.argv[1], opts);
  const info = m.info();
  const tokens = (await m.generate(${JSON.stringify(PROMPT)}, ${JSON.stringify(GREEDY)})).tokens;
  const chat = await m.chat(${JSON.stringify(MESSAGES)}, ${JSON.stringify(GREEDY)});
  const seeded = (await m.generate(${JSON.stringify(PROMPT)}, { maxTokens: 16, ignoreEos: true, temperature: 0.8, seed: 7 })).tokens;
  process.stdout.write(JSON.stringify({ worldSize: info.worldSize, rank: info.rank, weightBytes: info.weightBytes, tokens, text: chat.text, seeded }));
  m.close();
})().catch((e) => { process.stderr.write(String(e && e.message)); process.exit(1); });
`;

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

function runRank(dir, opts, env) {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, ['-e', SCRIPT, dir, JSON.stringify(opts)], {
      env: { ...process.env, ...env, MLX_LFM_TP_TIMEOUT_S: '60' },
    });
    let out = '';
    let err = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (err += d));
    const timer = setTimeout(() => child.kill('SIGKILL'), 180_000);
    child.on('exit', (code) => {
      clearTimeout(timer);
      resolve({ code, out, err });
    });
  });
}

test('two ranks with distributed: ring give one process\'s tokens and text; info() and the checks', async () => {
  const dir = await fixture('tiny', TINY);
  const opts = { useBlockPagedCache: false };
  const one = await runRank(dir, opts, {});
  assert.equal(one.code, 0, one.err);
  const want = JSON.parse(one.out);
  assert.equal(want.worldSize, 1);
  assert.equal(want.rank, 0);

  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'mlx-lfm-tp-'));
  try {
    const hostfile = path.join(tmp, 'hosts.json');
    fs.writeFileSync(hostfile, JSON.stringify([[`127.0.0.1:${await freePort()}`], [`127.0.0.1:${await freePort()}`]]));
    const ranks = await Promise.all(
      [0, 1].map((r) => runRank(dir, { ...opts, distributed: 'ring' }, { MLX_HOSTFILE: hostfile, MLX_RANK: String(r) })),
    );
    ranks.forEach((r, i) => {
      assert.equal(r.code, 0, `rank ${i}: ${r.err}`);
      const got = JSON.parse(r.out);
      assert.equal(got.worldSize, 2);
      assert.equal(got.rank, i);
      assert.ok(got.weightBytes < want.weightBytes, `rank ${i} holds ${got.weightBytes} of ${want.weightBytes} bytes`);
      assert.deepEqual(got.tokens, want.tokens, `rank ${i}: greedy tokens`);
      assert.equal(got.text, want.text, `rank ${i}: chat text`);
      assert.deepEqual(got.seeded, want.seeded, `rank ${i}: seeded sampling`);
    });
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
});

test('distributed takes only a backend MLX knows', async () => {
  const dir = await fixture('tiny', TINY);
  await assert.rejects(addon.Lfm2Model.load(dir, { distributed: 'tcp' }), /distributed `tcp` is not valid; use ring, nccl, jaccl, mpi, any/);
});
