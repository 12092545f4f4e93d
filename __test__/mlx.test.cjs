'use strict';
const test = require('node:test');
const assert = require('node:assert/strict');
const { addon } = require('./helpers.cjs');

test('mlxInfo reports the pinned MLX and its backend', () => {
  const info = addon.mlxInfo();
  assert.equal(info.version, '0.32.4');
  assert.ok(['cpu', 'cuda', 'metal'].includes(info.backend), info.backend);
  assert.ok(['cpu', 'gpu'].includes(info.defaultDevice));
  assert.equal(typeof info.memory.activeBytes, 'number');
  assert.ok(info.memory.limitBytes > 0);
});

test('an MLX computation runs off the JS thread', async () => {
  const y = await addon.mlxMatmul(new Float32Array([1, 2, 3, 4]), [2, 2], new Float32Array([5, 6, 7, 8]), [2, 2]);
  assert.deepEqual(Array.from(y), [19, 22, 43, 50]);
});

test('an MLX exception arrives as a JS Error with MLX\'s message, and the process keeps working', async () => {
  await assert.rejects(
    addon.mlxMatmul(new Float32Array([1, 2, 3, 4]), [2, 2], new Float32Array([1, 2, 3]), [3, 1]),
    (e) => e instanceof Error && /\[matmul\]/.test(e.message) && /\(2,2\)/.test(e.message),
  );
  await assert.rejects(
    addon.mlxMatmul(new Float32Array([1, 2, 3]), [2, 2], new Float32Array([1]), [1, 1]),
    /needs 16 bytes, got 12/,
  );
  const y = await addon.mlxMatmul(new Float32Array([2]), [1, 1], new Float32Array([3]), [1, 1]);
  assert.deepEqual(Array.from(y), [6]);
});
