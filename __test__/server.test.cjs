// The OpenAI-compatible server, driven by the official `openai` client
// against localhost (no network needed).
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { spawn } = require('node:child_process');
const { OpenAI } = require('openai');
const { addon, fixture, root } = require('./helpers.cjs');
const { listen } = require('../lib/server.cjs');

const TINY = { preset: 'tiny', dtype: 'f32' };
const MODEL_ID = 'tiny-test';
let ctx;

/** One model and one server for the file. */
async function setup() {
  if (ctx) return ctx;
  const model = await addon.Lfm2Model.load(await fixture('tiny', TINY));
  const streams = [];
  const generates = [];
  // The real model, with the results of streamed requests and generate() calls recorded.
  const spy = {
    chat: (m, o) => model.chat(m, o),
    generate: (p, o) => {
      const r = model.generate(p, o);
      generates.push(r);
      return r;
    },
    chatStream: (m, o) => {
      const s = model.chatStream(m, o);
      streams.push(s.result());
      return s;
    },
    generateStream: (p, o) => {
      const s = model.generateStream(p, o);
      streams.push(s.result());
      return s;
    },
  };
  const { server, url } = await listen({ model: spy, modelId: MODEL_ID, maxBodyBytes: 64 * 1024 }, { port: 0 });
  const client = new OpenAI({ baseURL: url, apiKey: 'unused', maxRetries: 0, timeout: 30000 });
  ctx = { model, server, url, client, streams, generates };
  return ctx;
}

test.after(() => {
  if (ctx) {
    ctx.server.close();
    ctx.server.closeAllConnections();
    ctx.model.close();
  }
});

const USER = [{ role: 'user', content: 'Tell me a story.' }];

test('GET /v1/models lists the served model', async () => {
  const { client } = await setup();
  const list = await client.models.list();
  assert.deepEqual(list.data.map((m) => m.id), [MODEL_ID]);
  assert.equal((await client.models.retrieve(MODEL_ID)).id, MODEL_ID);
  await assert.rejects(client.models.retrieve('other'), (e) => e.status === 404);
});

test('chat completions, plain and streamed, match the model', async () => {
  const { client, model } = await setup();
  const direct = await model.chat(USER, { maxTokens: 8, ignoreEos: true });
  const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 8, ignore_eos: true });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.model, MODEL_ID);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(r.choices[0].message.content, direct.text);
  assert.equal(r.choices[0].finish_reason, 'length');
  const { prompt_tokens_details: details, ...counts } = r.usage;
  assert.deepEqual(counts, { prompt_tokens: direct.usage.promptTokens, completion_tokens: 8, total_tokens: direct.usage.totalTokens });
  assert.ok(Number.isInteger(details.cached_tokens) && details.cached_tokens < direct.usage.promptTokens);

  const stream = await client.chat.completions.create({
    model: MODEL_ID,
    messages: USER,
    max_completion_tokens: 8,
    ignore_eos: true,
    stream: true,
    stream_options: { include_usage: true },
  });
  let text = '';
  const finish = [];
  let usage;
  let chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    assert.equal(chunk.object, 'chat.completion.chunk');
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) {
      text += c.delta.content ?? '';
      if (c.finish_reason) finish.push(c.finish_reason);
    }
  }
  assert.ok(chunks > 3);
  assert.equal(text, direct.text);
  assert.deepEqual(finish, ['length']);
  assert.equal(usage.completion_tokens, 8);
});

test('completions accept a string or token ids, plain and streamed', async () => {
  const { client, model } = await setup();
  const direct = await model.generate([1, 2, 3], { maxTokens: 6, ignoreEos: true });
  const r = await client.completions.create({ model: MODEL_ID, prompt: [1, 2, 3], max_tokens: 6, ignore_eos: true });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices[0].text, direct.text);
  assert.equal(r.usage.prompt_tokens, 3);
  const s = await client.completions.create({ model: MODEL_ID, prompt: 'Once upon a time', max_tokens: 6, ignore_eos: true, stream: true });
  let text = '';
  for await (const chunk of s) text += chunk.choices[0]?.text ?? '';
  assert.equal(text, (await model.generate('Once upon a time', { maxTokens: 6, ignoreEos: true })).text);
  // OpenAI's parameters reach the model: a seeded sample is reproducible.
  const a = await client.completions.create({ model: MODEL_ID, prompt: 'x', max_tokens: 6, temperature: 0.9, top_p: 0.9, seed: 3, top_k: 20, min_p: 0.01 });
  const b = await model.generate('x', { maxTokens: 6, temperature: 0.9, topP: 0.9, seed: 3, topK: 20, minP: 0.01 });
  assert.equal(a.choices[0].text, b.text);
});

