// OpenAI-compatible HTTP server over one loaded Lfm2Model (plain node:http).
//
//   POST /v1/chat/completions   (stream: server-sent events)
//   POST /v1/completions        (prompt: a string or an array of token ids)
//   GET  /v1/models, GET /v1/models/{id}
//
// Concurrent requests are batched on the model's worker (continuous
// batching), and a follow-up turn reuses the prefix cache. A
// client that disconnects stops its generation (abort) and the server goes
// on serving. Bad requests get OpenAI-style error bodies:
//   { error: { message, type, param, code } }
//
// Safe to expose: with `apiKey` every route but GET /health needs
// `Authorization: Bearer KEY`, and `listen` refuses a non-loopback address
// without one; slow clients meet header, body and idle timeouts; requests
// beyond `maxQueued` get 503 with Retry-After; a prompt over
// `maxPromptTokens` is a 400 before any compute; a streaming client that
// stops reading has its generation cancelled; no CORS headers unless `cors`
// names an origin; POST bodies must be application/json.
'use strict';
const http = require('node:http');
const { createHash, randomBytes, timingSafeEqual } = require('node:crypto');

const DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024;
const DEFAULT_MAX_TOKENS = 2048;
// Beyond any context a model here has (the engine refuses more anyway).
const MAX_TOKENS_LIMIT = 2 ** 27;
const DEFAULT_MAX_QUEUED = 64;
// A streaming client that has not taken a write for this long is gone.
const DEFAULT_STALL_MS = 30000;
// Slow clients: the headers within 10 s, the whole request within 60 s, an
// idle keep-alive connection closed after 5 s.
const DEFAULT_TIMEOUTS = { headersTimeout: 10000, requestTimeout: 60000, keepAliveTimeout: 5000 };

class ApiError extends Error {
  constructor(status, message, { type, param = null, code = null } = {}) {
    super(message);
    this.status = status;
    this.type = type ?? (status >= 500 ? 'server_error' : 'invalid_request_error');
    this.param = param;
    this.code = code;
  }

  body() {
    return { error: { message: this.message, type: this.type, param: this.param, code: this.code } };
  }
}

const invalid = (message, param = null, code = null) => new ApiError(400, message, { param, code });

function kindOf(v) {
  if (v === null) return 'null';
  if (Array.isArray(v)) return 'an array';
  if (typeof v === 'object') return 'an object';
  return `a ${typeof v}`;
}

function wrongType(param, expected, v) {
  return invalid(`Invalid type for '${param}': expected ${expected}, but got ${kindOf(v)} instead.`, param, 'invalid_type');
}

// Option readers: undefined/null mean "not given".
function optNumber(body, key, { min, max, integer = false, exclusiveMin = false } = {}) {
  const v = body[key];
  if (v === undefined || v === null) return undefined;
  if (typeof v !== 'number' || !Number.isFinite(v)) throw wrongType(key, integer ? 'an integer' : 'a number', v);
  if (integer && !Number.isInteger(v)) throw wrongType(key, 'an integer', v);
  if (min !== undefined && (exclusiveMin ? v <= min : v < min)) {
    throw invalid(`Invalid value for '${key}': ${v} is ${exclusiveMin ? 'at most' : 'less than'} the minimum of ${min}.`, key, 'invalid_value');
  }
  if (max !== undefined && v > max) throw invalid(`Invalid value for '${key}': ${v} is greater than the maximum of ${max}.`, key, 'invalid_value');
  return v;
}

function optBool(body, key) {
  const v = body[key];
  if (v === undefined || v === null) return undefined;
  if (typeof v !== 'boolean') throw wrongType(key, 'a boolean', v);
  return v;
}

function optStop(body) {
  const v = body.stop;
  if (v === undefined || v === null) return undefined;
  if (typeof v === 'string') return [v];
  if (Array.isArray(v) && v.every((s) => typeof s === 'string')) return v;
  throw wrongType('stop', 'a string or an array of strings', v);
}

function unsupported(param, what) {
  return invalid(`${what} is not supported by this server.`, param, 'unsupported_parameter');
}

