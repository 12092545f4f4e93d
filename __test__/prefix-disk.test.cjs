// The paged prefix cache's disk tier (prefixCacheDir): blocks written at
// close and on eviction are found by a later process (restart reuse, same
// greedy tokens), damaged / truncated / foreign files are skipped with one
// warning and removed, the directory stays within prefixCacheDiskMb, and
// cacheStats() counts disk hits, misses, bytes and evictions.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { spawnSync } = require('node:child_process');
const { addon, fixture } = require('./helpers.cjs');

const TINY = { preset: 'tiny', dtype: 'f32' };
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'mlx-lfm-disk-'));
process.on('exit', () => fs.rmSync(tmp, { recursive: true, force: true }));
const PROMPT = 'Tell me a long story about the sea and the mountains and the rivers.';

// One process: load with the disk tier, run `prompts` (chat texts or token
// id arrays) greedily, print the results and the stats, close.
const CHILD = `
const addon = require(${JSON.stringify(path.join(__dirname, '..', 'main.cjs'))});
(async () => {
  const { dir, options, prompts } = JSON.parse(process.argv[1]);
  const m = await addon.Lfm2Model.load(dir, options);
  const out = [];
  for (const p of prompts) {
    const r = typeof p === 'string'
      ? await m.chat([{ role: 'user', content: p }], { maxTokens: 8, ignoreEos: true })
      : await m.generate(p, { maxTokens: 2, ignoreEos: true });
    out.push({ text: r.text, metrics: r.metrics });
  }
  console.log(JSON.stringify({ out, stats: await m.cacheStats() }));
  m.close();
})().catch((e) => { console.error(e); process.exit(1); });
`;

