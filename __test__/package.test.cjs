'use strict';
// Installable like a user installs it: `npm run package` packs the root
// package and this platform's CPU package; both are installed into an empty
// project with `npm install`, with nothing but node and npm on PATH (no
// cargo, rustc or python3), and the installed package loads, reports which
// binary it chose and chats with a generated tiny model.
const { test } = require('node:test');
const assert = require('node:assert');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { spawnSync } = require('node:child_process');

const root = path.resolve(__dirname, '..');
const supported = process.platform === 'linux' && process.arch === 'x64';

function which(cmd) {
  const r = spawnSync('sh', ['-c', `command -v ${cmd}`], { encoding: 'utf8' });
  return r.status === 0 ? r.stdout.trim() : null;
}

test('the packed packages install with npm alone and chat', { skip: !supported && 'the CPU package is built for linux-x64 here', timeout: 600_000 }, () => {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'mlx-lfm-pack-'));
  try {
    const dist = path.join(tmp, 'dist');
    const packed = spawnSync(process.execPath, [path.join(root, 'scripts', 'package.cjs'), '--out', dist, '--no-build'], {
      cwd: root,
      encoding: 'utf8',
    });
    assert.strictEqual(packed.status, 0, packed.stderr);
    const tarballs = fs.readdirSync(dist).sort();
    assert.deepStrictEqual(tarballs, ['mlx-lfm-0.1.0.tgz', 'mlx-lfm-linux-x64-gnu-0.1.0.tgz']);

    // The packed root lists every platform package, at its version.
    const listed = spawnSync('tar', ['-xzOf', path.join(dist, 'mlx-lfm-0.1.0.tgz'), 'package/package.json'], { encoding: 'utf8' });
    const pkg = JSON.parse(listed.stdout);
    assert.deepStrictEqual(Object.keys(pkg.optionalDependencies).sort(), [
      'mlx-lfm-darwin-arm64',
      'mlx-lfm-linux-arm64-gnu',
      'mlx-lfm-linux-x64-gnu',
      'mlx-lfm-linux-x64-gnu-cuda',
    ]);
    assert.ok(Object.values(pkg.optionalDependencies).every((v) => v === pkg.version));
    assert.strictEqual(pkg.scripts, undefined, 'the published root runs no scripts');

    // A PATH with node and npm only.
    const app = path.join(tmp, 'app');
    const bin = path.join(app, 'bin');
    fs.mkdirSync(bin, { recursive: true });
    fs.symlinkSync(process.execPath, path.join(bin, 'node'));
    fs.symlinkSync(fs.realpathSync(which('npm')), path.join(bin, 'npm'));
    const env = { ...process.env, PATH: bin, npm_config_update_notifier: 'false' };
    for (const k of Object.keys(env)) if (k.startsWith('MLX_LFM') || k === 'NAPI_RS_NATIVE_LIBRARY_PATH') delete env[k];
    for (const tool of ['cargo', 'rustc', 'python3']) {
      assert.notStrictEqual(spawnSync(tool, ['--version'], { env }).status, 0, `${tool} is reachable`);
    }
    fs.writeFileSync(path.join(app, 'package.json'), JSON.stringify({ name: 'app', version: '1.0.0', private: true }));
    const inst = spawnSync('npm', ['install', '--no-audit', '--no-fund', ...tarballs.map((t) => path.join(dist, t))], {
      cwd: app,
      env,
      encoding: 'utf8',
    });
    assert.strictEqual(inst.status, 0, inst.stderr);
    // The installed .node finds MLX beside it only, never in this build's tree.
    const installed = fs.readFileSync(path.join(app, 'node_modules', 'mlx-lfm-linux-x64-gnu', 'mlx-lfm.linux-x64-gnu.node'));
    assert.ok(installed.includes(Buffer.from('$ORIGIN/mlx/lib\0')), 'RUNPATH $ORIGIN/mlx/lib');
    assert.ok(!installed.includes(Buffer.from('$ORIGIN/mlx/lib:')), 'the RUNPATH still names the build tree after $ORIGIN');

    fs.writeFileSync(
      path.join(app, 'chat.cjs'),
      `const { Lfm2Model, generateFixture, mlxInfo } = require('mlx-lfm');
(async () => {
  await generateFixture(${JSON.stringify(path.join(app, 'tiny'))}, { preset: 'tiny' });
  const m = await Lfm2Model.load(${JSON.stringify(path.join(app, 'tiny'))});
  const r = await m.chat([{ role: 'user', content: 'Hello' }], { maxTokens: 6 });
  const i = mlxInfo();
  console.log(JSON.stringify({ n: r.usage.completionTokens, finish: r.finishReason, binding: i.binding, reason: i.bindingReason, backend: i.backend, allocator: i.allocator, from: require.resolve('mlx-lfm') }));
  await m.close();
})().catch((e) => { console.error(e); process.exit(1); });
`,
    );
    const run = spawnSync('node', ['chat.cjs'], { cwd: app, env, encoding: 'utf8' });
    assert.strictEqual(run.status, 0, run.stderr);
    const got = JSON.parse(run.stdout.trim().split('\n').pop());
    assert.deepStrictEqual(
      { n: got.n, finish: got.finish, binding: got.binding, backend: got.backend },
      { n: 6, finish: 'length', binding: 'mlx-lfm-linux-x64-gnu', backend: 'cpu' },
    );
    assert.match(got.reason, /mlx-lfm-linux-x64-gnu-cuda is not installed/);
    assert.ok(got.from.startsWith(path.join(app, 'node_modules', 'mlx-lfm')), got.from);

    // The installed CLI runs through the same entry.
    const ver = spawnSync('node', [path.join(app, 'node_modules', 'mlx-lfm', 'cli.cjs'), '--version'], { cwd: app, env, encoding: 'utf8' });
    assert.strictEqual(ver.status, 0, ver.stderr);
    assert.match(ver.stdout, /^mlx-lfm 0\.1\.0 \(MLX 0\.32\.4, cpu backend, default device cpu, native package: mlx-lfm-linux-x64-gnu\)$/m);

    // The platform package carries the allocator the CLI preloads, and the
    // installed CLI runs its model commands under it; a program that
    // requires the package keeps the C library's malloc (chat.cjs above).
    const shipped = path.join(app, 'node_modules', 'mlx-lfm-linux-x64-gnu', 'libmimalloc.so');
    const cli = path.join(app, 'node_modules', 'mlx-lfm', 'cli.cjs');
    const where = spawnSync('node', [cli, 'allocator'], { cwd: app, env, encoding: 'utf8' });
    assert.strictEqual(where.status, 0, where.stderr);
    assert.strictEqual(where.stdout.trim(), shipped);
    const loaded = spawnSync('node', [cli, 'info', '--model', path.join(app, 'tiny')], { cwd: app, env, encoding: 'utf8' });
    assert.strictEqual(loaded.status, 0, loaded.stderr);
    assert.strictEqual(JSON.parse(loaded.stdout).mlx.allocator, shipped);
    assert.match(got.allocator, /libc\.so/);
    // ... unless it is started with the package's preload.
    const pre = spawnSync('node', ['-r', 'mlx-lfm/allocator.cjs', 'chat.cjs'], { cwd: app, env, encoding: 'utf8' });
    assert.strictEqual(pre.status, 0, pre.stderr);
    assert.strictEqual(JSON.parse(pre.stdout.trim().split('\n').pop()).allocator, shipped);

    // A CUDA package that cannot load (here: not a shared object at all, as
    // when its CUDA libraries are missing) falls back to the CPU one, saying why.
    const fake = path.join(app, 'node_modules', 'mlx-lfm-linux-x64-gnu-cuda');
    fs.mkdirSync(fake, { recursive: true });
    fs.writeFileSync(path.join(fake, 'package.json'), JSON.stringify({ name: 'mlx-lfm-linux-x64-gnu-cuda', version: pkg.version, main: 'mlx-lfm.linux-x64-gnu.node' }));
    fs.writeFileSync(path.join(fake, 'mlx-lfm.linux-x64-gnu.node'), 'not a shared object');
    const info = "const i = require('mlx-lfm').mlxInfo(); console.log(JSON.stringify([i.binding, i.bindingReason, i.backend]))";
    const fell = spawnSync('node', ['-e', info], { cwd: app, env: { ...env, MLX_LFM_NVIDIA_GPU: '1' }, encoding: 'utf8' });
    assert.strictEqual(fell.status, 0, fell.stderr);
    const [b, why, backend] = JSON.parse(fell.stdout);
    assert.deepStrictEqual([b, backend], ['mlx-lfm-linux-x64-gnu', 'cpu']);
    assert.match(why, /^mlx-lfm-linux-x64-gnu-cuda could not load \(.*\); using the CPU package$/);
    const noGpu = spawnSync('node', ['-e', info], { cwd: app, env: { ...env, MLX_LFM_NVIDIA_GPU: '0' }, encoding: 'utf8' });
    assert.deepStrictEqual(JSON.parse(noGpu.stdout).slice(0, 2), ['mlx-lfm-linux-x64-gnu', 'the CUDA package is installed but no NVIDIA GPU was found']);
    const forced = spawnSync('node', ['-e', info], { cwd: app, env: { ...env, MLX_LFM_BACKEND: 'cpu', MLX_LFM_NVIDIA_GPU: '1' }, encoding: 'utf8' });
    assert.deepStrictEqual(JSON.parse(forced.stdout).slice(0, 2), ['mlx-lfm-linux-x64-gnu', 'MLX_LFM_BACKEND=cpu']);
    // With no CPU package to fall back to, the error says what CUDA needs.
    const cpuDir = path.join(app, 'node_modules', 'mlx-lfm-linux-x64-gnu');
    fs.renameSync(cpuDir, `${cpuDir}.aside`);
    try {
      const alone = spawnSync('node', ['-e', "require('mlx-lfm')"], { cwd: app, env: { ...env, MLX_LFM_NVIDIA_GPU: '1' }, encoding: 'utf8' });
      assert.notStrictEqual(alone.status, 0);
      assert.match(alone.stderr, /mlx-lfm-linux-x64-gnu-cuda could not load \(.*\): MLX's CUDA build needs the NVIDIA driver and the CUDA 13 libraries .* on LD_LIBRARY_PATH, and no CPU package \(mlx-lfm-linux-x64-gnu\) is installed/);
    } finally {
      fs.renameSync(`${cpuDir}.aside`, cpuDir);
    }
    fs.rmSync(fake, { recursive: true });

    // Asking for CUDA without its package is an error that says how to get it.
    const cuda = spawnSync('node', ['-e', "require('mlx-lfm')"], { cwd: app, env: { ...env, MLX_LFM_BACKEND: 'cuda' }, encoding: 'utf8' });
    assert.notStrictEqual(cuda.status, 0);
    assert.match(cuda.stderr, /MLX_LFM_BACKEND=cuda, but mlx-lfm-linux-x64-gnu-cuda is not installed: npm install mlx-lfm-linux-x64-gnu-cuda/);
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
});