test('bad requests get OpenAI error bodies', async () => {
  const { client, url } = await setup();
  await assert.rejects(client.chat.completions.create({ model: MODEL_ID, messages: 'hello' }), (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError, e.constructor.name);
    assert.equal(e.status, 400);
    assert.equal(e.error.type, 'invalid_request_error');
    assert.equal(e.error.param, 'messages');
    assert.equal(e.error.code, 'invalid_type');
    return true;
  });
  await assert.rejects(client.chat.completions.create({ model: MODEL_ID, messages: [] }), (e) => e.status === 400 && e.param === 'messages');
  await assert.rejects(client.chat.completions.create({ model: MODEL_ID, messages: USER, temperature: 'hot' }), (e) => e.status === 400 && e.param === 'temperature');
  await assert.rejects(client.chat.completions.create({ model: MODEL_ID, messages: USER, n: 17 }), (e) => e.status === 400 && e.param === 'n');
  await assert.rejects(client.chat.completions.create({ model: 'gpt-4o', messages: USER }), (e) => {
    assert.ok(e instanceof OpenAI.NotFoundError);
    assert.equal(e.code, 'model_not_found');
    return true;
  });
  await assert.rejects(client.completions.create({ model: MODEL_ID, prompt: [1, 999999], max_tokens: 2 }), (e) => e.status === 400 && /out of range/.test(e.message));

  const post = (p, body, headers = {}) => fetch(url + p, { method: 'POST', body, headers: { 'content-type': 'application/json', ...headers } });
  const bad = await post('/chat/completions', '{"messages": [');
  assert.equal(bad.status, 400);
  const badBody = await bad.json();
  assert.deepEqual(Object.keys(badBody.error).sort(), ['code', 'message', 'param', 'type']);
  assert.equal(badBody.error.code, 'invalid_json');
  const big = await post('/chat/completions', JSON.stringify({ messages: [{ role: 'user', content: 'x'.repeat(100000) }] }));
  assert.equal(big.status, 413);
  assert.equal((await big.json()).error.code, 'request_too_large');
  const missing = await fetch(url + '/nope');
  assert.equal(missing.status, 404);
  assert.equal((await missing.json()).error.type, 'invalid_request_error');
  assert.equal((await fetch(url + '/chat/completions')).status, 405);
});

test('a client that disconnects mid-stream stops its generation; the server keeps serving', async () => {
  const { client, streams, generates } = await setup();
  const before = streams.length;
  const stream = await client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 5000, ignore_eos: true, stream: true });
  let n = 0;
  for await (const chunk of stream) {
    if (chunk.choices[0]?.delta?.content && ++n === 3) break; // closes the connection
  }
  assert.equal(streams.length, before + 1);
  const r = await streams[before];
  assert.equal(r.finishReason, 'abort');
  assert.ok(r.tokens.length < 1000, `generated ${r.tokens.length} tokens after the client left`);
  // Non-streamed too: the request is aborted when the client goes away.
  const ac = new AbortController();
  const gBefore = generates.length;
  const pending = client.completions.create({ model: MODEL_ID, prompt: 'x', max_tokens: 5000, ignore_eos: true }, { signal: ac.signal });
  while (generates.length === gBefore) await new Promise((r) => setTimeout(r, 5));
  setTimeout(() => ac.abort(), 50);
  await assert.rejects(pending, (e) => e instanceof OpenAI.APIUserAbortError);
  const g = await generates[gBefore];
  assert.equal(g.finishReason, 'abort');
  assert.ok(g.tokens.length < 5000);
  // Concurrent requests queue on the model and all succeed.
  const rs = await Promise.all([1, 2, 3].map((i) => client.completions.create({ model: MODEL_ID, prompt: [i], max_tokens: 3, ignore_eos: true })));
  assert.deepEqual(rs.map((x) => x.usage.completion_tokens), [3, 3, 3]);
});