/** Generation options shared by both endpoints, from OpenAI parameters (plus top_k, min_p, repetition_penalty). */
function generationOptions(body, defaultMaxTokens) {
  const n = optNumber(body, 'n', { integer: true, min: 1 });
  if (n !== undefined && n !== 1) throw unsupported('n', 'n other than 1');
  for (const key of ['presence_penalty', 'frequency_penalty']) {
    const v = optNumber(body, key, { min: -2, max: 2 });
    if (v) throw unsupported(key, `A non-zero ${key}`);
  }
  if (body.logit_bias !== undefined && body.logit_bias !== null && Object.keys(body.logit_bias).length) {
    throw unsupported('logit_bias', 'logit_bias');
  }
  const opts = {
    maxTokens:
      optNumber(body, 'max_completion_tokens', { integer: true, min: 1, max: MAX_TOKENS_LIMIT }) ??
      optNumber(body, 'max_tokens', { integer: true, min: 1, max: MAX_TOKENS_LIMIT }) ??
      defaultMaxTokens,
    temperature: optNumber(body, 'temperature', { min: 0, max: 2 }),
    topP: optNumber(body, 'top_p', { min: 0, max: 1, exclusiveMin: true }),
    topK: optNumber(body, 'top_k', { integer: true, min: 0, max: 2 ** 24 }),
    minP: optNumber(body, 'min_p', { min: 0, max: 1 }),
    repetitionPenalty: optNumber(body, 'repetition_penalty', { min: 0, exclusiveMin: true }),
    repetitionContextSize: optNumber(body, 'repetition_context_size', { integer: true, min: 1, max: 2 ** 20 }),
    seed: optNumber(body, 'seed', { integer: true, min: 0, max: Number.MAX_SAFE_INTEGER }),
    stop: optStop(body),
    ignoreEos: optBool(body, 'ignore_eos'),
  };
  for (const k of Object.keys(opts)) if (opts[k] === undefined) delete opts[k];
  return opts;
}

function streamFlags(body) {
  const stream = optBool(body, 'stream') ?? false;
  const so = body.stream_options;
  if (so !== undefined && so !== null && (typeof so !== 'object' || Array.isArray(so))) throw wrongType('stream_options', 'an object', so);
  const includeUsage = so ? optBool(so, 'include_usage') ?? false : false;
  return { stream, includeUsage };
}

/** Message content: a string, null, or text parts. */
function contentText(content, param) {
  if (content === undefined || content === null) return undefined;
  if (typeof content === 'string') return content;
  if (Array.isArray(content)) {
    return content
      .map((part, j) => {
        if (part && typeof part === 'object' && part.type === 'text' && typeof part.text === 'string') return part.text;
        if (part && typeof part === 'object' && typeof part.type === 'string') {
          throw unsupported(`${param}[${j}].type`, `Content of type '${part.type}'`);
        }
        throw wrongType(`${param}[${j}]`, "a content part like { type: 'text', text }", part);
      })
      .join('');
  }
  throw wrongType(param, 'a string or an array of content parts', content);
}

const ROLES = new Set(['system', 'developer', 'user', 'assistant', 'tool']);

function chatMessages(body) {
  const msgs = body.messages;
  if (msgs === undefined || msgs === null) throw invalid("Missing required parameter: 'messages'.", 'messages', 'missing_required_parameter');
  if (!Array.isArray(msgs)) throw wrongType('messages', 'an array', msgs);
  if (msgs.length === 0) throw invalid("Invalid 'messages': empty array. Expected an array with minimum length 1.", 'messages', 'empty_array');
  return msgs.map((m, i) => {
    const p = `messages[${i}]`;
    if (!m || typeof m !== 'object' || Array.isArray(m)) throw wrongType(p, 'an object', m);
    if (typeof m.role !== 'string') throw wrongType(`${p}.role`, 'a string', m.role);
    if (!ROLES.has(m.role)) {
      throw invalid(`Invalid value: '${m.role}'. Supported values are: 'system', 'developer', 'user', 'assistant' and 'tool'.`, `${p}.role`, 'invalid_value');
    }
    const out = { role: m.role === 'developer' ? 'system' : m.role };
    const content = contentText(m.content, `${p}.content`);
    if (content !== undefined) out.content = content;
    if (m.tool_calls !== undefined && m.tool_calls !== null) {
      if (m.role !== 'assistant') throw invalid(`'${p}.tool_calls' is only allowed on assistant messages.`, `${p}.tool_calls`);
      if (!Array.isArray(m.tool_calls)) throw wrongType(`${p}.tool_calls`, 'an array', m.tool_calls);
      m.tool_calls.forEach((c, j) => {
        const cp = `${p}.tool_calls[${j}]`;
        if (!c || typeof c !== 'object' || !c.function || typeof c.function.name !== 'string') {
          throw wrongType(cp, "a tool call like { id, type: 'function', function: { name, arguments } }", c);
        }
        if (c.function.arguments !== undefined && typeof c.function.arguments !== 'string') {
          throw wrongType(`${cp}.function.arguments`, 'a JSON string', c.function.arguments);
        }
      });
      out.toolCalls = m.tool_calls;
    }
    if (m.role === 'tool') {
      if (typeof m.tool_call_id !== 'string') throw invalid(`Missing required parameter: '${p}.tool_call_id'.`, `${p}.tool_call_id`, 'missing_required_parameter');
      out.toolCallId = m.tool_call_id;
    }
    if (m.role !== 'assistant' && content === undefined) {
      throw invalid(`Missing required parameter: '${p}.content'.`, `${p}.content`, 'missing_required_parameter');
    }
    if (m.name !== undefined && m.name !== null) {
      if (typeof m.name !== 'string') throw wrongType(`${p}.name`, 'a string', m.name);
      out.name = m.name;
    }
    return out;
  });
}

