'use strict';
// Preloaded with `node -r mlx-lfm/allocator.cjs app.js` (or
// NODE_OPTIONS="-r mlx-lfm/allocator.cjs"): on Linux, restarts the program
// in place (execve: same pid, signals and exit status) under the allocator
// the `mlx-lfm` command uses (mimalloc, shipped beside the native addon;
// lib/allocator.cjs says why), for a program that requires the package and
// cannot set LD_PRELOAD itself. Elsewhere, in a worker thread (whose
// process is the main thread's), or with MLX_LFM_ALLOCATOR=system, it does
// nothing.
const allocator = require('./lib/allocator.cjs');

if (require('node:worker_threads').isMainThread) {
  try {
    allocator.execUnder();
  } catch (e) {
    throw new Error(`mlx-lfm/allocator.cjs: ${e.message}`);
  }
}
