// Streaming, cancellation (AbortSignal, breaking out of a stream), tool-call
// parsing and chat sessions.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const { addon, fixture, fixtureCopy, root } = require('./helpers.cjs');

const TINY = { preset: 'tiny', dtype: 'f32' };
let shared;
async function model() {
  shared ??= addon.Lfm2Model.load(await fixture('tiny', TINY));
  return shared;
}

/** Reads a whole stream: its text deltas and its final result. */
async function drain(stream) {
  const deltas = [];
  let result;
  for await (const ev of stream) {
    if (ev.type === 'text') {
      assert.equal(result, undefined, 'no text after done');
      deltas.push(ev.text);
    } else {
      assert.equal(ev.type, 'done');
      result = ev.result;
    }
  }
  assert.ok(result, 'the stream ends with a done event');
  return { deltas, result };
}

const GREEDY = { maxTokens: 24, ignoreEos: true };
let baseline;
async function baselineTokens() {
  const m = await model();
  baseline ??= (await m.generate([1, 2, 3], GREEDY)).tokens;
  return baseline;
}

test('streamed deltas are whole characters and add up to the final text', async () => {
  const m = await model();
  await baselineTokens();
  let multiByte = 0;
  // Sampled output of the random model; try a few seeds until some
  // multi-byte characters came out (seed 15 gives several on CPU).
  for (const seed of [15, 9, 22, 26, 52]) {
    const { deltas, result } = await drain(m.generateStream('😊 你好 😊', { maxTokens: 120, ignoreEos: true, temperature: 1, seed }));
    assert.equal(result.finishReason, 'length');
    const text = deltas.join('');
    for (const d of deltas) {
      assert.ok(d.length > 0, 'no empty deltas');
      assert.ok(d.isWellFormed(), `delta ${JSON.stringify(d)} has a lone surrogate`);
    }
    assert.equal(text, result.text);
    // A character cut in two would show up as an extra U+FFFD here.
    assert.equal(text, await m.detokenize(result.tokens));
    multiByte += [...text].filter((c) => c.codePointAt(0) > 0x7f && c !== '\uFFFD').length;
    if (multiByte >= 2) break;
  }
  assert.ok(multiByte >= 2, 'the sampled output should contain multi-byte characters');
});

test('chatStream gives the same reply as chat, event by event', async () => {
  const m = await model();
  const msgs = [{ role: 'user', content: 'Tell me a story.' }];
  const whole = await m.chat(msgs, GREEDY);
  const { deltas, result } = await drain(m.chatStream(msgs, GREEDY));
  assert.ok(deltas.length > 1);
  assert.equal(deltas.join(''), whole.text);
  assert.deepEqual(result.tokens, whole.tokens);
  assert.equal(result.finishReason, whole.finishReason);
  assert.deepEqual(result.usage, whole.usage);
  // Stop strings are held back and never streamed.
  const stop = whole.text.slice(5, 8);
  const cut = await drain(m.chatStream(msgs, { ...GREEDY, stop }));
  assert.equal(cut.result.finishReason, 'stop');
  assert.equal(cut.deltas.join(''), whole.text.slice(0, whole.text.indexOf(stop)));
});

test('breaking out of for-await stops the generation early', async () => {
  const m = await model();
  const stream = m.generateStream([1, 2, 3], { maxTokens: 5000, ignoreEos: true });
  let seen = 0;
  for await (const ev of stream) {
    assert.equal(ev.type, 'text');
    if (++seen === 2) break;
  }
  const r = await stream.result();
  assert.equal(r.finishReason, 'abort');
  assert.ok(r.tokens.length < 500, `stopped after ${r.tokens.length} tokens`);
  // The iterator is finished after the break.
  assert.deepEqual(await stream[Symbol.asyncIterator]().next(), { value: undefined, done: true });
  // cancel() does the same without a loop.
  const s2 = m.generateStream([1, 2, 3], { maxTokens: 5000, ignoreEos: true });
  s2.cancel();
  assert.equal((await s2.result()).finishReason, 'abort');
  assert.deepEqual((await m.generate([1, 2, 3], GREEDY)).tokens, await baselineTokens());
});

