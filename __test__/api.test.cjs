// The Lfm2Model API: results, options, errors that name the problem, and
// the promise that model work never blocks the event loop.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { addon, fixture, fixtureCopy } = require('./helpers.cjs');

const TINY = { preset: 'tiny', dtype: 'f32' };
let shared;
async function model() {
  shared ??= addon.Lfm2Model.load(await fixture('tiny', TINY));
  return shared;
}

test('info describes the checkpoint', async () => {
  const m = await model();
  const info = m.info();
  assert.equal(info.modelType, 'lfm2');
  assert.equal(info.dtype, 'float32');
  assert.deepEqual(info.quantization, []);
  // Unquantized: the paged cache with prefix reuse by default.
  assert.equal(info.cacheKind, 'paged');
  assert.match(info.cacheReason, /default for unquantized checkpoints/);
  assert.equal(info.pagedBlockSize, 32);
  assert.equal(info.layerKinds.length, info.numLayers);
  assert.ok(info.layerKinds.includes('attention') && info.layerKinds.includes('conv'));
  assert.ok(info.parameterCount > 100000);
  assert.ok(info.hasChatTemplate);
  assert.ok(info.eosTokenIds.length >= 1);
});

test('chat returns text, tokens, usage and honest metrics', async () => {
  const m = await model();
  const r = await m.chat([{ role: 'user', content: 'Tell me a story.' }], { maxTokens: 12, ignoreEos: true });
  assert.equal(r.finishReason, 'length');
  assert.equal(r.tokens.length, 12);
  assert.equal(r.usage.completionTokens, 12);
  assert.equal(r.usage.promptTokens, (await m.applyChatTemplate([{ role: 'user', content: 'Tell me a story.' }])).length);
  // Tokens run plus tokens reused from the prefix cache make the prompt.
  assert.equal(r.metrics.prefillTokens + r.metrics.cachedTokens, r.usage.promptTokens);
  assert.equal(r.text, await m.detokenize(r.tokens));
  const t = r.metrics;
  assert.ok(t.ttftMs > 0 && t.totalMs >= t.ttftMs);
  // prefill tok/s is exactly the tokens run divided by the prefill time.
  assert.ok(Math.abs(t.prefillTokensPerSecond - t.prefillTokens / (t.prefillMs / 1000)) < 1e-6 * t.prefillTokensPerSecond);
  assert.ok(Math.abs(t.decodeTokensPerSecond - 11 / (t.decodeMs / 1000)) < 1e-6 * t.decodeTokensPerSecond);
});

test('generation stops on end-of-sequence tokens', async () => {
  // The random-weight model may never sample its EOS: make one of the
  // tokens it does produce an end-of-sequence id (generation_config.json
  // adds to config.json's), so the stop is forced at a known step.
  const m = await model();
  const free = await m.generate([1, 5, 9], { maxTokens: 24, ignoreEos: true });
  const at = free.tokens.findIndex((t, i) => i >= 3 && free.tokens.indexOf(t) === i);
  assert.ok(at >= 3, `no token first appears at step 3 or later in ${free.tokens}`);
  const dir = await fixtureCopy('tiny', TINY, 'tiny-forced-eos');
  const genCfg = path.join(dir, 'generation_config.json');
  const cfg = JSON.parse(fs.readFileSync(genCfg, 'utf8'));
  const original = [].concat(cfg.eos_token_id);
  fs.writeFileSync(genCfg, JSON.stringify({ ...cfg, eos_token_id: [...original, free.tokens[at]] }));
  const forced = await addon.Lfm2Model.load(dir);
  try {
    assert.ok(forced.info().eosTokenIds.includes(free.tokens[at]));
    const r = await forced.generate([1, 5, 9], { maxTokens: 24 });
    assert.equal(r.finishReason, 'stop');
    assert.deepEqual(r.tokens, free.tokens.slice(0, at), 'the EOS token itself is not returned');
    assert.equal(r.usage.completionTokens, at + 1, 'the EOS is counted as generated');
    const through = await forced.generate([1, 5, 9], { maxTokens: 24, ignoreEos: true });
    assert.deepEqual(through.tokens, free.tokens, 'ignoreEos runs past it');
    assert.equal(through.finishReason, 'length');
  } finally {
    forced.close();
  }
});

test('stop strings end the text before the stop string', async () => {
  const m = await model();
  const free = await m.generate('The', { maxTokens: 40, ignoreEos: true });
  assert.ok(free.text.length > 6, free.text);
  const stop = free.text.slice(4, 6);
  const r = await m.generate('The', { maxTokens: 40, ignoreEos: true, stop: [stop, 'never-appears'] });
  assert.equal(r.finishReason, 'stop');
  assert.equal(r.text, free.text.slice(0, free.text.indexOf(stop)));
});

