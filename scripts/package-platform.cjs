#!/usr/bin/env node
// Lays out this platform's npm package (npm/<platform>/): the built .node
// plus the MLX wheel's libmlx and bundled libraries in the wheel's own
// layout (mlx/lib/ and <wheel>.libs/), which the .node's RUNPATH
// ($ORIGIN/mlx/lib on Linux, @loader_path/mlx/lib on macOS) and libmlx's own
// RPATH ($ORIGIN/../../<wheel>.libs) find. Prints the package's size.
'use strict';
const fs = require('node:fs');
const path = require('node:path');
const { spawnSync } = require('node:child_process');

const root = path.resolve(__dirname, '..');
const platform = { 'linux-x64': 'linux-x64-gnu', 'linux-arm64': 'linux-arm64-gnu', 'darwin-arm64': 'darwin-arm64' }[`${process.platform}-${process.arch}`];
if (!platform) throw new Error(`no npm platform package for ${process.platform}-${process.arch}`);
const nodeFile = `mlx-lfm.${platform}.node`;
if (!fs.existsSync(path.join(root, nodeFile))) throw new Error(`${nodeFile} is not built; run \`npm run build\` first`);

const mlxRoot = process.env.MLX_DIR || (() => {
  const base = path.join(root, '.mlx');
  const dirs = fs.readdirSync(base).filter((d) => !d.endsWith('.partial'));
  if (dirs.length !== 1) throw new Error(`expected one MLX install in ${base}, found: ${dirs.join(', ')}`);
  return path.join(base, dirs[0]);
})();

const out = path.join(root, 'npm', platform);
for (const e of fs.readdirSync(out)) if (e !== 'package.json' && e !== 'README.md') fs.rmSync(path.join(out, e), { recursive: true });
fs.copyFileSync(path.join(root, nodeFile), path.join(out, nodeFile));
const carried = [nodeFile];
fs.mkdirSync(path.join(out, 'mlx'), { recursive: true });
fs.cpSync(path.join(mlxRoot, 'mlx', 'lib'), path.join(out, 'mlx', 'lib'), { recursive: true });
carried.push('mlx/lib/');
for (const d of fs.readdirSync(mlxRoot)) {
  if (d.endsWith('.libs')) {
    fs.cpSync(path.join(mlxRoot, d), path.join(out, d), { recursive: true });
    carried.push(`${d}/`);
  }
}
const pkgPath = path.join(out, 'package.json');
const pkg = JSON.parse(fs.readFileSync(pkgPath, 'utf8'));
pkg.files = carried;
fs.writeFileSync(pkgPath, JSON.stringify(pkg, null, 2) + '\n');

function size(p) {
  const st = fs.statSync(p);
  return st.isDirectory() ? fs.readdirSync(p).reduce((n, e) => n + size(path.join(p, e)), 0) : st.size;
}
console.log(`npm/${platform}: ${carried.join(' ')} = ${(size(out) / 1e6).toFixed(1)} MB`);
if (process.platform === 'linux') {
  const ldd = spawnSync('ldd', [path.join(out, nodeFile)], { encoding: 'utf8' }).stdout;
  const line = ldd.split('\n').find((l) => l.includes('libmlx.so')) || '';
  console.log(`ldd: ${line.trim()}`);
  if (!line.includes(out)) throw new Error('libmlx did not resolve next to the .node through $ORIGIN');
}