test('an abort during decode resolves with the text so far', async () => {
  const m = await model();
  // Stream: abort as soon as text arrives, so decode is surely running.
  const ac = new AbortController();
  const stream = m.chatStream([{ role: 'user', content: 'hi' }], { maxTokens: 5000, ignoreEos: true, signal: ac.signal });
  const deltas = [];
  let result;
  for await (const ev of stream) {
    if (ev.type === 'text') {
      deltas.push(ev.text);
      ac.abort();
    } else result = ev.result;
  }
  assert.equal(result.finishReason, 'abort');
  assert.ok(result.tokens.length >= 1 && result.tokens.length < 500, `${result.tokens.length} tokens`);
  assert.equal(deltas.join(''), result.text);
  assert.ok((await m.detokenize(result.tokens)).startsWith(result.text));
  // Promise form: abort on a timer.
  const ac2 = new AbortController();
  setTimeout(() => ac2.abort(), 150);
  const r = await m.generate([1, 2, 3], { maxTokens: 5000, ignoreEos: true, signal: ac2.signal });
  assert.equal(r.finishReason, 'abort');
  assert.ok(r.tokens.length < 5000);
  assert.equal(r.usage.completionTokens, r.tokens.length);
  assert.deepEqual((await m.generate([1, 2, 3], GREEDY)).tokens, await baselineTokens());
});

test('an abort during a chunked prefill stops between chunks', async () => {
  const m = await addon.Lfm2Model.load(await fixture('tiny', TINY), { prefillChunkSize: 8 });
  try {
    // 1000 chunks: far more than run in the 100 ms before the abort.
    const long = Array.from({ length: 8000 }, (_, i) => 20 + (i % 900));
    const ac = new AbortController();
    setTimeout(() => ac.abort(), 100);
    const r = await m.generate(long, { maxTokens: 8, signal: ac.signal });
    assert.equal(r.finishReason, 'abort');
    assert.equal(r.text, '');
    assert.deepEqual(r.tokens, []);
    assert.equal(r.usage.promptTokens, long.length);
    assert.ok(r.metrics.prefillTokens < long.length, `prefill ran ${r.metrics.prefillTokens} of ${long.length} tokens`);
    assert.equal(r.metrics.prefillTokens % 8, 0, 'stopped on a chunk boundary');
    // The same model answers normally afterwards.
    assert.deepEqual((await m.generate([1, 2, 3], GREEDY)).tokens, await baselineTokens());
  } finally {
    m.close();
  }
});

test('an already-aborted signal resolves at once without queueing', async () => {
  const m = await model();
  // Keep the worker busy; the aborted calls must not wait behind it.
  const busy = new AbortController();
  const long = m.generate([1, 2, 3], { maxTokens: 5000, ignoreEos: true, signal: busy.signal });
  const signal = AbortSignal.abort();
  const r = await m.chat([{ role: 'user', content: 'hi' }], { maxTokens: 8, signal });
  assert.equal(r.finishReason, 'abort');
  assert.equal(r.text, '');
  assert.deepEqual(r.usage, { promptTokens: 0, completionTokens: 0, totalTokens: 0 });
  const { deltas, result } = await drain(m.generateStream([1, 2], { maxTokens: 8, signal }));
  assert.deepEqual(deltas, []);
  assert.equal(result.finishReason, 'abort');
  busy.abort();
  assert.equal((await long).finishReason, 'abort');
  // Bad options are still rejected (the promise, not a throw), signal or not.
  await assert.rejects(m.generate([1], { maxTokens: 0, signal }), /maxTokens/);
  await assert.rejects(m.generate([1], { signal: {} }), /AbortSignal/);
  assert.deepEqual((await m.generate([1, 2, 3], GREEDY)).tokens, await baselineTokens());
});

test('a long-lived signal does not collect listeners', async () => {
  const m = await model();
  const { getEventListeners } = require('node:events');
  const ac = new AbortController();
  for (let i = 0; i < 3; i++) await m.generate([1, 2], { maxTokens: 2, signal: ac.signal });
  await drain(m.generateStream([1, 2], { maxTokens: 2, signal: ac.signal }));
  await new Promise((r) => setTimeout(r, 20));
  assert.equal(getEventListeners(ac.signal, 'abort').length, 0);
});

test('a failing streamed request rejects the iteration', async () => {
  const m = await model();
  await assert.rejects(drain(m.generateStream([1, 999999], { maxTokens: 2 })), /token id 999999 is out of range/);
  const s = m.generateStream([1, 999999], { maxTokens: 2 });
  await assert.rejects(s.result(), /out of range/);
});

