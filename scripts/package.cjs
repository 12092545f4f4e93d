#!/usr/bin/env node
// `npm run package [-- --out DIR] [--cuda] [--no-build]`: builds what this
// machine can and packs every npm tarball into one folder (default dist/).
//
// - the addon (`npm run build`) unless its .node is there (or --no-build);
// - this platform's package, npm/<platform>/: the .node and the MLX wheel's
//   libraries in the wheel's own layout (mlx/lib/ and <wheel>.libs/), which
//   the .node's RUNPATH ($ORIGIN/mlx/lib, @loader_path/mlx/lib on macOS) and
//   libmlx's own RPATH find: linux-x64-gnu with MLX's CPU build here,
//   darwin-arm64 with the Metal build on a Mac;
// - on Linux x64 with --cuda (or MLX_LFM_CUDA_WHEEL=path/to/mlx_cuda_13.whl)
//   the CUDA flavour npm/linux-x64-gnu-cuda/: the same .node (built against
//   the same MLX version's headers) with MLX's CUDA 13 build;
// - the root package, whose packed package.json lists every platform package
//   in optionalDependencies at its own version. The source package.json lists
//   none, so `npm ci` in a clone never asks the registry for packages that
//   are not published yet.
'use strict';
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');
const { spawnSync } = require('node:child_process');

const root = path.resolve(__dirname, '..');
const args = process.argv.slice(2);
const opt = (name) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : undefined;
};
const known = new Set(['--out', '--cuda', '--no-build']);
for (let i = 0; i < args.length; i++) {
  if (!known.has(args[i])) {
    console.error(`mlx-lfm package: unknown argument ${args[i]} (use --out DIR, --cuda, --no-build)`);
    process.exit(2);
  }
  if (args[i] === '--out') i++;
}
const out = path.resolve(opt('--out') || path.join(root, 'dist'));
const MLX_VERSION = '0.32.4';

function run(cmd, argv, o = {}) {
  const r = spawnSync(cmd, argv, { cwd: root, encoding: 'utf8', ...o });
  if (r.error || r.status !== 0) {
    throw new Error(`${cmd} ${argv.join(' ')} failed: ${r.error ? r.error.message : (r.stderr || '').trim().slice(-2000)}`);
  }
  return r.stdout;
}

function size(p) {
  const st = fs.statSync(p);
  return st.isDirectory() ? fs.readdirSync(p).reduce((n, e) => n + size(path.join(p, e)), 0) : st.size;
}

const PLATFORMS = { 'linux-x64': 'linux-x64-gnu', 'linux-arm64': 'linux-arm64-gnu', 'darwin-arm64': 'darwin-arm64' };
const platform = PLATFORMS[`${process.platform}-${process.arch}`];
if (!platform) throw new Error(`no npm platform package for ${process.platform}-${process.arch}`);
const nodeFile = `mlx-lfm.${platform}.node`;
if (!fs.existsSync(path.join(root, nodeFile)) && !args.includes('--no-build')) {
  console.error('building the addon (npm run build)...');
  run(process.execPath, [path.join(root, 'scripts', 'run.cjs'), 'build'], { stdio: 'inherit' });
}
if (!fs.existsSync(path.join(root, nodeFile))) throw new Error(`${nodeFile} is not built; run \`npm run build\` first`);

