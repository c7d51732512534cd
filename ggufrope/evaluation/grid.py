"""The comparison grid behind ``ggufrope eval compare``.

:func:`run_compare` runs a grid (contexts x methods x dynamic k x log-n; dynamic k for the NTK
family only), one cached JSON file per unit (:mod:`ggufrope.evaluation.cache`: model
fingerprint, method, k, b, dynamic k, log-n, n_ctx, document or passkey trial set, protocol
version), so an interrupted run resumes where it stopped; it writes ``results.json``, a
markdown table shaped like seed 000's Table 1 and a PNG plot
(:mod:`ggufrope.evaluation.report`).
"""

from __future__ import annotations

import os
import pathlib
import platform
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import GGUFRopeError
from ..methods import DEFAULT_EXPONENT, entry
from .cache import EVAL_VERSION, Cache, atomic_json, model_fingerprint
from .decoder import DEFAULT_N_GEN, Setting, n_ctx_orig_of
from .passkey import DEFAULT_DEPTHS
from .ppl import Text, check_score_from, summarize_windows
from .report import plot, report_markdown
from .units import FLASH_ATTN, GridStats, UnitRunner, advance, unit_bar  # noqa: F401  (FLASH_ATTN, GridStats: re-exported)

#: grid order of ``--methods all``
ALL_METHODS = ("none", "linear", "yarn", "ntk", "ntk-fixed", "ntk-mixed")


def grid_configs(n_ctxs: Sequence[int], methods: Sequence[str], logn_modes: Sequence[bool],
                 dynamic_modes: Sequence[bool] = (False,)) -> list[tuple[int, str, bool, bool]]:
    """The cells of the grid, (n_ctx, method, log-n, dynamic), in report order: contexts, then
    methods, then static before dynamic, then log-n; dynamic k only for methods that support it
    (the NTK family)."""
    return [(c, m, ln, dyn) for c in n_ctxs for m in methods for dyn in dynamic_modes for ln in logn_modes
            if not dyn or entry(m).supports_dynamic]


