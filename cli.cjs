#!/usr/bin/env node
// mlx-lfm command line: chat with a model, inspect it, serve it, benchmark
// it, convert it, or generate a test checkpoint.
'use strict';
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const readline = require('node:readline');

const pkg = require('./package.json');

// Flags every command that loads a model takes (passed to Lfm2Model.load).
const LOAD_FLAGS = {
  dtype: { arg: 'DTYPE', choices: ['float32', 'float16', 'bfloat16', 'f32', 'f16', 'bf16'], help: 'cast the weights (default: as stored)' },
  'kv-cache': {
    arg: 'NAME',
    choices: ['default', 'affine4', 'affine8', 'rotorquant', 'rotorquant-dense', 'rotorquant-quaternion', 'rotorquant-adaptive'],
    help: 'KV cache storage (default: full precision)',
  },
  'decode-path': { arg: 'PATH', choices: ['compiled', 'eager'], help: 'decode step (default: compiled when the model allows)' },
  paged: { boolean: true, help: 'paged KV cache with prefix reuse (the default for unquantized checkpoints)' },
  'no-paged': { boolean: true, help: 'flat per-request KV caches instead' },
  device: { arg: 'DEVICE', choices: ['cpu', 'gpu'], help: "MLX device (default: MLX's default)" },
  'context-length': { arg: 'N', int: true, help: "positions a request may use (default: the model's)" },
  'prefix-cache-dir': { arg: 'DIR', help: 'keep prefix-cache blocks on disk here too, reused after a restart (paged cache)' },
  'prefix-cache-disk-mb': { arg: 'N', int: true, help: 'disk budget for --prefix-cache-dir in MiB (default 4096)' },
};

const MODEL_FLAG = { model: { arg: 'DIR', help: 'checkpoint directory (Hugging Face or MLX layout)' } };
const DEMO_MODEL_FLAG = { model: { arg: 'DIR', help: 'checkpoint directory (default: a tiny generated model with random weights)' } };

const SAMPLING_FLAGS = {
  'max-tokens': { arg: 'N', int: true, help: 'most tokens per reply (default 256)' },
  temperature: { arg: 'T', num: true, help: '0 (the default) is greedy' },
  'top-p': { arg: 'P', num: true, help: 'nucleus sampling' },
  'top-k': { arg: 'K', int: true, help: 'sample among the K likeliest tokens' },
  'min-p': { arg: 'P', num: true, help: 'drop tokens below P times the likeliest' },
  seed: { arg: 'S', int: true, help: 'seed for reproducible sampling' },
  'repetition-penalty': { arg: 'R', num: true, help: 'penalize recently generated tokens' },
};