function run(dir, options, prompts) {
  const r = spawnSync(process.execPath, ['-e', CHILD, JSON.stringify({ dir, options, prompts })], { encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
  return { ...JSON.parse(r.stdout), stderr: r.stderr };
}

const blockFiles = (d) => (fs.existsSync(d) ? fs.readdirSync(d).filter((f) => f.endsWith('.blk')) : []);
const dirBytes = (d) => blockFiles(d).reduce((n, f) => n + fs.statSync(path.join(d, f)).size, 0);

test('restart reuse: a second process finds the first one\'s blocks and gives the same greedy tokens', async () => {
  const dir = await fixture('tiny', TINY);
  const cache = path.join(tmp, 'restart');
  const options = { pagedBlockSize: 8, prefixCacheDir: cache };
  const first = run(dir, options, [PROMPT]);
  assert.equal(first.out[0].metrics.cachedTokens, 0);
  assert.equal(first.stats.diskHits, 0);
  assert.ok(first.stats.diskMisses >= 1);
  const promptLen = first.out[0].metrics.prefillTokens;
  const files = blockFiles(cache);
  assert.ok(files.length >= Math.floor(promptLen / 8), `${files.length} block files after close`);
  assert.deepEqual(fs.readdirSync(cache).filter((f) => !f.endsWith('.blk')), [], 'no temporary files left');

  const second = run(dir, options, [PROMPT]);
  const fullBlocks = Math.floor((promptLen - 1) / 8) * 8;
  assert.ok(second.out[0].metrics.cachedTokens >= fullBlocks, JSON.stringify(second.out[0].metrics));
  assert.equal(second.out[0].text, first.out[0].text);
  assert.equal(second.stats.diskHits, fullBlocks / 8);
  assert.equal(second.stats.diskBytes, dirBytes(cache));
  assert.equal(second.stderr, '');

  // Without the directory nothing is reused; another model never reads them.
  const plain = await addon.Lfm2Model.load(dir, { pagedBlockSize: 8 });
  const cold = await plain.chat([{ role: 'user', content: PROMPT }], { maxTokens: 8, ignoreEos: true });
  assert.equal(cold.metrics.cachedTokens, 0);
  assert.equal((await plain.cacheStats()).diskHits, undefined);
  plain.close();
  const other = run(dir, { pagedBlockSize: 16, prefixCacheDir: cache }, [PROMPT]);
  assert.equal(other.out[0].metrics.cachedTokens, 0, 'another block size is another fingerprint');
  assert.equal(other.stats.diskDamaged, 0);
});

test('processes sharing one directory at the same time never read a half-written block', async () => {
  const dir = await fixture('tiny', TINY);
  const cache = path.join(tmp, 'shared');
  // A 1 MiB pool: blocks are spilled while the processes run, so reads
  // and writes of the same files overlap.
  const options = { pagedBlockSize: 4, pagedCacheBudgetMb: 1, prefixCacheDir: cache };
  const { execFile } = require('node:child_process');
  const runAsync = (prompts) =>
    new Promise((resolve, reject) =>
      execFile(process.execPath, ['-e', CHILD, JSON.stringify({ dir, options, prompts })], (err, stdout, stderr) =>
        err ? reject(new Error(stderr)) : resolve({ ...JSON.parse(stdout), stderr }),
      ),
    );
  const longs = [0, 1, 2].map((k) => Array.from({ length: 400 }, (_, i) => 1 + ((i * 13 + k * 71) % 250)));
  const long = longs[0];
  // Four processes at once: each reads what the others have finished
  // writing (or nothing) while they write the same blocks.
  for (let round = 0; round < 2; round++) {
    const rs = await Promise.all([0, 1, 2, 3].map(() => runAsync([...longs, long, PROMPT])));
    for (const r of rs) {
      assert.equal(r.stats.diskDamaged, 0);
      assert.equal(r.stderr, '');
      assert.equal(r.out[4].text, rs[0].out[4].text);
      assert.equal(r.out[3].text, rs[0].out[0].text);
    }
    if (round === 1) assert.ok(rs.some((r) => r.stats.diskHits > 0));
  }
  assert.deepEqual(fs.readdirSync(cache).filter((f) => !f.endsWith('.blk')), [], 'no temporary files left');
  const after = run(dir, options, [long]);
  assert.ok(after.out[0].metrics.cachedTokens >= 396 && after.stats.diskDamaged === 0, JSON.stringify(after.stats));
});

test('damaged, truncated and foreign files are skipped with one warning and removed', async () => {
  const dir = await fixture('tiny', TINY);
  const cache = path.join(tmp, 'damaged');
  const options = { pagedBlockSize: 8, prefixCacheDir: cache };
  const first = run(dir, options, [PROMPT]);
  // A foreign block: the MoE fixture's file under a name the dense model looks up.
  const moeCache = path.join(tmp, 'moe');
  run(await fixture('tiny-moe', { preset: 'tiny-moe', dtype: 'f32' }), { pagedBlockSize: 8, prefixCacheDir: moeCache }, [PROMPT]);
  const second = run(dir, options, [PROMPT]);
  assert.ok(second.stats.diskHits >= 3);

  // Which file holds which block is not visible from outside; damage every
  // file in one of three ways, the first block is then always unusable.
  const files = blockFiles(cache).sort();
  const foreign = path.join(moeCache, blockFiles(moeCache)[0]);
  files.forEach((f, i) => {
    const p = path.join(cache, f);
    if (i % 3 === 0) {
      const b = fs.readFileSync(p);
      b[b.length - 3] ^= 0xff;
      fs.writeFileSync(p, b);
    } else if (i % 3 === 1) {
      fs.truncateSync(p, Math.floor(fs.statSync(p).size / 2));
    } else {
      fs.copyFileSync(foreign, p);
    }
  });
  const third = run(dir, options, [PROMPT]);
  assert.equal(third.out[0].text, first.out[0].text, 'recomputed, same tokens');
  assert.equal(third.out[0].metrics.cachedTokens, 0);
  assert.equal(third.stats.diskDamaged, 1, 'the chain stops at the first unusable block');
  assert.equal((third.stderr.match(/is unusable/g) || []).length, 1, third.stderr);
  // The damaged first block was removed (and written afresh at close).
  const fourth = run(dir, options, [PROMPT]);
  assert.ok(fourth.out[0].metrics.cachedTokens >= 8);
  assert.equal(fourth.out[0].text, first.out[0].text);

  // A file far larger than a block is refused before it is read.
  for (const f of blockFiles(cache)) fs.writeFileSync(path.join(cache, f), Buffer.alloc(8 << 20, 1));
  const fifth = run(dir, options, [PROMPT]);
  assert.equal(fifth.out[0].metrics.cachedTokens, 0);
  assert.equal(fifth.stats.diskDamaged, 1);
  assert.match(fifth.stderr, /is unusable: it is 8388608 bytes, more than a block of this model/);
  assert.equal(fifth.out[0].text, first.out[0].text);
});

test('the directory stays within prefixCacheDiskMb: least recently used files go', async () => {
  const dir = await fixture('tiny', TINY);
  const cache = path.join(tmp, 'budget');
  // Four prompts of 600 distinct tokens in 4-token blocks: far more than 1 MiB of block files.
  const prompts = [0, 1, 2, 3].map((k) => Array.from({ length: 600 }, (_, i) => 1 + ((i * 7 + k * 131) % 250)));
  const options = { pagedBlockSize: 4, prefixCacheDir: cache, prefixCacheDiskMb: 1, pagedCacheBudgetMb: 1 };
  const first = run(dir, options, prompts);
  assert.ok(first.stats.evictions > 0, 'the 1 MiB pool evicted blocks');
  assert.ok(dirBytes(cache) <= 1 << 20, `${dirBytes(cache)} bytes on disk`);
  const second = run(dir, options, [prompts[3], prompts[0]]);
  assert.ok(second.stats.diskBytes <= 1 << 20);
  // The most recent prompt's blocks survived the budget; the oldest did not.
  assert.ok(second.out[0].metrics.cachedTokens > 0, JSON.stringify(second.out[0].metrics));
  assert.equal(second.out[1].metrics.cachedTokens, 0);
  assert.ok(dirBytes(cache) <= 1 << 20);
});

// In its own process too, so the blocks it writes at close are all written
// before the test's directory is removed.
const SPILL = `
const addon = require(${JSON.stringify(path.join(__dirname, '..', 'main.cjs'))});
(async () => {
  const { dir, cache } = JSON.parse(process.argv[1]);
  const m = await addon.Lfm2Model.load(dir, { pagedBlockSize: 4, pagedCacheBudgetMb: 1, prefixCacheDir: cache, prefixCacheDiskMb: 4 });
  const prompts = [0, 1, 2].map((k) => Array.from({ length: 500 }, (_, i) => 1 + ((i * 11 + k * 97) % 250)));
  const first = await m.generate(prompts[0], { maxTokens: 2, ignoreEos: true });
  for (const p of prompts.slice(1)) await m.generate(p, { maxTokens: 2, ignoreEos: true });
  let s = await m.cacheStats();
  for (let i = 0; i < 200 && s.diskWrites === 0; i++) {
    await new Promise((r) => setTimeout(r, 20));
    s = await m.cacheStats();
  }
  const again = await m.generate(prompts[0], { maxTokens: 2, ignoreEos: true });
  console.log(JSON.stringify({ during: s, after: await m.cacheStats(), first, again }));
  m.close();
})().catch((e) => { console.error(e); process.exit(1); });
`;

test('blocks evicted from memory are spilled while the model runs, and read back from disk', async () => {
  const dir = await fixture('tiny', TINY);
  const cache = path.join(tmp, 'spill');
  const r = spawnSync(process.execPath, ['-e', SPILL, JSON.stringify({ dir, cache })], { encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
  const { during, after, first, again } = JSON.parse(r.stdout);
  assert.ok(during.evictions > 0 && during.diskWrites > 0, JSON.stringify(during));
  assert.ok(after.diskBytes <= 4 << 20, JSON.stringify(after));
  // The first prompt's blocks left memory first; some came back from disk.
  assert.ok(after.diskHits > 0 && again.metrics.cachedTokens > 0, JSON.stringify({ after, m: again.metrics }));
  assert.equal(again.text, first.text);
});

test('option errors', async () => {
  const dir = await fixture('tiny', TINY);
  await assert.rejects(addon.Lfm2Model.load(dir, { prefixCacheDiskMb: 5 }), /prefixCacheDiskMb is set without prefixCacheDir/);
  await assert.rejects(
    addon.Lfm2Model.load(dir, { useBlockPagedCache: false, prefixCacheDir: path.join(tmp, 'x') }),
    /prefixCacheDir needs the paged KV cache/,
  );
  await assert.rejects(addon.Lfm2Model.load(dir, { prefixCacheDir: 5 }), TypeError);
  await assert.rejects(addon.Lfm2Model.load(dir, { prefixCacheDir: path.join(tmp, 'y'), prefixCacheDiskMb: 0 }), /prefixCacheDiskMb/);
  const file = path.join(tmp, 'a-file');
  fs.writeFileSync(file, 'x');
  await assert.rejects(addon.Lfm2Model.load(dir, { prefixCacheDir: file }), /prefixCacheDir .*a-file: cannot create it/);
});
