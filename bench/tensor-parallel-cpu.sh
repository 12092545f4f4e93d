#!/bin/bash
# Tensor-parallel tok/s on this CPU: N=1 and N=2 interleaved (two rounds),
# same generated LFM2-350M-shaped f32 checkpoint, flat cache, compiled and
# eager decode. Output: JSON rows from mlx-lfm-bench plus the load average
# before each run (the machine is shared; read N=1 against N=2 of a round).
#   cargo build --release --target x86_64-unknown-linux-gnu --bin mlx-lfm-bench
#   bench/tensor-parallel-cpu.sh > bench/results/DATE-cpu-tensor-parallel.log
cd "$(dirname "$0")/.."
B=target/x86_64-unknown-linux-gnu/release/mlx-lfm-bench
M=/tmp/mlx-lfm-bench-lfm2-350m-f32
echo "# $(date -u) $(nproc) cores; load: $(cat /proc/loadavg)"
$B --preset lfm2-350m --dtype f32 --out $M --prompts 16 --gen 1 --reps 1 --paths eager >/dev/null
for round in 1 2; do
  for n in 1 2; do
    echo "# round $round N=$n $(date -u +%T) load: $(cat /proc/loadavg)"
    $B --model $M --tensor-parallel $n --prompts 128 --gen 32 --reps 2 --paths compiled,eager --cache flat
  done
done
echo "# done $(date -u) load: $(cat /proc/loadavg)"
