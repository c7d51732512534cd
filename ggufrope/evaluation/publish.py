"""``make results-v2-report``: rewrite the published grid reports of docs/results/v2 from the
committed units, computing nothing, and quote their tables in docs/results.md.

Each ``docs/results/v2/MODEL-NAME/results.json`` (``MODEL`` is a name of :mod:`ggufrope.models`)
records its grid; :func:`rerun` runs that grid again with ``report_only`` over the unit cache,
which rewrites ``results.json``, ``results.md`` and ``ppl.png`` in place (a ``results.json`` whose
cells and units did not change keeps its bytes, run fields included: no diff). docs/results.md quotes a
report's per-document perplexity table between ``<!-- grid-MODEL-NAME:start -->`` and
``<!-- grid-MODEL-NAME:end -->``, followed by the count of its windows that have a result, and
its retrieval table (grids with RULER-lite tasks) between ``<!-- grid-MODEL-NAME-retrieval:start
-->`` and ``...:end -->``; :func:`splice` replaces what is between the markers. A report without
markers in docs/results.md is only rewritten.

Usage: ``python -m ggufrope.evaluation.publish [--docs DIR] [--cache DIR]``; exit status 2 with a
one-line error when a report, a marker or a document does not match.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import click

from ..errors import GGUFRopeError
from . import grid as EG, ppl as EP, report as ER


def rerun(model: str | os.PathLike, pub: dict[str, Any], *, cache_dir: str | os.PathLike,
          out_dir: str | os.PathLike, progress: bool = False) -> tuple[dict[str, Any], Any]:
    """:func:`ggufrope.evaluation.grid.run_compare` with ``report_only`` and the grid (and command
    line) of the published ``results.json`` ``pub``, over the units in ``cache_dir``; writes the
    report to ``out_dir`` and returns (results, unit stats). Raises GGUFRopeError when one of the
    grid's documents is no longer the text it was scored on (sha256)."""
    g = pub["grid"]
    # a grid of retrieval only (--no-ppl) scored no document: resolve_texts([]) would mean the
    # whole corpus, and its windows would count as "not run"
    texts = EP.resolve_texts([t["name"] for t in g["texts"]]) if g["texts"] else []
    for t, want in zip(texts, g["texts"]):
        if t.sha256 != want["sha256"]:
            raise GGUFRopeError(f"text {t.name}: sha256 {t.sha256[:12]}… is not the report's {want['sha256'][:12]}…")
    return EG.run_compare(
        model, n_ctxs=g["n_ctx"], methods=g["methods"], logn_modes=g["logn"], dynamic_modes=g["dynamic"],
        dynamic_ratio=g.get("dynamic_ratio"), factor=g["factor"], exponent=g["exponent"],
        attn_factor=g.get("attn_factor", 1.0), texts=texts, max_windows=g["max_windows"],
        score_from=g["score_from"], trials=g["trials"], seed=g["seed"], depths=g["depths"], n_gen=g["n_gen"],
        ruler_tasks=g.get("ruler_tasks", ()), samples=g.get("samples", 10), n_batch=g.get("n_batch", 512),
        gpu_layers=g.get("gpu_layers", 0), out_dir=out_dir, cache_dir=cache_dir, report_only=True,
        progress=progress, command=pub.get("command"),
    )


def windows_line(res: dict[str, Any]) -> str:
    """The sentence under a quoted per-document table: how many of its windows have a result."""
    done, total = ER.ppl_windows(res)
    if done == total:
        return f"Committed units: all {total} windows of the table."
    return f"Committed units: {done} of the table's {total} windows; – marks the rest, not run yet."


def quoted_blocks(name: str, res: dict[str, Any]) -> dict[str, str]:
    """Marker tag -> text between the markers, for report ``name`` (its directory name)."""
    rows = lambda s: "\n".join(ln for ln in s.splitlines() if ln.startswith("|"))  # noqa: E731
    out = {}
    if res["grid"]["texts"]:  # a retrieval-only grid (--no-ppl) has no per-document table
        out[name] = rows(ER.ppl_by_text_table(res)) + "\n\n" + windows_line(res)
    if res["grid"].get("ruler_tasks"):
        out[f"{name}-retrieval"] = rows(ER.retrieval_table(res))
    return out