const COMMANDS = {
  chat: {
    usage: 'mlx-lfm chat [--model DIR] [--prompt TEXT] [--system TEXT] [options]',
    about:
      'One reply to --prompt, otherwise an interactive chat (an empty line or Ctrl-D ends it). ' +
      'The reply is printed as it is generated; timings go to stderr.',
    flags: {
      ...DEMO_MODEL_FLAG,
      prompt: { arg: 'TEXT', help: 'the message to answer (omit for an interactive chat)' },
      system: { arg: 'TEXT', help: 'a system prompt' },
      ...SAMPLING_FLAGS,
      ...LOAD_FLAGS,
    },
    run: chat,
    relaunch: true,
  },
  info: {
    usage: 'mlx-lfm info --model DIR [options]',
    about: 'Loads the model and prints what was loaded and how it runs (JSON), with MLX facts.',
    flags: { ...MODEL_FLAG, ...LOAD_FLAGS },
    run: info,
    relaunch: true,
  },
  fixture: {
    usage: 'mlx-lfm fixture --out DIR [--preset NAME] [--dtype f32|bf16|f16] [--layout hf|mlx] [--seed N]',
    about: 'Writes a random-weight checkpoint with a trained tokenizer and a chat template (for tests and benchmarks).',
    flags: {
      out: { arg: 'DIR', help: 'where to write it' },
      preset: { arg: 'NAME', choices: ['tiny', 'tiny-moe', 'lfm2-350m', 'lfm2-1.2b', 'lfm2-8b-a1b'], help: 'model shape (default tiny)' },
      dtype: { arg: 'DTYPE', choices: ['f32', 'bf16', 'f16'], help: 'weight dtype (default f32)' },
      layout: { arg: 'LAYOUT', choices: ['hf', 'mlx'], help: 'tensor names (default hf)' },
      seed: { arg: 'N', int: true, help: 'random seed (default 0)' },
    },
    run: fixture,
  },
  serve: {
    usage: 'mlx-lfm serve [--model DIR] [--port N] [--host ADDR] [options]',
    about:
      'OpenAI-compatible HTTP server: POST /v1/chat/completions, POST /v1/completions (both with "stream": true too), ' +
      'GET /v1/models, GET /health. With an API key every route but /health needs "Authorization: Bearer KEY"; ' +
      'a --host other than loopback needs one.',
    flags: {
      ...DEMO_MODEL_FLAG,
      port: { arg: 'N', int: true, help: 'port (default 8080; 0 picks a free one)' },
      host: { arg: 'ADDR', help: 'address (default 127.0.0.1)' },
      name: { arg: 'ID', help: "the model id clients send (default: the model directory's name)" },
      'api-key': { arg: 'KEY', help: 'require this bearer key (or set MLX_LFM_API_KEY)' },
      cors: { arg: 'ORIGIN', help: 'send CORS headers for this origin (none by default)' },
      'max-prompt-tokens': { arg: 'N', int: true, help: "longer prompts are a 400 before any compute (default: the model's context length)" },
      'tensor-parallel': { arg: 'N', int: true, help: 'split the model over N ranks (default 1); this process is rank 0 and serves' },
      backend: { arg: 'NAME', choices: ['ring', 'nccl', 'jaccl', 'any'], help: 'MLX distributed backend for --tensor-parallel (default ring)' },
      hostfile: { arg: 'FILE', help: "MLX's hostfile (a JSON list per rank of \"ip:port\"); default: N ranks on loopback" },
      ...LOAD_FLAGS,
    },
    run: serve,
    relaunch: true,
  },
  follow: {
    usage: 'mlx-lfm follow --model DIR [--backend NAME] [options]',
    about:
      'A rank other than 0 of `serve --tensor-parallel N` (serve starts the local ones itself): joins the group that ' +
      'MLX_HOSTFILE and MLX_RANK describe, loads its shard and runs what rank 0 announces until rank 0 stops.',
    flags: {
      ...MODEL_FLAG,
      backend: { arg: 'NAME', choices: ['ring', 'nccl', 'jaccl', 'any'], help: 'MLX distributed backend (default ring)' },
      ...LOAD_FLAGS,
    },
    run: follow,
    relaunch: true,
  },
  convert: {
    usage: 'mlx-lfm convert --model DIR --out DIR [-q] [--q-mode MODE] [--q-bits N] [--q-group-size N] [--dtype DTYPE] [--q-override RULE ...]',
    about:
      'Writes an MLX-layout checkpoint (as mlx_lm.convert does) into a new or empty --out. Quantizes when -q or any ' +
      '--q-* flag is given (mode affine by default; bits and group size default per mode). A rule is ' +
      'PATH=BITS[:GROUP[:MODE]] or PATH=skip; PATH matches module paths (`*` is a wildcard; `feed_forward.gate` ' +
      'names every router); the last matching rule wins.',
    flags: {
      ...MODEL_FLAG,
      out: { arg: 'DIR', help: 'where to write it (new or empty)' },
      quantize: { boolean: true, short: 'q', help: 'quantize (affine 4-bit, group 64 unless said)' },
      'q-mode': { arg: 'MODE', choices: ['affine', 'mxfp4', 'mxfp8', 'nvfp4'], help: 'quantization mode' },
      'q-bits': { arg: 'N', int: true, help: 'bits per weight' },
      'q-group-size': { arg: 'N', int: true, help: 'weights per scale' },
      dtype: { arg: 'DTYPE', choices: ['float32', 'float16', 'bfloat16'], help: 'cast unquantized float weights' },
      'q-override': { arg: 'RULE', multiple: true, help: 'per-module rule (repeatable)' },
    },
    run: convert,
  },
  bench: {
    usage: 'mlx-lfm bench --model DIR [--prompt-tokens 512] [--gen 128] [--reps 1] [options]',
    about:
      'Measures prefill and decode speed: after a short warm-up, runs a prompt of --prompt-tokens tokens and ' +
      'generates --gen tokens (end-of-sequence ignored), --reps times, and prints tok/s from the results\' metrics ' +
      '(the median over reps).',
    flags: {
      ...MODEL_FLAG,
      'prompt-tokens': { arg: 'N', int: true, help: 'prompt length in tokens (default 512)' },
      gen: { arg: 'N', int: true, help: 'tokens to generate (default 128)' },
      reps: { arg: 'N', int: true, help: 'measured runs (default 1)' },
      ...LOAD_FLAGS,
    },
    run: bench,
    relaunch: true,
  },
  allocator: {
    usage: 'mlx-lfm allocator [-h]',
    about:
      'Prints the allocator library the commands that run a model preload on Linux (mimalloc, shipped with the ' +
      'native package: MLX\'s host work per token is allocation-heavy), for a program of your own: ' +
      'LD_PRELOAD="$(npx mlx-lfm allocator)" node app.js. Fails with the reason where there is none. ' +
      'MLX_LFM_ALLOCATOR=system keeps the C library\'s malloc; MLX_LFM_ALLOCATOR=PATH preloads that library instead.',
    flags: {},
    run: allocatorPath,
    addon: false,
  },
};