test('tool calls come back in the OpenAI shape (stub model)', async () => {
  const call = { id: 'call_x1', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Oslo"}' } };
  const result = {
    text: '',
    finishReason: 'tool_calls',
    tokens: [1, 2],
    usage: { promptTokens: 5, completionTokens: 2, totalTokens: 7 },
    metrics: {},
    toolCalls: [call],
  };
  const seen = [];
  const stub = {
    async chat(messages, opts) {
      seen.push({ messages, opts });
      return result;
    },
    chatStream(messages, opts) {
      seen.push({ messages, opts });
      return (async function* () {
        yield { type: 'done', result };
      })();
    },
  };
  const { server, url } = await listen({ model: stub, modelId: 'stub' }, { port: 0 });
  try {
    const client = new OpenAI({ baseURL: url, apiKey: 'unused', maxRetries: 0 });
    const tools = [{ type: 'function', function: { name: 'get_weather', parameters: { type: 'object', properties: { city: { type: 'string' } } } } }];
    const messages = [
      { role: 'system', content: 'Use tools.' },
      { role: 'user', content: [{ type: 'text', text: 'Weather in ' }, { type: 'text', text: 'Oslo?' }] },
      { role: 'assistant', content: null, tool_calls: [call] },
      { role: 'tool', tool_call_id: 'call_x1', content: '{"temp": 21}' },
    ];
    const r = await client.chat.completions.create({ model: 'stub', messages, tools, max_tokens: 16 });
    assert.equal(r.choices[0].finish_reason, 'tool_calls');
    assert.equal(r.choices[0].message.content, null);
    assert.deepEqual(r.choices[0].message.tool_calls, [call]);
    // What the model got: OpenAI messages mapped to ChatMessage, tools passed on.
    assert.deepEqual(seen[0].messages, [
      { role: 'system', content: 'Use tools.' },
      { role: 'user', content: 'Weather in Oslo?' },
      { role: 'assistant', toolCalls: [call] },
      { role: 'tool', content: '{"temp": 21}', toolCallId: 'call_x1' },
    ]);
    assert.deepEqual(seen[0].opts.tools, tools);
    assert.equal(seen[0].opts.maxTokens, 16);
    assert.ok(seen[0].opts.signal instanceof AbortSignal);

    const stream = await client.chat.completions.create({ model: 'stub', messages, tools, stream: true });
    const deltas = [];
    let finish;
    for await (const chunk of stream) {
      for (const c of chunk.choices) {
        if (c.delta.tool_calls) deltas.push(...c.delta.tool_calls);
        if (c.finish_reason) finish = c.finish_reason;
      }
    }
    assert.equal(finish, 'tool_calls');
    assert.deepEqual(deltas, [{ index: 0, ...call }]);
    // tool_choice 'none' sends no tools.
    await client.chat.completions.create({ model: 'stub', messages, tools, tool_choice: 'none' });
    assert.equal(seen[2].opts.tools, undefined);
  } finally {
    server.close();
  }
});

test('`mlx-lfm serve` serves the model until stopped', async () => {
  const dir = await fixture('tiny', TINY);
  const child = spawn(process.execPath, [path.join(root, 'cli.cjs'), 'serve', '--model', dir, '--port', '0', '--name', 'cli-model'], {
    stdio: ['ignore', 'ignore', 'pipe'],
  });
  try {
    const url = await new Promise((resolve, reject) => {
      let err = '';
      child.stderr.on('data', (d) => {
        err += d;
        const m = /serving cli-model at (http:\/\/\S+)/.exec(err);
        if (m) resolve(m[1]);
      });
      child.on('exit', (code) => reject(new Error(`serve exited with ${code}: ${err}`)));
    });
    const client = new OpenAI({ baseURL: url, apiKey: 'unused', maxRetries: 0 });
    assert.deepEqual((await client.models.list()).data.map((m) => m.id), ['cli-model']);
    const r = await client.chat.completions.create({ model: 'cli-model', messages: USER, max_tokens: 3 });
    assert.equal(typeof r.choices[0].message.content, 'string');
  } finally {
    const exited = new Promise((resolve) => child.once('exit', resolve));
    child.kill('SIGTERM');
    assert.equal(await exited, 0);
  }
});

// A second server on the same model, with a key and CORS for one origin.
async function keyed(extra = {}) {
  const { model } = await setup();
  return listen({ model, modelId: MODEL_ID, apiKey: 'sk-test-123456', cors: 'https://app.example', ...extra }, { port: 0 });
}

test('with an API key every route but /health needs it; the key compare is exact', async () => {
  const { server, url } = await keyed();
  try {
    const base = url.replace(/\/v1$/, '');
    const health = await fetch(`${base}/health`);
    assert.equal(health.status, 200);
    assert.deepEqual(await health.json(), { status: 'ok', model: MODEL_ID, worldSize: 1 });
    for (const auth of [undefined, 'Bearer wrong-key-000', 'Bearer sk-test-12345', 'sk-test-123456']) {
      const r = await fetch(`${url}/models`, { headers: auth ? { authorization: auth } : {} });
      assert.equal(r.status, 401, String(auth));
      const body = await r.json();
      assert.equal(body.error.code, 'invalid_api_key');
      assert.equal(body.error.type, 'invalid_request_error');
    }
    const client = new OpenAI({ baseURL: url, apiKey: 'sk-test-123456', maxRetries: 0 });
    assert.deepEqual((await client.models.list()).data.map((m) => m.id), [MODEL_ID]);
    const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 2, ignore_eos: true });
    assert.equal(r.usage.completion_tokens, 2);
    // CORS only for the named origin, preflight answered.
    const pre = await fetch(`${url}/chat/completions`, { method: 'OPTIONS' });
    assert.equal(pre.status, 204);
    assert.equal(pre.headers.get('access-control-allow-origin'), 'https://app.example');
  } finally {
    server.close();
    server.closeAllConnections();
  }
});

