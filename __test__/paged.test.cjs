// The paged KV cache from JavaScript: routing (option > config.json >
// default by quantization) and what info() says about it, warm chat turns
// that equal a cold run while running only the suffix (cachedTokens), sessions
// that stay warm, and requests that are aborted or fail giving their blocks
// back.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { addon, fixture, fixtureCopy } = require('./helpers.cjs');

const TINY = { preset: 'tiny', dtype: 'f32' };
const tiny = () => fixture('tiny', TINY);
const GREEDY = { maxTokens: 24, ignoreEos: true };

async function withConfig(name, edit) {
  const dir = await fixtureCopy('tiny', TINY, name);
  const p = path.join(dir, 'config.json');
  const cfg = JSON.parse(fs.readFileSync(p, 'utf8'));
  edit(cfg);
  fs.writeFileSync(p, JSON.stringify(cfg));
  return dir;
}

test('routing: the load option wins, then config.json, then quantization decides', async () => {
  const dir = await tiny();
  const def = (await addon.Lfm2Model.load(dir)).info();
  assert.equal(def.cacheKind, 'paged');
  assert.match(def.cacheReason, /default for unquantized/);
  const off = (await addon.Lfm2Model.load(dir, { useBlockPagedCache: false })).info();
  assert.equal(off.cacheKind, 'flat');
  assert.match(off.cacheReason, /useBlockPagedCache: false \(load option\)/);
  assert.equal(off.pagedBlockSize, undefined);

  const cfgOff = await withConfig('tiny-paged-off', (c) => {
    c.use_block_paged_cache = false;
  });
  assert.equal((await addon.Lfm2Model.load(cfgOff)).info().cacheKind, 'flat');
  const forced = (await addon.Lfm2Model.load(cfgOff, { useBlockPagedCache: true, pagedBlockSize: 16, pagedCacheBudgetMb: 8 })).info();
  assert.equal(forced.cacheKind, 'paged');
  assert.equal(forced.pagedBlockSize, 16);
  assert.equal(forced.pagedCacheBudgetMb, 8);

  const cfgSized = await withConfig('tiny-paged-sized', (c) => {
    c.paged_block_size = 64;
    c.paged_cache_budget_mb = 100;
  });
  const sized = (await addon.Lfm2Model.load(cfgSized)).info();
  assert.equal(sized.pagedBlockSize, 64);
  assert.equal(sized.pagedCacheBudgetMb, 100);

  const quantDir = path.join(path.dirname(dir), 'tiny-q4-paged');
  await addon.convert(dir, quantDir, { bits: 4, groupSize: 32 });
  const q = await addon.Lfm2Model.load(quantDir);
  assert.equal(q.info().cacheKind, 'flat');
  assert.match(q.info().cacheReason, /quantized checkpoints/);
  assert.equal(await q.cacheStats(), null);
  const qPaged = await addon.Lfm2Model.load(quantDir, { useBlockPagedCache: true });
  assert.equal(qPaged.info().cacheKind, 'paged');
  // Quantized and paged give the same tokens as quantized and flat.
  assert.deepEqual((await qPaged.generate([5, 6, 7], GREEDY)).tokens, (await q.generate([5, 6, 7], GREEDY)).tokens);
});

