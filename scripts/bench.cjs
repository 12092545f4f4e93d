#!/usr/bin/env node
// `npm run bench`: mlx-lfm against mlx-lm on the same checkpoint, in the same run.
//
// For each prompt length P (default 512 and 2048) both runtimes generate G
// tokens (default 128) greedily from the same random prompt token ids, with
// end-of-sequence ignored so every run decodes exactly G tokens. Figures, the
// same definition for both:
//   TTFT          time from the generate call to the first token (read back)
//   prefill tok/s P / TTFT
//   decode tok/s  (G - 1) / (time of the last token - time of the first token)
// mlx-lfm: Lfm2Model.generate(ids, { maxTokens: G, ignoreEos: true }) and its
// metrics (timed inside the engine, from the call reaching the model).
// mlx-lm: its own generate_step() (what generate()/stream_generate() run),
// timed in Python around the generator (scripts/ref/mlx_lm_ref.py bench_suite).
// Both load the checkpoint as stored, use a prefill chunk of 2048 (mlx-lm's
// default), run one warm-up generation first, then N measured repetitions per
// prompt length; the best repetition of each figure is reported.
'use strict';
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { spawn } = require('node:child_process');

const root = path.resolve(__dirname, '..');

const USAGE = `usage: npm run bench -- [options]     (or: node scripts/bench.cjs [options])

  --model DIR          checkpoint to measure (else a generated random-weight one)
  --preset NAME        generated checkpoint's shape (default lfm2-350m; also tiny,
                       tiny-moe, lfm2-1.2b, lfm2-8b-a1b)
  --dtype bf16|f16|f32 generated checkpoint's dtype (default bf16)
  --prompts 512,2048   prompt lengths in tokens
  --gen 128            tokens generated per run (EOS ignored)
  --reps N             measured repetitions per prompt length, best one kept (default 1)
  --warmup P,G         warm-up generation: P prompt tokens, G generated (default 128,16)
  --seed N             seed of the random prompt token ids (default 0)
  --json FILE          also write every run and the table as JSON
  --skip-ref           measure mlx-lfm only
  --regen              regenerate the cached checkpoint
  --help

Generated checkpoints are cached in $MLX_LFM_BENCH_CACHE or ~/.cache/mlx-lfm/bench/<preset>-<dtype>.
mlx-lm comes from $MLX_LFM_PYREF (a pip --target folder; \`npm run bench\` installs it in .pyref/),
run with $MLX_LFM_PYTHON or python3.`;

function die(msg) {
  console.error(`bench: ${msg}`);
  process.exit(2);
}

function parseArgs(argv) {
  const o = {
    model: null,
    preset: 'lfm2-350m',
    dtype: 'bf16',
    prompts: [512, 2048],
    gen: 128,
    reps: 1,
    warmup: [128, 16],
    seed: 0,
    json: null,
    skipRef: false,
    regen: false,
    dtypeGiven: false,
  };
  const ints = (v, name) => {
    const xs = String(v).split(',').map((s) => Number(s.trim()));
    if (!xs.length || xs.some((x) => !Number.isInteger(x) || x < 1)) die(`${name} wants positive integers, got "${v}"`);
    return xs;
  };
  for (let i = 0; i < argv.length; i++) {
    let a = argv[i];
    let val = null;
    const eq = a.indexOf('=');
    if (a.startsWith('--') && eq > 0) {
      val = a.slice(eq + 1);
      a = a.slice(0, eq);
    }
    const next = () => {
      if (val !== null) return val;
      if (i + 1 >= argv.length) die(`${a} needs a value`);
      return argv[++i];
    };
    switch (a) {
      case '--model': o.model = path.resolve(next()); break;
      case '--preset': o.preset = next(); break;
      case '--dtype': {
        const d = next().toLowerCase();
        const map = { bf16: 'bf16', bfloat16: 'bf16', f16: 'f16', float16: 'f16', f32: 'f32', float32: 'f32' };
        if (!map[d]) die(`--dtype must be bf16, f16 or f32, got "${d}"`);
        o.dtype = map[d];
        o.dtypeGiven = true;
        break;
      }
      case '--prompts': o.prompts = ints(next(), '--prompts'); break;
      case '--gen': [o.gen] = ints(next(), '--gen'); break;
      case '--reps': [o.reps] = ints(next(), '--reps'); break;
      case '--warmup': {
        const w = ints(next(), '--warmup');
        if (w.length !== 2) die('--warmup wants P,G (prompt tokens, generated tokens)');
        o.warmup = w;
        break;
      }
      case '--seed': o.seed = Number(next()); if (!Number.isInteger(o.seed)) die('--seed wants an integer'); break;
      case '--json': o.json = path.resolve(next()); break;
      case '--skip-ref': o.skipRef = true; break;
      case '--regen': o.regen = true; break;
      case '-h': case '--help': console.log(USAGE); process.exit(0); break;
      default: die(`unknown option ${a}\n\n${USAGE}`);
    }
  }
  if (o.gen < 2) die('--gen must be at least 2 (decode speed needs tokens after the first)');
  return o;
}

