#!/usr/bin/env node
// mlx-lfm command line: chat with a model, inspect it, or generate a test checkpoint.
'use strict';
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const readline = require('node:readline');
const { parseArgs } = require('node:util');

const USAGE = `usage:
  mlx-lfm chat [--model DIR] [--prompt TEXT] [--system TEXT] [--max-tokens N]
               [--temperature T] [--top-p P] [--top-k K] [--min-p P] [--seed S]
               [--repetition-penalty R]
      One prompt with --prompt, otherwise an interactive chat (empty line or
      Ctrl-D ends it). Without --model, a tiny random-weight model is generated
      and used (it answers gibberish; it shows the pipeline works).
  mlx-lfm info --model DIR
  mlx-lfm fixture --out DIR [--preset tiny|tiny-moe|lfm2-350m|lfm2-1.2b|lfm2-8b-a1b]
               [--dtype f32|bf16|f16] [--layout hf|mlx] [--seed N]
  mlx-lfm convert --model DIR --out DIR [-q] [--q-mode affine|mxfp4|mxfp8|nvfp4]
               [--q-bits N] [--q-group-size N] [--dtype float32|bfloat16|float16]
               [--q-override PATH=BITS[:GROUP[:MODE]] | --q-override PATH=skip ...]
      Writes an MLX-layout checkpoint (as mlx_lm.convert does) into a new or
      empty --out. Quantizes when -q or any --q-* option is given (mode
      affine by default; bits and group size default per mode). PATH matches
      module paths (\`*\` is a wildcard; \`feed_forward.gate\` names every
      router); the last matching --q-override wins.
  mlx-lfm serve [--model DIR] [--port N] [--host 127.0.0.1] [--name ID]
               [--api-key KEY] [--cors ORIGIN] [--max-prompt-tokens N]
      OpenAI-compatible HTTP server: POST /v1/chat/completions, POST
      /v1/completions (both with "stream": true too), GET /v1/models, GET
      /health. --name is the model id clients send (default: the model
      directory's name). Port 8080 unless given; 0 picks a free one. With
      --api-key (or MLX_LFM_API_KEY) every route but /health needs
      "Authorization: Bearer KEY"; a --host other than loopback needs one.
      --cors ORIGIN sends CORS headers for that origin (none otherwise).
      A request whose prompt has more than --max-prompt-tokens tokens
      (default: the model's context length) is a 400 before any compute.`;

function fail(msg) {
  console.error(`mlx-lfm: ${msg}`);
  process.exit(1);
}

function num(v, name, integer = false) {
  if (v === undefined) return undefined;
  const n = Number(v);
  if (!Number.isFinite(n) || (integer && !Number.isInteger(n))) fail(`--${name} must be a${integer ? 'n integer' : ' number'}, got ${v}`);
  return n;
}

function cacheDir() {
  const base = process.env.XDG_CACHE_HOME || path.join(os.homedir(), '.cache');
  return path.join(base, 'mlx-lfm');
}