test('bad paged settings are errors that name the field', async () => {
  const dir = await tiny();
  const bad = await withConfig('tiny-paged-bad', (c) => {
    c.use_block_paged_cache = 'yes';
  });
  await assert.rejects(async () => addon.Lfm2Model.load(bad), /use_block_paged_cache` must be true or false, found "yes"/);
  await assert.rejects(async () => addon.Lfm2Model.load(dir, { pagedBlockSize: 0 }), /pagedBlockSize must be from 1/);
  await assert.rejects(async () => addon.Lfm2Model.load(dir, { pagedBlockSize: 5000 }), /block size 5000 is out of range/);
  await assert.rejects(
    async () => addon.Lfm2Model.load(dir, { useBlockPagedCache: true, kvCache: 'affine8' }),
    /cannot be combined with kvCache `affine8`/,
  );
  // Without the explicit choice a quantized kvCache simply means flat caches.
  assert.equal((await addon.Lfm2Model.load(dir, { kvCache: 'affine8' })).info().cacheKind, 'quantized');
});

test('a warm chat turn equals a cold run and runs only the suffix', async () => {
  const m = await addon.Lfm2Model.load(await tiny(), { pagedBlockSize: 16 });
  const history = [
    { role: 'system', content: 'You are a helpful assistant that answers in one short paragraph.' },
    { role: 'user', content: 'Tell me about the sea, the wind and the long coastline of the north.' },
  ];
  const t1 = await m.chat(history, GREEDY);
  assert.equal(t1.metrics.cachedTokens, 0);
  history.push({ role: 'assistant', content: t1.text });
  history.push({ role: 'user', content: 'And the mountains?' });
  const prompt2 = await m.applyChatTemplate(history);
  const warm = await m.chat(history, GREEDY);
  assert.ok(warm.metrics.cachedTokens >= 32, `only ${warm.metrics.cachedTokens} tokens reused`);
  // Reused: the longest common prefix with what turn 1 ran (its prompt and
  // the reply tokens it fed), all of it when turn 2 continues turn 1
  // exactly (its last partial block is kept), else in whole blocks. (The
  // template re-tokenizes the reply's text, which need not give back the
  // tokens a random-weight model sampled.)
  const ran1 = (await m.applyChatTemplate(history.slice(0, 2))).concat(t1.tokens.slice(0, -1));
  let common = 0;
  while (common < ran1.length && common < prompt2.length - 1 && ran1[common] === prompt2[common]) common++;
  const expected = common === ran1.length ? common : Math.floor(common / 16) * 16;
  assert.equal(warm.metrics.cachedTokens, expected, `common prefix ${common} of ${ran1.length}`);
  assert.equal(warm.metrics.prefillTokens, prompt2.length - warm.metrics.cachedTokens);
  assert.equal(warm.usage.promptTokens, prompt2.length);
  const tps = warm.metrics.prefillTokensPerSecond;
  assert.ok(Math.abs(tps - warm.metrics.prefillTokens / (warm.metrics.prefillMs / 1000)) < 1e-6 * tps);
  await m.clearPrefixCache();
  const cold = await m.chat(history, GREEDY);
  assert.equal(cold.metrics.cachedTokens, 0);
  assert.equal(cold.metrics.prefillTokens, prompt2.length);
  assert.equal(warm.text, cold.text);
  assert.deepEqual(warm.tokens, cold.tokens);
  // A flat model agrees too.
  const flat = await addon.Lfm2Model.load(await tiny(), { useBlockPagedCache: false });
  assert.deepEqual((await flat.chat(history, GREEDY)).tokens, cold.tokens);
  const s = await m.cacheStats();
  assert.equal(s.blocksInUse, 0);
  assert.ok(s.blocksCached > 0 && s.hits >= 1 && s.bytes > 0);
});

test('a session keeps its cache warm between turns', async () => {
  const m = await addon.Lfm2Model.load(await tiny(), { pagedBlockSize: 16 });
  const s = m.createSession({ system: 'You are terse and precise in every reply you give.', defaults: { maxTokens: 20, ignoreEos: true } });
  const t1 = await s.send('First question about rivers and lakes and the weather in spring?');
  const t2 = await s.send('Second question?');
  const t3 = await s.send('Third?');
  assert.equal(t1.metrics.cachedTokens, 0);
  for (const t of [t2, t3]) {
    assert.ok(t.metrics.cachedTokens > 0, 'the next turn reused the conversation so far');
    assert.equal(t.metrics.prefillTokens + t.metrics.cachedTokens, t.usage.promptTokens);
    // Only the new turn runs, plus at most a block where the re-rendered
    // reply stops matching the tokens the model sampled.
    assert.ok(t.metrics.prefillTokens < 16 + 40, `ran ${t.metrics.prefillTokens} tokens`);
  }
});

test('aborted and failed requests give their blocks back', async () => {
  // A 1 MiB pool: a few hundred tokens of the tiny model.
  const m = await addon.Lfm2Model.load(await tiny(), { pagedBlockSize: 16, pagedCacheBudgetMb: 1, prefillChunkSize: 8 });
  const stats0 = await m.cacheStats();
  const maxTokens = stats0.maxBlocks * stats0.blockSize;
  const prompt = Array.from({ length: 100 }, (_, i) => ((i * 13) % 500) + 3);
  const stream = m.generateStream(prompt, { maxTokens: 200, ignoreEos: true });
  let n = 0;
  for await (const ev of stream) {
    if (ev.type === 'text' && ++n === 3) break; // stops generation mid-decode
  }
  assert.equal((await m.cacheStats()).blocksInUse, 0);
  const huge = Array.from({ length: maxTokens + 100 }, (_, i) => ((i * 7) % 800) + 3);
  await assert.rejects(m.generate(huge, { maxTokens: 2 }), /paged KV cache is full: all \d+ blocks of 16 tokens/);
  assert.equal((await m.cacheStats()).blocksInUse, 0);
  // The model still answers, and answers right.
  const flat = await addon.Lfm2Model.load(await tiny(), { useBlockPagedCache: false });
  assert.deepEqual((await m.generate(prompt, GREEDY)).tokens, (await flat.generate(prompt, GREEDY)).tokens);
  assert.equal((await m.cacheStats()).blocksInUse, 0);
});

test('a prompt that continues a finished request exactly reuses all of it, its partial block included', async () => {
  const m = await addon.Lfm2Model.load(await tiny(), { pagedBlockSize: 16 });
  const p1 = Array.from({ length: 37 }, (_, i) => ((i * 19) % 700) + 3);
  const g1 = await m.generate(p1, { maxTokens: 10, ignoreEos: true });
  const p2 = p1.concat(g1.tokens, [11, 12, 13, 14, 15]);
  const warm = await m.generate(p2, GREEDY);
  // Turn 1 ran its 37 prompt tokens and fed 9 of its 10 tokens: 46
  // positions, 2 whole blocks and 14 in a partial one.
  assert.equal(warm.metrics.cachedTokens, 46);
  assert.equal(warm.metrics.prefillTokens, p2.length - 46);
  await m.clearPrefixCache();
  const cold = await m.generate(p2, GREEDY);
  assert.equal(cold.metrics.cachedTokens, 0);
  assert.deepEqual(warm.tokens, cold.tokens);
  assert.equal((await m.cacheStats()).blocksInUse, 0);
});