test('no CORS headers by default, JSON bodies only, bad paths and limits are 4xx', async () => {
  const { url } = await setup();
  const r = await fetch(`${url}/models`);
  assert.equal(r.headers.get('access-control-allow-origin'), null);
  // A cross-site "simple request" (text/plain) cannot reach the model.
  const plain = await fetch(`${url}/chat/completions`, { method: 'POST', body: JSON.stringify({ messages: USER }), headers: { 'content-type': 'text/plain' } });
  assert.equal(plain.status, 415);
  assert.equal((await plain.json()).error.code, 'unsupported_media_type');
  const bad = await fetch(`${url}/models/%E0%A4%A`);
  assert.equal(bad.status, 400);
  assert.equal((await bad.json()).error.code, 'invalid_url');
  const post = (body) => fetch(`${url}/chat/completions`, { method: 'POST', body: JSON.stringify(body), headers: { 'content-type': 'application/json' } });
  for (const [body, param] of [
    [{ messages: USER, max_tokens: 2 ** 32 + 1 }, 'max_tokens'],
    [{ messages: USER, max_tokens: 1e12 }, 'max_tokens'],
    [{ messages: USER, n: 0 }, 'n'],
    [{ messages: USER, seed: 2 ** 64 }, 'seed'],
  ]) {
    const res = await post(body);
    assert.equal(res.status, 400, JSON.stringify(body));
    assert.equal((await res.json()).error.param, param);
  }
  // A prompt beyond the model's context is a 400 naming it, before any compute.
  const long = 'word '.repeat(200000);
  const res = await post({ messages: [{ role: 'user', content: long }], max_tokens: 4 });
  assert.ok(res.status === 400 || res.status === 413, String(res.status));
});

