"""The report tables of ggufrope/evaluation/report.py on hand-made results: perplexity by
document (beyond / within L) and the retrieval table with its truncation-baseline row."""

from __future__ import annotations

from ggufrope.evaluation import report as ER


def _res():
    cell = dict(logn=False, factor=2.0, exponent=None, ppl=None, ppl_beyond=None, ppl_within=None, scored_tokens=None,
                scored_tokens_beyond=None, scored_tokens_within=None, passkey_accuracy=None, passkey_by_depth=None,
                passkey_trials=None)
    cells = [
        {**cell, "n_ctx": 16384, "method": "yarn", "label": "yarn",
         "ppl_by_text": {"verse": {"ppl": 9.0, "ppl_beyond": 10.0, "ppl_within": 8.0, "windows": 1},
                         "tech": {"ppl": 5.0, "ppl_beyond": 5.5, "ppl_within": 4.25, "windows": 1}},
         "passkey_accuracy": 0.3, "ruler": {"niah_single": {"score": 40.0, "control": 0.0, "samples": 10}}},
        {**cell, "n_ctx": 16384, "method": "ntk-mixed", "exponent": 0.625, "label": "ntk-mixed",
         "ppl_by_text": {"verse": {"ppl": 9.5, "ppl_beyond": 9.75, "ppl_within": None, "windows": 1}},
         "passkey_accuracy": 0.5, "ruler": {"niah_single": {"score": 60.0, "control": 10.0, "samples": 10}}},
        {**cell, "n_ctx": 16384, "method": "truncate", "label": "truncate to L = 8192", "factor": None,
         "ppl_by_text": {}, "passkey_accuracy": 0.6, "ruler": {"niah_single": {"score": 55.0, "control": 0.0,
                                                                              "samples": 10}}},
    ]
    return {"model": {"n_ctx_orig": 8192, "name": "m"}, "cells": cells,
            "grid": {"n_ctx": [16384], "methods": ["yarn", "ntk-mixed"], "logn": [False], "exponent": 0.625,
                     "texts": [{"name": "verse"}, {"name": "tech"}], "score_from": 4096, "max_windows": 1,
                     "trials": 10, "ruler_tasks": ["niah_single"], "samples": 10}}


def test_ppl_by_text_table_beyond_and_within():
    md = ER.ppl_by_text_table(_res())
    lines = md.splitlines()
    assert lines[0] == "| method | verse @ 16384 (2×L) | tech @ 16384 (2×L) |"
    assert lines[2] == "| YaRN | 10.000 / 8.000 | 5.500 / 4.250 |"
    assert lines[3] == "| NTK-RoPE-mixed (b=0.625) | 9.750 / – | – |"  # tech not run, within not scored
    assert not any("Truncation" in ln for ln in lines)  # no perplexity row for the baseline
    assert "within L (positions 4096 … 8191" in md


def test_retrieval_table_with_truncation_row_and_control():
    md = ER.retrieval_table(_res())
    lines = md.splitlines()
    assert lines[0] == "| method | passkey @ 16384 | niah_single @ 16384 |"
    assert lines[2] == "| YaRN | 30 | 40 |"
    assert lines[3] == "| NTK-RoPE-mixed (b=0.625) | 50 | 60 |"
    assert lines[4] == "| Truncation baseline (last L = 8192 tokens, none) | 60 | 55 |"
    assert "at most 10 % in any cell" in md
    assert "Truncation baseline: the same prompts cut to their last L = 8192 tokens" in md


def test_retrieval_table_explains_the_truncation_baseline_only_when_it_has_its_row():
    res = _res()
    res["cells"] = [c for c in res["cells"] if c["method"] != "truncate"]  # within L, or --no-truncation
    md = ER.retrieval_table(res)
    assert "Truncation baseline" not in md
    assert md.splitlines()[-1].startswith("Shuffled control")


def test_report_markdown_adds_the_tables_only_when_the_grid_has_them():
    res = _res()
    full = ER.report_markdown(res)
    assert full.count("| method |") == 3
    old = _res()
    old["grid"].update(texts=[{"name": "verse"}], score_from=None, ruler_tasks=[])
    old["cells"] = [c for c in old["cells"] if c["method"] != "truncate"]
    assert ER.report_markdown(old) == ER.markdown_table(old)  # the published single-text reports unchanged


def test_markdown_table_note_names_the_passkey_trials_or_says_there_were_none():
    res = _res()
    assert "/ passkey retrieval accuracy over 10 trials (higher is better" in ER.markdown_table(res)
    res["grid"]["trials"] = 0
    md = ER.markdown_table(res)
    assert "over 0 trials" not in md and "/ – (no passkey trials in this grid: --trials 0)." in md


def test_retrieval_only_grid_has_no_table_of_dashes_but_keeps_the_notes():
    res = _res()
    res["grid"].update(texts=[], trials=0)  # --no-ppl --trials 0
    res["builds"] = {"abc (patch 0.1.0), CPU": 3}
    res["command"] = "ggufrope eval compare m --no-ppl --trials 0"
    md = ER.markdown_table(res)
    assert not any(ln.startswith("|") for ln in md.splitlines())  # no "| YaRN | – / – |" rows
    assert md.startswith("No perplexity or passkey table: this grid scored no text (--no-ppl)")
    assert "Factor k per context: 16384: k = 2." in md
    assert "Units computed by: abc (patch 0.1.0), CPU (3 units)." in md
    assert md.rstrip().endswith("Command: `ggufrope eval compare m --no-ppl --trials 0`")
    full = ER.report_markdown(res)
    assert full.count("| method |") == 1 and "| YaRN | 40 |" in full  # the RULER-lite table is the report
    res["grid"]["trials"] = 10  # passkey without perplexity: the table stays (its cells have accuracies)
    assert "| YaRN | – / 30% |" in ER.markdown_table(res)