test('seeded sampling is reproducible; greedy is deterministic', async () => {
  const m = await model();
  const opts = { maxTokens: 24, ignoreEos: true, temperature: 0.9, topP: 0.95, topK: 50, minP: 0.02, seed: 1234 };
  const a = await m.generate([1, 2, 3], opts);
  const b = await m.generate([1, 2, 3], opts);
  assert.deepEqual(a.tokens, b.tokens);
  const c = await m.generate([1, 2, 3], { ...opts, seed: 999 });
  assert.notDeepEqual(a.tokens, c.tokens);
  const g1 = await m.generate([1, 2, 3], { maxTokens: 24, ignoreEos: true });
  const g2 = await m.generate([1, 2, 3], { maxTokens: 24, ignoreEos: true, temperature: 0 });
  assert.deepEqual(g1.tokens, g2.tokens);
});

test('repetition penalty changes a repetitive greedy continuation', async () => {
  const m = await model();
  const plain = await m.generate([1, 2, 3], { maxTokens: 48, ignoreEos: true });
  const pen = await m.generate([1, 2, 3], { maxTokens: 48, ignoreEos: true, repetitionPenalty: 1.8, repetitionContextSize: 32 });
  const distinct = (t) => new Set(t).size;
  assert.ok(distinct(pen.tokens) >= distinct(plain.tokens), `${distinct(pen.tokens)} < ${distinct(plain.tokens)}`);
  assert.notDeepEqual(pen.tokens, plain.tokens);
});

test('bad options are rejected with the option named', async () => {
  const m = await model();
  const msgs = [{ role: 'user', content: 'hi' }];
  await assert.rejects(async () => m.chat(msgs, { temperature: -1 }), /temperature/);
  await assert.rejects(async () => m.chat(msgs, { topP: 1.5 }), /topP/);
  await assert.rejects(async () => m.chat(msgs, { minP: 2 }), /minP/);
  await assert.rejects(async () => m.chat(msgs, { maxTokens: 0 }), /maxTokens/);
  await assert.rejects(async () => m.chat([], {}), /messages is empty/);
  await assert.rejects(async () => m.generate([1, 999999], { maxTokens: 2 }), /token id 999999 is out of range/);
  await assert.rejects(async () => m.generate([], { maxTokens: 2 }), /no tokens/);
  await assert.rejects(async () => addon.Lfm2Model.load('/x', { dtype: 'int4' }), /dtype `int4`/);
  await assert.rejects(async () => addon.Lfm2Model.load('/x', { device: 'tpu' }), /device `tpu`/);
  // The model still works after all of that.
  assert.equal((await m.generate([1, 2], { maxTokens: 3, ignoreEos: true })).tokens.length, 3);
});

test('model work never blocks the event loop', async () => {
  const m = await model();
  let ticks = 0;
  const timer = setInterval(() => ticks++, 5);
  const t0 = Date.now();
  const r = await m.generate([1, 2, 3], { maxTokens: 600, ignoreEos: true });
  const elapsed = Date.now() - t0;
  clearInterval(timer);
  assert.equal(r.tokens.length, 600);
  // A blocked loop would see ~0 ticks; allow generous scheduling slack.
  assert.ok(ticks >= Math.floor(elapsed / 5 / 4), `${ticks} ticks in ${elapsed} ms`);
  assert.ok(elapsed > 50, `generation too short (${elapsed} ms) to prove anything`);
});

test('concurrent calls on one model are batched and do not corrupt each other', async () => {
  const m = await model();
  const prompts = [[1, 2, 3], [4, 5, 6, 7], [8], [9, 10, 11, 12, 13]];
  const seq = [];
  for (const p of prompts) seq.push((await m.generate(p, { maxTokens: 16, ignoreEos: true })).tokens);
  const par = await Promise.all(prompts.map((p) => m.generate(p, { maxTokens: 16, ignoreEos: true })));
  assert.deepEqual(par.map((r) => r.tokens), seq);
  const logits = await Promise.all([m.logits([1, 2, 3]), m.logits([1, 2, 3])]);
  assert.deepEqual(Array.from(logits[0]), Array.from(logits[1]));
});