test('an exposed address needs a key; a full queue answers 503 with Retry-After', async () => {
  const { model } = await setup();
  await assert.rejects(listen({ model, modelId: MODEL_ID }, { port: 0, host: '0.0.0.0' }), /refusing to listen on 0\.0\.0\.0 without an API key/);
  const { server, url } = await listen({ model, modelId: MODEL_ID, maxQueued: 1 }, { port: 0 });
  try {
    const post = (body) => fetch(`${url}/chat/completions`, { method: 'POST', body: JSON.stringify(body), headers: { 'content-type': 'application/json' } });
    const first = post({ messages: USER, max_tokens: 64, ignore_eos: true });
    await new Promise((r) => setTimeout(r, 20));
    const second = await post({ messages: USER, max_tokens: 2 });
    assert.equal(second.status, 503);
    assert.equal(second.headers.get('retry-after'), '1');
    assert.equal((await second.json()).error.code, 'server_busy');
    assert.equal((await first).status, 200);
  } finally {
    server.close();
    server.closeAllConnections();
  }
});

test('a streaming client that stops reading has its generation cancelled', async () => {
  // A stub whose stream never ends, with 64 KiB text events: the socket
  // fills at once when the client stops reading.
  let cancelled = false;
  let sent = 0;
  const stub = {
    chatStream() {
      const big = 'x'.repeat(65536);
      return {
        cancel() {
          cancelled = true;
        },
        async *[Symbol.asyncIterator]() {
          while (!cancelled) {
            sent++;
            yield { type: 'text', text: big };
            await new Promise((r) => setImmediate(r));
          }
        },
      };
    },
  };
  const { server } = await listen({ model: stub, modelId: 'stub', stallMs: 300 }, { port: 0 });
  const net = require('node:net');
  try {
    const { port } = server.address();
    const body = JSON.stringify({ messages: USER, stream: true });
    const sock = net.connect(port, '127.0.0.1');
    await new Promise((r) => sock.once('connect', r));
    sock.write(`POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(body)}\r\n\r\n${body}`);
    sock.pause(); // never read: the server's socket buffer fills
    const t = Date.now();
    while (!cancelled && Date.now() - t < 20000) await new Promise((r) => setTimeout(r, 50));
    assert.ok(cancelled, 'the stream was not cancelled');
    const events = sent;
    await new Promise((r) => setTimeout(r, 200));
    assert.ok(sent <= events + 1, 'events kept being produced after the cancel');
    // Bounded: only what fit the socket buffers before the stall was sent.
    assert.ok(sent < 2000, `${sent} events of 64 KiB were produced for a reader that took nothing`);
    sock.destroy();
  } finally {
    server.close();
    server.closeAllConnections();
  }
});

test('a prompt over the per-request limit is a 400 naming messages or prompt, before any compute, streamed or not', async () => {
  const { model } = await setup();
  let calls = 0;
  // The real model, counting what reaches it.
  const counted = {
    chat: (m, o) => (calls++, model.chat(m, o)),
    chatStream: (m, o) => (calls++, model.chatStream(m, o)),
    generate: (p, o) => (calls++, model.generate(p, o)),
    generateStream: (p, o) => (calls++, model.generateStream(p, o)),
  };
  const { server, url } = await listen({ model: counted, modelId: MODEL_ID, maxPromptTokens: 30 }, { port: 0 });
  try {
    const client = new OpenAI({ baseURL: url, apiKey: 'unused', maxRetries: 0 });
    const long = [{ role: 'user', content: 'a long message that the chat template makes well over thirty tokens, '.repeat(3) }];
    const tooLong = (param) => (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, `${e.constructor.name}: ${e.message}`);
      assert.equal(e.param, param);
      assert.equal(e.code, 'prompt_too_long');
      assert.match(e.message, /prompt has \d+ tokens, more than this server's limit of 30 per request/);
      return true;
    };
    await assert.rejects(client.chat.completions.create({ model: MODEL_ID, messages: long, max_tokens: 2 }), tooLong('messages'));
    // Streamed: the 400 comes before the event stream starts (not a 200 with an error event).
    await assert.rejects(client.chat.completions.create({ model: MODEL_ID, messages: long, max_tokens: 2, stream: true }), tooLong('messages'));
    const ids = Array.from({ length: 31 }, (_, i) => i + 5);
    await assert.rejects(client.completions.create({ model: MODEL_ID, prompt: ids, max_tokens: 2 }), tooLong('prompt'));
    await assert.rejects(client.completions.create({ model: MODEL_ID, prompt: ids, max_tokens: 2, stream: true }), tooLong('prompt'));
    assert.equal(calls, 4);
    // At the limit it runs.
    const ok = await client.completions.create({ model: MODEL_ID, prompt: ids.slice(1), max_tokens: 2, ignore_eos: true });
    assert.equal(ok.usage.prompt_tokens, 30);
    const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 2, ignore_eos: true, stream: true });
    let text = 0;
    for await (const c of r) text += c.choices.length;
    assert.ok(text > 0);
  } finally {
    server.close();
    server.closeAllConnections();
  }
});

