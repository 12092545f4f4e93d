#!/usr/bin/env node
// KV cache quality / size / speed report (GitHub issue 7): builds and runs the
// `kv_quality` Rust binary (src/bin/kv_quality.rs), which works on a generated
// checkpoint without Node in the loop.
//
//   node scripts/kv-quality.cjs [--preset lfm2-350m|tiny] [--dtype f32|bf16]
//        [--mode study,quality,bench] [--context 4096] [--steps 64]
//        [--backends default,affine8,affine4,rotorquant-dense,rotorquant-quaternion,rotorquant-adaptive]
//        [--bench-prompt 1024] [--bench-gen 32] [--reps 2]
//
// Defaults: lfm2-350m shape in float32 (faster than bf16 on CPU), a 4096-token
// context, 64 teacher-forced decode steps, all modes. Tables go to stdout.
'use strict';
const { spawnSync } = require('node:child_process');
const path = require('node:path');

const root = path.resolve(__dirname, '..');
const target = process.env.MLX_LFM_TARGET || 'x86_64-unknown-linux-gnu';
const args = process.argv.slice(2);
if (args.includes('--help') || args.includes('-h')) {
  console.log(require('node:fs').readFileSync(__filename, 'utf8').split('\n').slice(1, 13).join('\n'));
  process.exit(0);
}
const build = spawnSync('cargo', ['build', '--release', '--target', target, '--bin', 'kv_quality'], { cwd: root, stdio: 'inherit' });
if (build.status !== 0) process.exit(build.status ?? 1);
const bin = path.join(root, 'target', target, 'release', 'kv_quality');
const run = spawnSync(bin, args, { cwd: root, stdio: 'inherit' });
process.exit(run.status ?? 1);