// ---------------------------------------------------------------- progress

const t0 = Date.now();
const tty = process.stderr.isTTY;

function clock(ms) {
  const s = Math.floor(ms / 1000);
  const m = Math.floor(s / 60);
  return `${String(m).padStart(2, ' ')}:${String(s % 60).padStart(2, '0')}`;
}

/** Progress on stderr: a live status line on a terminal, else a line per change and a heartbeat. */
class Progress {
  constructor(total) {
    this.total = total;
    this.step = 0;
    this.text = null;
    this.since = 0;
    this.lastBeat = 0;
    this.timer = setInterval(() => this.tick(), tty ? 1000 : 5000);
    this.timer.unref();
  }
  prefix() {
    return `[${clock(Date.now() - t0)}] [step ${this.step}/${this.total}]`;
  }
  /** Starts the next step. */
  next(text) {
    this.step++;
    this.set(text);
  }
  /** Changes what the current step is doing. */
  set(text) {
    this.text = text;
    this.since = Date.now();
    this.lastBeat = this.since;
    this.render(true);
  }
  tick() {
    if (!this.text) return;
    if (tty) this.render(false);
    else if (Date.now() - this.lastBeat >= 30000) {
      this.lastBeat = Date.now();
      this.render(false);
    }
  }
  render(fresh) {
    const el = `${((Date.now() - this.since) / 1000).toFixed(0)} s`;
    if (tty) process.stderr.write(`\r\x1b[K${this.prefix()} ${this.text} (${el})`);
    else process.stderr.write(`${this.prefix()} ${this.text}${fresh ? '' : ` ... ${el}`}\n`);
  }
  /** A permanent line (results as they come). */
  log(text) {
    if (tty) process.stderr.write('\r\x1b[K');
    process.stderr.write(`[${clock(Date.now() - t0)}]   ${text}\n`);
    if (tty && this.text) this.render(false);
  }
  done() {
    clearInterval(this.timer);
    if (tty) process.stderr.write('\r\x1b[K');
    this.text = null;
  }
}

// ---------------------------------------------------------------- helpers

function cpuModel() {
  try {
    const m = /^model name\s*:\s*(.+)$/m.exec(fs.readFileSync('/proc/cpuinfo', 'utf8'));
    if (m) return m[1].trim();
  } catch {}
  return os.cpus()[0]?.model || 'unknown';
}

/** Deterministic uniform ints in [lo, hi) (mulberry32). */
function randomIds(n, lo, hi, seed) {
  let a = seed >>> 0;
  const out = new Array(n);
  for (let i = 0; i < n; i++) {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    const r = ((t ^ (t >>> 14)) >>> 0) / 4294967296;
    out[i] = lo + Math.floor(r * (hi - lo));
  }
  return out;
}

function cacheDir(preset, dtype) {
  const base = process.env.MLX_LFM_BENCH_CACHE
    || path.join(process.env.XDG_CACHE_HOME || path.join(os.homedir(), '.cache'), 'mlx-lfm', 'bench');
  return path.join(base, `${preset}-${dtype}`);
}

