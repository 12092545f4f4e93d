#!/bin/bash
# Builds mimalloc (v2, from the libmimalloc-sys crate's bundled C source,
# pinned by version and hash) as a shared library that replaces malloc and
# free when preloaded: the `mimalloc` A/B variant of run.py runs our bench
# under LD_PRELOAD of it. Session 18's host profile of the H200 decode put
# 28-36% of the decoding thread's samples in libc, most of them in glibc's
# malloc and free and their arena locks; on this CPU the preloaded mimalloc
# cut the compiled step's build time by about a quarter. Here, not on the
# device (it has no network): the .so travels in .device/bin.
set -eu
top=$(git rev-parse --show-toplevel); cd "$top"
ver=0.1.44
sum=667f4fec20f29dfc6bc7357c582d91796c169ad7e2fce709468aefeb2c099870
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
if ! curl -sSfL -o "$work/mi.crate" "https://static.crates.io/crates/libmimalloc-sys/libmimalloc-sys-$ver.crate"; then
  echo "mimalloc.sh: could not fetch libmimalloc-sys $ver from crates.io; the mimalloc variant will be missing" >&2
  exit 0
fi
echo "$sum  $work/mi.crate" | sha256sum -c --quiet
tar xzf "$work/mi.crate" -C "$work"
src="$work/libmimalloc-sys-$ver/c_src/mimalloc/v2"
mkdir -p .device/bin
# One translation unit (static.c includes the rest); MI_MALLOC_OVERRIDE
# exports malloc, free and the rest under their libc names; the flags the
# crate's own build uses (no debug checks, initial-exec TLS: a preloaded
# library's thread-locals are reached without __tls_get_addr).
cc -O2 -fPIC -shared -ftls-model=initial-exec -DMI_MALLOC_OVERRIDE -DMI_DEBUG=0 -DNDEBUG -I "$src/include" \
  "$src/src/static.c" -o .device/bin/libmimalloc.so -lpthread
strip .device/bin/libmimalloc.so