def _ruler_cell(r: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if r is None else {"score": r["score"], "control": r["control"], "samples": r["samples"]}


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
    attn_factor: float = 1.0,
    texts: Sequence[Text] = (),
    max_windows: int | None = 1,
    score_from: int | None = None,
    trials: int = 10,
    seed: int = 0,
    depths: Sequence[float] | None = DEFAULT_DEPTHS,
    n_gen: int = DEFAULT_N_GEN,
    ruler_tasks: Sequence[str] = (),
    samples: int = 10,
    truncation: bool = True,
    out_dir: str | os.PathLike = "eval-results",
    cache_dir: str | os.PathLike | None = None,
    n_batch: int = 512,
    n_ubatch: int | None = None,
    gpu_layers: int = 0,
    threads: int | None = None,
    report_only: bool = False,
    any_build: bool = False,
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
    whose units are missing is reported as not run (None). ``any_build``: reuse a cached unit
    whichever build computed it, compute only the units not cached.
    ``dynamic_modes``: static (False) and/or dynamic k (True, NTK-family methods only), with the
    schedule's ratio ``dynamic_ratio`` (None: the library's 2). ``attn_factor``: a constant
    attention scale s on every row (:class:`Setting`; s != 1 with ``yarn`` raises
    :class:`GGUFRopeError`), not on the truncation rows. ``ruler_tasks``: RULER-lite
    tasks (:mod:`ggufrope.evaluation.ruler`), ``samples`` each. ``truncation``: for every
    context beyond L with retrieval (passkey or RULER-lite), the truncation baseline row
    ``truncate``: the same prompts cut to their last L tokens, method none at L."""
    for c in n_ctxs:
        check_score_from(c, score_from)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache = Cache(cache_dir if cache_dir is not None else out / "cache")
    L = n_ctx_orig_of(model)
    fp = model_fingerprint(model, cache.root)
    t_start = time.perf_counter()
    say = log or (lambda s: None)

    configs = grid_configs(n_ctxs, methods, logn_modes, dynamic_modes)
    if not configs:
        raise GGUFRopeError("nothing to run: dynamic k applies to the NTK family only (ntk, ntk-fixed, ntk-mixed)")
    dl = None if depths is None else list(depths)
    none = Setting("none")
    jobs: list[tuple[tuple, Callable[[], dict[str, Any] | None]]] = []
    for c, m, ln, dyn in configs:
        st = Setting.for_grid(m, factor, exponent, ln, dyn, dynamic_ratio, attn_factor)
        for t in texts:
            jobs.append(((m, ln, dyn, c, "ppl", t.name), lambda st=st, c=c, t=t: runner.ppl(
                st, c, t, score_from=score_from, max_windows=max_windows)))
        if trials > 0:
            jobs.append(((m, ln, dyn, c, "passkey", None), lambda st=st, c=c: runner.passkey(
                st, c, trials=trials, seed=seed, depths=dl, n_gen=n_gen)))
        for task in ruler_tasks:
            jobs.append(((m, ln, dyn, c, "ruler", task), lambda st=st, c=c, task=task: runner.ruler(
                st, c, task, samples=samples, seed=seed)))
    # the truncation baseline of every retrieval cell beyond L: the same prompts, their last L tokens
    if truncation:
        for c in n_ctxs:
            if c <= L:
                continue
            if trials > 0:
                jobs.append((("truncate", False, False, c, "passkey", None), lambda c=c: runner.passkey(
                    none, L, trials=trials, seed=seed, depths=dl, n_gen=n_gen, truncate_from=c)))
            for task in ruler_tasks:
                jobs.append((("truncate", False, False, c, "ruler", task), lambda c=c, task=task: runner.ruler(
                    none, L, task, samples=samples, seed=seed, truncate_from=c)))

    results: dict[tuple, dict[str, Any]] = {}
    runner = UnitRunner(model, cache, n_batch=n_batch, n_ubatch=n_ubatch, gpu_layers=gpu_layers, threads=threads,
                        verbose=verbose, progress=progress, report_only=report_only, any_build=any_build, log=say)
    with runner, unit_bar(len(jobs), "compare", disable=not progress, file=sys.stderr) as bar:
        for rk, job in jobs:
            bar.set_description(f"compare: {rk[0]}{' + log-n' if rk[1] else ''} @ {rk[3]} {rk[5] or rk[4]}")
            r = job()
            if r is not None:
                results[rk] = r
            advance(bar, runner.last_computed)
    stats, builds = runner.stats, runner.builds

    cells = []
    for c, m, ln, dyn in configs:
        st = Setting.for_grid(m, factor, exponent, ln, dyn, dynamic_ratio, attn_factor)
        got = {t.name: results.get((m, ln, dyn, c, "ppl", t.name)) for t in texts}
        docs = {n: d for n, d in got.items() if d is not None}
        # report_only and some text not run: its per-text cells stay, but no partial pooled value
        pooled = summarize_windows(w for d in docs.values() for w in d["windows"]) if docs and len(docs) == len(got) else None
        pk = results.get((m, ln, dyn, c, "passkey", None))
        cells.append({
            "n_ctx": c, "method": m, "logn": ln, **({"dynamic": True} if dyn else {}),
            "label": st.label(), "factor": st.resolved_factor(c, L),
            "exponent": st.exponent if m == "ntk-mixed" else None,
            "ppl": pooled and pooled["ppl"], "ppl_beyond": pooled and pooled["ppl_beyond"],
            "ppl_within": pooled and pooled["ppl_within"],
            "scored_tokens": pooled and pooled["count"], "scored_tokens_beyond": pooled and pooled["count_beyond"],
            "scored_tokens_within": pooled and pooled["count_within"],
            "ppl_by_text": {n: {"ppl": d["ppl"], "ppl_beyond": d["ppl_beyond"], "ppl_within": summarize_windows(d["windows"])["ppl_within"],
                                "windows": d["n_windows"]}
                            for n, d in docs.items()},
            "passkey_accuracy": pk and pk["accuracy"], "passkey_by_depth": pk and pk["by_depth"],
            "passkey_trials": pk and pk["trials"],
            **({"ruler": {t: _ruler_cell(results.get((m, ln, dyn, c, "ruler", t))) for t in ruler_tasks}}
               if ruler_tasks else {}),
        })
    for c in n_ctxs:  # the truncation baseline rows
        pk = results.get(("truncate", False, False, c, "passkey", None))
        rl = {t: _ruler_cell(results.get(("truncate", False, False, c, "ruler", t))) for t in ruler_tasks}
        if pk is not None or any(v is not None for v in rl.values()):
            cells.append({"n_ctx": c, "method": "truncate", "logn": False, "label": f"truncate to L = {L}",
                          "factor": None, "exponent": None, "ppl": None, "ppl_beyond": None, "ppl_within": None,
                          "scored_tokens": None, "scored_tokens_beyond": None, "scored_tokens_within": None,
                          "ppl_by_text": {}, "passkey_accuracy": pk and pk["accuracy"],
                          "passkey_by_depth": pk and pk["by_depth"], "passkey_trials": pk and pk["trials"],
                          "ruler": rl})
    res = {
        "eval_version": EVAL_VERSION,
        "command": command,
        "model": {**fp, "path": os.fspath(model), "n_ctx_orig": L},
        "grid": {"n_ctx": list(n_ctxs), "methods": list(methods), "logn": list(logn_modes),
                 "dynamic": list(dynamic_modes), "dynamic_ratio": dynamic_ratio, "factor": factor,
                 "exponent": exponent, **({"attn_factor": attn_factor} if attn_factor != 1.0 else {}),
                 "texts": [{"name": t.name, "sha256": t.sha256} for t in texts],
                 "max_windows": max_windows, "score_from": score_from, "trials": trials, "seed": seed,
                 "depths": None if depths is None else list(depths), "n_gen": n_gen,
                 "n_batch": n_batch, "gpu_layers": gpu_layers,
                 **({"ruler_tasks": list(ruler_tasks), "samples": samples} if ruler_tasks else {})},
        "cells": cells,
        "machine": machine_info(),  # of this run: with report_only, not the one that computed the units
        "report_only": report_only,
        "wall_s_this_run": time.perf_counter() - t_start,
        "wall_s_all_units": runner.wall_s,
        "units": {"computed": stats.computed, "cached": stats.cached, "missing": stats.missing, "stale": stats.stale},
        "builds": builds,  # the units of this report per build that computed them
    }
    atomic_json(out / "results.json", res)
    (out / "results.md").write_text(report_markdown(res), encoding="utf-8")
    plot(res, out / "ppl.png")
    return res, stats
