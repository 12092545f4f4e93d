#!/bin/bash
# The mimalloc the `mimalloc` A/B variant of run.py preloads under our bench:
# the very library the `mlx-lfm` command preloads on Linux
# (scripts/mimalloc.cjs builds it), built here, not on the device (it has
# no network): the .so travels in .device/bin.
set -eu
top=$(git rev-parse --show-toplevel); cd "$top"
node scripts/mimalloc.cjs .device/bin/libmimalloc.so --optional
