// A prompt cache that survives restarts: the model fingerprint, and saved
// sessions (session.save / model.loadSession) for dense and MoE fixtures,
// paged and flat caches, f32 and a 4-bit checkpoint, a quantized KV cache;
// files from another model, another format version, truncated or damaged
// files are clear errors that load nothing.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const crypto = require('node:crypto');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { addon, fixture, fixtureCopy } = require('./helpers.cjs');

const TINY = { preset: 'tiny', dtype: 'f32' };
const MOE = { preset: 'tiny-moe', dtype: 'f32' };
const GREEDY = { maxTokens: 12, ignoreEos: true };
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'mlx-lfm-persist-'));
process.on('exit', () => fs.rmSync(tmp, { recursive: true, force: true }));

let q4dir;
async function q4() {
  if (!q4dir) {
    q4dir = path.join(tmp, 'tiny-q4');
    await addon.convert(await fixture('tiny', TINY), q4dir, { bits: 4, groupSize: 32 });
  }
  return q4dir;
}

test('the fingerprint is stable per model and differs with weights, dtype or cache kind', async () => {
  const dir = await fixture('tiny', TINY);
  const a = await addon.Lfm2Model.load(dir, { pagedBlockSize: 8 });
  const b = await addon.Lfm2Model.load(dir, { pagedBlockSize: 8 });
  assert.match(a.info().fingerprint, /^[0-9a-f]{64}$/);
  assert.equal(a.info().fingerprint, b.info().fingerprint);
  const prints = new Set([a.info().fingerprint]);
  for (const [d, o] of [
    [dir, { pagedBlockSize: 16 }],
    [dir, { useBlockPagedCache: false }],
    [dir, { dtype: 'bf16' }],
    [await fixture('tiny-moe', MOE), {}],
    [await q4(), {}],
  ]) {
    const m = await addon.Lfm2Model.load(d, o);
    prints.add(m.info().fingerprint);
    m.close();
  }
  assert.equal(prints.size, 6);
  // Same weights, another chat template: another fingerprint.
  const copy = await fixtureCopy('tiny', TINY, 'tiny-template');
  const cfgPath = path.join(copy, 'tokenizer_config.json');
  const cfg = JSON.parse(fs.readFileSync(cfgPath, 'utf8'));
  cfg.chat_template = '{{ bos_token }}' + (cfg.chat_template || '');
  fs.writeFileSync(cfgPath, JSON.stringify(cfg));
  fs.rmSync(path.join(copy, 'chat_template.jinja'), { force: true });
  const t = await addon.Lfm2Model.load(copy, { pagedBlockSize: 8 });
  assert.notEqual(t.info().fingerprint, a.info().fingerprint);
  for (const m of [a, b, t]) m.close();
});

/**
 * A conversation of two turns, saved after the first; the second turn of
 * the original and of the session restored into a fresh model instance
 * must agree, the restored one running only its new tokens.
 */
async function roundTrip(dir, loadOptions, name) {
  const file = path.join(tmp, `${name}.session`);
  const original = await addon.Lfm2Model.load(dir, loadOptions);
  const s = original.createSession({ system: 'You are terse.' });
  await s.send('Tell me about the sea and the long coast of it.', GREEDY);
  const saved = await s.save(file);
  assert.ok(saved.tokens > 0 && saved.bytes > 0, JSON.stringify(saved));
  assert.ok(fs.statSync(file).size === saved.bytes);
  const next = await s.send('And the mountains?', GREEDY);
  original.close();

  const fresh = await addon.Lfm2Model.load(dir, loadOptions);
  const r = await fresh.loadSession(file);
  assert.deepEqual(r.history, s.history.slice(0, 3));
  const cont = await r.send('And the mountains?', GREEDY);
  assert.equal(cont.text, next.text, `${name}: the restored session continues as the original`);
  assert.equal(cont.metrics.cachedTokens, saved.tokens, `${name}: the restored state is used, not recomputed`);
  assert.equal(
    cont.metrics.cachedTokens + cont.metrics.prefillTokens,
    next.metrics.cachedTokens + next.metrics.prefillTokens,
    'the same prompt',
  );
  assert.ok(cont.metrics.prefillTokens > 0 && cont.metrics.prefillTokens < 40);
  assert.deepEqual(r.history, s.history);
  fresh.close();
  return { saved, file };
}

