// Constrained decoding (llguidance): on the tiny random-weight fixture,
// whose output would never be JSON by chance, sampling at temperature 1
// under a JSON schema always gives JSON that validates (checked with ajv),
// and json_object JSON that parses to an object; an output maxTokens cuts
// off is a prefix of compact JSON;
// under a regex or a Lark grammar a whole match, under toolChoice calls
// whose arguments validate against the tool's schema; alone and batched,
// on the compiled and the eager path, streamed; bad schemas and grammars
// reject before any compute.
'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const fs = require('node:fs');
const path = require('node:path');
const Ajv = require('ajv');
const { OpenAI } = require('openai');
const { addon, fixture } = require('./helpers.cjs');
const { listen } = require('../lib/server.cjs');

const FIX = ['tiny', { preset: 'tiny', dtype: 'f32' }];
const ajv = new Ajv({ strict: false });

// Bounded schemas: a random model never chooses to close an open-ended
// string, so every string has a maxLength and every array a maxItems.
const schemas = {
  enumAndBool: {
    type: 'object',
    properties: { colour: { enum: ['red', 'green', 'blue'] }, ok: { type: 'boolean' } },
    required: ['colour', 'ok'],
    additionalProperties: false,
  },
  nested: {
    type: 'object',
    properties: {
      name: { type: 'string', maxLength: 6 },
      age: { type: 'integer', minimum: 0, maximum: 120 },
      tags: { type: 'array', items: { type: 'string', maxLength: 3 }, maxItems: 3 },
      address: {
        type: 'object',
        properties: { zip: { type: 'string', pattern: '^[0-9]{5}$' }, n: { type: 'integer', minimum: -5, maximum: 5 } },
        required: ['zip', 'n'],
        additionalProperties: false,
      },
    },
    required: ['name', 'age', 'tags', 'address'],
    additionalProperties: false,
  },
  anyOfList: {
    type: 'array',
    minItems: 1,
    maxItems: 4,
    items: { anyOf: [{ type: 'integer', minimum: 1, maximum: 9 }, { const: 'x' }, { type: 'null' }] },
  },
  refs: {
    $defs: { point: { type: 'object', properties: { x: { type: 'integer', minimum: 0, maximum: 99 }, y: { type: 'integer', minimum: 0, maximum: 99 } }, required: ['x', 'y'], additionalProperties: false } },
    type: 'object',
    properties: { from: { $ref: '#/$defs/point' }, to: { $ref: '#/$defs/point' } },
    required: ['from', 'to'],
    additionalProperties: false,
  },
};

function checkJson(label, r, schema) {
  assert.equal(r.finishReason, 'stop', `${label}: ${r.finishReason} ${JSON.stringify(r.text)}`);
  let value;
  assert.doesNotThrow(() => { value = JSON.parse(r.text); }, `${label}: not JSON: ${JSON.stringify(r.text)}`);
  assert.ok(ajv.validate(schema, value), `${label}: ${JSON.stringify(value)} fails: ${ajv.errorsText()}`);
  return value;
}

/**
 * Reads `text` as compact JSON (no whitespace outside strings: what every
 * constraint here generates): 'complete' when it is one whole value,
 * 'prefix' when some continuation would make it one; otherwise throws
 * naming the offset. For outputs cut off by maxTokens, which JSON.parse
 * cannot judge.
 */