test('parseToolCalls: LFM2 tool-call output to OpenAI tool calls', () => {
  const text =
    'Let me look. <|tool_call_start|>[get_weather(city="Zürich", days=3, units=\'metric\', detail=None), ' +
    'search(q="a \\"quoted\\" word", filters={"tags": ["x", 1.5, True]})]<|tool_call_end|>Done.';
  const r = addon.parseToolCalls(text);
  assert.equal(r.text, 'Let me look. Done.');
  assert.deepEqual(r.toolCallErrors, []);
  assert.equal(r.toolCalls.length, 2);
  for (const c of r.toolCalls) {
    assert.match(c.id, /^call_[A-Za-z0-9]{24}$/);
    assert.equal(c.type, 'function');
  }
  assert.notEqual(r.toolCalls[0].id, r.toolCalls[1].id);
  assert.equal(r.toolCalls[0].function.name, 'get_weather');
  assert.deepEqual(JSON.parse(r.toolCalls[0].function.arguments), { city: 'Zürich', days: 3, units: 'metric', detail: null });
  assert.deepEqual(JSON.parse(r.toolCalls[1].function.arguments), { q: 'a "quoted" word', filters: { tags: ['x', 1.5, true] } });

  const json = addon.parseToolCalls('<|tool_call_start|>[{"name": "f", "arguments": {"a": [1, {"b": null}]}}]<|tool_call_end|>');
  assert.deepEqual(JSON.parse(json.toolCalls[0].function.arguments), { a: [1, { b: null }] });

  const bad = addon.parseToolCalls('x<|tool_call_start|>[f(1, 2)]<|tool_call_end|>y<|tool_call_start|>[g(a=');
  assert.equal(bad.text, 'xy');
  assert.deepEqual(bad.toolCalls, []);
  assert.equal(bad.toolCallErrors.length, 2);
  assert.equal(bad.toolCallErrors[0].raw, '<|tool_call_start|>[f(1, 2)]<|tool_call_end|>');
  assert.match(bad.toolCallErrors[0].message, /positional argument/);
  assert.match(bad.toolCallErrors[1].message, /not closed/);

  const none = addon.parseToolCalls('plain text');
  assert.deepEqual(none, { text: 'plain text', toolCalls: [], toolCallErrors: [] });
});