test('session round trip: dense f32, paged cache (several blocks and a partial one)', async () => {
  const { saved } = await roundTrip(await fixture('tiny', TINY), { pagedBlockSize: 5 }, 'dense-paged');
  assert.ok(saved.tokens > 10 && saved.tokens % 5 !== 0, `${saved.tokens} tokens: whole blocks and a partial one`);
  // Whole blocks only.
  await roundTrip(await fixture('tiny', TINY), { pagedBlockSize: saved.tokens / 2 }, 'dense-paged-whole');
});

/** Rewrites a session file with `edit(name, bytes)` applied to its tensors and a matching checksum. */
function editTensors(file, out, edit) {
  const b = fs.readFileSync(file);
  const n = Number(b.readBigUInt64LE(0));
  const header = JSON.parse(b.subarray(8, 8 + n).toString('utf8'));
  const data = Buffer.from(b.subarray(8 + n));
  const names = Object.keys(header).filter((k) => k !== '__metadata__').sort();
  const sha = crypto.createHash('sha256');
  for (const k of names) {
    const [s, e] = header[k].data_offsets;
    edit(k, data.subarray(s, e));
    sha.update(k);
    sha.update(data.subarray(s, e));
  }
  header.__metadata__.checksum = sha.digest('hex');
  let h = Buffer.from(JSON.stringify(header));
  h = Buffer.concat([h, Buffer.alloc((8 - (h.length % 8)) % 8, 0x20)]);
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(h.length));
  fs.writeFileSync(out, Buffer.concat([len, h, data]));
}

test('the restored tensors are what the next turn continues from (K/V, the end conv states, block snapshots)', async () => {
  const dir = await fixture('tiny', TINY);
  // The next turn continues the history (K/V and the end state are read);
  // a turn after reset() shares only the first blocks (their snapshots).
  const next = (s) => s.send('And the mountains?', GREEDY);
  const diverging = (s) => {
    s.reset();
    return s.send('Tell me about the sea', GREEDY);
  };
  for (const [opts, parts] of [
    [{ pagedBlockSize: 5 }, [[/keys$/, next], [/^layers\.\d+\.conv$/, next], [/^blocks\./, diverging]]],
    [{ useBlockPagedCache: false }, [[/keys$/, next], [/^layers\.\d+\.conv$/, next]]],
  ]) {
    const { file } = await roundTrip(dir, opts, 'edited');
    for (const [re, turn] of parts) {
      const m = await addon.Lfm2Model.load(dir, opts);
      const untouched = await turn(await m.loadSession(file));
      m.close();
      const out = `${file}.edited`;
      editTensors(file, out, (name, bytes) => re.test(name) && bytes.fill(0x46));
      const f = await addon.Lfm2Model.load(dir, opts);
      const r = await turn(await f.loadSession(out));
      assert.ok(r.metrics.cachedTokens > 0);
      assert.notEqual(r.text, untouched.text, `${JSON.stringify(opts)}: tensors ${re} are used`);
      f.close();
    }
  }
});

test('session round trip: dense f32, flat cache', async () => {
  await roundTrip(await fixture('tiny', TINY), { useBlockPagedCache: false }, 'dense-flat');
});

test('session round trip: MoE f32, paged and flat', async () => {
  const dir = await fixture('tiny-moe', MOE);
  await roundTrip(dir, { pagedBlockSize: 5 }, 'moe-paged');
  await roundTrip(dir, { useBlockPagedCache: false }, 'moe-flat');
});

test('session round trip: a 4-bit checkpoint (flat by default, and paged)', async () => {
  const dir = await q4();
  await roundTrip(dir, {}, 'q4-flat');
  await roundTrip(dir, { useBlockPagedCache: true, pagedBlockSize: 5 }, 'q4-paged');
});

