#!/usr/bin/env python3
"""The same-run H200 benchmark: mlx-lfm against llama.cpp and mlx-lm.

llama.cpp is the revision node-llama-cpp 3.22.1 ships (what a Node user gets
instead of us), built from source on the device with CUDA (sm_90) and fed
GGUF files that llama.cpp's own converter makes from the very checkpoints our
fixture generator writes; mlx-lm 0.32.2 runs on MLX CUDA 0.32.4, the MLX we
link. Every engine runs on the same random weights with the real shapes, one
after another per model (interleaved), in two rounds, so a ratio is never
taken across machines or moments.

Here (the development machine), once:
    bash bench/h200/prepare.sh
Then these calls of the device tool, back to back (the machine keeps /tmp
only while it is warm, ~30 s after a call: answer each call at once; each
call carries at most 64 MiB with the working tree, so .device/b, .device/bin
and .device/llama do not fit together; a call runs 10 minutes at most):
    1. carry [".device/a", ".device/tests"]: python3 bench/h200/run.py stage-mlx
    2. carry [".device/b", ".device/llama"]: H200_KERNEL_JOBS=3 python3 bench/h200/run.py llama install kernels
       (mlx-lm's wheel sits in .device/lm since session 43: carry it with .device/b, or
       later in a call that runs `install` before the rounds, e.g. [".device/lm",
       ".device/bin"] with `install round 1`: on a warm machine whose MLX is in, `install`
       then adds mlx-lm alone)
       (or, where no kernel's code changed since session 16's binaries, check with
       `git diff --stat 9bf0d7b -- src/kernels src/mlx/kernel.rs cpp`, ~60 s instead of ~500:
       `python3 bench/h200/run.py llama install verdicts-from bench/results/2026-12-03-h200-session16.raw.jsonl
        && H200_KERNEL_TESTS=compiled_prefill_equals_the_eager_prefill python3 bench/h200/run.py kernels`,
       the chosen tests' verdicts merged over the reused ones)
       (380 s on 2026-12-03 with 3 processes sharing the GPU, 505 s in session 16 with the
       stacked rows' test; H200_KERNEL_TESTS=name,name runs
       only the tests whose names hold one, as the test binary filters them: use whole
       names, "greedy" also picks up other tests. Where no kernel's code changed since a
       committed raw file's `tests` record, `llama install verdicts-from FILE` takes its
       verdicts instead: see verdicts_from)
    3. carry [".device/bin"]:                python3 bench/h200/run.py checkpoints step-ops dispatch-cost
       (or `host-profile` instead of dispatch-cost: where a decode's host time goes, sampled
       in process, ~30 s a model, H200_MODELS narrows it; named here by
       bench/h200/symbolize.py; cuda-gdb, the device's only debugger, took ~40 s a
       sample in session 17, three samples in a call)
       (300 s on 2026-12-03, GGUF too; step-ops now also counts a 512-token prompt's
       primitives per model, a process each: 346 s without dispatch-cost in session 16)
    4. carry [".device/bin"]:                H200_MODELS=lfm2-350m-bf16,lfm2-1.2b-bf16,lfm2-8b-a1b-q4 \
                                             H200_AB_REPS=6 timeout -s TERM 580 python3 bench/h200/run.py ab pick
       (every variant: ~150 s in process plus ~30 processes for MLX's knobs, ~300 s: an
       estimate, not yet run whole)
       (H200_AB_VARIANTS=a,b times only those against the defaults, all as engines of one
       process run in alternation: separate processes minutes apart moved 2x on 2026-12-03;
       MLX's own knobs, graph-ops-50/200, graph-per-step and no-cuda-graphs, as one process per sample in
       alternation with the defaults: ab_processes. In session 14 `ab pick` of 8 variants
       over the three models took 107 s; the knobs add ~10 s a process)
    5. carry [".device/bin"]:                timeout -s TERM 580 python3 bench/h200/run.py round 1 round 2
       (the two rounds ran past 440 s on 2026-12-03's slower host; `timeout` lets run.py
       pack its logs and raw file before the call's own limit kills it)
       (H200_MODELS=a,b narrows the rounds and their checkpoints; with
       H200_OURS_ENV='{"LD_PRELOAD": "<ROOT>/.device/bin/libmimalloc.so"}', ours runs
       under the allocator the CLI preloads on Linux, and each round also times the
       same bench with glibc's, engine "mlx-lfm-glibc", right after; run.py puts the
       checkout's root for `<ROOT>` (since session 57: sessions 56 and 57 passed it on
       as it was, and the loader ignored the preload), stops a round whose preload
       names no file, and records an error where the bench says another allocator
       served it; H200_GLIBC_BATCHED=1 also times the 16-sequence step under glibc)
    6. carry [".device/bin"]:                python3 bench/h200/run.py profile new-lengths
Session 17 spent 65 s starting the machine, 88 s on call 2 (one test), 590
on call 3 (checkpoints and GGUF alone ~400 s of it), 358 on `ab pick` (four
variants, three models) and 508 on the rounds: the 30 minutes hold calls
1-5 only where call 2 runs a chosen few tests (the kernels whose code
changed, the greedy and stacked rows' tests when the defaults changed,
verdicts-from for the rest) and call 3 is `checkpoints` with at most a
one-model `host-profile` (H200_MODELS=lfm2-350m-bf16, ~35 s).
Session 19, for planning: six chosen tests (the greedy test among them,
H200_KERNEL_JOBS=4) 199 s; `ab` of the two dense models (checkpoints without
GGUF included) with four variants and sync-steps 110 s; the 8B-A1B's
checkpoint and `ab` 162 s; a machine taken back mid-call loses everything
on it, and starting over (MLX, llama.cpp's build, the GGUF files) costs
more than half the session's device time.
Session 20: eight chosen tests (`H200_KERNEL_JOBS=4`) 293 s, `checkpoints`
379 s, `round 1 round 2` 503 s, `ab` of the 1.2B (its checkpoint
included) 75 s, the 8B-A1B's 171 s. Two machines were given back in
pauses on this side (a dropped connection, then reading results between
calls): write the whole chain down before the first call. Process
variants (`mimalloc`, `malloc-tcache`) need `.device/bin` carried, `ab`
needs `.device/b` too on a machine that has not installed MLX's wheel.
Session 21: four chosen tests (greedy among them, `H200_KERNEL_JOBS=4`)
207 s with the wheel's install; `ab` of one model with two in-process
variants and three process arms x 3 reps: 159 s (1.2B), 199 s (350M), the
8B-A1B's with its checkpoint and two arms x 2 reps 257 s; `profile-kernels`
of one model ~100 s. A fresh machine for a 350M-only round: `stage` (the
llama.cpp build starts), then `install verdicts-from ... && round 1`
397 s (the build's wait included), each later round ~60 s.
Session 22 (one machine, 1,594 s of the 1,800): `stage` 1 s (+ ~30 s to
start); four tests (`H200_KERNEL_JOBS=4`; norm_gemv's 317 s with every
dtype's column variants, now bf16's alone, the greedy test's 282, the
GEMV's 158) 322 s; `checkpoints` of the 1.2B and the 8B-A1B 345 s (the
8B-A1B's quantize ~106, GGUF ~71, llama-quantize ~117); a GPU-time `ab`
(H200_AB_GPU_TIME=1) of five 1.2B variants, two processes an arm, ~60 s;
`ab pick` of two in-process 8B-A1B variants, 4 reps, 31 s; `round 1
round 2` of those two models 421 s; a GPU-time `ab` of one 8B-A1B
variant plus `profile` of both models 163 s; `round 3` 176 s.
Session 23 (one machine, 1,765 s of the 1,800): `stage` 1 s; eight tests
(`H200_KERNEL_JOBS=4`; the greedy test alone 411 s, norm_gemv + GEMV
448 s) 454 s; `checkpoints` of the 1.2B and the 8B-A1B 233 s (the GGUF
thread works); a GPU-time `ab` of three 1.2B variants, `H200_AB_REPS=4`
(two processes an arm, ~17 s each) 136 s, then its 8B-A1B arms (~30 s a
process) ran into the call's limit with no record: give the 8B-A1B a call
of its own or fewer arms; `ab pick` of seven in-process variants over the
two models 99 s; `round 1 round 2` ran past 555 s (the 8B-A1B's
16-concurrent of round 2 cut): a round of the two models is ~290 s now.
Session 24 (one machine, 1,692 s of the 1,800): `stage` 1 s (+ ~95 s to
start); nine tests (`H200_KERNEL_JOBS=5`: the two greedy tests a process
each) 354 s; `checkpoints` of the 1.2B and the 8B-A1B plus `ab pick` of
eleven variants over the two models 281 s (checkpoints ~175, the A/B ~105);
`round 1` 258 s, `round 2` 210 s; `profile-kernels` of the 8B-A1B with
eight kernel names (qmv_kernel among them: 53 launches a step, each
replayed per section) ran past 440 s with no record: name two or three
kernels, or give it a call of its own.
Session 25 was lent no machine (new loans paused): it wrote, for the
next, the prompt's short conv as one kernel (`conv-prefill`, opt-in, its
test `conv_prefill_kernel_matches_stock_ops` and a greedy set) and its
q/k/v norm + RoPE (`qkv-prefill`, likewise) and the 8B-A1B's quantized
embedding (`quant-embed`, seven nodes of its step as one) and a decode
attention over position chunks (`attention-chunks-8`/`-4`), made the
feed-forward's gate one MLX compiled kernel in a prompt's pass (a default
everywhere, `fused-swiglu-off` measures it; its test
`fused_gate_equals_the_ops` holds it to the ops' bits, on the CPU so far)
and asks `norm-kernel-all-rows` of every model's prefill again.
Session 27: two short stretches of the device (~10 of its 30 minutes lost
to starts that found no machine; a machine went back between calls 4 and
5): `install kernels` of every kernel test was cut at 570 s with only the
two greedy tests reporting (~270-320 s each, five processes on 16 cores
compiling with NVRTC, no PTX cache); four chosen tests 185 s;
`kernel-detail` of three arms with two source pages 67 s.
Session 28 was lent no machine (new loans paused): it made a lone
sequence's decode position a view into a GPU-written table (out of MLX's
managed pool, which 24 launches a step read; a default everywhere,
`position-table-off` measures it, the greedy tests' `position-table-off`
run checks it against the stock run's tokens) and padded a two-row batch's
positions and row indices the same way (a batch's positions now step on on
the GPU, sampled batches too); kernel-bench has a `scalar-table-view` arm.
It also wrote the norm folds with eps compiled in (`fold-eps-const`,
opt-in: the 350M's 32 fold launches a step read eps from the managed pool;
its test is `norm_gemv_kernels_match_stock_ops`, its greedy set
`MLX_LFM_FOLD_EPS_CONST`), and a fold without the prologue
(`fold-deferred`: each warp walks the residual's rows and the norm's
weight beside its weight rows and scales its sums once, so its weight
loads start at once; same test, greedy set `norm-gemv-deferred`;
kernel-bench arms `norm-then-*` against `fold-prologue*` and
`fold-deferred*` on the 1.2B's in_proj and w1/w3).
Session 29 was lent no machine either: it wrote a lone sequence's MoE
layer as one launch (`moe-fused`, opt-in: the router + norm, the experts'
gate/up and down, 3 launches a layer today, as stages a block takes by a
ticket from a per-layer counter; its test
`moe_fused_kernel_matches_the_three_kernels`, its greedy set `moe-fused`,
kernel-bench's `moe-layer-q4-three` / `moe-layer-q4-fused`), and the
short-conv layer over quantized projections the same way (`conv-fused`:
the add + RMSNorm, in_proj, the conv step, out_proj, 4 launches a layer
today; its test `conv_fused_kernel_matches_stock_ops`, greedy sets
`MLX_LFM_CONV_FUSED` and `moe-conv-fused`, kernel-bench's
`conv-layer-q4-*` and `conv-layer-bf16-*`; over dense projections too),
and the feed-forward (`ffn-fused`: the add + RMSNorm, the SwiGLU
GEMV, w2, dense or, since session 30, 4-bit; its test `ffn_fused_kernel_matches_stock_ops`, greedy sets
`MLX_LFM_FFN_FUSED` and `conv-ffn-fused`), and an attention layer's q/k/v
stage (`qkv-fused`: the add + RMSNorm, the stacked projection, the heads'
norm + RoPE; its test `qkv_fused_kernel_matches_stock_ops`, greedy set
`MLX_LFM_QKV_FUSED`); `layers-fused` turns all four on (greedy set
`layers-fused`). Session 30 joined the conv layer and its feed-forward
into one launch (`conv-layer-fused`: six stages; its test
`conv_layer_fused_kernel_matches_the_two_kernels` holds it to the two
kernels' bits, greedy sets `MLX_LFM_CONV_LAYER_FUSED` and
`layers-fused-whole`, the variant of that name turning all five on).
Session 31 (an H100) adopted the four one-launch layers as CUDA defaults
from its A/B: the variants and greedy sets that turned them on are gone,
`layers-fused-off` (greedy set and variant) and `moe-fused-off`,
`conv-fused-off`, `ffn-fused-off`, `qkv-fused-off` measure them off, and
the greedy test's default run checks it built each.
Next (`bash bench/h200/prepare.sh` here first; ~1,400 s planned; a
fresh machine's `ab` first generates the checkpoints it times (~20 s
each on an H100, ~40 s for the 8B-A1B's two), and a round waits ~150 s
for the GGUF chain; take an H100 when the H200 is refused: every round
since session 31 ran on one; a failed start costs 90-180 device-seconds,
so ask `status` before each retry and call only once its `none_now`
window has passed; a call that names no kind after a failed H100 start
asks for an H200 only. Never let a helper use the device: session 46's
reviewer started the machine and ran ~150 s on it).
Session 57 got an H100 at once (23:49 UTC on 2026-12-07 to 00:16 on the
8th; its README block; binaries of 6b1e045) and ran session 56's chain:
step 3 passed all nine tests (517 s; the tiny MoE greedy test whole for
the first time since session 32), so every GPU test has passed with the
kernels as they are; step 4's rounds (350M and 1.2B, 242 and 187 s) and
a round of the 8B-A1B (194 s, after call 7 made its checkpoints and
GGUF) met every decode and prefill target, but under glibc: the
preload was passed as `<ROOT>/...` word for word, the loader ignored it
(so it went in session 56's rounds too), and run.py fills the root in
and stops on a preload naming no file since. Step 5 first found no
checkpoint on the fresh machine (`profile-kernels` makes them since),
then got ncu's detail sections (180 s) and lost the stall pass to its
TERM (H200_NCU_STALLS_ONLY=1 runs that pass alone since). Here, after
it: one `split` of the stacked step's [16] tokens in place of a slice a
row saves nothing (MLX 0.32.4 makes 16 Slices of it where 4 rows get one
Split node; counted on the CPU with MLX_LFM_COUNT_STEP_NODES and
MLXB_GRAPH_DUMP), so it was not kept.
The chain now:
  1. carry [.device/a]: `stage-mlx`.
  2. carry [.device/llama]: `llama` (its build runs in the background).
  3. carry [.device/bin], H200_OURS_ENV='{"LD_PRELOAD":
     "<ROOT>/.device/bin/libmimalloc.so"}' H200_GLIBC_BATCHED=1
     H200_MODELS=lfm2-1.2b-bf16,lfm2-350m-bf16 `timeout -s TERM 560
     python3 bench/h200/run.py round 1`, then `round 2`: check the
     record's allocator says libmimalloc (and no run_ours error); the
     16-sequence step under both allocators in one round decides what
     session 57's 18-43% drop was (the allocator, or a change since
     c636a56). ~280 and ~230 s. Then, in `round 2`'s call or its own:
     H200_BATCH_NODES_ONLY=1 H200_MODELS=lfm2-350m-bf16,lfm2-1.2b-bf16
     `batch-phases` (~60 s): the nodes a 16-row step hands MLX
     (MLX_LFM_COUNT_STEP_NODES, new in session 57), against the one-row
     step's ~60 (`step-ops`): every one-launch layer kernel takes one row.
     With it, `dispatch-cost` (no checkpoint; session 13 ran it on the
     H200): what a node costs at one row and at 16 (MLX's GEMMs there),
     so that the count says what fusing 16-row layers would save.
  4. Same env, H200_MODELS=lfm2-8b-a1b-q4 `timeout -s TERM 560 python3
     bench/h200/run.py round 1` (~350 s with its checkpoints and GGUF on
     a fresh machine).
  5. With what is left: H200_NCU_STALLS_ONLY=1
     H200_NCU_KERNELS='lfm_moe_fused|lfm_conv_fused' H200_NCU_COUNT=6
     H200_MODELS=lfm2-8b-a1b-q4 `timeout -s TERM 300 python3
     bench/h200/run.py profile-kernels` (the checkpoint is there after
     step 4).
  On an H200: the three models' rounds first (none since session 30;
  the issue's targets are the H200's).
Session 56 got an H100 at once (22:02-22:29 UTC on 2026-12-07; its
README block; binaries of a3d5c25) and ran session 55's chain but its
step 5: `stage-mlx`, `llama`, the suite (H200_KERNEL_JOBS=8, TERM 540,
then `unrun` at TERM 380: 76 of 81 GPU tests with a verdict, the five
cut being moe_router_norm_kernel_matches_the_norm_and_router_kernels,
qkv_fused_kernel_matches_stock_ops, qkv_fused_kernel_writes_kv_in_place,
short_conv_kernel_matches_stock_ops and
stacked_rows_with_kernels_equal_each_row_alone), the 8B-A1B's rounds 1
(277 s with its checkpoints and GGUF) and 2 (124 s): decode 1.15 / 1.14x
llama.cpp, every target met; and moe_experts_kernels_match_stock_ops and
norm_gemv_kernels_match_stock_ops alone (216 s, passed: each had failed
in call 4 on a small SwiGLU case's one-rounding floor, three since
bf969be). The compiled prefill's farthest padded case: 0.1218 of the
scale from the eager prefill, its uncompiled twin exactly as far (the
padding's, not the compiling's). After it the float32-sum quantized GEMV
was retired (step 0 of the chain below): its variants `qgemv-float` and
`quant-norm-kernels` and greedy sets `qgemv-float` and
`quant-norm-float` are gone; NVRTC held all 468 kernel forms' and
dtypes' PTX to the byte across the header's edit
(scripts/dev/nvrtc-check.py --ptx-dir; --define=LFM_QGEMV_MLX=1 on the
tree before, its default).
Its chain, which session 57 ran (above):
  1. carry [.device/a]: `stage-mlx`.
  2. carry [.device/llama]: `llama` (its build runs in the background).
  3. carry [.device/b, .device/tests, .device/ptx, .device/lm]:
     H200_KERNEL_JOBS=8 H200_KERNEL_TESTS=moe_router_norm_kernel_matches_the_norm_and_router_kernels,qkv_fused_kernel_matches_stock_ops,qkv_fused_kernel_writes_kv_in_place,short_conv_kernel_matches_stock_ops,stacked_rows_with_kernels_equal_each_row_alone,moe_experts_kernels_match_stock_ops,norm_gemv_kernels_match_stock_ops,quant_gemv_kernel_matches_stock_ops,greedy_tokens_with_kernels_equal_stock_ops_on_moe
     `timeout -s TERM 540 python3 bench/h200/run.py install kernels
     save-ptx`: the five session 56's limit cut, the three whose
     assertions changed after it, and the tiny MoE greedy test, which
     should now pass whole (507 s beside seven other processes in
     session 56: the call's long pole). With the other
     72 verdicts of a3d5c25 (the kernels' PTX unchanged since, but for
     the opt-in quantized norm fold's, which makes q in pairs since
     session 56), the suite is then whole. Every kernel on the quantized
     header has new text, so a new module name: none of them comes from
     .device/ptx, each compiles once in the call.
  4. carry [.device/bin], H200_OURS_ENV (mimalloc):
     H200_MODELS=lfm2-1.2b-bf16,lfm2-350m-bf16 `timeout -s TERM 560
     python3 bench/h200/run.py round 1`, then `round 2` (their latest
     rounds are session 50's). On an H200: the three models' rounds
     first (none since session 30; the issue's targets are the H200's).
  5. With what is left: the MoE and conv layers' stalls
     (H200_NCU_KERNELS='lfm_moe_fused|lfm_conv_fused' H200_NCU_COUNT=6
     H200_MODELS=lfm2-8b-a1b-q4 `profile-kernels`, TERM at 400 s).
Session 55 got an H100 late (21:09-21:25 UTC on 2026-12-07; its README
block; binaries of 415e4c7): a first machine (20:54) was taken back
during its second call; three failed starts, one refused call and a
pause of new loans cost ~470 device-seconds. It ran session 53's steps
2-3 (chain below): the compiled prefill's test, judged since 655f0d2
against its uncompiled twin on a GPU, passed (its first pass on a GPU
since it was written in session 16; the 5-token lines were cut from the kept tail: 0c23904 now
reports the farthest padded case last); the wide MoE greedy test passed
with the two-outputs default (both forms built, `moe-one-output`
neither); the tiny MoE one failed only on `qgemv-float` and
`quant-norm-float`, as always; the compiled prefill's A/B read P=512
0.87-1.23x (350M, median 1.02) and 0.91-1.01x (8B-A1B, median 0.95):
still opt-in; `layer-chains`: the MoE layer 50.1 µs a layer (default)
against 56.4 (g2) and 58.7 (one output), the route's block done
6.1-6.2 µs into each; ncu: the MoE layer 35.0-36.1 µs, the conv layer
16.2-16.5 (stalls cut by the call's TERM at 300 s). Its chain, which
session 56 ran but for step 5 (step 0 after it):
  0. Here, before it, worth weighing: retire the float32-sum quantized
     GEMV (`MLX_LFM_QGEMV_EXACT=0`; `qgemv-float`, `quant-norm-kernels`,
     their greedy sets `qgemv-float` and `quant-norm-float`). It is the
     suite's one standing failure: the tiny MoE fixture's 4-bit greedy
     run departs from the stock tokens in every session since 32 (step
     26, led by 0.159, the stock route's closest call 1.68 roundings), so
     it can never be adopted. That edits QUANT_HEADER, the text every
     quantized kernel includes (~157 mentions across src, bench, README):
     hold the default kernels' PTX byte for byte before and after
     (scripts/dev/nvrtc-check.py --files, NVRTC from pip here), and let
     step 3's whole suite judge them at the new text.
  1. carry [.device/a]: `stage-mlx`.
  2. carry [.device/llama]: `llama` (its build runs in the background).
  3. carry [.device/b, .device/tests, .device/ptx, .device/lm]:
     H200_KERNEL_JOBS=8 `timeout -s TERM 540 python3 bench/h200/run.py
     install kernels save-ptx` (the whole suite at one commit, never yet
     done; installs mlx-lm for the rounds), then H200_KERNEL_TESTS=unrun
     H200_KERNEL_JOBS=8 `... kernels save-ptx` on the warm machine for
     what the first call's TERM cut. The compiled prefill's last line
     names its farthest padded case and the twin's distance there.
  4. carry [.device/bin]: H200_OURS_ENV (mimalloc),
     H200_MODELS=lfm2-1.2b-bf16,lfm2-350m-bf16 `timeout -s TERM 560
     python3 bench/h200/run.py round 1`, then `round 2`; the 8B-A1B's
     in calls of their own (H200_MODELS=lfm2-8b-a1b-q4, ~330 s a round
     on a machine without its checkpoints): session 50's rounds predate
     the 8B-A1B's two-outputs default (its decode ~5% up in session 53's
     A/B). On an H200 the same, with the rounds first (none since
     session 30; the issue's targets are the H200's).
  5. With what is left: the MoE and conv layers' stalls
     (H200_NCU_KERNELS='lfm_moe_fused|lfm_conv_fused' H200_NCU_COUNT=6
     H200_MODELS=lfm2-8b-a1b-q4 `profile-kernels`, TERM at 400 s: its
     sections took 165 s and the stalls pass was cut at 300).
Session 54 (17:43-20:43 UTC on 2026-12-07) was lent no machine:
fifteen starts (stage-mlx: nine naming nvidia-h100-x1, six
nvidia-h200), spaced ~12 minutes apart after the fourth, found none;
with one call refused inside a `none_now` window (15 s) they cost 1,533
of its 1,800 device-seconds (75-90 s a failed start; ~180 s twice, when
a nvidia-h200 call tried both cards). It stopped at 267 s: too little
for a start (~90 s) and the wide MoE greedy test (~240 s alone). Nothing changed in the code; session 53's chain below stood
as it was (the .device at 6860147, session 53's PTX cache). Ask `status`
first, and name nvidia-h100-x1 while its `kind` says so: a
nvidia-h200 call that tries both cards costs twice as much when it fails.
Session 53 got an H100 at once (16:25-16:58 UTC on 2026-12-07; its
README block): the 38 tests session 52 had not passed ran (fourteen
processes): 29 passed; six failed out of GPU memory (each test process
sharing the GPU now holds MLX's cache to TEST_CACHE_LIMIT_MB),
`moe_experts_kernels_match_stock_ops` on one random draw (mended), the
compiled prefill (opt-in) as since session 17, and the tiny MoE greedy
test on its known float32-sum sets; those passed in calls 3 and 10, the
grouped GEMM's after its reference was made a segment at a time. The MoE layer's two-outputs forms: kernel-bench
34.78 µs against 37.66, the 8B-A1B's decode 1.045-1.056x in the paired
A/B: defaults since (`moe-gate-rows-1`, `moe-down-cols-1`,
`moe-one-output` time the old forms; their test among
DEFAULT_KERNEL_TESTS). Call 11 (the MoE greedy test alone, TERM at 195 s)
was cut after the bf16 and float32 fixtures.
Its chain, which session 55 ran but for steps 4-5:
  1. carry [.device/a]: `stage-mlx`.
  2. carry [.device/b, .device/tests, .device/ptx, .device/lm]:
     H200_KERNEL_JOBS=3 H200_KERNEL_TESTS=greedy_tokens_with_kernels_equal_stock_ops_on_moe,greedy_tokens_with_kernels_equal_stock_ops_on_wide_moe,compiled_prefill_equals_the_eager_prefill
     `timeout -s TERM 400 python3 bench/h200/run.py install kernels
     save-ptx` (session 55's compiled prefill test: its twin lines; the wide MoE fixture's is the one where the two-outputs
     default serves: its default run must build both forms and the new
     `moe-one-output` set neither; the tiny one's was cut in call 11;
     ~240 s alone each).
  3. carry [.device/bin], H200_OURS_ENV (mimalloc): `layer-chains`, and
     H200_NCU_KERNELS='lfm_moe_fused|lfm_conv_fused' H200_NCU_COUNT=6
     H200_MODELS=lfm2-8b-a1b-q4 `timeout -s TERM 300 python3
     bench/h200/run.py profile-kernels` (does the route's block take
     ~6.5 µs of every MoE layer in a busy step? Session 38's local route,
     every gate/up block routing for itself, lost 44.4 µs against 41.6
     and was retired: a slow route block asks for a faster route in that
     block, not for more of them). If the compiled prefill's test passed
     in step 2: H200_AB_VARIANTS=compiled-prefill
     H200_MODELS=lfm2-350m-bf16,lfm2-8b-a1b-q4 `ab` (its P=512 prefill
     read 0.99x on the H200 in session 17, before every kernel since; the
     350M's and the 8B-A1B's P=512 are the H200 targets last missed).
  4. On an H200: carry [.device/llama] `llama`, then rounds 1-2 of the
     three models with mlx-lm. On an H100: rounds 1-2 too (the 8B-A1B's
     default changed: session 50's rounds predate it).
  5. The whole suite at one commit (H200_KERNEL_JOBS=8, the cache limit
     now on), never yet done: `H200_KERNEL_TESTS=unrun` over two calls.
Sessions 52 back to 23: their notes and chains, as this docstring had
them, are in bench/h200/HISTORY.md ("run.py's chains", at its end).
Append nothing that copies loose files into $OUT after run.py: a call
brings back a few files (8 on 2026-12-03) and drops the rest, raw.jsonl
with them; run.py writes $OUT/raw.jsonl and $OUT/logs.tgz itself.
/tmp/h200/raw.jsonl is cumulative on a machine: a later call's copy holds
the earlier calls' records too (deduplicate before committing).
Issue each call the moment the last returns: a machine idle for 30 s is
given back, with /tmp (on 2026-12-02 two machines went that way between
calls, and with them the staged MLX and the checkpoints; on 2026-12-03
reading a failed test's log between calls 3 and 4 cost the machine, and
with it the rounds). A call blocks until it ends, so settle every call's
command before the first, and read the results when the chain is done.
(Calls 1-5 are ~27 of the 30 device minutes a session has, with ~2 minutes
to start the machine; `H200_MODELS=...` narrows `ab` and `profile`, and
`checkpoints` of the dense models alone takes ~1.5 minutes.)
`gguf-bg` starts llama.cpp's GGUF chain for the rounds in its own process
session (it outlives the call; `round` waits for it).
`kernel-detail` takes ncu's detail sections and stall reasons over a few
`kernel-bench` arms alone (H200_DETAIL_ARMS; the experts' kernels by default).
`save-ptx` packs the kernels the machine compiled into $OUT/ptx-cache.tgz;
copied to .device/ptx/ here and carried with call 2 of the next session,
`install` puts them into that machine's MLX cache first (restore_ptx).
`batch-phases` splits the 16-concurrent step's host time (pipelined and
synchronous, ~1 minute a model).
`kernels` runs the fused kernels' tests there (each test's verdict kept);
`ab` times each opt-in change of the decode step against the defaults on
the same checkpoints; `pick` adopts the switches that won by 3% with their
tests passed (picked-env.json), which every later step of the session runs
with; the repository's defaults are then set to match, so the rounds
measure what ships. (`profile-prefill` profiles a 512-token prefill the
same way; `profile-kernels` records ncu's detail sections for the kernels
H200_NCU_KERNELS matches, the first H200_NCU_COUNT of them in the step
where it is set; `profile-gaps` the step's GPU time as one graph
less its kernels' ncu durations with warm caches, the time between them; `ab-binaries` times .device/prev/mlx-lfm-bench-prev, a build of
the previous commit, against this one; `constrained` times constrained
against free decode; `dispatch-cost` what a node of each kind costs the
host; `new-lengths` times the first prefill at new prompt
lengths, `shape-cost` which op of a prompt's pass pays for a new length;
`kernel-bench` times each dense GEMV kernel alone under ncu, MLX's
and each walk of ours on the same operands.)
Each call leaves raw.jsonl (every measurement, tagged) and its logs (logs.tgz) in $OUT.
Back here:
    python3 bench/h200/run.py merge-raw bench/results/DATE-h200-sessionN.raw.jsonl COMMIT \
        1 CALL1/raw.jsonl "stage-mlx" 2 CALL2/raw.jsonl "llama install kernels" ...
    python3 bench/h200/run.py merge-logs bench/results/DATE-h200-sessionN-logs.tgz 1 CALL1/logs.tgz ...
    python3 bench/h200/run.py collect RAW.jsonl... > bench/results/DATE-h200-same-run.json

Figures: median of each engine's repetitions within a round (llama-bench's
own samples, mlx-lfm-bench's and mlx-lm's per-rep figures), prompts 512 and
2048 (and 4096 for the 1.2B), 256 generated tokens, greedy; the batched
figure is 16 concurrent 128-token prompts with 64 tokens each, set beside
llama-batched-bench's decode rate at 16 sequences.
"""
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = Path("/tmp/h200")
CK = WORK / "ck"
GGUF = WORK / "gguf"
LLSRC = Path("/tmp/llsrc")
LLBIN = LLSRC / "build" / "bin"
SITE = Path("/tmp/site")
OUT = Path(os.environ.get("OUT", "/tmp/h200/out"))
RAW = WORK / "raw.jsonl"
BENCH = ROOT / ".device" / "bin" / "mlx-lfm-bench"
TESTS = WORK / "tests"