async function demoModel(addon) {
  // Versioned, so a newer generator never reuses an older demo model.
  const dir = path.join(cacheDir(), `tiny-demo-${require('./package.json').version}-${addon.mlxInfo().version}`);
  if (!fs.existsSync(path.join(dir, 'config.json'))) await addon.generateFixture(dir, { preset: 'tiny', dtype: 'f32' });
  console.error(`mlx-lfm: no --model given; using a tiny generated model with random weights at ${dir}`);
  console.error('         (its replies are gibberish; pass --model DIR for a real LFM2 checkpoint)');
  return dir;
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
    maxTokens: num(v['max-tokens'], 'max-tokens', true) ?? 256,
    temperature: num(v.temperature, 'temperature'),
    topP: num(v['top-p'], 'top-p'),
    topK: num(v['top-k'], 'top-k', true),
    minP: num(v['min-p'], 'min-p'),
    seed: num(v.seed, 'seed', true),
    repetitionPenalty: num(v['repetition-penalty'], 'repetition-penalty'),
  };
  for (const k of Object.keys(opts)) if (opts[k] === undefined) delete opts[k];
  const dir = v.model ?? (await demoModel(addon));
  const model = await addon.Lfm2Model.load(dir);
  const history = v.system ? [{ role: 'system', content: v.system }] : [];
  const ask = async (text) => {
    history.push({ role: 'user', content: text });
    const r = await model.chat(history, opts);
    history.push({ role: 'assistant', content: r.text });
    console.log(r.text);
    printMetrics(r);
  };
  if (v.prompt !== undefined) {
    await ask(v.prompt);
  } else {
    const info = model.info();
    console.error(`mlx-lfm: ${info.modelType} (${info.dtype}, ${info.backend}); empty line or Ctrl-D to quit`);
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

async function convert(addon, v) {
  if (!v.model || !v.out) fail('convert needs --model DIR and --out DIR');
  const opts = { dtype: v.dtype, overrides: v['q-override'] };
  if (v.quantize || v['q-mode'] || v['q-bits'] || v['q-group-size']) {
    opts.mode = v['q-mode'] ?? 'affine';
    opts.bits = num(v['q-bits'], 'q-bits', true);
    opts.groupSize = num(v['q-group-size'], 'q-group-size', true);
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
  const dir = v.model ?? (await demoModel(addon));
  const model = await addon.Lfm2Model.load(dir);
  const modelId = v.name ?? path.basename(path.resolve(dir));
  const port = num(v.port, 'port', true) ?? 8080;
  const maxPromptTokens = num(v['max-prompt-tokens'], 'max-prompt-tokens', true) ?? null;
  if (maxPromptTokens !== null && maxPromptTokens < 1) fail('--max-prompt-tokens must be at least 1');
  // Build the kernels concurrent requests need before the first client waits.
  const warm = await model.warmUp();
  if (warm != null) console.error(`mlx-lfm: warmed up in ${(warm / 1000).toFixed(1)} s`);
  const options = { model, modelId, apiKey: apiKey || null, cors: v.cors ?? null, maxPromptTokens, log: (m) => console.error(`mlx-lfm: ${m}`) };
  const { server, url } = await listen(options, { port, host }).catch((e) => {
    model.close();
    fail(e.message);
  });
  console.error(`mlx-lfm: serving ${modelId} at ${url} (Ctrl-C stops)`);
  const stop = () => {
    server.close();
    server.closeAllConnections?.();
    model.close();
  };
  process.once('SIGINT', stop);
  process.once('SIGTERM', stop);
}

async function main() {
  const [cmd, ...argv] = process.argv.slice(2);
  if (!cmd || cmd === '--help' || cmd === '-h') {
    console.log(USAGE);
    return;
  }
  let parsed;
  try {
    parsed = parseArgs({
      args: argv,
      options: {
        model: { type: 'string' }, prompt: { type: 'string' }, system: { type: 'string' },
        'max-tokens': { type: 'string' }, temperature: { type: 'string' }, 'top-p': { type: 'string' },
        'top-k': { type: 'string' }, 'min-p': { type: 'string' }, seed: { type: 'string' },
        'repetition-penalty': { type: 'string' }, out: { type: 'string' }, preset: { type: 'string' },
        dtype: { type: 'string' }, layout: { type: 'string' },
        quantize: { type: 'boolean', short: 'q' }, 'q-mode': { type: 'string' }, 'q-bits': { type: 'string' },
        'q-group-size': { type: 'string' }, 'q-override': { type: 'string', multiple: true },
        port: { type: 'string' }, host: { type: 'string' }, name: { type: 'string' },
        'api-key': { type: 'string' }, cors: { type: 'string' }, 'max-prompt-tokens': { type: 'string' },
      },
    });
  } catch (e) {
    fail(`${e.message}\n${USAGE}`);
  }
  const v = parsed.values;
  const addon = require('./index.cjs');
  if (cmd === 'chat') {
    await chat(addon, v);
  } else if (cmd === 'info') {
    if (!v.model) fail('info needs --model DIR');
    const model = await addon.Lfm2Model.load(v.model);
    console.log(JSON.stringify({ mlx: addon.mlxInfo(), model: model.info() }, null, 2));
    model.close();
  } else if (cmd === 'fixture') {
    if (!v.out) fail('fixture needs --out DIR');
    await addon.generateFixture(v.out, { preset: v.preset, dtype: v.dtype, layout: v.layout, seed: num(v.seed, 'seed', true) });
    console.log(`wrote ${v.out}`);
  } else if (cmd === 'convert') {
    await convert(addon, v);
  } else if (cmd === 'serve') {
    await serve(addon, v);
  } else {
    fail(`unknown command ${cmd}\n${USAGE}`);
  }
}

main().catch((e) => fail(e.message));
