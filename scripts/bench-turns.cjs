#!/usr/bin/env node
// `npm run bench:turns`: time to first token of a multi-turn conversation,
// warm (the conversation so far reused) against cold, for mlx-lfm and mlx-lm
// on the same checkpoint in the same run.
//
// The conversation is token-level and the same shape for both: a system
// prompt of S random ids, then per turn U user ids and a greedy reply of R
// tokens (EOS ignored) appended to the history. The ids come from one
// formula shared with `mlx-lfm-bench --turns` and mlx_lm_ref.py bench_turns.
//   mlx-lfm warm: one model with the paged cache answering every turn
//     (prefix reuse finds the conversation so far); cold: a second model
//     whose prefix cache is cleared before each turn.
//   mlx-lm warm: one prompt cache kept across turns and fed only the tokens
//     it has not seen (mlx_lm.chat's way; LFM2's conv caches cannot be
//     trimmed, so an exact continuation is all it can reuse); cold: a fresh
//     cache and the whole prompt.
// Each side appends its own reply, so the histories have the same lengths;
// their ids agree as long as the greedy replies do.
'use strict';
const path = require('node:path');

const root = path.resolve(__dirname, '..');
const { parseOptions, ids, checkpoint, vocabOf, mlxLm } = require('./bench-common.cjs');
const USAGE = `usage: npm run bench:turns -- [--model DIR | --preset P --dtype D] [--turns 4] [--system 1024]
                              [--user 64] [--reply 32] [--block 32] [--skip-ref]`;

const f = (x) => (x >= 100 ? x.toFixed(0) : x.toFixed(1));

async function main() {
  const o = parseOptions(process.argv.slice(2), { model: '', preset: 'lfm2-350m', dtype: 'bf16', turns: 4, system: 1024, user: 64, reply: 32, block: 32, skipRef: false }, USAGE);
  const addon = require(path.join(root, 'index.cjs'));
  const dir = await checkpoint(addon, o);
  const vocab = vocabOf(dir);
  const load = () => addon.Lfm2Model.load(dir, { useBlockPagedCache: true, pagedBlockSize: o.block });
  const warm = await load();
  const cold = await load();
  const params = { maxTokens: o.reply, ignoreEos: true };
  // Warm-up at the conversation's sizes (kernels are built per shape).
  for (const m of [warm, cold]) {
    for (const n of [64, o.system + o.user, o.user + o.reply]) await m.generate(ids(n, vocab, 999), { maxTokens: 8, ignoreEos: true });
    await m.clearPrefixCache();
  }
  const info = warm.info();
  console.log(`mlx-lfm multi-turn TTFT: ${dir}`);
  console.log(`  ${info.modelType}, ${info.dtype}, ${info.backend}/${info.device}, decode ${info.decodePath}, paged blocks of ${o.block}`);
  console.log(`  system ${o.system} tokens, then ${o.turns} turns of ${o.user} user tokens + ${o.reply}-token greedy replies`);
  let history = ids(o.system, vocab, 1);
  const ours = [];
  for (let t = 0; t < o.turns; t++) {
    history = history.concat(ids(o.user, vocab, 100 + t));
    const w = await warm.generate(history, params);
    await cold.clearPrefixCache();
    const c = await cold.generate(history, params);
    if (w.tokens.join() !== c.tokens.join()) console.log(`  note: turn ${t + 1} warm and cold replies differ`);
    ours.push({ prompt: history.length, warm: w.metrics, cold: c.metrics });
    history = history.concat(w.tokens);
  }
  let ref = null;
  if (!o.skipRef) {
    ref = mlxLm({ op: 'bench_turns', model: dir, vocab, system: o.system, user: o.user, reply: o.reply, turns: o.turns, prefill_step_size: 2048 });
    console.log(`  mlx-lm ${ref.mlx_lm_version} on MLX ${ref.mlx_version} (${ref.default_device})`);
  }
  console.log('');
  console.log('turn | prompt | mlx-lfm warm: cached/run, TTFT ms | mlx-lfm cold TTFT ms | mlx-lm warm: run, TTFT ms | mlx-lm cold TTFT ms | warm vs cold (ours) | ours warm vs mlx-lm warm');
  ours.forEach((r, i) => {
    const m = ref && ref.turns[i];
    const cols = [
      String(i + 1),
      String(r.prompt),
      `${r.warm.cachedTokens}/${r.warm.prefillTokens}, ${f(r.warm.ttftMs)}`,
      f(r.cold.ttftMs),
      m ? `${m.warm_run}, ${f(m.warm_ttft_ms)}` : '-',
      m ? f(m.cold_ttft_ms) : '-',
      `${(r.cold.ttftMs / r.warm.ttftMs).toFixed(2)}x faster`,
      m ? `${(m.warm_ttft_ms / r.warm.ttftMs).toFixed(2)}x` : '-',
    ];
    console.log(cols.join(' | '));
  });
}

main().catch((e) => {
  console.error(`bench-turns: ${e.message}`);
  process.exit(1);
});
