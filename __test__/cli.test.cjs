'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { spawnSync } = require('node:child_process');
const { addon, fixture, root, startServe } = require('./helpers.cjs');

const cli = path.join(root, 'cli.cjs');

test('`mlx-lfm chat --model DIR --prompt TEXT` prints the reply and the metrics', async () => {
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const r = spawnSync(process.execPath, [cli, 'chat', '--model', dir, '--prompt', 'Hello', '--max-tokens', '5'], { encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
  // The reply printed is the model's own: the same request through the API.
  const m = await addon.Lfm2Model.load(dir);
  const want = await m.chat([{ role: 'user', content: 'Hello' }], { maxTokens: 5 });
  m.close();
  assert.ok(want.text.length > 0);
  assert.equal(r.stdout.trim(), want.text.trim());
  const metrics = r.stderr.match(/prompt (\d+) tok, completion (\d+) tok \| TTFT [\d.]+ ms \| prefill [\d.]+ tok\/s \| decode [\d.]+ tok\/s/);
  assert.ok(metrics, r.stderr);
  assert.equal(Number(metrics[1]), want.usage.promptTokens);
  assert.equal(Number(metrics[2]), want.usage.completionTokens);
});

test('interactive chat keeps the conversation', async () => {
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const r = spawnSync(process.execPath, [cli, 'chat', '--model', dir, '--max-tokens', '3'], { input: 'hi\nagain\n\n', encoding: 'utf8' });
  assert.equal(r.status, 0, r.stderr);
  const prompts = [...r.stderr.matchAll(/prompt (\d+) tok/g)].map((m) => Number(m[1]));
  assert.equal(prompts.length, 2);
  assert.ok(prompts[1] > prompts[0] + 3, `second turn should include the first: ${prompts}`);
});

test('the CLI reports bad input and exits non-zero', () => {
  const r = spawnSync(process.execPath, [cli, 'chat', '--model', '/no/such/dir', '--prompt', 'x'], { encoding: 'utf8' });
  assert.equal(r.status, 1);
  assert.match(r.stderr, /model path \/no\/such\/dir is not a directory/);
  const b = spawnSync(process.execPath, [cli, 'chat', '--max-tokens', 'lots'], { encoding: 'utf8' });
  assert.equal(b.status, 1);
  assert.match(b.stderr, /--max-tokens must be an integer/);
});

const run = (args, opts = {}) => spawnSync(process.execPath, [cli, ...args], { encoding: 'utf8', ...opts });

test('--version prints the package version and MLX\'s version and backend', () => {
  const r = run(['--version']);
  assert.equal(r.status, 0, r.stderr);
  const info = addon.mlxInfo();
  assert.equal(r.stdout.trim(), `mlx-lfm ${require('../package.json').version} (MLX ${info.version}, ${info.backend} backend, default device ${info.defaultDevice}, native package: ${info.binding})`);
});

test('--help for each command lists its flags', () => {
  const expect = {
    chat: ['--model', '--prompt', '--system', '--max-tokens', '--temperature', '--top-p', '--top-k', '--min-p', '--seed', '--repetition-penalty', '--dtype', '--kv-cache', '--decode-path', '--paged', '--no-paged', '--device', '--context-length', '--prefix-cache-dir', '--prefix-cache-disk-mb'],
    info: ['--model', '--dtype', '--kv-cache', '--decode-path', '--paged', '--no-paged', '--device', '--context-length', '--prefix-cache-dir', '--prefix-cache-disk-mb'],
    fixture: ['--out', '--preset', '--dtype', '--layout', '--seed'],
    serve: ['--model', '--port', '--host', '--name', '--api-key', '--cors', '--max-prompt-tokens', '--tensor-parallel', '--backend', '--hostfile', '--dtype', '--kv-cache', '--decode-path', '--paged', '--no-paged', '--device', '--context-length', '--prefix-cache-dir', '--prefix-cache-disk-mb'],
    follow: ['--model', '--backend', '--dtype', '--kv-cache', '--decode-path', '--paged', '--no-paged', '--device', '--context-length', '--prefix-cache-dir', '--prefix-cache-disk-mb'],
    convert: ['--model', '--out', '--quantize', '--q-mode', '--q-bits', '--q-group-size', '--dtype', '--q-override'],
    bench: ['--model', '--prompt-tokens', '--gen', '--reps', '--dtype', '--kv-cache', '--decode-path', '--paged', '--no-paged', '--device', '--context-length', '--prefix-cache-dir', '--prefix-cache-disk-mb'],
    allocator: [],
  };
  for (const [cmd, flags] of Object.entries(expect)) {
    for (const form of [[cmd, '--help'], [cmd, '-h'], ['help', cmd]]) {
      const r = run(form);
      assert.equal(r.status, 0, `${form.join(' ')}: ${r.stderr}`);
      assert.match(r.stdout, new RegExp(`^usage: mlx-lfm ${cmd} `), form.join(' '));
      const listed = [...r.stdout.matchAll(/^\s+(?:-\w, )?(--[\w-]+)/gm)].map((m) => m[1]);
      assert.deepEqual(listed, [...flags, '--help'], form.join(' '));
    }
  }
  const top = run(['--help']);
  assert.equal(top.status, 0);
  for (const cmd of Object.keys(expect)) assert.match(top.stdout, new RegExp(`^  mlx-lfm ${cmd} `, 'm'));
});

test('unknown flags and commands are errors naming the closest valid one', () => {
  const cases = [
    [['chat', '--max-tokenz', '3'], 'unknown flag --max-tokenz for chat (did you mean --max-tokens?)'],
    [['serve', '--kv-cach=affine8'], 'unknown flag --kv-cach for serve (did you mean --kv-cache?)'],
    [['bench', '--prompt-token', '5'], 'unknown flag --prompt-token for bench (did you mean --prompt-tokens?)'],
    [['info', '--frobnicate'], 'unknown flag --frobnicate for info; see mlx-lfm info --help'],
    [['chta'], 'unknown command chta (did you mean chat?)'],
    [['--verison'], 'unknown command --verison (did you mean --version?)'],
    [['chat', '--dtype', 'float64'], '--dtype must be one of float32, float16, bfloat16, f32, f16, bf16; got `float64`'],
    [['chat', '--paged', '--no-paged'], '--paged and --no-paged contradict each other; give one'],
    [['chat', '--prompt'], '--prompt needs a value (TEXT)'],
    [['bench'], 'bench needs --model DIR'],
  ];
  for (const [args, message] of cases) {
    const r = run(args);
    assert.equal(r.status, 1, args.join(' '));
    assert.equal(r.stderr.split('\n')[0], `mlx-lfm: ${message}`, args.join(' '));
  }
});

test('chat streams its reply and passes the load options', async () => {
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  // 40 tokens of reply arrive in more than one write while the process runs
  // (a reply printed at the end would be one).
  const { spawn } = require('node:child_process');
  const child = spawn(process.execPath, [cli, 'chat', '--model', dir, '--prompt', 'Hello', '--max-tokens', '40',
    '--no-paged', '--decode-path', 'eager', '--dtype', 'bf16', '--kv-cache', 'affine8', '--context-length', '512']);
  const chunks = [];
  let stderr = '';
  child.stdout.on('data', (d) => chunks.push(d.toString()));
  child.stderr.on('data', (d) => (stderr += d));
  const code = await new Promise((resolve) => child.on('close', resolve));
  assert.equal(code, 0, stderr);
  const m = await addon.Lfm2Model.load(dir, { useBlockPagedCache: false, decodePath: 'eager', dtype: 'bf16', kvCache: 'affine8', contextLength: 512 });
  const stream = m.chatStream([{ role: 'user', content: 'Hello' }], { maxTokens: 40 });
  const deltas = [];
  for await (const ev of stream) if (ev.type === 'text') deltas.push(ev.text);
  const want = await stream.result();
  m.close();
  assert.equal(chunks.join(''), `${want.text}\n`);
  assert.ok(deltas.length > 1 && chunks.length > 1, `streamed in ${chunks.length} writes`);
  assert.match(stderr, new RegExp(`prompt ${want.usage.promptTokens} tok, completion ${want.usage.completionTokens} tok`));
});

test('info takes the load options, and loading shows progress lines without a terminal', async () => {
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const r = run(['info', '--model', dir, '--no-paged', '--decode-path', 'eager', '--device', 'cpu', '--context-length', '256']);
  assert.equal(r.status, 0, r.stderr);
  const { model } = JSON.parse(r.stdout);
  assert.equal(model.cacheKind, 'flat');
  assert.equal(model.decodePath, 'eager');
  assert.equal(model.device, 'cpu');
  assert.equal(model.contextLength, 256);
  const lines = r.stderr.trim().split('\n');
  assert.ok(!r.stderr.includes('\r'), 'no carriage returns without a TTY');
  const pct = lines.filter((l) => l.startsWith('mlx-lfm: loading weights')).map((l) => Number(/(\d+)%/.exec(l)[1]));
  assert.equal(pct[0], 0);
  assert.equal(pct.at(-1), 100);
  assert.deepEqual(pct, [...pct].sort((a, b) => a - b));
  assert.match(lines.at(-1), /^mlx-lfm: loaded [\d.]+ MB of weights in [\d.]+ s$/);
});

test('loading draws a progress bar on a terminal', { skip: spawnSync('script', ['--version']).status !== 0 && 'no `script` to make a terminal' }, async () => {
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  // `script` runs the CLI on a pseudo-terminal (stderr.isTTY) and copies what it wrote.
  const cmd = [process.execPath, cli, 'info', '--model', dir].map((a) => `'${a}'`).join(' ');
  const r = spawnSync('script', ['-qec', cmd, '/dev/null'], { encoding: 'utf8' });
  assert.equal(r.status, 0, r.stdout + r.stderr);
  assert.match(r.stdout, /\rloading weights \[[#.]{30}\] +\d+% [\d.]+\/[\d.]+ MB/);
  assert.match(r.stdout, /\r\x1b\[Kmlx-lfm: loaded [\d.]+ MB of weights/);
  assert.doesNotMatch(r.stdout, /mlx-lfm: loading weights \d+%/);
});

test('bench prints prefill and decode tok/s with progress', async () => {
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const r = run(['bench', '--model', dir, '--prompt-tokens', '48', '--gen', '12', '--reps', '2', '--decode-path', 'eager']);
  assert.equal(r.status, 0, r.stderr);
  assert.match(r.stdout, /^prefill: [\d.]+ tok\/s \(48 tokens, [\d.]+ ms\)\ndecode: [\d.]+ tok\/s \(12 tokens, [\d.]+ ms\)\nttft: [\d.]+ ms\n$/);
  assert.ok(Number(/prefill: ([\d.]+)/.exec(r.stdout)[1]) > 0 && Number(/decode: ([\d.]+)/.exec(r.stdout)[1]) > 0);
  assert.match(r.stderr, /eager decode/);
  assert.match(r.stderr, /run 1\/2: prefill 48 tokens, decode 12\n.*run 1\/2: prefill [\d.]+ tok\/s, decode [\d.]+ tok\/s/);
  assert.match(r.stderr, /run 2\/2: prefill [\d.]+ tok\/s/);
  const over = run(['bench', '--model', dir, '--prompt-tokens', '200000', '--gen', '1']);
  assert.equal(over.status, 1);
  assert.match(over.stderr, /--prompt-tokens 200000 plus --gen 1 exceed the model's context length \(128000\)/);
});

test('serve takes the load options', async () => {
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const { child, url, log } = await startServe(['--model', dir, '--port', '0', '--no-paged', '--decode-path', 'eager', '--kv-cache', 'affine4']);
  try {
    assert.match(log(), /: eager decode, quantized cache, affine4 KV\n/);
    const res = await fetch(`${url}/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ messages: [{ role: 'user', content: 'hi' }], max_tokens: 3 }),
    });
    assert.equal(res.status, 200);
    assert.equal((await res.json()).object, 'chat.completion');
  } finally {
    child.kill('SIGTERM');
  }
});

test('serve --prefix-cache-dir: a restarted server reuses the blocks the first one wrote at exit', async () => {
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const fs = require('node:fs');
  const os = require('node:os');
  const cache = fs.mkdtempSync(path.join(os.tmpdir(), 'mlx-lfm-serve-disk-'));
  const content = 'Tell me a long story about the sea, the mountains, the rivers and the people who live by them.';
  async function once() {
    const { child, url, exited } = await startServe(['--model', dir, '--port', '0', '--prefix-cache-dir', cache, '--prefix-cache-disk-mb', '64']);
    try {
      const res = await fetch(`${url}/chat/completions`, {
        method: 'POST',
        headers: { 'content-type': 'application/json' },
        body: JSON.stringify({ messages: [{ role: 'user', content }], max_tokens: 6, ignore_eos: true }),
      });
      assert.equal(res.status, 200);
      return await res.json();
    } finally {
      child.kill('SIGTERM');
      await exited;
    }
  }
  try {
    const first = await once();
    assert.equal(first.usage.prompt_tokens_details.cached_tokens, 0);
    assert.ok(first.usage.prompt_tokens > 33, `${first.usage.prompt_tokens} prompt tokens: at least one full block`);
    assert.ok(fs.readdirSync(cache).some((f) => f.endsWith('.blk')), 'blocks written at exit');
    const second = await once();
    assert.ok(second.usage.prompt_tokens_details.cached_tokens >= 32, JSON.stringify(second.usage));
    assert.equal(second.choices[0].message.content, first.choices[0].message.content);
  } finally {
    fs.rmSync(cache, { recursive: true, force: true });
  }
});

// The model commands relaunch themselves once with mimalloc preloaded on
// Linux (lib/allocator.cjs): what each process's malloc is, the loader's
// own answer (mlxInfo().allocator, dladdr of malloc), says whether it took.
const linux = process.platform === 'linux';
const shipped = path.join(root, 'libmimalloc.so');

function cliEnv(extra = {}) {
  const env = { ...process.env, ...extra };
  delete env.LD_PRELOAD;
  delete env.MLX_LFM_ALLOCATOR_RELAUNCHED;
  if (!('MLX_LFM_ALLOCATOR' in extra)) delete env.MLX_LFM_ALLOCATOR;
  for (const [k, v] of Object.entries(extra)) if (v === undefined) delete env[k];
  return env;
}

test('model commands run under the shipped allocator on Linux; MLX_LFM_ALLOCATOR=system keeps libc\'s', { skip: !linux && 'Linux only' }, async () => {
  assert.ok(require('node:fs').existsSync(shipped), `${shipped} was not built (scripts/mimalloc.cjs, run by npm run build)`);
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const info = (env) => {
    const r = spawnSync(process.execPath, [cli, 'info', '--model', dir], { encoding: 'utf8', env });
    assert.equal(r.status, 0, r.stderr);
    return JSON.parse(r.stdout).mlx.allocator;
  };
  assert.equal(info(cliEnv()), shipped);
  assert.match(info(cliEnv({ MLX_LFM_ALLOCATOR: 'system' })), /\/libc\.so/);
  // This test's own process was not restarted: a program that requires
  // the package keeps its malloc.
  assert.match(addon.mlxInfo().allocator, /\/libc\.so/);
  const where = spawnSync(process.execPath, [cli, 'allocator'], { encoding: 'utf8', env: cliEnv() });
  assert.equal(where.status, 0, where.stderr);
  assert.equal(where.stdout.trim(), shipped);
  // A chat under it answers what the API answers, its stdin and stdout the
  // command's own.
  const r = spawnSync(process.execPath, [cli, 'chat', '--model', dir, '--max-tokens', '5'], { encoding: 'utf8', env: cliEnv(), input: 'Hello\n\n' });
  assert.equal(r.status, 0, r.stderr);
  const m = await addon.Lfm2Model.load(dir);
  const want = await m.chat([{ role: 'user', content: 'Hello' }], { maxTokens: 5 });
  m.close();
  assert.ok(r.stdout.includes(want.text.trim()), `${JSON.stringify(r.stdout)} lacks ${JSON.stringify(want.text)}`);
});

/** Process ids whose parent is `pid` (by /proc/N/stat's fourth field). */
function childrenOf(pid) {
  const fs = require('node:fs');
  const out = [];
  for (const e of fs.readdirSync('/proc')) {
    if (!/^\d+$/.test(e)) continue;
    try {
      // The name field may hold spaces: the fields after its closing ')'.
      const stat = fs.readFileSync(`/proc/${e}/stat`, 'utf8');
      if (Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]) === pid) out.push(Number(e));
    } catch {
      // gone meanwhile
    }
  }
  return out;
}

test('the restart leaves alone what the user chose', { skip: !linux && 'Linux only' }, () => {
  const { relaunchEnv, preloadPath, refusal } = require('../lib/allocator.cjs');
  for (const env of [
    { MLX_LFM_ALLOCATOR: 'system' },
    { LD_PRELOAD: '/opt/lib/libjemalloc.so.2' },
    { LD_PRELOAD: '/usr/lib/x86_64-linux-gnu/libmimalloc.so.2:/x/other.so' },
    { LD_PRELOAD: shipped },
    { MLX_LFM_ALLOCATOR_RELAUNCHED: '1' },
    { MLX_LFM_ALLOCATOR: '/no/such/lib.so' },
    // A debugger would lose the process it is attached to.
    { NODE_OPTIONS: '--inspect=127.0.0.1:0' },
  ]) {
    assert.equal(relaunchEnv(env), null, JSON.stringify(env));
  }
  assert.equal(relaunchEnv({}).LD_PRELOAD, shipped);
  assert.equal(relaunchEnv({ LD_PRELOAD: '/x/other.so' }).LD_PRELOAD, `${shipped}:/x/other.so`);
  assert.deepEqual(preloadPath({ MLX_LFM_ALLOCATOR: 'system' }), { path: null, reason: 'MLX_LFM_ALLOCATOR=system' });
  assert.deepEqual(preloadPath({ MLX_LFM_ALLOCATOR: shipped }), { path: shipped });
  assert.equal(refusal({ MLX_LFM_ALLOCATOR: shipped }), null);
  assert.match(refusal({ MLX_LFM_ALLOCATOR: '/no/such/lib.so' }), /no such file/);
  const spaced = path.join(require('node:os').tmpdir(), 'a b', 'libmimalloc.so');
  require('node:fs').mkdirSync(path.dirname(spaced), { recursive: true });
  require('node:fs').copyFileSync(shipped, spaced);
  assert.match(preloadPath({ MLX_LFM_ALLOCATOR: spaced }).reason, /space or colon/);
});

test('a restarted command keeps its process: pid, failures and signals its own', { skip: !linux && 'Linux only' }, async () => {
  const fs = require('node:fs');
  const { spawn } = require('node:child_process');
  // Its exit status and message come through.
  const bad = spawnSync(process.execPath, [cli, 'info', '--model', '/no/such/dir'], { encoding: 'utf8', env: cliEnv() });
  assert.equal(bad.status, 1);
  assert.match(bad.stderr, /model path \/no\/such\/dir is not a directory/);
  // A library that is not there is named, and nothing runs.
  for (const args of [['allocator'], ['info', '--model', '/no/such/dir']]) {
    const none = spawnSync(process.execPath, [cli, ...args], { encoding: 'utf8', env: cliEnv({ MLX_LFM_ALLOCATOR: '/no/such/lib.so' }) });
    assert.equal(none.status, 1, args.join(' '));
    assert.match(none.stderr, /MLX_LFM_ALLOCATOR=\/no\/such\/lib\.so: no such file/, args.join(' '));
  }
  // A server: the process started is the one serving under the library
  // (no child between it and its signals), and SIGTERM stops it cleanly.
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const p = spawn(process.execPath, [cli, 'serve', '--model', dir, '--port', '0'], { env: cliEnv(), stdio: ['ignore', 'pipe', 'pipe'] });
  const ended = new Promise((r) => p.on('exit', (code, signal) => r({ code, signal })));
  try {
    let err = '';
    p.stderr.on('data', (d) => (err += d));
    const until = Date.now() + 60_000;
    while (Date.now() < until && !/serving /.test(err)) await new Promise((r) => setTimeout(r, 100));
    assert.match(err, /serving /);
    assert.deepEqual(childrenOf(p.pid), [], 'a child process');
    assert.ok(fs.readFileSync(`/proc/${p.pid}/maps`, 'utf8').includes(shipped), 'the library is not mapped');
    p.kill('SIGTERM');
    const timer = new Promise((r) => setTimeout(() => r({ code: 'still running 30 s after SIGTERM' }), 30_000));
    assert.deepEqual(await Promise.race([ended, timer]), { code: 0, signal: null }, err);
  } finally {
    p.kill('SIGKILL');
  }
});

test('`node -r mlx-lfm/allocator.cjs app.js` runs a program under the shipped allocator, in its own process, its argv, output and exit its own', { skip: !linux && 'Linux only' }, async () => {
  const fs = require('node:fs');
  const os = require('node:os');
  const dir = await fixture('tiny', { preset: 'tiny', dtype: 'f32' });
  const app = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'mlx-lfm-preload-')), 'app.cjs');
  fs.writeFileSync(app, `const { Lfm2Model, mlxInfo } = require(${JSON.stringify(path.join(root, 'main.cjs'))});
(async () => {
  const m = await Lfm2Model.load(${JSON.stringify(dir)});
  const r = await m.chat([{ role: 'user', content: 'Hi' }], { maxTokens: 3 });
  console.log(JSON.stringify(process.argv[2] === 'pid' ? { pid: process.pid } : { allocator: mlxInfo().allocator, n: r.usage.completionTokens, argv: process.argv.slice(2) }));
  m.close();
  process.exitCode = 3;
})();
`);
  const preload = path.join(root, 'allocator.cjs');
  const run = (env, args = ['a b', 'c']) => spawnSync(process.execPath, ['-r', preload, app, ...args], { encoding: 'utf8', env });
  const r = run(cliEnv());
  assert.equal(r.status, 3, r.stderr);
  assert.deepEqual(JSON.parse(r.stdout), { allocator: shipped, n: 3, argv: ['a b', 'c'] });
  const sys = run(cliEnv({ MLX_LFM_ALLOCATOR: 'system' }));
  assert.match(JSON.parse(sys.stdout).allocator, /\/libc\.so/);
  const viaOptions = spawnSync(process.execPath, [app], { encoding: 'utf8', env: cliEnv({ NODE_OPTIONS: `-r ${preload}` }) });
  assert.equal(JSON.parse(viaOptions.stdout).allocator, shipped, viaOptions.stderr);
  const bad = run(cliEnv({ MLX_LFM_ALLOCATOR: '/no/such/lib.so' }));
  assert.notEqual(bad.status, 0);
  assert.match(bad.stderr, /MLX_LFM_ALLOCATOR=\/no\/such\/lib\.so: no such file/);
  // The program runs in the process started (restarted in place).
  const own = spawnSync(process.execPath, ['-r', preload, app, 'pid'], { encoding: 'utf8', env: cliEnv() });
  assert.equal(JSON.parse(own.stdout).pid, own.pid, own.stderr);
});
