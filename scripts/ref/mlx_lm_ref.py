"""mlx-lm reference runner for mlx-lfm's parity tests and benchmarks.

Reads one JSON request on stdin, writes one JSON answer on stdout.
  {"op": "greedy", "model": DIR, "cases": [{"prompt": [ids], "max_tokens": N}]}
      -> {"results": [{"tokens": [...], "logits": [...first-step logits, f32...]}]}
  {"op": "chat_prompt", "model": DIR, "messages": [...], "tools": [...]|null}
      -> {"prompt": [ids]}  (the tokenizer's chat template, add_generation_prompt=True)
  {"op": "encode", "model": DIR, "text": "..."} -> {"ids": [...]}  (mlx-lm's generate() encoding)
  {"op": "bench", "model": DIR, "prompt_len": P, "gen": G, "reps": R}
      -> {"prefill_tps": ..., "decode_tps": ..., "ttft_ms": ...}
  {"op": "bench_suite", "model": DIR, "prompts": [[ids], ...], "gen": G, "reps": R,
   "warmup": {"prompt": [ids], "gen": G2}, "prefill_step_size": 2048|null, "shape_warmup": bool}
      -> {"mlx_version", "mlx_lm_version", "default_device", "dtype", "params", "load_ms",
          "warmup": run, "results": [{"prompt_len": P, "runs": [run, ...], "cold": run|null}]}
      where run = {"ttft_ms", "prefill_tps", "decode_tps", "decode_ms", "tokens",
                   "total_ms", "peak_mem_bytes", "out_tokens"}. Each run goes through mlx-lm's own
      generate_step (greedy, EOS never checked, so exactly G tokens), on a fresh cache.
      Progress lines "BENCH-PROGRESS {json}" go to stderr.
  {"op": "bench_serve", "model": DIR, "prefill_step_size": 2048|null}
      The same runs, one at a time, so a caller can interleave them with its own:
      after loading it writes {"loaded": {mlx_version, mlx_lm_version, default_device,
      dtype, params, load_ms}} as one stdout line, then reads commands, one JSON line
      each, from file descriptor 3: {"prompt": [ids], "gen": G, "label": "..."} -> one
      stdout line with the run (as in bench_suite); {"quit": true} or EOF ends it
      (answer {"runs": N}).
  {"op": "convert", "model": SRC, "out": DIR, "quantize": bool, "mode": M, "bits": B,
   "group_size": G, "dtype": D|null, "overrides": [{"pattern", "skip"|"bits"/"group_size"/"mode"}]}
      -> {"out": DIR}  mlx_lm.convert.convert(); overrides become its quant_predicate
      (last matching pattern wins, else the model's own quant_predicate), with the pattern
      rules of mlx-lfm's converter: `*` matches anything, a pattern matches the whole module
      path or a tail of it that starts after a dot.
  {"op": "processed", "model": DIR, "cases": [{"prompt": [ids], "max_tokens": N, "logit_bias": {id: b},
   "repetition_penalty": R|null, "presence_penalty": P|null, "frequency_penalty": F|null,
   "context_size": C, "top": K}]}
      -> {"results": [{"tokens": [...], "logprobs": [lp of each token], "top": [[[id, lp], ...K]]}]}
      greedy through mlx-lm's generate_step with make_logits_processors (all three penalties
      over the same window of C tokens); logprobs as generate_step yields them.
  {"op": "batch", "requests": [request, ...]} -> {"results": [answer, ...]}  (one process;
      a greedy request there may set "upcast_gather_mm": true, which from then on runs MLX's
      gather_mm in float32 so that bf16 MoE models run on the CPU wheel: an emulation)
"""
import json
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step


def greedy(model, cases):
    out = []
    for c in cases:
        prompt = mx.array(c["prompt"], dtype=mx.uint32)
        logits = model(prompt[None])[:, -1, :].astype(mx.float32)
        mx.eval(logits)
        toks = []
        for tok, _ in generate_step(prompt, model, max_tokens=c["max_tokens"]):
            toks.append(int(tok))
        out.append({"tokens": toks, "logits": logits[0].tolist()})
    return {"results": out}


def processed(model, cases):
    from mlx_lm.sample_utils import make_logits_processors

    out = []
    for c in cases:
        c_size = c.get("context_size", 20)
        procs = make_logits_processors(
            logit_bias={int(k): float(v) for k, v in (c.get("logit_bias") or {}).items()} or None,
            repetition_penalty=c.get("repetition_penalty"),
            repetition_context_size=c_size,
            presence_penalty=c.get("presence_penalty"),
            presence_context_size=c_size,
            frequency_penalty=c.get("frequency_penalty"),
            frequency_context_size=c_size,
        )
        prompt = mx.array(c["prompt"], dtype=mx.uint32)
        toks, lps, tops = [], [], []
        k = c.get("top", 0)
        for tok, lp in generate_step(prompt, model, max_tokens=c["max_tokens"], logits_processors=procs):
            lp = lp.astype(mx.float32)
            toks.append(int(tok))
            lps.append(float(lp[int(tok)]))
            order = mx.argsort(-lp)[:k].tolist()
            tops.append([[int(i), float(lp[i])] for i in order])
        out.append({"tokens": toks, "logprobs": lps, "top": tops})
    return {"results": out}