GEN = 256
REPS = 3
MODELS = {
    # name: (preset, our checkpoint, llama.cpp quant type, prompts)
    "lfm2-350m-bf16": ("lfm2-350m", None, "bf16", [512, 2048]),
    "lfm2-1.2b-bf16": ("lfm2-1.2b", None, "bf16", [512, 2048, 4096]),
    "lfm2-8b-a1b-q4": ("lfm2-8b-a1b", "affine:4:64", "q4_0", [512, 2048]),
}
BATCH = {"n": 16, "prompt": 128, "gen": 64}


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def env():
    """MLX CUDA and the CUDA libraries from the image's torch venv."""
    e = dict(os.environ)
    if (WORK / "kernels-off").exists():
        e["MLX_LFM_KERNELS"] = "0"
    e.update(picked_env())
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    libs = []
    if spec and spec.submodule_search_locations:
        for base in spec.submodule_search_locations:
            for d in sorted(Path(base).glob("*/lib")):
                libs.append(str(d))
    libs.append(str(SITE / "mlx" / "lib"))
    e["LD_LIBRARY_PATH"] = ":".join(libs + [e.get("LD_LIBRARY_PATH", "")])
    e["PYTHONPATH"] = str(SITE) + (":" + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e["PYTHONUNBUFFERED"] = "1"
    # Keep MLX's compiled kernels across the calls of one warm machine.
    e.setdefault("MLX_PTX_CACHE_DIR", str(WORK / "ptx"))
    return e


PICKED = WORK / "picked-env.json"


def picked_env():
    """What `pick` adopted from this machine's A/B (the opt-in switches that
    won), applied to every later step of the session; the repository's
    defaults are then changed to match, so the rounds measure what ships."""
    return json.loads(PICKED.read_text()) if PICKED.exists() else {}


def ours_extra():
    """H200_OURS_ENV as a dict, `<ROOT>` in a value standing for the
    checkout's root on the device (the docstring's form). Sessions 56 and 57
    passed `<ROOT>` on as it was: the loader ignored the preload with a
    line in ours' log, the allocator record said libc's, and their rounds,
    meant under mimalloc, ran under glibc. So a preload that names no file
    stops the rounds before any engine runs."""
    extra = {k: str(v).replace("<ROOT>", str(ROOT)) for k, v in json.loads(os.environ.get("H200_OURS_ENV", "{}")).items()}
    pre = extra.get("LD_PRELOAD")
    # (A bare name is the loader's to find on its path; a path must be there.)
    if pre and not all(Path(f).is_file() for f in preloads(pre) if "/" in f):
        raise SystemExit(f"H200_OURS_ENV: LD_PRELOAD={pre} names no file here (bench/h200/prepare.sh builds "
                         f".device/bin/libmimalloc.so; carry .device/bin)")
    return extra


def preloads(value):
    """The libraries an LD_PRELOAD value names (colons or spaces apart)."""
    return value.replace(":", " ").split()


def preload_served(value, served):
    """Whether the bench's allocator line (`served`, the library the loader
    says serves malloc) is one of the LD_PRELOAD value's libraries."""
    return any(Path(f).name in (served or "") for f in preloads(value))


def glibc_env():
    """ours_env() without its preload: the allocator alone differs."""
    e = ours_env()
    e.pop("LD_PRELOAD", None)
    return e


def ours_env():
    """env() plus H200_OURS_ENV (a JSON object) for our engine alone in the
    rounds: an MLX knob (read once per process) that won its process A/B
    this session, measured in the rounds without reaching mlx-lm's MLX."""
    e = env()
    e.update(ours_extra())
    return e


def sh(cmd, log_name=None, check=True, **kw):
    # (After the TERM a worker thread starts nothing more: checkpoints'
    # GGUF chain would otherwise run on past the call's limit, its `finally`
    # with raw.jsonl never reached. The main thread's wrap-up still may.)
    if TERM_SEEN and threading.current_thread() is not threading.main_thread():
        raise Stopped(f"stopped by SIGTERM before {Path(str(cmd[0])).name}")
    log("$", " ".join(map(str, cmd)))
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=kw.pop("env", env()), **kw)
    if log_name:
        OUT.mkdir(parents=True, exist_ok=True)
        with open(OUT / f"{log_name}.log", "a") as f:
            f.write(f"$ {' '.join(map(str, cmd))}\n{r.stdout}\n--- stderr\n{r.stderr[-20000:]}\n")
    if check and r.returncode != 0:
        raise SystemExit(f"failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stderr[-3000:]}")
    return r


def record(**kv):
    WORK.mkdir(parents=True, exist_ok=True)
    # (H200_TAG=text: a call's own label on each record, e.g. the process
    # switch a second `kernel-bench` of the call ran under.)
    if os.environ.get("H200_TAG"):
        kv.setdefault("tag", os.environ["H200_TAG"])
    with open(RAW, "a") as f:
        f.write(json.dumps(kv) + "\n")


def stage(llama=True, mlx=True):
    """Call 1: the first half of the MLX CUDA wheel, and llama.cpp's build
    started in the background (it takes ~5 minutes and runs on while the
    next call generates and converts the checkpoints). `stage-mlx` stages
    the wheel alone (and keeps .device/tests, carried beside it, for
    `kernels`); `llama` starts the build alone."""
    WORK.mkdir(parents=True, exist_ok=True)
    if mlx:
        stage_dir = Path("/tmp/stage")
        stage_dir.mkdir(parents=True, exist_ok=True)
        for p in (ROOT / ".device" / "a").iterdir():
            shutil.copy(p, stage_dir / p.name)
        if (ROOT / ".device" / "tests").is_dir():
            shutil.copytree(ROOT / ".device" / "tests", TESTS, dirs_exist_ok=True)
    if llama and not (LLBIN / "llama-bench").exists():
        shutil.rmtree(LLSRC, ignore_errors=True)
        sh(["tar", "xzf", ROOT / ".device" / "llama" / "llsrc.tgz", "-C", "/tmp"])
        shutil.copy(ROOT / ".device" / "llama" / "convert_gguf.py", WORK / "convert_gguf.py")
        script = (
            f"cd {LLSRC} && cmake -B build -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF "
            "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF "
            "-DCMAKE_BUILD_TYPE=Release > /tmp/h200/llcmake.log 2>&1 && "
            "cmake --build build -j 14 --target llama-bench llama-quantize llama-batched-bench "
            "> /tmp/h200/llbuild.log 2>&1; echo $? > /tmp/h200/llbuild.rc"
        )
        # setsid: the build outlives this call (the machine stays warm for the next).
        subprocess.Popen(["setsid", "bash", "-c", script], stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        log("llama.cpp build started in the background")
    sh(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,memory.used,memory.total", "--format=csv"], "device", check=False)


PTX = WORK / "ptx"
PTX_CARRY = ROOT / ".device" / "ptx" / "ptx-cache.tgz"
# MLX's own cache folder where MLX_PTX_CACHE_DIR is not set
# (<temp>/mlx/<version>/ptx): a process started without run_env's
# environment (ncu's, a test binary's children) writes there.
MLX_TEMP_PTX = Path(tempfile.gettempdir()) / "mlx"


def gpu_query(field):
    """nvidia-smi's `field` of the first GPU, None where it cannot say."""
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True, text=True)
    except OSError:
        return None
    return (r.stdout.split("\n")[0].strip() or None) if r.returncode == 0 else None


def gpu_capability():
    """The GPU's compute capability ("9.0"), None where nvidia-smi cannot say."""
    return gpu_query("compute_cap")


def mlx_version():
    """The MLX version installed in SITE (its wheel's dist-info), None before."""
    found = sorted(SITE.glob("mlx_cuda_13-*.dist-info"))
    return found[0].name[len("mlx_cuda_13-"):-len(".dist-info")] if found else None


def restore_ptx():
    """A fresh machine compiles every kernel it runs with NVRTC, MLX's and
    ours, on its host (much of the kernel tests' ~400 s). `save-ptx` brings
    back the kernels a session compiled (MLX's cache: a cubin and its
    names' file a kernel); carried in .device/ptx/, they go into the cache
    of the next machine before anything runs, where its GPU is the one they
    were compiled for. Safe across builds: MLX keys its cache by kernel
    name (MLX's own are fixed by the pinned version, the cache folder names
    it), and each of ours is named with a hash of its text and operand
    dtypes (src/mlx/kernel.rs: module_name), so a changed kernel is simply
    compiled again."""
    if not PTX_CARRY.exists() or (PTX.exists() and any(PTX.iterdir())):
        return
    import tarfile

    with tarfile.open(PTX_CARRY, "r:gz") as t:
        meta = json.load(t.extractfile("ptx-cache.json"))
        here = {"compute_cap": gpu_capability(), "mlx": mlx_version()}
        # (MLX's wrapping of our kernels, its headers and its own kernels
        # change with its version: a cache of another MLX or GPU, or one
        # whose versions could not be read, is left out.)
        if None in here.values() or any(meta.get(k) != v for k, v in here.items()):
            record(engine="ptx-cache", restored=0, why=f"compiled for {meta}, here {here}")
            return
        PTX.mkdir(parents=True, exist_ok=True)
        safe = lambda n: not n.startswith("/") and ".." not in Path(n).parts
        members = [m for m in t.getmembers() if m.isfile() and m.name != "ptx-cache.json" and safe(m.name)]
        t.extractall(PTX, members=members)
    record(engine="ptx-cache", restored=len(members), from_commit=meta.get("commit"))


def read_or(path, default):
    return path.read_text().strip() if path.exists() else default


def save_ptx(limit=None):
    """This machine's compiled kernels (MLX's cache, without the sources it
    keeps beside them) as $OUT/ptx-cache.tgz, for .device/ptx/ of the next
    session (see restore_ptx). It must fit what the test call carries beside
    .device/b, .device/tests (gzipped since session 48) and .device/lm
    (~5.7 MiB of the 64 left with the tree in session 49; H200_PTX_MB
    sets another size than 5): ours first (the kernel tests compile them in every
    dtype and shape), then MLX's, a quarter fewer each time until it fits."""
    limit = limit or int(float(os.environ.get("H200_PTX_MB", "5")) * (1 << 20))
    import io
    import tarfile

    # (Every file but the sources: session 26's first save found no .ptx
    # there, so it keeps whatever this MLX writes, and says what it found;
    # and MLX's default folder too, which a process that did not get
    # MLX_PTX_CACHE_DIR fills: session 26's save found nothing in ours.)
    version = mlx_version()
    folders = [PTX] + (sorted(MLX_TEMP_PTX.glob(f"{version}/ptx")) if version else [])
    found, seen = [], set()
    for folder in folders:
        # (A file of one name is kept from the first folder that has it.)
        for p in sorted(folder.rglob("*")) if folder.exists() else []:
            if p.is_file() and str(p.relative_to(folder)) not in seen:
                seen.add(str(p.relative_to(folder)))
                found.append((folder, p))
    root_of = lambda p: next(f for f in folders if p.is_relative_to(f))
    files = sorted((p for _, p in found if p.suffix != ".cu"), key=lambda p: (not p.name.startswith("custom_kernel_"), str(p)))
    suffixes = {}
    for _, p in found:
        suffixes[p.suffix or "(none)"] = suffixes.get(p.suffix or "(none)", 0) + 1
    rel = lambda p: str(p.relative_to(root_of(p)))

    # MLX writes a module's compiled code, then its kernel names, then its
    # source, none atomically: a test process killed at a TERM may leave a
    # module half written, which the next session would load and fail on
    # ("There is no kernel named ..."). Only whole ones are kept.
    def whole(p):
        code, names = p.with_suffix(".ptx"), p.with_suffix(".txt")
        return (code.exists() and code.stat().st_size > 0 and names.exists()
                and "\t" in names.read_text(errors="replace"))
    torn = sorted({rel(p.with_suffix("")) for p in files if not whole(p)})
    files = [p for p in files if rel(p.with_suffix("")) not in torn]
    modules = sorted({rel(p.with_suffix("")) for p in files}, key=lambda m: (not Path(m).name.startswith("custom_kernel_"), m))
    out = OUT / "ptx-cache.tgz"
    keep = len(modules)
    cc = gpu_capability()
    while True:
        kept = set(modules[:keep])
        chosen = [p for p in files if rel(p.with_suffix("")) in kept]
        meta = {"compute_cap": cc, "mlx": version, "commit": read_or(ROOT / ".device" / "bin" / "COMMIT", "unknown"),
                "modules": keep, "of": len(modules)}
        with tarfile.open(out, "w:gz") as t:
            data = json.dumps(meta).encode()
            info = tarfile.TarInfo("ptx-cache.json")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
            for p in chosen:
                t.add(p, arcname=rel(p))
        if out.stat().st_size <= limit or keep == 0:
            break
        keep = keep * 3 // 4
    record(engine="ptx-cache", saved=keep, of=len(modules), bytes=out.stat().st_size, torn=torn,
           folders={str(f): sum(1 for g, _ in found if g == f) for f in folders},
           found=suffixes, env=os.environ.get("MLX_PTX_CACHE_DIR"))


def install():
    """Call 2: the second half of the wheel, then MLX CUDA, MLX and mlx-lm
    into /tmp/site."""
    lm = ROOT / ".device" / "lm"
    if not (SITE / "mlx" / "lib" / "libmlx.so").exists():
        install_wheels()
    elif not (SITE / "mlx_lm").exists() and any(lm.glob("*.whl")):
        # (MLX is in from an earlier call of this warm machine; mlx-lm's
        # wheel came with this one: .device/lm.)
        sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", SITE]
           + [str(p) for p in lm.glob("*.whl")], env=dict(os.environ))
    restore_ptx()


def install_wheels():
    b = ROOT / ".device" / "b"
    whl = Path("/tmp/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl")
    parts = [Path("/tmp/stage/cuda.part.aa"), b / "cuda.part.ab"]
    missing = [str(p) for p in parts if not p.exists()]
    if missing:
        # (Session 31 spent a call on a traceback here: its first `ab` came
        # before the call that carries .device/b.)
        raise SystemExit(f"install: MLX's CUDA wheel is not on this machine yet and {', '.join(missing)} is missing: "
                         "`stage` (carry .device/a) first, then a call that carries .device/b (the kernel tests' call) "
                         "installs it; later calls need neither while the machine stays warm")
    with open(whl, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    # (mlx-lm's wheel sits in .device/lm since session 43, so that the
    # kernel tests' call, .device/b with .device/tests, fits 64 MiB.)
    wheels = [str(whl)] + [str(p) for d in (b, ROOT / ".device" / "lm") for p in d.glob("*.whl")]
    sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target", SITE] + wheels,
       env=dict(os.environ))


def checkpoints(names=None, gguf=True):
    """Our fixture generator writes every checkpoint (deterministic random
    weights, real shapes); llama.cpp's converter turns the same files into
    GGUF. The GGUF chain (the converter and llama-quantize, on the CPU) of
    a model runs in a thread beside our quantization of the same bf16
    files and the next model's generation (on the GPU): one after the
    other they took 345 s of session 22's 1,800 for the 1.2B and the
    8B-A1B (the 8B-A1B's quantize ~106 s, GGUF ~71, llama-quantize ~117)."""
    from concurrent.futures import ThreadPoolExecutor

    CK.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(max_workers=1) as conv:
        try:
            checkpoint_chain(conv, names, gguf)
        except Stopped:
            # (The TERM: the queued GGUF chains never start; leaving the
            # `with` waits for the running one only, whose converter the
            # TERM to the process group has ended. Another failure lets them
            # finish, for the next call. A worker that passed sh()'s check
            # just before the TERM may still start one command: a window of
            # milliseconds, left open.)
            conv.shutdown(wait=False, cancel_futures=True)
            raise


def checkpoint_chain(conv, names, gguf):
    """checkpoints' body: each model's checkpoints here, its GGUF chain
    queued on `conv`."""
    pending = []
    for name, (preset, quant, lq, _) in MODELS.items():
        if names and name not in names:
            continue
        src = CK / f"{preset}-bf16"
        # (The bf16 files of a quantized model too, without GGUF: our
        # quantization reads them, and a later GGUF chain, gguf-bg's in
        # the background, then needs the GPU for nothing.)
        if not (src / "config.json").exists():
            sh([BENCH, "--preset", preset, "--dtype", "bf16", "--out", src, "--device", "gpu",
                "--prompts", "16", "--gen", "2", "--reps", "1", "--paths", "compiled"], "generate")
        g = GGUF / f"{name}.gguf"
        if gguf and not g.exists():
            pending.append(conv.submit(gguf_of, name, preset, lq, src))
        if quant and not (CK / name / "config.json").exists():
            # Our converter quantizes the very bf16 files llama.cpp converts
            # (without them, the deterministic generator makes them again).
            frm = ["--from", src] if (src / "config.json").exists() else []
            sh([BENCH, "--preset", preset, "--dtype", "bf16", "--quantize", quant, "--out", CK / name] + frm +
               ["--device", "gpu", "--prompts", "16", "--gen", "2", "--reps", "1", "--paths", "compiled"], "generate")
    # (A failed conversion raises here, as it did inline.)
    for f in pending:
        f.result()


def gguf_of(name, preset, lq, src):
    """The GGUF file of `name` from our bf16 checkpoint `src`, by
    llama.cpp's converter (and llama-quantize for a quantized type)."""
    g = GGUF / f"{name}.gguf"
    GGUF.mkdir(parents=True, exist_ok=True)
    bf = GGUF / f"{preset}-bf16.gguf"
    # (Each file under a temporary name until it is whole: a chain cut
    # short, in the background or in a call, leaves nothing that passes
    # for done.)
    part = lambda p: p.with_name(p.name + ".part")
    if not bf.exists():
        sh([sys.executable, WORK / "convert_gguf.py", "--llama-cpp", LLSRC, src, "--outtype", "bf16",
            "--outfile", part(bf)], "convert", env={**os.environ, "PYTHONUNBUFFERED": "1"})
        part(bf).rename(bf)
    if lq != "bf16":
        wait_llama()
        sh([LLBIN / "llama-quantize", bf, part(g), lq.upper(), "16"], "convert")
        part(g).rename(g)
        bf.unlink()
    else:
        bf.rename(g)


def wait_llama():
    # (WORK is /tmp/h200, where stage()'s build script writes these.)
    rc = WORK / "llbuild.rc"
    t = time.time()
    while not rc.exists():
        if TERM_SEEN:
            raise Stopped("stopped by SIGTERM waiting for llama.cpp's build")
        if time.time() - t > 480:
            raise SystemExit("llama.cpp build did not finish in 8 minutes")
        time.sleep(5)
    if rc.read_text().strip() != "0":
        shutil.copy(WORK / "llbuild.log", OUT / "llbuild.log") if OUT.exists() else None
        raise SystemExit("llama.cpp build failed:\n" + (WORK / "llbuild.log").read_text()[-3000:])


def ours_ck(name):
    preset, quant, _, _ = MODELS[name]
    return CK / name if quant else CK / f"{preset}-bf16"


def run_llama(name, rnd):
    wait_llama()
    _, _, _, prompts = MODELS[name]
    g = GGUF / f"{name}.gguf"
    bench = [LLBIN / "llama-bench", "-m", g, "-fa", "1", "-r", str(REPS), "-o", "json"]
    r = sh(bench + ["-p", ",".join(map(str, prompts)), "-n", "0"], f"llama-{name}")
    for t in json.loads(r.stdout):
        record(engine="llama.cpp", model=name, round=rnd, metric="prefill_tps", prompt=t["n_prompt"],
               samples=t.get("samples_ts") or [t["avg_ts"]], build=t.get("build_commit"))
    # Decode after the shortest prompt (-d: the KV cache holds that many
    # tokens first), as our decode figure is taken after that prompt.
    depth = min(prompts)
    r = sh(bench + ["-p", "0", "-n", str(GEN), "-d", str(depth)], f"llama-{name}", check=False)
    if r.returncode != 0:
        depth = 0
        r = sh(bench + ["-p", "0", "-n", str(GEN)], f"llama-{name}")
    for t in json.loads(r.stdout):
        record(engine="llama.cpp", model=name, round=rnd, metric="decode_tps", prompt=t.get("n_depth", depth),
               samples=t.get("samples_ts") or [t["avg_ts"]])
    b = BATCH
    r = sh([LLBIN / "llama-batched-bench", "-m", g, "-fa", "on", "-c", str(b["n"] * (b["prompt"] + b["gen"]) + 256),
            "-b", "2048", "-ub", "512", "-npp", str(b["prompt"]), "-ntg", str(b["gen"]), "-npl", f"1,{b['n']}",
            "-ngl", "99"], f"llama-batched-{name}", check=False)
    for line in r.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and cells[0].isdigit() and int(cells[2]) in (1, b["n"]):
            # |PP|TG|B|N_KV|T_PP s|S_PP t/s|T_TG s|S_TG t/s|T s|S t/s|
            record(engine="llama.cpp", model=name, round=rnd, metric=f"batch{cells[2]}_decode_tps",
                   prompt=int(cells[0]), samples=[float(cells[7])])


