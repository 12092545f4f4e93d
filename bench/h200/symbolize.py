#!/usr/bin/env python3
"""Names the decoding thread's samples of `mlx-lfm-bench --host-profile`
by the libraries' own symbol tables (dladdr, in the bench, sees only the
exported symbols; the wheel's libmlx.so keeps its full table).

    python3 bench/h200/symbolize.py RECORDS.jsonl LIB=PATH [LIB=PATH ...] [--top N]

RECORDS: lines holding a `host_profile` object (the bench's own line, or
run.py's `host-profile` records, which carry the model). LIB=PATH: a
library as the profile names it and the file to read its symbols from, e.g.
libmlx.so=/tmp/mlxcuda/mlx/lib/libmlx.so (the same wheel as on the device:
`cat .device/a/cuda.part.aa .device/b/cuda.part.ab > w.whl` and unzip it).
Prints, per record, the share of samples by function (self time) and by
library."""
import bisect
import json
import subprocess
import sys


def table(path):
    out = subprocess.run(["nm", "-C", "-n", "--defined-only", path], capture_output=True, text=True).stdout
    addrs, names = [], []
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] in "TtWw":
            addrs.append(int(parts[0], 16))
            names.append(parts[2])
    return addrs, names


def main():
    args = sys.argv[1:]
    top = 40
    if "--top" in args:
        i = args.index("--top")
        top = int(args[i + 1])
        del args[i:i + 2]
    records, libs = args[0], dict(a.split("=", 1) for a in args[1:])
    tables = {lib: table(path) for lib, path in libs.items()}
    for line in open(records):
        if "host_profile" not in line:
            continue
        r = json.loads(line)
        prof = r["host_profile"]
        total = prof.get("decoding_thread_samples") or 1
        by_fn = {}
        for lib, offs in prof.get("offsets", {}).items():
            for off, count in offs:
                off = int(off, 16)
                name = "?"
                if lib in tables:
                    addrs, names = tables[lib]
                    i = bisect.bisect_right(addrs, off) - 1
                    if i >= 0:
                        name = names[i]
                key = f"{lib}  {name[:140]}"
                by_fn[key] = by_fn.get(key, 0) + count
        print(f"== {r.get('model', '')} prompt {r.get('prompt')} gen {r.get('gen')}: "
              f"{prof.get('decoding_thread_samples')} samples of the decoding thread of {prof.get('samples')}")
        for lib, c in prof.get("by_library", []):
            print(f"  {100 * c / total:5.1f}%  {lib}")
        print("  --")
        for key, c in sorted(by_fn.items(), key=lambda kv: -kv[1])[:top]:
            print(f"  {100 * c / total:5.1f}%  {key}")


if __name__ == "__main__":
    main()
