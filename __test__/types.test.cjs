'use strict';
// The published types say what the values are: a strict program using them
// compiles, and one that assigns a finishReason the API never returns does
// not (so the unions are not silently `string` again).
const test = require('node:test');
const assert = require('node:assert/strict');
const path = require('node:path');
const { spawnSync } = require('node:child_process');
const { root } = require('./helpers.cjs');

const tsc = require.resolve('typescript/bin/tsc', { paths: [root] });

function compile(file) {
  const r = spawnSync(process.execPath, [
    tsc, '--strict', '--noEmit', '--pretty', 'false', '--target', 'es2022', '--module', 'nodenext',
    '--moduleResolution', 'nodenext', '--types', 'node', path.join(__dirname, 'types', file),
  ], { cwd: root, encoding: 'utf8' });
  assert.equal(r.error, undefined);
  return { status: r.status, out: (r.stdout + r.stderr).trim() };
}

test('a strict TypeScript program using the types compiles', () => {
  const r = compile('usage.ts');
  assert.equal(r.out, '');
  assert.equal(r.status, 0);
});

test('assigning finishReason a value it never has does not compile', () => {
  const r = compile('wrong-finish-reason.ts');
  assert.equal(r.status, 2);
  assert.equal(
    r.out,
    `__test__/types/wrong-finish-reason.ts(7,3): error TS2322: Type '"done"' is not assignable to type '"length" | "stop" | "abort" | "tool_calls" | "constraint"'.`,
  );
});
