"""What the patch costs at run time: prefill and decode speed, patched vs unpatched llama.cpp.

Configurations, on the default real model (SmolLM2-135M-Instruct Q4_1; ``--model`` another), CPU
(``-ngl`` offloads), flash attention on:

- ``stock``        unpatched llama.cpp of the same pinned tree (bench/build-stock.sh), plain RoPE
- ``none``         patched library, method none
- ``mixed``        patched, ntk-mixed (b = 0.625, k = 2)
- ``mixed+logn``   patched, ntk-mixed + log-n

Tasks: prefill of 512, 4096 and 16384 tokens from an empty context (tokens/s), and decode of 128
tokens at depth 8192 (tokens/s, prefill not counted). Every measurement runs in a fresh process
(one model load per task, one warm-up ubatch first; prefills shorter than ``--prefill-tokens``
(2048) are repeated in the process, about that many tokens in all, and their median kept; with layers on a GPU two warm-up prefills, then repeats for
5 times and 2 s at least); with ``--persistent`` one process per configuration serves every
sample instead (the model loaded once: many rounds in little time where loading dominates, as on
a GPU). Repetitions alternate the configurations (rotated order per round) so drift hits all
alike. Prints per-task medians, min–max spread, and ratios to ``stock``; writes
JSON with every sample.

    .venv/bin/python bench/runtime_cost.py [--reps 3] [--lengths 512,4096,16384] [--decode-depth 8192] [--model gemma3] [--persistent]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import benchlib
from benchlib import ROOT, paired_ratios, spread

STOCK_LIB = ROOT / "build" / "stock-lib"
CONFIGS = ["stock", "none", "mixed", "mixed+logn"]
N_DECODE = 128


def load(config: str, n_ctx: int, threads: int, ngl: int = 0, model: str | None = None) -> tuple[Any, list[int]]:
    """In a child process: load ``model`` (default: the default model) as ``config`` wants it;
    return the ``Llama`` and the benchmark text's tokens."""
    from ggufrope import runtime
    from ggufrope.models import default_model_path

    model = model or default_model_path()
    if config == "stock":
        assert not runtime.is_patched(), "stock config loaded the patched library"
        import llama_cpp

        llm = llama_cpp.Llama(model_path=str(model), n_ctx=n_ctx, n_batch=512, n_ubatch=512, flash_attn=True,
                              n_threads=threads, n_threads_batch=threads, n_gpu_layers=ngl, verbose=False)
    else:
        assert runtime.is_patched(), "patched config loaded a stock library"
        method, logn = {"none": ("none", False), "mixed": ("ntk-mixed", False), "mixed+logn": ("ntk-mixed", True)}[config]
        kb = {"factor": 2.0, "exponent": 0.625} if method == "ntk-mixed" else {}  # k and b only where they apply
        llm = runtime.load(model, method=method, logn=logn, n_ctx=n_ctx, n_batch=512,
                           n_ubatch=512, n_threads=threads, n_threads_batch=threads, n_gpu_layers=ngl, **kb)
    return llm, benchlib.real_tokens(llm)