const HELP_FLAG = { help: { boolean: true, short: 'h', help: 'show this help' } };

function usage() {
  const lines = [`mlx-lfm ${pkg.version}: run LFM2 models on MLX`, '', 'usage:'];
  for (const c of Object.values(COMMANDS)) lines.push(`  ${c.usage}`);
  lines.push('  mlx-lfm --version', '', 'mlx-lfm COMMAND --help lists the flags of a command.');
  return lines.join('\n');
}

function wrap(text, width, indent) {
  const out = [];
  let line = '';
  for (const word of text.split(/\s+/)) {
    if (line && line.length + 1 + word.length > width) {
      out.push(line);
      line = word;
    } else {
      line = line ? `${line} ${word}` : word;
    }
  }
  if (line) out.push(line);
  return out.join(`\n${' '.repeat(indent)}`);
}

function commandHelp(name) {
  const c = COMMANDS[name];
  const flags = { ...c.flags, ...HELP_FLAG };
  const left = (n, f) => `${f.short ? `-${f.short}, ` : '    '}--${n}${f.arg ? ` ${f.arg}` : ''}`;
  const width = Math.max(...Object.entries(flags).map(([n, f]) => left(n, f).length)) + 2;
  const lines = [`usage: ${c.usage}`, '', wrap(c.about, 78, 0), '', 'flags:'];
  for (const [n, f] of Object.entries(flags)) {
    const choices = f.choices ? ` [${f.choices.join(', ')}]` : '';
    lines.push(`  ${left(n, f).padEnd(width)}${wrap(f.help + choices, 76 - width, width + 2)}`);
  }
  return lines.join('\n');
}

function fail(msg) {
  console.error(`mlx-lfm: ${msg}`);
  process.exit(1);
}

// Levenshtein distance, for "did you mean".
function distance(a, b) {
  const row = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    let diag = row[0];
    row[0] = i;
    for (let j = 1; j <= b.length; j++) {
      const next = Math.min(diag + (a[i - 1] === b[j - 1] ? 0 : 1), row[j] + 1, row[j - 1] + 1);
      diag = row[j];
      row[j] = next;
    }
  }
  return row[b.length];
}

function closest(word, candidates) {
  let best = null;
  let bestD = Infinity;
  for (const c of candidates) {
    const d = distance(word, c);
    if (d < bestD) [best, bestD] = [c, d];
  }
  // About one edit in three characters: a typo, not another word.
  return bestD <= 1 + Math.floor(word.length / 3) ? best : null;
}