function compactJsonPrefix(text) {
  const stack = [];
  // value | value-or-] | key | key-or-} | colon | after
  let want = 'value';
  let i = 0;
  const fail = (why) => { throw new Error(`not a compact JSON prefix: ${why} at ${i} in ${JSON.stringify(text)}`); };
  const number = /^-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?$/;
  while (i < text.length) {
    const c = text[i];
    if (want === 'after') {
      if (stack.length === 0) fail('text after the value');
      const top = stack[stack.length - 1];
      if (c === ',') want = top === '{' ? 'key' : 'value';
      else if ((c === '}' && top === '{') || (c === ']' && top === '[')) stack.pop();
      else fail(`${JSON.stringify(c)} after a value`);
      i++;
    } else if (want === 'colon') {
      if (c !== ':') fail(`${JSON.stringify(c)} after a key`);
      want = 'value';
      i++;
    } else if (c === '"') {
      i++;
      for (;;) {
        if (i >= text.length) return 'prefix';
        const d = text[i];
        if (d === '"') break;
        if (d < ' ') fail('a raw control character in a string');
        if (d === '\\') {
          const e = text[i + 1];
          if (e === undefined) return 'prefix';
          if (e === 'u') {
            const hex = text.slice(i + 2, i + 6);
            if (!/^[0-9a-fA-F]*$/.test(hex)) fail('a bad \\u escape');
            if (hex.length < 4) return 'prefix';
            i += 6;
            continue;
          }
          if (!'"\\/bfnrt'.includes(e)) fail('a bad escape');
          i += 2;
          continue;
        }
        i++;
      }
      i++;
      want = want.startsWith('key') ? 'colon' : 'after';
    } else if (want.startsWith('key')) {
      if (c !== '}' || want !== 'key-or-}') fail(`${JSON.stringify(c)} where a key belongs`);
      stack.pop();
      want = 'after';
      i++;
    } else if (c === ']' && want === 'value-or-]') {
      stack.pop();
      want = 'after';
      i++;
    } else if (c === '{' || c === '[') {
      stack.push(c);
      want = c === '{' ? 'key-or-}' : 'value-or-]';
      i++;
    } else if (c === '-' || (c >= '0' && c <= '9')) {
      const run = /^[-+.eE0-9]+/.exec(text.slice(i))[0];
      i += run.length;
      if (!number.test(run)) {
        if (i === text.length && number.test(`${run}0`)) return 'prefix';
        fail(`the number ${run}`);
      }
      want = 'after';
    } else {
      const word = ['true', 'false', 'null'].find((w) => w[0] === c);
      const got = text.slice(i, i + (word ?? '').length);
      if (!word || !word.startsWith(got)) fail(`${JSON.stringify(c)} where a value belongs`);
      if (got.length < word.length) return 'prefix';
      i += word.length;
      want = 'after';
    }
  }
  return want === 'after' && stack.length === 0 ? 'complete' : 'prefix';
}

/** A json_object / jsonSchema output: stopped, it parses (to an object when `object`); cut off, it is a prefix. */
function checkJsonOutput(label, finishReason, text, { object = false, schema } = {}) {
  if (finishReason === 'stop') {
    let value;
    assert.doesNotThrow(() => { value = JSON.parse(text); }, `${label}: stopped but not JSON: ${JSON.stringify(text)}`);
    assert.equal(compactJsonPrefix(text), 'complete', `${label}: ${JSON.stringify(text)}`);
    if (object) assert.ok(value !== null && typeof value === 'object' && !Array.isArray(value), `${label}: not an object: ${text}`);
    if (schema) assert.ok(ajv.validate(schema, value), `${label}: ${text} fails: ${ajv.errorsText()}`);
  } else {
    assert.equal(finishReason, 'length', `${label}: ${finishReason} ${JSON.stringify(text)}`);
    // A cut may also fall right after a whole value (a bare number could go on).
    assert.ok(['prefix', 'complete'].includes(compactJsonPrefix(text)), `${label}: ${JSON.stringify(text)}`);
    if (object) assert.ok(text === '' || text.startsWith('{'), `${label}: ${JSON.stringify(text)}`);
  }
}

let model;
async function load() {
  model ??= await addon.Lfm2Model.load(await fixture(...FIX));
  return model;
}
test.after(() => model && model.close());

test('the compact JSON prefix check agrees with JSON.parse, and every cut of a value is a prefix', () => {
  const whole = ['{}', '[]', '0', '-1.5e+3', '"a"', 'null', '{"a":[1,{"b":null}],"c":"x\\"\\u00e9","d":true,"e":[]}', '[[],{},[false]]'];
  for (const w of whole) {
    assert.doesNotThrow(() => JSON.parse(w), w);
    // Every cut is a prefix, and complete exactly when JSON.parse takes it (`-1` of `-1.5e+3`).
    for (let k = 0; k <= w.length; k++) {
      const cut = w.slice(0, k);
      let parses = true;
      try { JSON.parse(cut); } catch { parses = false; }
      assert.equal(compactJsonPrefix(cut), parses ? 'complete' : 'prefix', JSON.stringify(cut));
    }
  }
  // Wrong JSON, and JSON with whitespace (which the constraints never allow), fail.
  for (const bad of ['{"a":}', '{}}', '{"a":01}', '{,', '[1,]', '{"a":1,}', '{"a" :1}', '{ }', '[1 ]', '{"a":tru3', '"\\x"', '{"a":"\n"}', '{1:2}', '{"a"}', '1.e', '[}', '{]']) {
    assert.throws(() => compactJsonPrefix(bad), /not a compact JSON prefix/, bad);
  }
});

