#!/usr/bin/env python3
"""The host's allocator, glibc's malloc against a preloaded mimalloc, on
this machine's backend (MLX's CPU backend here), same run, alternated.

    python3 bench/allocator.py [--pairs N] [--preload PATH] [--model DIR] > bench/results/DATE-allocator-cpu.json

Three measurements, each as pairs run one after the other (glibc, then the
preload), so a slow moment of the machine falls on both arms:
  - `mlx-lfm-bench --dispatch-cost`: what one node of each kind costs the
    host (µs a node, chains of 200);
  - the compiled decode of a generated LFM2-350M bf16 (16-token prompt, 24
    tokens): the step's build time a token and decode tok/s;
  - `node cli.cjs chat` on the demo's tiny model, whose step is all host.
Session 18's H200 host profile put 28-36% of the decoding thread in libc's
malloc and free; this asks what another allocator changes where it can be
run here. PATH: a mimalloc that overrides malloc (Debian/Ubuntu:
`apt install libmimalloc2.0`, /usr/lib/x86_64-linux-gnu/libmimalloc.so.2;
or bench/h200/mimalloc.sh's build)."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "target" / "x86_64-unknown-linux-gnu" / "release" / "mlx-lfm-bench"


def arg(name, default):
    a = sys.argv
    return a[a.index(name) + 1] if name in a else default


def run(cmd, preload, timeout=600):
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    # The CLI would relaunch itself under its own mimalloc (lib/allocator.cjs):
    # each arm here is the allocator it names.
    env["MLX_LFM_ALLOCATOR"] = "system"
    if preload:
        env["LD_PRELOAD"] = preload
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    if r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stderr[-2000:]}")
    return r.stdout + r.stderr


def main():
    pairs = int(arg("--pairs", "3"))
    preload = arg("--preload", "/usr/lib/x86_64-linux-gnu/libmimalloc.so.2")
    model = Path(arg("--model", "/tmp/mlx-lfm-allocator-350m"))
    if not Path(preload).is_file():
        raise SystemExit(f"{preload}: no such file (apt install libmimalloc2.0, or bench/h200/mimalloc.sh)")
    if not BENCH.is_file():
        subprocess.run(["cargo", "build", "--release", "--target", "x86_64-unknown-linux-gnu", "--bin", "mlx-lfm-bench"],
                       cwd=ROOT, check=True)
    if not (model / "config.json").is_file():
        run([BENCH, "--preset", "lfm2-350m", "--dtype", "bf16", "--out", model, "--device", "cpu", "--prompts", "16",
             "--gen", "2", "--reps", "1", "--paths", "compiled"], None)
    arms = [("glibc", None), ("preload", preload)]
    out = {"what": "glibc malloc against a preloaded allocator, same run, alternated pairs",
           "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
           "date": time.strftime("%Y-%m-%d"), "backend": "cpu", "preload": preload,
           "cpus": os.cpu_count(), "dispatch_cost": [], "decode_350m": [], "demo_chat": []}
    for p in range(pairs):
        for name, pre in arms:
            for line in run([BENCH, "--dispatch-cost", "--device", "cpu", "--reps", "5"], pre).splitlines():
                if line.startswith("{") and "dispatch_cost" in line:
                    j = json.loads(line)
                    out["dispatch_cost"].append({"pair": p, "arm": name, "node": j["dispatch_cost"],
                                                 "build_us": j["build_us"], "dispatch_us": j["dispatch_us"]})
            for line in run([BENCH, "--model", model, "--device", "cpu", "--prompts", "16", "--gen", "24", "--reps", "2",
                             "--paths", "compiled"], pre).splitlines():
                if line.startswith("{") and "decode_tps_runs" in line:
                    j = json.loads(line)
                    out["decode_350m"].append({"pair": p, "arm": name, "decode_tps_runs": j["decode_tps_runs"],
                                               "build_us_runs": [h[0] for h in j["host_build_dispatch_wait_us_runs"]]})
            text = run(["node", "cli.cjs", "chat", "--prompt", "Hello! What can you do?"], pre)
            m = re.search(r"decode ([0-9.]+) tok/s", text)
            out["demo_chat"].append({"pair": p, "arm": name, "decode_tps": float(m.group(1)) if m else None})
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