/** `argv` checked against the command's flags; values are strings, booleans or arrays of strings. */
function parseFlags(cmd, argv) {
  const flags = { ...COMMANDS[cmd].flags, ...HELP_FLAG };
  const shorts = Object.fromEntries(Object.entries(flags).filter(([, f]) => f.short).map(([n, f]) => [f.short, n]));
  const values = {};
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    let name;
    let value;
    if (a.startsWith('--')) {
      const eq = a.indexOf('=');
      [name, value] = eq < 0 ? [a.slice(2), undefined] : [a.slice(2, eq), a.slice(eq + 1)];
    } else if (/^-[A-Za-z]$/.test(a) && shorts[a[1]]) {
      name = shorts[a[1]];
    } else if (a.startsWith('-')) {
      name = a.replace(/^-+/, '');
    } else {
      fail(`unexpected argument \`${a}\` for ${cmd}: values go after their flag (see mlx-lfm ${cmd} --help)`);
    }
    const f = flags[name];
    if (!f) {
      const near = closest(name, Object.keys(flags));
      const hint = near ? ` (did you mean --${near}?)` : `; see mlx-lfm ${cmd} --help`;
      fail(`unknown flag ${a.split('=')[0]} for ${cmd}${hint}`);
    }
    if (f.boolean) {
      if (value !== undefined) fail(`--${name} takes no value`);
      values[name] = true;
      continue;
    }
    if (value === undefined) {
      if (i + 1 >= argv.length) fail(`--${name} needs a value (${f.arg})`);
      value = argv[++i];
    }
    if (f.choices && !f.choices.includes(value)) {
      fail(`--${name} must be one of ${f.choices.join(', ')}; got \`${value}\``);
    }
    if (f.int || f.num) {
      const n = Number(value);
      if (value.trim() === '' || !Number.isFinite(n) || (f.int && !Number.isInteger(n))) {
        fail(`--${name} must be a${f.int ? 'n integer' : ' number'}, got ${value}`);
      }
      value = n;
    }
    if (f.multiple) (values[name] ??= []).push(value);
    else values[name] = value;
  }
  if (values.paged && values['no-paged']) fail('--paged and --no-paged contradict each other; give one');
  return values;
}

function cacheDir() {
  const base = process.env.XDG_CACHE_HOME || path.join(os.homedir(), '.cache');
  return path.join(base, 'mlx-lfm');
}

async function demoModel(addon) {
  // Versioned, so a newer generator never reuses an older demo model.
  const dir = path.join(cacheDir(), `tiny-demo-${pkg.version}-${addon.mlxInfo().version}`);
  if (!fs.existsSync(path.join(dir, 'config.json'))) await addon.generateFixture(dir, { preset: 'tiny', dtype: 'f32' });
  console.error(`mlx-lfm: no --model given; using a tiny generated model with random weights at ${dir}`);
  console.error('         (its replies are gibberish; pass --model DIR for a real LFM2 checkpoint)');
  return dir;
}

const MB = (b) => (b / 1e6).toFixed(1);

/**
 * Shows a load's progress on stderr: a bar redrawn in place on a terminal,
 * otherwise a line per tenth (logs and pipes get no carriage returns).
 */
function progressReporter() {
  const tty = process.stderr.isTTY;
  const start = Date.now();
  let lastTenth = -1;
  let lastDraw = 0;
  return (p) => {
    const frac = p.totalBytes > 0 ? p.loadedBytes / p.totalBytes : 1;
    if (p.phase === 'ready') {
      if (tty) process.stderr.write('\r\x1b[K');
      console.error(`mlx-lfm: loaded ${MB(p.totalBytes)} MB of weights in ${((Date.now() - start) / 1000).toFixed(1)} s`);
      return;
    }
    if (tty) {
      // Redrawing costs a write; a few per second is enough for the eye.
      const now = Date.now();
      if (now - lastDraw < 100 && frac < 1) return;
      lastDraw = now;
      const width = 30;
      const filled = Math.round(frac * width);
      process.stderr.write(
        `\rloading weights [${'#'.repeat(filled)}${'.'.repeat(width - filled)}] ${String(Math.floor(frac * 100)).padStart(3)}% ` +
          `${MB(p.loadedBytes)}/${MB(p.totalBytes)} MB`,
      );
      return;
    }
    const tenth = Math.floor(frac * 10);
    if (tenth > lastTenth) {
      lastTenth = tenth;
      console.error(`mlx-lfm: loading weights ${tenth * 10}% (${MB(p.loadedBytes)} of ${MB(p.totalBytes)} MB)`);
    }
  };
}

async function load(addon, dir, v, distributed) {
  const opts = {
    distributed,
    dtype: v.dtype,
    kvCache: v['kv-cache'],
    decodePath: v['decode-path'],
    useBlockPagedCache: v.paged ? true : v['no-paged'] ? false : undefined,
    device: v.device,
    contextLength: v['context-length'],
    prefixCacheDir: v['prefix-cache-dir'],
    prefixCacheDiskMb: v['prefix-cache-disk-mb'],
    onProgress: progressReporter(),
  };
  for (const k of Object.keys(opts)) if (opts[k] === undefined) delete opts[k];
  return addon.Lfm2Model.load(dir, opts);
}