test('without a constraint the fixture does not write JSON (so the checks below mean something)', async () => {
  const m = await load();
  for (let seed = 0; seed < 3; seed++) {
    const r = await m.generate('Data:', { maxTokens: 24, temperature: 1, seed });
    assert.throws(() => JSON.parse(r.text));
  }
});

test('jsonSchema: temperature-1 samples always parse and validate (generate and chat, alone and batched)', async () => {
  const m = await load();
  for (const [name, schema] of Object.entries(schemas)) {
    for (let seed = 0; seed < 4; seed++) {
      checkJson(`${name} seed ${seed}`, await m.generate('Data:', { jsonSchema: schema, temperature: 1, seed, maxTokens: 200 }), schema);
    }
  }
  // Different schemas in one batch: each row has its own mask.
  const names = Object.keys(schemas);
  const rs = await Promise.all(names.flatMap((name, i) => [0, 1].map((k) => m.chat([{ role: 'user', content: `Give me ${name}` }], {
    jsonSchema: schemas[name], temperature: 1, seed: 100 + 2 * i + k, maxTokens: 200, logprobs: true,
  }))));
  rs.forEach((r, j) => {
    checkJson(`batched ${names[j >> 1]}`, r, schemas[names[j >> 1]]);
    // The logprobs are of the masked distribution: the drawn token was allowed.
    assert.ok(r.logprobs.every((e) => Number.isFinite(e.logprob)));
  });
});

test('the eager path constrains the same way', async () => {
  const eager = await addon.Lfm2Model.load(await fixture(...FIX), { decodePath: 'eager' });
  try {
    const rs = await Promise.all([1, 2, 3].map((seed) => eager.generate('x', { jsonSchema: schemas.nested, temperature: 1, seed, maxTokens: 200 })));
    rs.forEach((r, i) => checkJson(`eager ${i}`, r, schemas.nested));
    // Same seed, same output as the compiled path (the constraint changes nothing in the math).
    const m = await load();
    const c = await m.generate('x', { jsonSchema: schemas.nested, temperature: 1, seed: 1, maxTokens: 200 });
    assert.equal(c.text, rs[0].text);
  } finally {
    eager.close();
  }
});