def record_cold(engine, name, rnd, prompt, tps):
    """The untimed first pass at a prompt length (MLX's per-shape setup,
    ~100 ms on the GPU), which since session 32 precedes the timed reps of
    ours and mlx-lm's as llama-bench's warm-up precedes its own: kept as
    its own metric, so the rounds still show what a new length costs.
    (Before, the median of three reps with a cold first was the lower of
    the two warm ones.)"""
    if tps:
        record(engine=engine, model=name, round=rnd, metric="prefill_cold_tps", prompt=prompt, samples=[tps])


def run_ours(name, rnd):
    _, _, _, prompts = MODELS[name]
    r = sh([BENCH, "--model", ours_ck(name), "--device", "gpu", "--prompts", ",".join(map(str, prompts)),
            "--gen", str(GEN), "--reps", str(REPS), "--paths", "compiled"], f"ours-{name}", env=ours_env())
    for line in r.stdout.splitlines():
        j = json.loads(line)
        if "allocator" in j:
            # Which allocator served our malloc (the loader's answer).
            record(engine="mlx-lfm-allocator", model=name, round=rnd, allocator=j["allocator"])
            pre = ours_extra().get("LD_PRELOAD")
            if pre and not preload_served(pre, j["allocator"]):
                # (An error, so `collect` lists it: the round's "mlx-lfm"
                # figures are then not the preloaded allocator's. The bench
                # gives null where the loader names no library.)
                record(engine="run_ours", model=name, round=rnd,
                       error=f"malloc served by {j['allocator']}, not the preloaded {pre}")
        if "prompt" not in j:
            continue
        record(engine="mlx-lfm", model=name, round=rnd, metric="prefill_tps", prompt=j["prompt"], samples=j["prefill_tps_runs"])
        record_cold("mlx-lfm", name, rnd, j["prompt"], j.get("cold_prefill_tps"))
        # Per token of each rep, µs: [host building the step, MLX encoding and
        # launching it, waiting for the token].
        record(engine="mlx-lfm", model=name, round=rnd, metric="decode_tps", prompt=j["prompt"], samples=j["decode_tps_runs"],
               cache=j["cache"], host_us=j.get("host_build_dispatch_wait_us_runs"))
    if "LD_PRELOAD" in ours_extra():
        # Ours with the allocator the CLI preloads, and here the same bench
        # with glibc's (what a program that requires the package gets
        # unless it preloads too), same round, right after.
        r = sh([BENCH, "--model", ours_ck(name), "--device", "gpu", "--prompts", ",".join(map(str, prompts)),
                "--gen", str(GEN), "--reps", str(REPS), "--paths", "compiled"], f"ours-glibc-{name}", check=False,
               env=glibc_env())
        for line in r.stdout.splitlines():
            j = json.loads(line) if line.startswith("{") else {}
            if "prompt" in j:
                record(engine="mlx-lfm-glibc", model=name, round=rnd, metric="prefill_tps", prompt=j["prompt"],
                       samples=j["prefill_tps_runs"])
                record(engine="mlx-lfm-glibc", model=name, round=rnd, metric="decode_tps", prompt=j["prompt"],
                       samples=j["decode_tps_runs"], host_us=j.get("host_build_dispatch_wait_us_runs"))
    if name in AB_IN_ROUNDS:
        # The same build with this session's decode-step changes off (the
        # stock ops as before them), same minute: what the changes buy.
        e = ours_env()
        e.update(AB["stock"][0])
        r = sh([BENCH, "--model", ours_ck(name), "--device", "gpu", "--prompts", str(min(prompts)), "--gen", str(GEN),
                "--reps", str(REPS), "--paths", "compiled"], f"ours-stock-{name}", check=False, env=e)
        for line in r.stdout.splitlines():
            j = json.loads(line)
            if "prompt" in j:
                record(engine="mlx-lfm-stock-ops", model=name, round=rnd, metric="decode_tps", prompt=j["prompt"],
                       samples=j["decode_tps_runs"])
                record(engine="mlx-lfm-stock-ops", model=name, round=rnd, metric="prefill_tps", prompt=j["prompt"],
                       samples=j["prefill_tps_runs"])
    run_batched(name, rnd, "mlx-lfm", ours_env())
    if "LD_PRELOAD" in ours_extra() and os.environ.get("H200_GLIBC_BATCHED") == "1":
        # The 16-sequence step under glibc too, right after: session 57's
        # rounds, which ran it under glibc unawares, read 18-43% below
        # session 50's under mimalloc, where the 1.2B's one-sequence decode
        # held.
        run_batched(name, rnd, "mlx-lfm-glibc", glibc_env(), log_name=f"ours-glibc-batched-{name}")


def run_batched(name, rnd, engine, e, log_name=None):
    b = BATCH
    r = sh([BENCH, "--model", ours_ck(name), "--device", "gpu", "--concurrent", str(b["n"]), "--prompts", str(b["prompt"]),
            "--gen", str(b["gen"]), "--reps", "2"], log_name or f"ours-batched-{name}", env=e,
           check=engine == "mlx-lfm")
    if r.returncode != 0:
        # (The glibc twin's failure: its own error record, not empty samples
        # that `collect` drops without a word.)
        record(engine=engine, model=name, round=rnd, error=f"batched bench failed ({r.returncode}): {r.stderr[-2000:]}")
        return
    steps, solo, agg, phases = [], [], [], []
    for line in r.stdout.splitlines():
        j = json.loads(line) if line.startswith("{") else {}
        if "median_step_ms" in j:
            steps.append(b["n"] * 1000.0 / j["median_step_ms"])
            solo.append(1000.0 / j["solo_step_ms"])
            agg.append(j["concurrent_tps"])
            phases.append(j.get("batch_build_dispatch_sync_accept_us"))
    # (phases: µs a stacked step, build / dispatch / sync / the rows'
    # reads and deliveries: where the batched step's host time goes.)
    record(engine=engine, model=name, round=rnd, metric=f"batch{b['n']}_decode_tps", prompt=b["prompt"], samples=steps,
           phases_us=phases)
    record(engine=engine, model=name, round=rnd, metric="batch1_decode_tps", prompt=b["prompt"], samples=solo)
    record(engine=engine, model=name, round=rnd, metric=f"batch{b['n']}_end_to_end_tps", prompt=b["prompt"], samples=agg)


def run_mlx_lm(name, rnd):
    _, _, _, prompts = MODELS[name]
    cfg = json.loads((ours_ck(name) / "config.json").read_text())
    vocab = cfg["vocab_size"]
    m = min(vocab, 60000) - 10
    ids = lambda n, salt: [((i * 2654435761 + salt * 40503) % (1 << 32)) % m + 5 for i in range(n)]
    req = {"op": "bench_suite", "model": str(ours_ck(name)), "gen": GEN, "reps": REPS,
           "prompts": [ids(p, 7) for p in prompts], "warmup": {"prompt": ids(64, 1), "gen": 8}, "shape_warmup": True}
    r = sh([sys.executable, ROOT / "scripts" / "ref" / "mlx_lm_ref.py"], f"mlx-lm-{name}", input=json.dumps(req))
    res = json.loads(r.stdout)
    for row in res["results"]:
        record(engine="mlx-lm", model=name, round=rnd, metric="prefill_tps", prompt=row["prompt_len"],
               samples=[x["prefill_tps"] for x in row["runs"]], device=res.get("default_device"))
        record_cold("mlx-lm", name, rnd, row["prompt_len"], (row.get("cold") or {}).get("prefill_tps"))
        record(engine="mlx-lm", model=name, round=rnd, metric="decode_tps", prompt=row["prompt_len"],
               samples=[x["decode_tps"] for x in row["runs"]])


def round_models():
    # H200_MODELS=a,b narrows the rounds too (a short device budget: the
    # 350M alone needs no llama-quantize and the shortest conversion).
    names = os.environ.get("H200_MODELS")
    return [n for n in MODELS if not names or n in names.split(",")]


GGUF_PID = WORK / "gguf.pid"
GGUF_RC = WORK / "gguf.rc"
GGUF_OUT = WORK / "gguf-out"
GGUF_RESULT = None


def gguf_background():
    """llama.cpp's GGUF chain for the rounds (its converter and
    llama-quantize: ~175 s of session 24's call 3, on the CPU, while the
    GPU waited) started in a process session of its own, so it runs on
    across calls while the machine stays warm: a call of GPU-timed work
    (kernel-bench, kernel-detail, profile) goes on meanwhile, and the
    rounds wait for it (wait_gguf). Our checkpoints should exist already
    (`ab` makes them): it makes only what is missing, on the GPU where a
    checkpoint is. Every model of the rounds unless H200_GGUF_MODELS names
    them."""
    if GGUF_PID.exists():
        log("gguf-bg: already started on this machine")
        return
    WORK.mkdir(parents=True, exist_ok=True)
    e = dict(os.environ)
    e["OUT"] = str(GGUF_OUT)
    e.pop("H200_MODELS", None)
    if os.environ.get("H200_GGUF_MODELS"):
        e["H200_MODELS"] = os.environ["H200_GGUF_MODELS"]
    # (start_new_session: the child leads a session of its own, which the
    # device tool leaves running when this call's command returns; it
    # writes its own pid, which wait_gguf checks is alive.)
    GGUF_PID.write_text("")
    with open(WORK / "gguf-bg.log", "w") as logf:
        subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "gguf"], stdin=subprocess.DEVNULL, stdout=logf,
                         stderr=subprocess.STDOUT, env=e, start_new_session=True)
    log("GGUF chain started in the background")


def gguf():
    """What gguf_background runs: the rounds' checkpoints with their GGUF
    files. main() writes GGUF_RC ("0", or why not) once its logs are
    packed, so a waiter finds them complete."""
    global GGUF_RESULT
    GGUF_PID.write_text(str(os.getpid()))
    try:
        install()
        checkpoints(round_models())
        GGUF_RESULT = "0"
    except BaseException as e:
        GGUF_RESULT = f"failed: {e}"
        raise


def gguf_alive():
    try:
        os.kill(int(GGUF_PID.read_text().strip()), 0)
        return True
    except (ValueError, OSError):
        return False


def wait_gguf():
    """Where this machine runs a background GGUF chain: wait for its end
    (H200_GGUF_WAIT seconds at most, 240 by default, well inside a call's
    600; a dead process is not waited for), bring its logs into this
    call's $OUT, and say whether the rounds may convert what is missing
    themselves (True: no chain runs any more) or must leave llama.cpp out
    of this round (False: it still runs, and converting beside it would
    write the same files)."""
    if not GGUF_PID.exists():
        return True
    limit = float(os.environ.get("H200_GGUF_WAIT", "240"))
    t = time.time()
    # (Its pid appears once the child starts: a few seconds' grace while
    # the file is still empty.)
    started = lambda: GGUF_PID.read_text().strip() != ""
    while not GGUF_RC.exists() and time.time() - t < limit and (gguf_alive() or (not started() and time.time() - t < 10)):
        time.sleep(max(0.0, min(3.0, limit - (time.time() - t))))
    waited = round(time.time() - t, 1)
    OUT.mkdir(parents=True, exist_ok=True)
    if (WORK / "gguf-bg.log").exists():
        shutil.copy(WORK / "gguf-bg.log", OUT / "gguf-bg.log")
    packed = GGUF_OUT / "logs.tgz"
    if GGUF_RC.exists() and packed.exists():
        import tarfile

        try:
            with tarfile.open(packed, "r:gz") as tgz:
                for m in tgz.getmembers():
                    f = tgz.extractfile(m)
                    if f and "/" not in m.name:
                        (OUT / f"gguf-bg-{m.name}").write_bytes(f.read())
        except (tarfile.TarError, EOFError, OSError) as e:
            log(f"gguf-bg: its logs unreadable ({e})")
    rc = GGUF_RC.read_text().strip() if GGUF_RC.exists() else None
    running = rc is None and gguf_alive()
    record(engine="gguf-bg", waited_s=waited, rc=rc or ("still running" if running else "ended without a verdict"))
    return not running


def rounds(rnd):
    ours_extra()
    install()
    if wait_gguf():
        checkpoints(round_models())
        skip_llama = False
    else:
        # (Ours and mlx-lm still run; llama.cpp's files are not ready.)
        checkpoints(round_models(), gguf=False)
        skip_llama = True
    # (The device tool may lend an H100 for an H200: the round names its card.)
    record(engine="env", round=rnd, gpu=gpu_query("name"), picked=picked_env(), kernels_off=(WORK / "kernels-off").exists(),
           ours_env=ours_extra())
    for name in round_models():
        # Alternate which engine goes first so neither always meets a cold
        # (or a warm) machine.
        order = [run_llama, run_ours, run_mlx_lm]
        if rnd % 2 == 0:
            order.reverse()
        if skip_llama:
            record(engine="run_llama", model=name, round=rnd, error="the background GGUF chain had not finished")
            order = [f for f in order if f is not run_llama]
        for f in order:
            try:
                f(name, rnd)
            except SystemExit as e:
                log(f"{f.__name__} {name}: {e}")
                record(engine=f.__name__, model=name, round=rnd, error=str(e)[-2000:])


def ncu_count():
    """`--launch-count N` from H200_NCU_COUNT (a positive whole number;
    unset, every matching launch of the step): ncu's detail sections replay
    each launch ~18 times, saving and restoring the memory it may write, and
    session 51's 8B-A1B step (22 MoE and 18 conv launches) ran past 330 s
    of a call without finishing where the 1.2B's 26 launches took ~100 s.
    A few launches of each kernel say as much as all of a step's."""
    v = os.environ.get("H200_NCU_COUNT", "").strip()
    if not v:
        return []
    if not v.isdigit() or int(v) < 1:
        raise SystemExit(f"H200_NCU_COUNT={v!r}: a positive whole number of launches")
    return ["--launch-count", str(int(v))]


def ncu_step(name, tag, args, page, e):
    """ncu (with `args`) over step 32 of a 512-token prompt on the compiled
    single-sequence path of model `name`, environment `e`; its `page` as
    CSV (kept in $OUT as TAG-NAME.csv), or None after recording the error."""
    rep = WORK / f"{tag}-{name}"
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "-f", "-o", rep, *ncu_count(), *args,
           BENCH, "--model", ours_ck(name), "--device", "gpu", "--concurrent", "1", "--prompts", "512",
           "--gen", "40", "--reps", "1"]
    e["MLXLFM_PROFILE_STEP"] = "32"
    r = sh(cmd, f"{tag}-{name}", check=False, env=e)
    if r.returncode != 0:
        record(engine=tag, model=name, error=r.stderr[-2000:])
        return None
    csv = sh(["ncu", "--import", f"{rep}.ncu-rep", "--csv", "--page", page, "--print-units", "base",
              "--print-kernel-base", "function"], check=False)
    (OUT / f"{tag}-{name}.csv").write_text(csv.stdout)
    return csv.stdout


def profile():
    """ncu over one compiled decode step of the 1.2B and the 8B-A1B (step 32
    of a 512-token prompt, `--concurrent 1` drives the single-sequence
    compiled step as generate does), and the wall time of the same step
    without ncu, so host time = wall - GPU kernel time."""
    for name in ab_models():
        e = env()
        csv = ncu_step(name, "ncu", ["--metrics", "gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum"],
                       "raw", e)
        if csv is None:
            continue
        # The switches it ran with (`MLX_LFM_GEMV_KERNEL=1 run.py profile`
        # profiles an opt-in kernel's step).
        switches = {k: v for k, v in e.items() if k.startswith("MLX_LFM_")}
        record(engine="ncu", model=name, kernels=summarize_ncu(csv), switches=switches)
        # The same step's wall time without ncu (median over 64 steps, 3 reps).
        r = sh([BENCH, "--model", ours_ck(name), "--device", "gpu", "--concurrent", "1", "--prompts", "512",
                "--gen", "64", "--reps", "3"], f"step-{name}", check=False)
        walls = [json.loads(l)["solo_step_ms"] for l in r.stdout.splitlines() if "solo_step_ms" in l]
        record(engine="ncu", model=name, step_wall_ms=walls)


def profile_gaps():
    """Where a decode step's GPU time goes between its kernels (the issue's
    "gaps between kernels"): for each model in ab_models(), the kernels of
    one compiled step timed by ncu with the caches left warm
    (`--cache-control none`: `profile` flushes them before each launch,
    an upper bound), and the step's whole GPU time as one CUDA graph waited
    for right after its dispatch (gpu-time-per-step's knobs: the wait after
    the dispatch, host_us' fourth field: the median of three reps' means
    a step). Both under H200_OURS_ENV, as the rounds run. Their difference is the time no kernel of the step ran: the
    graph's launches between dependent kernels, and ncu's serial timing
    of each kernel alone. ncu's own per-kernel overhead is not in its
    durations, so the figure is an estimate, recorded as such."""
    for name in ab_models():
        e = ours_env()
        csv = ncu_step(name, "ncu-warm", ["--cache-control", "none", "--metrics", "gpu__time_duration.sum"], "raw", e)
        if csv is None:
            continue
        warm = summarize_ncu(csv)
        r = sh([BENCH, "--model", ours_ck(name), "--device", "gpu", "--prompts", "512", "--gen", "64", "--reps", "3",
                "--paths", "compiled"], f"gpu-step-{name}", check=False, env={**ours_env(), **AB["gpu-time-per-step"][0]})
        waits = gpu_step_waits(r.stdout)
        gpu_us = statistics.median(waits) if waits else None
        record(engine="profile-gaps", model=name, kernels=warm["kernels"], kernel_us_warm=warm["kernel_us"],
               under_5us=warm["under_5us"], gpu_step_us=gpu_us, gpu_step_us_runs=waits,
               gaps_us=None if gpu_us is None else gpu_us - warm["kernel_us"],
               by_kernel=warm["by_kernel"][:12])


def gpu_step_waits(stdout):
    """Each rep's wait after the dispatch (host_build_dispatch_wait_us_runs'
    fourth field) from mlx-lfm-bench's lines: under gpu-time-per-step's
    knobs, a step's whole GPU time."""
    waits = []
    for line in stdout.splitlines():
        try:
            j = json.loads(line)
        except ValueError:
            continue
        for run in j.get("host_build_dispatch_wait_us_runs") or []:
            if len(run) >= 4:
                waits.append(run[3])
    return waits


# ncu's detail sections and its per-reason warp stalls, as `profile-kernels`
# (a model's step) and `kernel-detail` (kernel-bench's arms) both take them.
NCU_SECTIONS = [a for sec in ["SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis",
                              "SchedulerStats"] for a in ("--section", sec)]
NCU_STALLS = ["--metrics", "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio"]


def profile_kernels():
    """ncu's detail sections (speed of light, occupancy, launch, warp stall
    reasons, memory) for the kernels matching H200_NCU_KERNELS (a regex) in
    one compiled decode step of each model in ab_models(), with the
    switches of the environment: why a kernel reads slower than its bytes
    say it could (the 2026-12-02 profile left the MoE down and the folded
    norm + quantized GEMV at 0.24-0.32 TB/s, with no registers spilled)."""
    # (Session 22's ncu: the experts' down kernel 23 µs a launch at 0.36
    # TB/s, the router 9.2 µs for 64 KB, the decode attention 15.7 µs at
    # 0.07 TB/s, beside MLX's own GEMV at 3.0 TB/s.)
    pattern = os.environ.get("H200_NCU_KERNELS", "lfm_moe_down|lfm_moe_gate_up|lfm_moe_router|lfm_decode_attention|"
                                                 "lfm_add_rms_norm|gemv_single|qmv_kernel")
    # (H200_NCU_STALLS_ONLY=1: the stall pass alone, where an earlier call
    # has the detail sections: session 57's took 180 s of the 8B-A1B's and
    # left the stall pass to its TERM.)
    stalls_only = os.environ.get("H200_NCU_STALLS_ONLY") == "1"
    for name in ab_models():
        e = env()
        switches = {k: v for k, v in e.items() if k.startswith("MLX_LFM_")}
        if not stalls_only:
            args = ["--kernel-name", f"regex:{pattern}", *NCU_SECTIONS]
            csv = ncu_step(name, "ncu-detail", args, "details", e)
            if csv is None:
                continue
            import csv as _csv
            import io
            per = {}
            for row in _csv.DictReader(io.StringIO(csv)):
                k = row.get("Kernel Name")
                if k:
                    per.setdefault(k, {})[row.get("Metric Name", "")] = row.get("Metric Value", "")
            record(engine="ncu-detail", model=name, switches=switches, kernels=per)
        # Where the warps wait, per issued instruction, by reason (long
        # scoreboard: a global load; barrier; not selected; ...): session 21
        # and 22 left the folds, the experts' down kernel, the router and the
        # decode attention at 45-55 cycles a warp's issue with DRAM mostly
        # idle. Its own ncu run (a metric this ncu lacks fails only this).
        stalls = ncu_step(name, "ncu-stalls", ["--kernel-name", f"regex:{pattern}", *NCU_STALLS], "raw", env())
        if stalls is not None:
            record(engine="ncu-stalls", model=name, switches=switches, kernels=summarize_stalls(stalls))