/** npm/<dir>/ with the .node and the MLX libraries of `mlxRoot` (a pip --target folder). */
function layout(dir, mlxRoot) {
  const pkgDir = path.join(root, 'npm', dir);
  for (const e of fs.readdirSync(pkgDir)) {
    if (e !== 'package.json' && e !== 'README.md') fs.rmSync(path.join(pkgDir, e), { recursive: true });
  }
  fs.copyFileSync(path.join(root, nodeFile), path.join(pkgDir, nodeFile));
  dropBuildRunpath(path.join(pkgDir, nodeFile));
  const carried = [nodeFile, 'mlx/lib/'];
  fs.mkdirSync(path.join(pkgDir, 'mlx'), { recursive: true });
  fs.cpSync(path.join(mlxRoot, 'mlx', 'lib'), path.join(pkgDir, 'mlx', 'lib'), { recursive: true });
  // The allocator the `mlx-lfm` command preloads (lib/allocator.cjs),
  // beside the .node where it looks for it (built again where it is of an
  // older pin: a package never carries one).
  if (process.platform === 'linux') {
    const lib = path.join(root, 'libmimalloc.so');
    run(process.execPath, [path.join(root, 'scripts', 'mimalloc.cjs'), lib], { stdio: 'inherit' });
    fs.copyFileSync(lib, path.join(pkgDir, 'libmimalloc.so'));
    carried.push('libmimalloc.so');
  }
  // MLX's CUDA build compiles kernels at run time (NVRTC) and looks for the
  // CCCL headers its wheel bundles at <libmlx's folder>/../include/cccl;
  // without them every JIT kernel (gathers, our fused kernels) fails to
  // compile on the user's GPU.
  const cccl = path.join(mlxRoot, 'mlx', 'include', 'cccl');
  if (fs.existsSync(cccl)) {
    fs.cpSync(cccl, path.join(pkgDir, 'mlx', 'include', 'cccl'), { recursive: true });
    carried.push('mlx/include/cccl/');
  }
  for (const d of fs.readdirSync(mlxRoot)) {
    if (d.endsWith('.libs')) {
      fs.cpSync(path.join(mlxRoot, d), path.join(pkgDir, d), { recursive: true });
      carried.push(`${d}/`);
    }
  }
  const pkgPath = path.join(pkgDir, 'package.json');
  const pkg = JSON.parse(fs.readFileSync(pkgPath, 'utf8'));
  pkg.files = carried;
  pkg.main = nodeFile;
  fs.writeFileSync(pkgPath, JSON.stringify(pkg, null, 2) + '\n');
  if (process.platform === 'linux') {
    // The .node must find libmlx beside it ($ORIGIN), not the build's .mlx/.
    const ldd = spawnSync('ldd', [path.join(pkgDir, nodeFile)], { encoding: 'utf8' }).stdout || '';
    const line = ldd.split('\n').find((l) => l.includes('libmlx.so')) || '';
    if (!line.includes(pkgDir) && !line.includes('not found')) {
      throw new Error(`npm/${dir}: libmlx resolves to ${line.trim()}, not to the package's own mlx/lib`);
    }
  }
  return pkgDir;
}

/**
 * The build gives the .node two library paths: its own folder's mlx/lib
 * (what a package uses) and, after it, the build machine's MLX (what a
 * clone uses). A published .node keeps only the first: the second names a
 * folder of the machine that built it, which on a user's machine is absent
 * or, worse, another MLX.
 */