// A random model never closes a string, array or object by chance: bias the
// fixture's tokens made only of JSON punctuation up (those with a quote
// most, closing brackets least, so objects get keys and nest before they
// close), so sampled outputs finish, and meet maxTokens at every kind of
// point. Ids come from the fixture's own vocabulary.
async function punctuationBias() {
  const { model: { vocab } } = JSON.parse(fs.readFileSync(path.join(await fixture(...FIX), 'tokenizer.json'), 'utf8'));
  const bias = {};
  for (const [t, id] of Object.entries(vocab)) if (/^[{}[\]",:]+$/.test(t)) bias[id] = t.includes('"') ? 12 : /[}\]]/.test(t) ? 6 : 9;
  assert.ok(['{', '}', '"', ':', ','].every((t) => vocab[t] in bias), JSON.stringify(bias));
  return bias;
}

/** Counts of finish reasons (and of stopped outputs longer than `{}`), checking each output as `checkJsonOutput` does. */
function tally(label, outputs, how) {
  const counts = { stop: 0, length: 0, bigger: 0 };
  outputs.forEach(({ finishReason, text }, i) => {
    checkJsonOutput(`${label} ${i}`, finishReason, text, how);
    counts[finishReason]++;
    if (finishReason === 'stop' && text.length > 4) counts.bigger++;
  });
  return counts;
}

/** Both endings happened, and not only trivially, so both checks ran on real outputs. */
function assertMixed(counts) {
  assert.ok(counts.stop >= 4 && counts.length >= 2 && counts.bigger >= 3, JSON.stringify(counts));
}

test("json_object (jsonSchema { type: 'object' }) and any JSON (true): what stops parses, what maxTokens cuts is a prefix", async () => {
  const m = await load();
  const logitBias = await punctuationBias();
  const opts = (seed) => ({ temperature: 1, seed, maxTokens: 64, logitBias });
  const seeds = [...Array(16).keys()];
  const object = { type: 'object' };
  const gen = await Promise.all(seeds.map((seed) => m.generate('Data:', { ...opts(seed), jsonSchema: object })));
  const chat = await Promise.all(seeds.map((seed) => m.chat([{ role: 'user', content: 'JSON, please.' }], { ...opts(seed), jsonSchema: object })));
  const any = await Promise.all(seeds.map((seed) => m.generate('Data:', { ...opts(seed), jsonSchema: true })));
  const counts = [tally('generate', gen, { object: true }), tally('chat', chat, { object: true }), tally('any', any, {})];
  counts.forEach(assertMixed);
});

test('jsonSchema: an output cut off by maxTokens is a prefix of compact JSON (stopped ones still validate)', async () => {
  const m = await load();
  let cut = 0;
  for (const [name, schema] of Object.entries(schemas)) {
    const rs = await Promise.all([3, 6, 10, 15].map((maxTokens, seed) => m.generate('Data:', { jsonSchema: schema, temperature: 1, seed, maxTokens })));
    rs.forEach((r, i) => {
      checkJsonOutput(`${name} ${i}`, r.finishReason, r.text, { schema });
      if (r.finishReason === 'length') cut++;
    });
  }
  assert.ok(cut >= 8, `only ${cut} outputs were cut off`);
});

test('regex and Lark grammars: whole matches; streamed text is the result', async () => {
  const m = await load();
  for (let seed = 0; seed < 4; seed++) {
    const r = await m.generate('Code:', { regex: '[A-Z]{2}-[0-9]{3}(-[a-z]{1,3})?', temperature: 1, seed, maxTokens: 40 });
    assert.equal(r.finishReason, 'stop');
    assert.match(r.text, /^[A-Z]{2}-[0-9]{3}(-[a-z]{1,3})?$/);
    const g = await m.generate('Answer:', { grammar: 'start: ("yes" | "no" | "maybe") ("!" | ".")', temperature: 1, seed, maxTokens: 10 });
    assert.match(g.text, /^(yes|no|maybe)[!.]$/);
  }
  const stream = m.generateStream('Code:', { regex: '[0-9]{4}', temperature: 1, seed: 3, maxTokens: 10 });
  let text = '';
  let done;
  for await (const ev of stream) {
    if (ev.type === 'text') text += ev.text;
    else done = ev.result;
  }
  assert.match(done.text, /^[0-9]{4}$/);
  assert.equal(text, done.text);
  // ignoreEos cannot run past a complete grammar.
  const full = await m.generate('Code:', { regex: '[0-9]{4}', maxTokens: 50, ignoreEos: true });
  assert.match(full.text, /^[0-9]{4}$/);
  assert.equal(full.finishReason, 'stop');
  // maxTokens first: 'length', the output a prefix of a match.
  const cut = await m.generate('Code:', { regex: 'a{30}', maxTokens: 3, temperature: 1, seed: 1 });
  assert.equal(cut.finishReason, 'length');
  assert.match(cut.text, /^a+$/);
});

const tools = [
  { type: 'function', function: { name: 'get_weather', description: 'Weather', parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 8 }, days: { type: 'integer', minimum: 1, maximum: 7 } }, required: ['city', 'days'], additionalProperties: false } } },
  { type: 'function', function: { name: 'ping', description: 'No arguments' } },
];

test('toolChoice required / named: well-formed calls whose arguments validate', async () => {
  const m = await load();
  const msgs = [{ role: 'user', content: 'Weather in Paris?' }];
  const argSchema = { get_weather: tools[0].function.parameters, ping: { type: 'object', maxProperties: 0 } };
  for (let seed = 0; seed < 4; seed++) {
    const r = await m.chat(msgs, { tools, toolChoice: 'required', temperature: 1, seed, maxTokens: 200 });
    assert.equal(r.finishReason, 'tool_calls', JSON.stringify(r));
    assert.ok(r.toolCalls.length >= 1);
    assert.equal(r.toolCallErrors, undefined);
    for (const c of r.toolCalls) {
      const args = JSON.parse(c.function.arguments);
      assert.ok(ajv.validate(argSchema[c.function.name], args), `${c.function.name} ${c.function.arguments}: ${ajv.errorsText()}`);
    }
    const named = await m.chat(msgs, { tools, toolChoice: { type: 'function', function: { name: 'get_weather' } }, temperature: 1, seed, maxTokens: 200 });
    assert.equal(named.toolCalls.length, 1);
    assert.equal(named.toolCalls[0].function.name, 'get_weather');
    assert.ok(ajv.validate(argSchema.get_weather, JSON.parse(named.toolCalls[0].function.arguments)));
  }
  // A session's tools count for its turns.
  const s = m.createSession({ tools });
  const t = await s.send('Ping it', { toolChoice: { name: 'ping' }, maxTokens: 100 });
  assert.deepEqual(t.toolCalls.map((c) => [c.function.name, c.function.arguments]), [['ping', '{}']]);
});