def bench(model, p, g, reps):
    import random

    rng = random.Random(0)
    vocab = model.args.vocab_size
    best = None
    for _ in range(reps):
        prompt = mx.array([rng.randrange(1, min(vocab, 1000)) for _ in range(p)], dtype=mx.uint32)
        t0 = time.perf_counter()
        first = None
        n = 0
        for tok, _ in generate_step(prompt, model, max_tokens=g):
            n += 1
            if first is None:
                first = time.perf_counter()
        t1 = time.perf_counter()
        r = {
            "ttft_ms": (first - t0) * 1000,
            "prefill_tps": p / (first - t0),
            "decode_tps": (n - 1) / (t1 - first) if n > 1 else 0.0,
        }
        if best is None or r["decode_tps"] > best["decode_tps"]:
            best = r
    return best


def _progress(**kv):
    sys.stderr.write("BENCH-PROGRESS " + json.dumps(kv) + "\n")
    sys.stderr.flush()


def _timed_run(model, ids, gen, prefill_step_size, label, prompt_cache=None):
    """One generation through mlx-lm's generate_step, timed the way its users
    see it: t0 just before the call, the first token when generate_step yields
    it (prefill done and the first token read back), the last token when the
    last one is read back. The prompt is an mx.array before t0, as it is for
    generate()/stream_generate() callers."""
    prompt = mx.array(ids, dtype=mx.uint32)
    mx.eval(prompt)
    kwargs = {"max_tokens": gen}
    if prompt_cache is not None:
        kwargs["prompt_cache"] = prompt_cache
    if prefill_step_size:
        kwargs["prefill_step_size"] = prefill_step_size
    mx.reset_peak_memory()
    _progress(label=label, phase="prefill", prompt_len=len(ids))
    t0 = time.perf_counter()
    first = last = None
    n = 0
    toks = []
    for tok, _ in generate_step(prompt, model, **kwargs):
        last = time.perf_counter()
        n += 1
        toks.append(int(tok))
        if first is None:
            first = last
            _progress(label=label, phase="decode", done=1, of=gen, ttft_ms=(first - t0) * 1000)
        elif n % 16 == 0:
            _progress(label=label, phase="decode", done=n, of=gen)
    # generate_step queues one step past the last token it yields; let it finish
    # (untimed) so it cannot spill into the next run's timing.
    mx.synchronize()
    ttft = first - t0
    dec = last - first
    return {
        "ttft_ms": ttft * 1000,
        "prefill_tps": len(ids) / ttft,
        "decode_tps": (n - 1) / dec if n > 1 and dec > 0 else 0.0,
        "decode_ms": dec * 1000,
        "tokens": n,
        "total_ms": (last - t0) * 1000,
        "peak_mem_bytes": mx.get_peak_memory(),
        "out_tokens": toks,
    }


def bench_suite(model, req, load_ms):
    gen = req["gen"]
    reps = max(1, req.get("reps", 1))
    step = req.get("prefill_step_size")
    out = _suite_info(model, load_ms)
    _progress(phase="loaded", **out)
    w = req.get("warmup")
    if w:
        out["warmup"] = _timed_run(model, w["prompt"], w["gen"], step, "warmup")
    results = []
    for ids in req["prompts"]:
        runs = []
        # "shape_warmup": an untimed run at this length first (returned as
        # "cold"), as mlx-lfm-bench and llama-bench warm up.
        cold = None
        if req.get("shape_warmup"):
            warm_ids = [(i * 7 + 3) % max(2, min(model.args.vocab_size, 1000)) + 1 for i in ids]
            cold = _timed_run(model, warm_ids, 2, step, f"P={len(ids)} warm-up")
        for r in range(reps):
            runs.append(_timed_run(model, ids, gen, step, f"P={len(ids)} rep {r + 1}/{reps}"))
            _progress(label=f"P={len(ids)} rep {r + 1}/{reps}", phase="done", run=runs[-1])
        results.append({"prompt_len": len(ids), "runs": runs, "cold": cold})
    out["results"] = results
    return out


