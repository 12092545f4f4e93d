"""mlx-lm reference runner for mlx-lfm's parity tests and benchmarks.

Reads one JSON request on stdin, writes one JSON answer on stdout.
  {"op": "greedy", "model": DIR, "cases": [{"prompt": [ids], "max_tokens": N}]}
      -> {"results": [{"tokens": [...], "logits": [...first-step logits, f32...]}]}
  {"op": "chat_prompt", "model": DIR, "messages": [...], "tools": [...]|null}
      -> {"prompt": [ids]}  (the tokenizer's chat template, add_generation_prompt=True)
  {"op": "encode", "model": DIR, "text": "..."} -> {"ids": [...]}  (mlx-lm's generate() encoding)
  {"op": "bench", "model": DIR, "prompt_len": P, "gen": G, "reps": R}
      -> {"prefill_tps": ..., "decode_tps": ..., "ttft_ms": ...}
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


def main():
    req = json.load(sys.stdin)
    model, tok = load(req["model"])
    op = req["op"]
    if op == "greedy":
        res = greedy(model, req["cases"])
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
    else:
        raise SystemExit(f"unknown op {op}")
    json.dump(res, sys.stdout)


if __name__ == "__main__":
    main()