test('session round trip: a quantized KV cache', async () => {
  await roundTrip(await fixture('tiny', TINY), { kvCache: 'affine8' }, 'kv-affine8');
});

test('a restored flat state is used once; a turn that does not continue the history runs it all', async () => {
  const dir = await fixture('tiny', TINY);
  const opts = { useBlockPagedCache: false };
  const m = await addon.Lfm2Model.load(dir, opts);
  const s = m.createSession();
  await s.send('Hello there, how are you?', GREEDY);
  const file = path.join(tmp, 'once.session');
  await s.save(file);
  const r = await m.loadSession(file);
  r.reset();
  const after = await r.send('Something else', GREEDY);
  assert.equal(after.metrics.cachedTokens, 0);
  m.close();
});

test('files from another model, another version, truncated or damaged: clear errors, nothing loaded', async () => {
  const dir = await fixture('tiny', TINY);
  const opts = { pagedBlockSize: 8 };
  const m = await addon.Lfm2Model.load(dir, opts);
  const s = m.createSession();
  await s.send('Hello there, how are you?', GREEDY);
  const file = path.join(tmp, 'good.session');
  await s.save(file);
  const bytes = fs.readFileSync(file);

  const other = await addon.Lfm2Model.load(await fixture('tiny-moe', MOE), opts);
  await assert.rejects(other.loadSession(file), /saved by another model: its config, weights differ/);
  const flat = await addon.Lfm2Model.load(dir, { useBlockPagedCache: false });
  await assert.rejects(flat.loadSession(file), /its cache differ \(the file's cache is float32 paged, 8-token blocks, this model's float32 flat\)/);

  // Another format version: rewrite the header's metadata.
  const n = Number(bytes.readBigUInt64LE(0));
  const header = JSON.parse(bytes.subarray(8, 8 + n).toString('utf8'));
  header.__metadata__.version = '99';
  let h = Buffer.from(JSON.stringify(header));
  const pad = (8 - (h.length % 8)) % 8;
  h = Buffer.concat([h, Buffer.alloc(pad, 0x20)]);
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(h.length));
  const v99 = path.join(tmp, 'v99.session');
  fs.writeFileSync(v99, Buffer.concat([len, h, bytes.subarray(8 + n)]));
  await assert.rejects(m.loadSession(v99), /format version 99; this mlx-lfm reads version 1/);

  const truncated = path.join(tmp, 'truncated.session');
  fs.writeFileSync(truncated, bytes.subarray(0, bytes.length - 100));
  await assert.rejects(m.loadSession(truncated), /truncated\.session is not a usable session file: .*truncated/);
  fs.writeFileSync(truncated, bytes.subarray(0, 5));
  await assert.rejects(m.loadSession(truncated), /not a usable session file/);

  const damaged = path.join(tmp, 'damaged.session');
  const d = Buffer.from(bytes);
  d[d.length - 7] ^= 0xff;
  fs.writeFileSync(damaged, d);
  await assert.rejects(m.loadSession(damaged), /do not match its checksum \(the file is damaged\)/);
  await assert.rejects(m.loadSession(path.join(tmp, 'missing.session')), /cannot read the session file .*missing\.session/);

  // Nothing was installed by the failures: the prefix cache is as it was.
  const before = await m.cacheStats();
  await assert.rejects(m.loadSession(damaged));
  assert.deepEqual(await m.cacheStats(), before);

  // Argument errors.
  await assert.rejects(m.loadSession(42), TypeError);
  await assert.rejects(m.loadSession(file, { system: 'x' }), TypeError);
  await assert.rejects(s.save(7), TypeError);
  await assert.rejects(m.createSession().save(path.join(tmp, 'empty.session')), /no history yet/);
  // A save never leaves a temporary file behind, and fails cleanly on a bad path.
  await assert.rejects(s.save(path.join(tmp, 'no-such-dir', 'x.session')), /cannot write/);
  assert.deepEqual(fs.readdirSync(tmp).filter((f) => f.endsWith('.tmp')), []);
  for (const x of [m, other, flat]) x.close();
});