const STAMP = '.mlx-lfm-bench.json';

function fixtureReady(dir, want) {
  try {
    const s = JSON.parse(fs.readFileSync(path.join(dir, STAMP), 'utf8'));
    return s.preset === want.preset && s.dtype === want.dtype && s.seed === want.seed
      && fs.existsSync(path.join(dir, 'config.json'));
  } catch {
    return false;
  }
}

function fmtNum(x, digits) {
  if (x === null || x === undefined || !Number.isFinite(x)) return '-';
  if (digits === undefined) digits = x >= 100 ? 1 : x >= 10 ? 2 : 3;
  return x.toFixed(digits);
}

function fmtParams(n) {
  if (n >= 1e9) return `${(n / 1e9).toFixed(2)}B`;
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)}M`;
  return `${n}`;
}

// CPU time of other processes during a run (this is a shared machine: a
// compiler running beside the benchmark skews it). Linux only; null elsewhere.
function procJiffies(pid) {
  try {
    const st = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
    const f = st.slice(st.lastIndexOf(')') + 2).split(' ');
    return Number(f[11]) + Number(f[12]); // utime + stime
  } catch {
    return null;
  }
}
function busyJiffies() {
  try {
    const f = fs.readFileSync('/proc/stat', 'utf8').split('\n')[0].trim().split(/\s+/).slice(1).map(Number);
    return f[0] + f[1] + f[2] + f[5] + f[6] + f[7]; // user nice system irq softirq steal
  } catch {
    return null;
  }
}
function cpuWatch(pid) {
  const a = { t: Date.now(), busy: busyJiffies(), own: procJiffies(pid) };
  return () => {
    const busy = busyJiffies();
    const own = procJiffies(pid);
    if (a.busy === null || a.own === null || busy === null || own === null) return null;
    const secs = (Date.now() - a.t) / 1000;
    if (secs <= 0) return null;
    const hz = 100; // USER_HZ on Linux
    return { otherCores: Math.max(0, (busy - a.busy - (own - a.own)) / hz / secs), ownCores: (own - a.own) / hz / secs };
  };
}
function cpuNote(c) {
  return c ? ` [this process ${c.ownCores.toFixed(2)} cores, others ${c.otherCores.toFixed(2)} cores]` : '';
}

/** Per figure, the best run: highest tok/s, lowest TTFT. */
function best(runs) {
  const max = (k) => Math.max(...runs.map((r) => r[k]));
  const min = (k) => Math.min(...runs.map((r) => r[k]));
  return { prefillTps: max('prefillTps'), ttftMs: min('ttftMs'), decodeTps: max('decodeTps') };
}

// ---------------------------------------------------------------- mlx-lfm

/** mlx-lfm in this process: Lfm2Model.generate on its worker thread. */
class LfmRunner {
  constructor(addon, dir) {
    this.addon = addon;
    this.dir = dir;
    this.name = 'mlx-lfm';
  }
  async start() {
    const tl = Date.now();
    this.model = await this.addon.Lfm2Model.load(this.dir);
    this.loadMs = Date.now() - tl;
    const i = this.model.info();
    this.info = {
      modelType: i.modelType, dtype: i.dtype, parameterCount: i.parameterCount, weightBytes: i.weightBytes,
      device: i.device, backend: i.backend, decodePath: i.decodePath, decodePathReason: i.decodePathReason,
      cacheKind: i.cacheKind, numLayers: i.numLayers, hiddenSize: i.hiddenSize, vocabSize: i.vocabSize,
    };
    return `loaded in ${(this.loadMs / 1000).toFixed(1)} s: ${i.modelType}, ${fmtParams(i.parameterCount)} params, `
      + `${i.dtype}, device ${i.device}, decode path ${i.decodePath}`;
  }
  async run(ids, gen) {
    // Every measurement is a cold prompt: repetitions of the same prompt
    // must not be served from the paged prefix cache (mlx-lm keeps nothing
    // between runs either). Warm turns are measured by bench-turns.cjs.
    await this.model.clearPrefixCache();
    const watch = cpuWatch(process.pid);
    const w0 = process.hrtime.bigint();
    const r = await this.model.generate(ids, { maxTokens: gen, ignoreEos: true, temperature: 0 });
    const wallMs = Number(process.hrtime.bigint() - w0) / 1e6;
    const cpu = watch();
    const m = r.metrics;
    if (r.usage.completionTokens !== gen) {
      throw new Error(`mlx-lfm produced ${r.usage.completionTokens} tokens, expected ${gen} (finishReason ${r.finishReason})`);
    }
    return {
      ttftMs: m.ttftMs,
      prefillTps: ids.length / (m.ttftMs / 1000),
      decodeTps: m.decodeTokensPerSecond,
      decodeMs: m.decodeMs,
      tokens: r.usage.completionTokens,
      engineTotalMs: m.totalMs,
      jsWallMs: wallMs,
      engine: { prefillMs: m.prefillMs, prefillTokensPerSecond: m.prefillTokensPerSecond },
      outTokens: r.tokens,
      cpu,
    };
  }
  close() {
    if (this.model) {
      this.peakMemBytes = this.addon.mlxInfo().memory.peakBytes;
      this.model.close();
      this.model = null;
    }
  }
}

// ---------------------------------------------------------------- mlx-lm

function pyrefDir() {
  const dir = process.env.MLX_LFM_PYREF || path.join(root, '.pyref');
  if (!fs.existsSync(path.join(dir, 'mlx_lm'))) {
    die(`mlx-lm is not installed at ${dir}. Run through \`npm run bench\` (it installs it in .pyref/), `
      + 'set MLX_LFM_PYREF to a pip --target folder with mlx-lm 0.32.2, or pass --skip-ref.');
  }
  return dir;
}

