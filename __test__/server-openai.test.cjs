// The rest of the OpenAI surface on the server, through the official
// `openai` client against localhost: logprobs (chat and completions, plain
// and streamed), n choices sharing the prompt, penalties and logit_bias,
// lists of prompts and echo. Each answer is checked against the library
// call it stands for on the same model.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { OpenAI } = require('openai');
const { addon, fixture } = require('./helpers.cjs');
const { listen } = require('../lib/server.cjs');

const MODEL_ID = 'tiny-openai';
let ctx;

async function setup() {
  if (ctx) return ctx;
  const model = await addon.Lfm2Model.load(await fixture('tiny', { preset: 'tiny', dtype: 'f32' }));
  const { server, url } = await listen({ model, modelId: MODEL_ID }, { port: 0 });
  const client = new OpenAI({ baseURL: url, apiKey: 'unused', maxRetries: 0, timeout: 60000 });
  ctx = { model, server, url, client };
  return ctx;
}

test.after(() => {
  if (ctx) {
    ctx.server.close();
    ctx.server.closeAllConnections();
    ctx.model.close();
  }
});

const USER = [{ role: 'user', content: 'Name three colours.' }];
const close = (a, b) => Math.abs(a - b) < 1e-5;

async function collect(stream) {
  const chunks = [];
  for await (const c of stream) chunks.push(c);
  return chunks;
}

test('chat logprobs and top_logprobs, plain and streamed, are the library entries in OpenAI shape', async () => {
  const { client, model } = await setup();
  const lib = await model.chat(USER, { maxTokens: 8, ignoreEos: true, logprobs: true, topLogprobs: 3 });
  const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 8, ignore_eos: true, logprobs: true, top_logprobs: 3 });
  const content = r.choices[0].logprobs.content;
  assert.equal(content.length, 8);
  content.forEach((e, i) => {
    assert.equal(e.token, lib.logprobs[i].text);
    assert.ok(close(e.logprob, lib.logprobs[i].logprob));
    assert.deepEqual(e.bytes, [...Buffer.from(e.token, 'utf8')]);
    assert.equal(e.top_logprobs.length, 3);
    assert.ok(e.top_logprobs[0].logprob >= e.top_logprobs[2].logprob);
    // Greedy: the drawn token is the most likely one.
    assert.ok(close(e.top_logprobs[0].logprob, e.logprob));
  });
  const chunks = await collect(await client.chat.completions.create({
    model: MODEL_ID, messages: USER, max_tokens: 8, ignore_eos: true, logprobs: true, top_logprobs: 3, stream: true,
  }));
  const streamed = chunks.flatMap((c) => c.choices[0]?.logprobs?.content ?? []);
  assert.deepEqual(streamed, content);
  // Without logprobs: null, as OpenAI answers.
  const plain = await client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 2 });
  assert.equal(plain.choices[0].logprobs, null);
});

test('completions logprobs (an integer) in the legacy shape, plain and streamed', async () => {
  const { client, model } = await setup();
  const prompt = [1, 40, 300, 41];
  const lib = await model.generate(prompt, { maxTokens: 6, ignoreEos: true, logprobs: true, topLogprobs: 2 });
  const r = await client.completions.create({ model: MODEL_ID, prompt, max_tokens: 6, ignore_eos: true, logprobs: 2 });
  const lp = r.choices[0].logprobs;
  assert.deepEqual(lp.tokens, lib.logprobs.map((e) => e.text));
  lp.token_logprobs.forEach((v, i) => assert.ok(close(v, lib.logprobs[i].logprob)));
  assert.equal(lp.top_logprobs.length, 6);
  lp.top_logprobs.forEach((top, i) => assert.ok(Object.keys(top).length >= 1 && Object.keys(top).length <= 2, `step ${i}`));
  let off = 0;
  lp.text_offset.forEach((o, i) => {
    assert.equal(o, off);
    off += lp.tokens[i].length;
  });
  const chunks = await collect(await client.completions.create({ model: MODEL_ID, prompt, max_tokens: 6, ignore_eos: true, logprobs: 2, stream: true }));
  const parts = chunks.map((c) => c.choices[0]?.logprobs).filter(Boolean);
  assert.deepEqual(parts.flatMap((p) => p.tokens), lp.tokens);
  assert.deepEqual(parts.flatMap((p) => p.text_offset), lp.text_offset);
  assert.deepEqual(parts.flatMap((p) => p.token_logprobs), lp.token_logprobs);
});

