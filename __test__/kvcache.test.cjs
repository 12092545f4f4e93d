// Quantized KV caches (kvCache load option / MLX_LFM_KV_CACHE): every name
// loads and generates, bad names are rejected with the valid list, info()
// says what is stored and why decode is eager, and RotorQuant's greedy text
// follows the default cache's.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { addon, fixture } = require('./helpers.cjs');

const NAMES = ['default', 'affine4', 'affine8', 'rotorquant', 'rotorquant-dense', 'rotorquant-quaternion', 'rotorquant-adaptive'];
const VALID_LIST = NAMES.join(', ');
const esc = (s) => s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');

async function withEnv(vars, fn) {
  const old = {};
  for (const [k, v] of Object.entries(vars)) {
    old[k] = process.env[k];
    if (v === undefined) delete process.env[k];
    else process.env[k] = v;
  }
  try {
    return await fn();
  } finally {
    for (const [k, v] of Object.entries(old)) {
      if (v === undefined) delete process.env[k];
      else process.env[k] = v;
    }
  }
}

const tiny = () => fixture('tiny', { preset: 'tiny', dtype: 'f32' });
const PROMPT = Array.from({ length: 24 }, (_, i) => ((i * 37 + 11) % 700) + 1);

// tiny has 2 attention layers: rotorquant-adaptive's default (1 full-precision
// layer at each end) would keep both, so it needs kvCacheFullPrecisionLayers: 0 there.
const optionsFor = (name) => (name === 'rotorquant-adaptive' ? { kvCache: name, kvCacheFullPrecisionLayers: 0 } : { kvCache: name });

for (const name of NAMES) {
  test(`kvCache '${name}' loads and generates`, async () => {
    const dir = await tiny();
    const m = await addon.Lfm2Model.load(dir, optionsFor(name));
    const info = m.info();
    assert.equal(info.kvCache, name);
    assert.equal(info.kvCacheLayers.length, info.layerKinds.filter((k) => k === 'attention').length);
    if (name === 'default') {
      assert.equal(info.cacheKind, 'paged');
      assert.equal(info.decodePath, 'compiled');
      assert.deepEqual(info.kvCacheLayers, ['default', 'default']);
    } else {
      assert.equal(info.cacheKind, 'quantized');
      assert.equal(info.decodePath, 'eager');
      assert.match(info.decodePathReason, new RegExp(`kvCache \`${esc(name)}\` keeps K/V quantized`));
      assert.ok(info.kvCacheLayers.every((k) => k !== 'default'));
    }
    for (const prompt of [[1], PROMPT]) {
      const r = await m.generate(prompt, { maxTokens: 16, ignoreEos: true });
      assert.equal(r.tokens.length, 16);
      assert.equal(r.usage.completionTokens, 16);
    }
    const chat = await m.chat([{ role: 'user', content: 'Hello there' }], { maxTokens: 8, ignoreEos: true });
    assert.equal(chat.tokens.length, 8);
    m.close();
  });
}

test('info() reports what each attention layer stores and the bytes per token', async () => {
  const dir = await tiny();
  const d = await addon.Lfm2Model.load(dir);
  const r = await addon.Lfm2Model.load(dir, { kvCache: 'rotorquant' });
  const q = await addon.Lfm2Model.load(dir, { kvCache: 'rotorquant-quaternion' });
  const a = await addon.Lfm2Model.load(dir, { kvCache: 'affine4' });
  assert.deepEqual(r.info().kvCacheLayers, ['rotorquant-dense', 'rotorquant-dense']);
  assert.deepEqual(q.info().kvCacheLayers, ['rotorquant-quaternion', 'rotorquant-quaternion']);
  // tiny: 2 attention layers × 2 kv heads × (K, V) × head_dim 16.
  assert.equal(d.info().kvBytesPerToken, 2 * 2 * 2 * 16 * 4); // float32
  assert.equal(r.info().kvBytesPerToken, 2 * 2 * 2 * (6 + 2)); // 3-bit codes + fp16 norm
  // affine4: head_dim 16 is padded to one group of 32: 16 bytes + f32 scale and bias.
  assert.equal(a.info().kvBytesPerToken, 2 * 2 * 2 * (16 + 8));
  for (const m of [d, r, q, a]) m.close();
});

