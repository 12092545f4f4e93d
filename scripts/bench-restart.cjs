#!/usr/bin/env node
// `npm run bench:restart`: time to first token after a restart, with the
// prompt cache on disk against a cold start, every number from a fresh
// process (so nothing is cached in memory):
//   prefix cold:    load (paged), run a P-token prompt (random ids).
//   prefix disk:    load with prefixCacheDir filled by an earlier process
//                   that ran the same prompt and closed; run it again.
//   session cold:   createSession({ system: S-token text }), send a message.
//   session loaded: loadSession(file) saved by an earlier process after
//                   the same system prompt and one turn, send the message.
// Each process first runs a short throwaway prompt (so one-time setup is
// not timed), then the timed request with maxTokens 1; TTFT is the result's
// metrics.ttftMs (disk reads and the session file's load are inside it for
// the disk row; loadSession's own time is printed beside it). Prints one
// JSON object (medians of --reps processes per row, and every rep).
'use strict';
const path = require('node:path');
const fs = require('node:fs');
const os = require('node:os');
const { spawnSync } = require('node:child_process');

const root = path.resolve(__dirname, '..');
const { parseOptions, ids, checkpoint, vocabOf } = require('./bench-common.cjs');
const USAGE = 'usage: npm run bench:restart -- [--model DIR | --preset P --dtype D] [--prompt 1024] [--reps 3] [--block 32]';

const CHILD = `
const addon = require(${JSON.stringify(path.join(root, 'index.cjs'))});
(async () => {
  const a = JSON.parse(process.argv[1]);
  const opts = { useBlockPagedCache: true, pagedBlockSize: a.block, ...(a.cacheDir ? { prefixCacheDir: a.cacheDir } : {}) };
  const m = await addon.Lfm2Model.load(a.dir, opts);
  await m.generate(a.warm, { maxTokens: 2, ignoreEos: true });
  await m.clearPrefixCache();
  const one = { maxTokens: 1, ignoreEos: true };
  let r, loadMs = null;
  if (a.mode === 'prefix') {
    r = await m.generate(a.prompt, one);
  } else if (a.mode === 'session-save') {
    const s = m.createSession({ system: a.system });
    await s.send('Hello.', { maxTokens: 4, ignoreEos: true });
    await s.save(a.file);
    r = await s.send(a.message, one);
  } else if (a.mode === 'session-cold') {
    const s = m.createSession({ system: a.system });
    await s.send('Hello.', { maxTokens: 4, ignoreEos: true });
    // The conversation as the restored one holds it, run from nothing.
    await m.clearPrefixCache();
    r = await s.send(a.message, one);
  } else {
    const t = process.hrtime.bigint();
    const s = await m.loadSession(a.file);
    loadMs = Number(process.hrtime.bigint() - t) / 1e6;
    r = await s.send(a.message, one);
  }
  console.log(JSON.stringify({ ttftMs: r.metrics.ttftMs, cachedTokens: r.metrics.cachedTokens, promptTokens: r.usage.promptTokens, loadMs }));
  m.close();
})().catch((e) => { console.error(e); process.exit(1); });
`;

function child(args) {
  const r = spawnSync(process.execPath, ['-e', CHILD, JSON.stringify(args)], { encoding: 'utf8', maxBuffer: 1 << 26 });
  if (r.status !== 0) throw new Error(`bench child (${args.mode}) failed:\n${r.stderr}`);
  return JSON.parse(r.stdout.trim().split('\n').pop());
}

const median = (xs) => {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
};

async function main() {
  const o = parseOptions(process.argv.slice(2), { model: '', preset: 'lfm2-350m', dtype: 'f32', prompt: 1024, reps: 3, block: 32 }, USAGE);
  const addon = require(path.join(root, 'index.cjs'));
  const dir = await checkpoint(addon, o);
  const vocab = vocabOf(dir);
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'mlx-lfm-bench-restart-'));
  try {
    const base = { dir, block: o.block, warm: ids(64, vocab, 999) };
    const prompt = ids(o.prompt, vocab, 1);
    // Text of about --prompt tokens for the session rows.
    const words = 'the sea and the mountains keep their old stories for the people who listen'.split(' ');
    const system = Array.from({ length: Math.round(o.prompt * 0.8) }, (_, i) => words[i % words.length]).join(' ');
    const message = 'Tell me one of them.';
    const cacheDir = path.join(tmp, 'prefix');
    const file = path.join(tmp, 'session.safetensors');
    const rows = { prefixCold: [], prefixDisk: [], sessionCold: [], sessionLoaded: [] };
    child({ ...base, mode: 'prefix', prompt, cacheDir }); // fills the directory
    child({ ...base, mode: 'session-save', system, message, file });
    for (let rep = 0; rep < o.reps; rep++) {
      rows.prefixCold.push(child({ ...base, mode: 'prefix', prompt }));
      rows.prefixDisk.push(child({ ...base, mode: 'prefix', prompt, cacheDir }));
      rows.sessionCold.push(child({ ...base, mode: 'session-cold', system, message }));
      rows.sessionLoaded.push(child({ ...base, mode: 'session-load', message, file }));
    }
    const summary = {};
    for (const [k, v] of Object.entries(rows)) {
      summary[k] = {
        ttftMsMedian: median(v.map((x) => x.ttftMs)),
        cachedTokens: v[0].cachedTokens,
        promptTokens: v[0].promptTokens,
        ...(v[0].loadMs != null ? { loadSessionMsMedian: median(v.map((x) => x.loadMs)) } : {}),
      };
    }
    summary.prefixSpeedup = summary.prefixCold.ttftMsMedian / summary.prefixDisk.ttftMsMedian;
    summary.sessionSpeedup = summary.sessionCold.ttftMsMedian / summary.sessionLoaded.ttftMsMedian;
    const info = addon.mlxInfo ? addon.mlxInfo() : {};
    console.log(
      JSON.stringify(
        {
          bench: 'restart',
          checkpoint: o.model || `${o.preset} ${o.dtype} (generated, random weights)`,
          prompt: o.prompt,
          block: o.block,
          reps: o.reps,
          backend: info.backend,
          cpus: os.cpus().length,
          cpuModel: os.cpus()[0]?.model,
          summary,
          rows,
        },
        null,
        2,
      ),
    );
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
}

main().catch((e) => {
  console.error(e.message);
  process.exit(1);
});