function printMetrics(r) {
  const m = r.metrics;
  console.error(
    `[${r.finishReason}] prompt ${r.usage.promptTokens} tok` +
      (m.cachedTokens > 0 ? ` (${m.cachedTokens} cached, ${m.prefillTokens} run)` : '') +
      `, completion ${r.usage.completionTokens} tok | ` +
      `TTFT ${m.ttftMs.toFixed(1)} ms | prefill ${m.prefillTokensPerSecond.toFixed(1)} tok/s | ` +
      `decode ${m.decodeTokensPerSecond.toFixed(1)} tok/s | total ${m.totalMs.toFixed(1)} ms`,
  );
}

async function chat(addon, v) {
  const opts = {
    maxTokens: v['max-tokens'] ?? 256,
    temperature: v.temperature,
    topP: v['top-p'],
    topK: v['top-k'],
    minP: v['min-p'],
    seed: v.seed,
    repetitionPenalty: v['repetition-penalty'],
  };
  for (const k of Object.keys(opts)) if (opts[k] === undefined) delete opts[k];
  const dir = v.model ?? (await demoModel(addon));
  const model = await load(addon, dir, v);
  const history = v.system ? [{ role: 'system', content: v.system }] : [];
  const ask = async (text) => {
    history.push({ role: 'user', content: text });
    const stream = model.chatStream(history, opts);
    for await (const ev of stream) {
      if (ev.type === 'text') process.stdout.write(ev.text);
    }
    const r = await stream.result();
    process.stdout.write('\n');
    history.push({ role: 'assistant', content: r.text });
    printMetrics(r);
  };
  if (v.prompt !== undefined) {
    await ask(v.prompt);
  } else {
    const i = model.info();
    console.error(`mlx-lfm: ${i.modelType} (${i.dtype}, ${i.backend}); empty line or Ctrl-D to quit`);
    const rl = readline.createInterface({ input: process.stdin, output: process.stderr, terminal: process.stdin.isTTY });
    rl.setPrompt('> ');
    rl.prompt();
    for await (const line of rl) {
      if (!line.trim()) break;
      await ask(line);
      rl.prompt();
    }
    rl.close();
  }
  model.close();
}

async function info(addon, v) {
  if (!v.model) fail('info needs --model DIR');
  const model = await load(addon, v.model, v);
  console.log(JSON.stringify({ mlx: addon.mlxInfo(), model: model.info() }, null, 2));
  model.close();
}

function allocatorPath() {
  const { preloadPath } = require('./lib/allocator.cjs');
  const p = preloadPath();
  if (!p.path) fail(`no allocator to preload: ${p.reason}`);
  console.log(p.path);
}

async function fixture(addon, v) {
  if (!v.out) fail('fixture needs --out DIR');
  await addon.generateFixture(v.out, { preset: v.preset, dtype: v.dtype, layout: v.layout, seed: v.seed });
  console.log(`wrote ${v.out}`);
}

async function convert(addon, v) {
  if (!v.model || !v.out) fail('convert needs --model DIR and --out DIR');
  const opts = { dtype: v.dtype, overrides: v['q-override'] };
  if (v.quantize || v['q-mode'] || v['q-bits'] || v['q-group-size']) {
    opts.mode = v['q-mode'] ?? 'affine';
    opts.bits = v['q-bits'];
    opts.groupSize = v['q-group-size'];
  } else if (v['q-override']) {
    fail('--q-override needs quantization: give -q or --q-mode/--q-bits/--q-group-size');
  }
  for (const k of Object.keys(opts)) if (opts[k] === undefined) delete opts[k];
  const r = await addon.convert(v.model, v.out, opts);
  const formats = r.quantization.map((q) => `${q.mode} ${q.bits}-bit group ${q.groupSize} x${q.projections}`);
  console.log(`wrote ${r.outDir}: ${r.modelType} (${r.sourceLayout} layout in), ${r.tensors} tensors, ` +
    `${(r.weightBytes / 1e6).toFixed(1)} MB, ${r.bitsPerWeight.toFixed(3)} bits per weight`);
  console.log(`  float dtype: ${r.dtype}; quantized: ${formats.length ? formats.join(', ') : 'nothing'}`);
  for (const u of r.unquantized) if (r.globalQuantization) console.log(`  not quantized: ${u.path} (${u.reason})`);
}