function chatTools(body) {
  const tools = body.tools;
  const choice = body.tool_choice;
  if (choice !== undefined && choice !== null && choice !== 'auto' && choice !== 'none') {
    if (typeof choice === 'string' && choice !== 'required') throw invalid(`Invalid value for 'tool_choice': '${choice}'.`, 'tool_choice', 'invalid_value');
    throw unsupported('tool_choice', "tool_choice other than 'auto' or 'none'");
  }
  if (tools === undefined || tools === null) return undefined;
  if (!Array.isArray(tools)) throw wrongType('tools', 'an array', tools);
  tools.forEach((t, i) => {
    if (!t || typeof t !== 'object' || t.type !== 'function' || !t.function || typeof t.function.name !== 'string') {
      throw invalid(`Invalid 'tools[${i}]': expected { type: 'function', function: { name, description?, parameters? } }.`, `tools[${i}]`, 'invalid_value');
    }
  });
  if (choice === 'none' || tools.length === 0) return undefined;
  return tools;
}

function responseFormat(body) {
  const rf = body.response_format;
  if (rf === undefined || rf === null) return;
  if (typeof rf !== 'object' || rf.type !== 'text') throw unsupported('response_format', "response_format other than { type: 'text' }");
}

function completionPrompt(body) {
  let p = body.prompt;
  if (p === undefined || p === null) throw invalid("Missing required parameter: 'prompt'.", 'prompt', 'missing_required_parameter');
  const isTokens = (a) => Array.isArray(a) && a.length > 0 && a.every((t) => Number.isInteger(t) && t >= 0);
  if (Array.isArray(p) && p.length === 1 && (typeof p[0] === 'string' || isTokens(p[0]))) p = p[0];
  if (typeof p === 'string') return p;
  if (isTokens(p)) return p;
  if (Array.isArray(p) && p.length > 1 && p.every((x) => typeof x === 'string' || isTokens(x))) {
    throw unsupported('prompt', 'More than one prompt per request');
  }
  throw wrongType('prompt', 'a string or an array of token ids', p);
}

function toOpenAIToolCalls(calls) {
  return calls.map((c) => ({ id: c.id, type: 'function', function: { name: c.function.name, arguments: c.function.arguments } }));
}

function finishReason(r) {
  // 'abort' only happens when the client went away; say 'stop' if anything reads it.
  return r.finishReason === 'abort' ? 'stop' : r.finishReason;
}

function usage(r) {
  return { prompt_tokens: r.usage.promptTokens, completion_tokens: r.usage.completionTokens, total_tokens: r.usage.totalTokens };
}

// Stops a stream whose client left (GenerationStream.cancel(), or return() of any async iterator).
function stopStream(events) {
  if (typeof events.cancel === 'function') events.cancel();
  else if (typeof events.return === 'function') events.return().catch(() => {});
}

function newId(prefix) {
  return `${prefix}-${randomBytes(12).toString('hex')}`;
}

/**
 * Native errors: bad arguments and template/tokenizer problems are the
 * caller's (400), the rest are ours (500). A prompt over the limits names
 * `promptParam` (`messages` or `prompt`).
 */
