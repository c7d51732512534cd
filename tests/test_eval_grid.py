"""ggufrope/evaluation/grid.py: `ggufrope eval compare` (run_compare) on the real model.

a. On a tiny grid it writes results.json, results.md and ppl.png, and resumes from its cache
   (a second run computes nothing; a deleted unit is recomputed alone); --report-only computes
   nothing and reports the rest as not run.
b. The retrieval table with the truncation rows (beyond L only), on a copy of the real model
   whose llama.context_length says L = 512.
c. The published results (docs/results) are what the committed cache holds.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import copy_committed_cache

from ggufrope.evaluation import grid as EG, ppl as EP, publish, report as ER

pytestmark = pytest.mark.real_model

THREADS = os.cpu_count() or 1


# --- a. compare: outputs and resuming ------------------------------------------------------------------


def test_compare_tiny_grid_writes_reports_and_resumes(patched_lib, smollm2, text_slice, tmp_path):
    from click.testing import CliRunner

    from ggufrope.cli import main

    txt = tmp_path / "slice.txt"
    txt.write_text(text_slice[:2500], encoding="utf-8")
    out = tmp_path / "out"
    args = ["eval", "compare", str(smollm2), "--n-ctx", "256", "--methods", "none,ntk-mixed", "--logn", "off",
            "-k", "2", "--text", str(txt), "--trials", "1", "--out", str(out), "-q", "-t", str(THREADS)]
    runner = CliRunner()

    r1 = runner.invoke(main, args)
    assert r1.exit_code == 0, r1.output
    assert "units: 4 computed, 0 from the cache" in r1.output
    res = json.loads((out / "results.json").read_text())
    assert [(c["method"], c["logn"], c["n_ctx"]) for c in res["cells"]] == [("none", False, 256), ("ntk-mixed", False, 256)]
    for c in res["cells"]:
        assert c["ppl"] > 1 and c["ppl_beyond"] is None and c["passkey_trials"] == 1
    assert res["cells"][0]["ppl"] != res["cells"][1]["ppl"]  # k = 2 reached the library
    md = (out / "results.md").read_text()
    assert "| Baseline |" in md and "| NTK-RoPE-mixed (b=0.625) k=2 |" in md and "ggufrope eval compare" in md
    png = (out / "ppl.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 200_000
    cached = sorted((out / "cache").glob("*-256-*.json"))
    assert len(cached) == 4
    mtimes = [p.stat().st_mtime_ns for p in cached]

    r2 = runner.invoke(main, args)  # resumes: nothing left to compute
    assert r2.exit_code == 0, r2.output
    assert "units: 0 computed, 4 from the cache" in r2.output
    assert [p.stat().st_mtime_ns for p in cached] == mtimes
    assert json.loads((out / "results.json").read_text())["cells"] == res["cells"]

    cached[0].unlink()  # an interrupted run: one unit missing
    r3 = runner.invoke(main, args)
    assert r3.exit_code == 0, r3.output
    assert "units: 1 computed, 3 from the cache" in r3.output
    assert json.loads((out / "results.json").read_text())["cells"] == res["cells"]  # deterministic

    # --report-only over a larger grid: computes nothing, reports what is cached, the rest as not run
    n_files = len(list((out / "cache").glob("*.json")))
    wide = [a if a != "none,ntk-mixed" else "none,yarn,ntk-mixed" for a in args] + ["--report-only"]
    r4 = runner.invoke(main, wide)
    assert r4.exit_code == 0, r4.output
    assert "units: 0 computed, 4 from the cache, 2 not run" in r4.output
    assert len(list((out / "cache").glob("*.json"))) == n_files
    res4 = json.loads((out / "results.json").read_text())
    by = {c["method"]: c for c in res4["cells"]}
    assert by["yarn"]["ppl"] is None and by["yarn"]["passkey_accuracy"] is None
    assert [by["none"], by["ntk-mixed"]] == res["cells"]
    assert "| YaRN k=2 | – / – |" in (out / "results.md").read_text()

    # --any-build: a unit of another build (a lent GPU's, here a forged library hash) is used, not
    # recomputed; only the units not cached are computed
    forged = json.loads(cached[0].read_text())
    forged["build"] = {**forged["build"], "library": "0123456789abcdef"}
    cached[0].write_text(json.dumps(forged))
    any_build = [a for a in wide if a != "--report-only"] + ["--any-build"]
    r5 = runner.invoke(main, any_build)
    assert r5.exit_code == 0, r5.output
    assert "units: 2 computed, 4 from the cache, 0 not run" in r5.output
    assert json.loads(cached[0].read_text()) == forged
    res5 = json.loads((out / "results.json").read_text())
    assert sorted(res5["builds"].values()) == [1, 5] and "--any-build" in res5["command"]
    assert [c for c in res5["cells"] if c["method"] != "yarn"] == res["cells"]
    r6 = runner.invoke(main, [a for a in any_build if a != "--any-build"])  # without it: stale, recomputed
    assert r6.exit_code == 0, r6.output
    assert "units: 1 computed (1 of them stale: cached by another build), 5 from the cache" in r6.output


def test_compare_attn_factor_scales_every_row_and_names_it(patched_lib, smollm2, text_slice, tmp_path):
    """--attn-factor S (llama.cpp's yarn_attn_factor, what tune searches) reaches the library on
    every row, keys its own units, names the rows and the command; with yarn it is refused."""
    from click.testing import CliRunner

    from ggufrope.cli import main

    txt = tmp_path / "slice.txt"
    txt.write_text(text_slice[:2500], encoding="utf-8")
    base = ["eval", "compare", str(smollm2), "--n-ctx", "256", "--methods", "none,ntk-mixed", "--logn", "off",
            "-k", "2", "--text", str(txt), "--trials", "0", "--cache", str(tmp_path / "cache"), "-q",
            "-t", str(THREADS)]
    runner = CliRunner()
    r1 = runner.invoke(main, base + ["--out", str(tmp_path / "plain")])
    assert r1.exit_code == 0, r1.output
    r2 = runner.invoke(main, base + ["--out", str(tmp_path / "scaled"), "--attn-factor", "1.2"])
    assert r2.exit_code == 0, r2.output
    assert "units: 2 computed, 0 from the cache" in r2.output  # not the s = 1 units
    plain = json.loads((tmp_path / "plain" / "results.json").read_text())
    scaled = json.loads((tmp_path / "scaled" / "results.json").read_text())
    assert "attn_factor" not in plain["grid"] and scaled["grid"]["attn_factor"] == 1.2
    for p, s in zip(plain["cells"], scaled["cells"]):
        assert s["label"].endswith("attn×1.2") and not p["label"].endswith("attn×1.2")
        assert s["ppl"] != p["ppl"] and s["ppl"] > 1  # the logits scaled by 1.44 on both rows
    md = (tmp_path / "scaled" / "results.md").read_text()
    assert "| Baseline attn×1.2 |" in md and "| NTK-RoPE-mixed (b=0.625) k=2 attn×1.2 |" in md
    assert "--attn-factor 1.2" in scaled["command"]

    r3 = runner.invoke(main, [a if a != "none,ntk-mixed" else "none,yarn" for a in base]
                       + ["--out", str(tmp_path / "y"), "--attn-factor", "1.2"])
    assert r3.exit_code != 0
    assert r3.exception is None or isinstance(r3.exception, SystemExit)
    assert "yarn scales attention itself" in r3.output and "Traceback" not in r3.output
    assert not (tmp_path / "y" / "results.json").exists()


def test_report_only_keeps_the_cached_documents_of_a_partly_run_cell(patched_lib, smollm2, text_slice, tmp_path):
    """A cell with some documents not run yet: no pooled value (it would not be comparable with the
    other rows), but the per-document table shows the documents that are cached."""
    texts = [EP.Text("doc0", text_slice[:2500]), EP.Text("doc1", text_slice[2500:5000])]
    kw = dict(n_ctxs=[256], methods=["none"], logn_modes=[False], texts=texts, trials=0,
              out_dir=tmp_path / "out", cache_dir=tmp_path / "cache", progress=False, threads=THREADS)
    full, st = EG.run_compare(smollm2, **kw)
    assert st.computed == 2
    doc = full["cells"][0]["ppl_by_text"]
    assert set(doc) == {"doc0", "doc1"} and doc["doc0"]["ppl"] != doc["doc1"]["ppl"]
    assert full["cells"][0]["ppl"] is not None

    unit1 = [p for p in (tmp_path / "cache").glob("ppl-*.json") if "doc1" in p.read_text()]
    assert len(unit1) == 1
    unit1[0].unlink()
    part, st2 = EG.run_compare(smollm2, **kw, report_only=True)
    assert (st2.computed, st2.cached, st2.missing) == (0, 1, 1)
    cell = part["cells"][0]
    assert cell["ppl"] is None and cell["ppl_beyond"] is None
    assert cell["ppl_by_text"] == {"doc0": doc["doc0"]}
    rows = [ln for ln in ER.ppl_by_text_table(part).splitlines() if ln.startswith("| Baseline |")]
    # n_ctx 256 < L = 8192: doc0's scored tokens are all within L; doc1 is not run
    assert rows == [f"| Baseline | – / {doc['doc0']['ppl_within']:.3f} | – |"]
    assert doc["doc0"]["ppl_within"] > 1


# --- b. compare's retrieval table with the truncation rows ------------------------------------------
# (the tiny test vocabularies cannot tokenize English, so this uses the real model; a copy whose
# llama.context_length says L = 512 makes a context "beyond L" cheap)


@pytest.mark.real_model
def test_compare_writes_the_retrieval_table_with_the_truncation_row(patched_lib, smollm2_l512, tmp_path):
    from ggufrope.evaluation import grid as G

    kw = dict(n_ctxs=[512, 1024], methods=["none", "ntk-mixed"], logn_modes=[False], texts=[], trials=2,
              depths=[0.5], ruler_tasks=["niah_single"], samples=2, out_dir=tmp_path / "out", progress=False,
              threads=THREADS)
    res, st = G.run_compare(smollm2_l512, **kw)
    # 2 contexts x 2 methods x (passkey + niah_single), and the truncation rows beyond L only (1024): 2 units
    assert st.computed == 8 + 2
    trunc = [c for c in res["cells"] if c["method"] == "truncate"]
    assert [c["n_ctx"] for c in trunc] == [1024] and trunc[0]["ruler"]["niah_single"]["samples"] == 2
    assert trunc[0]["passkey_trials"] == 2
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| Truncation baseline (last L = 512 tokens, none) |" in md and "niah_single @ 1024" in md
    _, st2 = G.run_compare(smollm2_l512, **kw)  # resumable: nothing computed again
    assert st2.computed == 0 and st2.cached == 10


# --- c. the published results are what the cache holds ------------------------------------------


ROOT = Path(__file__).resolve().parents[1]


def _report_only_rerun(model, pub: dict, tmp_path):
    """run_compare --report-only over a copy of the committed cache, with the grid of a published
    results.json ``pub``: (results, stats)."""
    return publish.rerun(model, pub, cache_dir=copy_committed_cache(tmp_path / "cache"), out_dir=tmp_path / "out")


def test_published_results_are_the_cached_units(smollm2, tmp_path):
    """docs/results/results.json and the table in docs/results.md are regenerated, with
    --report-only, from the raw per-unit results committed in docs/results/cache: nothing in the
    published table is typed by hand or left over from another model, text or grid."""
    pub = json.loads((ROOT / "docs" / "results" / "results.json").read_text(encoding="utf-8"))
    g = pub["grid"]
    res, stats = _report_only_rerun(smollm2, pub, tmp_path)
    assert stats.computed == 0 and stats.cached == pub["units"]["cached"] > 0
    assert res["cells"] == pub["cells"]
    md = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    rows = [line for line in ER.markdown_table(res).splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(g["methods"]) * len(g["logn"])
    for line in rows:
        assert line in md, line


def _published_dynamic_reports():
    return sorted((ROOT / "docs" / "results" / "dynamic").glob("*/results.json"))


@pytest.mark.parametrize("report", _published_dynamic_reports(), ids=lambda p: p.parent.name)
def test_published_dynamic_reports_are_the_cached_units(smollm2, tmp_path, report):
    """The dynamic-k tables of docs/results.md (issue 13; `make results-dynamic-report`) are
    regenerated with --report-only from the committed units: every table row quoted in
    docs/results.md is the one the cache gives."""
    pub = json.loads(report.read_text(encoding="utf-8"))
    res, stats = _report_only_rerun(smollm2, pub, tmp_path)
    assert stats.computed == 0 and stats.cached == pub["units"]["cached"] > 0
    assert res["cells"] == pub["cells"]
    md = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    table = (report.parent / "results.md").read_text(encoding="utf-8")
    for line in ER.markdown_table(res).splitlines():
        if line.startswith("| "):
            assert line in table, line
            assert line in md, line


#: docs/results/v2 reports that docs/results.md only cites in prose, without a quoted table
V2_NOT_QUOTED = ("smollm2-1x",)


def _published_v2_reports():
    return sorted((ROOT / "docs" / "results" / "v2").glob("*/results.json"))


@pytest.mark.parametrize("report", _published_v2_reports(), ids=lambda p: p.parent.name)
def test_published_v2_reports_are_the_cached_units(request, tmp_path, report):
    """docs/results/v2/MODEL-Nx (issue 15's grid on three documents; MODEL names the model's
    fixture) is what --report-only writes from the committed units, the cells not run included;
    docs/results.md quotes its per-document table between <!-- grid-NAME:start/end --> markers,
    and its retrieval table (where the grid has RULER-lite tasks) between
    <!-- grid-NAME-retrieval:start/end -->."""
    name = report.parent.name
    pub = json.loads(report.read_text(encoding="utf-8"))
    res, stats = _report_only_rerun(str(request.getfixturevalue(name.split("-", 1)[0])), pub, tmp_path)
    assert stats.computed == 0 and stats.cached == pub["units"]["cached"] + pub["units"]["computed"] > 0
    assert stats.missing == pub["units"]["missing"]
    assert res["cells"] == pub["cells"]
    table = (report.parent / "results.md").read_text(encoding="utf-8")
    by_text = ([ln for ln in ER.ppl_by_text_table(res).splitlines() if ln.startswith("| ")]
               if pub["grid"]["texts"] else [])  # a retrieval-only grid (--no-ppl) scored no document
    retrieval = ([ln for ln in ER.retrieval_table(res).splitlines() if ln.startswith("| ")]
                 if pub["grid"].get("ruler_tasks") else [])
    for line in [ln for ln in ER.markdown_table(res).splitlines() if ln.startswith("| ")] + by_text + retrieval:
        assert line in table, line
    md = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    blocks = publish.quoted_blocks(name, res)
    assert set(blocks) == ({name} if by_text else set()) | ({f"{name}-retrieval"} if retrieval else set())
    if name in V2_NOT_QUOTED:
        assert f"<!-- grid-{name}:start -->" not in md
        return
    for tag, body in blocks.items():
        # what `make results-v2-report` writes there, the count of windows under the table included
        block = md.split(f"<!-- grid-{tag}:start -->\n", 1)[1].split(f"\n<!-- grid-{tag}:end -->", 1)[0]
        assert block == body
        assert all(line in block for line in (by_text if tag == name else retrieval))



def summary_cell(ref):
    """The cell ``ref`` = (report in docs/results/v2, cell label) of a published report's
    results.json; None for None (no cell in the grid)."""
    if ref is None:
        return None
    cells = json.loads((ROOT / "docs" / "results" / "v2" / ref[0] / "results.json").read_text(encoding="utf-8"))["cells"]
    (c,) = [c for c in cells if c["label"] == ref[1]]  # labels are unique ("dyn" in a dynamic row's)
    return c


def summary_ppl(c) -> str:
    """A summary cell's perplexity: the pooled perplexity beyond L to two decimals, `–` where none."""
    return "–" if c is None or c["ppl_beyond"] is None else f"{c['ppl_beyond']:.2f}"


def summary_niah(c):
    """The cell's niah_single unit, None where there is none (yet)."""
    return ((c or {}).get("ruler") or {}).get("niah_single")


def summary_rows(tag: str) -> list[list[str]]:
    """The rows of docs/results.md's hand-typed table between ``<!-- TAG:start -->`` and
    ``<!-- TAG:end -->``, after its header: each a list of its cells, bold marks removed."""
    md = (ROOT / "docs" / "results.md").read_text(encoding="utf-8")
    block = md.split(f"<!-- {tag}:start -->", 1)[1].split(f"<!-- {tag}:end -->", 1)[0]
    return [[x.strip().replace("**", "") for x in ln.strip("|").split("|")]
            for ln in [x for x in block.splitlines() if x.startswith("| ")][1:]]


#: rows of the summary table at the top of docs/results.md -> (report, cell label) in
#: docs/results/v2 for 2xL and 4xL (None: no cell); tune's 2xL niah_single is its trial's
SUMMARY_ROWS = {
    "none (plain RoPE)": (("smollm2-2x", "none"), ("smollm2-4x", "none")),
    "none + log n": (("smollm2-2x", "none + log-n"), ("smollm2-4x", "none + log-n")),
    "linear (PI; stock `--rope-scaling linear`)": (("smollm2-2x", "linear"), ("smollm2-4x", "linear")),
    "linear + log n": (("smollm2-2x", "linear + log-n"), ("smollm2-4x", "linear + log-n")),
    "YaRN (stock `--rope-scaling yarn`)": (("smollm2-2x", "yarn"), ("smollm2-4x", "yarn")),
    "YaRN + log n": (("smollm2-2x", "yarn + log-n"), ("smollm2-4x", "yarn + log-n")),
    "ntk (NTK-aware)": (("smollm2-2x", "ntk"), ("smollm2-4x", "ntk")),
    "ntk (NTK-aware) + log n": (("smollm2-2x", "ntk + log-n"), ("smollm2-4x", "ntk + log-n")),
    "ntk (NTK-aware), dynamic k": (None, ("smollm2-4x", "ntk dyn")),
    "ntk (NTK-aware) + log n, dynamic k": (("smollm2-2x-dyn", "ntk dyn + log-n"), ("smollm2-4x", "ntk dyn + log-n")),
    "ntk (NTK-aware), k = 2·n_ctx/L": (("smollm2-2x-k4", "ntk"), ("smollm2-4x-k8", "ntk")),
    "ntk-fixed + log n": (("smollm2-2x", "ntk-fixed + log-n"), None),
    "ntk-mixed b = 0.625": (("smollm2-2x", "ntk-mixed (b=0.625)"), ("smollm2-4x", "ntk-mixed (b=0.625)")),
    "ntk-mixed b = 0.625 + log n (seed 000's default)":
        (("smollm2-2x", "ntk-mixed (b=0.625) + log-n"), ("smollm2-4x", "ntk-mixed (b=0.625) + log-n")),
    "ntk-mixed b = 0.625, dynamic k": (None, ("smollm2-4x", "ntk-mixed (b=0.625) dyn")),
    "ntk-mixed b = 0.625 + log n, dynamic k (the default when no k is set)":
        (("smollm2-2x-dyn", "ntk-mixed (b=0.625) dyn + log-n"), ("smollm2-4x", "ntk-mixed (b=0.625) dyn + log-n")),
    "`tune`'s choice by perplexity (b = 0.75; 2×L: attn ×1.035; 4×L: dynamic k, attn ×1.07)":
        (("smollm2-2x-tuned", "ntk-mixed (b=0.75) attn×1.035"),
         ("smollm2-4x-tuned-full", "ntk-mixed (b=0.75) dyn attn×1.07")),
    "truncation (the prompt cut to its last L tokens, none)":
        (("smollm2-2x", "truncate to L = 8192"), ("smollm2-4x", "truncate to L = 8192")),
}


def test_results_summary_is_the_published_reports():
    """The summary table at the top of docs/results.md (typed by hand) says what the published v2
    reports (results.json, checked against the units above) say: each perplexity cell is the
    pooled perplexity beyond L to two decimals, `–` exactly where there is none yet; each
    niah_single cell (2xL and 4xL) is the score, `–` where it is not run yet. A unit computed
    without updating the summary fails here."""
    tune = json.loads((ROOT / "docs" / "results" / "tune" / "smollm2-16384-retrieval" / "tune.json").read_text())
    seen = []
    for name, ppl2, niah2, ppl4, niah4 in summary_rows("summary-smollm2"):
        seen.append(name)
        c2, c4 = (summary_cell(ref) for ref in SUMMARY_ROWS[name])
        assert (ppl2, ppl4) == (summary_ppl(c2), summary_ppl(c4)), name
        unit4 = summary_niah(c4)
        assert niah4 == ("–" if unit4 is None else f"{unit4['score']:g} %"), name
        unit = summary_niah(c2)  # None: in the grid, not run yet
        if c2 is None or (unit is None and "tune" not in name):
            assert niah2 == "–", name
            continue
        if unit is not None:
            score = unit["score"]
        else:  # the tuned setting: tune --retrieval scored it (same prompts, seed 0, 10 samples)
            (t,) = [t for t in tune["trials"] if t["label"] == "ntk-mixed (b=0.75) k=2 attn×1.035"]
            score = t["niah_single"]
        assert niah2 == f"{score:g} %", name
    assert seen == list(SUMMARY_ROWS)


GEMMA_SUMMARY_ROWS = {
    "none (plain RoPE)": (("gemma3-2x", "none"), ("gemma3-4x", "none")),
    "none + log n": (("gemma3-2x", "none + log-n"), ("gemma3-4x", "none + log-n")),
    "linear (PI; stock `--rope-scaling linear`)": (("gemma3-2x", "linear"), ("gemma3-4x", "linear")),
    "linear + log n": (("gemma3-2x", "linear + log-n"), ("gemma3-4x", "linear + log-n")),
    "YaRN (stock `--rope-scaling yarn`)": (("gemma3-2x", "yarn"), ("gemma3-4x", "yarn")),
    "YaRN + log n": (("gemma3-2x", "yarn + log-n"), ("gemma3-4x", "yarn + log-n")),
    "ntk (NTK-aware)": (("gemma3-2x", "ntk"), ("gemma3-4x", "ntk")),
    "ntk (NTK-aware) + log n": (("gemma3-2x", "ntk + log-n"), ("gemma3-4x", "ntk + log-n")),
    "ntk-fixed": (("gemma3-2x", "ntk-fixed"), None),
    "ntk-fixed + log n": (("gemma3-2x", "ntk-fixed + log-n"), None),
    "ntk-mixed b = 0.625": (("gemma3-2x", "ntk-mixed (b=0.625)"), ("gemma3-4x", "ntk-mixed (b=0.625)")),
    "ntk-mixed b = 0.625 + log n (seed 000's default)":
        (("gemma3-2x", "ntk-mixed (b=0.625) + log-n"), ("gemma3-4x", "ntk-mixed (b=0.625) + log-n")),
    "`tune --quick`'s choice at 2×L (b = 0.5, no log n)": (("gemma3-2x-tuned", "ntk-mixed (b=0.5)"), None),
    "`tune`'s choice at 2×L, full search (b = 0.375, k = 2.5, no log n)":
        (("gemma3-2x-tuned-full", "ntk-mixed (b=0.375)"), None),
    "ntk (NTK-aware), k = 2·n_ctx/L (`tune --retrieval`'s choice at 2×L, k = 4; 4×L: k = 8)":
        (("gemma3-2x-k4", "ntk"), ("gemma3-4x-k8", "ntk")),
    "truncation (the prompt cut to its last L tokens, none)":
        (("gemma3-2x", "truncate to L = 32768"), ("gemma3-4x", "truncate to L = 32768")),
}


def test_results_gemma_summary_is_the_published_reports():
    """Gemma 3's summary table at the top of docs/results.md (typed by hand) says what its published
    v2 reports say: pooled perplexity beyond L at 2xL (three documents) and 4xL (one), niah_single
    and passkey (10 trials) at 2xL and 4xL; `–` exactly where a cell is not run yet (or not in the
    grid: None above)."""
    seen = []
    for name, ppl2, niah2, pk2, ppl4, niah4, pk4 in summary_rows("summary-gemma3"):
        seen.append(name)
        c2, c4 = (summary_cell(ref) for ref in GEMMA_SUMMARY_ROWS[name])
        assert (ppl2, ppl4) == (summary_ppl(c2), summary_ppl(c4)), name
        for got, c in ((niah2, c2), (niah4, c4)):
            unit = summary_niah(c)
            assert got == ("–" if unit is None else f"{unit['score']:g} %"), name
        for got, c in ((pk2, c2), (pk4, c4)):
            acc = (c or {}).get("passkey_accuracy")
            assert got == ("–" if acc is None else f"{100 * acc:g} %"), name
    assert seen == list(GEMMA_SUMMARY_ROWS)