async function serve(addon, v) {
  const { listen, isLoopback } = require('./lib/server.cjs');
  const host = v.host ?? '127.0.0.1';
  const apiKey = v['api-key'] ?? process.env.MLX_LFM_API_KEY ?? null;
  // Before anything loads: an exposed server without a key is refused.
  if (!isLoopback(host) && !apiKey) {
    fail(`refusing to listen on ${host} without an API key: pass --api-key KEY or set MLX_LFM_API_KEY (or listen on 127.0.0.1)`);
  }
  const maxPromptTokens = v['max-prompt-tokens'] ?? null;
  if (maxPromptTokens !== null && maxPromptTokens < 1) fail('--max-prompt-tokens must be at least 1');
  const dir = v.model ?? (await demoModel(addon));
  const tp = v['tensor-parallel'] ?? 1;
  if (tp < 1) fail('--tensor-parallel must be at least 1');
  const ranks = tp > 1 ? await startRanks(dir, v, tp) : null;
  const model = await load(addon, dir, v, tp > 1 ? v.backend ?? 'ring' : undefined).catch((e) => {
    ranks?.stop();
    throw e;
  });
  const modelId = v.name ?? path.basename(path.resolve(dir));
  const port = v.port ?? 8080;
  // Build the kernels concurrent requests need before the first client waits.
  const warm = await model.warmUp();
  if (warm != null) console.error(`mlx-lfm: warmed up in ${(warm / 1000).toFixed(1)} s`);
  const options = { model, modelId, apiKey: apiKey || null, cors: v.cors ?? null, maxPromptTokens, log: (m) => console.error(`mlx-lfm: ${m}`) };
  const { server, url } = await listen(options, { port, host }).catch((e) => {
    model.close();
    fail(e.message);
  });
  const i = model.info();
  console.error(`mlx-lfm: ${i.modelType} ${i.dtype} on ${i.backend}: ${i.decodePath} decode, ${i.cacheKind} cache, ${i.kvCache} KV`);
  if (tp > 1) console.error(`mlx-lfm: tensor parallel over ${i.worldSize} ranks (${v.backend ?? 'ring'}); this is rank ${i.rank}`);
  console.error(`mlx-lfm: serving ${modelId} at ${url} (Ctrl-C stops)`);
  const stop = () => {
    server.close();
    server.closeAllConnections?.();
    model.close();
  };
  // A rank that ends while serving leaves a group that cannot compute:
  // stop rather than answer with a broken model.
  ranks?.onExit((r, code) => {
    console.error(`mlx-lfm: rank ${r} exited (${code}) while serving; stopping`);
    stop();
    process.exitCode = 1;
  });
  process.once('SIGINT', stop);
  process.once('SIGTERM', stop);
}

