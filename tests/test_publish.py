"""`make results-v2-report` (ggufrope.evaluation.publish): the marker splice, the window count under
a quoted table, and one real run over a copy of a published report (the real model and cache).

That every published v2 report and its blocks in docs/results.md are what publish writes is
test_eval_grid.py::test_published_v2_reports_are_the_cached_units."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import copy_committed_cache

from ggufrope.errors import GGUFRopeError
from ggufrope.evaluation import publish, report as ER

ROOT = Path(__file__).resolve().parents[1]


def _res(by_text_per_cell):
    """A results dict of two rows (none, yarn) at one context over documents a and b, plus a
    truncation row (retrieval only, never a window); ``by_text_per_cell``: method -> ppl_by_text."""
    cells = [{"method": m, "logn": False, "n_ctx": 16, "label": m, "ppl_by_text": d}
             for m, d in by_text_per_cell.items()]
    cells.append({"method": "truncate", "logn": False, "n_ctx": 16, "label": "truncate to L = 8", "ppl_by_text": {}})
    return {"grid": {"methods": ["none", "yarn"], "logn": [False], "n_ctx": [16], "exponent": 0.625,
                     "texts": [{"name": "a"}, {"name": "b"}], "score_from": 4},
            "model": {"n_ctx_orig": 8}, "cells": cells}


W = {"ppl_beyond": 12.3456, "ppl_within": 7.0, "windows": 1}


def test_windows_counted_and_said():
    three = _res({"none": {"a": W, "b": W}, "yarn": {"b": W}})
    assert ER.ppl_windows(three) == (3, 4)  # 2 rows x 2 documents; the truncation row is no window
    assert publish.windows_line(three) == (
        "Committed units: 3 of the table's 4 windows; – marks the rest, not run yet.")
    full = _res({"none": {"a": W, "b": W}, "yarn": {"a": W, "b": W}})
    assert publish.windows_line(full) == "Committed units: all 4 windows of the table."


def test_quoted_block_is_the_table_rows_and_the_count():
    res = _res({"none": {"a": W, "b": W}, "yarn": {"b": W}})
    (body,) = publish.quoted_blocks("m-2x", res).values()
    assert body.splitlines() == [
        "| method | a @ 16 (2×L) | b @ 16 (2×L) |",
        "|---|---:|---:|",
        "| Baseline | 12.346 / 7.000 | 12.346 / 7.000 |",
        "| YaRN | – | 12.346 / 7.000 |",
        "",
        "Committed units: 3 of the table's 4 windows; – marks the rest, not run yet.",
    ]


def test_splice():
    md = "intro\n<!-- grid-x:start -->\nold\nlines\n<!-- grid-x:end -->\nafter <!-- grid-xy:start -->\n"
    assert publish.splice(md, "x", "new\n") == "intro\n<!-- grid-x:start -->\nnew\n<!-- grid-x:end -->\nafter <!-- grid-xy:start -->\n"
    assert publish.splice(md, "absent", "new") is None
    for bad in ("<!-- grid-x:start -->\nold\n",  # no end
                "<!-- grid-x:start -->\n<!-- grid-x:start -->\nold\n<!-- grid-x:end -->",  # start twice
                "a\n<!-- grid-x:end -->\n<!-- grid-x:start -->\n"):  # out of order
        with pytest.raises(GGUFRopeError, match="grid-x"):
            publish.splice(bad, "x", "new")


def _copy_report(name, tmp_path):
    """docs/results/v2/NAME under tmp_path/docs and the committed unit cache as tmp_path/cache;
    returns the docs directory (its results.md is the test's to write)."""
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs" / "results" / "v2" / name, docs / "results" / "v2" / name)
    copy_committed_cache(tmp_path / "cache")
    return docs


def test_publish_rewrites_a_report_and_its_block(smollm2, tmp_path):
    """The real thing on a copy: the 2xL tuned report (3 committed units) under a docs directory
    whose results.md block is stale; publish restores the committed block and report, and leaves
    the rest of results.md as it was."""
    name = "smollm2-2x-tuned"
    docs = _copy_report(name, tmp_path)
    committed = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    block = committed.split(f"<!-- grid-{name}:start -->\n", 1)[1].split(f"\n<!-- grid-{name}:end -->", 1)[0]
    (docs / "results.md").write_text(f"# head\n\n<!-- grid-{name}:start -->\nstale\n<!-- grid-{name}:end -->\n\ntail\n",
                                     encoding="utf-8")
    rj = docs / "results" / "v2" / name / "results.json"
    pub = json.loads(rj.read_text(encoding="utf-8"))
    rj.write_text(json.dumps({**pub, "cells": []}), encoding="utf-8")  # a stale report is rewritten
    (docs / "results" / "v2" / name / "results.md").write_text("stale", encoding="utf-8")

    said = publish.publish(docs, tmp_path / "cache", progress=False)

    assert said == [f"{name}: 3 units cached, 0 not run; quoted in results.md: grid-{name}"]
    assert (docs / "results.md").read_text(encoding="utf-8") == (
        f"# head\n\n<!-- grid-{name}:start -->\n{block}\n<!-- grid-{name}:end -->\n\ntail\n")
    assert (docs / "results" / "v2" / name / "results.md").read_text(encoding="utf-8") == (
        ROOT / "docs" / "results" / "v2" / name / "results.md").read_text(encoding="utf-8")
    written = rj.read_bytes()
    new = json.loads(written)
    assert new["cells"] == pub["cells"] and new["command"] == pub["command"]
    assert sorted(p.name for p in docs.iterdir()) == ["results", "results.md"]  # no temporary file left

    # Nothing changed since: a second run keeps results.json byte for byte (its wall time and
    # machine fields included), so `make results-v2-report` leaves no diff behind.
    publish.publish(docs, tmp_path / "cache", progress=False)
    assert rj.read_bytes() == written


def test_publish_keeps_a_retrieval_only_report_without_documents(gemma3, tmp_path):
    """A report run with --no-ppl (Gemma 3's within-L reference: passkey, niah_single and vt, no
    document) is rerun with no document: its three units are all it has, nothing "not run", and
    its grid still lists no text (not the whole corpus, which an empty --text list means)."""
    name = "gemma3-half"
    docs = _copy_report(name, tmp_path)
    (docs / "results.md").write_text(f"<!-- grid-{name}-retrieval:start -->\n<!-- grid-{name}-retrieval:end -->\n",
                                     encoding="utf-8")
    rj = docs / "results" / "v2" / name / "results.json"
    committed = rj.read_bytes()
    assert json.loads(committed)["grid"]["texts"] == []

    said = publish.publish(docs, tmp_path / "cache", progress=False)

    assert said == [f"{name}: 3 units cached, 0 not run; quoted in results.md: grid-{name}-retrieval"]
    assert rj.read_bytes() == committed
    assert "| Baseline | 50 | 60 | 0 |" in (docs / "results.md").read_text(encoding="utf-8")


def test_same_report_ignores_only_the_run_fields():
    a = {"cells": [1], "machine": {"cpu": "x"}, "wall_s_this_run": 1.0, "wall_s_all_units": 9.0}
    assert publish._same_report(a, {**a, "machine": {"cpu": "y"}, "wall_s_this_run": 2.0})
    assert not publish._same_report(a, {**a, "wall_s_all_units": 10.0})
    assert not publish._same_report(a, {**a, "cells": [2]})


def test_cli_errors_are_one_line(tmp_path):
    r = CliRunner().invoke(publish.main, ["--docs", str(tmp_path / "nowhere"), "-q"])
    assert r.exit_code == 2
    assert r.output.strip() == f"ggufrope: error: no reports under {tmp_path / 'nowhere' / 'results' / 'v2'}"