test('warmUp runs before requests, changes no result, and does nothing over running ones', async () => {
  const dir = await fixture('tiny', TINY);
  const cold = await addon.Lfm2Model.load(dir);
  const warm = await addon.Lfm2Model.load(dir);
  const ms = await warm.warmUp();
  assert.equal(typeof ms, 'number');
  assert.ok(ms > 0);
  assert.equal((await warm.cacheStats()).blocksInUse, 0);
  const params = { maxTokens: 24, ignoreEos: true };
  const prompts = [[1, 2, 3, 4], [5, 6, 7]];
  const want = [];
  for (const p of prompts) want.push((await cold.generate(p, params)).tokens);
  // Queued behind two running generations: it waits for its turn between
  // steps, finds them batched, and leaves them alone.
  const running = prompts.map((p) => warm.generate(p, params));
  const during = warm.warmUp();
  const got = await Promise.all(running);
  assert.deepEqual(got.map((g) => g.tokens), want);
  // The generations were queued first, so the warm-up found them running.
  assert.equal(await during, null);
  cold.close();
  warm.close();
});

test('bf16 checkpoints stay bf16 unless a dtype is requested', async () => {
  const dir = await fixture('tiny-bf16', { preset: 'tiny', dtype: 'bf16' });
  const m = await addon.Lfm2Model.load(dir);
  assert.equal(m.info().dtype, 'bfloat16');
  const r = await m.generate([1, 2, 3], { maxTokens: 8, ignoreEos: true });
  assert.equal(r.tokens.length, 8);
  m.close();
  const f = await addon.Lfm2Model.load(dir, { dtype: 'float32' });
  assert.equal(f.info().dtype, 'float32');
  f.close();
});

test('a closed model rejects further calls, every one of them', async () => {
  const m = await addon.Lfm2Model.load(await fixture('tiny', TINY));
  m.close();
  await assert.rejects(m.generate([1], { maxTokens: 1 }), /closed/);
  await assert.rejects(m.chat([{ role: 'user', content: 'hi' }]), /closed/);
  await assert.rejects(m.logits([1, 2]), /closed/);
  await assert.rejects(m.tokenize('hi'), /model closed/);
  await assert.rejects(m.detokenize([1]), /model closed/);
  await assert.rejects(m.applyChatTemplate([{ role: 'user', content: 'hi' }]), /model closed/);
  await assert.rejects(m.cacheStats(), /closed/);
  await assert.rejects(m.warmUp(), /closed/);
  assert.throws(() => m.info(), /model closed/);
  assert.throws(() => m.createSession(), /model closed/);
});

test('load errors name the problem, and a failed load leaves the process working', async () => {
  await assert.rejects(addon.Lfm2Model.load('/nonexistent/model'), /\/nonexistent\/model is not a directory/);

  const noTok = await fixtureCopy('tiny', TINY, 'no-tokenizer');
  fs.rmSync(path.join(noTok, 'tokenizer.json'));
  await assert.rejects(addon.Lfm2Model.load(noTok), /tokenizer\.json/);

  const badType = await fixtureCopy('tiny', TINY, 'bad-type');
  const cfg = JSON.parse(fs.readFileSync(path.join(badType, 'config.json'), 'utf8'));
  fs.writeFileSync(path.join(badType, 'config.json'), JSON.stringify({ ...cfg, model_type: 'llama' }));
  await assert.rejects(addon.Lfm2Model.load(badType), /unknown model_type `llama`/);

  const badValue = await fixtureCopy('tiny', TINY, 'bad-value');
  fs.writeFileSync(path.join(badValue, 'config.json'), JSON.stringify({ ...cfg, norm_eps: 'small' }));
  await assert.rejects(addon.Lfm2Model.load(badValue), /`norm_eps` must be a number/);

  const moreLayers = await fixtureCopy('tiny', TINY, 'more-layers');
  fs.writeFileSync(path.join(moreLayers, 'config.json'), JSON.stringify({ ...cfg, num_hidden_layers: cfg.num_hidden_layers + 1 }));
  await assert.rejects(addon.Lfm2Model.load(moreLayers), new RegExp(`missing tensor \`model\\.layers\\.${cfg.num_hidden_layers}\\.`));

  const wrongShape = await fixtureCopy('tiny', TINY, 'wrong-shape');
  fs.writeFileSync(path.join(wrongShape, 'config.json'), JSON.stringify({ ...cfg, num_key_value_heads: cfg.num_attention_heads }));
  await assert.rejects(addon.Lfm2Model.load(wrongShape), /tensor `model\.layers\.\d+\.self_attn\.k_proj\.weight` has shape \[\d+, \d+\], expected \[\d+, \d+\]/);

  const truncated = await fixtureCopy('tiny', TINY, 'truncated');
  const st = path.join(truncated, 'model.safetensors');
  fs.truncateSync(st, fs.statSync(st).size - 1000);
  await assert.rejects(addon.Lfm2Model.load(truncated), /model\.safetensors is truncated: the header describes \d+ bytes but the file has \d+/);

  const garbage = await fixtureCopy('tiny', TINY, 'garbage');
  fs.writeFileSync(path.join(garbage, 'model.safetensors'), 'not a safetensors file at all');
  await assert.rejects(addon.Lfm2Model.load(garbage), /model\.safetensors is not a valid safetensors file/);

  const sharded = await fixtureCopy('tiny-sharded', { ...TINY, maxShardBytes: 300000 }, 'missing-shard');
  const shard = fs.readdirSync(sharded).find((f) => /^model-0+2-of/.test(f));
  fs.rmSync(path.join(sharded, shard));
  await assert.rejects(addon.Lfm2Model.load(sharded), new RegExp(`shard .*${shard} named in model\\.safetensors\\.index\\.json does not exist`));

  const ok = await addon.Lfm2Model.load(await fixture('tiny', TINY));
  assert.equal((await ok.generate([1, 2], { maxTokens: 2, ignoreEos: true })).tokens.length, 2);
  ok.close();
});