/**
 * mlx-lm in a Python child (scripts/ref/mlx_lm_ref.py, op bench_serve): it
 * loads the checkpoint once, then times one generate_step run per command
 * (commands on fd 3, answers as stdout lines, progress on stderr).
 */
class RefRunner {
  constructor(dir, progress) {
    this.dir = dir;
    this.progress = progress;
    this.name = 'mlx-lm';
    this.waiting = [];
    this.errTail = '';
    this.exited = null;
  }
  start() {
    const py = process.env.MLX_LFM_PYTHON || 'python3';
    const child = spawn(py, [path.join(root, 'scripts', 'ref', 'mlx_lm_ref.py')], {
      cwd: root,
      env: { ...process.env, PYTHONPATH: pyrefDir(), TOKENIZERS_PARALLELISM: 'false', PYTHONUNBUFFERED: '1' },
      stdio: ['pipe', 'pipe', 'pipe', 'pipe'],
    });
    this.child = child;
    this.cmds = child.stdio[3];
    let outBuf = '';
    let errBuf = '';
    child.stdout.on('data', (d) => {
      outBuf += d;
      let nl;
      while ((nl = outBuf.indexOf('\n')) >= 0) {
        const line = outBuf.slice(0, nl);
        outBuf = outBuf.slice(nl + 1);
        if (!line.trim()) continue;
        const w = this.waiting.shift();
        let v;
        try { v = JSON.parse(line); } catch (e) { if (w) w.reject(new Error(`mlx-lm reference: bad line ${line.slice(0, 200)}`)); continue; }
        if (w) w.resolve(v);
      }
    });
    child.stderr.on('data', (d) => {
      errBuf += d;
      let nl;
      while ((nl = errBuf.indexOf('\n')) >= 0) {
        const line = errBuf.slice(0, nl);
        errBuf = errBuf.slice(nl + 1);
        if (line.startsWith('BENCH-PROGRESS ')) {
          let ev;
          try { ev = JSON.parse(line.slice(15)); } catch { continue; }
          this.onEvent(ev);
        } else {
          this.errTail = (this.errTail + line + '\n').slice(-8000);
        }
      }
    });
    const failAll = (err) => {
      for (const w of this.waiting.splice(0)) w.reject(err);
    };
    child.on('error', (e) => {
      this.exited = this.exited || { code: e.code || 'error' };
      failAll(new Error(`could not run ${py}: ${e.message}`));
    });
    child.on('close', (code, sig) => {
      this.exited = { code, sig };
      failAll(new Error(`mlx-lm reference exited with ${sig || code}:\n${this.errTail}${errBuf}`));
    });
    this.cmds.on('error', () => {});
    child.stdin.end(JSON.stringify({ op: 'bench_serve', model: this.dir, prefill_step_size: 2048 }));
    return this.next().then((v) => {
      const l = v.loaded;
      this.info = {
        mlxVersion: l.mlx_version, mlxLmVersion: l.mlx_lm_version, defaultDevice: l.default_device,
        dtype: l.dtype, params: l.params,
      };
      this.loadMs = l.load_ms;
      return `loaded in ${(l.load_ms / 1000).toFixed(1)} s: ${fmtParams(l.params)} params, ${l.dtype}, `
        + `${l.default_device}, mlx ${l.mlx_version}, mlx-lm ${l.mlx_lm_version}`;
    });
  }
  next() {
    return new Promise((resolve, reject) => {
      if (this.exited) reject(new Error(`mlx-lm reference exited with ${this.exited.sig || this.exited.code}:\n${this.errTail}`));
      else this.waiting.push({ resolve, reject });
    });
  }
  onEvent(ev) {
    if (!this.label) return;
    if (ev.phase === 'prefill') this.progress.set(`${this.label}: prefill ${ev.prompt_len} tokens`);
    else if (ev.phase === 'decode' && ev.done === 1) {
      this.progress.set(`${this.label}: first token after ${fmtNum(ev.ttft_ms / 1000)} s; decoding 1/${ev.of}`);
    } else if (ev.phase === 'decode') this.progress.set(`${this.label}: decoding ${ev.done}/${ev.of}`);
  }
  async run(ids, gen, label) {
    this.label = `mlx-lm ${label}`;
    const watch = cpuWatch(this.child.pid);
    const p = this.next();
    this.cmds.write(JSON.stringify({ prompt: ids, gen, label }) + '\n');
    const r = await p;
    const cpu = watch();
    this.label = null;
    if (r.tokens !== gen) throw new Error(`mlx-lm produced ${r.tokens} tokens, expected ${gen}`);
    return {
      ttftMs: r.ttft_ms, prefillTps: r.prefill_tps, decodeTps: r.decode_tps, decodeMs: r.decode_ms,
      tokens: r.tokens, totalMs: r.total_ms, peakMemBytes: r.peak_mem_bytes, outTokens: r.out_tokens, cpu,
    };
  }
  close() {
    if (!this.child || this.exited) return Promise.resolve();
    return new Promise((resolve) => {
      this.child.on('close', () => resolve());
      this.cmds.end(JSON.stringify({ quit: true }) + '\n');
    });
  }
}