def test_retrieval_table_note_names_only_the_tasks_run():
    res = _res()
    assert ("passkey accuracy over 10 trials; RULER-lite string_match_all over 10 samples a cell."
            in ER.retrieval_table(res))
    res["grid"]["trials"] = 0
    md = ER.retrieval_table(res)
    assert md.splitlines()[0] == "| method | niah_single @ 16384 |"
    assert "(higher is better; – = not run): RULER-lite string_match_all over 10 samples a cell." in md
    assert "passkey" not in md


def test_relative_ppl_against_yarn_or_the_lowest_row():
    ref, rows = ER.relative_ppl(_res())
    assert ref == "YaRN"  # YaRN is run on both documents
    # verse: 9.75 / 10 = 0.975; tech: not run for ntk-mixed; no row for the truncation baseline
    assert rows == [("YaRN", [1.0, 1.0]), ("NTK-RoPE-mixed (b=0.625)", [0.975, None])]

    res = _res()
    del res["cells"][0]["ppl_by_text"]["tech"]  # YaRN not run on tech: the lowest row per document
    res["cells"][1]["ppl_by_text"]["tech"] = {"ppl": 6.0, "ppl_beyond": 6.0, "ppl_within": None, "windows": 1}
    ref, rows = ER.relative_ppl(res)
    assert ref == "the lowest row on each document"
    assert rows == [("YaRN", [10.0 / 9.75, None]), ("NTK-RoPE-mixed (b=0.625)", [1.0, 1.0])]


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_plot_one_context_is_rows_beside_retrieval_several_contexts_are_lines(tmp_path):
    one = _res()
    ER.plot(one, tmp_path / "rows.png")
    w_rows, _ = _png_size(tmp_path / "rows.png")
    assert w_rows > 1000  # two panels: perplexity against YaRN per document, retrieval scores

    lines = _res()
    lines["grid"]["n_ctx"] = [8192, 16384]
    lines["cells"] = [c for c in lines["cells"] if c["method"] != "truncate"]
    for c in lines["cells"]:
        c["ppl_beyond"] = c["ppl_by_text"]["verse"]["ppl_beyond"]
    lines["cells"] += [{**c, "n_ctx": 8192, "ppl_beyond": None, "ppl": 7.0} for c in list(lines["cells"])]
    ER.plot(lines, tmp_path / "lines.png")
    assert _png_size(tmp_path / "lines.png") == (600, 400)  # perplexity against context


def test_plot_rows_marks_each_cell_not_run_and_nothing_else():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = _res()
    # a row with perplexity on one document and no retrieval at all (a dynamic row whose niah cell
    # is still to run): its tech slot and its niah_single slot are not run; the truncation row has
    # no perplexity by design, so its perplexity slots stay unmarked
    res["cells"].append({**res["cells"][1], "dynamic": True, "ruler": {}, "passkey_accuracy": None,
                         "ppl_by_text": {"verse": {"ppl": 9.0, "ppl_beyond": 9.5, "ppl_within": None,
                                                   "windows": 1}}})
    res["grid"]["dynamic"] = [False, True]
    fig = ER._rows_figure(res)
    try:
        ppl_ax, ret_ax = fig.axes[:2]
        ppl_marks = sorted(t.get_text() for t in ppl_ax.texts if "not run" in t.get_text())
        ret_marks = sorted(t.get_text() for t in ret_ax.texts if "not run" in t.get_text())
    finally:
        plt.close(fig)
    # ntk-mixed static and dynamic: tech not run (2 marks); YaRN and truncation: none
    assert ppl_marks == ["tech: not run", "tech: not run"]
    # only the dynamic row lacks retrieval, both columns of it (the grid has passkey trials too)
    assert ret_marks == ["niah_single: not run", "passkey: not run"]


def test_a_factor_k_given_to_the_grid_is_named_in_the_static_rows():
    """-k 2.5 at n_ctx 16384 over L 8192 (k = 2 by default): the rows say k=2.5 (the baseline, which
    takes no k, and the truncation row do not); without -k the rows name no k."""
    res = _res()
    res["grid"]["factor"] = 2.5
    lines = ER.retrieval_table(res).splitlines()
    assert lines[2] == "| YaRN k=2.5 | 30 | 40 |"
    assert lines[3] == "| NTK-RoPE-mixed (b=0.625) k=2.5 | 50 | 60 |"
    assert lines[4] == "| Truncation baseline (last L = 8192 tokens, none) | 60 | 55 |"
    assert ER.ppl_by_text_table(res).splitlines()[3] == "| NTK-RoPE-mixed (b=0.625) k=2.5 | 9.750 / – | – |"
    res["grid"]["methods"] = ["none"]
    res["cells"][0]["method"] = "none"
    assert ER.markdown_table(res).splitlines()[2].startswith("| Baseline | ")
    res["grid"]["factor"] = None
    assert ER.retrieval_table(_res()).splitlines()[3] == "| NTK-RoPE-mixed (b=0.625) | 50 | 60 |"