test('onProgress reports the weights as they load, then "ready", all before load resolves', async () => {
  const dir = await fixture('tiny', TINY);
  const seen = [];
  const m = await addon.Lfm2Model.load(dir, { onProgress: (p) => seen.push(p) });
  const total = m.info().weightBytes;
  m.close();
  // The tiny model has more than 8 arrays: several chunks, each reported.
  assert.ok(seen.length >= 3, JSON.stringify(seen));
  assert.deepEqual(Object.keys(seen[0]).sort(), ['loadedBytes', 'phase', 'totalBytes']);
  assert.equal(seen[0].loadedBytes, 0);
  for (const [i, p] of seen.entries()) {
    assert.equal(p.totalBytes, total, `report ${i}`);
    if (i > 0) assert.ok(p.loadedBytes >= seen[i - 1].loadedBytes, `report ${i} went back: ${JSON.stringify(seen)}`);
  }
  assert.deepEqual(seen.map((p) => p.phase), [...Array(seen.length - 1).fill('weights'), 'ready']);
  const last = seen.at(-1);
  assert.equal(last.loadedBytes, last.totalBytes);
  // The last weights report already has everything.
  assert.equal(seen.at(-2).loadedBytes, total);
});

test('onProgress: a non-function is a TypeError, and a throw rejects the load with it', async () => {
  const dir = await fixture('tiny', TINY);
  await assert.rejects(addon.Lfm2Model.load(dir, { onProgress: 'yes' }), {
    name: 'TypeError',
    message: 'options.onProgress must be a function, found a string',
  });
  await assert.rejects(addon.Lfm2Model.load(dir, { onProgres: () => {} }), /unknown option `onProgres` \(did you mean `onProgress`\?\)/);
  let calls = 0;
  await assert.rejects(
    addon.Lfm2Model.load(dir, {
      onProgress: () => {
        calls++;
        throw new Error('progress bar broke');
      },
    }),
    /progress bar broke/,
  );
  assert.ok(calls >= 1);
  // The process still loads models afterwards.
  const ok = await addon.Lfm2Model.load(dir, { onProgress: () => {} });
  assert.equal((await ok.generate([1, 2], { maxTokens: 2, ignoreEos: true })).tokens.length, 2);
  ok.close();
});

test('a model path from MLX_LFM_TEST_MODEL (a real checkpoint) chats', async (t) => {
  const dir = process.env.MLX_LFM_TEST_MODEL;
  if (!dir) {
    t.skip('MLX_LFM_TEST_MODEL is not set: point it at a real LFM2 checkpoint directory to run this test');
    return;
  }
  const m = await addon.Lfm2Model.load(dir);
  const r = await m.chat([{ role: 'user', content: 'What is the capital of France? Answer in one word.' }], { maxTokens: 16 });
  assert.match(r.text, /Paris/i);
  m.close();
});

test('a process that exits with several models loaded exits cleanly', async () => {
  // Models used to be freed on their threads while the process was already
  // running libmlx's static destructors (heap corruption, abort at exit, in
  // about one exit in four with two models). Several exits to catch it.
  const { spawnSync } = require('node:child_process');
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const script = `
    const addon = require(${JSON.stringify(require.resolve('../index.cjs'))});
    (async () => {
      const ms = [await addon.Lfm2Model.load(${JSON.stringify(dir)}), await addon.Lfm2Model.load(${JSON.stringify(dir)}, { useBlockPagedCache: false })];
      for (const m of ms) await m.generate([5, 6, 7, 8], { maxTokens: 6, ignoreEos: true });
    })();`;
  for (let i = 0; i < 6; i++) {
    const r = spawnSync(process.execPath, ['-e', script], { encoding: 'utf8' });
    assert.equal(r.status, 0, `exit ${i + 1}: status ${r.status} signal ${r.signal}\n${r.stderr}`);
  }
});
