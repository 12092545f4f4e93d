// Decode-path routing: compiled by default, eager on request, invalid
// settings rejected with the valid values named; both paths agree.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { addon, fixture } = require('./helpers.cjs');

async function withEnv(value, fn) {
  const old = process.env.MLX_LFM_DISABLE_COMPILED;
  if (value === undefined) delete process.env.MLX_LFM_DISABLE_COMPILED;
  else process.env.MLX_LFM_DISABLE_COMPILED = value;
  try {
    return await fn();
  } finally {
    if (old === undefined) delete process.env.MLX_LFM_DISABLE_COMPILED;
    else process.env.MLX_LFM_DISABLE_COMPILED = old;
  }
}

for (const [label, name, opts] of [
  ['dense f32', 'tiny', { preset: 'tiny', dtype: 'f32' }],
  ['dense bf16', 'tiny-bf16', { preset: 'tiny', dtype: 'bf16' }],
  ['moe f32', 'tiny-moe', { preset: 'tiny-moe', dtype: 'f32' }],
  ['moe bf16', 'tiny-moe-bf16', { preset: 'tiny-moe', dtype: 'bf16' }],
]) {
  test(`compiled is the default and generates exactly what eager does: ${label}`, async () => {
    const dir = await fixture(name, opts);
    const compiled = await withEnv(undefined, () => addon.Lfm2Model.load(dir));
    const eager = await addon.Lfm2Model.load(dir, { decodePath: 'eager' });
    assert.equal(compiled.info().decodePath, 'compiled');
    assert.match(compiled.info().decodePathReason, /default/);
    assert.equal(eager.info().decodePath, 'eager');
    for (const prompt of [[1], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]) {
      const a = await compiled.generate(prompt, { maxTokens: 64, ignoreEos: true });
      const b = await eager.generate(prompt, { maxTokens: 64, ignoreEos: true });
      assert.deepEqual(a.tokens, b.tokens);
      assert.ok(new Set(a.tokens).size > 3);
    }
    compiled.close();
    eager.close();
  });
}

test('MLX_LFM_DISABLE_COMPILED=1 forces eager; an invalid value is an error naming the valid ones', async () => {
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const m = await withEnv('1', () => addon.Lfm2Model.load(dir));
  assert.equal(m.info().decodePath, 'eager');
  assert.match(m.info().decodePathReason, /MLX_LFM_DISABLE_COMPILED=1/);
  m.close();
  const z = await withEnv('0', () => addon.Lfm2Model.load(dir));
  assert.equal(z.info().decodePath, 'compiled');
  z.close();
  await withEnv('maybe', () =>
    assert.rejects(addon.Lfm2Model.load(dir), /MLX_LFM_DISABLE_COMPILED=maybe is not valid; use 1\/true\/yes\/on or 0\/false\/no\/off/));
  await assert.rejects(async () => addon.Lfm2Model.load(dir, { decodePath: 'fast' }), /decodePath `fast` is not valid; use compiled or eager/);
});

test('two models in one process keep their own compiled paths', async () => {
  const dense = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const moe = await fixture('tiny-moe', { preset: 'tiny-moe', dtype: 'f32' });
  const a = await addon.Lfm2Model.load(dense);
  const b = await addon.Lfm2Model.load(moe);
  assert.equal(a.info().decodePath, 'compiled');
  assert.equal(b.info().decodePath, 'compiled');
  const opts = { maxTokens: 32, ignoreEos: true };
  const soloA = (await a.generate([1, 2, 3], opts)).tokens;
  const soloB = (await b.generate([1, 2, 3], opts)).tokens;
  // Interleaved and concurrent: neither evicts nor disturbs the other.
  for (let i = 0; i < 3; i++) {
    const [ra, rb] = await Promise.all([a.generate([1, 2, 3], opts), b.generate([1, 2, 3], opts)]);
    assert.deepEqual(ra.tokens, soloA);
    assert.deepEqual(rb.tokens, soloB);
  }
  assert.notDeepEqual(soloA, soloB);
  a.close();
  b.close();
});
