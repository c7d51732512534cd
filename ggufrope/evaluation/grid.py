"""The comparison grid behind ``ggufrope eval compare``.

:func:`run_compare` runs a grid (contexts x methods x dynamic k x log-n; dynamic k for the NTK
family only), one cached JSON file per unit (:mod:`ggufrope.evaluation.cache`: model
fingerprint, method, k, b, dynamic k, log-n, n_ctx, document or passkey trial set, protocol
version), so an interrupted run resumes where it stopped; it writes ``results.json``, a
markdown table shaped like seed 000's Table 1 and a PNG plot
(:mod:`ggufrope.evaluation.report`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import GGUFRopeError
from ..methods import DEFAULT_EXPONENT, entry
from .cache import EVAL_VERSION, Cache, atomic_json, build_id, build_info, model_fingerprint, unit_key
from .decoder import DEFAULT_N_GEN, Decoder, Setting, batch_sizes, load_model, n_ctx_orig_of
from .passkey import DEFAULT_DEPTHS, passkey
from .ppl import Text, check_score_from, perplexity, summarize_windows
from .report import markdown_table, plot

#: grid order of ``--methods all``
ALL_METHODS = ("none", "linear", "yarn", "ntk", "ntk-fixed", "ntk-mixed")

#: flash attention in the grid's models (``runtime.load``'s default, passed explicitly so that
#: the build recorded with each unit is the one it ran with)
FLASH_ATTN = True


def grid_configs(n_ctxs: Sequence[int], methods: Sequence[str], logn_modes: Sequence[bool],
                 dynamic_modes: Sequence[bool] = (False,)) -> list[tuple[int, str, bool, bool]]:
    """The cells of the grid, (n_ctx, method, log-n, dynamic), in report order: contexts, then
    methods, then static before dynamic, then log-n; dynamic k only for methods that support it
    (the NTK family)."""
    return [(c, m, ln, dyn) for c in n_ctxs for m in methods for dyn in dynamic_modes for ln in logn_modes
            if not dyn or entry(m).supports_dynamic]


@dataclasses.dataclass
class GridStats:
    computed: int = 0
    cached: int = 0
    missing: int = 0  #: units neither cached nor computed (report_only)
    models_loaded: int = 0
    stale: int = 0  #: of the computed units, those cached by another build (recomputed, overwritten)


def machine_info() -> dict[str, Any]:
    from ..runtime import library_version

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "ggufrope_patch": library_version(),
    }
    try:
        import llama_cpp

        info["llama_cpp_python"] = llama_cpp.__version__
    except Exception:  # pragma: no cover
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def run_compare(
    model: str | os.PathLike,
    *,
    n_ctxs: Sequence[int],
    methods: Sequence[str],
    logn_modes: Sequence[bool] = (False, True),
    dynamic_modes: Sequence[bool] = (False,),
    dynamic_ratio: float | None = None,
    factor: float | None = None,
    exponent: float = DEFAULT_EXPONENT,
    texts: Sequence[Text] = (),
    max_windows: int | None = 1,
    score_from: int | None = None,
    trials: int = 10,
    seed: int = 0,
    depths: Sequence[float] | None = DEFAULT_DEPTHS,
    n_gen: int = DEFAULT_N_GEN,
    out_dir: str | os.PathLike = "eval-results",
    cache_dir: str | os.PathLike | None = None,
    n_batch: int = 512,
    n_ubatch: int | None = None,
    gpu_layers: int = 0,
    threads: int | None = None,
    report_only: bool = False,
    progress: bool = True,
    verbose: bool = False,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], GridStats]:
    """Run (or read from the cache) every unit of the grid; write ``results.json``,
    ``results.md`` and ``ppl.png`` into ``out_dir``. Returns (results, stats).

    A cached unit is reused only when the build it records (:func:`ggufrope.evaluation.cache.build_info`)
    is this one; one cached by another build (or by an unrecorded one) is stale: recomputed and
    overwritten. ``report_only``: compute nothing, build the report from the units already
    cached, whichever build computed them (``results.json`` counts the units per build); a cell
    whose units are missing is reported as not run (None).
    ``dynamic_modes``: static (False) and/or dynamic k (True, NTK-family methods only), with the
    schedule's ratio ``dynamic_ratio`` (None: the library's 2)."""
    from tqdm import tqdm

    for c in n_ctxs:
        check_score_from(c, score_from)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache = Cache(cache_dir if cache_dir is not None else out / "cache")
    L = n_ctx_orig_of(model)
    fp = model_fingerprint(model, cache.root)
    stats = GridStats()
    t_start = time.perf_counter()
    say = log or (lambda s: None)

    tokens_by_text: dict[str, list[int]] = {}  # tokenized once, with the first model loaded
    configs = grid_configs(n_ctxs, methods, logn_modes, dynamic_modes)
    if not configs:
        raise GGUFRopeError("nothing to run: dynamic k applies to the NTK family only (ntk, ntk-fixed, ntk-mixed)")
    units = []
    for c, m, ln, dyn in configs:
        st = Setting.for_grid(m, factor, exponent, ln, dyn, dynamic_ratio)
        base = unit_key(st, c, L, fp)
        for t in texts:
            units.append((st, c, "ppl", t, {**base, "kind": "ppl", "text": t.name, "text_sha256": t.sha256,
                                            "score_from": c // 2 if score_from is None else score_from,
                                            "max_windows": max_windows}))
        if trials > 0:
            units.append((st, c, "passkey", None, {**base, "kind": "passkey", "trials": trials, "seed": seed,
                                                   "depths": None if depths is None else list(depths),
                                                   "n_gen": n_gen}))

    results: dict[tuple, dict[str, Any]] = {}
    builds: dict[str, int] = {}  # units of the report per build
    llm_key: tuple | None = None
    dec: Decoder | None = None
    llm = None
    with tqdm(total=len(units), unit="unit", desc="compare", disable=not progress, file=sys.stderr,
              dynamic_ncols=True) as bar:
        for st, c, kind, text, key in units:
            label = f"{st.label()} @ {c}" + (f" {text.name}" if text else " passkey")
            bar.set_description(f"compare: {label}")
            unit = cache.read(key)
            if unit is None and report_only:
                stats.missing += 1
                say(f"missing  {label}")
                bar.update(1)
                continue
            build = None if report_only else build_info(gpu_layers, FLASH_ATTN, batch_sizes(n_batch, n_ubatch, c)[1])
            if unit is not None and not report_only and unit.get("build") != build:
                stats.stale += 1
                say(f"stale (another build) {label}: {build_id(unit.get('build'))}")
                bar.set_description(f"compare: {label} stale (another build)")
                unit = None
            r = None if unit is None else unit["result"]
            if r is None:
                if llm_key != (st, c):
                    if dec is not None:
                        dec.close()
                    dec = llm = None
                    llm = load_model(model, st, c, n_batch=n_batch, n_ubatch=n_ubatch, gpu_layers=gpu_layers,
                                     threads=threads, verbose=verbose, flash_attn=FLASH_ATTN)
                    dec, llm_key = Decoder(llm), (st, c)
                    stats.models_loaded += 1
                t0 = time.perf_counter()
                if kind == "ppl":
                    if text.name not in tokens_by_text:
                        tokens_by_text[text.name] = dec.tokenize(text.text)
                    ws = perplexity(dec, tokens_by_text[text.name], c, L, score_from=score_from,
                                    max_windows=max_windows, progress=progress, desc=text.name)
                    r = {"windows": [dataclasses.asdict(w) for w in ws], **summarize_windows(ws)}
                else:
                    r = passkey(dec, c, trials=trials, seed=seed, depths=depths, n_gen=n_gen, progress=progress)
                if st.dynamic:  # the k the last window / trial reached
                    from ..runtime import factor_in_use

                    r["factor_end"] = factor_in_use(llm)
                r["wall_s"] = time.perf_counter() - t0
                cache.put(key, r, build)
                stats.computed += 1
                say(f"computed {label}")
            else:
                build = unit.get("build")
                stats.cached += 1
                say(f"cached   {label}")
            builds[build_id(build)] = builds.get(build_id(build), 0) + 1
            results[(st.method, st.logn, st.dynamic, c, kind, text.name if text else None)] = r
            bar.update(1)
    if dec is not None:
        dec.close()
    del llm

    cells = []
    for c, m, ln, dyn in configs:
        st = Setting.for_grid(m, factor, exponent, ln, dyn, dynamic_ratio)
        docs = {t.name: results.get((m, ln, dyn, c, "ppl", t.name)) for t in texts}
        if None in docs.values():  # report_only and some text not run: no partial pooled value
            docs = {}
        pooled = summarize_windows(w for d in docs.values() for w in d["windows"]) if docs else None
        pk = results.get((m, ln, dyn, c, "passkey", None))
        cells.append({
            "n_ctx": c, "method": m, "logn": ln, **({"dynamic": True} if dyn else {}),
            "label": st.label(), "factor": st.resolved_factor(c, L),
            "exponent": st.exponent if m == "ntk-mixed" else None,
            "ppl": pooled and pooled["ppl"], "ppl_beyond": pooled and pooled["ppl_beyond"],
            "ppl_within": pooled and pooled["ppl_within"],
            "scored_tokens": pooled and pooled["count"], "scored_tokens_beyond": pooled and pooled["count_beyond"],
            "scored_tokens_within": pooled and pooled["count_within"],
            "ppl_by_text": {n: {"ppl": d["ppl"], "ppl_beyond": d["ppl_beyond"], "windows": d["n_windows"]}
                            for n, d in docs.items()},
            "passkey_accuracy": pk and pk["accuracy"], "passkey_by_depth": pk and pk["by_depth"],
            "passkey_trials": pk and pk["trials"],
        })
    res = {
        "eval_version": EVAL_VERSION,
        "command": command,
        "model": {**fp, "path": os.fspath(model), "n_ctx_orig": L},
        "grid": {"n_ctx": list(n_ctxs), "methods": list(methods), "logn": list(logn_modes),
                 "dynamic": list(dynamic_modes), "dynamic_ratio": dynamic_ratio, "factor": factor,
                 "exponent": exponent, "texts": [{"name": t.name, "sha256": t.sha256} for t in texts],
                 "max_windows": max_windows, "score_from": score_from, "trials": trials, "seed": seed,
                 "depths": None if depths is None else list(depths), "n_gen": n_gen,
                 "n_batch": n_batch, "gpu_layers": gpu_layers},
        "cells": cells,
        "machine": machine_info(),  # of this run: with report_only, not the one that computed the units
        "report_only": report_only,
        "wall_s_this_run": time.perf_counter() - t_start,
        "wall_s_all_units": sum(r.get("wall_s", 0.0) for r in results.values()),
        "units": {"computed": stats.computed, "cached": stats.cached, "missing": stats.missing, "stale": stats.stale},
        "builds": builds,  # the units of this report per build that computed them
    }
    atomic_json(out / "results.json", res)
    (out / "results.md").write_text(markdown_table(res), encoding="utf-8")
    plot(res, out / "ppl.png")
    return res, stats
