#!/usr/bin/env node
// The README's commands: `npm run demo`, `npm test` (yarn runs them too),
// `npm run bench`. Each installs and builds what it needs by itself, so they
// work on a fresh clone: npm dependencies, the MLX wheel (through
// build.rs), the addon, and for tests and benchmarks the mlx-lm reference.
'use strict';
const { spawnSync } = require('node:child_process');
const fs = require('node:fs');
const path = require('node:path');

const root = path.resolve(__dirname, '..');

function run(cmd, args, opts = {}) {
  console.error(`\n$ ${cmd} ${args.join(' ')}`);
  const r = spawnSync(cmd, args, { cwd: root, stdio: 'inherit', ...opts });
  if (r.error) {
    console.error(`mlx-lfm: could not run ${cmd}: ${r.error.message}`);
    process.exit(1);
  }
  if (r.status !== 0) process.exit(r.status ?? 1);
}

function hostTriple() {
  const r = spawnSync('rustc', ['-vV'], { encoding: 'utf8' });
  if (r.status !== 0) {
    console.error('mlx-lfm: a Rust toolchain (rustc, cargo) is needed to build the addon: https://rustup.rs');
    process.exit(1);
  }
  return /host: (\S+)/.exec(r.stdout)[1];
}

function ensureDeps() {
  // Installed again whenever the lockfile changed since the last install
  // (a pull that adds a devDependency), not only when node_modules is gone.
  const lock = fs.readFileSync(path.join(root, 'package-lock.json'));
  const hash = require('node:crypto').createHash('sha256').update(lock).digest('hex');
  const stamp = path.join(root, 'node_modules', '.mlx-lfm-lock-sha256');
  if (fs.existsSync(stamp) && fs.readFileSync(stamp, 'utf8') === hash) return;
  // One lockfile (package-lock.json), also when invoked through yarn: a
  // second one drifted from it.
  run('npm', ['ci', '--no-audit', '--no-fund']);
  fs.writeFileSync(stamp, hash);
}

function build() {
  ensureDeps();
  const before = fs.readFileSync(path.join(root, 'index.d.cts'), 'utf8');
  const cliDir = path.dirname(require.resolve('@napi-rs/cli/package.json', { paths: [root] }));
  run(process.execPath, [path.join(cliDir, 'dist', 'cli.js'),
    'build', '--platform', '--release', '--js', 'index.cjs', '--dts', 'index.d.cts']);
  // The allocator the `mlx-lfm` command preloads on Linux, beside the .node
  // (lib/allocator.cjs); without it (no network on a first build) the
  // command runs with glibc's malloc, slower on CUDA.
  if (process.platform === 'linux') {
    run(process.execPath, [path.join(root, 'scripts', 'mimalloc.cjs'), path.join(root, 'libmimalloc.so'), '--optional']);
  }
  return before;
}

function python() {
  return process.env.MLX_LFM_PYTHON || 'python3';
}

// mlx-lm 0.32.2 on the CPU MLX wheel, pinned, in .pyref/ (for parity and bench).
function ensureReference() {
  const dir = path.join(root, '.pyref');
  const stamp = path.join(dir, '.complete');
  const req = path.join(root, 'scripts', 'ref', 'requirements.txt');
  const want = fs.readFileSync(req, 'utf8');
  if (fs.existsSync(stamp) && fs.readFileSync(stamp, 'utf8') === want) return dir;
  fs.rmSync(dir, { recursive: true, force: true });
  // A --target install touches no system packages: pip's warning about
  // running as root (CI machines do) does not apply.
  run(python(), ['-m', 'pip', 'install', '--quiet', '--disable-pip-version-check', '--no-deps',
    '--target', dir, '-r', req], { env: { ...process.env, PIP_ROOT_USER_ACTION: 'ignore' } });
  fs.writeFileSync(stamp, want);
  return dir;
}

function testFiles() {
  const dir = path.join(root, '__test__');
  return fs.readdirSync(dir).filter((f) => f.endsWith('.test.cjs')).sort().map((f) => path.join('__test__', f));
}

const cmd = process.argv[2];
const rest = process.argv.slice(3);
if (cmd === 'demo') {
  build();
  run(process.execPath, [path.join(root, 'cli.cjs'), 'chat', ...(rest.length ? rest : ['--prompt', 'Hello! What can you do?'])]);
} else if (cmd === 'test') {
  const before = build();
  const after = fs.readFileSync(path.join(root, 'index.d.cts'), 'utf8');
  if (before !== after) {
    console.error('mlx-lfm: index.d.cts changed when rebuilt; commit the regenerated file.');
    process.exit(1);
  }
  const pyref = ensureReference();
  const env = { ...process.env, MLX_LFM_PYREF: pyref };
  run('cargo', ['test', '--release', '--target', hostTriple(), '--lib'], { env });
  run(process.execPath, ['--test', '--test-concurrency=1', ...testFiles()], { env });
} else if (cmd === 'build') {
  build();
} else if (cmd === 'bench' || cmd === 'bench-turns' || cmd === 'bench-concurrent' || cmd === 'bench-restart') {
  build();
  const pyref = ensureReference();
  const script = `${cmd}.cjs`;
  run(process.execPath, [path.join(root, 'scripts', script), ...rest], { env: { ...process.env, MLX_LFM_PYREF: pyref } });
} else {
  console.error('usage: node scripts/run.cjs demo|test|build|bench|bench-turns|bench-concurrent|bench-restart [args]');
  process.exit(2);
}
