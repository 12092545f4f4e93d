'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { spawnSync } = require('node:child_process');
const { addon, fixture, root } = require('./helpers.cjs');

const cli = path.join(root, 'cli.cjs');

test('`mlx-lfm chat --model DIR --prompt TEXT` prints the reply and the metrics', async () => {
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const r = spawnSync(process.execPath, [cli, 'chat', '--model', dir, '--prompt', 'Hello', '--max-tokens', '5'], { encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
  // The reply printed is the model's own: the same request through the API.
  const m = await addon.Lfm2Model.load(dir);
  const want = await m.chat([{ role: 'user', content: 'Hello' }], { maxTokens: 5 });
  m.close();
  assert.ok(want.text.length > 0);
  assert.equal(r.stdout.trim(), want.text.trim());
  const metrics = r.stderr.match(/prompt (\d+) tok, completion (\d+) tok \| TTFT [\d.]+ ms \| prefill [\d.]+ tok\/s \| decode [\d.]+ tok\/s/);
  assert.ok(metrics, r.stderr);
  assert.equal(Number(metrics[1]), want.usage.promptTokens);
  assert.equal(Number(metrics[2]), want.usage.completionTokens);
});

test('interactive chat keeps the conversation', async () => {
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const r = spawnSync(process.execPath, [cli, 'chat', '--model', dir, '--max-tokens', '3'], { input: 'hi\nagain\n\n', encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
  const prompts = [...r.stderr.matchAll(/prompt (\d+) tok/g)].map((m) => Number(m[1]));
  assert.equal(prompts.length, 2);
  assert.ok(prompts[1] > prompts[0] + 3, `second turn should include the first: ${prompts}`);
});

test('the CLI reports bad input and exits non-zero', () => {
  const r = spawnSync(process.execPath, [cli, 'chat', '--model', '/no/such/dir', '--prompt', 'x'], { encoding: 'utf8' });
  assert.equal(r.status, 1);
  assert.match(r.stderr, /model path \/no\/such\/dir is not a directory/);
  const b = spawnSync(process.execPath, [cli, 'chat', '--max-tokens', 'lots'], { encoding: 'utf8' });
  assert.equal(b.status, 1);
  assert.match(b.stderr, /--max-tokens must be an integer/);
});
