// OpenAI-compatible HTTP server over one loaded Lfm2Model (plain node:http).
//
//   POST /v1/chat/completions   (stream: server-sent events)
//   POST /v1/completions        (prompt: a string, token ids, or a list of either)
//
// `n` choices per prompt are n requests with the same prompt: the paged
// prefix cache shares the prompt and the scheduler batches their decode.
// Logprobs are those of the tokens as drawn (see the library's `logprobs`).
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

// Choices per prompt, and choices per request (prompts times n): each is
// a request on the model.
const MAX_N = 16;
const MAX_CHOICES = 64;

function choiceCount(body, prompts = 1) {
  const n = optNumber(body, 'n', { integer: true, min: 1, max: MAX_N }) ?? 1;
  if (n * prompts > MAX_CHOICES) {
    throw invalid(`This request asks for ${n * prompts} choices (${prompts} prompts times n = ${n}); the limit is ${MAX_CHOICES}.`, 'n', 'invalid_value');
  }
  return n;
}

/** `logit_bias`: token id (a decimal string) -> a bias from -100 to 100. */
function logitBias(body) {
  const v = body.logit_bias;
  if (v === undefined || v === null) return undefined;
  if (typeof v !== 'object' || Array.isArray(v)) throw wrongType('logit_bias', 'an object mapping token ids to biases', v);
  const out = {};
  for (const [k, b] of Object.entries(v)) {
    if (!/^(0|[1-9][0-9]{0,9})$/.test(k) || Number(k) > 2 ** 32 - 1) {
      throw invalid(`Invalid 'logit_bias': the key '${k}' is not a token id.`, 'logit_bias', 'invalid_value');
    }
    if (typeof b !== 'number' || !Number.isFinite(b) || b < -100 || b > 100) {
      throw invalid(`Invalid 'logit_bias' for token ${k}: ${JSON.stringify(b)} is not a number from -100 to 100.`, 'logit_bias', 'invalid_value');
    }
    out[k] = b;
  }
  return Object.keys(out).length ? out : undefined;
}