def splice(md: str, tag: str, body: str) -> str | None:
    """``md`` with the text between ``<!-- grid-TAG:start -->`` and ``<!-- grid-TAG:end -->``
    replaced by ``body`` (each marker on a line of its own); None when ``md`` has no such markers.
    Raises GGUFRopeError when only one of them is there, either is there twice, or they are out
    of order."""
    a, b = f"<!-- grid-{tag}:start -->\n", f"\n<!-- grid-{tag}:end -->"
    na, nb = md.count(a), md.count(b)
    if na == nb == 0:
        return None
    if na != 1 or nb != 1 or md.index(a) > md.index(b):
        raise GGUFRopeError(f"docs: the markers of grid-{tag} must be there once each, start before end "
                            f"(start ×{na}, end ×{nb})")
    i, j = md.index(a) + len(a), md.index(b)
    return md[:i] + body.strip("\n") + md[j:]


#: results.json fields that a report-only rerun rewrites even when no cell or unit changed.
RUN_FIELDS = ("machine", "wall_s_this_run")


def _same_report(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two results.json documents differ at most in :data:`RUN_FIELDS`."""
    strip = lambda d: {k: v for k, v in d.items() if k not in RUN_FIELDS}  # noqa: E731
    return strip(a) == strip(b)


def publish(docs: str | os.PathLike, cache_dir: str | os.PathLike, *, progress: bool = True) -> list[str]:
    """Rewrite every report under ``docs/results/v2`` (see the module docstring) and splice its
    tables into ``docs/results.md`` (written to a temporary file and renamed); returns one line
    per report for the terminal."""
    from .. import models

    docs = pathlib.Path(docs)
    md_path = docs / "results.md"
    reports = sorted((docs / "results" / "v2").glob("*/results.json"))
    if not reports:
        raise GGUFRopeError(f"no reports under {docs / 'results' / 'v2'}")
    try:
        md = md_path.read_text(encoding="utf-8")
    except OSError as e:
        raise GGUFRopeError(f"cannot read {md_path}: {e.strerror}") from None
    said = []
    for report in reports:
        name = report.parent.name
        before = report.read_text(encoding="utf-8")
        pub = json.loads(before)
        model = models.model_path(name.split("-", 1)[0])
        res, stats = rerun(model, pub, cache_dir=cache_dir, out_dir=report.parent, progress=progress)
        if _same_report(pub, json.loads(report.read_text(encoding="utf-8"))):
            with models.atomic_open(report, "w", encoding="utf-8") as f:  # no diff for a rerun that changed nothing
                f.write(before)
        quoted = []
        for tag, body in quoted_blocks(name, res).items():
            new = splice(md, tag, body)
            if new is not None:
                md = new
                quoted.append(f"grid-{tag}")
        said.append(f"{name}: {stats.cached} units cached, {stats.missing} not run; "
                    f"quoted in {md_path.name}: {', '.join(quoted) or 'nothing'}")
    with models.atomic_open(md_path, "w", encoding="utf-8") as f:
        f.write(md)
    return said


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--docs", default="docs", show_default=True, type=click.Path(file_okay=False),
              help="The directory of results.md and results/v2.")
@click.option("--cache", "cache_dir", default="docs/results/cache", show_default=True,
              type=click.Path(file_okay=False), help="The committed unit cache.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
def main(docs: str, cache_dir: str, quiet: bool) -> None:
    """Rewrite docs/results/v2/*/ from the cached units and quote their tables in results.md."""
    from ..cli import CliError

    try:
        for line in publish(docs, cache_dir, progress=not quiet):
            click.echo(line)
    except GGUFRopeError as e:
        raise CliError(str(e)) from None


if __name__ == "__main__":
    main()