test('assistant tool calls and tool results are rendered by the chat template', async () => {
  const toolCalls = [{ id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Oslo"}' } }];
  const msgs = [
    { role: 'user', content: 'Weather in Oslo?' },
    { role: 'assistant', content: '', toolCalls },
    { role: 'tool', toolCallId: 'call_1', content: '{"temp": 21}' },
  ];
  const tools = [{ type: 'function', function: { name: 'get_weather', parameters: { type: 'object' } } }];
  // LFM2's own template does not render tool_calls: they are written back as
  // the model's tool-call text.
  const dir = await fixtureCopy('tiny', TINY, 'lfm2-template');
  fs.writeFileSync(path.join(dir, 'chat_template.jinja'), fs.readFileSync(path.join(root, 'src', 'text', 'lfm2_template.jinja'), 'utf8'));
  const m = await addon.Lfm2Model.load(dir);
  try {
    const text = await m.detokenize(await m.applyChatTemplate(msgs, { tools }));
    assert.ok(text.includes('<|im_start|>assistant\n<|tool_call_start|>[get_weather(city="Oslo")]<|tool_call_end|><|im_end|>'), text);
    assert.ok(text.includes('<|tool_response_start|>{"temp": 21}<|tool_response_end|>'), text);
    assert.ok(text.includes('<|tool_list_start|>[{"type": "function"'), text);
    await assert.rejects(
      async () => m.applyChatTemplate([{ role: 'assistant', toolCalls: [{ function: { name: 'f', arguments: '{oops' } }] }]),
      /messages\[0\]\.toolCalls\[0\]\.function\.arguments is not valid JSON/,
    );
  } finally {
    m.close();
  }
  // The fixture's template renders tool_calls itself (as JSON): left to it.
  const f = await model();
  const text = await f.detokenize(await f.applyChatTemplate(msgs));
  assert.ok(text.includes('<|tool_call_start|>[{"id": "call_1", "type": "function"'), text);
});

test('a session keeps its history across turns, tool results included', async () => {
  const m = await model();
  const s = m.createSession({ system: 'Be brief.', defaults: { maxTokens: 6, ignoreEos: true } });
  const t1 = await s.send('Hello there');
  const t2 = await s.send('And again');
  assert.deepEqual(s.history.map((x) => x.role), ['system', 'user', 'assistant', 'user', 'assistant']);
  assert.equal(s.history[2].content, t1.text);
  // Each turn runs the whole conversation (no prefix cache yet).
  const before = s.history.slice(0, 4);
  assert.equal(t2.usage.promptTokens, (await m.applyChatTemplate(before)).length);
  // Per-turn options override the defaults; streaming turns join the history too.
  const { deltas, result } = await drain(s.sendStream('Third', { maxTokens: 3 }));
  assert.equal(result.tokens.length, 3);
  assert.equal(deltas.join(''), result.text);
  assert.equal(s.history.length, 7);
  assert.equal(s.history[6].content, result.text);

  // One turn at a time.
  const pending = s.send('Fourth');
  // A Promise-returning method rejects rather than throws, even for a busy session.
  await assert.rejects(s.send('Fifth'), /already in progress/);
  await pending;
  assert.equal(s.history.length, 9);

  // A turn aborted before any text leaves no trace; a failed turn neither.
  await s.send('never', { signal: AbortSignal.abort() });
  assert.equal(s.history.length, 9);
  s.reset();
  assert.deepEqual(s.history, [{ role: 'system', content: 'Be brief.' }]);
  await assert.rejects(async () => s.send(), /needs a message/);

  // Tool calls in the history and their results.
  const call = { id: 'call_abc', type: 'function', function: { name: 'get_time', arguments: '{"tz": "UTC"}' } };
  const t = m.createSession({
    tools: [{ type: 'function', function: { name: 'get_time', parameters: { type: 'object' } } }],
    messages: [{ role: 'user', content: 'What time is it?' }, { role: 'assistant', content: '', toolCalls: [call] }],
    defaults: { maxTokens: 4, ignoreEos: true },
  });
  assert.throws(() => t.addToolResult('call_nope', '12:00'), /no tool call with id `call_nope`/);
  t.addToolResult('call_abc', { time: '12:00' });
  assert.deepEqual(t.history[2], { role: 'tool', content: '{"time":"12:00"}', toolCallId: 'call_abc', name: 'get_time' });
  const reply = await t.send();
  assert.equal(reply.usage.promptTokens, (await m.applyChatTemplate(t.history.slice(0, 3), { tools: [{ type: 'function', function: { name: 'get_time', parameters: { type: 'object' } } }] })).length);
  assert.deepEqual(t.history.map((x) => x.role), ['user', 'assistant', 'tool', 'assistant']);
  assert.throws(() => m.createSession({ defaults: { signal: AbortSignal.abort() } }), /defaults\.signal/);
});

test('concurrent streams run batched: one cancelled, one aborted, the others as if alone', async () => {
  const m = await addon.Lfm2Model.load(await fixture('tiny', TINY));
  const prompts = Array.from({ length: 6 }, (_, i) => Array.from({ length: 5 + 9 * i }, (_, j) => ((j * 31 + i * 7) % 800) + 3));
  const opts = (i) => ({ maxTokens: 20 + 5 * i, ignoreEos: true });
  const alone = [];
  for (let i = 0; i < prompts.length; i++) alone.push((await m.generate(prompts[i], opts(i))).tokens);
  await m.clearPrefixCache();
  const ac = new AbortController();
  const runs = prompts.map(async (p, i) => {
    if (i === 1) {
      // Leaves the batch by breaking out of its stream.
      let n = 0;
      for await (const ev of m.generateStream(p, opts(i))) if (ev.type === 'text' && ++n === 3) break;
      return null;
    }
    if (i === 2) {
      const r = m.generate(p, { ...opts(i), signal: ac.signal });
      setTimeout(() => ac.abort(), 5);
      return (await r).finishReason;
    }
    return (await drain(m.generateStream(p, opts(i)))).result.tokens;
  });
  const got = await Promise.all(runs);
  assert.ok(['abort', 'length'].includes(got[2]));
  for (const i of [0, 3, 4, 5]) assert.deepEqual(got[i], alone[i], `stream ${i} differs from its run alone`);
  // And the model is sound afterwards.
  assert.deepEqual((await m.generate(prompts[0], opts(0))).tokens, alone[0]);
  assert.equal((await m.cacheStats()).blocksInUse, 0);
});