/** Generation options shared by both endpoints, from OpenAI parameters (plus top_k, min_p, repetition_penalty). */
function generationOptions(body, defaultMaxTokens) {
  const opts = {
    presencePenalty: optNumber(body, 'presence_penalty', { min: -2, max: 2 }),
    frequencyPenalty: optNumber(body, 'frequency_penalty', { min: -2, max: 2 }),
    logitBias: logitBias(body),
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

/** `tools` and `tool_choice` as library options ({ tools, toolChoice }). */
function chatTools(body) {
  const tools = body.tools;
  const choice = body.tool_choice;
  let toolChoice;
  if (choice !== undefined && choice !== null && choice !== 'auto' && choice !== 'none') {
    if (typeof choice === 'string') {
      if (choice !== 'required') throw invalid(`Invalid value for 'tool_choice': '${choice}'.`, 'tool_choice', 'invalid_value');
      toolChoice = 'required';
    } else if (choice && typeof choice === 'object' && !Array.isArray(choice) && choice.type === 'function' && choice.function && typeof choice.function.name === 'string') {
      toolChoice = { name: choice.function.name };
    } else {
      throw wrongType('tool_choice', "'auto', 'none', 'required' or { type: 'function', function: { name } }", choice);
    }
  }
  if (tools !== undefined && tools !== null) {
    if (!Array.isArray(tools)) throw wrongType('tools', 'an array', tools);
    tools.forEach((t, i) => {
      if (!t || typeof t !== 'object' || t.type !== 'function' || !t.function || typeof t.function.name !== 'string') {
        throw invalid(`Invalid 'tools[${i}]': expected { type: 'function', function: { name, description?, parameters? } }.`, `tools[${i}]`, 'invalid_value');
      }
    });
  }
  const offered = choice !== 'none' && Array.isArray(tools) && tools.length > 0 ? tools : undefined;
  // An explicit 'auto' completes a call the model starts under the tools' schemas.
  if (choice === 'auto' && offered) toolChoice = 'auto';
  if (toolChoice && !offered) throw invalid(`'tool_choice' ${JSON.stringify(choice)} needs 'tools'.`, 'tool_choice', 'invalid_value');
  if (toolChoice && toolChoice.name && !offered.some((t) => t.function.name === toolChoice.name)) {
    throw invalid(`'tool_choice' names the function '${toolChoice.name}', which is not in 'tools'.`, 'tool_choice', 'invalid_value');
  }
  return { tools: offered, toolChoice };
}

/** `response_format` as library options: json_object and json_schema constrain the output. */
function responseFormat(body) {
  const rf = body.response_format;
  if (rf === undefined || rf === null) return {};
  if (typeof rf !== 'object' || Array.isArray(rf)) throw wrongType('response_format', 'an object', rf);
  if (rf.type === 'text') return {};
  if (rf.type === 'json_object') return { jsonSchema: { type: 'object' } };
  if (rf.type === 'json_schema') {
    const js = rf.json_schema;
    if (!js || typeof js !== 'object' || Array.isArray(js)) throw wrongType('response_format.json_schema', 'an object like { name, schema, strict }', js);
    const schema = js.schema ?? {};
    if (typeof schema !== 'object' || Array.isArray(schema) || schema === null) throw wrongType('response_format.json_schema.schema', 'a JSON schema (an object)', schema);
    return { jsonSchema: schema };
  }
  throw invalid(`Invalid value for 'response_format.type': ${JSON.stringify(rf.type)}; use 'text', 'json_object' or 'json_schema'.`, 'response_format', 'invalid_value');
}

/** The prompts of a completion request: a string, token ids, or a list of either. */
function completionPrompts(body) {
  const p = body.prompt;
  if (p === undefined || p === null) throw invalid("Missing required parameter: 'prompt'.", 'prompt', 'missing_required_parameter');
  const isTokens = (a) => Array.isArray(a) && a.length > 0 && a.every((t) => Number.isInteger(t) && t >= 0);
  if (typeof p === 'string') return [p];
  if (isTokens(p)) return [p];
  if (Array.isArray(p) && p.length > 0 && p.every((x) => typeof x === 'string' || isTokens(x))) return p;
  throw wrongType('prompt', 'a string, an array of token ids, or an array of those', p);
}

const bytesOf = (s) => [...Buffer.from(s, 'utf8')];

/** Chat's `logprobs`/`top_logprobs` as library options. */
function chatLogprobOptions(body) {
  const on = optBool(body, 'logprobs') ?? false;
  const top = optNumber(body, 'top_logprobs', { integer: true, min: 0, max: 20 });
  if (top && !on) throw invalid("'top_logprobs' needs 'logprobs' set to true.", 'top_logprobs', 'invalid_value');
  return on ? { logprobs: true, topLogprobs: top ?? 0 } : {};
}

/** Library logprob entries in chat's shape ({ content: [...] }), or null. */
function chatLogprobs(entries) {
  if (!entries) return null;
  return {
    content: entries.map((e) => ({
      token: e.text,
      logprob: e.logprob,
      bytes: bytesOf(e.text),
      top_logprobs: e.topLogprobs.map((t) => ({ token: t.text, logprob: t.logprob, bytes: bytesOf(t.text) })),
    })),
    refusal: null,
  };
}

/** Library logprob entries in the legacy completions shape; `offset` is the text offset of the first. */
function completionLogprobs(entries, offset) {
  if (!entries) return null;
  const textOffset = [];
  for (const e of entries) {
    textOffset.push(offset);
    offset += e.text.length;
  }
  return {
    tokens: entries.map((e) => e.text),
    token_logprobs: entries.map((e) => e.logprob),
    top_logprobs: entries.map((e) => Object.fromEntries(e.topLogprobs.map((t) => [t.text, t.logprob]))),
    text_offset: textOffset,
  };
}

/** The options of choice `j` of n: a given seed becomes seed + j, so choices differ yet reproduce. */
function choiceOptions(opts, j) {
  if (j === 0 || opts.seed === undefined) return opts;
  return { ...opts, seed: (opts.seed + j) % Number.MAX_SAFE_INTEGER };
}

/** Usage of several choices: each distinct prompt counted once. */
function sumUsage(results, n) {
  let prompt = 0;
  let cached = 0;
  let completion = 0;
  results.forEach((r, i) => {
    if (i % n === 0) {
      prompt += r.usage.promptTokens;
      cached += r.metrics?.cachedTokens ?? 0;
    }
    completion += r.usage.completionTokens;
  });
  return {
    prompt_tokens: prompt,
    completion_tokens: completion,
    total_tokens: prompt + completion,
    // OpenAI's field: prompt tokens served from the prefix cache (memory or
    // disk), as each prompt's first choice found them.
    prompt_tokens_details: { cached_tokens: cached },
  };
}

function toOpenAIToolCalls(calls) {
  return calls.map((c) => ({ id: c.id, type: 'function', function: { name: c.function.name, arguments: c.function.arguments } }));
}

function finishReason(r) {
  // 'abort' only happens when the client went away; say 'stop' if anything reads it.
  return r.finishReason === 'abort' ? 'stop' : r.finishReason;
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
  if (/logitBias names token id/.test(msg)) return invalid(msg, 'logit_bias', 'invalid_value');
  if (/^invalid argument: jsonSchema is not valid/.test(msg)) return invalid(msg, 'response_format', 'invalid_schema');
  if (/^invalid argument: toolChoice is not valid/.test(msg)) return invalid(msg, 'tools', 'invalid_schema');
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
   * Starts the streams of a request's choices (`jobs`, n per prompt, made
   * by `make`). The first choice of each prompt runs alone until its first
   * event (its prefill is done by then), so the other n - 1 find the prompt
   * in the paged prefix cache instead of running it again, and decode
   * batched with it. Resolves once every stream has its first event: a
   * request refused before generation (prompt limits, template errors)
   * fails here (the others stopped), before any response is sent.
   */
  async function startChoices(res, jobs, n, make) {
    const streams = [];
    const its = [];
    const firsts = [];
    res.on('close', () => streams.forEach((s) => s && stopStream(s)));
    const open = async (k) => {
      streams[k] = make(jobs[k]);
      its[k] = streams[k][Symbol.asyncIterator]();
      firsts[k] = await its[k].next();
    };
    const keys = jobs.map((_, k) => k);
    try {
      await Promise.all(keys.filter((k) => k % n === 0).map(open));
      await Promise.all(keys.filter((k) => k % n !== 0).map(open));
    } catch (e) {
      streams.forEach((s) => s && stopStream(s));
      throw e;
    }
    return { streams, its, firsts };
  }

  /**
   * Runs started choices to the end: `onEvent(k, ev, out)` per event of
   * choice k, written to a server-sent event response when `stream`.
   * Returns the response writer (or null) and each choice's result.
   */
  async function runChoices(res, started, stream, onEvent = async () => {}) {
    const { streams, its, firsts } = started;
    const out = stream ? new EventWriter(res, stallMs) : null;
    const results = new Array(streams.length).fill(null);
    try {
      await Promise.all(its.map(async (it, k) => {
        for (let next = firsts[k]; !next.done; next = await it.next()) {
          if (out && out.gone) {
            stopStream(streams[k]);
            break;
          }
          if (next.value.type === 'done') results[k] = next.value.result;
          await onEvent(k, next.value, out);
        }
      }));
    } catch (e) {
      // One choice failed: the request fails, the others stop.
      streams.forEach(stopStream);
      throw e;
    }
    return { out, results };
  }

  async function chatCompletions(req, res, body) {
    checkModel(body);
    const messages = chatMessages(body);
    const opts = limited({ ...generationOptions(body, defaultMaxTokens), ...chatLogprobOptions(body) });
    const n = choiceCount(body);
    const { tools, toolChoice } = chatTools(body);
    if (tools) opts.tools = tools;
    if (toolChoice) opts.toolChoice = toolChoice;
    Object.assign(opts, responseFormat(body));
    if (opts.jsonSchema && opts.toolChoice) throw invalid("'response_format' json and a forcing 'tool_choice' cannot be used together.", 'response_format', 'invalid_value');
    const { stream, includeUsage } = streamFlags(body);
    const id = newId('chatcmpl');
    const now = Math.floor(Date.now() / 1000);
    const ac = abortOnDisconnect(res);
    opts.signal = ac.signal;
    const jobs = Array.from({ length: n }, (_, j) => choiceOptions(opts, j));
    if (!stream) {
      let rs;
      if (n === 1) rs = [await model.chat(messages, opts)];
      else rs = (await runChoices(res, await startChoices(res, jobs, n, (o) => model.chatStream(messages, o)), false)).results;
      if (ac.signal.aborted || rs.some((r) => !r)) return;
      const choices = rs.map((r, index) => {
        const message = { role: 'assistant', content: r.text, refusal: null };
        if (r.toolCalls && r.toolCalls.length) {
          message.tool_calls = toOpenAIToolCalls(r.toolCalls);
          if (!r.text) message.content = null;
        }
        if (r.toolCallErrors && r.toolCallErrors.length) message.tool_call_errors = r.toolCallErrors;
        return { index, message, logprobs: chatLogprobs(r.logprobs), finish_reason: finishReason(r) };
      });
      sendJson(res, 200, {
        id,
        object: 'chat.completion',
        created: now,
        model: modelId,
        system_fingerprint: null,
        choices,
        usage: sumUsage(rs, n),
      });
      return;
    }
    const chunk = (index, delta, finish = null, logprobs = null) => ({
      id,
      object: 'chat.completion.chunk',
      created: now,
      model: modelId,
      system_fingerprint: null,
      choices: [{ index, delta, logprobs, finish_reason: finish }],
      ...(includeUsage ? { usage: null } : {}),
    });
    const started = await startChoices(res, jobs, n, (o) => model.chatStream(messages, o));
    const opened = new Set();
    const { out, results } = await runChoices(res, started, true, async (k, ev, w) => {
      if (!opened.has(k)) {
        opened.add(k);
        await w.send(chunk(k, { role: 'assistant', content: '' }));
      }
      if (ev.type === 'text') {
        await w.send(chunk(k, { content: ev.text }, null, chatLogprobs(ev.logprobs)));
        return;
      }
      const r = ev.result;
      if (r.toolCalls && r.toolCalls.length) {
        await w.send(chunk(k, { tool_calls: toOpenAIToolCalls(r.toolCalls).map((c, index) => ({ index, ...c })) }));
      }
      const last = chunk(k, {}, finishReason(r));
      if (r.toolCallErrors && r.toolCallErrors.length) last.choices[0].tool_call_errors = r.toolCallErrors;
      await w.send(last);
    });
    if (includeUsage && results.every(Boolean)) {
      await out.send({ id, object: 'chat.completion.chunk', created: now, model: modelId, system_fingerprint: null, choices: [], usage: sumUsage(results, n) });
    }
    await out.send('[DONE]');
    out.end();
  }

  /** The text of a prompt as given (token ids decoded), for `echo`. */
  async function promptText(p) {
    if (typeof p === 'string') return p;
    if (typeof model.detokenize !== 'function') throw unsupported('echo', 'echo of token-id prompts');
    return model.detokenize(p);
  }

  async function completions(req, res, body) {
    checkModel(body);
    const prompts = completionPrompts(body);
    const opts = limited(generationOptions(body, defaultMaxTokens));
    const n = choiceCount(body, prompts.length);
    const echo = optBool(body, 'echo') ?? false;
    if (body.suffix) throw unsupported('suffix', 'suffix');
    const lp = optNumber(body, 'logprobs', { integer: true, min: 0, max: 5 });
    if (lp !== undefined) Object.assign(opts, { logprobs: true, topLogprobs: lp });
    if (echo && lp !== undefined) throw unsupported('logprobs', 'logprobs together with echo (the prompt tokens have none here)');
    const bestOf = optNumber(body, 'best_of', { integer: true, min: 1 });
    if (bestOf !== undefined && bestOf !== 1) throw unsupported('best_of', 'best_of other than 1');
    const { stream, includeUsage } = streamFlags(body);
    const id = newId('cmpl');
    const now = Math.floor(Date.now() / 1000);
    const ac = abortOnDisconnect(res);
    opts.signal = ac.signal;
    // Choice k is prompt floor(k / n), sample k % n.
    const jobs = prompts.flatMap((p) => Array.from({ length: n }, (_, j) => ({ prompt: p, opts: choiceOptions(opts, j) })));
    const echoes = echo ? await Promise.all(prompts.map(promptText)) : null;
    const prefix = (k) => (echoes ? echoes[Math.floor(k / n)] : '');
    if (!stream) {
      let rs;
      if (jobs.length === 1) rs = [await model.generate(jobs[0].prompt, jobs[0].opts)];
      else rs = (await runChoices(res, await startChoices(res, jobs, n, (j) => model.generateStream(j.prompt, j.opts)), false)).results;
      if (ac.signal.aborted || rs.some((r) => !r)) return;
      sendJson(res, 200, {
        id,
        object: 'text_completion',
        created: now,
        model: modelId,
        system_fingerprint: null,
        choices: rs.map((r, index) => ({
          index,
          text: prefix(index) + r.text,
          logprobs: completionLogprobs(r.logprobs, prefix(index).length),
          finish_reason: finishReason(r),
        })),
        usage: sumUsage(rs, n),
      });
      return;
    }
    const chunk = (index, text, finish = null, logprobs = null) => ({
      id,
      object: 'text_completion',
      created: now,
      model: modelId,
      system_fingerprint: null,
      choices: [{ index, text, logprobs, finish_reason: finish }],
      ...(includeUsage ? { usage: null } : {}),
    });
    const offsets = jobs.map((_, k) => prefix(k).length);
    const echoed = new Set();
    const started = await startChoices(res, jobs, n, (j) => model.generateStream(j.prompt, j.opts));
    const { out, results } = await runChoices(res, started, true, async (k, ev, w) => {
      if (echoes && !echoed.has(k)) {
        echoed.add(k);
        await w.send(chunk(k, prefix(k)));
      }
      if (ev.type === 'text') {
        const logprobs = completionLogprobs(ev.logprobs, offsets[k]);
        if (ev.logprobs) offsets[k] += ev.logprobs.reduce((sum, e) => sum + e.text.length, 0);
        await w.send(chunk(k, ev.text, null, logprobs));
        return;
      }
      await w.send(chunk(k, '', finishReason(ev.result)));
    });
    if (includeUsage && results.every(Boolean)) {
      await out.send({ id, object: 'text_completion', created: now, model: modelId, choices: [], usage: sumUsage(results, n) });
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