def _ids(n, vocab, salt):
    # The same ids as mlx-lfm-bench's conversation (src/bin/bench.rs).
    m = min(vocab, 60000) - 10
    return [((i * 2654435761 + salt * 40503) % (1 << 32)) % m + 5 for i in range(n)]


def bench_turns(model, req, load_ms):
    """The conversation of `mlx-lfm-bench --turns`: per turn the TTFT of a
    cold run (fresh cache, whole prompt) and of a warm one that keeps one
    prompt cache across turns and feeds only the tokens it has not seen (what
    mlx_lm.chat does; LFM2's conv caches cannot be trimmed, so an exact
    continuation is the only reuse mlx-lm has)."""
    from mlx_lm.models.cache import make_prompt_cache

    vocab = req["vocab"]
    step = req.get("prefill_step_size")
    out = _suite_info(model, load_ms)
    for n in (64, req["system"] + req["user"], req["user"] + req["reply"]):
        _timed_run(model, _ids(n, vocab, 999), 8, step, "warmup")
    history = _ids(req["system"], vocab, 1)
    cache = make_prompt_cache(model)
    seen = 0
    turns = []
    for t in range(req["turns"]):
        history = history + _ids(req["user"], vocab, 100 + t)
        w = _timed_run(model, history[seen:], req["reply"], step, f"turn {t + 1} warm", prompt_cache=cache)
        c = _timed_run(model, history, req["reply"], step, f"turn {t + 1} cold")
        turns.append({"turn": t + 1, "prompt": len(history), "warm_ttft_ms": w["ttft_ms"], "warm_run": len(history) - seen,
                      "cold_ttft_ms": c["ttft_ms"], "warm_decode_tps": w["decode_tps"]})
        history = history + w["out_tokens"]
        seen = next(c.offset for c in cache if hasattr(c, "offset"))
        assert seen <= len(history), (seen, len(history))
    out["turns"] = turns
    return out


def bench_concurrent(model, req, load_ms):
    """What `mlx-lfm-bench --concurrent N` measures, with mlx-lm: N prompts
    one after another through generate_step, then the same N together through
    mlx-lm's own continuous batcher (BatchGenerator), no stop tokens, greedy."""
    from mlx_lm.generate import BatchGenerator

    n, p, gen, vocab = req["concurrent"], req["prompt"], req["gen"], req["vocab"]
    step = req.get("prefill_step_size")

    def together(prompts):
        g = BatchGenerator(model, stop_tokens=None, completion_batch_size=max(32, n), prefill_batch_size=n)
        uids = g.insert(prompts, [gen] * len(prompts))
        counts = {u: 0 for u in uids}
        while responses := g.next_generated():
            for r in responses:
                counts[r.uid] += 1
        mx.synchronize()
        g.close()
        return counts

    warm = [_ids(p, vocab, 900 + i) for i in range(n)]
    together(warm)
    _timed_run(model, warm[0], gen, step, "warmup")
    out = _suite_info(model, load_ms)
    runs = []
    for r in range(req.get("reps", 2)):
        prompts = [_ids(p, vocab, 1 + r * 100 + i) for i in range(n)]
        t = time.perf_counter()
        for q in prompts:
            _timed_run(model, q, gen, step, f"sequential {r}")
        seq_s = time.perf_counter() - t
        t = time.perf_counter()
        counts = together(prompts)
        par_s = time.perf_counter() - t
        total = n * gen
        runs.append({"concurrent": n, "prompt": p, "gen": gen, "sequential_tps": total / seq_s,
                     "concurrent_tps": sum(counts.values()) / par_s, "ratio": seq_s / par_s,
                     "tokens": sum(counts.values())})
    out["runs"] = runs
    return out


def _suite_info(model, load_ms):
    from mlx.utils import tree_flatten

    import mlx_lm

    leaves = [v for _, v in tree_flatten(model.parameters())]
    dtypes = sorted({str(v.dtype) for v in leaves if mx.issubdtype(v.dtype, mx.floating)})
    return {
        "mlx_version": mx.__version__,
        "mlx_lm_version": getattr(mlx_lm, "__version__", "?"),
        "default_device": str(mx.default_device()),
        "dtype": ",".join(d.replace("mlx.core.", "") for d in dtypes),
        "params": int(sum(v.size for v in leaves)),
        "load_ms": load_ms,
    }


def bench_serve(model, req, load_ms):
    import os

    step = req.get("prefill_step_size")
    sys.stdout.write(json.dumps({"loaded": _suite_info(model, load_ms)}) + "\n")
    sys.stdout.flush()
    n = 0
    with os.fdopen(3, "r") as cmds:
        for line in cmds:
            if not line.strip():
                continue
            c = json.loads(line)
            if c.get("quit"):
                break
            r = _timed_run(model, c["prompt"], c["gen"], step, c.get("label", "run"))
            n += 1
            sys.stdout.write(json.dumps(r) + "\n")
            sys.stdout.flush()
    return {"runs": n}