test('n choices share the prompt through the prefix cache and match the library with seeds seed + j', async () => {
  const { client, model } = await setup();
  // Long enough to fill whole paged blocks.
  const messages = [{ role: 'user', content: 'Tell me about the sea, the wind and the long grey ships of the northern coast, in detail.' }];
  const before = await model.cacheStats();
  const opts = { model: MODEL_ID, messages, max_tokens: 6, ignore_eos: true, temperature: 1, seed: 11, n: 3 };
  const r = await client.chat.completions.create(opts);
  const after = await model.cacheStats();
  assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2]);
  assert.equal(r.usage.completion_tokens, 18);
  const prompt = (await model.applyChatTemplate(messages)).length;
  assert.equal(r.usage.prompt_tokens, prompt);
  // The two later choices reused the first one's prompt blocks.
  assert.ok(after.hits - before.hits >= 2, `hits ${before.hits} -> ${after.hits}`);
  for (let j = 0; j < 3; j++) {
    const lib = await model.chat(messages, { maxTokens: 6, ignoreEos: true, temperature: 1, seed: 11 + j });
    assert.equal(r.choices[j].message.content, lib.text, `choice ${j}`);
  }
  assert.notEqual(r.choices[0].message.content, r.choices[1].message.content);
  // Streamed: chunks of both choices, each one's text the same as plain.
  const chunks = await collect(await client.chat.completions.create({ ...opts, n: 2, stream: true, stream_options: { include_usage: true } }));
  const text = [0, 1].map((i) => chunks.filter((c) => c.choices[0]?.index === i).map((c) => c.choices[0].delta.content ?? '').join(''));
  assert.deepEqual(text, [r.choices[0].message.content, r.choices[1].message.content]);
  assert.equal(chunks.filter((c) => c.choices[0]?.finish_reason).length, 2);
  assert.equal(chunks.at(-1).usage.completion_tokens, 12);
});

test('presence_penalty, frequency_penalty and logit_bias reach the sampler; bad ones are 400s', async () => {
  const { client, model, url } = await setup();
  const pen = { maxTokens: 8, ignoreEos: true, presencePenalty: 1.5, frequencyPenalty: 0.5 };
  const lib = await model.chat(USER, pen);
  const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 8, ignore_eos: true, presence_penalty: 1.5, frequency_penalty: 0.5 });
  assert.equal(r.choices[0].message.content, lib.text);
  const free = await model.chat(USER, { maxTokens: 8, ignoreEos: true });
  assert.notDeepEqual(lib.tokens, free.tokens, 'the penalties changed nothing: a weak test');
  // A strong bias makes one token the only choice.
  const biased = await client.completions.create({ model: MODEL_ID, prompt: [1, 2, 3], max_tokens: 5, ignore_eos: true, logit_bias: { 77: 100 }, logprobs: 0 });
  assert.deepEqual(await model.tokenize(biased.choices[0].text, false), [77, 77, 77, 77, 77]);
  const vocab = model.info().vocabSize;
  const post = async (p, body) => {
    const res = await fetch(url + p, { method: 'POST', body: JSON.stringify({ max_tokens: 2, ...body }), headers: { 'content-type': 'application/json' } });
    return { status: res.status, error: (await res.json()).error };
  };
  for (const [p, body, param] of [
    ['/completions', { prompt: 'x', logit_bias: { [vocab]: 1 } }, 'logit_bias'],
    ['/completions', { prompt: 'x', logit_bias: { abc: 1 } }, 'logit_bias'],
    ['/completions', { prompt: 'x', logit_bias: { 5: 200 } }, 'logit_bias'],
    ['/completions', { prompt: 'x', logprobs: 6 }, 'logprobs'],
    ['/completions', { prompt: Array(5).fill('x'), n: 16 }, 'n'],
    ['/chat/completions', { messages: USER, presence_penalty: 2.5 }, 'presence_penalty'],
    ['/chat/completions', { messages: USER, top_logprobs: 2 }, 'top_logprobs'],
    ['/chat/completions', { messages: USER, logprobs: true, top_logprobs: 21 }, 'top_logprobs'],
  ]) {
    const { status, error } = await post(p, body);
    assert.equal(status, 400, JSON.stringify(body));
    assert.equal(error.param, param, JSON.stringify(error));
  }
});

test('completions take a list of prompts (each with n choices) and echo', async () => {
  const { client, model } = await setup();
  const prompts = ['Once upon a time', [1, 40, 300]];
  const r = await client.completions.create({ model: MODEL_ID, prompt: prompts, max_tokens: 4, ignore_eos: true, n: 2, echo: true });
  assert.equal(r.choices.length, 4);
  const echoes = ['Once upon a time', await model.detokenize([1, 40, 300])];
  for (let k = 0; k < 4; k++) {
    const lib = await model.generate(prompts[Math.floor(k / 2)], { maxTokens: 4, ignoreEos: true });
    assert.equal(r.choices[k].index, k);
    assert.equal(r.choices[k].text, echoes[Math.floor(k / 2)] + lib.text);
  }
  const p0 = (await model.generate(prompts[0], { maxTokens: 1 })).usage.promptTokens;
  assert.equal(r.usage.prompt_tokens, p0 + 3);
  assert.equal(r.usage.completion_tokens, 16);
  // Streamed: every choice's chunks, the echo first.
  const chunks = await collect(await client.completions.create({ model: MODEL_ID, prompt: prompts, max_tokens: 4, ignore_eos: true, echo: true, stream: true }));
  for (let k = 0; k < 2; k++) {
    const text = chunks.filter((c) => c.choices[0]?.index === k).map((c) => c.choices[0].text).join('');
    assert.equal(text, r.choices[k * 2].text);
  }
});
