"""The evaluation's command line: the ``ggufrope eval`` group (``ppl``, ``passkey``, ``ruler``,
``compare``), ``ggufrope tune``, and the parsers of their flags.

The group adds itself to :data:`ggufrope.cli.main` when this module is imported; ggufrope/cli.py
imports it at its end, so ``ggufrope eval ...`` is there whichever module is imported first.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import click

from ..cli import _CONTEXT, _DEVICE_OPTIONS, _Group, main
from ..errors import GGUFRopeError

# --- the CLI parses flags -------------------------------------------------------------------------


def parse_methods(spec: str) -> list[str]:
    from ..methods import canonical
    from .grid import ALL_METHODS

    if spec.strip().lower() == "all":
        return list(ALL_METHODS)
    out = []
    for s in spec.split(","):
        if s.strip():
            try:
                m = canonical(s)
            except ValueError as e:
                raise GGUFRopeError(str(e)) from None
            if m not in out:
                out.append(m)
    if not out:
        raise GGUFRopeError("no method given")
    return out


def parse_ints(spec: str, what: str = "--n-ctx") -> list[int]:
    try:
        out = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise GGUFRopeError(f"{what}: expected comma-separated integers, got {spec!r}") from None
    if not out or min(out) < 16:
        raise GGUFRopeError(f"{what}: expected integers >= 16, got {spec!r}")
    return out


def parse_depths(spec: str) -> list[float] | None:
    if spec.strip().lower() == "random":
        return None
    try:
        out = [float(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise GGUFRopeError(f"--depths: expected 'random' or comma-separated numbers in [0, 1], got {spec!r}") from None
    if not out or any(not 0.0 <= d <= 1.0 for d in out):
        raise GGUFRopeError(f"--depths: expected numbers in [0, 1], got {spec!r}")
    return out


def parse_logn(spec: str, what: str = "--logn") -> list[bool]:
    """off, on or both (also of ``--dynamic``: ``what`` names the option)."""
    s = spec.strip().lower()
    table = {"both": [False, True], "off": [False], "on": [True]}
    if s not in table:
        raise GGUFRopeError(f"{what}: expected off, on or both, got {spec!r}")
    return table[s]


def _contexts(model: str, n_ctxs: str | None) -> tuple[int, list[int]]:
    """(L, the contexts of ``-c N[,N...]``; default [2 x L])."""
    from .decoder import n_ctx_orig_of

    L = n_ctx_orig_of(model)
    return L, (parse_ints(n_ctxs) if n_ctxs else [2 * L])


def _each_context(model: str, st: Any, ctxs: list[int], engine: dict[str, Any], *, cap: int | None = None,
                  say: bool = True) -> Iterator[tuple[int, Any, Any]]:
    """(n_ctx, llm, decoder) for each context in turn: the model loaded with the setting at
    min(n_ctx, ``cap``), its rope line said, closed (model and KV cache freed) before the next
    context is loaded. ``engine``: :func:`~ggufrope.evaluation.decoder.load_model`'s keyword
    arguments."""
    from .decoder import Decoder, load_model

    for c in ctxs:
        llm = load_model(model, st, c if cap is None else min(c, cap), **engine)
        try:
            if say:
                _say_rope(llm)
            with Decoder(llm) as dec:
                yield c, llm, dec
        finally:
            llm.close()


# --- the commands ---------------------------------------------------------------------------------


@main.group("eval", cls=_Group, context_settings=_CONTEXT)
def eval_group() -> None:
    """Evaluate methods beyond the trained context L: perplexity on long documents, passkey
    retrieval, and the side-by-side grid (see the package ggufrope/evaluation for the protocols).

    \b
    ggufrope eval ppl MODEL --n-ctx 16384 -m ntk-mixed --logn --text hamlet
    ggufrope eval passkey MODEL --n-ctx 2048,16384 -m yarn --trials 20
    ggufrope eval compare MODEL --n-ctx 16384,32768 --methods all --logn both --out results/

    Methods are applied at load time (kv overrides, llama.cpp's own parameters for linear
    and yarn); MODEL is never rewritten.
    """


def _eval_method_options(f: Any) -> Any:
    opts = [
        click.option("-m", "--method", default="none", show_default=True, metavar="METHOD",
                     help="none, linear, yarn, ntk, ntk-fixed, ntk-mixed (alias mixed)."),
        click.option("-k", "--factor", type=float, default=None, metavar="K",
                     help="Factor k >= 1. Left out: max(1, n_ctx / L), passed to every method alike."),
        click.option("--b", "--exponent", "exponent", type=float, default=None, metavar="B",
                     help="Exponent b of ntk-mixed, 0 < b <= 1.  [default: 0.625]"),
        click.option("--logn/--no-logn", default=False, show_default=True, help="log-n query scaling beyond L."),
        click.option("--dynamic/--static", "dynamic", default=False, show_default=True,
                     help="Dynamic k (NTK family, without -k): no k is passed; llama.cpp keeps k = 1 within L, then "
                     "the smallest power of 2 with k*L >= n as the window fills, re-rotating the cached keys. "
                     "--static: one k per context, passed explicitly."),
        click.option("--attn-factor", "attn_factor", type=float, default=1.0, show_default=True, metavar="S",
                     help="Constant attention scale s > 0 (llama.cpp's yarn_attn_factor: cos/sin of Q and K times s, "
                     "logits times s^2), on top of --logn or instead of it; what `ggufrope tune` searches."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _eval_engine_options(f: Any) -> Any:
    opts = [
        click.option("--batch-size", "n_batch", type=click.IntRange(min=1), default=512, show_default=True,
                     help="Tokens per llama_decode call (n_batch; n_ubatch is the same unless --ubatch)."),
        click.option("--ubatch", "n_ubatch", type=click.IntRange(min=1), default=None, help="n_ubatch."),
    ] + _DEVICE_OPTIONS
    for o in reversed(opts):
        f = o(f)
    return f


def _model_and_contexts(what: str) -> Callable[[Any], Any]:
    """The MODEL argument and ``-c N[,N...]`` (default 2 x L) of a retrieval command; ``what``:
    how its prompt fills each context."""

    def deco(f: Any) -> Any:
        f = click.option("-c", "--n-ctx", "n_ctxs", default=None, metavar="N[,N...]",
                         help=f"Context lengths ({what}).  [default: 2 x L]")(f)
        return click.argument("model", metavar="MODEL")(f)

    return deco


def _say_rope(llm: Any) -> None:
    from ..runtime import describe

    click.echo(f"[ggufrope] {describe(llm)}", err=True)


def _fmt_ppl(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


@eval_group.command("ppl", context_settings=_CONTEXT)
@click.argument("model", metavar="MODEL")
@click.option("-c", "--n-ctx", type=click.IntRange(min=16), default=None,
              help="Window size n_ctx in tokens.  [default: 2 x L]")
@_eval_method_options
@click.option("--text", "texts", multiple=True, metavar="NAME_OR_FILE",
              help="A UTF-8 file or a corpus document (repeatable). Default: every long corpus document.")
@click.option("--max-windows", type=click.IntRange(min=1), default=None, help="At most this many windows per text.")
@click.option("--score-from", type=click.IntRange(min=0), default=None,
              help="First scored position of each window.  [default: n_ctx/2, as llama-perplexity]")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_eval_engine_options
def eval_ppl_cmd(model: str, n_ctx: int | None, method: str, factor: float | None, exponent: float | None, logn: bool,
                 dynamic: bool, attn_factor: float, texts: tuple[str, ...], max_windows: int | None,
                 score_from: int | None, as_json: bool, n_batch: int, n_ubatch: int | None, gpu_layers: int, threads: int | None, verbose: bool) -> None:
    """Perplexity of MODEL on long documents, over all scored tokens and beyond L.

    Each window of n_ctx tokens is evaluated from an empty context in one pass (first token
    BOS when the vocabulary adds one), and the tokens from --score-from on are scored
    (llama-perplexity's protocol). "beyond L" counts the tokens predicted from positions >= L.
    """
    from .decoder import Decoder, Setting, load_model, n_ctx_orig_of
    from .ppl import check_score_from, perplexity, resolve_texts, summarize_windows

    L = n_ctx_orig_of(model)
    n_ctx = n_ctx or 2 * L
    check_score_from(n_ctx, score_from)
    st = Setting(method, factor, exponent, logn, dynamic, attn_factor=attn_factor)
    txts = resolve_texts(texts)
    llm = load_model(model, st, n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, gpu_layers=gpu_layers,
                       threads=threads, verbose=verbose)
    _say_rope(llm)
    out: dict[str, Any] = {"model": model, "n_ctx": n_ctx, "n_ctx_orig": L, "method": st.label(n_ctx, L),
                           "score_from": n_ctx // 2 if score_from is None else score_from, "texts": {}}
    allw = []
    with Decoder(llm) as dec:
        for t in txts:
            ws = perplexity(dec, dec.tokenize(t.text), n_ctx, L, score_from=score_from, max_windows=max_windows,
                              progress=not as_json, desc=t.name)
            allw += ws
            s = summarize_windows(ws)
            out["texts"][t.name] = s
            if not as_json:
                click.echo(f"{t.name:16s} windows {s['n_windows']:3d}  ppl {_fmt_ppl(s['ppl'])} "
                           f"({s['count']} tokens)  beyond L: {_fmt_ppl(s['ppl_beyond'])} ({s['count_beyond']} tokens)")
    out["all"] = summarize_windows(allw)
    if st.dynamic:  # the k the last window reached, read back from the context
        from ..runtime import factor_in_use

        out["factor_end"] = factor_in_use(llm)
        if not as_json:
            _say_rope(llm)
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        s = out["all"]
        click.echo(f"{st.label(n_ctx, L)} @ n_ctx {n_ctx} (L = {L}): ppl {_fmt_ppl(s['ppl'])} over {s['count']} tokens; "
                   f"beyond L {_fmt_ppl(s['ppl_beyond'])} over {s['count_beyond']} tokens")


@eval_group.command("passkey", context_settings=_CONTEXT)
@_model_and_contexts("the prompt fills n_ctx less --n-gen tokens")
@_eval_method_options
@click.option("--trials", type=click.IntRange(min=1), default=10, show_default=True, help="Trials per context.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the keys and depths.")
@click.option("--depths", default="0,0.25,0.5,0.75,1", show_default=True,
              help="Depths of the key line, cycled over the trials, or 'random' (uniform, reported by nearest quarter).")
@click.option("--n-gen", type=click.IntRange(min=6), default=10, show_default=True, help="Tokens decoded greedily.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@_eval_engine_options
def eval_passkey_cmd(model: str, n_ctxs: str | None, method: str, factor: float | None, exponent: float | None,
                     logn: bool, dynamic: bool, attn_factor: float,
                     trials: int, seed: int, depths: str, n_gen: int, as_json: bool, n_batch: int,
                     n_ubatch: int | None, gpu_layers: int, threads: int | None, verbose: bool) -> None:
    """Passkey retrieval (Mohtashami & Jaggi 2023, as in the PI and YaRN papers): accuracy by
    context length and depth of the key. A random 5-digit key per trial; greedy answer."""
    from .decoder import Setting
    from .passkey import passkey

    ds = parse_depths(depths)
    st = Setting(method, factor, exponent, logn, dynamic, attn_factor=attn_factor)
    L, ctxs = _contexts(model, n_ctxs)
    out: dict[str, Any] = {"model": model, "n_ctx_orig": L, "method": st.label(), "seed": seed, "results": {}}
    for c, llm, dec in _each_context(model, st, ctxs, dict(n_batch=n_batch, n_ubatch=n_ubatch, gpu_layers=gpu_layers,
                                                            threads=threads, verbose=verbose)):
        r = passkey(dec, c, trials=trials, seed=seed, depths=ds, n_gen=n_gen, progress=not as_json,
                    desc=f"passkey {c}")
        if st.dynamic:  # the k the last trial reached
            from ..runtime import factor_in_use

            r["factor_end"] = factor_in_use(llm)
        out["results"][str(c)] = r
        if not as_json:
            by = "  ".join(f"d={d}: {100 * v['accuracy']:.0f}% ({v['trials']})" for d, v in r["by_depth"].items())
            click.echo(f"{st.label(c, L)} @ {c}: {r['correct']}/{r['trials']} = {100 * r['accuracy']:.0f}%   {by}")
    if as_json:
        click.echo(json.dumps(out, indent=2))


@eval_group.command("compare", context_settings=_CONTEXT)
@click.argument("model", metavar="MODEL")
@click.option("-c", "--n-ctx", "n_ctxs", default="16384,32768", show_default=True, metavar="N[,N...]",
              help="Contexts (columns of the table).")
@click.option("--methods", default="all", show_default=True,
              help="Comma-separated methods, or all (none, linear, yarn, ntk, ntk-fixed, ntk-mixed).")
@click.option("--logn", "logn_spec", default="both", show_default=True, help="off, on or both.")
@click.option("--dynamic", "dynamic_spec", default="off", show_default=True,
              help="Dynamic k: off, on or both (on: the NTK-family methods only, no k passed; rows labelled dyn).")
@click.option("-k", "--factor", type=float, default=None, metavar="K",
              help="Factor k of the static rows. Left out: max(1, n_ctx / L).")
@click.option("--dynamic-ratio", type=float, default=None, metavar="R",
              help="Ratio r > 1 of the dynamic rows' schedule (k = r^e). Left out: 2.")
@click.option("--b", "--exponent", "exponent", type=float, default=0.625, show_default=True, metavar="B",
              help="Exponent b of ntk-mixed.")
@click.option("--attn-factor", "attn_factor", type=float, default=1.0, show_default=True, metavar="S",
              help="Constant attention scale s > 0 on every row (llama.cpp's yarn_attn_factor: logits times s^2), "
                   "as `ggufrope tune` searches it; not with yarn, which scales attention itself.")
@click.option("--text", "texts", multiple=True, metavar="NAME_OR_FILE",
              help="Perplexity texts (repeatable). Default: every long corpus document.")
@click.option("--no-ppl", is_flag=True, help="Skip perplexity: retrieval only (passkey and --tasks).")
@click.option("--max-windows", type=click.IntRange(min=1), default=1, show_default=True,
              help="Windows per text and context.")
@click.option("--score-from", type=click.IntRange(min=0), default=None, help="[default: n_ctx/2]")
@click.option("--trials", type=click.IntRange(min=0), default=10, show_default=True,
              help="Passkey trials per cell (0: no passkey).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--depths", default="0,0.25,0.5,0.75,1", show_default=True, help="Passkey depths, or 'random'.")
@click.option("--tasks", "tasks_spec", default=None, metavar="T[,T...]",
              help="RULER-lite tasks per cell (niah_single, niah_multikey, niah_multikey_uuid, vt, cwe, fwe, or all).")
@click.option("--samples", type=click.IntRange(min=1), default=10, show_default=True,
              help="Samples per RULER-lite task and cell.")
@click.option("--truncation/--no-truncation", default=True, show_default=True,
              help="Beyond L, the truncation baseline row: the same retrieval prompts cut to their last L tokens, "
                   "method none at L.")
@click.option("-o", "--out", "out_dir", default="eval-results", show_default=True, metavar="DIR",
              help="Where results.json, results.md and ppl.png go.")
@click.option("--cache", "cache_dir", default=None, metavar="DIR", help="Result cache.  [default: DIR/cache]")
@click.option("--report-only", is_flag=True,
              help="Compute nothing: write the report from the cached units; cells not cached show as not run.")
@click.option("--any-build", is_flag=True,
              help="Reuse cached units whichever library build computed them (units of a lent GPU, a rebuild) instead of "
                   "recomputing them; compute only the units not cached, and resume a retrieval unit from another build's "
                   "partial file (each sample records its build). results.md counts the units per build.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@_eval_engine_options
def eval_compare_cmd(model: str, n_ctxs: str, methods: str, logn_spec: str, dynamic_spec: str, factor: float | None,
                     dynamic_ratio: float | None, exponent: float, attn_factor: float,
                     texts: tuple[str, ...], no_ppl: bool, max_windows: int, score_from: int | None, trials: int,
                     seed: int, depths: str, tasks_spec: str | None, samples: int, truncation: bool, out_dir: str,
                     cache_dir: str | None, report_only: bool, any_build: bool, quiet: bool, n_batch: int,
                     n_ubatch: int | None, gpu_layers: int, threads: int | None, verbose: bool) -> None:
    """Run the grid contexts x methods x dynamic k x log-n, resumably, and write the report.

    Every unit (model sha256, method, k, b, dynamic k, log-n, n_ctx, text or passkey trial set) is cached
    as one JSON file, so an interrupted run resumes where it stopped and a finished one only
    rewrites the report. A unit cached by another library build (llama.cpp libraries, patch,
    backend, flash attention, n_ubatch) is stale and recomputed; --report-only reads it, and --any-build
    uses it and computes only what is not cached. Writes DIR/results.json, DIR/results.md (rows: methods without and
    with log-n; columns: contexts; cells: perplexity beyond L / passkey accuracy) and DIR/ppl.png.
    """
    import shlex

    from .. import methods as M
    from .decoder import Setting
    from .grid import grid_configs, run_compare
    from .ppl import resolve_texts
    from .report import report_markdown

    ctxs = parse_ints(n_ctxs)
    ms = parse_methods(methods)
    lns = parse_logn(logn_spec)
    dyns = parse_logn(dynamic_spec, "--dynamic")
    ds = parse_depths(depths)
    for m in ms:  # the registry's checks of k and b, before anything runs
        Setting.for_grid(m, factor, exponent, False, attn_factor=attn_factor)
        if dynamic_ratio is not None and True in dyns and M.entry(m).supports_dynamic:
            Setting.for_grid(m, None, exponent, False, True, dynamic_ratio)
    if not grid_configs(ctxs, ms, lns, dyns):
        raise GGUFRopeError("nothing to run: --dynamic on applies to the NTK family only (ntk, ntk-fixed, ntk-mixed)")
    txts = [] if no_ppl else resolve_texts(texts)
    from .ruler import parse_tasks

    tasks = parse_tasks(tasks_spec) if tasks_spec else []
    if not txts and trials == 0 and not tasks:
        raise GGUFRopeError("nothing to run: --no-ppl with --trials 0 and no --tasks")
    argv = ["ggufrope", "eval", "compare", model, "--n-ctx", ",".join(map(str, ctxs)), "--methods", ",".join(ms),
            "--logn", logn_spec]
    if dyns != [False]:
        argv += ["--dynamic", dynamic_spec]
    if factor is not None:
        argv += ["-k", f"{factor:g}"]
    if dynamic_ratio is not None:
        argv += ["--dynamic-ratio", f"{dynamic_ratio:.9g}"]
    argv += ["--b", f"{exponent:g}"]
    if attn_factor != 1.0:
        argv += ["--attn-factor", f"{attn_factor:g}"]
    if no_ppl:
        argv += ["--no-ppl"]
    else:
        for t in texts:
            argv += ["--text", t]
        argv += ["--max-windows", str(max_windows)]
        if score_from is not None:
            argv += ["--score-from", str(score_from)]
    argv += ["--trials", str(trials), "--seed", str(seed), "--depths", depths]
    if tasks:
        argv += ["--tasks", ",".join(tasks), "--samples", str(samples)]
    if not truncation:
        argv += ["--no-truncation"]
    argv += ["--out", out_dir]
    if cache_dir is not None:
        argv += ["--cache", cache_dir]
    if report_only:
        argv += ["--report-only"]
    if any_build:
        argv += ["--any-build"]
    res, stats = run_compare(
        model, n_ctxs=ctxs, methods=ms, logn_modes=lns, dynamic_modes=dyns, dynamic_ratio=dynamic_ratio, factor=factor,
        exponent=exponent, attn_factor=attn_factor, texts=txts,
        max_windows=max_windows, score_from=score_from, trials=trials, seed=seed, depths=ds, ruler_tasks=tasks,
        samples=samples, truncation=truncation, out_dir=out_dir,
        cache_dir=cache_dir, n_batch=n_batch, n_ubatch=n_ubatch, gpu_layers=gpu_layers, threads=threads,
        report_only=report_only, any_build=any_build, progress=not quiet, verbose=verbose, command=shlex.join(argv),
    )
    click.echo(report_markdown(res))
    stale = f" ({stats.stale} of them stale: cached by another build)" if stats.stale else ""
    click.echo(f"units: {stats.computed} computed{stale}, {stats.cached} from the cache, {stats.missing} not run; "
               f"wrote {os.path.join(out_dir, 'results.json')}, results.md, ppl.png")


@eval_group.command("ruler", context_settings=_CONTEXT)
@_model_and_contexts("each prompt fills n_ctx less the task's answer tokens")
@_eval_method_options
@click.option("--tasks", "tasks_spec", default="niah_single,vt", show_default=True, metavar="T[,T...]",
              help="niah_single, niah_multikey, niah_multikey_uuid, vt, cwe, fwe, or all.")
@click.option("--samples", type=click.IntRange(min=1), default=10, show_default=True, help="Samples per task.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the samples.")
@click.option("--truncate", "truncate", is_flag=True,
              help="The truncation baseline instead: the same prompts cut to their last L tokens, answered by the "
                   "model at n_ctx = L without a method (-m must be none).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON (every sample's answer).")
@_eval_engine_options
def eval_ruler_cmd(model: str, n_ctxs: str | None, method: str, factor: float | None, exponent: float | None,
                   logn: bool, dynamic: bool, attn_factor: float, tasks_spec: str, samples: int, seed: int,
                   truncate: bool, as_json: bool, n_batch: int, n_ubatch: int | None, gpu_layers: int, threads: int | None, verbose: bool) -> None:
    """RULER-lite (Hsieh et al. 2024): the synthetic retrieval and aggregation tasks of RULER
    that need no download, in the model's chat template, greedy, scored as RULER does
    (string_match_all, percent), with the shuffled control (answers graded against another
    sample's gold). Deterministic in --seed."""
    from .decoder import Setting
    from .ruler import parse_tasks, run_task

    tasks = parse_tasks(tasks_spec)
    st = Setting(method, factor, exponent, logn, dynamic, attn_factor=attn_factor)
    if truncate and (st.method != "none" or st.logn or st.attn_factor != 1.0):
        raise GGUFRopeError("--truncate is the baseline without a method: leave -m/--logn/--attn-factor out")
    L, ctxs = _contexts(model, n_ctxs)
    out: dict[str, Any] = {"model": model, "n_ctx_orig": L, "method": "truncate" if truncate else st.label(),
                           "seed": seed, "results": {}}
    engine = dict(n_batch=n_batch, n_ubatch=n_ubatch, gpu_layers=gpu_layers, threads=threads, verbose=verbose)
    for c, _llm, dec in _each_context(model, st, ctxs, engine, cap=L if truncate else None, say=not as_json):
        for t in tasks:
            r = run_task(dec, t, c, samples=samples, seed=seed, keep_last=L if truncate and c > L else None,
                         progress=not as_json, desc=f"{t} {c}")
            out["results"].setdefault(str(c), {})[t] = r
            if not as_json:
                what = f"truncated to the last {L}" if truncate and c > L else st.label(c, L)
                click.echo(f"{what} @ {c} {t}: {r['score']:.1f} %  (shuffled control {r['control']:.1f} %, "
                           f"{r['samples']} samples)")
    if as_json:
        click.echo(json.dumps(out, indent=2))


@main.command("tune", context_settings=_CONTEXT)
@click.argument("model", metavar="MODEL")
@click.option("-c", "--n-ctx", "n_ctx", type=click.IntRange(min=16), required=True,
              help="The context to tune for (> L).")
@click.option("--text", "texts", multiple=True, metavar="NAME_OR_FILE",
              help="Calibration text (repeatable): a UTF-8 file of at least n_ctx tokens, or a bundled document. "
                   "[default: loc_workshop]")
@click.option("--held-out", "held", multiple=True, metavar="NAME_OR_FILE",
              help="Text for the held-out check, not used by the search.  [default: docutils_manual, or "
                   "paradise_lost when that is calibration text]")
@click.option("--retrieval", is_flag=True,
              help="Also run RULER-lite niah_single at n_ctx on the three best by perplexity, the seed default and "
                   "NTK-aware at twice n_ctx/L (the best score wins), and on stock YaRN for comparison.")
@click.option("--samples", type=click.IntRange(min=1), default=5, show_default=True,
              help="niah_single samples per setting with --retrieval.")
@click.option("--quick", is_flag=True, help="Coarse search only (b, log-n, one attention factor): 8 settings.")
@click.option("--score-from", type=click.IntRange(min=0), default=None,
              help="First scored position of each window.  [default: L/2, so within-L tokens are scored too]")
@click.option("-w", "--write", "write_out", default=None, metavar="OUT",
              help="Apply the chosen setting to a copy of MODEL with `ggufrope set` (atomic; MODEL untouched).")
@click.option("-o", "--out", "out_dir", default="tune-results", show_default=True, metavar="DIR",
              help="Where tune.json and tune.md go.")
@click.option("--cache", "cache_dir", default=None, metavar="DIR",
              help="Unit cache (shared with eval compare).  [default: <ggufrope cache>/units]")
@click.option("--report-only", is_flag=True,
              help="Compute nothing: redo the search and the report from the cached units, whichever build computed "
                   "them (an error names the first unit not cached).")
@click.option("--any-build", is_flag=True,
              help="Reuse cached units whichever library build computed them (a rebuild of the same patches, another "
                   "CPU) instead of recomputing them, and resume a retrieval unit from another build's partial file (each "
                   "sample records its build); tune.md counts the units per build.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@_eval_engine_options
def tune_cmd(model: str, n_ctx: int, texts: tuple[str, ...], held: tuple[str, ...], retrieval: bool, samples: int,
             quick: bool, score_from: int | None, write_out: str | None, out_dir: str, cache_dir: str | None,
             report_only: bool, any_build: bool, quiet: bool, n_batch: int, n_ubatch: int | None, gpu_layers: int,
             threads: int | None, verbose: bool) -> None:
    """Search method x b x log-n x attention factor x k x dynamic k for MODEL at n_ctx on
    calibration text, ranked by perplexity beyond L, with stock llama.cpp's YaRN and linear as
    references; then score the chosen setting, the seed default (ntk-mixed b=0.625 + log-n)
    and YaRN on held-out text. Resumable: every window is a cached unit.

    \b
    ggufrope tune model.gguf -c 16384
    ggufrope tune model.gguf -c 32768 --text my-notes.txt --retrieval -w model-tuned.gguf
    """
    from . import tune as T
    from .cache import Cache, atomic_json
    from .ppl import resolve_texts, summarize_windows
    from .units import UnitRunner, advance, unit_bar

    from ..models import cache_root
    from tqdm import tqdm

    cal = resolve_texts(list(texts) or ["loc_workshop"])
    names = {t.name for t in cal}
    hold = resolve_texts(list(held) or (["paradise_lost"] if "docutils_manual" in names else ["docutils_manual"]))
    if names & {t.name for t in hold}:
        raise GGUFRopeError(f"--held-out {', '.join(sorted(names & {t.name for t in hold}))} is also calibration text")
    cache = Cache(cache_dir or cache_root() / "units")
    with UnitRunner(model, cache, n_batch=n_batch, n_ubatch=n_ubatch, gpu_layers=gpu_layers, threads=threads,
                    verbose=verbose, progress=not quiet, report_only=report_only, any_build=any_build) as runner:
        L = runner.L
        if n_ctx <= L:
            raise GGUFRopeError(f"--n-ctx {n_ctx} is within the trained context L = {L}: nothing to tune")
        # every text must fill a window: checked before hours of search, not at the held-out check
        from ..generate import count_tokens

        for flag, txts in (("--text", cal), ("--held-out", hold)):
            for t in txts:
                if (n := count_tokens(model, t.text, verbose=verbose)) < n_ctx:
                    raise GGUFRopeError(f"{flag} {t.name}: {n} tokens, fewer than one window of n_ctx {n_ctx}; "
                                        "give a longer text")
        sf = L // 2 if score_from is None else score_from
        n_eval = T.max_settings(quick) * len(cal) + 3 * len(hold) + (5 * samples if retrieval else 0)
        bar = unit_bar(n_eval, "tune", disable=quiet)

        def pooled(st: T.Setting, txts: list) -> dict:
            ws = []
            for t in txts:
                bar.set_description(f"tune: {st.label(n_ctx, L)} {t.name}")
                r = runner.ppl(st, n_ctx, t, score_from=sf, max_windows=1)
                if r is None:
                    raise GGUFRopeError(f"--report-only: {st.label(n_ctx, L)} @ {n_ctx} {t.name} is not cached in {cache.root}")
                advance(bar, runner.last_computed)
                ws += r["windows"]
            s = summarize_windows(ws)
            if s["ppl_beyond"] is None:
                raise GGUFRopeError(f"no token beyond L = {L} is scored (--score-from {sf}, n_ctx {n_ctx})")
            return s

        within: dict = {}

        def objective(st: T.Setting) -> float:
            s = pooled(st, cal)
            within[st] = s["ppl_within"]
            return s["ppl_beyond"]

        search = T.Search(objective, n_ctx / L, quick=quick, log=(lambda s: tqdm.write(s)) if not quiet else None)
        chosen = search.run()
        for t in search.trials:
            t.extra["ppl_within"] = within.get(t.setting)
        if retrieval:
            def niah(st: T.Setting) -> float:
                r = runner.ruler(st, n_ctx, "niah_single", samples=samples, seed=0)
                if r is None:
                    raise GGUFRopeError(f"--report-only: {st.label(n_ctx, L)} @ {n_ctx} niah_single is not cached")
                advance(bar, runner.last_computed, samples)
                return r["score"]

            chosen = T.choose_with_retrieval(search.trials, niah)
        checks = [("chosen", chosen.setting), ("seed default", T.seed_default()), ("yarn", T.candidate("yarn"))]
        rival = T.stock_rival(search.trials, chosen)
        if rival is not None and rival.setting.method != "yarn":
            checks.append((f"{rival.setting.method} (stock)", rival.setting))
        bar.total = bar.n + len(checks) * len(hold)
        held_out = {name: pooled(st, hold) for name, st in checks}
        bar.close()
    md = T.markdown(search.trials, chosen, n_ctx=n_ctx, L=L, texts=[t.name for t in cal], held_out=held_out,
                    held_texts=[t.name for t in hold], label=lambda st: st.label(n_ctx, L),
                    samples=samples if retrieval else None, builds=runner.builds)
    os.makedirs(out_dir, exist_ok=True)
    atomic_json(__import__("pathlib").Path(out_dir) / "tune.json", {
        "model": model, "n_ctx": n_ctx, "n_ctx_orig": L, "texts": [t.name for t in cal],
        "held_out_texts": [t.name for t in hold], "score_from": sf, "quick": quick,
        "any_build": any_build, "retrieval_samples": samples if retrieval else None,
        "trials": [{"label": t.setting.label(n_ctx, L), "stage": t.stage, "role": t.role, "ppl_beyond": t.score,
                    **t.extra, "setting": T.setting_dict(t.setting)} for t in search.ranked()],
        "chosen": T.setting_dict(chosen.setting), "held_out": held_out,
        "units": {"computed": runner.stats.computed, "cached": runner.stats.cached, "stale": runner.stats.stale},
        "builds": runner.builds, "wall_s_units": runner.wall_s,
    })
    with open(os.path.join(out_dir, "tune.md"), "w", encoding="utf-8") as f:
        f.write(md)
    click.echo(md)
    click.echo(f"chosen: {chosen.setting.label(n_ctx, L)}; units: {runner.stats.computed} computed, "
               f"{runner.stats.cached} from the cache; wrote {os.path.join(out_dir, 'tune.json')}, tune.md")
    if write_out:
        res = T.write(model, write_out, chosen.setting, n_ctx)
        click.echo(f"wrote {write_out}: {res}")
