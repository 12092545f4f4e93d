#!/usr/bin/env node
// Builds libmimalloc.so, the allocator the `mlx-lfm` command preloads on
// Linux (lib/allocator.cjs). A decode step's host time is mostly MLX's
// per-node bookkeeping, and much of that glibc's malloc and free: on the
// H200, mimalloc preloaded decoded the 350M 1.54x and the 8B-A1B 1.30x as
// fast as glibc (session 21's paired A/B, bench/results/
// 2026-12-04-h200-session21.raw.jsonl). The addon cannot swap the
// allocator of a running process (libc's malloc is bound first), hence a
// library to preload, shipped beside the .node.
//
// Source: mimalloc v2 as the libmimalloc-sys crate bundles it, fetched from
// crates.io (a package registry, like the MLX wheel build.rs fetches from
// PyPI), pinned by version and SHA-256, cached in .mimalloc/.
//
//   node scripts/mimalloc.cjs OUT.so [--optional]
//
// Builds OUT.so unless it is there with OUT.so.pin naming the pinned
// version and hash (a library of an older pin is built again).
// --optional: a failure (no network, no C compiler) is a warning and exit 0
// (a source build without it still works, with glibc's malloc).
'use strict';
const { spawnSync } = require('node:child_process');
const crypto = require('node:crypto');
const fs = require('node:fs');
const os = require('node:os');
const path = require('node:path');

const VERSION = '0.1.44';
const SHA256 = '667f4fec20f29dfc6bc7357c582d91796c169ad7e2fce709468aefeb2c099870';
const URL = `https://static.crates.io/crates/libmimalloc-sys/libmimalloc-sys-${VERSION}.crate`;
const root = path.resolve(__dirname, '..');

function run(cmd, args) {
  const r = spawnSync(cmd, args, { encoding: 'utf8' });
  if (r.error) throw new Error(`could not run ${cmd}: ${r.error.message}`);
  if (r.status !== 0) throw new Error(`${cmd} ${args.join(' ')} failed (${r.status}):\n${(r.stderr || '').slice(-2000)}`);
}

async function crate() {
  const dir = path.join(root, '.mimalloc');
  const file = path.join(dir, `libmimalloc-sys-${VERSION}.crate`);
  const ok = (buf) => crypto.createHash('sha256').update(buf).digest('hex') === SHA256;
  if (fs.existsSync(file) && ok(fs.readFileSync(file))) return file;
  const res = await fetch(URL);
  if (!res.ok) throw new Error(`GET ${URL}: HTTP ${res.status}`);
  const buf = Buffer.from(await res.arrayBuffer());
  if (!ok(buf)) throw new Error(`${URL}: SHA-256 is not the pinned ${SHA256}`);
  fs.mkdirSync(dir, { recursive: true });
  fs.writeFileSync(file, buf);
  return file;
}

async function build(out) {
  if (process.platform !== 'linux') throw new Error(`only Linux preloads an allocator (this is ${process.platform})`);
  const work = fs.mkdtempSync(path.join(os.tmpdir(), 'mlx-lfm-mimalloc-'));
  try {
    run('tar', ['xzf', await crate(), '-C', work]);
    const src = path.join(work, `libmimalloc-sys-${VERSION}`, 'c_src', 'mimalloc', 'v2');
    const tmp = path.join(work, 'libmimalloc.so');
    // One translation unit (static.c includes the rest). MI_MALLOC_OVERRIDE
    // exports malloc, free, operator new's targets and the rest under libc's
    // names; the crate's own flags otherwise (no debug checks; initial-exec
    // TLS, which a preloaded library may use and which keeps its
    // thread-locals off __tls_get_addr).
    run(process.env.CC || 'cc', ['-O2', '-fPIC', '-shared', '-ftls-model=initial-exec', '-DMI_MALLOC_OVERRIDE',
      '-DMI_DEBUG=0', '-DNDEBUG', '-I', path.join(src, 'include'), path.join(src, 'src', 'static.c'), '-o', tmp,
      '-lpthread', '-s']);
    fs.mkdirSync(path.dirname(path.resolve(out)), { recursive: true });
    fs.copyFileSync(tmp, out);
  } finally {
    fs.rmSync(work, { recursive: true, force: true });
  }
}

async function main() {
  const args = process.argv.slice(2);
  const optional = args.includes('--optional');
  const out = args.find((a) => !a.startsWith('--'));
  if (!out) {
    console.error('usage: node scripts/mimalloc.cjs OUT.so [--optional]');
    process.exit(2);
  }
  const stamp = `${out}.pin`;
  const pin = `${VERSION} ${SHA256}\n`;
  if (fs.existsSync(out) && fs.existsSync(stamp) && fs.readFileSync(stamp, 'utf8') === pin) return;
  try {
    fs.rmSync(stamp, { force: true });
    await build(out);
    fs.writeFileSync(stamp, pin);
  } catch (e) {
    if (!optional) {
      console.error(`mlx-lfm: could not build ${out}: ${e.message}`);
      process.exit(1);
    }
    console.error(`mlx-lfm: warning: no ${path.basename(out)} (${e.message}); the mlx-lfm command runs with glibc's malloc`);
  }
}

main();