test('bad schemas, grammars and option mixes are errors naming the option, before any compute', async () => {
  const m = await load();
  await assert.rejects(m.generate('x', { jsonSchema: { type: 'string', minLength: 5, maxLength: 2 } }), /jsonSchema is not valid/);
  await assert.rejects(m.generate('x', { jsonSchema: { type: 'object', properties: { a: { $ref: '#/$defs/missing' } }, required: ['a'] } }), /jsonSchema is not valid/);
  await assert.rejects(m.generate('x', { jsonSchema: 'object' }), { name: 'TypeError', message: /jsonSchema must be a JSON schema/ });
  await assert.rejects(m.generate('x', { regex: '(' }), /regex is not valid/);
  await assert.rejects(m.generate('x', { grammar: 'start: undefined_rule' }), /grammar is not valid/);
  await assert.rejects(m.generate('x', { grammar: 'start: <[99999999]>' }), /grammar is not valid/);
  await assert.rejects(m.generate('x', { regex: 'a', jsonSchema: {} }), { name: 'TypeError', message: /jsonSchema and regex cannot be used together/ });
  await assert.rejects(m.chat([{ role: 'user', content: 'hi' }], { toolChoice: 'required' }), /needs `tools`/);
  await assert.rejects(m.chat([{ role: 'user', content: 'hi' }], { tools, toolChoice: { name: 'nope' } }), { name: 'RangeError', message: /`nope`/ });
  await assert.rejects(m.chat([{ role: 'user', content: 'hi' }], { tools, toolChoice: 'sometimes' }), /toolChoice must be/);
  // Nothing ran: the model answers the next request normally.
  const r = await m.generate('x', { maxTokens: 3, ignoreEos: true });
  assert.equal(r.tokens.length, 3);
  assert.equal((await m.cacheStats()).blocksInUse, 0);
});

test("a constraint that cannot go on ends with finishReason 'constraint', not a hang; hostile nesting is refused", async () => {
  const m = await load();
  // A million a's: llguidance's lexer runs past its limits on the first
  // mask, so no token is allowed and the request ends there.
  const r = await m.generate('x', { regex: '(a{1000}){1000}', maxTokens: 8, temperature: 1, seed: 3 });
  assert.equal(r.finishReason, 'constraint');
  assert.ok(r.tokens.length < 8, `${r.tokens.length} tokens`);
  // Deep nesting is an error naming the option, not a stack overflow.
  let deep = { type: 'string' };
  for (let i = 0; i < 5000; i++) deep = { type: 'object', properties: { a: deep }, required: ['a'] };
  await assert.rejects(m.generate('x', { jsonSchema: deep }), /jsonSchema/);
  await assert.rejects(m.generate('x', { grammar: `start: ${'('.repeat(5000)}"a"${')'.repeat(5000)}` }), /grammar is not valid: .*too deeply nested/);
  const ok = await m.generate('x', { maxTokens: 3, ignoreEos: true });
  assert.equal(ok.tokens.length, 3);
});