function dropBuildRunpath(file) {
  if (process.platform === 'darwin') {
    // The LC_RPATH entries other than @loader_path's are the build's.
    const out = spawnSync('otool', ['-l', file], { encoding: 'utf8' }).stdout || '';
    for (const m of out.matchAll(/path (\/[^ ]+) \(offset/g)) {
      const r = spawnSync('install_name_tool', ['-delete_rpath', m[1], file], { encoding: 'utf8' });
      if (r.status !== 0) throw new Error(`install_name_tool -delete_rpath ${m[1]} failed: ${r.stderr}`);
    }
    return;
  }
  // ELF: RUNPATH is one NUL-terminated string in .dynstr,
  // "$ORIGIN/mlx/lib:/build/.../mlx/lib". Ending it at the colon (one byte,
  // so no offset moves) leaves "$ORIGIN/mlx/lib".
  const buf = fs.readFileSync(file);
  const head = Buffer.from('$ORIGIN/mlx/lib:/');
  const at = buf.indexOf(head);
  if (at < 0) {
    if (buf.includes(Buffer.from('$ORIGIN/mlx/lib\0'))) return; // already portable
    throw new Error(`${file}: no RUNPATH starting "$ORIGIN/mlx/lib"; was it built by build.rs?`);
  }
  buf[at + head.length - 2] = 0;
  fs.writeFileSync(file, buf);
}

function cpuMlxRoot() {
  if (process.env.MLX_DIR) return process.env.MLX_DIR;
  const base = path.join(root, '.mlx');
  const dirs = fs.readdirSync(base).filter((d) => !d.endsWith('.partial') && !d.startsWith('cuda'));
  if (dirs.length !== 1) throw new Error(`expected one MLX install in ${base}, found: ${dirs.join(', ')}`);
  return path.join(base, dirs[0]);
}

/** MLX's CUDA 13 wheel unpacked into .mlx/cuda-<version>/ (downloaded with pip when not given). */
function cudaMlxRoot() {
  const dir = path.join(root, '.mlx', `cuda-${MLX_VERSION}`);
  if (fs.existsSync(path.join(dir, 'mlx', 'lib', 'libmlx.so')) && fs.existsSync(path.join(dir, 'mlx', 'include', 'cccl'))) return dir;
  let wheel = process.env.MLX_LFM_CUDA_WHEEL;
  if (!wheel) {
    const dl = fs.mkdtempSync(path.join(os.tmpdir(), 'mlx-cuda-'));
    console.error(`downloading mlx-cuda-13==${MLX_VERSION} (about 90 MB)...`);
    run(process.env.MLX_LFM_PYTHON || 'python3', ['-m', 'pip', 'download', '--quiet', '--no-deps', '--only-binary=:all:',
      '--platform', 'manylinux_2_35_x86_64', '--python-version', '3.12', '-d', dl, `mlx-cuda-13==${MLX_VERSION}`]);
    wheel = path.join(dl, fs.readdirSync(dl).find((f) => f.endsWith('.whl')));
  }
  const partial = `${dir}.partial`;
  fs.rmSync(partial, { recursive: true, force: true });
  fs.mkdirSync(partial, { recursive: true });
  // A wheel is a zip; Python's zipfile is the unzip every machine here has.
  run(process.env.MLX_LFM_PYTHON || 'python3', ['-c',
    'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); ' +
    "[z.extract(n, sys.argv[2]) for n in z.namelist() if n.startswith(('mlx/lib/', 'mlx/include/cccl/', 'mlx_cuda_13.libs/'))]",
    wheel, partial]);
  fs.rmSync(dir, { recursive: true, force: true });
  fs.renameSync(partial, dir);
  return dir;
}

fs.mkdirSync(out, { recursive: true });
const tarballs = [];
function pack(dir) {
  const name = run('npm', ['pack', '--silent', '--pack-destination', out], { cwd: dir }).trim().split('\n').pop();
  const file = path.join(out, name);
  tarballs.push(file);
  console.log(`${path.relative(root, dir) || '.'} -> ${path.relative(process.cwd(), file)}: ` +
    `${(size(dir === root ? file : dir) / 1e6).toFixed(1)} MB ${dir === root ? 'packed' : 'unpacked'}, ${(fs.statSync(file).size / 1e6).toFixed(1)} MB packed`);
}

pack(layout(platform, cpuMlxRoot()));
if (platform === 'linux-x64-gnu' && (args.includes('--cuda') || process.env.MLX_LFM_CUDA_WHEEL)) {
  pack(layout('linux-x64-gnu-cuda', cudaMlxRoot()));
}

// The root package: staged, with optionalDependencies for every platform
// package (at its own version) and nothing a user's install does not need.
const stage = fs.mkdtempSync(path.join(os.tmpdir(), 'mlx-lfm-root-'));
const rootPkg = JSON.parse(fs.readFileSync(path.join(root, 'package.json'), 'utf8'));
for (const f of rootPkg.files) fs.cpSync(path.join(root, f), path.join(stage, f), { recursive: true });
fs.copyFileSync(path.join(root, 'README.md'), path.join(stage, 'README.md'));
const optional = {};
for (const d of fs.readdirSync(path.join(root, 'npm')).sort()) {
  const p = JSON.parse(fs.readFileSync(path.join(root, 'npm', d, 'package.json'), 'utf8'));
  if (p.version !== rootPkg.version) throw new Error(`npm/${d} is at ${p.version}, the root at ${rootPkg.version}`);
  optional[p.name] = p.version;
}
const published = { ...rootPkg, optionalDependencies: optional };
delete published.devDependencies;
delete published.scripts;
fs.writeFileSync(path.join(stage, 'package.json'), JSON.stringify(published, null, 2) + '\n');
pack(stage);
fs.rmSync(stage, { recursive: true, force: true });
console.log(`${tarballs.length} tarball(s) in ${out}`);