function fromNative(e, promptParam = null) {
  if (e instanceof ApiError) return e;
  const msg = String(e && e.message ? e.message : e);
  const over = /the prompt has (\d+) tokens, more than maxPromptTokens \((\d+)\)/.exec(msg);
  if (over) {
    return invalid(`This request's prompt has ${over[1]} tokens, more than this server's limit of ${over[2]} per request.`, promptParam, 'prompt_too_long');
  }
  if (/beyond the model's context length/.test(msg)) return invalid(msg, promptParam, 'context_length_exceeded');
  if (/^(invalid argument|text error):/.test(msg) || (e && e.code === 'InvalidArg')) return invalid(msg);
  if (/^model closed:/.test(msg)) return new ApiError(503, msg, { type: 'server_error', code: 'model_closed' });
  return new ApiError(500, msg, { type: 'server_error' });
}

function readBody(req, limit) {
  return new Promise((resolve, reject) => {
    const declared = Number(req.headers['content-length']);
    if (Number.isFinite(declared) && declared > limit) {
      reject(new ApiError(413, `Request body too large: ${declared} bytes, the limit is ${limit}.`, { code: 'request_too_large' }));
      return;
    }
    const chunks = [];
    let size = 0;
    let failed = false;
    req.on('data', (c) => {
      if (failed) return;
      size += c.length;
      if (size > limit) {
        failed = true;
        reject(new ApiError(413, `Request body too large: more than ${limit} bytes.`, { code: 'request_too_large' }));
        return;
      }
      chunks.push(c);
    });
    req.on('end', () => failed || resolve(Buffer.concat(chunks)));
    req.on('error', (e) => failed || ((failed = true), reject(e)));
  });
}

function parseJson(buf) {
  let body;
  try {
    body = JSON.parse(buf.toString('utf8'));
  } catch (e) {
    throw invalid(`We could not parse the JSON body of your request: ${e.message}`, null, 'invalid_json');
  }
  if (!body || typeof body !== 'object' || Array.isArray(body)) throw invalid(`The request body must be a JSON object, not ${kindOf(body)}.`, null, 'invalid_json');
  return body;
}

function sendJson(res, status, obj, extraHeaders = {}) {
  const text = JSON.stringify(obj);
  res.writeHead(status, { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(text), ...extraHeaders });
  res.end(text);
}

function sendError(res, err) {
  if (err.status === 503) res.setHeader('Retry-After', '1');
  if (res.headersSent) {
    // Mid-stream: an error event, then the end of the stream.
    if (!res.writableEnded && !res.destroyed) {
      res.write(`data: ${JSON.stringify(err.body())}\n\n`);
      res.end();
    }
    return;
  }
  // After an oversized body the rest is not read: close the connection.
  sendJson(res, err.status, err.body(), err.status === 413 ? { Connection: 'close' } : {});
}

/**
 * Server-sent events with backpressure: waits for 'drain' when the socket is
 * full. A client that takes nothing for `stallMs` is treated as gone: the
 * connection is closed, which cancels its generation, so a reader that
 * stops cannot make the server buffer without bound.
 */
class EventWriter {
  constructor(res, stallMs = DEFAULT_STALL_MS) {
    this.res = res;
    this.stallMs = stallMs;
    res.writeHead(200, { 'Content-Type': 'text/event-stream; charset=utf-8', 'Cache-Control': 'no-cache', Connection: 'keep-alive' });
    res.flushHeaders();
  }

  get gone() {
    return this.res.destroyed || this.res.writableEnded;
  }

  async send(obj) {
    if (this.gone) return;
    if (!this.res.write(`data: ${typeof obj === 'string' ? obj : JSON.stringify(obj)}\n\n`)) {
      await new Promise((resolve) => {
        const done = () => {
          clearTimeout(timer);
          this.res.off('drain', done);
          this.res.off('close', done);
          resolve();
        };
        const timer = setTimeout(() => {
          this.res.destroy();
          done();
        }, this.stallMs);
        this.res.on('drain', done);
        this.res.on('close', done);
      });
    }
  }

  end() {
    if (!this.gone) this.res.end();
  }
}

/**
 * An http.Server answering the OpenAI API with `model` (an Lfm2Model, or
 * anything with the same chat/chatStream/generate/generateStream methods).
 */
/** Constant-time comparison of a presented key with the expected one. */
function keyMatches(presented, expected) {
  const h = (k) => createHash('sha256').update(String(k)).digest();
  return timingSafeEqual(h(presented), h(expected));
}

function createServer({
  model,
  modelId = 'mlx-lfm',
  maxBodyBytes = DEFAULT_MAX_BODY_BYTES,
  defaultMaxTokens = DEFAULT_MAX_TOKENS,
  maxPromptTokens = null,
  apiKey = null,
  cors = null,
  maxQueued = DEFAULT_MAX_QUEUED,
  stallMs = DEFAULT_STALL_MS,
  headersTimeout = DEFAULT_TIMEOUTS.headersTimeout,
  requestTimeout = DEFAULT_TIMEOUTS.requestTimeout,
  keepAliveTimeout = DEFAULT_TIMEOUTS.keepAliveTimeout,
  log = () => {},
} = {}) {
  if (!model) throw new TypeError('createServer needs { model }');
  if (apiKey !== null && (typeof apiKey !== 'string' || apiKey.length < 8)) {
    throw new TypeError('apiKey must be a string of at least 8 characters');
  }
  // A request's prompt costs prefill time on the one model every client
  // shares: bounded per request (default: the model's context length).
  if (maxPromptTokens === null) maxPromptTokens = typeof model.info === 'function' ? model.info().contextLength : null;
  // Ranks the model is split over (tensor parallelism); 1 for one process.
  const worldSize = typeof model.info === 'function' ? model.info().worldSize ?? 1 : 1;
  if (maxPromptTokens !== null && !(Number.isInteger(maxPromptTokens) && maxPromptTokens >= 1)) {
    throw new TypeError('maxPromptTokens must be a positive integer');
  }
  for (const [name, ms] of Object.entries({ headersTimeout, requestTimeout, keepAliveTimeout })) {
    if (!(Number.isInteger(ms) && ms > 0)) throw new TypeError(`${name} must be a positive number of milliseconds`);
  }
  let inFlight = 0;
  const created = Math.floor(Date.now() / 1000);
  const modelObject = { id: modelId, object: 'model', created, owned_by: 'mlx-lfm' };

  function checkModel(body) {
    if (body.model === undefined || body.model === null) return;
    if (typeof body.model !== 'string') throw wrongType('model', 'a string', body.model);
    if (body.model !== modelId) {
      throw new ApiError(404, `The model '${body.model}' does not exist; this server serves '${modelId}'.`, { param: 'model', code: 'model_not_found' });
    }
  }

  // Aborts the request's generation when the client goes away before the response is complete.
  function abortOnDisconnect(res) {
    const ac = new AbortController();
    res.on('close', () => {
      if (!res.writableFinished) ac.abort();
    });
    return ac;
  }

  function limited(opts) {
    if (maxPromptTokens !== null) opts.maxPromptTokens = maxPromptTokens;
    return opts;
  }

  /**
   * Starts a server-sent event response for `events`, once its first event
   * is there: a request refused before generation (prompt limits, template
   * errors) still gets its 4xx instead of an error event after a 200.
   */
  async function streamEvents(res, events) {
    res.on('close', () => stopStream(events));
    const it = events[Symbol.asyncIterator]();
    const first = await it.next();
    const out = new EventWriter(res, stallMs);
    return { out, first, it };
  }

  async function chatCompletions(req, res, body) {
    checkModel(body);
    const messages = chatMessages(body);
    const opts = limited(generationOptions(body, defaultMaxTokens));
    const tools = chatTools(body);
    if (tools) opts.tools = tools;
    responseFormat(body);
    if (body.logprobs) throw unsupported('logprobs', 'logprobs');
    const { stream, includeUsage } = streamFlags(body);
    const id = newId('chatcmpl');
    const now = Math.floor(Date.now() / 1000);
    const ac = abortOnDisconnect(res);
    opts.signal = ac.signal;
    if (!stream) {
      const r = await model.chat(messages, opts);
      if (ac.signal.aborted) return;
      const message = { role: 'assistant', content: r.text, refusal: null };
      if (r.toolCalls && r.toolCalls.length) {
        message.tool_calls = toOpenAIToolCalls(r.toolCalls);
        if (!r.text) message.content = null;
      }
      if (r.toolCallErrors && r.toolCallErrors.length) message.tool_call_errors = r.toolCallErrors;
      sendJson(res, 200, {
        id,
        object: 'chat.completion',
        created: now,
        model: modelId,
        system_fingerprint: null,
        choices: [{ index: 0, message, logprobs: null, finish_reason: finishReason(r) }],
        usage: usage(r),
      });
      return;
    }
    const { out, first, it } = await streamEvents(res, model.chatStream(messages, opts));
    const chunk = (delta, finish = null) => ({
      id,
      object: 'chat.completion.chunk',
      created: now,
      model: modelId,
      system_fingerprint: null,
      choices: [{ index: 0, delta, logprobs: null, finish_reason: finish }],
      ...(includeUsage ? { usage: null } : {}),
    });
    await out.send(chunk({ role: 'assistant', content: '' }));
    for (let next = first; !next.done; next = await it.next()) {
      const ev = next.value;
      if (out.gone) break;
      if (ev.type === 'text') {
        await out.send(chunk({ content: ev.text }));
        continue;
      }
      const r = ev.result;
      if (r.toolCalls && r.toolCalls.length) {
        await out.send(chunk({ tool_calls: toOpenAIToolCalls(r.toolCalls).map((c, index) => ({ index, ...c })) }));
      }
      const last = chunk({}, finishReason(r));
      if (r.toolCallErrors && r.toolCallErrors.length) last.choices[0].tool_call_errors = r.toolCallErrors;
      await out.send(last);
      if (includeUsage) await out.send({ id, object: 'chat.completion.chunk', created: now, model: modelId, system_fingerprint: null, choices: [], usage: usage(r) });
    }
    await out.send('[DONE]');
    out.end();
  }

  async function completions(req, res, body) {
    checkModel(body);
    const prompt = completionPrompt(body);
    const opts = limited(generationOptions(body, defaultMaxTokens));
    if (body.echo) throw unsupported('echo', 'echo');
    if (body.suffix) throw unsupported('suffix', 'suffix');
    if (body.logprobs !== undefined && body.logprobs !== null) throw unsupported('logprobs', 'logprobs');
    const bestOf = optNumber(body, 'best_of', { integer: true, min: 1 });
    if (bestOf !== undefined && bestOf !== 1) throw unsupported('best_of', 'best_of other than 1');
    const { stream, includeUsage } = streamFlags(body);
    const id = newId('cmpl');
    const now = Math.floor(Date.now() / 1000);
    const ac = abortOnDisconnect(res);
    opts.signal = ac.signal;
    if (!stream) {
      const r = await model.generate(prompt, opts);
      if (ac.signal.aborted) return;
      sendJson(res, 200, {
        id,
        object: 'text_completion',
        created: now,
        model: modelId,
        system_fingerprint: null,
        choices: [{ index: 0, text: r.text, logprobs: null, finish_reason: finishReason(r) }],
        usage: usage(r),
      });
      return;
    }
    const { out, first, it } = await streamEvents(res, model.generateStream(prompt, opts));
    const chunk = (text, finish = null) => ({
      id,
      object: 'text_completion',
      created: now,
      model: modelId,
      system_fingerprint: null,
      choices: [{ index: 0, text, logprobs: null, finish_reason: finish }],
      ...(includeUsage ? { usage: null } : {}),
    });
    for (let next = first; !next.done; next = await it.next()) {
      const ev = next.value;
      if (out.gone) break;
      if (ev.type === 'text') {
        await out.send(chunk(ev.text));
        continue;
      }
      await out.send(chunk('', finishReason(ev.result)));
      if (includeUsage) await out.send({ id, object: 'text_completion', created: now, model: modelId, choices: [], usage: usage(ev.result) });
    }
    await out.send('[DONE]');
    out.end();
  }

  const routes = {
    '/v1/chat/completions': { POST: chatCompletions },
    '/v1/completions': { POST: completions },
    '/v1/models': { GET: (req, res) => sendJson(res, 200, { object: 'list', data: [modelObject] }) },
  };

  async function handle(req, res) {
    const path = (req.url || '/').split('?')[0].replace(/\/+$/, '') || '/';
    if (cors) {
      res.setHeader('Access-Control-Allow-Origin', cors);
      res.setHeader('Vary', 'Origin');
      if (req.method === 'OPTIONS') {
        res.writeHead(204, {
          'Access-Control-Allow-Methods': 'GET, POST, OPTIONS',
          'Access-Control-Allow-Headers': 'Authorization, Content-Type',
          'Access-Control-Max-Age': '600',
        });
        res.end();
        return;
      }
    }
    if (path === '/health' && req.method === 'GET') {
      sendJson(res, 200, { status: 'ok', model: modelId, worldSize });
      return;
    }
    if (apiKey !== null) {
      const m = /^Bearer (.+)$/.exec(req.headers.authorization || '');
      if (!m || !keyMatches(m[1], apiKey)) {
        throw new ApiError(401, 'Incorrect or missing API key: send `Authorization: Bearer KEY`.', { code: 'invalid_api_key' });
      }
    }
    let handler;
    let route = routes[path];
    if (!route && path.startsWith('/v1/models/')) {
      let id;
      try {
        id = decodeURIComponent(path.slice('/v1/models/'.length));
      } catch {
        throw invalid(`The request path ${path} is not valid percent-encoding.`, null, 'invalid_url');
      }
      route = {
        GET: (q, s) => {
          if (id !== modelId) throw new ApiError(404, `The model '${id}' does not exist.`, { param: 'model', code: 'model_not_found' });
          sendJson(s, 200, modelObject);
        },
      };
    }
    if (!route) throw new ApiError(404, `Unknown request URL: ${req.method} ${path}.`, { code: 'unknown_url' });
    handler = route[req.method];
    if (!handler) throw new ApiError(405, `Method ${req.method} is not allowed on ${path}; use ${Object.keys(route).join(', ')}.`, { code: 'method_not_allowed' });
    let body;
    if (req.method === 'POST') {
      // Only JSON: a cross-site form or text/plain "simple request" cannot
      // reach the model.
      const type = String(req.headers['content-type'] || '').split(';')[0].trim().toLowerCase();
      if (type !== 'application/json') {
        throw new ApiError(415, `POST bodies must be sent as Content-Type: application/json, not ${type ? `'${type}'` : 'none'}.`, { code: 'unsupported_media_type' });
      }
      if (inFlight >= maxQueued) {
        throw new ApiError(503, `The server is busy: ${inFlight} requests are queued or running; retry shortly.`, { type: 'server_error', code: 'server_busy' });
      }
      inFlight++;
      try {
        body = parseJson(await readBody(req, maxBodyBytes));
        await handler(req, res, body);
      } finally {
        inFlight--;
      }
      return;
    }
    await handler(req, res, body);
  }

  const server = http.createServer({
    headersTimeout,
    requestTimeout,
    keepAliveTimeout,
    // Node checks the header and request timeouts on this interval (30 s
    // by default), so a 10 s headers timeout could let a slow client hold
    // its connection for 40 s.
    connectionsCheckingInterval: Math.min(1000, headersTimeout),
  }, (req, res) => {
    const started = Date.now();
    handle(req, res)
      .catch((e) => {
        const err = fromNative(e, req.url && req.url.includes('/chat/') ? 'messages' : 'prompt');
        if (err.status >= 500) log(`${req.method} ${req.url}: ${err.message}`);
        sendError(res, err);
        if (err.status === 413) req.resume();
      })
      .finally(() => log(`${req.method} ${req.url} ${res.statusCode} ${Date.now() - started} ms`));
  });
  return server;
}

function isLoopback(host) {
  return host === 'localhost' || host === '::1' || /^127\.\d+\.\d+\.\d+$/.test(host);
}

/**
 * Loads nothing: listens with `createServer(options)` on `port`/`host`;
 * resolves once listening. Anything but a loopback address needs an apiKey.
 */
function listen(options, { port = 8080, host = '127.0.0.1', maxConnections = 256, ...timeouts } = {}) {
  if (!isLoopback(host) && !options.apiKey) {
    return Promise.reject(new Error(
      `refusing to listen on ${host} without an API key: anyone who can reach it could use the model. ` +
        'Pass --api-key KEY (or set MLX_LFM_API_KEY), or listen on 127.0.0.1.',
    ));
  }
  const server = createServer({ ...options, ...timeouts });
  server.maxConnections = maxConnections;
  return new Promise((resolve, reject) => {
    server.once('error', reject);
    server.listen(port, host, () => {
      server.off('error', reject);
      const addr = server.address();
      const shownHost = addr.family === 'IPv6' ? `[${addr.address}]` : addr.address;
      resolve({ server, port: addr.port, url: `http://${shownHost}:${addr.port}/v1` });
    });
  });
}

module.exports = { createServer, listen, isLoopback, ApiError };
