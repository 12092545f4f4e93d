// Logits processors (logit bias, presence / frequency / repetition
// penalties) and log-probabilities against mlx-lm 0.32.2's generate_step
// with make_logits_processors, on a random-weight f32 fixture: the same
// greedy tokens, and the same log-probabilities (the log-softmax of the
// processed logits) for the drawn token and the top alternatives. Run
// alone, batched with other requests (the compiled stacked step), and on
// the eager path.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { addon, fixture, reference } = require('./helpers.cjs');

const GEN = 24;
const FIX = ['tiny-f32-hf', { preset: 'tiny', dtype: 'f32', layout: 'hf' }];

const cases = [
  { prompt: [1, 40, 300, 41, 7, 512, 99], top: 5, opts: { logitBias: { 7: 2.5, 300: -1.0 }, presencePenalty: 0.7, frequencyPenalty: 0.4 } },
  { prompt: [1, 5, 5, 5, 9], top: 3, opts: { repetitionPenalty: 1.3, frequencyPenalty: -0.5, repetitionContextSize: 8 } },
  { prompt: [1, 77, 120], top: 0, opts: {} },
];

function refCase(c) {
  const o = c.opts;
  return {
    prompt: c.prompt, max_tokens: GEN, top: c.top,
    logit_bias: o.logitBias ?? null,
    repetition_penalty: o.repetitionPenalty ?? null,
    presence_penalty: o.presencePenalty ?? null,
    frequency_penalty: o.frequencyPenalty ?? null,
    context_size: o.repetitionContextSize ?? 20,
  };
}

function check(label, ours, ref, top) {
  assert.deepEqual(ours.tokens, ref.tokens, `${label}: tokens differ`);
  assert.equal(ours.logprobs.length, GEN);
  for (let i = 0; i < GEN; i++) {
    const e = ours.logprobs[i];
    assert.equal(e.token, ours.tokens[i]);
    assert.ok(Math.abs(e.logprob - ref.logprobs[i]) < 1e-4, `${label} step ${i}: ${e.logprob} vs ${ref.logprobs[i]}`);
    assert.equal(e.topLogprobs.length, top);
    for (let k = 0; k < top; k++) {
      assert.ok(Math.abs(e.topLogprobs[k].logprob - ref.top[i][k][1]) < 1e-4, `${label} step ${i} top ${k}`);
      assert.equal(typeof e.topLogprobs[k].text, 'string');
    }
    // Ids may swap only between (near-)ties.
    const ids = e.topLogprobs.map((t) => t.token).sort();
    const refIds = ref.top[i].map((t) => t[0]).sort();
    if (JSON.stringify(ids) !== JSON.stringify(refIds)) {
      const lastRef = ref.top[i][top - 1][1];
      for (const t of e.topLogprobs) {
        if (!refIds.includes(t.token)) assert.ok(Math.abs(t.logprob - lastRef) < 1e-4, `${label} step ${i}: top ids differ`);
      }
    }
  }
}

let ref;
function refResults(dir) {
  ref ??= reference({ op: 'processed', model: dir, cases: cases.map(refCase) }).results;
  // A fixture whose processors never change a choice would test little.
  return ref;
}

for (const decodePath of ['compiled', 'eager']) {
  test(`logit bias, penalties and logprobs match mlx-lm (${decodePath}, alone and batched)`, async () => {
    const dir = await fixture(...FIX);
    const r = refResults(dir);
    const model = await addon.Lfm2Model.load(dir, { decodePath });
    try {
      const opts = (c) => ({ ...c.opts, maxTokens: GEN, ignoreEos: true, logprobs: true, topLogprobs: c.top });
      for (let i = 0; i < cases.length; i++) {
        check(`case ${i} alone`, await model.generate(cases[i].prompt, opts(cases[i])), r[i], cases[i].top);
      }
      const together = await Promise.all(cases.map((c) => model.generate(c.prompt, opts(c))));
      together.forEach((g, i) => check(`case ${i} batched`, g, r[i], cases[i].top));
      // Without the processors the first case decodes differently: they did something.
      const plain = await model.generate(cases[0].prompt, { maxTokens: GEN, ignoreEos: true });
      assert.notDeepEqual(plain.tokens, r[0].tokens);
      assert.equal(plain.logprobs, undefined);
    } finally {
      model.close();
    }
  });
}

test('streamed events carry the same logprobs as the result', async () => {
  const dir = await fixture(...FIX);
  const model = await addon.Lfm2Model.load(dir);
  try {
    const stream = model.generateStream([1, 40, 300], { maxTokens: 12, ignoreEos: true, topLogprobs: 2 });
    const seen = [];
    let done;
    for await (const ev of stream) {
      if (ev.type === 'text') seen.push(...(ev.logprobs ?? []));
      else done = ev.result;
    }
    assert.equal(seen.length, 12);
    assert.deepEqual(seen, done.logprobs);
    assert.ok(seen.every((e) => e.topLogprobs.length === 2 && e.topLogprobs[0].logprob >= e.topLogprobs[1].logprob));
  } finally {
    model.close();
  }
});

test('bad sampler options are named errors before any compute', async () => {
  const dir = await fixture(...FIX);
  const model = await addon.Lfm2Model.load(dir);
  try {
    const vocab = model.info().vocabSize;
    await assert.rejects(model.generate([1], { logitBias: { [vocab]: 1 } }), /logitBias names token id/);
    await assert.rejects(model.generate([1], { logitBias: { abc: 1 } }), { name: 'TypeError', message: /logitBias key `abc`/ });
    await assert.rejects(model.generate([1], { logitBias: { 3: 101 } }), { name: 'RangeError', message: /logitBias\[3\]/ });
    await assert.rejects(model.generate([1], { topLogprobs: 21 }), { name: 'RangeError', message: /topLogprobs/ });
    await assert.rejects(model.generate([1], { presencePenalty: 3 }), /presencePenalty must be from -2 to 2/);
    await assert.rejects(model.generate([1], { frequencyPenalty: NaN }), /frequencyPenalty/);
    // The model still works.
    assert.equal((await model.generate([1], { maxTokens: 2, ignoreEos: true })).tokens.length, 2);
  } finally {
    model.close();
  }
});
