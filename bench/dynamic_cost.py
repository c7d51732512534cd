"""What dynamic k costs at run time, against static k, in one process (issue 13).

Default real model (SmolLM2-135M-Instruct Q4_1, L = 8192), CPU, flash attention on, n_ubatch 512,
ntk-mixed (b = 0.625) + log-n in both configurations:

- ``static``   k = 2 fixed (the table of a 16k context), set when the context is created;
- ``dynamic``  ``{arch}.rope.ntk.dynamic``: k = 1 up to 8192 positions, 2 beyond; one step (and one
  re-rotation of the KV cache) while the prefill crosses L.

Both contexts live in this process (the model file is mmapped once by the OS); rounds alternate
the order (static first, then dynamic first, ...). Each round, per configuration:

1. prefill of 16384 tokens of real text from an empty cache (tokens/s);
2. the cache cut back to 16000 tokens (``llama_memory_seq_rm``; k stays 2: no step), then decode of
   128 tokens one by one at depth 16000 (tokens/s).

Then the re-rotation alone, on contexts of 16384 and 32768 cells: 64 tokens are decoded, their
positions moved up by ``llama_memory_seq_add`` so that the next token needs the next k, and that
token is decoded. The time of the re-rotation is the library's own measurement, read from its debug
log line (``dynamic k 1 -> 2 at n = ...: KV cache re-rotated in X ms``, the span from the
synchronisation before the table change to the end of the rotation graph); the rope op runs over
every cell of the cache, so the cost is that of a full cache of that size. The decode that carries
the step is also timed against one that does not (both carry the K-shift of the moved positions).

Prints medians, min-max, the ratios dynamic/static (goal: >= 0.99 decode, >= 0.98 prefill) and
writes JSON with every sample.

    .venv/bin/python bench/dynamic_cost.py [--rounds 3] [--threads N] [--out build/bench/dynamic_cost.json]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import time

import benchlib
from benchlib import median, spread

N_PREFILL = 16384
DEPTH = 16000
N_DECODE = 128


class DebugLog:
    """Collects llama.cpp's log lines (every level) through ``llama_log_set``."""

    def __init__(self):
        import llama_cpp

        self.lines: list[str] = []

        def cb(level, text, user_data):
            self.lines.append(text.decode(errors="replace"))

        self._cb = llama_cpp.llama_log_callback(cb)
        llama_cpp.llama_log_set(self._cb, ctypes.c_void_p(0))

    def rerotation_ms(self) -> list[float]:
        return [float(m.group(1)) for m in (re.search(r"re-rotated in ([0-9.]+) ms", s) for s in self.lines) if m]


def open_ctx(model, dynamic: bool, n_ctx: int, threads: int, ngl: int = 0):
    from ggufrope import runtime

    k = {"dynamic": True} if dynamic else {"factor": 2.0, "dynamic": False}
    return runtime.load(model, method="ntk-mixed", exponent=0.625, logn=True, n_ctx=n_ctx, n_batch=512, n_ubatch=512,
                        flash_attn=True, n_threads=threads, n_threads_batch=threads, n_gpu_layers=ngl, **k)


def k_now(llm) -> float:
    from ggufrope.runtime import factor_in_use

    return factor_in_use(llm._ctx.ctx)


def decode_one(llm, token: int, pos: int) -> float:
    """Decode one token at ``pos`` in sequence 0; returns the wall seconds of llama_decode."""
    import llama_cpp

    batch = llama_cpp.llama_batch_init(1, 0, 1)
    try:
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.seq_id[0][0], batch.logits[0] = token, pos, 1, 0, 1
        batch.n_tokens = 1
        t = time.perf_counter()
        rc = llama_cpp.llama_decode(llm._ctx.ctx, batch)
        dt = time.perf_counter() - t
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return dt
    finally:
        llama_cpp.llama_batch_free(batch)


def round_trip(llm, tokens: list[int], n_prefill: int, depth: int) -> dict:
    import llama_cpp

    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    llama_cpp.llama_memory_clear(mem, True)
    llm.n_tokens = 0
    t = time.perf_counter()
    llm.eval(tokens[:n_prefill])
    prefill_s = time.perf_counter() - t
    k_after_prefill = k_now(llm)
    assert llama_cpp.llama_memory_seq_rm(mem, 0, depth, -1)
    llm.n_tokens = depth
    t = time.perf_counter()
    for i in range(N_DECODE):
        decode_one(llm, tokens[depth + i], depth + i)
    decode_s = time.perf_counter() - t
    return {"prefill_s": prefill_s, "prefill_tok_s": n_prefill / prefill_s, "decode_s": decode_s,
            "decode_tok_s": N_DECODE / decode_s, "k_after_prefill": k_after_prefill, "k_after_decode": k_now(llm)}