_MODE_DEFAULTS = {"affine": (4, 64), "mxfp4": (4, 32), "mxfp8": (8, 32), "nvfp4": (4, 16)}


def _pattern_matches(pattern, path):
    import re

    rx = re.compile(".*".join(re.escape(p) for p in pattern.split("*")))
    tails = [path] + [path[i + 1 :] for i, c in enumerate(path) if c == "."]
    return any(rx.fullmatch(t) for t in tails)


def convert_op(req):
    import contextlib
    from pathlib import Path

    from mlx_lm.convert import convert
    from mlx_lm.utils import _get_classes, load_config

    mode, bits, gs = req.get("mode", "affine"), req.get("bits"), req.get("group_size")
    overrides = req.get("overrides") or []
    pred = None
    if overrides:
        model_class, _ = _get_classes(load_config(Path(req["model"])))
        prop = getattr(model_class, "quant_predicate", None)
        default = prop.fget(None) if isinstance(prop, property) else None
        gbits, ggs = bits or _MODE_DEFAULTS[mode][0], gs or _MODE_DEFAULTS[mode][1]

        def pred(path, module):
            for o in reversed(overrides):
                if _pattern_matches(o["pattern"], path):
                    if o.get("skip"):
                        return False
                    m = o.get("mode") or mode
                    b, g = (gbits, ggs) if m == mode else _MODE_DEFAULTS[m]
                    return {"group_size": o.get("group_size") or g, "bits": o.get("bits") or b, "mode": m}
            return default(path, module) if default else True

    # mlx-lm prints progress on stdout, which carries our answer.
    with contextlib.redirect_stdout(sys.stderr):
        convert(
            req["model"],
            req["out"],
            quantize=req.get("quantize", True),
            q_group_size=gs,
            q_bits=bits,
            q_mode=mode,
            dtype=req.get("dtype"),
            quant_predicate=pred,
        )
    return {"out": req["out"]}


def _upcast_gather_mm():
    """MLX's CPU gather_mm is float32-only; this runs it in float32 on
    upcast operands and casts the result back, so bf16/f16 MoE models run on
    the CPU wheel (an emulation for tests, not mlx-lm's own behaviour)."""
    orig = getattr(mx, "_mlx_lfm_gather_mm", mx.gather_mm)
    mx._mlx_lfm_gather_mm = orig

    def gather_mm(a, b, lhs_indices=None, rhs_indices=None, sorted_indices=False):
        return orig(
            a.astype(mx.float32),
            b.astype(mx.float32),
            lhs_indices=lhs_indices,
            rhs_indices=rhs_indices,
            sorted_indices=sorted_indices,
        ).astype(a.dtype)

    mx.gather_mm = gather_mm


def _one(req):
    op = req["op"]
    if op == "convert":
        return convert_op(req)
    if req.get("upcast_gather_mm"):
        _upcast_gather_mm()
    model, tok = load(req["model"])
    if op == "greedy":
        return greedy(model, req["cases"])
    raise SystemExit(f"op {op} is not available inside a batch")


def main():
    req = json.load(sys.stdin)
    if req["op"] in ("convert", "batch"):
        reqs = req["requests"] if req["op"] == "batch" else [req]
        res = [_one(r) for r in reqs]
        json.dump({"results": res} if req["op"] == "batch" else res[0], sys.stdout)
        return
    t_load = time.perf_counter()
    model, tok = load(req["model"])
    load_ms = (time.perf_counter() - t_load) * 1000
    op = req["op"]
    if op == "greedy":
        res = greedy(model, req["cases"])
    elif op == "processed":
        res = processed(model, req["cases"])
    elif op == "chat_prompt":
        ids = tok.apply_chat_template(req["messages"], tools=req.get("tools"), add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        res = {"prompt": [int(i) for i in ids]}
    elif op == "encode":
        text = req["text"]
        add = tok.bos_token is None or not text.startswith(tok.bos_token)
        res = {"ids": tok.encode(text, add_special_tokens=add)}
    elif op == "bench":
        res = bench(model, req["prompt_len"], req["gen"], req.get("reps", 1))
    elif op == "bench_suite":
        res = bench_suite(model, req, load_ms)
    elif op == "bench_turns":
        res = bench_turns(model, req, load_ms)
    elif op == "bench_serve":
        res = bench_serve(model, req, load_ms)
    elif op == "bench_concurrent":
        res = bench_concurrent(model, req, load_ms)
    else:
        raise SystemExit(f"unknown op {op}")
    json.dump(res, sys.stdout)


if __name__ == "__main__":
    main()
