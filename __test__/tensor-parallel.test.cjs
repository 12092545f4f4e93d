// Tensor parallelism from JavaScript: two Node processes load the tiny
// checkpoint with `distributed: 'ring'` (MLX_HOSTFILE / MLX_RANK over
// loopback, as mlx.launch sets them); rank 0 takes the calls, rank 1 runs
// model.follow(); rank 0 gets what one process gets, and info() says where
// each stands. Then `mlx-lfm serve --tensor-parallel 2` answers 4
// concurrent requests as one process does. (The Rust tests in
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
const { addon, fixture, root, startServe } = require('./helpers.cjs');

const TINY = { preset: 'tiny', dtype: 'f32' };
const GREEDY = { maxTokens: 32, ignoreEos: true };
const PROMPT = [5, 17, 300, 42, 8, 99, 250, 7, 61];
const MESSAGES = [{ role: 'user', content: 'Say something about rivers.' }];

// What rank 0 (and the single process) runs; rank 1 follows.
const SCRIPT = `
const addon = require(${JSON.stringify(path.join(root, 'main.cjs'))});
(async () => {
  const opts = JSON.parse(process.argv[2]);
  const m = await addon.Lfm2Model.load(process.argv[1], opts);
  const info = m.info();
  if (info.rank > 0) {
    const refused = await m.generate([1, 2, 3], { maxTokens: 2 }).then(() => null, (e) => e.message);
    await m.follow();
    process.stdout.write(JSON.stringify({ worldSize: info.worldSize, rank: info.rank, weightBytes: info.weightBytes, refused }));
    m.close();
    return;
  }
  await m.clearPrefixCache();
  const tokens = (await m.generate(${JSON.stringify(PROMPT)}, ${JSON.stringify(GREEDY)})).tokens;
  const chat = await m.chat(${JSON.stringify(MESSAGES)}, ${JSON.stringify(GREEDY)});
  const seeded = (await m.generate(${JSON.stringify(PROMPT)}, { maxTokens: 16, ignoreEos: true, temperature: 0.8, seed: 7 })).tokens;
  // The newer request parameters reach the followers too: a constraint,
  // penalties, logit bias and log-probabilities.
  const extra = await m.generate(${JSON.stringify(PROMPT)}, {
    regex: '[a-z]{3,6}( [a-z]{3,6}){2}', maxTokens: 24, temperature: 1, seed: 5,
    presencePenalty: 0.5, frequencyPenalty: 0.3, logitBias: { 7: 2.5 }, logprobs: true, topLogprobs: 3,
  });
  const constrained = { text: extra.text, tokens: extra.logprobs.map((l) => [l.token, l.topLogprobs.map((t) => t.token)]), logprobs: extra.logprobs.map((l) => l.logprob) };
  // Sessions are refused across ranks (each holds only its share of the state).
  const s = m.createSession();
  await s.send('hi', { maxTokens: 2, ignoreEos: true });
  const file = require('node:path').join(require('node:os').tmpdir(), 'mlxlfm-tp-' + process.pid + '.session');
  const saveErr = await s.save(file).then(() => null, (e) => e.message);
  const loadErr = await m.loadSession(file).then(() => null, (e) => e.message);
  require('node:fs').rmSync(file, { force: true });
  process.stdout.write(JSON.stringify({ worldSize: info.worldSize, rank: info.rank, weightBytes: info.weightBytes, tokens, text: chat.text, seeded, constrained, saveErr, loadErr }));
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

test('two ranks with distributed: ring: rank 0 gives one process\'s tokens, text and samples while rank 1 follows; info() says where each stands', async () => {
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
    });
    const [lead, follower] = ranks.map((r) => JSON.parse(r.out));
    assert.deepEqual(lead.tokens, want.tokens, 'greedy tokens');
    assert.equal(lead.text, want.text, 'chat text');
    assert.deepEqual(lead.seeded, want.seeded, 'seeded sampling');
    assert.match(want.constrained.text, /^[a-z]{3,6}( [a-z]{3,6}){2}$/);
    assert.equal(lead.constrained.text, want.constrained.text, 'constrained, penalised, biased sampling');
    assert.deepEqual(lead.constrained.tokens, want.constrained.tokens, 'drawn and top tokens');
    // Logits agree within 1e-4 (the ranks' partial sums add in another order).
    lead.constrained.logprobs.forEach((lp, i) => assert.ok(Math.abs(lp - want.constrained.logprobs[i]) < 1e-3, `logprob ${i}: ${lp} vs ${want.constrained.logprobs[i]}`));
    assert.match(follower.refused, /rank 1 of a tensor-parallel group: it follows rank 0/);
    assert.equal(want.saveErr, null, 'one process saves and reloads its session');
    assert.equal(want.loadErr, null);
    assert.match(lead.saveErr, /sessions cannot be saved on a model split over 2 ranks/);
    assert.match(lead.loadErr, /sessions cannot be loaded on a model split over 2 ranks/);
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
});

test('a tensor-parallel load refuses prefixCacheDir before joining a group', async () => {
  const dir = await fixture('tiny', TINY);
  await assert.rejects(
    addon.Lfm2Model.load(dir, { distributed: 'ring', prefixCacheDir: os.tmpdir() }),
    /prefixCacheDir cannot be combined with tensor parallelism/,
  );
});

test('distributed takes only a backend MLX knows', async () => {
  const dir = await fixture('tiny', TINY);
  await assert.rejects(addon.Lfm2Model.load(dir, { distributed: 'tcp' }), /distributed `tcp` is not valid; use ring, nccl, jaccl, mpi, any/);
});

test('`mlx-lfm serve --tensor-parallel 2` reports worldSize and answers 4 concurrent requests as one process', async () => {
  const dir = await fixture('tiny', TINY);
  const one = await addon.Lfm2Model.load(dir, { useBlockPagedCache: false });
  const prompts = ['Tell me about rivers.', 'Name a color.', 'Count to five.', 'What is a cat?'];
  const want = [];
  for (const p of prompts) want.push((await one.chat([{ role: 'user', content: p }], { maxTokens: 16, ignoreEos: true })).text);
  one.close();
  const serve = await startServe(['--model', dir, '--port', '0', '--no-paged', '--tensor-parallel', '2', '--name', 'tp'], { MLX_LFM_TP_TIMEOUT_S: '60' });
  const { url } = serve;
  try {
    const base = url.replace(/\/v1$/, '');
    assert.deepEqual(await (await fetch(`${base}/health`)).json(), { status: 'ok', model: 'tp', worldSize: 2 });
    const answers = await Promise.all(
      prompts.map(async (p) => {
        const r = await fetch(`${url}/chat/completions`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify({ model: 'tp', messages: [{ role: 'user', content: p }], max_tokens: 16, ignore_eos: true, temperature: 0 }),
        });
        const body = await r.json();
        assert.equal(r.status, 200, JSON.stringify(body));
        return body.choices[0].message.content;
      }),
    );
    assert.deepEqual(answers, want);
  } finally {
    serve.child.kill('SIGTERM');
    assert.equal(await serve.exited, 0, serve.log());
  }
});

test('a rank killed while `serve --tensor-parallel 2` generates stops the server with a message, not a hang', async () => {
  const dir = await fixture('tiny', TINY);
  const { child, url, exited, log } = await startServe(['--model', dir, '--port', '0', '--no-paged', '--tensor-parallel', '2', '--name', 'tp'], {
    MLX_LFM_TP_TIMEOUT_S: '20',
  });
  // A long streamed generation; at its first token the follower (the one
  // `follow` child of this server) is killed, so the kill always lands
  // mid-generation however fast this machine is.
  let firstToken;
  const started = new Promise((r) => (firstToken = r));
  const reply = fetch(`${url}/chat/completions`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: 'tp', messages: [{ role: 'user', content: 'hi' }], max_tokens: 100000, ignore_eos: true, stream: true }),
  }).then(
    async (r) => {
      let text = '';
      try {
        for await (const chunk of r.body) {
          text += Buffer.from(chunk).toString();
          if (text.includes('data: ')) firstToken();
        }
      } catch (e) {
        return `stream broke: ${e.message}`;
      } finally {
        firstToken();
      }
      return text.includes('data: [DONE]') ? 'completed' : 'cut short';
    },
    (e) => {
      firstToken();
      return e.message;
    },
  );
  await started;
  // (On Linux the serve command runs as its own child, relaunched under
  // the allocator it ships: the follower is a grandchild then.)
  const { spawnSync } = require('node:child_process');
  const under = (pid, pattern) =>
    spawnSync('pgrep', ['-P', String(pid), ...(pattern ? ['-f', pattern] : [])], { encoding: 'utf8' })
      .stdout.trim().split('\n').filter(Boolean).map(Number);
  const follower = [child.pid, ...under(child.pid)].flatMap((p) => under(p, 'cli.cjs follow'))[0];
  assert.ok(follower > 0, `no follower found under ${child.pid}`);
  const killedAt = Date.now();
  process.kill(follower, 'SIGKILL');
  const timer = setTimeout(() => child.kill('SIGKILL'), 60_000);
  const code = await exited;
  clearTimeout(timer);
  assert.ok(Date.now() - killedAt < 45_000, 'the server took too long to stop');
  assert.notEqual(code, 0);
  assert.match(log(), /rank 1 exited \(SIGKILL\) while serving; stopping/);
  assert.notEqual(await reply, 'completed', 'the stream finished normally although a rank died');
});

test('`serve --tensor-parallel 2 --hostfile` starts a rank on another host over ssh (MLX_LFM_SSH; here a stand-in that runs the command on this machine)', async (t) => {
  // A non-loopback address of this machine stands for "another host".
  const ip = Object.values(os.networkInterfaces()).flat().find((a) => a && a.family === 'IPv4' && !a.internal)?.address;
  if (!ip) {
    t.skip('this machine has no non-loopback IPv4 address to stand for another host');
    return;
  }
  const dir = await fixture('tiny', TINY);
  const one = await addon.Lfm2Model.load(dir, { useBlockPagedCache: false });
  const want = (await one.chat(MESSAGES, { maxTokens: 16, ignoreEos: true })).text;
  one.close();
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'mlxlfm-ssh-'));
  const log = path.join(tmp, 'ssh.log');
  const ssh = path.join(tmp, 'ssh');
  // What ssh does with `ssh HOST CMD`, minus the network: run CMD in a shell.
  fs.writeFileSync(ssh, '#!/bin/sh\necho "$1" >> "$FAKE_SSH_LOG"\nexec /bin/sh -c "$2"\n', { mode: 0o755 });
  const hostfile = path.join(tmp, 'hosts.json');
  fs.writeFileSync(hostfile, JSON.stringify([[`127.0.0.1:${await freePort()}`], [`${ip}:${await freePort()}`]]));
  const serve = await startServe(['--model', dir, '--port', '0', '--no-paged', '--tensor-parallel', '2', '--hostfile', hostfile, '--name', 'tp'], {
    MLX_LFM_TP_TIMEOUT_S: '60',
    MLX_LFM_SSH: ssh,
    FAKE_SSH_LOG: log,
  });
  const { url } = serve;
  try {
    assert.match(serve.log(), new RegExp(`starting rank 1 on ${ip.replace(/\./g, '\\.')} over `));
    assert.equal(fs.readFileSync(log, 'utf8').trim(), ip, 'ssh was asked for the rank\'s host');
    const base = url.replace(/\/v1$/, '');
    assert.deepEqual(await (await fetch(`${base}/health`)).json(), { status: 'ok', model: 'tp', worldSize: 2 });
    const r = await fetch(`${url}/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'tp', messages: MESSAGES, max_tokens: 16, ignore_eos: true, temperature: 0 }),
    });
    const body = await r.json();
    assert.equal(r.status, 200, JSON.stringify(body));
    assert.equal(body.choices[0].message.content, want);
  } finally {
    serve.child.kill('SIGTERM');
    assert.equal(await serve.exited, 0, serve.log());
    fs.rmSync(tmp, { recursive: true, force: true });
  }
});