def rerotation(model, n_ctx: int, threads: int, rounds: int, log: DebugLog, ngl: int = 0) -> dict:
    """One step of k on a cache of ``n_ctx`` cells (module docstring). Per round, alternated: 64
    tokens decoded (k = 1), their positions moved up by S with ``llama_memory_seq_add``, then one
    token decoded at 64 + S. S = 8128: n = 8193 > L, k 1 -> 2, the cache re-rotated (after the
    K-shift of the move); S = 8127: n = 8192, no step (the K-shift alone)."""
    import llama_cpp

    llm = open_ctx(model, True, n_ctx, threads, ngl)
    toks = llm.tokenize(b"The quick brown fox jumps over the lazy dog. " * 16, add_bos=True)[:65]
    mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
    out = {"n_ctx": n_ctx, "rerotation_ms": [], "decode_with_step_s": [], "decode_without_step_s": []}
    try:
        for r in range(rounds):
            for stepped in ((True, False) if r % 2 == 0 else (False, True)):
                llama_cpp.llama_memory_clear(mem, True)
                llm.n_tokens = 0
                llm.eval(toks[:64])
                assert k_now(llm) == 1.0
                shift = 8128 if stepped else 8127
                llama_cpp.llama_memory_seq_add(mem, 0, 0, 64, shift)
                n_log = len(log.rerotation_ms())
                dt = decode_one(llm, toks[64], 64 + shift)
                ms = log.rerotation_ms()[n_log:]
                assert k_now(llm) == (2.0 if stepped else 1.0) and len(ms) == (1 if stepped else 0), (k_now(llm), ms)
                out["decode_with_step_s" if stepped else "decode_without_step_s"].append(dt)
                out["rerotation_ms"] += ms
    finally:
        llm.close()
    print(f"re-rotation of a {n_ctx}-cell cache: {spread(out['rerotation_ms'])} ms (median [min-max]); one decode "
          f"with the step {median(out['decode_with_step_s']) * 1e3:.1f} ms, without "
          f"{median(out['decode_without_step_s']) * 1e3:.1f} ms", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-prefill", type=int, default=N_PREFILL, help="prefill length (a smoke run: 1024)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-ngl", "--n-gpu-layers", dest="ngl", type=int, default=0,
                    help="layers offloaded to the GPU (-1: all; a CUDA build)")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR / "dynamic_cost.json"))
    args = ap.parse_args()

    from ggufrope.models import default_model_path

    model = default_model_path()
    log = DebugLog()
    n_prefill = args.n_prefill
    depth = DEPTH if n_prefill == N_PREFILL else n_prefill - N_DECODE
    ctxs = {name: open_ctx(model, name == "dynamic", n_prefill + 256, args.threads, args.ngl) for name in ("static", "dynamic")}
    tokens = benchlib.real_tokens(ctxs["static"], n_prefill + N_DECODE)
    # warm-up: one ubatch each
    for llm in ctxs.values():
        llm.eval(tokens[:512])
        llm.reset()

    samples: dict[str, list[dict]] = {"static": [], "dynamic": []}
    for r in range(args.rounds):
        order = ("static", "dynamic") if r % 2 == 0 else ("dynamic", "static")
        for name in order:
            n_log = len(log.rerotation_ms())
            s = round_trip(ctxs[name], tokens, n_prefill, depth)
            s["rerotations_ms"] = log.rerotation_ms()[n_log:]
            samples[name].append(s)
            print(f"round {r + 1}/{args.rounds} {name:8s} prefill {s['prefill_tok_s']:8.1f} tok/s  "
                  f"decode {s['decode_tok_s']:6.2f} tok/s  k {s['k_after_prefill']:g}/{s['k_after_decode']:g}  "
                  f"re-rotations {s['rerotations_ms']}", flush=True)
    for llm in ctxs.values():
        llm.close()
    report_rerot = [rerotation(model, n, args.threads, args.rounds, log, args.ngl) for n in (16384, 32768)]

    def med(name, key):
        return median([x[key] for x in samples[name]])

    report = {"model": str(model), "threads": args.threads, "n_gpu_layers": args.ngl, "n_prefill": n_prefill, "depth": depth, "n_decode": N_DECODE,
              "samples": samples, "rerotation": report_rerot}
    for key in ("prefill_tok_s", "decode_tok_s"):
        report[f"ratio_{key}"] = med("dynamic", key) / med("static", key)
        print(f"{key:14s} static {spread([x[key] for x in samples['static']], '.2f')}  "
              f"dynamic {spread([x[key] for x in samples['dynamic']], '.2f')}  ratio {report[f'ratio_{key}']:.4f}")
    benchlib.write_record(args.out, report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