test('unknown kvCache names are rejected at load with the valid list (option and env)', async () => {
  const dir = await tiny();
  await assert.rejects(
    addon.Lfm2Model.load(dir, { kvCache: 'rotorquant3' }),
    new RegExp(esc(`kvCache \`rotorquant3\` is not valid; use one of: ${VALID_LIST}`)),
  );
  await withEnv({ MLX_LFM_KV_CACHE: 'turbo3' }, () =>
    assert.rejects(addon.Lfm2Model.load(dir), new RegExp(esc(`MLX_LFM_KV_CACHE \`turbo3\` is not valid; use one of: ${VALID_LIST}`))),
  );
  // A bad variable is an error even when the option is given (a typo never hides).
  await withEnv({ MLX_LFM_KV_CACHE: 'turbo3' }, () =>
    assert.rejects(addon.Lfm2Model.load(dir, { kvCache: 'affine4' }), /MLX_LFM_KV_CACHE `turbo3` is not valid/),
  );
  await withEnv({ MLX_LFM_KV_CACHE_FULL_PRECISION_LAYERS: 'two' }, () =>
    assert.rejects(addon.Lfm2Model.load(dir, { kvCache: 'rotorquant-adaptive' }), /MLX_LFM_KV_CACHE_FULL_PRECISION_LAYERS=two is not valid/),
  );
});

test('invalid combinations are rejected, naming what to do', async () => {
  const dir = await tiny();
  await assert.rejects(addon.Lfm2Model.load(dir, { kvCache: 'affine8', kvCacheFullPrecisionLayers: 1 }), /only applies to kvCache `rotorquant-adaptive`, not `affine8`/);
  await assert.rejects(
    addon.Lfm2Model.load(dir, { kvCache: 'rotorquant-adaptive' }),
    /kvCache `rotorquant-adaptive` with kvCacheFullPrecisionLayers=1 would keep all 2 attention layers in full precision .*use at most 0/,
  );
  await assert.rejects(addon.Lfm2Model.load(dir, { kvCache: 'rotorquant', decodePath: 'compiled' }), /decodePath `compiled` cannot be used with kvCache `rotorquant`/);
  // Eager is fine to ask for.
  const m = await addon.Lfm2Model.load(dir, { kvCache: 'rotorquant', decodePath: 'eager' });
  assert.equal(m.info().decodePath, 'eager');
  m.close();
});

test('MLX_LFM_KV_CACHE selects the cache; the load option wins over it', async () => {
  const dir = await tiny();
  const e = await withEnv({ MLX_LFM_KV_CACHE: 'affine8' }, () => addon.Lfm2Model.load(dir));
  assert.equal(e.info().kvCache, 'affine8');
  assert.equal(e.info().decodePath, 'eager');
  assert.match(e.info().decodePathReason, /kvCache `affine8`/);
  const o = await withEnv({ MLX_LFM_KV_CACHE: 'affine8' }, () => addon.Lfm2Model.load(dir, { kvCache: 'default' }));
  assert.equal(o.info().kvCache, 'default');
  assert.equal(o.info().decodePath, 'compiled');
  const n = await withEnv({ MLX_LFM_KV_CACHE: 'rotorquant-adaptive', MLX_LFM_KV_CACHE_FULL_PRECISION_LAYERS: '0' }, () => addon.Lfm2Model.load(dir));
  assert.equal(n.info().kvCache, 'rotorquant-adaptive');
  for (const m of [e, o, n]) m.close();
});

// How many leading greedy tokens each quantized cache reproduces exactly on
// tiny (random weights, so next-token distributions are flat and greedy
// choices fragile), over 8 prompts. The prefill is exact (deferred), so the
// first token always matches; quantization error shows from the first decode
// step on. The thresholds sit below what was measured (logged), with margin.
test('greedy text with quantized caches follows the default cache', async () => {
  const dir = await tiny();
  const def = await addon.Lfm2Model.load(dir);
  const prompts = [];
  for (let p = 0; p < 8; p++) prompts.push(Array.from({ length: 8 + 40 * p }, (_, i) => ((i * (13 + 2 * p) + 7 * p) % 700) + 1));
  const N = 48;
  const refs = [];
  for (const p of prompts) refs.push((await def.generate(p, { maxTokens: N, ignoreEos: true })).tokens);
  def.close();
  const leading = (a, b) => {
    let i = 0;
    while (i < a.length && a[i] === b[i]) i++;
    return i;
  };
  const report = {};
  for (const name of ['affine8', 'affine4', 'rotorquant', 'rotorquant-quaternion']) {
    const m = await addon.Lfm2Model.load(dir, { kvCache: name });
    const lens = [];
    for (let i = 0; i < prompts.length; i++) lens.push(leading(refs[i], (await m.generate(prompts[i], { maxTokens: N, ignoreEos: true })).tokens));
    m.close();
    report[name] = { leading: lens, mean: lens.reduce((a, b) => a + b, 0) / lens.length };
    assert.ok(lens.every((l) => l >= 1), `${name}: the first token comes from the exact prefill`);
  }
  console.log(`leading greedy tokens equal to the default cache (of ${N}):`, JSON.stringify(report));
  assert.ok(report.affine8.mean >= 40, `affine8: ${JSON.stringify(report.affine8)}`);
  assert.ok(report.rotorquant.mean >= 5, `rotorquant: ${JSON.stringify(report.rotorquant)}`);
});