def kernel_detail():
    """ncu's detail sections and warp stall reasons (as `profile-kernels`
    takes them in a model's step) over `kernel-bench` arms alone
    (H200_DETAIL_ARMS, default the 8B-A1B's expert kernels: MLX's gathered
    down product, our down kernel and its early-loads variant, our gate/up):
    16 launches an arm on the same operands, no model around them, so it
    ends in about a minute where `profile-kernels` of the 8B-A1B's step ran
    past 440 s (session 24). Why the down kernel read 0.36 TB/s in session
    22's profile, and what more columns a warp change."""
    arms = os.environ.get("H200_DETAIL_ARMS", "mlx-moe-q4-down,moe-q4-down,moe-q4-down-early,moe-q4-gate-up")
    pattern = "gemv|qmv|gather_qmm|lfm_"
    import csv as _csv
    import io

    def run(tag, args, page, arms=arms):
        rep = WORK / tag
        bench = [BENCH, "--kernel-bench", "--device", "gpu", "--reps", "1", "--arms", arms]
        r = sh(["ncu", "--clock-control", "none", "-f", "-o", rep, "--kernel-name", f"regex:{pattern}", *args, *bench],
               tag, check=False)
        if r.returncode != 0:
            record(engine=tag, arms=arms, error=r.stderr[-2000:])
            return None
        csv = sh(["ncu", "--import", f"{rep}.ncu-rep", "--csv", "--page", page, "--print-units", "base",
                  "--print-kernel-base", "function"], check=False).stdout
        (OUT / f"{tag}.csv").write_text(csv)
        return csv

    details = run("kernel-detail", NCU_SECTIONS, "details")
    if details is not None:
        # Per kernel (name with its template values: one per arm here), the
        # median over its launches of each metric ncu gives a number for.
        per = {}
        for row in _csv.DictReader(io.StringIO(details)):
            k, m, v = row.get("Kernel Name"), row.get("Metric Name"), row.get("Metric Value", "")
            try:
                x = float(str(v).replace(",", ""))
            except ValueError:
                continue
            if k and m:
                per.setdefault(k, {}).setdefault(m, []).append(x)
        record(engine="kernel-detail", arms=arms,
               kernels={k: {m: sorted(v)[len(v) // 2] for m, v in ms.items()} for k, ms in per.items()})
    stalls = run("kernel-stalls", NCU_STALLS, "raw")
    if stalls is not None:
        record(engine="kernel-stalls", arms=arms, kernels=summarize_stalls(stalls))
    # Which instruction the warps wait at: ncu's per-SASS-line stall samples
    # for one launch of each arm in H200_SOURCE_ARMS (default our down
    # kernel, whose warps waited 40 cycles an issue on loads at 7% of DRAM's
    # bandwidth in session 26, where gate/up waited 3: the expert index, the
    # h row, the weights or the score; each has another fix).
    for arm in [a for a in os.environ.get("H200_SOURCE_ARMS", "moe-q4-down,moe-q4-down-early").split(",") if a]:
        source = run(f"kernel-source-{arm}", ["--section", "SourceCounters", "--section", "WarpStateStats",
                                              "--launch-skip", "4", "--launch-count", "1"], "source", arms=arm)
        if source is not None:
            record(engine="kernel-source", arms=arm, lines=summarize_source(source))


def summarize_source(text, top=24):
    """ncu's source page (SASS, one row an instruction): the `top`
    instructions with the most warp stall samples, as (address, SASS,
    samples, not-issued samples). Column names vary across ncu versions, so
    they are found by what they start with; an empty list where none is."""
    import csv as _csv
    import io

    # (The table's header is the first line naming a Source column: ncu
    # prints the kernel's name on a line of its own before it.)
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if '"Source"' in l), None)
    if start is None:
        return []
    rows = list(_csv.DictReader(io.StringIO("\n".join(lines[start:]))))
    if not rows:
        return []

    def col(*starts):
        for c in rows[0].keys():
            if c and any(c.strip().startswith(s) for s in starts):
                return c
        return None

    src, addr = col("Source"), col("# Address", "Address")
    allc, noti = col("Warp Stall Sampling (All"), col("Warp Stall Sampling (Not")
    if not src or not allc:
        return []

    def num(v):
        try:
            return float(str(v).replace(",", ""))
        except ValueError:
            return 0.0

    ranked = sorted(rows, key=lambda r: -num(r.get(allc)))
    return [[r.get(addr, ""), r.get(src, "").strip(), num(r.get(allc)), num(r.get(noti)) if noti else None]
            for r in ranked[:top] if num(r.get(allc)) > 0]


def summarize_stalls(text):
    """ncu's raw page of the stall metrics: per kernel name, the mean over
    its launches of each reason's warps per issued instruction, largest
    first."""
    import csv as _csv
    import io

    pre, post = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"
    sums, counts = {}, {}
    for row in _csv.DictReader(io.StringIO(text)):
        k = row.get("Kernel Name")
        if not k:
            continue
        for col, val in row.items():
            if not col or not col.startswith(pre):
                continue
            try:
                v = float(str(val).replace(",", ""))
            except ValueError:
                continue  # the units row
            reason = col[len(pre):].removesuffix(post)
            sums.setdefault(k, {}).setdefault(reason, 0.0)
            sums[k][reason] += v
            counts.setdefault(k, {}).setdefault(reason, 0)
            counts[k][reason] += 1
    return {k: dict(sorted(((r, round(x / counts[k][r], 2)) for r, x in rs.items()), key=lambda t: -t[1]))
            for k, rs in sums.items()}


def summarize_ncu(text):
    import csv as _csv
    import io

    num = lambda v: float(v.replace(",", ""))  # ncu writes thousands separators
    rows = list(_csv.DictReader(io.StringIO(text)))
    rows = [r for r in rows if r.get("Kernel Name") and r.get("gpu__time_duration.sum", "").replace(",", "").replace(".", "").isdigit()]
    per = {}
    for r in rows:
        k = r["Kernel Name"]
        t = num(r["gpu__time_duration.sum"]) / 1000.0  # ns -> us
        rd = num(r.get("dram__bytes_read.sum") or "0")
        p = per.setdefault(k, {"n": 0, "us": 0.0, "read_bytes": 0.0, "under5": 0})
        p["n"] += 1
        p["us"] += t
        p["read_bytes"] += rd
        p["under5"] += t < 5
    total = sum(p["us"] for p in per.values())
    top = sorted(per.items(), key=lambda kv: -kv[1]["us"])
    return {
        # The step's kernels in launch order (ncu's IDs), so a kernel no
        # name places (session 22: 16 `copy_g_nd` a 1.2B token) is placed
        # by its neighbours.
        "sequence": [short_kernel(r["Kernel Name"]) for r in sorted(rows, key=lambda r: int(num(r.get("ID") or "0")))],
        "kernels": sum(p["n"] for p in per.values()),
        "kernel_us": total,
        "under_5us": sum(p["under5"] for p in per.values()),
        "dram_read_bytes": sum(p["read_bytes"] for p in per.values()),
        "by_kernel": [{"name": k, **v, "share": v["us"] / total if total else 0} for k, v in top],
    }


def profile_prefill():
    """ncu over one 512-token prefill (and its first token) of each model in
    ab_models(), after an unmeasured prefill of the same shape, and the same
    prefill's wall time without ncu (the bench's TTFT). Both under
    H200_OURS_ENV's switches (session 41 profiled the defaults twice for
    want of them), which the record names."""
    for name in ab_models():
        rep = WORK / f"prof-prefill-{name}"
        e = ours_env()
        e["MLXLFM_PROFILE_PREFILL"] = "1"
        cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "-f", "-o", rep,
               "--metrics", "gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum",
               BENCH, "--model", ours_ck(name), "--device", "gpu", "--prompts", "512", "--gen", "1", "--reps", "3",
               "--paths", "compiled"]
        r = sh(cmd, f"ncu-prefill-{name}", check=False, env=e)
        if r.returncode != 0:
            record(engine="ncu-prefill", model=name, error=r.stderr[-2000:])
            continue
        csv = sh(["ncu", "--import", f"{rep}.ncu-rep", "--csv", "--page", "raw", "--print-units", "base",
                  "--print-kernel-base", "function"], check=False)
        (OUT / f"ncu-prefill-{name}.csv").write_text(csv.stdout)
        r = sh([BENCH, "--model", ours_ck(name), "--device", "gpu", "--prompts", "512", "--gen", "1", "--reps", "5",
                "--paths", "compiled"], f"prefill-wall-{name}", check=False, env=ours_env())
        ttft = [json.loads(l)["ttft_ms"] for l in r.stdout.splitlines() if "ttft_ms" in l]
        record(engine="ncu-prefill", model=name, prompt=512, kernels=summarize_ncu(csv.stdout), ttft_ms=ttft,
               ours_env=ours_extra())


def ab_binaries():
    """The previous build (.device/prev/mlx-lfm-bench-prev, carried) against
    this one on the same checkpoints, interleaved twice: what this change of
    the decode step buys, same machine, same minute."""
    prev = ROOT / ".device" / "prev" / "mlx-lfm-bench-prev"
    if not prev.exists():
        raise SystemExit("no .device/prev/mlx-lfm-bench-prev to compare with")
    for name in ab_models():
        for turn in range(2):
            for variant, binary in (("prev", prev), ("this", BENCH)):
                r = sh([binary, "--model", ours_ck(name), "--device", "gpu", "--prompts", "512", "--gen", "128",
                        "--reps", "3", "--paths", "compiled"], f"ab-bin-{name}", check=False)
                for line in r.stdout.splitlines():
                    j = json.loads(line)
                    if "prompt" in j:
                        record(engine="ab", model=name, variant=variant, turn=turn, prefill=j["prefill_tps_runs"],
                               decode=j["decode_tps_runs"])


def new_lengths():
    """TTFT at 8 never-seen prompt lengths (512-519) against 8 prompts of a
    seen one: the per-shape setup a server pays on this backend; by default
    (a prompt's attention padded to buckets of 128 on CUDA since session
    33, src/cache/bucket.rs: 512-519 all take the 640 bucket's graphs after
    the first) and with the buckets off (MLX_LFM_ATTENTION_BUCKET=0), a
    process each."""
    for name in ab_models():
        for variant, extra in [("defaults", {}), ("attention-bucket-off", {"MLX_LFM_ATTENTION_BUCKET": "0"})]:
            r = sh([BENCH, "--new-lengths", "8", "--prompts", "512", "--model", ours_ck(name), "--device", "gpu"],
                   f"new-lengths-{name}-{variant}", check=False, env={**ours_env(), **extra})
            for line in r.stdout.splitlines():
                j = json.loads(line) if line.startswith("{") else {}
                if "new_lengths" in j:
                    record(engine="new-lengths", model=name, variant=variant, **j)


def step_ops():
    """The primitives one compiled decode step hands MLX, by name, for each
    model (`mlx-lfm-bench --step-ops`), under this call's switches: with the
    host timing of `ab` and the rounds, what each node of a step costs the
    host (the decode step is host-bound on this machine, session 11); and
    per model the primitives of a 512-token prompt up to its first token
    (`--prefill-ops`)."""
    # H200_AB_VARIANTS=a,b: those variants' steps too (each where it applies).
    only = [v for v in os.environ.get("H200_AB_VARIANTS", "").split(",") if v in AB]
    # (H200_MODELS narrows it as it does `ab`; H200_PREFILL_OPS=0 leaves out
    # the prompts' counts, ~10 s a model.)
    for name in ab_models() if os.environ.get("H200_MODELS") else MODELS:
        for variant in ["all"] + only:
            extra, models = AB[variant]
            if models and name not in models:
                continue
            e = env()
            e.update(extra)
            # Every node of the step too (the bridge's MLXB_GRAPH_DUMP), whole.
            e["MLXB_GRAPH_DUMP"] = "1"
            r = sh([BENCH, "--step-ops", "--prompts", "16", "--model", ours_ck(name), "--device", "gpu"],
                   f"step-ops-{name}", check=False, env=e)
            (OUT / f"step-nodes-{name}-{variant}.txt").write_text(
                "\n".join(l for l in r.stderr.splitlines() if l.startswith("NODE ")) + "\n")
            for line in r.stdout.splitlines():
                j = json.loads(line)
                if "step_ops" in j:
                    j.pop("model", None)
                    record(engine="step-ops", model=name, variant=variant, **j)
        # What a 512-token prompt hands MLX up to its first token, as the
        # prefill figures run it (the 350M's and the 8B-A1B's P=512 prefill
        # miss their target; the pass is built eagerly, node by node), and
        # with the compiled prefill (its fused graph: session 16's opt-in).
        for variant, extra in [("all", {}), ("compiled-prefill", AB["compiled-prefill"][0])]:
            if os.environ.get("H200_PREFILL_OPS") == "0":
                break
            e = env()
            e.update(extra)
            r = sh([BENCH, "--prefill-ops", "--prompts", "512", "--model", ours_ck(name), "--device", "gpu"],
                   f"prefill-ops-{name}", check=False, env=e)
            for line in r.stdout.splitlines():
                j = json.loads(line) if line.startswith("{") else {}
                if "prefill_ops" in j:
                    j.pop("model", None)
                    record(engine="prefill-ops", model=name, variant=variant, **j)


def dispatch_cost():
    """What one node of each kind costs the host on this machine
    (`mlx-lfm-bench --dispatch-cost`: chains of 200 adds, views, GEMVs,
    4-bit GEMVs, RMSNorms and custom kernels; µs per node to build, to
    dispatch, to wait for; since session 57 the adds, products and norms
    at 16 rows too, a stacked step's). No checkpoint needed."""
    r = sh([BENCH, "--dispatch-cost", "--device", "gpu", "--reps", "5"], "dispatch-cost", check=False)
    for line in r.stdout.splitlines():
        j = json.loads(line)
        if "dispatch_cost" in j:
            record(engine="dispatch-cost", **j)


def shape_cost():
    """Which op of a prompt's pass pays for a length never seen before
    (`mlx-lfm-bench --shape-cost`: causal attention, the bf16 and 4-bit
    products, RMSNorm at the 1.2B's widths, each timed with its wait at 8
    new lengths, then 8 times at a seen one). No checkpoint needed;
    session 32's rounds paid 68-137 ms a new length against 4-60 warm."""
    r = sh([BENCH, "--shape-cost", "--device", "gpu", "--reps", "8"], "shape-cost", check=False)
    for line in r.stdout.splitlines():
        j = json.loads(line) if line.startswith("{") else {}
        if "shape_cost" in j:
            record(engine="shape-cost", **j)


def moe_timeline():
    """Where the 8B-A1B's one-launch MoE layer spends its launch (as it
    ships, in float32, with the down rows' prefetch), the one-launch
    feed-forward (the 1.2B's dense one, the 8B-A1B's 4-bit one cold and
    with its weights in L2), and the one-launch conv layer (the 8B-A1B's 4-bit
    and the 1.2B's dense, without and with its rows asked for early, and
    warm) (`mlx-lfm-bench --kernel-bench --arms
    moe-layer-q4-timeline,conv-layer-timeline,ffn-layer-timeline`, no ncu:
    their timeline forms stamp the GPU's global timer as each block takes
    its part, ends its wait, has its row staged and is done; L2 evicted
    before each launch but the warm forms'). Session 33's ncu had the MoE launch at 40 µs in the step
    (~0.6 TB/s), the conv launch at 25 (~0.37). No checkpoint needed."""
    r = sh([BENCH, "--kernel-bench", "--device", "gpu", "--reps", "2", "--arms",
            "moe-layer-q4-timeline,conv-layer-timeline,ffn-layer-timeline"], "moe-timeline", check=False)
    if r.returncode != 0:
        record(engine="moe-timeline", error=r.stderr[-2000:])
    for line in r.stdout.splitlines():
        j = json.loads(line) if line.startswith("{") else {}
        if any(k in j for k in ("moe_timeline_summary", "moe_timeline", "conv_timeline_summary", "conv_timeline",
                                "ffn_timeline_summary", "ffn_timeline")):
            record(engine="moe-timeline", **j)
        elif "timeline_error" in j:
            record(engine="moe-timeline", arm=j["timeline_error"], error=j["error"])


def layer_chains():
    """The one-launch layers back to back in one stream, each launch's
    row the one before's output, as a step runs them (`mlx-lfm-bench
    --kernel-bench --arms layer-chains`, no ncu): a launch's time as the
    slope of two chains' walls, against the stock launches each replaces
    and MLX's GEMV of the q/k/v rows, and the 8B-A1B's one-launch MoE
    layer (since session 51), then the conv layer's, the feed-forward's,
    the q/k/v stage's and the MoE layer's timeline forms chained (each
    launch's span on the GPU's global timer, the gap to the next, and
    where each stage ends). The question (session 41): is the
    ~10-15 µs that ncu's lone launches read over these layers' bytes fixed
    a launch, ~190 µs of the 1.2B's step, or ncu's idle clocks? No
    checkpoint needed."""
    r = sh([BENCH, "--kernel-bench", "--device", "gpu", "--reps", "5", "--arms", "layer-chains"], "layer-chains", check=False)
    if r.returncode != 0:
        record(engine="layer-chains", error=r.stderr[-2000:])
    for line in r.stdout.splitlines():
        j = json.loads(line) if line.startswith("{") else {}
        if "layer_chain" in j or "layer_chain_timeline" in j:
            record(engine="layer-chains", **j)


def short_kernel(name):
    """A kernel's name without the hash of its text our kernels carry
    (src/mlx/kernel.rs: module_name), keeping its template values (K, C,
    the dtype), which tell apart the variants of one kernel."""
    return re.sub(r"_[0-9a-f]{16}(?=_|$)", "", name)[:100]


def kernel_bench():
    """Each GEMV kernel alone, timed by ncu (`mlx-lfm-bench
    --kernel-bench`: the decode step's GEMV shapes one product a launch,
    MLX's `gemv_single` and each walk of ours, and the 8B-A1B's 4-bit
    shapes through MLX's qmv and our two quantized GEMVs, on the same operands; ncu
    flushes the caches before each launch, so a product's weights come from
    DRAM as a step's do): µs a launch and GB/s, per arm and shape. Then the
    `scalar-*` arms (after the GEMVs, which now take the 1.2B's tied LM
    head, 65,536 x 2,048, and its stacked w1/w3, 16,384 x 2,048, MLX's GEMV
    of it, `mlx-w13`, against our SwiGLU GEMV, `ours-swiglu`: 46% of the
    1.2B's bytes a step): one small kernel reading its scalar from a template
    constant, from device memory, from MLX's managed pool (GPU-written, host
    made once, host made each launch): whether a step's kernels pay for the
    position and eps they read from managed memory. Then the `att-*` arms:
    the decode attention's variants alone on the 1.2B's shape (the chunked
    ones two kernels a product: each kernel's median and their sum). Last
    the `*moe-q4-*` arms: the 8B-A1B's routed experts for one decode row,
    MLX's gathered products (`gather_qmv`) and our gate/up and down kernels,
    the down kernel at 1, 2 and 4 columns a warp (a plan's n is the rows
    the row's 4 experts read, k their width, so the GB/s are comparable).
    Then the 1.2B's norm with the projection after it: as the step runs
    them (`norm-then-*`, the add + RMSNorm kernel and the GEMV, two
    kernels a product: us_per_product sums them) against the prologue
    fold and the deferred one (`fold-*`, one launch). Last the 8B-A1B's
    whole MoE layer for one row: the three launches the step runs
    (`moe-layer-q4-three`: the router + norm, gate/up, down) against the
    one of src/kernels/moe_fused.rs (`moe-layer-q4-fused`), and its
    short-conv layer: the four launches (`conv-layer-q4-four`: the add +
    RMSNorm, MLX's qmv, the conv step, MLX's qmv) against the one of
    src/kernels/conv_fused.rs (`conv-layer-q4-fused`), and the same over
    the 1.2B's dense projections (`conv-layer-bf16-*`, MLX's GEMVs); the
    1.2B's feed-forward: the three launches (`ffn-layer-bf16-three`: the
    add + RMSNorm, the SwiGLU GEMV, MLX's GEMV of w2) against the one of
    src/kernels/ffn_fused.rs (`ffn-layer-bf16-fused`), and the 8B-A1B's
    dense layers' 4-bit feed-forward: the four launches (`ffn-layer-q4-four`:
    the add + RMSNorm, MLX's qmv of w1/w3, the gate, qmv of w2) against the
    one (`ffn-layer-q4-fused`). Last a conv layer with what follows it as
    two one-launch kernels and as the joined one (`conv-ffn-layer-bf16-two`
    / `-joined`, the 1.2B's; `conv-moe-layer-q4-two` / `-joined`, the
    8B-A1B's).
    No checkpoint needed (over 140 s under ncu in session 30: narrow it
    with H200_KERNEL_BENCH_ARMS)."""
    rep = WORK / "kernel-bench"
    cmd = ["ncu", "--clock-control", "none", "-f", "-o", rep, "--kernel-name",
           "regex:gemv|qmv|gather_qmm|lfm_bench_scale|lfm_decode_attention|lfm_moe|lfm_add_rms_norm|lfm_short_conv|lfm_conv_fused|lfm_ffn_fused|lfm_conv_layer_fused|lfm_conv_moe_fused|lfm_qkv_",
           "--metrics", "gpu__time_duration.sum,dram__bytes_read.sum",
           BENCH, "--kernel-bench", "--device", "gpu", "--reps", "3"]
    # H200_KERNEL_BENCH_ARMS=a,b: those arms alone (the whole list ran past
    # 140 s under ncu in session 30).
    if os.environ.get("H200_KERNEL_BENCH_ARMS"):
        cmd += ["--arms", os.environ["H200_KERNEL_BENCH_ARMS"]]
    r = sh(cmd, "kernel-bench", check=False)
    plan = next((json.loads(l)["kernel_bench_plan"] for l in r.stdout.splitlines() if "kernel_bench_plan" in l), None)
    walls = [json.loads(l) for l in r.stdout.splitlines() if '"kernel_bench":' in l]
    if r.returncode != 0 or plan is None:
        record(engine="kernel-bench", error=r.stderr[-2000:])
    if plan is None:
        return
    csv = sh(["ncu", "--import", f"{rep}.ncu-rep", "--csv", "--page", "raw", "--print-units", "base",
              "--print-kernel-base", "function"], check=False).stdout
    (OUT / "kernel-bench.csv").write_text(csv)
    import csv as _csv
    import io

    num = lambda v: float(v.replace(",", ""))
    rows = [x for x in _csv.DictReader(io.StringIO(csv))
            if x.get("Kernel Name") and x.get("gpu__time_duration.sum", "").replace(",", "").replace(".", "").isdigit()]
    rows.sort(key=lambda x: int(num(x.get("ID") or "0")))
    # The plan's launches in order: each arm's and shape's share of the rows,
    # up to an arm that failed (its line has an `error`): from there ncu's
    # list departs from the plan, so the later arms keep their wall times only.
    at = 0
    attributed = True
    for p in plan:
        wall = next((w for w in walls if w["kernel_bench"] == p["arm"] and w["n"] == p["n"] and w["k"] == p["k"]), {})
        if not attributed or not wall or "error" in wall:
            why = wall.get("error") or ("no line: the process ended before this arm" if attributed else
                                        "not attributed: an arm before it failed")
            attributed = False
            record(engine="kernel-bench", arm=p["arm"], n=p["n"], k=p["k"], error=why,
                   products=wall.get("launches"), wall_us_median=wall.get("wall_us_median"))
            continue
        mine = rows[at:at + p["launches"]]
        at += p["launches"]
        us = sorted(num(x["gpu__time_duration.sum"]) / 1000.0 for x in mine)
        read = [num(x.get("dram__bytes_read.sum") or "0") for x in mine]
        # (An arm of several kernels a product, the chunked attention's part
        # and join: each kernel's median, and their sum a product.)
        by_name = {}
        for x in mine:
            by_name.setdefault(short_kernel(x["Kernel Name"]), []).append(num(x["gpu__time_duration.sum"]) / 1000.0)
        by_name = {kname: sorted(v)[len(v) // 2] for kname, v in by_name.items()}
        med = us[len(us) // 2] if us else None
        record(engine="kernel-bench", arm=p["arm"], n=p["n"], k=p["k"], launches=len(mine),
               kernels=sorted({short_kernel(x["Kernel Name"]) for x in mine}), us_median=med, us_min=us[0] if us else None,
               # (bf16 weights, or 4-bit with a bf16 scale and bias a group of 64;
               # the scalar arms read one row, their time is the figure)
               gbps_median=(p["n"] * p["k"] * (0.5625 if "q4" in p["arm"] else 2) / (med * 1e3))
               if med and not p["arm"].startswith(("scalar", "att-", "norm-then")) else None,
               dram_read_bytes_median=sorted(read)[len(read) // 2] if read else None,
               us_median_by_kernel=by_name, us_per_product=sum(by_name.values()) if by_name else None,
               wall_us_median=wall.get("wall_us_median"))
    if attributed and at != len(rows):
        record(engine="kernel-bench", error=f"{len(rows)} GEMV launches under ncu, the plan has {at}")


def host_profile():
    """Where a decode's host time goes, sampled in process (`mlx-lfm-bench
    --host-profile`: a SIGPROF timer over the measured reps, the
    interrupted address of the decoding thread named by its library and
    offset; no debugger, no stop): a 512-token prompt and 512 tokens, three
    reps, the compiled step, for each model in ab_models(). Records the
    profile beside the same run's figures; `bench/h200/symbolize.py` names
    the offsets here from the wheel's libmlx.so."""
    hz = os.environ.get("H200_PROFILE_HZ", "1000")
    # With H200_OURS_ENV, as the rounds run our engine (e.g. a preloaded
    # allocator: what is left of the host's time under it).
    e = ours_env()
    for name in ab_models():
        r = sh([BENCH, "--model", ours_ck(name), "--device", "gpu", "--prompts", "512", "--gen", "512", "--reps", "3",
                "--paths", "compiled", "--host-profile", hz], f"host-profile-{name}", check=False, env=e)
        lines = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
        figures = next(({k: j[k] for k in ("decode_tps_runs", "prefill_tps_runs", "host_build_dispatch_wait_us_runs")}
                        for j in lines if "decode_tps_runs" in j), {})
        for j in lines:
            if "host_profile" in j:
                record(engine="host-profile", model=name, hz=int(hz), preload=e.get("LD_PRELOAD"), **j, **figures)


def constrained():
    """Constrained (a JSON schema, a regex) against free decode on this GPU,
    alone and 4 batched (`mlx-lfm-bench --constrained`)."""
    for name in ("lfm2-350m-bf16", "lfm2-1.2b-bf16"):
        r = sh([BENCH, "--constrained", "--model", ours_ck(name), "--device", "gpu", "--gen", "128", "--reps", "3",
                "--batch", "4"], f"constrained-{name}", check=False)
        for line in r.stdout.splitlines():
            j = json.loads(line)
            if "case" in j:
                record(engine="constrained", model=name, **j)


def test_processes(names, jobs, new=()):
    """The kernel tests' processes: `groups` (lists of names) and `exact`
    (the compiled prefill's, run with TF32 off), from the listed names and
    H200_KERNEL_JOBS; `new` (never_judged) together in one process more."""
    groups = [[n] for n in names if GREEDY in n] if jobs > 1 else []
    # The MLX_LFM_QINT tests build their kernels under a process switch and
    # skip where another test built kernels first in the same process
    # (session 37: grouped with the conv test, both printed "skipped" and
    # the whole call ran with the kernels off): each in a process of its own.
    alone = [n for n in names if any(a in n for a in ALONE_TESTS)]
    groups += [[n] for n in alone]
    # A test no session has judged (never_judged), which a shared libtest
    # process would run in its place by name, maybe after the call's TERM:
    # together in one process more (the backend-free ones among them take
    # seconds), not counted against the slots the rest share.
    fresh = [n for n in new if n not in alone and GREEDY not in n and "compiled_prefill" not in n]
    # The compiled prefill's test in a process of its own with MLX's TF32
    # products off (read once per process), so its f32 cases are held to
    # f32's tolerance (session 17: 8.9e-4 of the scale apart with TF32 on);
    # one process more than H200_KERNEL_JOBS, beside the others.
    exact = [n for n in names if "compiled_prefill" in n]
    rest = [n for n in names if (jobs <= 1 or GREEDY not in n) and n not in exact and n not in alone and n not in fresh]
    slots = max(1, jobs - len(groups))
    groups += [rest[i::slots] for i in range(slots)] + [fresh]
    groups = [g for g in groups if g]
    return groups, exact


# MLX's buffer cache in each of several test processes sharing a GPU, MiB.
TEST_CACHE_LIMIT_MB = 1024


def passed_in(paths):
    """The tests whose last verdict in these committed raw files' test
    records (in the order given, a later one replacing an earlier, as
    `verdicts-from` reads them) is a pass."""
    last = {}
    for r in test_records(paths):
        last.update(record_verdicts(r))
    return {t for t, v in last.items() if v}


def never_judged(names):
    """The listed GPU tests (`kernels::tests`, `compiled::tests`; the
    modules' own tests are the CPU's) that no committed raw file has a
    verdict of: they share a process of their own (test_processes), so
    that a call cut by its TERM (every whole-suite call since session 16)
    has run the tests never run anywhere. (Within a process libtest runs its tests by name, whatever
    order they are given in: session 52's new test waited behind ~40
    others and did not start before the TERM.)"""
    # (Without any committed raw file there is no history to be new to: the
    # suite's usual grouping.)
    paths = committed_raw_files()
    if not paths:
        return []
    judged = set()
    for r in test_records(paths):
        judged.update(record_verdicts(r))
    return [n for n in names if n.startswith(("kernels::tests::", "compiled::tests::"))
            and n.rsplit("::", 1)[-1] not in judged]


def test_binary():
    """The library's test binary, unpacked where prepare.sh gzipped it: the
    stripped binary (~15 MB) beside .device/b and the tree came within
    0.3 MB of the 64 MiB a call carries, and session 48's call of the two
    was refused as over it; packed it is ~6 MB, room for .device/ptx too.
    A packed one is preferred to a plain one, the newest first (stage()
    copies .device/tests into TESTS, where an older build may lie)."""
    found = [*(ROOT / ".device" / "tests").glob("mlx_lfm-*")] or [*TESTS.glob("mlx_lfm-*")]
    if not found:
        raise SystemExit("no test binary in .device/tests (bench/h200/prepare.sh builds it)")
    t = min(found, key=lambda p: (p.suffix != ".gz", -p.stat().st_mtime))
    if t.suffix != ".gz":
        return t
    import gzip

    plain = TESTS / t.stem
    if not plain.exists() or plain.stat().st_mtime < t.stat().st_mtime:
        TESTS.mkdir(parents=True, exist_ok=True)
        part = plain.with_name(plain.name + ".part")
        with gzip.open(t) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst)
        part.chmod(0o755)
        part.replace(plain)
    return plain


def kernels():
    """Each fused kernel's tests against the stock ops (src/kernels/tests.rs),
    on this GPU, each test's verdict recorded. If a default kernel's test
    fails, the benchmark runs with the kernels off (MLX_LFM_KERNELS=0); an
    opt-in kernel whose tests fail is not adopted by `pick`."""
    tests = [test_binary()]
    # H200_KERNEL_TESTS=a,b runs only the tests whose names hold a or b
    # (each NVRTC compile costs device minutes); verdicts of tests not run
    # are absent, so `pick` does not adopt a variant that needs them.
    # (With the fused kernels' tests, the compiled prefill's: an opt-in
    # switch `pick` may adopt only where it passed on this GPU.)
    # H200_KERNEL_TESTS=unrun: the whole suite's tests this machine has no
    # verdict of yet (kernel-ran.json): the suite over two calls, the second
    # running what the first's TERM cut. H200_KERNEL_TESTS=unpassed:FILE,..
    # (committed raw files): of those, the ones that did not pass in FILE
    # (cut, failed or never reached there), the same command in each call
    # until none is left: session 52's suite finished 26 of its 60 GPU tests.
    whole = "kernels::,compiled_prefill_equals_the_eager_prefill"
    chosen = os.environ.get("H200_KERNEL_TESTS", whole)
    unpassed = chosen.startswith("unpassed:")
    unrun = chosen == "unrun" or unpassed
    filters = [f for f in (whole if unrun else chosen).split(",") if f]
    # The whole suite took 578 s of a call's 600 in one process (NVRTC
    # compiles per shape and dtype, on the host's cores): H200_KERNEL_JOBS
    # processes (3) share the GPU, each greedy test (the longest: four since
    # session 31, a fixture each) alone in one, the rest over what is left
    # of H200_KERNEL_JOBS (at least one process).
    listed = sh([tests[0], *filters, "--list"], check=False).stdout
    names = [l.split(": test")[0] for l in listed.splitlines() if l.endswith(": test")]
    ran_file = WORK / "kernel-ran.json"
    ran = json.loads(ran_file.read_text()) if ran_file.exists() else {}
    if unrun:
        names = [n for n in names if n.rsplit("::", 1)[-1] not in ran]
        log(f"{len(names)} tests without a verdict on this machine yet ({len(ran)} with one)")
        if unpassed:
            passed = passed_in(chosen.split(":", 1)[1].split(","))
            names = [n for n in names if n.rsplit("::", 1)[-1] not in passed]
            log(f"{len(names)} of them did not pass in {chosen.split(':', 1)[1]}")
        if not names:
            return
    groups, exact = test_processes(names, max(1, int(os.environ.get("H200_KERNEL_JOBS", "3"))), never_judged(names))
    runs = parted_runs(groups, kernel_test_parts())
    if exact:
        runs.append((exact, None))
    procs = []
    # Each process writes into files of its own as it runs, not into pipes
    # read at its end: a call cut by its TERM (session 48's seven processes
    # at 560 s) still records the tests that had finished in it.
    logs = WORK / "kernel-test-logs"
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    cut = False
    try:
        for i, (g, part) in enumerate(runs):
            cmd = [str(tests[0]), *g, "--exact", "--test-threads", "1", "--nocapture"]
            e = env()
            # The tests decide whether the kernels work: a kernels-off file
            # left by `verdicts-from` or an earlier call must not turn them
            # off here (session 46: three calls' tests all skipped so, each
            # writing the file again). Only the caller's own
            # MLX_LFM_KERNELS=0 stands.
            if "MLX_LFM_KERNELS" not in os.environ:
                e.pop("MLX_LFM_KERNELS", None)
            if g is exact:
                e["MLX_ENABLE_TF32"] = "0"
                cmd_env = "MLX_ENABLE_TF32=0 "
            else:
                cmd_env = ""
            if part:
                e["MLX_LFM_TEST_PART"] = f"{part[0]}/{part[1]}"
                cmd_env += f"MLX_LFM_TEST_PART={part[0]}/{part[1]} "
            if len(runs) > 1:
                # Processes sharing the GPU each hold MLX's buffer cache to
                # a share of it (src/kernels/tests.rs test_cache_limit):
                # session 53's fourteen ran an H100 out of memory, six
                # tests failing on cudaMallocAsync that passed in a call of
                # five processes.
                e["MLX_LFM_TEST_CACHE_LIMIT_MB"] = str(TEST_CACHE_LIMIT_MB)
                cmd_env += f"MLX_LFM_TEST_CACHE_LIMIT_MB={TEST_CACHE_LIMIT_MB} "
            log("$", cmd_env + " ".join(cmd))
            with open(logs / f"{i}.out", "w") as o, open(logs / f"{i}.err", "w") as er:
                procs.append((cmd_env + " ".join(cmd), subprocess.Popen(cmd, stdout=o, stderr=er, text=True, env=e),
                              logs / f"{i}.out", logs / f"{i}.err", part))
        for _, p, _, _, _ in procs:
            p.wait()
    except Stopped:
        cut = True
        for _, p, _, _, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    verdicts, out, err, rcs = {}, "", "", []
    part_verdicts = {}
    for cmd, p, out_file, err_file, part in procs:
        o, e = out_file.read_text(errors="replace"), err_file.read_text(errors="replace")
        OUT.mkdir(parents=True, exist_ok=True)
        with open(OUT / "kernel-tests.log", "a") as f:
            f.write(f"$ {cmd}\n{o}\n--- stderr\n{e[-20000:]}\n")
        out, err = out + o, err + e
        rcs.append(p.returncode)
        # A greedy set's verdict holds where it passed on every fixture,
        # over all the processes. A process that ended by a signal (killed
        # here, or the TERM `timeout` sends its whole group, or a crash) ran
        # its sets on only some fixtures: its FAILED lines count, its passes
        # do not; only its finished tests' libtest lines stand.
        ended = p.returncode is not None and p.returncode >= 0
        for k, v in test_verdicts(o, e).items():
            if k.startswith("greedy:"):
                if ended or not v:
                    verdicts[k] = verdicts.get(k, True) and v
            elif part:
                part_verdicts.setdefault(k, {})[part] = v
            else:
                verdicts[k] = v
    # A test run in parts has a verdict once every part finished: one part's
    # pass is a pass of its cases only.
    for k, got in part_verdicts.items():
        n = next(iter(got))[1]
        if len(got) == n:
            verdicts[k] = all(got.values())
        else:
            log(f"{k}: {len(got)} of its {n} parts finished, no verdict")
    # A test that found kernels built before it in its process checked
    # nothing (tests.rs `alone_with`): its verdict is a failure, not a
    # GPU-less run's skip, which turns every kernel off.
    for m in re.finditer(r"skipped (\w+): kernels were built without", err):
        verdicts[m.group(1)] = False
    skipped = "skipped" in re.sub(r"skipped \w+: kernels were built without", "", err)
    narrowed = bool(os.environ.get("MLX_LFM_TEST_CASES"))
    if unrun:
        # The tests the earlier call ran are not run again, but its greedy
        # sets' fixtures are this call's too: a set FAILED on one fixture
        # there stays failed whatever the fixture run here says.
        for k, v in verdicts.items():
            if k.startswith("greedy:") and k in ran:
                verdicts[k] = ran[k] and v
    ok = bool(procs) and all(rc == 0 for rc in rcs) and not skipped and not cut
    # (MLX_LFM_TEST_CASES narrows the layer tests to the cases named: a
    # verdict of those cases only, recorded as such.)
    record(engine="tests", suite="kernels::", passed=ok, verdicts=verdicts, skipped=skipped, tail=(out + err)[-3000:],
           sources=kernel_sources(), cases=os.environ.get("MLX_LFM_TEST_CASES") or "all", cut=cut,
           parts={k: sorted(f"{i}/{n}" for i, n in got) for k, got in part_verdicts.items()})
    mine = {k: v and not skipped for k, v in verdicts.items()}
    if not skipped:
        # What this machine has run, for `unrun`: its greedy sets too (to
        # join), not a narrowed run's layer tests (some cases only).
        WORK.mkdir(parents=True, exist_ok=True)
        this = {k: v for k, v in mine.items() if not (narrowed and k in NARROWED_TESTS)}
        ran_file.write_text(json.dumps({**ran, **this}))
    verdicts_file = WORK / "kernel-verdicts.json"
    partial = "H200_KERNEL_TESTS" in os.environ
    if partial and verdicts_file.exists():
        # A chosen few run after `verdicts-from` (or an earlier call): theirs
        # replace those tests' verdicts, the others' stand.
        mine = {**json.loads(verdicts_file.read_text()), **mine}
    verdicts_file.write_text(json.dumps(mine))
    # (A partial run with no earlier verdicts judges the defaults it ran.)
    default_ok = all(mine.get(t, False) for t in DEFAULT_KERNEL_TESTS if t in mine or not partial) and not skipped
    if default_ok:
        (WORK / "kernels-off").unlink(missing_ok=True)
    else:
        (WORK / "kernels-off").write_text("1")
    log("kernel tests", verdicts, "" if default_ok else "- a default kernel FAILED or did not run: benchmark runs with MLX_LFM_KERNELS=0")
    if cut:
        raise Stopped("stopped by SIGTERM during the kernel tests (the finished ones recorded)")


# Tests too long for one process within a call, run as that many processes
# (tests.rs case_chosen: MLX_LFM_TEST_PART=i/n takes every n-th case):
# session 49's H100 left the feed-forward's (~500 s whole) unfinished at
# 400 s and decode attention's (~20 compiles a case, since split into the
# default kernel's test and its variants') at 320 s; the conv layer's took
# ~300 s. H200_KERNEL_PARTS=name=n,... replaces these.
KERNEL_TEST_PARTS = {"ffn_fused_kernel_matches_stock_ops": 4, "decode_attention_kernel_matches_stock_ops": 2,
                     "decode_attention_variants_match_stock_ops": 4, "conv_fused_kernel_matches_stock_ops": 2,
                     # (Session 52: nine of its twelve cases in 230 s.)
                     "moe_fused_gate_rows_match_the_exact_form": 3}


def kernel_test_parts():
    """KERNEL_TEST_PARTS, or H200_KERNEL_PARTS's (`name=n,...`; n 1 runs a
    test whole)."""
    v = os.environ.get("H200_KERNEL_PARTS")
    if v is None:
        return dict(KERNEL_TEST_PARTS)
    parts = {}
    for item in filter(None, (x.strip() for x in v.split(","))):
        name, _, n = item.partition("=")
        if not n.strip().isdigit() or int(n) < 1:
            raise SystemExit(f"H200_KERNEL_PARTS: {item!r} is not name=n with n at least 1")
        parts[name.strip()] = int(n)
    return parts


def parted_runs(groups, parts):
    """The processes to start, each (names, part): a test of `parts` (by
    its short name) leaves its group for n processes of its own, part
    (i, n) each; the rest run as grouped, part None."""
    runs = []
    for g in groups:
        n_of = {name: parts.get(name.rsplit("::", 1)[-1], 1) for name in g}
        rest = [name for name in g if n_of[name] == 1]
        if rest:
            runs.append((rest, None))
        for name in g:
            if n_of[name] > 1:
                runs += [([name], (i, n_of[name])) for i in range(n_of[name])]
    return runs


def test_verdicts(out, err):
    """The verdicts in one test process's output: libtest's line per
    finished test ("test kernels::tests::x ... ok"), and the greedy test's
    line per case and kernel set ("...: the MLX_LFM_QGEMV_KERNEL kernels
    passed; near-ties: [...]"), a set's verdict "greedy:<set>" holding where
    every case it ran passed. A test a cut process had not finished has
    none."""
    verdicts = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "test" and parts[2] == "...":
            verdicts[parts[1].rsplit("::", 1)[-1]] = parts[3] == "ok"
    for line in err.splitlines():
        m = re.search(r": the (.+?) kernels (passed|FAILED)", line)
        if m:
            key = "greedy:" + m.group(1)
            verdicts[key] = verdicts.get(key, True) and m.group(2) == "passed"
    return verdicts


def kernel_sources():
    """A short hash of each file the kernels' device code lives in, as this
    working tree has it: recorded with the tests' verdicts, so that a later
    `verdicts-from` sees which kernels changed since (session 19 changed a
    default kernel's loops after its binaries were tested)."""
    import hashlib
    files = sorted((ROOT / "src" / "kernels").glob("*.rs")) + [ROOT / "src" / "mlx" / "kernel.rs", ROOT / "cpp" / "mlxb.cpp"]
    return {str(f.relative_to(ROOT)): hashlib.sha256(f.read_bytes()).hexdigest()[:12] for f in files
            if f.exists() and f.name != "tests.rs"}


# The tests MLX_LFM_TEST_CASES narrows (src/kernels/tests.rs case_chosen).
NARROWED_TESTS = ("ffn_fused_kernel_matches_stock_ops", "conv_fused_kernel_matches_stock_ops",
                  "decode_attention_kernel_matches_stock_ops", "decode_attention_variants_match_stock_ops",
                  "moe_fused_forms_match_their_references", "moe_fused_gate_rows_match_the_exact_form",
                  "moe_fused_kernel_matches_the_three_kernels",
                  # (The qint_tests! macro's, which run the layers' own tests.)
                  "q_by_its_bits_conv_layer_matches_stock_ops", "q_by_its_bits_ffn_layer_matches_stock_ops",
                  "q_by_its_bits_moe_layer_matches_stock_ops", "q_by_conversion_conv_layer_matches_stock_ops",
                  "q_by_conversion_ffn_layer_matches_stock_ops", "q_by_conversion_moe_layer_matches_stock_ops")


def committed_raw_files():
    """Every committed raw file, in session order (`verdicts-from
    committed`: a later session's verdict replaces an earlier one; the
    names sort by date, then by session number, an h100 session 31 after an
    h200 session 30 of the same day)."""
    def key(p):
        m = re.search(r"session(\d+)(\w*)", p.name)
        return (p.name[:10], int(m.group(1)) if m else 0, m.group(2) if m else "", p.name)
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "bench" / "results").glob("*.raw.jsonl"), key=key)]


def test_records(paths):
    """The kernel tests' records of these committed raw files (paths under
    the repository's root), in the order given and as written."""
    return [json.loads(l) for p in paths for l in (ROOT / p).read_text().splitlines() if '"engine": "tests"' in l]


def record_verdicts(r):
    """A `tests` record's verdicts that stand for their whole tests: a run
    narrowed by MLX_LFM_TEST_CASES judged those cases only, so its layer
    tests' verdicts do not (an earlier whole run's stand, or the test runs
    again)."""
    got = dict(r.get("verdicts", {}))
    if r.get("cases", "all") != "all":
        got = {t: v for t, v in got.items() if t not in NARROWED_TESTS}
    return got


def verdict_sources(rows):
    """Each test's latest verdict's kernel source hashes (None: a record
    from before they were kept), over `tests` records in order."""
    sources = {}
    for r in rows:
        for t in record_verdicts(r):
            sources[t] = r.get("sources")
    return sources


def verdicts_from(path):
    """The kernel tests' verdicts of an earlier session (its committed raw
    file's last `tests` record) instead of running them again (~380 s of a
    session's 1,800): only where no kernel's code changed since that
    record's binaries, which this machine cannot check (no git history
    travels); check it here first with
    `git diff --stat COMMIT -- src/kernels src/mlx/kernel.rs cpp`."""
    # FILE,FILE...: each file's records in the order given (session 18 ran
    # only the tests whose kernels changed, over session 16's verdicts).
    paths = committed_raw_files() if path == "committed" else path.split(",")
    rows = test_records(paths)
    if not rows:
        raise SystemExit(f"no kernel test record in {path}")
    # Every kernel call of that session in order, a later verdict replacing
    # an earlier one (session 16 ran the whole suite, then the stacked rows'
    # test again, mended).
    verdicts, skipped = {}, False
    for r in rows:
        verdicts.update(record_verdicts(r))
        skipped = skipped or bool(r.get("skipped"))
    r = rows[-1]
    # Verdicts given to binaries whose kernel code differs from this tree's
    # (by the hashes their records carry): they stand as before, but the
    # record names them, so a closing note can say which tests have not run
    # on the code that ships (session 49 found decode attention's standing
    # from session 24, its kernel changed in session 46).
    now = kernel_sources()
    stale = sorted(t for t, src in verdict_sources(rows).items() if src is not None and src != now)
    if stale:
        log(f"{len(stale)} reused verdicts were given to binaries whose kernel files (any of them) differ from "
            "this tree's:", ", ".join(stale))
    # (A test this call runs next, H200_KERNEL_TESTS set for both steps,
    # may be missing: its verdict comes with the run. The names filter as
    # the test binary filters them: a test runs where one is part of its name.)
    coming = set(os.environ.get("H200_KERNEL_TESTS", "").split(",")) - {""}

    def runs_next(test):
        return any(c in test for c in coming)

    # Kernel files changed since the newest record that hashed them: their
    # tests' old verdicts say nothing of the code now, so the call must name
    # the tests to run again (H200_KERNEL_TESTS) or stop here. Which tests
    # cover which file is the caller's to choose (the log names the files);
    # the hashes are of the tree the call carries, which is what prepare.sh
    # built the binaries from only if it ran after the last edit; and only
    # the newest hashed record is compared, though older verdicts merge in.
    hashed = [x for x in rows if x.get("sources")]
    if hashed:
        changed = sorted(f for f, h in kernel_sources().items() if hashed[-1]["sources"].get(f) != h)
        if changed and not coming:
            raise SystemExit(f"kernel code changed since {path}'s verdicts ({', '.join(changed)}): "
                             "name the tests to run again in H200_KERNEL_TESTS")
        if changed:
            log("kernel files changed since the reused verdicts:", ", ".join(changed), "- H200_KERNEL_TESTS runs",
                ", ".join(sorted(coming)))
    else:
        log("the reused verdicts carry no source hashes (before session 20): check "
            "`git diff --stat COMMIT -- src/kernels src/mlx/kernel.rs cpp` by hand")
    missing = [t for t in DEFAULT_KERNEL_TESTS if t not in verdicts and not runs_next(t)]
    if missing:
        # (A default test added since that record: reusing it would turn
        # the kernels off for the whole session without a word.)
        raise SystemExit(f"{path}'s kernel record lacks {', '.join(missing)}: run "
                         f"`H200_KERNEL_TESTS={','.join(missing)} ... kernels` instead of verdicts-from")
    WORK.mkdir(parents=True, exist_ok=True)
    (WORK / "kernel-verdicts.json").write_text(json.dumps({k: v and not skipped for k, v in verdicts.items()}))
    if skipped or not all(verdicts.get(t, False) for t in DEFAULT_KERNEL_TESTS if not runs_next(t)):
        (WORK / "kernels-off").write_text("1")
    commit = r.get("commit") or r.get("binaries_commit")
    record(engine="tests-reused", source=str(path), commit=commit, verdicts=verdicts, skipped=skipped, stale=stale)
    log("kernel verdicts reused from", path, commit)


# (The stacked rows' test checks the defaults over a 16-row batch step.)
# Tests that must be the first in their process to build kernels (parts
# of names: the MLX_LFM_QINT tests, one a layer).
ALONE_TESTS = ("q_by_its_bits_", "q_by_conversion_")
QINT_LAYERS = ("conv_layer", "ffn_layer", "qkv_layer", "gemv")
DEFAULT_KERNEL_TESTS = ["add_rms_norm_kernel_matches_stock_ops", "decode_attention_kernel_matches_stock_ops",
                        "moe_router_kernel_matches_stock_ops", "short_conv_kernel_matches_stock_ops",
                        "qk_norm_rope_kernel_matches_stock_ops", "stacked_rows_with_kernels_equal_each_row_alone",
                        "qkv_norm_rope_kernel_matches_stock_ops", "argmax_finite_kernel_matches_stock_ops",
                        "decode_attention_upto_kernel_matches_the_mask",
                        "moe_router_norm_kernel_matches_the_norm_and_router_kernels",
                        # (The one-launch layers, defaults since session 31.)
                        "conv_fused_kernel_matches_stock_ops", "ffn_fused_kernel_matches_stock_ops",
                        "qkv_fused_kernel_matches_stock_ops", "moe_fused_kernel_matches_the_three_kernels",
                        # (The quantized GEMV in MLX's arithmetic and the
                        # kernels' texts in files, defaults since session 39.)
                        "quant_gemv_kernel_matches_stock_ops", "a_kernel_from_files_gives_the_inline_bits",
                        # (The MoE layer's experts in MLX's walk, the default
                        # since session 38.)
                        "moe_fused_forms_match_their_references",
                        # (A prefill's MoE rows sorted by expert and combined
                        # in one launch each, defaults since session 41.)
                        "moe_sort_kernel_matches_a_stable_sort", "moe_grouped_prefill_kernel_matches_stock_ops",
                        # (The MoE layer's two gate/up outputs and two down
                        # columns a warp, defaults since session 53.)
                        "moe_fused_gate_rows_match_the_exact_form"]
# (Not among them: `fused_gate_equals_the_ops`, the fused gate's claim of the
# ops' bits, a default since session 25 and MLX's own compile, which the
# compiled decode step has always run. A failure there is a rounding of
# MLX's JIT against its prebuilt kernels, and turning every kernel off for
# the session over it would time the wrong thing; the greedy test's default
# run, against the three ops, says whether tokens depart.)


# The three stages waiting for their first block's norm (the every-norm
# forms, CUDA defaults since session 50, off): `every-norm-off`, and the
# early-prefetch variants, forms of the waiting kernels.
EVERY_NORM_OFF = {"MLX_LFM_QKV_EVERY_NORM": "0", "MLX_LFM_CONV_EVERY_NORM": "0", "MLX_LFM_FFN_EVERY_NORM": "0"}

AB = {
    # What each change of the decode step buys, same machine, same minute:
    # variant -> (environment, the models it changes).
    "stock": ({"MLX_LFM_FUSE_PROJECTIONS": "0", "MLX_LFM_KERNELS": "0"}, None),
    "all": ({}, None),
    # The fused add + RMSNorm over every row count (the default since
    # 2026-12-02 stops at 16 rows: MLX's ops in a prefill). Opt-in until
    # this A/B: MoE experts with many prefill rows as dequantize + matmul
    # (against the per-expert qmm path, the grouped GEMM off); the bf16 GEMV
    # (+ SwiGLU), alone and with the norm folded into it; the quantized
    # GEMV, alone and with the norm fold.
    # (Measured on the 1.2B in session 9 with the kernel's first version,
    # 27 µs a launch over 512 rows; its loads are batched since: asked
    # again of every model's prefill.)
    "norm-kernel-all-rows": ({"MLX_LFM_ADD_RMS_NORM_MAX_ROWS": "all"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # A prompt's short conv in one kernel (session 25: the gates, the
    # window and MLX's grouped conv, 29 µs a layer in the 1.2B's 512-token
    # profile, as one launch). A CUDA default since session 27: measured off.
    "conv-prefill-off": ({"MLX_LFM_CONV_PREFILL_KERNEL": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The add + RMSNorm kernel (and since session 27 the router + norm
    # kernel) with eps compiled in rather than read from its [1] array in
    # MLX's managed scalar pool (session 26's kernel-bench: ~1.6 µs a
    # launch). A CUDA default since session 27: measured off.
    "eps-const-off": ({"MLX_LFM_EPS_CONST": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # A lone sequence's decode position as a view into a table the GPU
    # wrote (device memory) rather than a host scalar made each token in
    # MLX's managed pool, which 24 launches a step read (each attention
    # layer's q/k/v kernel, two K/V scatters and attention; session 26's
    # kernel-bench: ~1.6 µs a launch). The default on every backend since
    # session 28, before any GPU measured it: measured off.
    "position-table-off": ({"MLX_LFM_POSITION_TABLE": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The norm folds (the 350M's projections with the add + RMSNorm before
    # them, 32 launches a step) with eps compiled in, as the add + RMSNorm
    # and router + norm kernels have it since session 27; opt-in until this
    # A/B (written in session 28).
    "fold-eps-const": ({"MLX_LFM_FOLD_EPS_CONST": "1"}, ["lfm2-350m-bf16"]),
    # The deferred folds (written in session 28): the norm + projection in
    # one launch with no prologue (each warp walks h, r and the norm's
    # weight beside its rows and scales its sums at the end), over every
    # dense norm + projection (the 1.2B's 32 a step at K = 2048, where
    # session 20's prologue folds lost; the 350M's at 1,024).
    "fold-deferred": ({"MLX_LFM_NORM_GEMV_KERNEL": "1", "MLX_LFM_NORM_GEMV_DEFERRED": "1"},
                      ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    # The quantized embedding's rows in one kernel (session 25: three
    # gathers, three reshapes and MLX's dequantize, seven of the 8B-A1B's
    # 203 nodes a step, as one); opt-in until this A/B.
    "quant-embed": ({"MLX_LFM_QUANT_EMBED_KERNEL": "1"}, ["lfm2-8b-a1b-q4"]),
    # A prompt's q/k/v norm + RoPE in one kernel, heads-first (session 25:
    # the split, reshapes, transposes and MLX's two norms and two ropes of
    # an attention layer's pass; the ropes were 16 µs a launch in the
    # 1.2B's 512-token profile); opt-in until this A/B.
    # (A CUDA default since session 26: measured off.)
    "qkv-prefill-off": ({"MLX_LFM_QKV_PREFILL_KERNEL": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The feed-forward's gate as one MLX compiled kernel in a prompt's pass
    # (a default on every backend since session 25: the same bits on the
    # CPU, what mlx-lm runs), measured off.
    "fused-swiglu-off": ({"MLX_LFM_FUSED_SWIGLU": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "gemv-kernel": ({"MLX_LFM_GEMV_KERNEL": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    "gemv-norm-kernels": ({"MLX_LFM_GEMV_KERNEL": "1", "MLX_LFM_NORM_GEMV_KERNEL": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    # The q/k norm + RoPE kernel (a default on CUDA since session 17) and
    # its form over the stacked q/k/v product whole (session 18: the
    # split, the reshapes, two norms and two ropes of an attention layer's
    # step as one node, 24 nodes a step fewer than the q/k kernel's path;
    # paired decode 1.03x / 1.04x / 1.05x), both measured off; and the
    # q/k/v form alone off (the q/k kernel then serves).
    "qk-norm-rope-off": ({"MLX_LFM_QK_NORM_ROPE_KERNEL": "0", "MLX_LFM_QKV_NORM_ROPE_KERNEL": "0"},
                         ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "qkv-norm-rope-off": ({"MLX_LFM_QKV_NORM_ROPE_KERNEL": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The greedy draw and its finiteness flag in one kernel (five kernels
    # and two views of a step as one; a default on CUDA since session 18,
    # paired decode 0.99x / 1.01x / 1.06x), measured off.
    "argmax-off": ({"MLX_LFM_ARGMAX_KERNEL": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The same kernel's scan over 16-byte chunks (session 39,
    # argmax_finite.rs VEC_SOURCE): session 39's profile of the 1.2B's step
    # had the draw at 12.6 µs a token, 64 two-byte loads a thread one after
    # another. In process; its test holds it to MLX's argmax.
    "argmax-vec": ({"MLX_LFM_ARGMAX_VEC": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The first layer's conv as four launches (MLX_LFM_CONV_FIRST_FUSED=0):
    # the one-launch kernel over a residual of zeros (session 39,
    # conv_fused.rs first_layer) is a CUDA default since session 40, whose
    # A/B read it 1.015x on the 8B-A1B (reps 1.008-1.017) and 1.026x on the
    # 350M. In process.
    "conv-first-off": ({"MLX_LFM_CONV_FIRST_FUSED": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The compiled step's attention bounded by the position (no mask built:
    # three nodes a step), a default on CUDA since session 19.
    "attention-upto-off": ({"MLX_LFM_ATTENTION_UPTO": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "moe-dequant-from-16-rows": ({"MLX_LFM_MOE_DEQUANT_ROWS": "16", "MLX_LFM_MOE_GEMM_KERNEL": "0"}, ["lfm2-8b-a1b-q4"]),
    # A prefill's MoE rows sorted by expert in one launch (session 40,
    # moe_sort.rs) in place of two argsorts, a floor division, a take and
    # the offsets' four kernels, and the rows back in token order, weighted
    # and summed, in one launch (its combine: a take, a multiply and a sum
    # less): CUDA defaults since session 41, whose A/B read the 8B-A1B's
    # P=512 prefill 1.094-1.098x with both, 1.038-1.058x with the sort
    # alone. Measured off here (the combine needs the sort). In process.
    "moe-sort-off": ({"MLX_LFM_MOE_SORT_KERNEL": "0"}, ["lfm2-8b-a1b-q4"]),
    "moe-combine-off": ({"MLX_LFM_MOE_COMBINE_KERNEL": "0"}, ["lfm2-8b-a1b-q4"]),
    "moe-dequant-from-64-rows": ({"MLX_LFM_MOE_DEQUANT_ROWS": "64", "MLX_LFM_MOE_GEMM_KERNEL": "0"}, ["lfm2-8b-a1b-q4"]),
    # (`qgemv-float` and `quant-norm-kernels`, the quantized GEMV summing
    # in float32 alone and with the layers' norms folded in: retired in
    # session 56 with that form, src/kernels/quant_gemv.rs MLX_SUFFIX.)
    # The router's quantized gate, its sigmoid and the top-k in one launch
    # (three a MoE layer before): a default on CUDA since session 14 (its
    # pick), measured off.
    "router-gate-off": ({"MLX_LFM_ROUTER_GATE_KERNEL": "0"}, ["lfm2-8b-a1b-q4"]),
    # Defaults since 2026-12-03, measured only: the MoE experts' decode
    # kernels and the prefill's grouped GEMM (two launches a layer, tensor
    # cores, where MLX's qmm ran one per expert and projection) off.
    "moe-kernels-off": ({"MLX_LFM_MOE_KERNEL": "0", "MLX_LFM_MOE_GEMM_KERNEL": "0"}, ["lfm2-8b-a1b-q4"]),
    # MLX's CUDA backend records kernels into CUDA graphs, each updated,
    # launched and followed by a host callback, cut on the H200 (compute
    # capability 9.0) after 100 kernel nodes or 1000 x 2^20 input elements
    # (MLX_MAX_OPS_PER_BUFFER / MLX_MAX_MB_PER_BUFFER; get_graph_limits in
    # the pinned wheel's libmlx.so, read on 2026-12-03; the 20 nodes these
    # notes assumed before are other architectures'): a decode step of
    # 175-260 kernels is two to four graphs. Measured only (MLX's own
    # knobs: not in PICK, whose switches also reach mlx-lm in the rounds).
    # A one-batch dense product against a [1, K, N] weight view: one node
    # where MLX's matmul folds a [1, T, K] input to 2-D and back (three); a
    # default on CUDA since session 14 (its pick), measured off.
    "batch1-matmul-off": ({"MLX_LFM_BATCH1_MATMUL": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    # Off for prompts only (a decode step keeps it): session 24's rounds
    # timed the 1.2B's P=512 prefill with the stock path (the 2-D product
    # among its differences) at 1.14x / 1.02x the defaults'.
    "batch1-matmul-prompts-off": ({"MLX_LFM_BATCH1_MATMUL_PROMPTS": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    # Every opt-in cut of a step's nodes at once, measured only (the greedy
    # test saw the opt-in kernels together depart from the stock tokens at
    # step 32 in session 11): what the host saves when they add up.
    "dense-all": ({"MLX_LFM_GEMV_KERNEL": "1", "MLX_LFM_NORM_GEMV_KERNEL": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    "moe-all": ({"MLX_LFM_QGEMV_KERNEL": "1", "MLX_LFM_NORM_GEMV_KERNEL": "1"}, ["lfm2-8b-a1b-q4"]),
    # The dense GEMV kernels (with the norm fold) are defaults on CUDA for
    # inputs at most 1024 wide since session 12 (the 350M's projections):
    # off (the stock GEMVs), and on up to K = 2048 (the 1.2B's but w2: +12%
    # decode in session 14's paired A/B, one run, reps 0.90-1.28) and up
    # to K = 8192 (w2 too; and the 350M's w2, K = 4608).
    "gemv-off": ({"MLX_LFM_GEMV_KERNEL": "0", "MLX_LFM_NORM_GEMV_KERNEL": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    "gemv-max-k-2048": ({"MLX_LFM_GEMV_KERNEL_MAX_K": "2048"}, ["lfm2-1.2b-bf16"]),
    "gemv-max-k-8192": ({"MLX_LFM_GEMV_KERNEL_MAX_K": "8192"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    # The same without the dense rows' L2 prefetch (session 18: up to K =
    # 2048 the 1.2B's step became bound by the GPU, the kernels reading
    # those rows slower than MLX's GEMV; a 4 KiB row is two batches of
    # loads, each preceded by its prefetch's requests); and the 350M's
    # default kernels without it.
    "gemv-max-k-2048-no-prefetch": ({"MLX_LFM_GEMV_KERNEL_MAX_K": "2048", "MLX_LFM_GEMV_LOOP": "nopf"}, ["lfm2-1.2b-bf16"]),
    # (The walk without the prefetch is the default since session 26, from
    # kernel-bench's ncu: the old walk measured in the step, on the 1.2B's
    # SwiGLU GEMV and the 350M's GEMVs.)
    "gemv-prefetch": ({"MLX_LFM_GEMV_LOOP": "prefetch"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    # (Session 19: the prefetch was not it.) MLX's own loop, one load of a
    # row at a time, the same sums: up to K = 2048 on the 1.2B, and the
    # 350M's default kernels so.
    "gemv-max-k-2048-plain": ({"MLX_LFM_GEMV_KERNEL_MAX_K": "2048", "MLX_LFM_GEMV_LOOP": "plain"}, ["lfm2-1.2b-bf16"]),
    "gemv-plain": ({"MLX_LFM_GEMV_LOOP": "plain"}, ["lfm2-350m-bf16"]),
    # Up to K = 2048 without the norm fold (its kernels serve those weights
    # by default when the GEMVs do: each of up to 1,056 blocks first runs
    # the add + RMSNorm of the whole row, a serial prologue as long as its
    # GEMV at K = 2048): the GEMVs alone, the norm its own launch.
    "gemv-max-k-2048-no-fold": ({"MLX_LFM_GEMV_KERNEL_MAX_K": "2048", "MLX_LFM_NORM_GEMV_KERNEL": "0"}, ["lfm2-1.2b-bf16"]),
    # (Session 20: without the fold the wait for a token stayed at 10-45
    # µs, with it 200-385: the folds are what read slowly.) The folds with
    # their first column's rows prefetched into L2 before the norm, so the
    # rows' DRAM reads run during the prologue (the same bits); with the
    # guarded walk too (a prologue without local memory); and the 350M's
    # default folds (K = 1024) so.
    "gemv-max-k-2048-early": ({"MLX_LFM_GEMV_KERNEL_MAX_K": "2048", "MLX_LFM_NORM_GEMV_PREFETCH": "early"}, ["lfm2-1.2b-bf16"]),
    "gemv-max-k-2048-early-guarded": ({"MLX_LFM_GEMV_KERNEL_MAX_K": "2048", "MLX_LFM_NORM_GEMV_PREFETCH": "early",
                                       "MLX_LFM_NORM_RUNS": "guarded"}, ["lfm2-1.2b-bf16"]),
    "fold-early": ({"MLX_LFM_NORM_GEMV_PREFETCH": "early"}, ["lfm2-350m-bf16"]),
    # Two or four output columns a warp (MLX_LFM_GEMV_COLS), the same bits:
    # x or the fold's normed rows read once a step for all of them, fewer
    # instructions a weight byte, the folds' prologue in a half or a quarter
    # of the blocks (session 21's ncu: the 1.2B's 6,144-column fold at 45
    # cycles a warp's issue, ~730 instructions a warp, 22% of DRAM's peak);
    # up to K = 2048 on the 1.2B (with the early prefetch and the guarded
    # walk, session 21's best there, too) and the 350M's default kernels.
    "gemv-max-k-2048-c2": ({"MLX_LFM_GEMV_KERNEL_MAX_K": "2048", "MLX_LFM_GEMV_COLS": "2"}, ["lfm2-1.2b-bf16"]),
    "gemv-max-k-2048-c4": ({"MLX_LFM_GEMV_KERNEL_MAX_K": "2048", "MLX_LFM_GEMV_COLS": "4"}, ["lfm2-1.2b-bf16"]),
    "gemv-max-k-2048-c2-early-guarded": ({"MLX_LFM_GEMV_KERNEL_MAX_K": "2048", "MLX_LFM_GEMV_COLS": "2",
                                          "MLX_LFM_NORM_GEMV_PREFETCH": "early", "MLX_LFM_NORM_RUNS": "guarded"},
                                         ["lfm2-1.2b-bf16"]),
    "gemv-max-k-2048-c4-early-guarded": ({"MLX_LFM_GEMV_KERNEL_MAX_K": "2048", "MLX_LFM_GEMV_COLS": "4",
                                          "MLX_LFM_NORM_GEMV_PREFETCH": "early", "MLX_LFM_NORM_RUNS": "guarded"},
                                         ["lfm2-1.2b-bf16"]),
    # (Session 22: every K = 2048 GEMV of ours above took more GPU time a
    # step than MLX's, 1.25-1.64 ms against 1.09.) The SwiGLU GEMV at
    # K = 2048 alone (the stacked w1/w3's GEMV, its Split, a copy and the
    # compiled gate as one launch, the same bits) won session 23's A/B
    # (1.027x) and is the default since: measured off here.
    "swiglu-gemv-1024": ({"MLX_LFM_SWIGLU_GEMV_MAX_K": "1024"}, ["lfm2-1.2b-bf16"]),
    # The decode attention keeping a row's scores in shared memory and a
    # lane group's V rows loaded several at a time (the same bits): ncu put
    # it at 15.7 µs a launch in session 22, six a token on every model.
    # Session 23 ran it with a kernel per power of two of the cache (a
    # first decode at each length of ~100 tok/s); now one capacity.
    "attention-smem": ({"MLX_LFM_DECODE_ATTENTION_SMEM": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The decode attention's heads split over 4 (or 8) blocks by output
    # elements, each scoring every position and summing p * v over its
    # slice of V: 128 (256) blocks a launch where the default runs 32 on
    # 132 SMs (ncu's 15.7 µs a launch at 73 GB/s, six a token). Its sums
    # run in another order (the stock ops' tolerance, the greedy tokens).
    "attention-split": ({"MLX_LFM_DECODE_ATTENTION_SPLIT": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "attention-split-8": ({"MLX_LFM_DECODE_ATTENTION_SPLIT": "8"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The positions over N blocks a KV head, its query heads together, and
    # a join launch (session 25): 64 (32) blocks a launch scoring ~70 (~140)
    # positions each, where the default's 32 walk all ~550 and the split's
    # 128 each still scored them all. A node more an attention layer (6 a
    # step): for the 1.2B, whose GPU bounds its step.
    "attention-chunks-8": ({"MLX_LFM_DECODE_ATTENTION_CHUNKS": "8"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "attention-chunks-4": ({"MLX_LFM_DECODE_ATTENTION_CHUNKS": "4"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # (Session 46: a row over 8 lanes, 8 rows' K and V loads a lane in
    # flight; src/kernels/decode_attention.rs WIDE_SOURCE.)
    "attention-wide": ({"MLX_LFM_DECODE_ATTENTION_WIDE": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The conv layer's in_proj GEMV folded in front of its step (a warp a
    # channel walks its B, C and x rows in MLX's GEMV order, the same bits):
    # a launch fewer a conv layer and token, the [1, 3D] product never
    # written; the SwiGLU's two-row fold won 1.027x in session 23.
    "conv-gemv": ({"MLX_LFM_CONV_GEMV_KERNEL": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    "gemv-c2": ({"MLX_LFM_GEMV_COLS": "2"}, ["lfm2-350m-bf16"]),
    "gemv-c4": ({"MLX_LFM_GEMV_COLS": "4"}, ["lfm2-350m-bf16"]),
    # The add + RMSNorm code's runs unrolled with a guard per element (by
    # ptxas its default walk keeps them in local memory: a 64-byte stack
    # frame in that kernel and the norm folds); the same sums, opt-in until
    # this A/B.
    "norm-runs-guarded": ({"MLX_LFM_NORM_RUNS": "guarded"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The MoE layer's residual add and norm folded into its router's launch
    # (one launch fewer a MoE layer: 22 on the 8B-A1B), a warp an expert:
    # the default since session 23's A/B (1.041x), measured off here, and
    # with its block of 8 warps (session 22: 0.99x, and 1,587-1,674 µs of
    # GPU time a step against 1,468-1,524, the 32 experts four in turn).
    # The experts' down kernel with 2 or 4 output columns a warp (the same
    # bits): a lane's h chunk widened once for C rows, C rows' loads in
    # flight; ncu put the one-column kernel at 23 µs a launch (0.36 TB/s),
    # 22 a token. The 8B-A1B's step is bound by its host; its GPU time
    # (H200_AB_GPU_TIME) is where this shows first.
    "moe-down-early": ({"MLX_LFM_MOE_DOWN_LOADS": "early"}, ["lfm2-8b-a1b-q4"]),
    # The router's expert weights as float32, 16 bytes a row: out of MLX's
    # managed scalar pool, where the down kernel's every warp waited on them
    # (session 27's ncu source view); alone and with the early loads.
    # (Since session 31 the one-launch MoE layer serves a lone sequence's
    # MoE layers: these three change only a batch's step, which this A/B
    # does not time; they read ~1.0 here.)
    "router-scores-f32": ({"MLX_LFM_ROUTER_SCORES_F32": "1"}, ["lfm2-8b-a1b-q4"]),
    "router-scores-f32-early": ({"MLX_LFM_ROUTER_SCORES_F32": "1", "MLX_LFM_MOE_DOWN_LOADS": "early"}, ["lfm2-8b-a1b-q4"]),
    # The one-launch layers, CUDA defaults since session 31 (its paired A/B,
    # on an H100, all four at once: decode 1.12x / 1.00x / 1.15x on the
    # 350M / 1.2B / 8B-A1B; the MoE layer with the conv layers' alone
    # 1.18x on the 8B-A1B): the MoE layer (the router + norm, the experts'
    # gate/up and down: 3 launches a MoE layer, 22 layers;
    # src/kernels/moe_fused.rs), the short-conv layer (the add + RMSNorm,
    # in_proj, the conv step, out_proj: 4 launches a layer;
    # src/kernels/conv_fused.rs), the feed-forward (the add + RMSNorm, the
    # SwiGLU GEMV, w2; src/kernels/ffn_fused.rs) and an attention layer's
    # q/k/v stage (the add + RMSNorm, the stacked projection, the heads'
    # norm + RoPE; src/kernels/qkv_fused.rs): measured off here, all four
    # (the path every session before 31 ran) and each alone.
    "layers-fused-off": ({"MLX_LFM_MOE_FUSED": "0", "MLX_LFM_CONV_FUSED": "0", "MLX_LFM_FFN_FUSED": "0", "MLX_LFM_QKV_FUSED": "0"},
                         ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "moe-fused-off": ({"MLX_LFM_MOE_FUSED": "0"}, ["lfm2-8b-a1b-q4"]),
    "conv-fused-off": ({"MLX_LFM_CONV_FUSED": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "ffn-fused-off": ({"MLX_LFM_FFN_FUSED": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "qkv-fused-off": ({"MLX_LFM_QKV_FUSED": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # A conv layer with its feed-forward or MoE in one launch (six stages:
    # the two kernels joined; src/kernels/conv_layer_fused.rs: the dense
    # models' ten conv layers after their first, the 8B-A1B's seventeen),
    # and an attention layer's out_proj with the feed-forward or MoE after
    # it (the six attention layers), over the one-launch layers of the
    # defaults (the 1.2B's step ~48 nodes, the 8B-A1B's ~57). Session 31
    # timed it before its MoE form could build (0.94-1.10x with the other
    # one-launch layers off).
    "conv-layer-fused": ({"MLX_LFM_CONV_LAYER_FUSED": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "router-norm-off": ({"MLX_LFM_ROUTER_NORM_KERNEL": "0"}, ["lfm2-8b-a1b-q4"]),
    "router-norm-narrow": ({"MLX_LFM_ROUTER_NORM_WIDE": "0"}, ["lfm2-8b-a1b-q4"]),
    # The quantized GEMVs in MLX's own qmv arithmetic (then
    # MLX_LFM_QGEMV_EXACT: the same bits as the stock products, where the
    # float32 kernel, retired in session 56, left
    # the greedy test's tokens in every session): a CUDA default since
    # session 39 (`qgemv-exact` then: 1.07x decode on a host-bound H100;
    # its kernel-bench read the 8B-A1B's LM head in 33.5 µs against MLX's
    # qmv's 78.6), measured off; and with the layers' norms folded in (24
    # launches fewer a token on the 8B-A1B).
    "qgemv-off": ({"MLX_LFM_QGEMV_KERNEL": "0"}, ["lfm2-8b-a1b-q4"]),
    "quant-norm-exact": ({"MLX_LFM_NORM_GEMV_KERNEL": "1"}, ["lfm2-8b-a1b-q4"]),
    # A prompt's pass handed to MLX every N layers as it is built, so the
    # GPU runs the first layers while the host builds the rest (a prefill
    # is eager: its build does not overlap the GPU otherwise). N = 2 is the
    # MoE model's default on CUDA since session 14 (+8-14% in each rep of
    # its A/B; the dense models lost): measured off there.
    "prefill-overlap-2": ({"MLX_LFM_PREFILL_OVERLAP": "2"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    "prefill-overlap-off": ({"MLX_LFM_PREFILL_OVERLAP": "0"}, ["lfm2-8b-a1b-q4"]),
    "prefill-overlap-4": ({"MLX_LFM_PREFILL_OVERLAP": "4"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # A prompt's stacked projections part by part (contiguous outputs for
    # the gates after them; MLX's strided elementwise kernels were 683 µs
    # of a 4.4 ms prefill in session 9's profile), alone and with the
    # overlap.
    "prefill-split": ({"MLX_LFM_PREFILL_SPLIT": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "prefill-split-overlap-4": ({"MLX_LFM_PREFILL_SPLIT": "1", "MLX_LFM_PREFILL_OVERLAP": "4"},
                                ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # A fresh prompt's pass compiled (up to 512 tokens, right-padded to a
    # power-of-two bucket): replayed instead of built op by
    # op, its elementwise chains fused (session 16: the dense models' P=512
    # prefill hands MLX 416 primitives, the 8B-A1B's 1,242; on the CPU the
    # tiny fixture's 590 fall to 341). Opt-in until this A/B; correctness is
    # compiled_prefill_equals_the_eager_prefill (kernels() runs it here).
    # (The 8B-A1B's pass compiled loses its prefill overlap, a default there.)
    "compiled-prefill": ({"MLX_LFM_COMPILED_PREFILL": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # A decode step's residual stream as [B, D] rows: no Flatten/Unflatten
    # around each dense projection, the same GPU kernels; rows for the
    # MoE's experts without reshapes. A default on CUDA since session 14
    # (round 3 ran it), measured off.
    "decode-rows-off": ({"MLX_LFM_DECODE_ROWS": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The K/V write as MLX's slice update instead of the scatter (measured
    # only: the scatter won on GPU time on 2026-12-02, this asks what each
    # costs the host).
    "kv-write-slice": ({"MLX_LFM_KV_WRITE": "slice"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # Measured only: each step waited for right after its dispatch (host
    # and GPU serialised): its host_us are the host's own cost with an idle
    # GPU and its fourth field the GPU's tail, against the pipelined
    # defaults' (MLX's eval can wait on the GPU inside a dispatch).
    "sync-steps": ({"MLX_LFM_SYNC_STEPS": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # (A committed graph is also the unit MLX's in-flight limit counts, 10:
    # larger ones let the host run further ahead of the GPU.) Half and twice
    # the H200's default, and one graph a step (both budgets past a step).
    "graph-ops-50": ({"MLX_MAX_OPS_PER_BUFFER": "50"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "graph-ops-200": ({"MLX_MAX_OPS_PER_BUFFER": "200"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "graph-per-step": ({"MLX_MAX_OPS_PER_BUFFER": "1000", "MLX_MAX_MB_PER_BUFFER": "100000"},
                       ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "no-cuda-graphs": ({"MLX_USE_CUDA_GRAPHS": "0"}, ["lfm2-1.2b-bf16"]),
    # MLX keeps a cache of instantiated graphs keyed by their topology
    # (MLX_CUDA_GRAPH_CACHE_SIZE, in the pinned libmlx); a miss instantiates
    # anew (1-8 ms a graph in a third party's nsys counts on other models). One of session
    # 17's three host-stack samples of a steady 350M decode was inside
    # cudaGraphInstantiate: a larger cache asks whether misses recur.
    "graph-cache-2000": ({"MLX_CUDA_GRAPH_CACHE_SIZE": "2000"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # Measured only: the GPU's whole time for a step. Under `sync-steps`
    # the fourth host_us field is the GPU's tail after the host let go, but
    # with two to four graphs a step the GPU starts on the first while the
    # host builds the rest, so the tail is a floor (session 19: 735-826 µs).
    # With one graph a step, committed when the step is whole, the wait
    # after the dispatch is the step's GPU time itself (its graph update
    # and launch included): whether a step is bound by the GPU once the
    # host's share is gone, and so whether fewer nodes can still pay
    # (session 20: 22 and 32 nodes fewer moved nothing).
    "gpu-time-per-step": ({"MLX_MAX_OPS_PER_BUFFER": "1000", "MLX_MAX_MB_PER_BUFFER": "100000", "MLX_LFM_SYNC_STEPS": "1"},
                          ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # Measured only (a process's environment, not a repository default):
    # session 18's host profile put 28-36% of the decoding thread's samples
    # in libc, by dladdr malloc, free and the mutexes, and most of the rest
    # at offsets beside malloc that no exported symbol names (glibc's
    # _int_malloc / _int_free, by their place). A step allocates and frees
    # many small objects a node; glibc's per-thread cache keeps 7 a size by
    # default, the rest going through the arena's locked paths. A larger
    # cache asks whether that churn is what the host pays for.
    "malloc-tcache": ({"GLIBC_TUNABLES": "glibc.malloc.tcache_count=1024"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The same question asked of another allocator: mimalloc preloaded
    # (bench/h200/mimalloc.sh, built by prepare.sh into .device/bin): on
    # this development CPU it cut the compiled step's build by about a
    # quarter. A user would preload it the same way (LD_PRELOAD for node).
    "mimalloc": ({"LD_PRELOAD": str(ROOT / ".device" / "bin" / "libmimalloc.so")},
                 ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # Session 33's host profile of the 8B-A1B put 25% of the decoding
    # thread's samples in libstdc++'s _Hash_bytes: MLX 0.32.4 hashes a
    # custom kernel's whole text at every dispatch (its CustomKernel::
    # eval_gpu), 47 one-launch layers of 34-44 KB a step. With the texts
    # in files MLX includes (src/mlx/kernel_text.rs), it hashes two
    # #include lines. A switch read once a process (a kernel is built once
    # a process): a process arm (PER_PROCESS). The default since session 39
    # (`kernel-text-file` then: host dispatch 1,014 -> 556 µs a token on
    # the 8B-A1B in session 38, the same PTX byte for byte), measured off.
    "kernel-text-inline": ({"MLX_LFM_KERNEL_TEXT": "inline"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The same session's dispatch-cost: a custom kernel's dispatch and build
    # grow by ~2.9 µs an output, and the one-launch layers' scratch rows
    # are 132 outputs a step of the 8B-A1B (58 of the 350M); kept in each
    # layer's state instead (src/kernels/stages.rs), a default since
    # session 39 (`scratch-in-state` then: host build + dispatch -190 µs a
    # token on the 8B-A1B in session 38, decode 1.003x), measured off.
    "scratch-outputs": ({"MLX_LFM_SCRATCH_IN_STATE": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # q in T by its bits in the MLX-exact quantized walk (session 35,
    # src/kernels/quant_gemv.rs qint_bits): the 8B-A1B's one-launch 4-bit
    # conv, feed-forward and q/k/v layers had an I2FP and an F2FP a weight
    # (sm_90 SASS), its conv layer 0.36 TB/s where the 1.2B's dense one
    # read 1.5. A process switch (PER_PROCESS).
    "qint-bits": ({"MLX_LFM_QINT": "bits"}, ["lfm2-8b-a1b-q4"]),
    # The walk's q by the conversion units (qint_mode's `convert`), the
    # default until session 38, when its 4-bit rows in pairs (session 36;
    # the `qint-pairs` variant then, 1.10x on the 8B-A1B's decode) took its
    # place, with the MoE experts in that walk. A process switch; under it
    # the experts take the float form, as before.
    "qint-convert": ({"MLX_LFM_QINT": "convert"}, ["lfm2-8b-a1b-q4"]),
    # The one-launch MoE layer's experts in float32 (MLX_LFM_MOE_EXACT=0),
    # the default until session 38, when MLX's qmv arithmetic in pairs took
    # its place (`moe-exact-pairs` then: 1.145x against the conversion
    # walk, 37.7 µs a launch against 41.6). In process.
    "moe-float": ({"MLX_LFM_MOE_EXACT": "0"}, ["lfm2-8b-a1b-q4"]),
    # The one-launch MoE layer's down rows asked of L2 by its gate/up
    # blocks, before their own rows and after (session 38,
    # src/kernels/moe_fused.rs down_prefetch): session 35's timelines had a
    # clean launch's down stage take 12.8 of 35.4 µs for ~7.3 MB, none of it
    # asked for before the gate/up stage ended. The same bits. In process.
    # (Session 37's route in every gate/up block, `moe-local-route`, 0.97x
    # in session 38's A/B and slower in its kernel-bench, is retired.)
    "moe-down-prefetch": ({"MLX_LFM_MOE_DOWN_PREFETCH": "1"}, ["lfm2-8b-a1b-q4"]),
    # The one-launch MoE layer's gate/up warps one output each, and its
    # down warps one column each, and both (src/kernels/moe_fused.rs
    # gate_rows, down_cols): the forms before session 53, whose A/B on an
    # H100 picked two a warp for both (the 8B-A1B's decode 1.045-1.056x
    # paired; 224 gate/up blocks of 1,024 threads, one an SM, two waves on
    # an H100, against 112; 256 down blocks against 128). The same bits.
    "moe-gate-rows-1": ({"MLX_LFM_MOE_GATE_ROWS": "1"}, ["lfm2-8b-a1b-q4"]),
    "moe-down-cols-1": ({"MLX_LFM_MOE_DOWN_COLS": "1"}, ["lfm2-8b-a1b-q4"]),
    "moe-one-output": ({"MLX_LFM_MOE_GATE_ROWS": "1", "MLX_LFM_MOE_DOWN_COLS": "1"}, ["lfm2-8b-a1b-q4"]),
    # The one-launch q/k/v stage with a head over 32 warps (session 38,
    # src/kernels/qkv_fused.rs warps): one block a head (49 on the 8B-A1B)
    # left most SMs idle, 14.4 µs a launch for ~3.6 MB in session 38's
    # profile. The same bits. In process.
    "qkv-warps-32": ({"MLX_LFM_QKV_WARPS": "32"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The same stage with each head's rows over 2 or 4 blocks (session 41,
    # src/kernels/qkv_fused.rs split): session 40's profile had the 1.2B's at
    # ~15 µs for 12.7 MB a launch (~0.85 TB/s), 1 + 48 blocks. The same bits.
    # In process (a process keeps one split).
    "qkv-split-2": ({"MLX_LFM_QKV_SPLIT": "2"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "qkv-split-4": ({"MLX_LFM_QKV_SPLIT": "4"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "moe-down-prefetch-after": ({"MLX_LFM_MOE_DOWN_PREFETCH": "after"}, ["lfm2-8b-a1b-q4"]),
    # (Session 38's two down columns a warp, `moe-down-rows-2`, 0.974x in
    # session 39's A/B and 268 ms a launch in its kernel-bench, its waits
    # giving up, is retired.)
    # The one-launch conv layers', feed-forwards' and q/k/v stages' weight
    # rows asked of L2 when a block takes its part, before it waits for the
    # stage before (session 34, src/kernels/stages.rs early_prefetch):
    # session 33's ncu had the 8B-A1B's conv layer at 25 µs for ~9.4 MB
    # with all its blocks resident, its q/k/v stage at ~18 µs for ~3.5 MB.
    # All three, and the conv layers' alone (the 1.2B's feed-forward is
    # 67 MB a layer, more than L2 holds at once). (Forms of the waiting
    # kernels: since session 50 each with its stage's every-norm off.)
    "early-prefetch": ({"MLX_LFM_EARLY_PREFETCH": "all", **EVERY_NORM_OFF}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "early-prefetch-conv": ({"MLX_LFM_EARLY_PREFETCH": "conv", "MLX_LFM_CONV_EVERY_NORM": "0"},
                            ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The q/k/v stage's head rows asked of L2 before the norm's wait: its
    # 48 head blocks (the 1.2B's), one an SM, each read 256 KB through 16
    # warps, 15 µs for 12.7 MB in session 39's profile (~0.84 TB/s); asked
    # whole at once, the head's reads wait on L2.
    "early-prefetch-qkv": ({"MLX_LFM_EARLY_PREFETCH": "qkv", "MLX_LFM_QKV_EVERY_NORM": "0"},
                           ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The dense feed-forward's gate two outputs a warp (session 42,
    # src/kernels/ffn_fused.rs gate_outs): half the gate's blocks, so that
    # w2's blocks are resident from the start (session 42's chained
    # timelines: the 1.2B's w2 done 16.4 µs after the gate, at ~2.0 TB/s,
    # its last block starting at 25.0 µs); and with w2's rows asked of L2
    # before their wait. The same bits. In process (each engine its own
    # counters).
    # (Rounds off: they take its place where they serve, the default since
    # session 44.)
    "ffn-gate-2": ({"MLX_LFM_FFN_GATE_ROWS": "2", "MLX_LFM_FFN_GATE_ROUNDS": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "ffn-gate-2-early": ({"MLX_LFM_FFN_GATE_ROWS": "2", "MLX_LFM_FFN_GATE_ROUNDS": "0", "MLX_LFM_EARLY_PREFETCH": "ffn",
                          "MLX_LFM_FFN_EVERY_NORM": "0"},
                         ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The gate outputs in rounds (session 43, ffn_fused.rs rounds):
    # w2's blocks walk their rows' first half while the gate makes the
    # gated row's second. The same bits. Dense rows only. A CUDA default
    # since session 44 (decode 1.052-1.056x on the 1.2B, 1.038-1.050x on
    # the 350M in its A/B on an H100): this variant is now the default's
    # own settings, and `ffn-rounds-off` times the form before it.
    "ffn-gate-rounds": ({"MLX_LFM_FFN_GATE_ROWS": "2", "MLX_LFM_FFN_GATE_ROUNDS": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    "ffn-rounds-off": ({"MLX_LFM_FFN_GATE_ROUNDS": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    # The attention layers' new K and V written into a lone sequence's
    # buffers (flat, or a paged one's decode mirrors) by the q/k/v stage
    # itself (session 44, qkv_fused.rs kv_in_place): two MLX scatters an
    # attention layer fewer (~4.6 µs each). A CUDA default since session 46
    # (decode 1.065-1.070x on the 1.2B in its A/B on an H100; the 350M's
    # and 8B-A1B's not yet timed): this variant is now the default's own
    # settings, and `kv-in-place-off` times the scatters.
    "kv-in-place": ({"MLX_LFM_KV_IN_PLACE": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "kv-in-place-off": ({"MLX_LFM_KV_IN_PLACE": "0"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # Every head's block of the q/k/v stage computing the norm itself, no
    # wait for the first block's (session 46, qkv_fused.rs every_norm;
    # kernel-bench's `qkv-bf16-every-norm`, `qkv-q4-every-norm`). With the
    # conv's and feed-forward's forms (below) a CUDA default since session
    # 50 (`every-norm-all` read decode 1.035x on the 1.2B, 1.066x on the
    # 350M, 1.022x on the 8B-A1B in its A/B on an H100): these variants are
    # now the default's own settings, and `every-norm-off` times the
    # waiting forms.
    "qkv-every-norm": ({"MLX_LFM_QKV_EVERY_NORM": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # The same for the conv layer's in_proj blocks and the feed-forward's
    # gate blocks (session 48, stages.rs CONV_/FFN_EVERY_NORM_SUBSTITUTION),
    # each alone and both (`stages-`): the q/k/v stage's read 1.014-1.021x
    # on the 1.2B in session 48 over its 6 attention layers; these reach
    # its 10 conv layers and 16 feed-forwards.
    "conv-every-norm": ({"MLX_LFM_CONV_EVERY_NORM": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "ffn-every-norm": ({"MLX_LFM_FFN_EVERY_NORM": "1"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "stages-every-norm": ({"MLX_LFM_CONV_EVERY_NORM": "1", "MLX_LFM_FFN_EVERY_NORM": "1"},
                          ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # (Session 49, 1.2B: the q/k/v form and the stages' pair each read
    # 1.01-1.025x alone, short of 3%: the three together.)
    "every-norm-all": ({"MLX_LFM_QKV_EVERY_NORM": "1", "MLX_LFM_CONV_EVERY_NORM": "1", "MLX_LFM_FFN_EVERY_NORM": "1"},
                       ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    "every-norm-off": (EVERY_NORM_OFF, ["lfm2-350m-bf16", "lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]),
    # (Four rounds: 257 blocks on the 1.2B, each gate warp four outputs;
    # the part w2 walks alone after the gate a quarter of its rows.)
    "ffn-gate-rounds-4": ({"MLX_LFM_FFN_GATE_ROUNDS": "4"}, ["lfm2-350m-bf16", "lfm2-1.2b-bf16"]),
    # (Session 44's conv layer in rounds, `MLX_LFM_CONV_ROUNDS`: each
    # channel warp a channel a round, out_proj walking each round's part
    # after it. Its test and greedy sets passed on an H100, but halving the
    # channels' blocks slowed in_proj more than the overlap gained: the
    # 1.2B's chained launch 22.5 µs against 18.5 (its channels 18.8 against
    # 13.0), decode 0.97x in two rounds and 0.88-0.90x in four. Retired,
    # with its variants.)
    # (Session 43's `MLX_LFM_STAGE_PREFETCH`, each stage's block asking L2
    # for all its rows at once as its wait ends, read slower in every
    # chained timeline on an H100: the 1.2B's feed-forward 46.2 µs with
    # w2's rows so, 52.4 with every stage's, against 41.8; its conv layer
    # 18.8 / 22.1 against 18.1: issuing a w2 block's 8,192 prefetches took
    # 4.4 µs, its walk after them 2.5 µs less. Retired, with its variants.)
    # (Session 40's second projections asked of L2 by the first stage's
    # blocks, `ffn-w2-prefetch` and `conv-out-prefetch` with their `-last`
    # forms, read 5-8 µs slower on the 1.2B's feed-forward and no faster on
    # its conv layer in session 41's kernel-bench, and are retired.)
}
# Our switches that only a process of its own can time (each is read when
# the process builds its kernels, which an in-process A/B's engines share).
PER_PROCESS = {"MLX_LFM_KERNEL_TEXT", "MLX_LFM_QINT"}
AB_IN_ROUNDS = ["lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]
GREEDY = "greedy_tokens_with_kernels_equal_stock_ops"
# The tests an opt-in variant needs passed before `pick` adopts it.
AB_TESTS = {
    "kernel-text-inline": [],
    "qint-bits": [f"q_by_its_bits_{l}_matches_stock_ops" for l in QINT_LAYERS],
    # (Under it the MoE experts take the float form.)
    "qint-convert": [f"q_by_conversion_{l}_matches_stock_ops" for l in QINT_LAYERS]
    + ["moe_fused_kernel_matches_the_three_kernels", "greedy:moe-float"],
    "moe-float": ["moe_fused_kernel_matches_the_three_kernels", "greedy:moe-float"],
    # (Its test holds it to the bits of the form it varies.)
    **{v: ["moe_fused_forms_match_their_references"] for v in ("moe-down-prefetch", "moe-down-prefetch-after")},
    # (The test of the two-outputs default holds the one-output forms'
    # bits too.)
    **{v: ["moe_fused_gate_rows_match_the_exact_form", "greedy:moe-one-output"]
       for v in ("moe-gate-rows-1", "moe-down-cols-1", "moe-one-output")},
    # (Its test holds it to the default's bits.)
    "qkv-warps-32": ["qkv_fused_kernel_matches_stock_ops"],
    **{v: ["qkv_fused_kernel_matches_stock_ops"] for v in ("qkv-split-2", "qkv-split-4")},
    # (Its test holds both forms to the default's bits.)
    "ffn-gate-2": ["ffn_fused_kernel_matches_stock_ops"],
    "ffn-gate-2-early": ["ffn_fused_kernel_matches_stock_ops", "greedy:early-prefetch"],
    "ffn-gate-rounds": ["ffn_fused_kernel_matches_stock_ops", "greedy:ffn-gate-rounds"],
    "ffn-gate-rounds-4": ["ffn_fused_kernel_matches_stock_ops", "greedy:ffn-gate-rounds-4"],
    "ffn-rounds-off": ["ffn_fused_kernel_matches_stock_ops", "greedy:ffn-rounds-off"],
    "kv-in-place": ["qkv_fused_kernel_writes_kv_in_place", "compiled_step_writes_kv_in_place_on_tiny_models", "greedy:kv-in-place"],
    "kv-in-place-off": ["greedy:kv-in-place-off"],
    # (The every-norm forms are the default's since session 50: the
    # default run's greedy set runs them, and must build each.)
    "qkv-every-norm": ["qkv_fused_kernel_matches_stock_ops", "qkv_fused_kernel_writes_kv_in_place", "greedy:default"],
    "conv-every-norm": ["conv_fused_kernel_matches_stock_ops", "greedy:default"],
    "ffn-every-norm": ["ffn_fused_kernel_matches_stock_ops", "greedy:default"],
    "stages-every-norm": ["conv_fused_kernel_matches_stock_ops", "ffn_fused_kernel_matches_stock_ops", "greedy:default"],
    "every-norm-all": ["conv_fused_kernel_matches_stock_ops", "ffn_fused_kernel_matches_stock_ops",
                       "qkv_fused_kernel_matches_stock_ops", "qkv_fused_kernel_writes_kv_in_place", "greedy:default"],
    "every-norm-off": ["greedy:every-norm-off"],
    "argmax-vec": ["argmax_finite_kernel_matches_stock_ops"],
    "conv-first-off": ["greedy:conv-first-off"],
    "scratch-outputs": [],
    **{v: ["conv_fused_kernel_matches_stock_ops", "ffn_fused_kernel_matches_stock_ops", "qkv_fused_kernel_matches_stock_ops",
           "greedy:early-prefetch"] for v in ("early-prefetch", "early-prefetch-conv", "early-prefetch-qkv")},
    # (Its test holds it to the default form's bits.)
    **{v: [] for v in ("moe-sort-off", "moe-combine-off")},
    "gemv-kernel": ["gemv_kernel_matches_stock_ops", "gemv_swiglu_kernel_matches_stock_ops", "greedy:default"],
    "gemv-norm-kernels": ["gemv_kernel_matches_stock_ops", "gemv_swiglu_kernel_matches_stock_ops",
                          "norm_gemv_kernels_match_stock_ops", "greedy:default"],
    "norm-kernel-all-rows": ["add_rms_norm_kernel_matches_stock_ops"],
    # The GEMV kernels' own tests cover K = 2048 and 8192; the greedy
    # test's fixtures are narrower, so its default run stands for the rest.
    "gemv-max-k-2048": ["gemv_kernel_matches_stock_ops", "gemv_swiglu_kernel_matches_stock_ops",
                        "norm_gemv_kernels_match_stock_ops", "greedy:default"],
    "gemv-max-k-8192": ["gemv_kernel_matches_stock_ops", "gemv_swiglu_kernel_matches_stock_ops",
                        "norm_gemv_kernels_match_stock_ops", "greedy:default"],
    "gemv-max-k-2048-no-prefetch": ["gemv_kernel_matches_stock_ops", "gemv_swiglu_kernel_matches_stock_ops",
                                    "norm_gemv_kernels_match_stock_ops", "greedy:default"],
    "gemv-max-k-2048-plain": ["gemv_kernel_matches_stock_ops", "gemv_swiglu_kernel_matches_stock_ops",
                              "norm_gemv_kernels_match_stock_ops", "greedy:default"],
    "gemv-max-k-2048-no-fold": ["gemv_kernel_matches_stock_ops", "gemv_swiglu_kernel_matches_stock_ops", "greedy:default"],
    "gemv-max-k-2048-early": ["gemv_kernel_matches_stock_ops", "gemv_swiglu_kernel_matches_stock_ops",
                              "norm_gemv_kernels_match_stock_ops", "greedy:default"],
    "gemv-max-k-2048-early-guarded": ["gemv_kernel_matches_stock_ops", "gemv_swiglu_kernel_matches_stock_ops",
                                      "norm_gemv_kernels_match_stock_ops", "add_rms_norm_kernel_matches_stock_ops",
                                      "greedy:default"],
    "fold-early": ["norm_gemv_kernels_match_stock_ops"],
    # (Off: the path these defaults replaced, which every earlier session's
    # tests ran. The greedy test's fixtures, 64 wide, reach neither.)
    "swiglu-gemv-1024": [],
    "attention-smem": ["decode_attention_variants_match_stock_ops"],
    "attention-split": ["decode_attention_variants_match_stock_ops", "greedy:MLX_LFM_DECODE_ATTENTION_SPLIT"],
    "attention-split-8": ["decode_attention_variants_match_stock_ops", "greedy:attention-split-8"],
    "attention-chunks-8": ["decode_attention_variants_match_stock_ops", "greedy:MLX_LFM_DECODE_ATTENTION_CHUNKS"],
    "attention-chunks-4": ["decode_attention_variants_match_stock_ops", "greedy:attention-chunks-4"],
    "attention-wide": ["decode_attention_variants_match_stock_ops", "greedy:MLX_LFM_DECODE_ATTENTION_WIDE"],
    **{v: ["gemv_kernel_matches_stock_ops", "gemv_swiglu_kernel_matches_stock_ops", "norm_gemv_kernels_match_stock_ops",
           "greedy:default"] for v in ("gemv-max-k-2048-c2", "gemv-max-k-2048-c4", "gemv-c2", "gemv-c4")},
    **{v: ["gemv_kernel_matches_stock_ops", "gemv_swiglu_kernel_matches_stock_ops", "norm_gemv_kernels_match_stock_ops",
           "add_rms_norm_kernel_matches_stock_ops", "greedy:default"]
       for v in ("gemv-max-k-2048-c2-early-guarded", "gemv-max-k-2048-c4-early-guarded")},
    "norm-runs-guarded": ["add_rms_norm_kernel_matches_stock_ops", "norm_gemv_kernels_match_stock_ops"],
    "router-norm-off": [],
    "conv-gemv": ["conv_gemv_kernel_matches_stock_ops", "greedy:MLX_LFM_CONV_GEMV_KERNEL"],
    **{v: ["moe_experts_kernels_match_stock_ops", f"greedy:{v}"] for v in ("moe-down-early",)},
    "router-scores-f32": ["moe_router_norm_kernel_matches_the_norm_and_router_kernels", "moe_experts_kernels_match_stock_ops",
                          "greedy:router-scores-f32"],
    "router-scores-f32-early": ["moe_router_norm_kernel_matches_the_norm_and_router_kernels", "moe_experts_kernels_match_stock_ops",
                                "greedy:router-scores-f32", "greedy:moe-down-early"],
    "router-norm-narrow": ["moe_router_norm_kernel_matches_the_norm_and_router_kernels"],
    # (Off: the path these defaults replaced, which every session before 31
    # ran, and a batch's rows still run.)
    **{v: [] for v in ("layers-fused-off", "moe-fused-off", "conv-fused-off", "ffn-fused-off", "qkv-fused-off")},
    "conv-layer-fused": ["conv_layer_fused_kernel_matches_the_two_kernels", "conv_moe_layer_fused_kernel_matches_the_two_kernels",
                         "out_layer_fused_kernel_matches_out_proj_and_the_kernel", "greedy:MLX_LFM_CONV_LAYER_FUSED"],
    "qgemv-off": [],
    "quant-norm-exact": ["quant_gemv_kernel_matches_stock_ops", "norm_gemv_kernels_match_stock_ops", "greedy:default",
                         "greedy:quant-norm-exact"],
    "compiled-prefill": ["compiled_prefill_equals_the_eager_prefill"],
    "conv-prefill-off": [],
    "position-table-off": [],
    "fold-eps-const": ["norm_gemv_kernels_match_stock_ops", "greedy:MLX_LFM_FOLD_EPS_CONST"],
    "fold-deferred": ["norm_gemv_kernels_match_stock_ops", "greedy:norm-gemv-deferred"],
    "qkv-prefill-off": [],
    # (The same bits: the GEMV test holds the walks to each other.)
    "gemv-prefetch": ["gemv_kernel_matches_stock_ops"],
    "quant-embed": ["quant_embed_kernel_matches_stock_ops", "greedy:MLX_LFM_QUANT_EMBED_KERNEL"],
    # (The same bits as the default kernel: its test holds it to them.)
    "eps-const-off": [],
    # (Off: the three ops every session before 25 ran.)
    "fused-swiglu-off": [],
    # (The same product either way; the stock path's.)
    "batch1-matmul-prompts-off": [],
}
# Groups of variants of which `pick` adopts at most one: (variants, the
# figure it must raise by 3% over "all" without the other falling 3%).
PICK = [
    (["gemv-kernel", "gemv-norm-kernels"], "decode"),
    (["quant-norm-exact"], "decode"),
    (["gemv-max-k-2048", "gemv-max-k-8192", "gemv-max-k-2048-no-prefetch", "gemv-max-k-2048-plain",
      "gemv-max-k-2048-no-fold", "gemv-max-k-2048-early", "gemv-max-k-2048-early-guarded",
      "gemv-max-k-2048-c2", "gemv-max-k-2048-c4", "gemv-max-k-2048-c2-early-guarded", "gemv-max-k-2048-c4-early-guarded"],
     "decode"),
    (["gemv-c2", "gemv-c4"], "decode"),
    (["swiglu-gemv-1024"], "decode"),
    (["conv-gemv"], "decode"),
    (["quant-embed"], "decode"),
    (["eps-const-off"], "decode"),
    (["position-table-off"], "decode"),
    (["moe-down-early", "router-scores-f32", "router-scores-f32-early"], "decode"),
    (["conv-layer-fused"], "decode"),
    (["early-prefetch", "early-prefetch-conv", "early-prefetch-qkv"], "decode"),
    (["qint-bits", "qint-convert", "moe-float"], "decode"),
    (["moe-down-prefetch", "moe-down-prefetch-after"], "decode"),
    (["moe-gate-rows-1", "moe-down-cols-1", "moe-one-output"], "decode"),
    (["qkv-warps-32", "qkv-split-2", "qkv-split-4"], "decode"),
    (["ffn-gate-2", "ffn-gate-2-early", "ffn-gate-rounds", "ffn-gate-rounds-4", "ffn-rounds-off"], "decode"),
    (["kv-in-place", "kv-in-place-off"], "decode"),
    # (The every-norm forms' `=1` variants are the default's own settings
    # since session 50: not picked, lest a pick of them on noise undo an
    # early-prefetch pick's `=0`; AB still times them.)
    (["every-norm-off"], "decode"),
    (["argmax-vec"], "decode"),
    (["conv-first-off"], "decode"),
    (["layers-fused-off", "moe-fused-off", "conv-fused-off", "ffn-fused-off", "qkv-fused-off"], "decode"),
    (["attention-smem", "attention-split", "attention-split-8", "attention-chunks-8", "attention-chunks-4", "attention-wide"], "decode"),
    (["norm-runs-guarded"], "decode"),
    (["fold-early"], "decode"),
    (["fold-deferred"], "decode"),
    (["fold-eps-const"], "decode"),
    (["router-norm-off", "router-norm-narrow"], "decode"),
    (["norm-kernel-all-rows"], "prefill"),
    (["conv-prefill-off"], "prefill"),
    (["qkv-prefill-off"], "prefill"),
    (["gemv-prefetch", "gemv-plain"], "decode"),
    (["batch1-matmul-prompts-off"], "prefill"),
    (["fused-swiglu-off"], "prefill"),
    (["moe-dequant-from-16-rows", "moe-dequant-from-64-rows"], "prefill"),
    (["moe-sort-off", "moe-combine-off"], "prefill"),
    (["prefill-overlap-2", "prefill-overlap-4", "prefill-split", "prefill-split-overlap-4"], "prefill"),
    (["compiled-prefill"], "prefill"),
]
# Variants that change only a decode step (one token a row): their prefill
# ratio is noise, not a cost, so `pick` does not hold them to it (session
# 17: the q/k norm + RoPE kernel's 1.09x on the 1.2B's decode was turned
# down by the 350M's prefill median, 0.96, a prefill it never runs in).
DECODE_ONLY = {"gemv-max-k-2048", "gemv-max-k-8192", "gemv-max-k-2048-no-prefetch", "gemv-max-k-2048-plain",
               "gemv-max-k-2048-no-fold", "gemv-max-k-2048-early", "gemv-max-k-2048-early-guarded", "fold-early",
               "gemv-max-k-2048-c2", "gemv-max-k-2048-c4", "gemv-max-k-2048-c2-early-guarded",
               "gemv-max-k-2048-c4-early-guarded", "gemv-c2", "gemv-c4", "swiglu-gemv-1024", "attention-smem",
               "attention-split", "attention-split-8", "attention-chunks-8", "attention-chunks-4", "attention-wide", "conv-gemv",
               "moe-down-early", "router-scores-f32", "router-scores-f32-early", "fold-eps-const", "position-table-off",
               "fold-deferred", "layers-fused-off", "moe-fused-off", "conv-fused-off", "ffn-fused-off", "qkv-fused-off",
               "conv-layer-fused", "early-prefetch", "early-prefetch-conv", "early-prefetch-qkv",
               "qint-bits", "qint-convert",
               "moe-float", "moe-down-prefetch", "moe-down-prefetch-after", "moe-gate-rows-1", "moe-down-cols-1", "moe-one-output",
               "qkv-warps-32", "argmax-vec",
               "conv-first-off", "qkv-split-2", "qkv-split-4",
               # (A lone sequence's decode kernels: session 44's pick of the
               # feed-forward in rounds fell on the 350M's prefill figure,
               # 0.908, whose paired reps spread 0.84-1.05.)
               "ffn-gate-2", "ffn-gate-2-early", "ffn-gate-rounds", "ffn-gate-rounds-4", "ffn-rounds-off",
               "kv-in-place", "kv-in-place-off", "qkv-every-norm",
               "conv-every-norm", "ffn-every-norm", "stages-every-norm", "every-norm-all", "every-norm-off"}
# Switches that change both models' steps: adopted only where every decode
# group's pick holds them (each was measured with them on).
SHARED_SWITCHES = ["MLX_LFM_NORM_GEMV_KERNEL"]
# Switches that reach other groups' models too (the 350M's and the 1.2B's
# GEMVs read the one MLX_LFM_GEMV_COLS; the attention variant of every
# model the one MLX_LFM_DECODE_ATTENTION_SMEM): two picks that set one
# apart keep the stronger, and a pick is adopted whole only where every
# variant of another group with the same value whose switches the final
# set all holds (what that model will run), measured in this call, held
# its decode (>= 0.97); else the pick is dropped with all its switches
# (the 1.2B's K = 2048 kernels without their columns are session 19's
# 0.87x).
SHARED_WHOLE = ["MLX_LFM_GEMV_COLS", "MLX_LFM_DECODE_ATTENTION_SMEM", "MLX_LFM_DECODE_ATTENTION_SPLIT",
                "MLX_LFM_DECODE_ATTENTION_CHUNKS", "MLX_LFM_QKV_WARPS"]


def ab_models():
    # H200_MODELS=lfm2-1.2b-bf16,... narrows `ab` and `profile` (a device call has 10 minutes).
    names = os.environ.get("H200_MODELS")
    return names.split(",") if names else ["lfm2-1.2b-bf16", "lfm2-8b-a1b-q4"]


def ab_prompt():
    """The prompt an A/B's decode runs after: H200_AB_PROMPT (16 to 32,768;
    512, the targets' depth, unless set). Session 45's rounds decoded the
    1.2B at 823 tok/s after 512 tokens and 678 after 4,096: variants of the
    decode attention, whose cost grows with the positions, are worth
    timing at long prompts too. `pick` reads only A/Bs at 512."""
    v = os.environ.get("H200_AB_PROMPT", "512").strip()
    if not v.isdigit() or not 16 <= int(v) <= 32768:
        raise SystemExit(f"H200_AB_PROMPT={v!r}: a whole number of tokens from 16 to 32768")
    return int(v)


def ab():
    """Each variant against the defaults, as engines of one process run in
    alternation (`mlx-lfm-bench --ab`): a rep's figure is taken beside the
    defaults' of the same rep, so the host's drift (2x within one call on
    2026-12-03, separate processes minutes apart) leaves the ratio alone.
    H200_AB_REPS=N reps (default 6); H200_AB_VARIANTS=a,b only those.
    Variants that set MLX's own knobs (read once per process) run as
    separate processes, as before. H200_OURS_ENV applies to every arm (the
    allocator the CLI preloads: session 21 left the 350M's and the
    8B-A1B's steps bound by the GPU under it, so launch cuts that moved
    nothing under glibc are worth timing again there)."""
    reps = int(os.environ.get("H200_AB_REPS", "6"))
    only = os.environ.get("H200_AB_VARIANTS")
    for name in ab_models():
        chosen = [(v, extra) for v, (extra, models) in AB.items()
                  if v not in ("all",) and (not models or name in models) and (not only or v in only.split(","))
                  and v != "stock"]
        if os.environ.get("H200_AB_GPU_TIME") == "1":
            # Each variant's GPU time a step, not its decode rate: every arm
            # (the defaults too) a process with one graph a step, waited
            # for right after its dispatch (gpu-time-per-step's knobs), so
            # the wait after the dispatch is the step's whole GPU time
            # (host_us' fourth field), whatever bounds the pipelined step.
            # (Variants of MLX's own knobs or the process, e.g. graph-ops-50 or
            # mimalloc, would undo the one-graph step or time no kernel:
            # only the MLX_LFM_* switches outside the base are timed so.)
            base = AB["gpu-time-per-step"][0]
            timed = [(v, e) for v, e in chosen
                     if all(k.startswith("MLX_LFM_") for k in e) and not set(e) & set(base)]
            ab_processes(name, timed, max(2, reps // 2), base=base, tag="@gpu-time")
            continue
        inproc = [(v, extra) for v, extra in chosen
                  if all(k.startswith("MLX_LFM_") and k not in PER_PROCESS for k in extra)]
        spec = ";".join(f"{v}:" + ",".join(f"{k}={x}" for k, x in extra.items()) for v, extra in inproc)
        # H200_AB_GEN tokens a rep (128): more averages a rep's host
        # hiccups (session 17's 350M reps of one variant ran 0.67-1.24).
        # (Only process variants chosen: no in-process run of the defaults
        # alone, which would time nothing against them.)
        r = sh([BENCH, "--model", ours_ck(name), "--device", "gpu", "--prompts", str(ab_prompt()),
                "--gen", os.environ.get("H200_AB_GEN", "128"), "--reps", str(reps), "--ab", spec], f"ab-{name}",
               check=False, env=ours_env()) if inproc else None
        for line in (r.stdout.splitlines() if r else []):
            j = json.loads(line)
            if "ab_variant" in j:
                record(engine="ab", model=name, variant=j["ab_variant"], prompt=ab_prompt(), prefill=j["prefill_tps_runs"],
                       decode=j["decode_tps_runs"], host_us=j.get("host_build_dispatch_wait_us_runs"),
                       decode_ratio=j["decode_ratio_runs"], prefill_ratio=j["prefill_ratio_runs"],
                       step_ops=j.get("step_ops"), paired=True)
        knobs = [(v, e) for v, e in chosen if (v, e) not in inproc]
        # A preload that is not there would be ignored by the loader with a
        # warning, and the variant would time glibc under its name.
        for v, e in list(knobs):
            if "LD_PRELOAD" in e and not Path(e["LD_PRELOAD"]).is_file():
                log(f"ab {name} {v}: {e['LD_PRELOAD']} is missing (bench/h200/prepare.sh builds it): skipped")
                knobs.remove((v, e))
        if knobs:
            ab_processes(name, knobs, max(2, reps // 2))


def ab_processes(name, knobs, reps, base=None, tag=""):
    """MLX's own knobs, read once per process (MLX_MAX_OPS_PER_BUFFER,
    MLX_MAX_MB_PER_BUFFER, MLX_USE_CUDA_GRAPHS): one process per sample, the defaults and each
    variant in alternation, the order rotated each rep, so a rep's samples
    are seconds apart and its ratios to the defaults' sample are paired as
    `--ab`'s are (on 2026-12-03 separate processes in two turns minutes
    apart drifted by 2x). A process's first run warms its shapes; its
    second is the sample. `base` goes under every arm (the defaults' too)
    and `tag` after each variant's name in the records."""
    arms = [("all", {})] + list(knobs)
    got = {v: {"decode": [], "prefill": [], "host_us": []} for v, _ in arms}
    for rep in range(reps):
        order = arms[rep % len(arms):] + arms[:rep % len(arms)]
        for v, extra in order:
            # (H200_OURS_ENV under every arm: with the allocator the CLI
            # ships preloaded, the step the variants change is the one users
            # run, bound by the GPU where glibc's left it bound by the host.)
            e = ours_env()
            e.update(base or {})
            e.update(extra)
            r = sh([BENCH, "--model", ours_ck(name), "--device", "gpu", "--prompts", str(ab_prompt()), "--gen", "128",
                    "--reps", "2", "--paths", "compiled"], f"ab-procs-{name}", check=False, env=e)
            rows = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{") and '"prompt"' in l]
            # The bench's first line names the allocator that served its
            # malloc (the loader's answer): a preload that did not take
            # would time glibc under the variant's name.
            head = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{") and '"allocator"' in l]
            served = head[0].get("allocator") if head else None
            if "LD_PRELOAD" in extra and served and not preload_served(extra["LD_PRELOAD"], served):
                log(f"ab-procs {name} {v}: malloc served by {served}, not {extra['LD_PRELOAD']}: no sample")
                rows = []
            if not rows or len(rows[-1].get("decode_tps_runs", [])) < 2:
                log(f"ab-procs {name} {v}: no sample (rc {r.returncode})")
                for f in ("decode", "prefill", "host_us"):
                    got[v][f].append(None)
                continue
            j = rows[-1]
            got[v]["decode"].append(j["decode_tps_runs"][-1])
            got[v]["prefill"].append(j["prefill_tps_runs"][-1])
            got[v]["host_us"].append((j.get("host_build_dispatch_wait_us_runs") or [None])[-1])
    base = got["all"]
    for v, _ in arms:
        ratio = {f: [x / b for x, b in zip(got[v][f], base[f]) if x and b] for f in ("decode", "prefill")}
        record(engine="ab", model=name, variant=v + tag, prompt=ab_prompt(), prefill=[x for x in got[v]["prefill"] if x],
               decode=[x for x in got[v]["decode"] if x], host_us=got[v]["host_us"], decode_ratio=ratio["decode"],
               prefill_ratio=ratio["prefill"], paired=True, processes=True)


def batch_phases():
    """Where the 16-concurrent step's time goes, pipelined and with each
    step waited for right after its dispatch (MLX_LFM_SYNC_STEPS=1), in
    alternation, two processes each: build / dispatch / sync / the rows'
    reads and deliveries, µs a step (session 14's dense batched steps took
    3.0-4.5 ms on the 350M against ~1.9 ms in session 12, more than its
    single-sequence step slowed)."""
    b = BATCH
    # (Then one process with the nodes of each stacked step counted,
    # MLX_LFM_COUNT_STEP_NODES=1: session 57 read the 16-row step's dispatch
    # at 4-10x the one-row step's, which `step-ops` counts at ~60 nodes.
    # H200_BATCH_NODES_ONLY=1 runs that process alone.)
    arms = [] if os.environ.get("H200_BATCH_NODES_ONLY") == "1" else [(rep, sync) for rep in range(2) for sync in ("0", "1")]
    for name in ab_models():
        for rep, sync in arms + [(0, "nodes")]:
            e = env()
            if sync == "nodes":
                e["MLX_LFM_COUNT_STEP_NODES"] = "1"
            else:
                e["MLX_LFM_SYNC_STEPS"] = sync
            r = sh([BENCH, "--model", ours_ck(name), "--device", "gpu", "--concurrent", str(b["n"]), "--prompts",
                    str(b["prompt"]), "--gen", str(b["gen"]), "--reps", "1"], f"batch-phases-{name}", check=False, env=e)
            for line in r.stdout.splitlines():
                j = json.loads(line) if line.startswith("{") else {}
                if "median_step_ms" in j:
                    extra = {"nodes": j.get("batch_step_nodes")} if sync == "nodes" else {"sync": sync == "1"}
                    record(engine="batch-phases", model=name, rep=rep, **extra,
                           median_step_ms=j["median_step_ms"], solo_step_ms=j["solo_step_ms"],
                           phases_us=j.get("batch_build_dispatch_sync_accept_us"))


def pick():
    """From this call's A/B: in each group of PICK, the variant whose figure
    beats "all" by 3% or more on the model it changes (the best one), whose
    other figure does not fall by 3%, and whose tests passed here; written to
    picked-env.json for the later steps (rounds, profile)."""
    rows = [json.loads(l) for l in RAW.read_text().splitlines() if '"engine": "ab"' in l]
    # (The targets' depth only: an A/B after a longer prompt, H200_AB_PROMPT,
    # is read, not picked from; records before it carry no prompt.)
    rows = [r for r in rows if r.get("prompt", 512) == 512]
    samples = {}
    for r in rows:
        d = samples.setdefault((r["variant"], r["model"]), {"decode": [], "prefill": []})
        d["decode"] += r["decode"]
        # A variant's first prefill meets new shapes (MLX's per-shape
        # setup): only the warm ones count.
        d["prefill"] += r["prefill"][1:] or r["prefill"]
    med = {k: {f: statistics.median(v[f]) for f in v} for k, v in samples.items()}
    # Paired records (one process, alternating): the median of the per-rep
    # ratios to the defaults, with "all" at 1.0.
    ratios = {}
    for r in rows:
        if r.get("paired"):
            d = ratios.setdefault((r["variant"], r["model"]), {"decode": [], "prefill": []})
            d["decode"] += r["decode_ratio"]
            d["prefill"] += r["prefill_ratio"]
    for k, v in ratios.items():
        med[k] = {f: statistics.median(v[f]) for f in v}
    verdicts_file = WORK / "kernel-verdicts.json"
    verdicts = json.loads(verdicts_file.read_text()) if verdicts_file.exists() else {}
    why, picks, decode_picks = [], [], []
    for variants, figure in PICK:
        other = "prefill" if figure == "decode" else "decode"
        best = None
        for v in variants:
            extra, models = AB[v]
            tests_ok = all(verdicts.get(t, False) for t in AB_TESTS.get(v, []))
            per_model = []
            for m in models or []:
                base, got = med.get(("all", m)), med.get((v, m))
                if not base or not got:
                    continue
                gain, keep = got[figure] / base[figure], got[other] / base[other]
                why.append({"variant": v, "model": m, figure: round(gain, 3), other: round(keep, 3), "tests": tests_ok})
                per_model.append((gain, keep))
            # A switch reaches every model it applies to: it must win on one
            # and lose (by 3%) on none, in neither figure (on 2026-12-03
            # the prefill overlap won 17% on one model and lost 6% on another).
            if not per_model or not tests_ok:
                continue
            top = max(g for g, _ in per_model)
            holds = all(g >= 0.97 and (k >= 0.97 or v in DECODE_ONLY) for g, k in per_model)
            if top >= 1.03 and holds and (best is None or top > best[1]):
                best = (v, top)
        if best:
            picks.append({"variant": best[0], "gain": best[1], "figure": figure, "group": variants})
        # (Only groups measured in this call: a model left out of the A/B
        # says nothing of a shared switch.)
        if figure == "decode" and any(med.get((v, m)) for v in variants for m in AB[v][1] or []):
            decode_picks.append((variants, AB[best[0]][0] if best else {}))

    def merged(ps):
        out = {}
        for p in ps:
            out.update(AB[p["variant"]][0])
        return out

    def ratio(v, m):
        got, base = med.get((v, m)), med.get(("all", m))
        return got["decode"] / base["decode"] if got and base else None

    # Switches that reach other groups' models (SHARED_WHOLE): two picks
    # that set one apart keep the stronger; then a pick whose value lost
    # elsewhere goes whole, where "elsewhere" is a variant of another
    # group that sets the same value and whose every switch the final set
    # holds (what that model will run), measured below 0.97.
    for key in SHARED_WHOLE:
        setting = sorted((p for p in picks if key in AB[p["variant"]][0]), key=lambda p: -p["gain"])
        for p in setting[1:]:
            if AB[p["variant"]][0][key] != AB[setting[0]["variant"]][0][key]:
                picks.remove(p)
                why.append({"dropped": p["variant"], "reason": f"{key} set apart by {setting[0]['variant']}"})
    def lost_elsewhere(p, final):
        """(key, where) of a shared switch of pick `p` whose value lost on
        another group's model that `final` would run it on, else None."""
        extra = AB[p["variant"]][0]
        for key in (k for k in SHARED_WHOLE if k in extra):
            hurt = [(v, m, round(ratio(v, m), 3)) for v, (e, models) in AB.items()
                    if v not in p["group"] and e.get(key) == extra[key] and all(final.get(k) == x for k, x in e.items())
                    for m in models or [] if ratio(v, m) is not None and ratio(v, m) < 0.97]
            if hurt:
                return key, hurt
        return None

    # (One pick at a time: dropping one changes what the others would run with.)
    while True:
        final = merged(picks)
        lost = next(((p, found) for p in picks if (found := lost_elsewhere(p, final))), None)
        if not lost:
            break
        p, (key, hurt) = lost
        picks.remove(p)
        why.append({"dropped": p["variant"], "reason": f"{key}={AB[p['variant']][0][key]} lost elsewhere", "where": hurt})
    picked = merged(picks)
    for key in SHARED_SWITCHES:
        # Each decode group with a variant that sets the switch must have
        # picked one that does.
        groups = [p for vs, p in decode_picks if any(key in AB[v][0] for v in vs)]
        if key in picked and not all(key in p for p in groups):
            del picked[key]
            why.append({"dropped": key, "reason": "not every model's pick was measured with it"})
    PICKED.write_text(json.dumps(picked))
    record(engine="pick", picked=picked, why=why)
    log("picked", picked, why)


def collect(files):
    rows = []
    for f in files:
        rows += [json.loads(l) for l in Path(f).read_text().splitlines() if l.strip()]
    runs, errors, profiles = [], [], []
    for r in rows:
        if "error" in r:
            errors.append(r)
        elif r.get("engine") in ("ncu", "ncu-prefill", "ab", "tests", "constrained", "new-lengths", "pick", "env", "step-ops",
                                 "prefill-ops", "batch-phases", "mlx-lfm-allocator", "kernel-bench", "kernel-detail",
                                 "kernel-stalls", "kernel-source", "ncu-detail", "ncu-stalls", "ptx-cache", "gguf-bg",
                                 "dispatch-cost", "shape-cost", "moe-timeline", "layer-chains"):
            profiles.append(r)
        elif r.get("samples"):
            runs.append({"model": r["model"], "engine": r["engine"], "metric": r["metric"], "prompt": r["prompt"],
                         "round": r["round"], "value": statistics.median(r["samples"]), "samples": r["samples"]})
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"commit": head, "date": time.strftime("%Y-%m-%d"), "device": f"{device_of(rows)} (mlx-cuda-13 0.32.4)",
            "gen": GEN, "reps_per_round": REPS, "value": "median of the round's repetitions",
            "runs": runs, "ratios": ratios(runs), "profiles": profiles, "errors": errors}


def device_of(rows):
    """The card the rounds ran on: the rounds' own records (their `env`
    record names it since session 32), else H200_DEVICE (a raw file from
    before: session 31 and 32 ran on an H100, the sessions before on an
    H200), else the H200 the benchmark was written for."""
    named = sorted({r["gpu"] for r in rows if r.get("engine") == "env" and r.get("gpu")})
    return " + ".join(named) or os.environ.get("H200_DEVICE") or "NVIDIA H200"


def merge_raw(out, commit, triples):
    """One raw file for a session from its calls' copies, each `CALL PATH
    CMD` (the call's number, its fetched raw.jsonl, the command it ran), in
    call order: a call's copy on a warm machine also holds the earlier
    calls' records (/tmp/h200/raw.jsonl is cumulative there), so the part it
    shares with the previous copy is skipped; every record is tagged `call`,
    `call_cmd` and `binaries_commit` (the commit prepare.sh built the
    carried binaries from)."""
    if len(triples) % 3:
        raise SystemExit("merge-raw OUT COMMIT then CALL PATH CMD for each call")
    prev, rows = [], []
    for i in range(0, len(triples), 3):
        call, path, cmd = int(triples[i]), triples[i + 1], triples[i + 2]
        lines = [l for l in Path(path).read_text().splitlines() if l.strip()]
        # A copy from the same warm machine starts with the previous copy's
        # records; a fresh machine's does not (and may repeat a record of
        # the same content, e.g. a node count, which is kept).
        start = len(prev) if lines[:len(prev)] == prev and prev else 0
        for line in lines[start:]:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                log(f"merge-raw: call {call}: an unreadable line skipped ({line[:60]}...)")
                continue
            r.update(call=call, call_cmd=cmd, binaries_commit=commit)
            rows.append(r)
        prev = lines
    Path(out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    log(f"merge-raw: {len(rows)} records from {len(triples) // 3} calls into {out}")


def merge_logs(out, pairs):
    """One logs archive for a session from its calls' logs.tgz, each `CALL
    PATH`: every member under `callN/`."""
    import io
    import tarfile

    if len(pairs) % 2:
        raise SystemExit("merge-logs OUT.tgz then CALL PATH for each call")
    with tarfile.open(out, "w:gz") as tar:
        for i in range(0, len(pairs), 2):
            call, path = int(pairs[i]), pairs[i + 1]
            with tarfile.open(path, "r:gz") as src:
                for m in src.getmembers():
                    f = src.extractfile(m)
                    if f is None:
                        continue
                    data = f.read()
                    m.name = f"call{call}/{m.name}"
                    tar.addfile(m, io.BytesIO(data))


def ratios(runs):
    """mlx-lfm / peer for each model, metric and prompt, per round (llama.cpp's
    decode figure is at a depth equal to the shortest prompt, so it pairs
    with ours after that prompt)."""
    out = []
    idx = {(r["engine"], r["model"], r["metric"], r["prompt"], r["round"]): r["value"] for r in runs}
    for (eng, model, metric, prompt, rnd), v in sorted(idx.items(), key=str):
        if eng not in ("mlx-lfm", "mlx-lfm-glibc"):
            continue
        for peer in ("llama.cpp", "mlx-lm"):
            peer_v = idx.get((peer, model, metric, prompt, rnd))
            if peer_v:
                row = {"model": model, "metric": metric, "prompt": prompt, "round": rnd, "peer": peer, "ratio": v / peer_v}
                if eng != "mlx-lfm":
                    row["engine"] = eng
                out.append(row)
    return out


class Stopped(BaseException):
    """SIGTERM (`timeout`'s): not a SystemExit, which the rounds catch as
    one engine's failure and go on to the next (session 31's rounds ran on
    past their TERM until the call's own limit killed them, before
    `finally` wrote raw.jsonl and logs.tgz: the round's figures were lost),
    nor an Exception, which a step may catch."""


# Set by the first SIGTERM: `timeout` sends its TERM to run.py and then to
# its whole process group, run.py again among it, and a second Stopped
# raised inside the first one's wrap-up skipped it (session 52's test call,
# killed so at 330 s, recorded no verdict of the ~40 tests it had finished).
TERM_SEEN = []


def on_sigterm(*_):
    if TERM_SEEN:
        return
    TERM_SEEN.append(time.time())
    raise Stopped("stopped by SIGTERM")


def main():
    import signal

    # `timeout` sends SIGTERM: end through `finally`, so raw.jsonl and
    # logs.tgz still reach $OUT (on 2026-12-03 a cut call left its loose
    # logs there instead, more files than a call brings back, and its
    # raw.jsonl was dropped with them).
    signal.signal(signal.SIGTERM, on_sigterm)
    args = sys.argv[1:]
    if not args:
        print(__doc__)
        return
    OUT.mkdir(parents=True, exist_ok=True)
    if args[0] == "summarize-ncu":
        json.dump(summarize_ncu(Path(args[1]).read_text()), sys.stdout, indent=1)
        print()
        return
    if args[0] == "collect":
        json.dump(collect(args[1:]), sys.stdout, indent=1)
        print()
        return
    if args[0] == "merge-raw":
        merge_raw(args[1], args[2], args[3:])
        return
    if args[0] == "merge-logs":
        merge_logs(args[1], args[2:])
        return
    i = 0
    try:
        while i < len(args):
            a = args[i]
            if a == "stage":
                stage()
            elif a == "stage-mlx":
                stage(llama=False)
            elif a == "llama":
                stage(mlx=False)
            elif a == "install":
                install()
            elif a == "round":
                i += 1
                rounds(int(args[i]))
            elif a == "kernels":
                install()
                kernels()
            elif a == "checkpoints":
                install()
                wait_gguf()
                checkpoints(round_models())
            elif a == "ab":
                install()
                checkpoints(ab_models(), gguf=False)
                ab()
            elif a == "pick":
                pick()
            elif a == "verdicts-from":
                i += 1
                verdicts_from(args[i])
            elif a == "profile":
                install()
                profile()
            elif a == "profile-kernels":
                install()
                # (Session 57's call 6 found no checkpoint on its machine:
                # it recorded a load error and ended in 2 s.)
                checkpoints(ab_models(), gguf=False)
                profile_kernels()
            elif a == "profile-gaps":
                install()
                checkpoints(ab_models(), gguf=False)
                profile_gaps()
            elif a == "profile-prefill":
                install()
                checkpoints(ab_models(), gguf=False)
                profile_prefill()
            elif a == "ab-binaries":
                install()
                checkpoints(ab_models(), gguf=False)
                ab_binaries()
            elif a == "step-ops":
                install()
                step_ops()
            elif a == "batch-phases":
                install()
                checkpoints(ab_models(), gguf=False)
                batch_phases()
            elif a == "host-profile":
                install()
                checkpoints(ab_models(), gguf=False)
                host_profile()
            elif a == "dispatch-cost":
                install()
                dispatch_cost()
            elif a == "shape-cost":
                install()
                shape_cost()
            elif a == "moe-timeline":
                install()
                moe_timeline()
            elif a == "layer-chains":
                install()
                layer_chains()
            elif a == "kernel-bench":
                install()
                kernel_bench()
            elif a == "kernel-detail":
                install()
                kernel_detail()
            elif a == "gguf-bg":
                gguf_background()
            elif a == "gguf":
                install()
                gguf()
            elif a == "save-ptx":
                save_ptx()
            elif a == "new-lengths":
                install()
                new_lengths()
            elif a == "constrained":
                install()
                checkpoints(["lfm2-350m-bf16", "lfm2-1.2b-bf16"], gguf=False)
                constrained()
            else:
                raise SystemExit(f"unknown step {a}")
            i += 1
    except Stopped as e:
        record(engine="stopped", args=args, reason=str(e))
        # What the cut tests compiled is on disk: a `save-ptx` still ahead
        # saves it (~seconds within the call's margin past its TERM), so the
        # next session's test call does not compile it again (session 49's
        # two cut test calls saved nothing).
        if "save-ptx" in args[i:]:
            try:
                if RAW.exists():
                    shutil.copy(RAW, OUT / "raw.jsonl")
                save_ptx()
            except Exception as err:
                log(f"save-ptx after the TERM failed: {err}")
        raise SystemExit(str(e))
    finally:
        if RAW.exists():
            shutil.copy(RAW, OUT / "raw.jsonl")
        for p in [WORK / "llbuild.log"]:
            if p.exists():
                shutil.copy(p, OUT / p.name)
        pack_logs()
        if args == ["gguf"]:
            GGUF_RC.write_text(GGUF_RESULT or "failed: ended before its checkpoints")


def pack_logs():
    """The device tool brings back only a few files a call (8 in one session,
    the rest dropped): every log and CSV goes into one logs.tgz beside
    raw.jsonl."""
    import tarfile

    logs = [p for p in OUT.iterdir() if p.is_file() and p.name not in ("raw.jsonl", "logs.tgz", "ptx-cache.tgz")]
    if not logs:
        return
    # A second run.py in the same call packs beside the first's logs
    # (once, this session's kernel test log was lost to an overwrite).
    earlier = OUT / "logs.tgz"
    kept = {}
    if earlier.exists():
        with tarfile.open(earlier, "r:gz") as old:
            for m in old.getmembers():
                f = old.extractfile(m)
                if f and m.name not in {p.name for p in logs}:
                    kept[m.name] = (m, f.read())
    import io

    with tarfile.open(OUT / "logs.tgz", "w:gz") as tar:
        for m, data in kept.values():
            tar.addfile(m, io.BytesIO(data))
        for p in logs:
            tar.add(p, arcname=p.name)
    for p in logs:
        p.unlink()


if __name__ == "__main__":
    main()