test('the prompt limit defaults to the model\'s context length; beyond the context is a 400 too', async () => {
  const m = await addon.Lfm2Model.load(await fixture('tiny', TINY), { contextLength: 64 });
  const { server, url } = await listen({ model: m, modelId: MODEL_ID }, { port: 0 });
  try {
    const client = new OpenAI({ baseURL: url, apiKey: 'unused', maxRetries: 0 });
    const ids = (n) => Array.from({ length: n }, (_, i) => i + 5);
    await assert.rejects(client.completions.create({ model: MODEL_ID, prompt: ids(65), max_tokens: 1 }), (e) => {
      assert.equal(e.status, 400);
      assert.equal(e.code, 'prompt_too_long');
      assert.match(e.message, /limit of 64 per request/);
      return true;
    });
    await assert.rejects(client.completions.create({ model: MODEL_ID, prompt: ids(60), max_tokens: 10 }), (e) => {
      assert.equal(e.status, 400);
      assert.equal(e.param, 'prompt');
      assert.equal(e.code, 'context_length_exceeded');
      return true;
    });
    const ok = await client.completions.create({ model: MODEL_ID, prompt: ids(60), max_tokens: 4, ignore_eos: true });
    assert.equal(ok.usage.completion_tokens, 4);
  } finally {
    server.close();
    server.closeAllConnections();
    m.close();
  }
});

test('slowloris: connections that never finish their headers or body are closed at the timeouts; others are served meanwhile', async () => {
  const net = require('node:net');
  const { model } = await setup();
  const headersTimeout = 1000;
  const requestTimeout = 2000;
  const { server, url } = await listen({ model, modelId: MODEL_ID }, { port: 0, headersTimeout, requestTimeout });
  const { port } = server.address();
  const open = (first, trickle) => new Promise((resolve) => {
    const sock = net.connect(port, '127.0.0.1', () => sock.write(first));
    const t0 = Date.now();
    let got = '';
    let timer = null;
    if (trickle) timer = setInterval(() => sock.writable && sock.write(trickle), 200);
    sock.on('data', (d) => (got += d));
    sock.on('error', () => {});
    sock.on('close', () => {
      clearInterval(timer);
      resolve({ ms: Date.now() - t0, got });
    });
  });
  try {
    const partial = 'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n';
    const body = JSON.stringify({ messages: USER, max_tokens: 2 });
    const slow = [
      ...Array.from({ length: 20 }, () => open(partial)),
      // One header byte at a time: still bounded by the headers timeout.
      open(partial, 'X'),
      // Headers complete, the body never: bounded by the request timeout.
      open(`POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${body.length}\r\n\r\n${body.slice(0, 10)}`),
    ];
    // Meanwhile a normal client is served.
    const client = new OpenAI({ baseURL: url, apiKey: 'unused', maxRetries: 0 });
    const r = await client.chat.completions.create({ model: MODEL_ID, messages: USER, max_tokens: 2, ignore_eos: true });
    assert.equal(r.usage.completion_tokens, 2);
    const closed = await Promise.all(slow);
    for (const [i, c] of closed.entries()) {
      const limit = i === closed.length - 1 ? requestTimeout : headersTimeout;
      // Closed by the timeout (not before it), within a check interval after it.
      assert.ok(c.ms >= limit - 100 && c.ms < limit + 2500, `connection ${i} closed after ${c.ms} ms (timeout ${limit})`);
      if (i < closed.length - 1) assert.match(c.got, /^HTTP\/1\.1 408/, `connection ${i}: ${JSON.stringify(c.got.slice(0, 40))}`);
    }
    // The server still serves.
    assert.equal((await fetch(`${url.replace(/\/v1$/, '')}/health`)).status, 200);
  } finally {
    server.close();
    server.closeAllConnections();
  }
});