test('server: response_format json_schema / json_object and tool_choice, with 400s for bad ones', async () => {
  const m = await load();
  const { server, url } = await listen({ model: m, modelId: 'tiny' }, { port: 0 });
  const client = new OpenAI({ baseURL: url, apiKey: 'unused', maxRetries: 0, timeout: 60000 });
  try {
    const messages = [{ role: 'user', content: 'A person, please.' }];
    const r = await client.chat.completions.create({
      model: 'tiny', messages, temperature: 1, seed: 5, max_tokens: 200, n: 3,
      response_format: { type: 'json_schema', json_schema: { name: 'person', schema: schemas.nested, strict: true } },
    });
    r.choices.forEach((c, i) => checkJson(`choice ${i}`, { finishReason: c.finish_reason, text: c.message.content }, schemas.nested));
    // json_object is accepted (its outputs are checked whole in the next test).
    const o = await client.chat.completions.create({ model: 'tiny', messages, max_tokens: 8, response_format: { type: 'json_object' } });
    assert.match(o.choices[0].message.content, /^\{/);
    const t = await client.chat.completions.create({ model: 'tiny', messages, tools, tool_choice: 'required', temperature: 1, seed: 2, max_tokens: 200 });
    assert.equal(t.choices[0].finish_reason, 'tool_calls');
    assert.ok(t.choices[0].message.tool_calls.length >= 1);
    const post = async (body) => {
      const res = await fetch(`${url}/chat/completions`, { method: 'POST', body: JSON.stringify({ messages, max_tokens: 2, ...body }), headers: { 'content-type': 'application/json' } });
      return { status: res.status, error: (await res.json()).error };
    };
    for (const [body, param] of [
      [{ response_format: { type: 'json_schema', json_schema: { schema: { type: 'string', minLength: 3, maxLength: 1 } } } }, 'response_format'],
      [{ response_format: { type: 'xml' } }, 'response_format'],
      [{ tools, tool_choice: { type: 'function', function: { name: 'nope' } } }, 'tool_choice'],
      [{ tool_choice: 'required' }, 'tool_choice'],
      [{ tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'object', properties: { a: { $ref: '#/nowhere' } }, required: ['a'] } } }], tool_choice: 'required' }, 'tools'],
    ]) {
      const { status, error } = await post(body);
      assert.equal(status, 400, JSON.stringify(body));
      assert.equal(error.param, param, JSON.stringify(error));
    }
  } finally {
    server.close();
    server.closeAllConnections();
  }
});

test('server: response_format json_object parses to an object when it stops and is a prefix when max_tokens cuts it; so is a cut json_schema', async () => {
  const m = await load();
  const logit_bias = await punctuationBias();
  const { server, url } = await listen({ model: m, modelId: 'tiny' }, { port: 0 });
  const client = new OpenAI({ baseURL: url, apiKey: 'unused', maxRetries: 0, timeout: 60000 });
  try {
    const messages = [{ role: 'user', content: 'JSON, please.' }];
    const ask = (seed, body) => client.chat.completions.create({ model: 'tiny', messages, temperature: 1, seed, n: 8, ...body });
    const outputs = (rs) => rs.flatMap((r) => r.choices.map((c) => ({ finishReason: c.finish_reason, text: c.message.content })));
    const objects = outputs(await Promise.all([0, 8].map((seed) => ask(seed, { max_tokens: 64, logit_bias, response_format: { type: 'json_object' } }))));
    assertMixed(tally('json_object', objects, { object: true }));
    const schema = schemas.nested;
    const cut = outputs([await ask(1, { max_tokens: 12, response_format: { type: 'json_schema', json_schema: { name: 'person', schema, strict: true } } })]);
    assert.ok(tally('json_schema', cut, { schema }).length >= 4);
  } finally {
    server.close();
    server.closeAllConnections();
  }
});

test("toolChoice 'auto': free text, but a call the model starts is completed under the tools' schemas", async () => {
  const m = await load();
  const msgs = [{ role: 'user', content: 'Weather in Paris?' }];
  const id = (await m.tokenize('<|tool_call_start|>', false))[0];
  assert.equal((await m.tokenize('<|tool_call_start|>', false)).length, 1);
  // Bias the start marker up so the random model opens calls often, and
  // compare with the same requests without the 'auto' constraint.
  let calls = 0;
  let malformedFree = 0;
  for (let seed = 0; seed < 6; seed++) {
    const opts = { tools, temperature: 1, seed, maxTokens: 150, logitBias: { [id]: 12 } };
    const auto = await m.chat(msgs, { ...opts, toolChoice: 'auto' });
    // Only a call cut off by maxTokens may be unparsed.
    for (const e of auto.toolCallErrors ?? []) {
      assert.equal(auto.finishReason, 'length', JSON.stringify(auto));
      assert.ok(!e.raw.includes('<|tool_call_end|>'), e.raw);
    }
    for (const c of auto.toolCalls ?? []) {
      calls++;
      const schema = c.function.name === 'get_weather' ? tools[0].function.parameters : { type: 'object', maxProperties: 0 };
      assert.ok(ajv.validate(schema, JSON.parse(c.function.arguments)), c.function.arguments);
    }
    const free = await m.chat(msgs, opts);
    if (free.toolCallErrors) malformedFree++;
  }
  assert.ok(calls >= 3, `only ${calls} calls were completed (${malformedFree} malformed free runs)`);
  // Without it the same model writes malformed calls: the check above means something.
  assert.ok(malformedFree >= 3, `only ${malformedFree} free runs had malformed calls`);
});