// ---------------------------------------------------------------- table

function buildTable(lfm, ref, prompts) {
  const rows = [];
  for (const ids of prompts) {
    const P = ids.length;
    const a = best(lfm.results.find((r) => r.promptLen === P).runs);
    const b = ref ? best(ref.results.find((r) => r.promptLen === P).runs) : null;
    rows.push({ figure: 'prefill tok/s', P, unit: 'tok/s', higherIsBetter: true, lfm: a.prefillTps, ref: b && b.prefillTps });
  }
  for (const ids of prompts) {
    const P = ids.length;
    const a = best(lfm.results.find((r) => r.promptLen === P).runs);
    const b = ref ? best(ref.results.find((r) => r.promptLen === P).runs) : null;
    rows.push({ figure: 'TTFT ms', P, unit: 'ms', higherIsBetter: false, lfm: a.ttftMs, ref: b && b.ttftMs });
  }
  for (const ids of prompts) {
    const P = ids.length;
    const a = best(lfm.results.find((r) => r.promptLen === P).runs);
    const b = ref ? best(ref.results.find((r) => r.promptLen === P).runs) : null;
    rows.push({ figure: 'decode tok/s', P, unit: 'tok/s', higherIsBetter: true, lfm: a.decodeTps, ref: b && b.decodeTps });
  }
  for (const r of rows) {
    r.ratio = r.ref ? r.lfm / r.ref : null;
    if (r.ratio !== null) {
      const speedup = r.higherIsBetter ? r.ratio : 1 / r.ratio;
      r.verdict = Math.abs(speedup - 1) < 0.02 ? 'about even'
        : speedup > 1 ? `mlx-lfm ${speedup.toFixed(2)}x faster` : `mlx-lfm ${(1 / speedup).toFixed(2)}x slower`;
    }
  }
  return rows;
}

