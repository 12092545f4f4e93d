// Parity with mlx-lm 0.32.2 (the reference) on generated checkpoints with
// f32 weights: greedy tokens identical for 64 steps, first-step logits
// within 1e-3 max-abs, and the same prompt tokens from the chat template.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { addon, fixture, fixtureCopy, reference, maxAbsDiff } = require('./helpers.cjs');

const GEN = 64;
const prompts = {
  one: [1],
  few: [1, 40, 300, 41, 7, 512, 99],
  // Longer than the 16-token prefill chunk the model is loaded with below.
  long: Array.from({ length: 45 }, (_, i) => (i * 37 + 11) % 900 + 2),
};

const variants = [
  ['hf layout, single file', 'tiny-f32-hf', { preset: 'tiny', dtype: 'f32', layout: 'hf' }],
  ['mlx layout, sharded', 'tiny-f32-mlx-sharded', { preset: 'tiny', dtype: 'f32', layout: 'mlx', maxShardBytes: 400000 }],
  ['layer_types and rope_parameters', 'tiny-f32-variant', {
    preset: 'tiny', dtype: 'f32', layout: 'hf', seed: 5, attnStyle: 'layer_types', ropeInParameters: true,
  }],
];

// mlx-lm requires num_key_value_heads, so for a config without it the
// reference runs on a copy that spells out the default (= attention heads).
variants.push(['no num_key_value_heads (reference on a copy stating the default)', 'tiny-f32-nokv', {
  preset: 'tiny', dtype: 'f32', layout: 'hf', seed: 9, omitNumKeyValueHeads: true,
}, async (dir) => {
  const copy = await fixtureCopy('tiny-f32-nokv', null, 'tiny-f32-nokv-explicit');
  const cfgPath = path.join(copy, 'config.json');
  const cfg = JSON.parse(fs.readFileSync(cfgPath, 'utf8'));
  assert.equal(cfg.num_key_value_heads, undefined);
  cfg.num_key_value_heads = cfg.num_attention_heads;
  fs.writeFileSync(cfgPath, JSON.stringify(cfg));
  return copy;
}]);

for (const [label, name, opts, refDir] of variants) {
  test(`greedy tokens and logits match mlx-lm: ${label}`, async () => {
    const dir = await fixture(name, opts);
    const ref = reference({
      op: 'greedy', model: refDir ? await refDir(dir) : dir,
      cases: Object.values(prompts).map((p) => ({ prompt: p, max_tokens: GEN })),
    }).results;
    const model = await addon.Lfm2Model.load(dir, { prefillChunkSize: 16 });
    try {
      const names = Object.keys(prompts);
      for (let i = 0; i < names.length; i++) {
        const p = prompts[names[i]];
        const ours = await model.generate(p, { maxTokens: GEN, ignoreEos: true });
        assert.equal(ours.tokens.length, GEN);
        assert.deepEqual(ours.tokens, ref[i].tokens, `${names[i]} prompt: tokens differ`);
        // A model stuck on one token would make this comparison weak.
        assert.ok(new Set(ours.tokens).size > 3, `${names[i]}: degenerate output ${ours.tokens}`);
        const logits = await model.logits(p);
        const d = maxAbsDiff(logits, ref[i].logits);
        assert.ok(d < 1e-3, `${names[i]} prompt: logits differ by ${d}`);
      }
    } finally {
      model.close();
    }
  });
}

test('chat template and string prompts tokenize exactly as mlx-lm/transformers do', async () => {
  const dir = await fixture('tiny-f32-hf', variants[0][2]);
  const model = await addon.Lfm2Model.load(dir);
  try {
    const messages = [
      { role: 'system', content: 'You are terse.' },
      { role: 'user', content: 'Hi there! Café, naïve, 中文 and emoji 🙂.' },
      { role: 'assistant', content: 'Hello.' },
      { role: 'user', content: 'What is 2+2?' },
    ];
    const ours = await model.applyChatTemplate(messages);
    assert.deepEqual(ours, reference({ op: 'chat_prompt', model: dir, messages }).prompt);
    const tools = [{ type: 'function', function: { name: 'get_weather', description: 'Weather <now> & later', parameters: { type: 'object', properties: { city: { type: 'string' } } } } }];
    const withTools = await model.applyChatTemplate(messages.slice(1, 2), { tools });
    assert.deepEqual(withTools, reference({ op: 'chat_prompt', model: dir, messages: messages.slice(1, 2), tools }).prompt);
    for (const text of ['Once upon a time', '<|startoftext|>Already has BOS']) {
      const ref = reference({ op: 'encode', model: dir, text }).ids;
      const r = await model.generate(text, { maxTokens: 1 });
      assert.equal(r.usage.promptTokens, ref.length);
      assert.deepEqual(await model.tokenize(text, !text.startsWith('<|startoftext|>')), ref);
    }
  } finally {
    model.close();
  }
});
