#!/usr/bin/env node
// `npm run bench:concurrent`: aggregate decode throughput of N concurrent
// requests on one model (continuous batching) against the same N requests
// one after another, through the JS API, and the same two phases with
// mlx-lm (generate_step one after another, then its continuous batcher,
// BatchGenerator), in the same run.
//   tokens/s = all generated tokens / wall time from the first call to the
//   last result. Every request: its own random prompt of P ids, G tokens,
//   greedy, EOS ignored. The prefix cache is cleared before each phase.
'use strict';
const path = require('node:path');

const root = path.resolve(__dirname, '..');
const { parseOptions, ids, checkpoint, vocabOf, mlxLm } = require('./bench-common.cjs');
const USAGE = 'usage: npm run bench:concurrent -- [--model DIR | --preset P --dtype D] [--n 8] [--prompt 128] [--gen 64] [--reps 2] [--skip-ref]';

async function main() {
  const o = parseOptions(process.argv.slice(2), { model: '', preset: 'lfm2-350m', dtype: 'bf16', n: 8, prompt: 128, gen: 64, reps: 2, skipRef: false }, USAGE);
  const addon = require(path.join(root, 'index.cjs'));
  const dir = await checkpoint(addon, o);
  const vocab = vocabOf(dir);
  const m = await addon.Lfm2Model.load(dir);
  const info = m.info();
  const params = { maxTokens: o.gen, ignoreEos: true };
  await m.generate(ids(o.prompt, vocab, 999), { maxTokens: 8, ignoreEos: true });
  await Promise.all(Array.from({ length: o.n }, (_, i) => m.generate(ids(o.prompt, vocab, 900 + i), { maxTokens: 8, ignoreEos: true })));
  console.log(`mlx-lfm concurrent decode: ${dir}`);
  console.log(`  ${info.modelType}, ${info.dtype}, ${info.backend}/${info.device}, ${info.cacheKind} cache, decode ${info.decodePath}`);
  console.log(`  ${o.n} requests of ${o.prompt} prompt tokens + ${o.gen} generated (greedy, EOS ignored); best of ${o.reps}`);
  let bestSeq = 0;
  let bestPar = 0;
  let same = true;
  for (let r = 0; r < o.reps; r++) {
    const prompts = Array.from({ length: o.n }, (_, i) => ids(o.prompt, vocab, 1 + r * 100 + i));
    await m.clearPrefixCache();
    let t = process.hrtime.bigint();
    const seq = [];
    for (const p of prompts) seq.push(await m.generate(p, params));
    const seqS = Number(process.hrtime.bigint() - t) / 1e9;
    await m.clearPrefixCache();
    t = process.hrtime.bigint();
    const par = await Promise.all(prompts.map((p) => m.generate(p, params)));
    const parS = Number(process.hrtime.bigint() - t) / 1e9;
    const n = o.n * o.gen;
    bestSeq = Math.max(bestSeq, n / seqS);
    bestPar = Math.max(bestPar, n / parS);
    same &&= par.every((x, i) => x.tokens.join() === seq[i].tokens.join());
    console.log(`  rep ${r + 1}: sequential ${(n / seqS).toFixed(1)} tok/s (${seqS.toFixed(2)} s), concurrent ${(n / parS).toFixed(1)} tok/s (${parS.toFixed(2)} s)`);
  }
  await m.close();
  let ref = null;
  if (!o.skipRef) {
    const r = mlxLm({ op: 'bench_concurrent', model: dir, vocab, concurrent: o.n, prompt: o.prompt, gen: o.gen, reps: o.reps, prefill_step_size: 2048 });
    ref = { seq: Math.max(...r.runs.map((x) => x.sequential_tps)), par: Math.max(...r.runs.map((x) => x.concurrent_tps)) };
    r.runs.forEach((x, i) => console.log(`  mlx-lm rep ${i + 1}: sequential ${x.sequential_tps.toFixed(1)} tok/s, concurrent ${x.concurrent_tps.toFixed(1)} tok/s`));
    console.log(`  mlx-lm ${r.mlx_lm_version} on MLX ${r.mlx_version} (${r.default_device})`);
  }
  console.log('');
  console.log(`mlx-lfm: sequential ${bestSeq.toFixed(1)} tok/s, ${o.n} concurrent ${bestPar.toFixed(1)} tok/s: ${(bestPar / bestSeq).toFixed(2)}x`);
  if (ref) {
    console.log(`mlx-lm:  sequential ${ref.seq.toFixed(1)} tok/s, ${o.n} concurrent ${ref.par.toFixed(1)} tok/s: ${(ref.par / ref.seq).toFixed(2)}x`);
    console.log(`${o.n} concurrent, mlx-lfm vs mlx-lm: ${(bestPar / ref.par).toFixed(2)}x`);
  }
  console.log(`same tokens as sequential: ${same ? 'yes' : 'no (bf16 batched matmuls can flip near-ties)'}`);
}

main().catch((e) => {
  console.error(`bench-concurrent: ${e.message}`);
  process.exit(1);
});