function printTable(rows, gen, haveRef) {
  const head = haveRef ? ['figure', 'prompt', 'mlx-lfm', 'mlx-lm', 'mlx-lfm/mlx-lm', ''] : ['figure', 'prompt', 'mlx-lfm'];
  const body = rows.map((r) => {
    const fig = r.figure === 'decode tok/s' ? `decode tok/s (${gen} tok)` : r.figure;
    const cells = [fig, `${r.P}`, fmtNum(r.lfm, r.unit === 'ms' ? 0 : undefined)];
    if (haveRef) {
      cells.push(fmtNum(r.ref, r.unit === 'ms' ? 0 : undefined), r.ratio === null ? '-' : `${r.ratio.toFixed(2)}`,
        r.verdict ? `(${r.verdict})` : '');
    }
    return cells;
  });
  const w = head.map((h, i) => Math.max(h.length, ...body.map((b) => b[i].length)));
  const fmt = (cells) => cells.map((c, i) => (i < 2 || i === cells.length - 1 && haveRef ? c.padEnd(w[i]) : c.padStart(w[i]))).join('  ').trimEnd();
  console.log(fmt(head));
  console.log(w.map((n) => '-'.repeat(n)).join('  '));
  for (const b of body) console.log(fmt(b));
  if (haveRef) console.log('(TTFT: a ratio below 1 means mlx-lfm is faster; for tok/s, above 1.)');
}

function agreement(a, b) {
  let n = 0;
  while (n < a.length && n < b.length && a[n] === b[n]) n++;
  return n;
}

// ---------------------------------------------------------------- main