def measure(llm: Any, tokens: list[int], task: str, n: int, ngl: int = 0, prefill_tokens: int = 2048) -> dict:
    """One sample of ``task`` (prefill of ``n`` tokens from an empty context, or decode of
    N_DECODE tokens at depth ``n``) on a loaded ``llm``."""
    prompt = tokens[:n]
    assert len(prompt) == n
    # Warm-up: one ubatch, so page faults on the mmapped weights, thread start-up and the first
    # allocation of the compute buffers are not charged to the first configuration of a round.
    llm.eval(prompt[: min(n, llm.n_batch)])

    def prefill() -> float:
        llm.reset()  # n_tokens = 0: the next eval starts at position 0 and overwrites the cache
        t0 = time.perf_counter()
        for i in range(0, n, llm.n_batch):
            llm.eval(prompt[i : i + llm.n_batch])
        return time.perf_counter() - t0

    if task == "prefill":
        # Short prefills are repeated in the process (about prefill_tokens in all) and the median kept;
        # with layers on a GPU one takes 0.01-0.6 s and, with 5 repeats a process, the 4096 and 16384
        # medians spread by 2x between processes (H200, 2026-11-26): there two whole prefills warm
        # up first, and the prefill repeats for at least 5 times and 2 s.
        if ngl != 0:
            prefill(), prefill()
            times: list[float] = []
            t_end = time.perf_counter() + 2.0
            while len(times) < 5 or time.perf_counter() < t_end:
                times.append(prefill())
        else:
            times = [prefill() for _ in range(max(1, prefill_tokens // n))]
        t_prefill = statistics.median(times)
        return {"tok_s": n / t_prefill, "seconds": t_prefill, "inner": times}
    prefill()
    follow = tokens[n : n + N_DECODE]
    t0 = time.perf_counter()
    for tok in follow:
        llm.eval([tok])
    t_dec = time.perf_counter() - t0
    return {"tok_s": N_DECODE / t_dec, "seconds": t_dec}


def serve(config: str, n_ctx: int, threads: int, ngl: int = 0, model: str | None = None,
          prefill_tokens: int = 2048) -> None:
    """The child process: load once, then answer ``TASK N`` lines on stdin with one JSON sample a
    line on stdout, until stdin closes."""
    llm, tokens = load(config, n_ctx, threads, ngl, model)
    print(json.dumps({"ready": config}), flush=True)
    for line in sys.stdin:
        task, n = line.split()
        print(json.dumps(measure(llm, tokens, task, int(n), ngl, prefill_tokens)), flush=True)


def child_env(config: str) -> dict[str, str]:
    env = dict(os.environ)
    if config == "stock":
        if not (STOCK_LIB / "libllama.so").exists():
            sys.exit(f"runtime_cost: error: {STOCK_LIB} has no unpatched libllama.so (run bench/build-stock.sh)")
        env["LLAMA_CPP_LIB_PATH"] = str(STOCK_LIB)
    else:
        env.pop("LLAMA_CPP_LIB_PATH", None)
    return env


class Server:
    """A ``serve`` child of one configuration: a fresh one for every sample, or with
    ``--persistent`` one for the whole run (the model loaded once; the rounds alternate between
    the children, only one measures at a time, the others wait on stdin)."""

    def __init__(self, config: str, n_ctx: int, threads: int, ngl: int, model: str, prefill_tokens: int = 2048):
        self.config = config
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen([sys.executable, __file__, "--serve", config, str(n_ctx), str(threads), str(ngl), model,
                                   str(prefill_tokens)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True,
                                  env=child_env(config))
        self._read()

    def _read(self) -> dict:
        line = self.p.stdout.readline() if self.p.stdout else ""
        if not line:
            self.err.seek(0)
            sys.exit(f"runtime_cost: error: the {self.config} worker stopped:\n{self.err.read()[-3000:]}")
        return json.loads(line)

    def __call__(self, task: str, n: int) -> dict:
        assert self.p.stdin is not None
        self.p.stdin.write(f"{task} {n}\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.p.stdin:
            self.p.stdin.close()
        self.p.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lengths", default="512,4096,16384")
    ap.add_argument("--decode-depth", type=int, default=8192)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("-ngl", "--n-gpu-layers", dest="ngl", type=int, default=0,
                    help="layers offloaded to the GPU (-1: all; a CUDA build of both libraries)")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--out", default=str(benchlib.OUT_DIR / "runtime_cost.json"))
    ap.add_argument("--model", default=None, metavar="NAME_OR_GGUF",
                    help="a real model's name (python -m ggufrope.models --help) or a GGUF path [default model]")
    ap.add_argument("--persistent", action="store_true",
                    help="one process per configuration for the whole run (the model loaded once), rounds alternating "
                         "between them; default: a fresh process per sample")
    ap.add_argument("--prefill-tokens", type=int, default=2048, metavar="N",
                    help="on the CPU, repeat shorter prefills in the process up to about N tokens in all")
    ap.add_argument("--serve", nargs=6, metavar=("CONFIG", "N_CTX", "THREADS", "NGL", "MODEL", "PREFILL_TOKENS"),
                    help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        c, n_ctx, th, ngl, model, pt = a.serve
        serve(c, int(n_ctx), int(th), int(ngl), model or None, int(pt))
        return
    model = ""
    if a.model:
        from ggufrope.models import MODELS, model_path

        model = str(model_path(a.model)) if a.model in MODELS else a.model
        if not os.path.isfile(model):
            sys.exit(f"runtime_cost: error: no model {a.model!r} (a GGUF path or one of {', '.join(MODELS)})")

    from tqdm import tqdm

    configs = a.configs.split(",")
    lengths = [int(x) for x in a.lengths.split(",") if x]
    tasks = [("prefill", n) for n in lengths] + ([("decode", a.decode_depth)] if a.decode_depth else [])
    n_ctx = max([n for _, n in tasks] + [a.decode_depth + N_DECODE]) + 512
    samples: dict[str, dict[str, list[float]]] = {f"{t}@{n}": {c: [] for c in configs} for t, n in tasks}
    jobs = [(r, (t, n), configs[r % len(configs):] + configs[: r % len(configs)]) for r in range(a.reps) for t, n in tasks]
    def server(c: str) -> Server:
        return Server(c, n_ctx, a.threads, a.ngl, model, a.prefill_tokens)

    def fresh(c: str, t: str, n: int) -> dict:
        srv = server(c)
        try:
            return srv(t, n)
        finally:
            srv.close()

    servers = {c: server(c) for c in configs} if a.persistent else {}
    with tqdm(total=a.reps * len(tasks) * len(configs), unit="run", file=sys.stderr) as bar:
        for r, (t, n), order in jobs:
            for c in order:
                bar.set_description(f"rep {r + 1} {t}@{n} {c}")
                sample = servers[c](t, n) if servers else fresh(c, t, n)
                samples[f"{t}@{n}"][c].append(sample["tok_s"])
                bar.update()
                # after every sample: a run stopped by a time limit keeps what it measured
                benchlib.write_record(a.out, {"model": model or "default", "threads": a.threads, "n_gpu_layers": a.ngl,
                                              "n_ctx": n_ctx, "reps": a.reps, "persistent": a.persistent,
                                              "tok_s": samples})
    for srv in servers.values():
        srv.close()

    base = "stock" if "stock" in configs else configs[0]
    print(f"\n{'task':16s}" + "".join(f"{c:>24s}" for c in configs) + "   (tokens/s: median [min-max]; ratio to " + base + ")")
    for key, per in samples.items():
        med = {c: statistics.median(v) for c, v in per.items()}
        cells = "".join(spread(per[c]).rjust(24) for c in configs)
        ratios = "  ".join(f"{c}/{base} {med[c] / med[base]:.3f}" for c in configs if c != base)
        print(f"{key:16s}{cells}   {ratios}")
    # Paired view: within one round the configurations ran back to back, so the per-round ratio
    # cancels drift that is slower than a round; its median and spread say how stable a ratio is.
    print(f"\nper-round ratios to {base} (median [min-max] over {a.reps} rounds)")
    for key, per in samples.items():
        cells = []
        for c in configs:
            if c == base:
                continue
            cells.append(f"{c}/{base} {spread(paired_ratios(per[c], per[base]), '.3f')}")
        print(f"{key:16s}" + "  ".join(cells))
    print(f"\nsamples: {a.out}")


if __name__ == "__main__":
    main()
