// On the H200, from an app that installed mlx-lfm and its CUDA package with
// npm: which binding loaded, a chat on a tiny generated model and on an
// LFM2-1.2B-shaped bf16 one (random weights), and the server answering an
// OpenAI request. Writes what it saw as JSON (argv[3]).
'use strict';
const fs = require('node:fs');
const path = require('node:path');
const { spawn } = require('node:child_process');
const { Lfm2Model, generateFixture, mlxInfo } = require('mlx-lfm');

const [dir, outFile] = process.argv.slice(2);

async function chat(model, opts) {
  const m = await Lfm2Model.load(model);
  const info = m.info();
  const r = await m.chat([{ role: 'user', content: 'Write a long story about a lighthouse.' }], opts);
  await m.close();
  return { device: info.device, decodePath: info.decodePath, finish: r.finishReason, tokens: r.usage.completionTokens, metrics: r.metrics, text: r.text.slice(0, 80) };
}

async function serve(model) {
  const cli = require.resolve('mlx-lfm/cli.cjs');
  const p = spawn(process.execPath, [cli, 'serve', '--model', model, '--port', '18123'], { stdio: ['ignore', 'pipe', 'pipe'] });
  let log = '';
  p.stdout.on('data', (d) => (log += d));
  p.stderr.on('data', (d) => (log += d));
  try {
    for (let i = 0; i < 600; i++) {
      try {
        const h = await fetch('http://127.0.0.1:18123/health');
        if (h.ok) break;
      } catch {}
      await new Promise((r) => setTimeout(r, 100));
    }
    const res = await fetch('http://127.0.0.1:18123/v1/chat/completions', {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ messages: [{ role: 'user', content: 'Hello' }], max_tokens: 8 }),
    });
    return { status: res.status, body: await res.json() };
  } finally {
    p.kill('SIGTERM');
    await new Promise((r) => p.on('exit', r));
    if (log) console.log(log.trim().split('\n').slice(-5).join('\n'));
  }
}

(async () => {
  const seen = { mlxInfo: mlxInfo() };
  console.log(JSON.stringify(seen.mlxInfo));
  const tiny = path.join(dir, 'tiny');
  await generateFixture(tiny, { preset: 'tiny' });
  seen.tiny = await chat(tiny, { maxTokens: 16 });
  const big = path.join(dir, 'lfm2-1.2b-bf16');
  const t = Date.now();
  if (process.env.NP_BIG !== '0') await generateFixture(big, { preset: 'lfm2-1.2b', dtype: 'bf16' });
  seen.generate_1_2b_s = (Date.now() - t) / 1000;
  // NP_BIG=0 skips the 1.2B (a dry run of this script on a CPU machine).
  if (process.env.NP_BIG !== '0') seen.big = await chat(big, { maxTokens: 256, temperature: 0, ignoreEos: true });
  seen.server = await serve(tiny);
  console.log(JSON.stringify(seen, null, 1));
  fs.writeFileSync(outFile, JSON.stringify(seen, null, 1));
})().catch((e) => {
  console.error(e);
  process.exit(1);
});