async function main() {
  const o = parseArgs(process.argv.slice(2));
  let addon;
  try {
    addon = require(path.join(root, 'index.cjs'));
  } catch (e) {
    die(`could not load the addon (build it with \`npm run build\` or run \`npm run bench\`): ${e.message}`);
  }
  if (!o.skipRef) pyrefDir();
  if (o.model && o.dtypeGiven) {
    console.error('bench: --dtype only applies to the generated checkpoint; --model runs as stored.');
  }

  const needFixture = !o.model;
  const dir = o.model || cacheDir(o.preset, o.dtype);
  const want = { preset: o.preset, dtype: o.dtype, seed: 0 };
  const fixtureNeeded = needFixture && (o.regen || !fixtureReady(dir, want));
  const runtimes = o.skipRef ? 1 : 2;
  // per runtime: load, warm-up, then one step per prompt and repetition
  const progress = new Progress((fixtureNeeded ? 1 : 0) + runtimes * (2 + o.prompts.length * o.reps));

  const mi = addon.mlxInfo();
  console.log('mlx-lfm benchmark');
  console.log(`  MLX ${mi.version}, backend ${mi.backend}, device ${mi.defaultDevice} (${mi.deviceName})`);
  console.log(`  CPU: ${cpuModel()}, ${os.cpus().length} cores; Node ${process.version}; ${os.platform()} ${os.arch()}`);

  if (fixtureNeeded) {
    progress.next(`generating the ${o.preset} ${o.dtype} checkpoint in ${dir}`);
    const tmp = `${dir}.tmp-${process.pid}`;
    fs.rmSync(tmp, { recursive: true, force: true });
    fs.mkdirSync(path.dirname(dir), { recursive: true });
    await addon.generateFixture(tmp, { preset: o.preset, dtype: o.dtype, seed: want.seed });
    fs.writeFileSync(path.join(tmp, STAMP), JSON.stringify(want));
    fs.rmSync(dir, { recursive: true, force: true });
    fs.renameSync(tmp, dir);
    progress.log(`checkpoint written to ${dir}`);
  }
  let config;
  try {
    config = JSON.parse(fs.readFileSync(path.join(dir, 'config.json'), 'utf8'));
  } catch (e) {
    die(`cannot read ${path.join(dir, 'config.json')}: ${e.message}`);
  }
  const vocab = config.vocab_size;
  if (!Number.isInteger(vocab) || vocab < 2) die(`config.json has no usable vocab_size`);
  // Random ids away from the low ids (special tokens in LFM2's vocabulary).
  const lo = Math.min(1000, Math.floor(vocab / 4));
  const prompts = o.prompts.map((p, i) => randomIds(p, lo, vocab, o.seed * 1000 + i + 1));
  const warmupIds = randomIds(o.warmup[0], lo, vocab, o.seed * 1000 + 999);

  const ckptLine = o.model
    ? `  checkpoint: ${dir} (${config.model_type}, hidden ${config.hidden_size}, ${config.num_hidden_layers} layers, vocab ${vocab})`
    : `  checkpoint: preset ${o.preset}, ${o.dtype}, random weights, ${dir}`;
  console.log(ckptLine);
  console.log(`  prompts: ${o.prompts.join(', ')} random token ids in [${lo}, ${vocab}) (seed ${o.seed}), same ids for both; `
    + `${o.gen} tokens generated, greedy, EOS ignored; prefill chunk 2048`);
  console.log(`  warm-up: one ${o.warmup[0]}-token prompt, ${o.warmup[1]} tokens; then ${o.reps} measured rep(s) per prompt, best kept`);
  console.log('');

  // Both runtimes stay loaded and take turns (mlx-lfm, mlx-lm, then mlx-lm,
  // mlx-lfm for the next measurement, ...), so a change in the machine's
  // load during the run hits both alike. Never two at once.
  const runners = [new LfmRunner(addon, dir)];
  if (!o.skipRef) runners.push(new RefRunner(dir, progress));
  const rec = new Map(runners.map((r) => [r, { warmup: null, results: prompts.map((ids) => ({ promptLen: ids.length, runs: [] })) }]));
  const pad = (n) => n.padEnd(7);
  try {
    for (const r of runners) {
      progress.next(`${r.name}: loading ${dir}`);
      progress.log(`${pad(r.name)} ${await r.start()}`);
    }
    for (const r of runners) {
      progress.next(`${r.name} warm-up: prefill ${warmupIds.length} tokens + decode ${o.warmup[1]} tokens`);
      rec.get(r).warmup = await r.run(warmupIds, o.warmup[1], 'warm-up');
    }
    let k = 0;
    for (let pi = 0; pi < prompts.length; pi++) {
      for (let rep = 0; rep < o.reps; rep++, k++) {
        const order = k % 2 === 0 ? runners : [...runners].reverse();
        for (const r of order) {
          const label = `P=${prompts[pi].length} rep ${rep + 1}/${o.reps}`;
          progress.next(`${r.name} ${label}: prefill ${prompts[pi].length} tokens + decode ${o.gen} tokens`);
          const run = await r.run(prompts[pi], o.gen, label);
          rec.get(r).results[pi].runs.push(run);
          progress.log(`${pad(r.name)} ${label}: TTFT ${fmtNum(run.ttftMs / 1000)} s, prefill ${fmtNum(run.prefillTps)} tok/s, `
            + `decode ${fmtNum(run.decodeTps)} tok/s${cpuNote(run.cpu)}`);
        }
      }
    }
  } finally {
    for (const r of runners) await r.close();
  }
  const lfmR = runners[0];
  const lfm = { loadMs: lfmR.loadMs, info: lfmR.info, peakMemBytes: lfmR.peakMemBytes, ...rec.get(lfmR) };
  const refR = runners[1];
  const ref = refR ? { loadMs: refR.loadMs, ...refR.info, ...rec.get(refR) } : null;
  progress.done();

  console.log('');
  console.log(`checkpoint: ${o.model ? dir : `${o.preset} (random weights)`}, `
    + `${fmtParams(lfm.info.parameterCount)} params, ${lfm.info.dtype} (as loaded by mlx-lfm)`
    + (ref ? `; mlx-lm: ${fmtParams(ref.params)} params, ${ref.dtype}` : ''));
  console.log(`MLX ${mi.version} ${mi.backend} on ${cpuModel()} (${os.cpus().length} cores)`
    + (ref ? `; mlx-lm ${ref.mlxLmVersion} on MLX ${ref.mlxVersion} (${ref.defaultDevice})` : ''));
  console.log(`best of ${o.reps} after a warm-up; prefill tok/s = prompt tokens / TTFT; decode tok/s = ${o.gen - 1} tokens after the first / time after the first`);
  console.log('');
  const rows = buildTable(lfm, ref, prompts);
  printTable(rows, o.gen, !!ref);

  if (ref) {
    const notes = [];
    for (const ids of prompts) {
      const a = lfm.results.find((r) => r.promptLen === ids.length).runs[0].outTokens;
      const b = ref.results.find((r) => r.promptLen === ids.length).runs[0].outTokens;
      if (a && b) notes.push(`P=${ids.length}: ${agreement(a, b)}/${o.gen}`);
    }
    if (notes.length) console.log(`greedy tokens identical up to (sanity check, not a speed figure): ${notes.join(', ')}`);
    const busy = [...lfm.results, ...ref.results].flatMap((r) => r.runs).filter((r) => r.cpu && r.cpu.otherCores > 0.25);
    if (busy.length) {
      console.log(`warning: other processes used up to ${Math.max(...busy.map((r) => r.cpu.otherCores)).toFixed(2)} of `
        + `${os.cpus().length} cores during ${busy.length} measured run(s); those figures are pessimistic (see the log above).`);
    }
    const slower = rows.filter((r) => r.verdict && r.verdict.includes('slower'));
    if (slower.length) {
      console.log(`mlx-lfm is slower than mlx-lm on: ${slower.map((r) => `${r.figure} P=${r.P} (${r.verdict})`).join('; ')}`);
    }
  }

  if (o.json) {
    const strip = (runs) => runs.map(({ outTokens, ...r }) => r);
    const doc = {
      date: new Date().toISOString(),
      mlx: mi,
      cpu: { model: cpuModel(), cores: os.cpus().length },
      node: process.version,
      checkpoint: {
        dir, preset: o.model ? null : o.preset, dtype: o.model ? lfm.info.dtype : o.dtype, generated: !o.model,
        modelType: config.model_type, params: lfm.info.parameterCount,
      },
      settings: {
        prompts: o.prompts, gen: o.gen, reps: o.reps, warmup: { prompt: o.warmup[0], gen: o.warmup[1] },
        seed: o.seed, promptIdRange: [lo, vocab], prefillChunk: 2048, ignoreEos: true, sampling: 'greedy',
      },
      mlxLfm: { ...lfm, warmup: strip([lfm.warmup])[0], results: lfm.results.map((r) => ({ promptLen: r.promptLen, runs: strip(r.runs) })) },
      mlxLm: ref && { ...ref, warmup: ref.warmup && strip([ref.warmup])[0], results: ref.results.map((r) => ({ promptLen: r.promptLen, runs: strip(r.runs) })) },
      table: rows,
      elapsedMs: Date.now() - t0,
    };
    fs.mkdirSync(path.dirname(o.json), { recursive: true });
    fs.writeFileSync(o.json, JSON.stringify(doc, null, 2) + '\n');
    console.log(`\nresults written to ${o.json}`);
  }
  console.log(`\ntotal time ${clock(Date.now() - t0).trim()}`);
}

main().catch((e) => {
  if (process.stderr.isTTY) process.stderr.write('\r\x1b[K');
  console.error(`bench: ${e && e.stack ? e.stack : e}`);
  process.exit(1);
});