/** A TCP port on loopback that the OS hands out free now. */
function freePort() {
  const net = require('node:net');
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.once('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

/** MLX's hostfile for `serve --tensor-parallel N`: the given one, or N ports on loopback. */
async function hostfileFor(v, n) {
  if (v.hostfile) {
    let hosts;
    try {
      hosts = JSON.parse(fs.readFileSync(v.hostfile, 'utf8'));
    } catch (e) {
      fail(`--hostfile ${v.hostfile}: ${e.message}`);
    }
    if (!Array.isArray(hosts) || hosts.length !== n) fail(`--hostfile ${v.hostfile} must list ${n} ranks (one array of "ip:port" per rank)`);
    return { file: path.resolve(v.hostfile), hosts };
  }
  const os = require('node:os');
  const hosts = [];
  // Ports the OS hands out free now; MLX binds them when the ranks start.
  for (let r = 0; r < n; r++) hosts.push([`127.0.0.1:${await freePort()}`]);
  const file = path.join(os.tmpdir(), `mlx-lfm-hosts-${process.pid}.json`);
  fs.writeFileSync(file, JSON.stringify(hosts));
  process.once('exit', () => fs.rmSync(file, { force: true }));
  return { file, hosts };
}

/** Starts ranks 1..n-1 of a tensor-parallel serve: `mlx-lfm follow` on this machine for loopback hosts, over ssh for the others. */
async function startRanks(dir, v, n) {
  const { spawn } = require('node:child_process');
  const { file, hosts } = await hostfileFor(v, n);
  process.env.MLX_HOSTFILE = file;
  process.env.MLX_RANK = '0';
  const args = [__filename, 'follow', '--model', dir, '--backend', v.backend ?? 'ring'];
  for (const k of ['dtype', 'kv-cache', 'decode-path', 'device', 'context-length']) if (v[k] !== undefined) args.push(`--${k}`, String(v[k]));
  if (v.paged) args.push('--paged');
  if (v['no-paged']) args.push('--no-paged');
  const children = [];
  let onExit = () => {};
  let stopping = false;
  for (let r = 1; r < n; r++) {
    const local = hosts[r].every((h) => /^(127\.\d+\.\d+\.\d+|localhost|\[::1\]):\d+$/.test(h));
    const child = local
      ? spawn(process.execPath, args, { env: { ...process.env, MLX_RANK: String(r) }, stdio: ['ignore', 'inherit', 'inherit'] })
      : spawnOverSsh(spawn, hosts, r, args);
    child.on('exit', (code, signal) => {
      if (!stopping && (code !== 0 || signal)) onExit(r, signal ?? code);
    });
    children.push(child);
  }
  process.once('exit', () => children.forEach((c) => c.exitCode === null && c.kill()));
  return {
    onExit: (f) => (onExit = f),
    stop: () => {
      stopping = true;
      children.forEach((c) => c.kill());
    },
  };
}

/**
 * A rank on another machine, started as mlx.launch starts them: over ssh
 * (`MLX_LFM_SSH`, default `ssh`; its options belong in ~/.ssh/config), with
 * the same node, the same mlx-lfm and the checkpoint at the same path there.
 * The hostfile travels inside the command (written to the remote /tmp) so
 * nothing needs copying first.
 */
function spawnOverSsh(spawn, hosts, r, args) {
  const host = String(hosts[r][0]).replace(/:\d+$/, '').replace(/^\[(.*)\]$/, '$1');
  const q = (x) => `'${String(x).replace(/'/g, `'\\''`)}'`;
  const remoteFile = `/tmp/mlx-lfm-hosts-${process.pid}-${r}.json`;
  const cmd =
    `printf %s ${q(JSON.stringify(hosts))} > ${q(remoteFile)} && ` +
    `MLX_HOSTFILE=${q(remoteFile)} MLX_RANK=${r} exec ${[process.execPath, ...args].map(q).join(' ')}`;
  const ssh = process.env.MLX_LFM_SSH || 'ssh';
  console.error(`mlx-lfm: starting rank ${r} on ${host} over ${ssh}`);
  const child = spawn(ssh, [host, cmd], { stdio: ['ignore', 'inherit', 'inherit'] });
  child.on('error', (e) => console.error(`mlx-lfm: could not start rank ${r} on ${host} (${ssh}): ${e.message}`));
  return child;
}

async function follow(addon, v) {
  if (!v.model) fail('follow needs --model DIR');
  if (process.env.MLX_RANK === undefined) fail('follow runs as a rank of `serve --tensor-parallel N`: MLX_RANK and MLX_HOSTFILE must be set');
  const model = await load(addon, v.model, v, v.backend ?? 'ring');
  await model.follow();
  model.close();
}

function median(xs) {
  const s = [...xs].sort((a, b) => a - b);
  return s.length % 2 ? s[(s.length - 1) / 2] : (s[s.length / 2 - 1] + s[s.length / 2]) / 2;
}

async function bench(addon, v) {
  if (!v.model) fail('bench needs --model DIR');
  const promptTokens = v['prompt-tokens'] ?? 512;
  const gen = v.gen ?? 128;
  const reps = v.reps ?? 1;
  for (const [flag, n] of [['prompt-tokens', promptTokens], ['gen', gen], ['reps', reps]]) {
    if (n < 1) fail(`--${flag} must be at least 1, got ${n}`);
  }
  const model = await load(addon, v.model, v);
  const i = model.info();
  if (promptTokens + gen > i.contextLength) {
    model.close();
    fail(`--prompt-tokens ${promptTokens} plus --gen ${gen} exceed the model's context length (${i.contextLength})`);
  }
  console.error(`mlx-lfm: ${i.modelType} ${i.dtype} on ${i.backend} (${i.decodePath} decode, ${i.cacheKind} cache)`);
  // Token ids, not text, so the prompt is exactly N tokens; each run starts
  // differently so none reuses another's prefix from the cache.
  const prompt = (run) => Array.from({ length: promptTokens }, (_, k) => (run * 7919 + k * 104729 + 17) % i.vocabSize);
  const opts = { maxTokens: gen, ignoreEos: true };
  console.error('mlx-lfm: warming up (building kernels)');
  const warm = await model.warmUp();
  if (warm != null) console.error(`mlx-lfm: warmed up in ${(warm / 1000).toFixed(1)} s`);
  // One unmeasured run of the measured shape: on CUDA, MLX compiles kernels
  // per shape the first time it meets one (seen on the H200: the first
  // 512-token prefill ran at 1.3k tok/s, the next at 65-92k), which would
  // otherwise land in the first measured run.
  console.error(`mlx-lfm: warm run: prefill ${promptTokens} tokens, decode ${gen} (not measured)`);
  await model.generate(prompt(0), opts);
  const runs = [];
  for (let run = 1; run <= reps; run++) {
    console.error(`mlx-lfm: run ${run}/${reps}: prefill ${promptTokens} tokens, decode ${gen}`);
    const r = await model.generate(prompt(run), opts);
    const m = r.metrics;
    console.error(
      `mlx-lfm: run ${run}/${reps}: prefill ${m.prefillTokensPerSecond.toFixed(1)} tok/s, ` +
        `decode ${m.decodeTokensPerSecond.toFixed(1)} tok/s, TTFT ${m.ttftMs.toFixed(1)} ms`,
    );
    runs.push(m);
  }
  model.close();
  const of = (k) => median(runs.map((m) => m[k]));
  console.log(`prefill: ${of('prefillTokensPerSecond').toFixed(1)} tok/s (${promptTokens} tokens, ${of('prefillMs').toFixed(1)} ms)`);
  console.log(`decode: ${of('decodeTokensPerSecond').toFixed(1)} tok/s (${gen} tokens, ${of('decodeMs').toFixed(1)} ms)`);
  console.log(`ttft: ${of('ttftMs').toFixed(1)} ms`);
}

function version() {
  let mlx;
  try {
    const m = require('./main.cjs').mlxInfo();
    mlx = `MLX ${m.version}, ${m.backend} backend, default device ${m.defaultDevice}, native package: ${m.binding}`;
  } catch (e) {
    mlx = `native addon not loaded: ${e.message.split('\n')[0]}`;
  }
  console.log(`mlx-lfm ${pkg.version} (${mlx})`);
}

async function main() {
  const [cmd, ...argv] = process.argv.slice(2);
  if (!cmd || cmd === '--help' || cmd === '-h' || (cmd === 'help' && !argv.length)) {
    console.log(usage());
    return;
  }
  if (cmd === '--version' || cmd === '-V' || cmd === 'version') return version();
  if (cmd === 'help') {
    if (!COMMANDS[argv[0]]) fail(`unknown command ${argv[0]}\n${usage()}`);
    console.log(commandHelp(argv[0]));
    return;
  }
  if (!COMMANDS[cmd]) {
    const near = cmd.startsWith('-') ? closest(cmd.replace(/^-+/, ''), ['help', 'version']) : closest(cmd, Object.keys(COMMANDS));
    const hint = near ? ` (did you mean ${cmd.startsWith('-') ? '--' : ''}${near}?)` : '';
    fail(`unknown command ${cmd}${hint}\n${usage()}`);
  }
  const values = parseFlags(cmd, argv);
  if (values.help) {
    console.log(commandHelp(cmd));
    return;
  }
  if (COMMANDS[cmd].relaunch) {
    // Once, before the model loads: this command again in this process,
    // under the allocator (lib/allocator.cjs says why).
    try {
      require('./lib/allocator.cjs').execUnder();
    } catch (e) {
      fail(e.message);
    }
  }
  await COMMANDS[cmd].run(COMMANDS[cmd].addon === false ? null : require('./main.cjs'), values);
}

main().catch((e) => fail(e.message));