// Every platform package, the ones this machine cannot build too (a Mac's
// darwin-arm64): named, versioned and restricted as npm and our loader
// expect, carrying the .node the loader asks for and MLX's libraries.
test('every npm/ platform package is laid out for the loader', () => {
  const rootPkg = require('../package.json');
  const expect = {
    'linux-x64-gnu': { os: 'linux', cpu: 'x64', node: 'linux-x64-gnu', libc: 'glibc' },
    'linux-x64-gnu-cuda': { os: 'linux', cpu: 'x64', node: 'linux-x64-gnu', libc: 'glibc' },
    'linux-arm64-gnu': { os: 'linux', cpu: 'arm64', node: 'linux-arm64-gnu', libc: 'glibc' },
    'darwin-arm64': { os: 'darwin', cpu: 'arm64', node: 'darwin-arm64' },
  };
  assert.deepStrictEqual(fs.readdirSync(path.join(root, 'npm')).sort(), Object.keys(expect).sort());
  for (const [dir, e] of Object.entries(expect)) {
    const pkg = JSON.parse(fs.readFileSync(path.join(root, 'npm', dir, 'package.json'), 'utf8'));
    assert.strictEqual(pkg.name, `mlx-lfm-${dir}`, dir);
    assert.strictEqual(pkg.version, rootPkg.version, dir);
    assert.deepStrictEqual(pkg.os, [e.os], dir);
    assert.deepStrictEqual(pkg.cpu, [e.cpu], dir);
    if (e.libc) assert.deepStrictEqual(pkg.libc, [e.libc], dir);
    assert.strictEqual(pkg.main, `mlx-lfm.${e.node}.node`, dir);
    assert.ok(pkg.files.includes(pkg.main) && pkg.files.includes('mlx/lib/'), `${dir}: files ${pkg.files}`);
    // (Linux: the allocator the CLI preloads, lib/allocator.cjs.)
    assert.strictEqual(pkg.files.includes('libmimalloc.so'), e.os === 'linux', `${dir}: files ${pkg.files}`);
    assert.ok(fs.existsSync(path.join(root, 'npm', dir, 'README.md')), dir);
  }
  // The loader asks for exactly these packages (plus -cuda on linux-x64).
  const { PLATFORMS } = require('../lib/backend.cjs');
  assert.deepStrictEqual(
    [...Object.values(PLATFORMS), 'linux-x64-gnu-cuda'].sort(),
    Object.keys(expect).sort(),
  );
});
