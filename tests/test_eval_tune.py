"""``ggufrope tune``'s search (ggufrope/evaluation/tune.py) on objectives whose minimum is known,
so that what the search finds can be checked; its --write on a tiny model (L = 64), whose file
gives the tuned setting's logits bit for bit without any override (the attention factor through
llama.cpp's own rope.scaling.attn_factor key); and the published tune, which is what the
committed cache gives. The command end to end on a tiny model is in test_eval_cli."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import copy_committed_cache, tiny_logits as _logits
from ggufrope.cli import main
from ggufrope.evaluation import decoder as ED
from ggufrope.evaluation import tune as T


def _b(s):
    return {"ntk-fixed": 1.0, "ntk-mixed": s.exponent}.get(s.method)


def objective(b_best=0.875, attn_best=1.035, logn_bonus=0.05, k_best=None, dyn_cost=0.01):
    """A bowl in b and the attention factor; log-n helps by ``logn_bonus``; k away from
    ``k_best`` costs; stock methods and NTK-aware are worse than every ntk-mixed."""
    calls = []

    def f(s):
        calls.append(s)
        if s.method == "yarn":
            return 9.0
        if s.method == "linear":
            return 20.0
        b = _b(s) if _b(s) is not None else 0.2
        k = 2.0 if s.factor is None else s.factor
        return (5.0 + 10 * (b - b_best) ** 2 + (0 if s.logn else logn_bonus) + 300 * (s.attn_factor - attn_best) ** 2
                + (0 if k_best is None else (k - k_best) ** 2) + (dyn_cost if s.dynamic else 0))

    return f, calls


def test_finds_an_interior_b_and_temperature_and_never_repeats_a_setting():
    f, calls = objective(b_best=0.875, attn_best=1.035)
    s = T.Search(f, 2.0)
    best = s.run()
    assert len(calls) == len(set(calls))  # memoized: one evaluation per distinct setting
    assert best.setting.method == "ntk-mixed" and best.setting.exponent == 0.875  # from the b refine stage
    assert best.setting.logn and best.setting.attn_factor == 1.035 and not best.setting.dynamic
    stages = [t.stage for t in s.trials]
    assert stages[:2] == ["reference", "reference"] and {"b", "b refine", "log-n", "attention", "NTK-aware", "k",
                                                        "dynamic"} <= set(stages)
    assert T.seed_default() in calls  # the seed default is always measured, for the comparison
    assert len(calls) <= 20  # affordable: 2 references + at most 18 candidates


def test_b_refine_steps_below_the_grid_when_its_lowest_b_is_best():
    f, calls = objective(b_best=0.3)
    s = T.Search(f, 2.0)
    best = s.run()
    refine = sorted(t.setting.exponent for t in s.trials if t.stage == "b refine")
    assert refine == [0.375, 0.5625]  # one step below 0.5 (0.5 - 0.125), and the midpoint to 0.625
    assert best.setting.exponent == 0.375
    assert len(calls) <= 20
    f, _ = objective(b_best=0.875)  # interior: midpoints only
    s = T.Search(f, 2.0)
    s.run()
    assert sorted(t.setting.exponent for t in s.trials if t.stage == "b refine") == [0.6875, 0.875]


def attn_tried(s):
    """The attention factors the search ``s`` tried in its attention stage, sorted."""
    return sorted({round(t.setting.attn_factor, 4) for t in s.trials if t.stage == "attention"})


def test_attention_steps_beyond_its_grid_when_the_largest_factor_is_best():
    f, calls = objective(attn_best=1.12)  # between the first step (1.105) and the second (1.14)
    s = T.Search(f, 2.0)
    best = s.run()
    assert attn_tried(s) == [1.035, 1.07, 1.105, 1.14]  # 1.14 is tried (1.105 was the best), then it stops
    assert best.setting.attn_factor == pytest.approx(1.105)
    assert len(calls) == len(set(calls)) and len(calls) <= 20
    f, _ = objective(attn_best=1.5)  # far beyond: two steps, no more
    s = T.Search(f, 2.0)
    assert s.run().setting.attn_factor == pytest.approx(1.14) and attn_tried(s)[-1] == 1.14
    f, _ = objective(attn_best=1.08)  # 1.07 best, 1.105 worse: one step
    s = T.Search(f, 2.0)
    assert s.run().setting.attn_factor == pytest.approx(1.07) and attn_tried(s) == [1.035, 1.07, 1.105]
    f, _ = objective(attn_best=1.035)  # interior: no step
    s = T.Search(f, 2.0)
    s.run()
    assert attn_tried(s) == [1.035, 1.07]


def test_attention_steps_below_1_when_a_sharper_softmax_hurts():
    # hand values of the bowl 300 (s - 0.95)^2: s = 1: 0.75, 1.035: 2.1675 (hurts), 0.965: 0.0675
    # (helps), 0.93: 0.12 (worse than 0.965: stop)
    f, calls = objective(attn_best=0.95)
    s = T.Search(f, 2.0)
    best = s.run()
    assert attn_tried(s) == [0.93, 0.965, 1.035, 1.07]  # 1.07: instead of log-n, which the best has
    assert best.setting.attn_factor == pytest.approx(0.965)
    assert len(calls) == len(set(calls)) and len(calls) <= 20
    f, _ = objective(attn_best=0.8)  # far below: two steps, no more
    s = T.Search(f, 2.0)
    assert s.run().setting.attn_factor == pytest.approx(0.93) and attn_tried(s)[0] == 0.93
    f, _ = objective(attn_best=1.0)  # s = 1 best: 0.965 is tried once, nothing further
    s = T.Search(f, 2.0)
    assert s.run().setting.attn_factor == 1.0 and 0.93 not in attn_tried(s) and 0.965 in attn_tried(s)
    f, _ = objective(attn_best=1.035)  # a sharper softmax helps: nothing below 1
    s = T.Search(f, 2.0)
    s.run()
    assert min(attn_tried(s)) == 1.035


def test_k_stage_moves_k_when_it_helps():
    f, _ = objective(k_best=3.0)
    best = T.Search(f, 2.0).run()
    assert best.setting.factor == 3.0  # k x 1.5 (k x 1.25 = 2.5 helped, so 1.5 was tried)


def test_ntk_aware_is_tried_at_twice_n_ctx_over_L_after_the_k_stage():
    """NTK-aware's table keeps the pairs that do not turn within L inside their trained angles only
    with k above n_ctx / L (YaRN paper section 3.1), so the search tries it at k = 2 * 2 = 4 too,
    after the k stage has refined the best ntk-mixed; when it wins, dynamic k is tried on it."""
    f, _ = objective()

    def g(s):  # NTK-aware at an explicit k: the bowl 1 + (k - 5)^2, so 2 at k = 4; at k = n_ctx / L
        # (factor None) and every other setting, the objective above, whose values are all >= 5
        return 1.0 + (s.factor - 5.0) ** 2 if s.method == "ntk" and s.factor is not None else f(s)

    s = T.Search(g, 2.0)
    best = s.run()
    stages = [t.stage for t in s.trials]
    assert stages.index("NTK-aware") > max(i for i, st in enumerate(stages) if st == "k")
    assert [t.setting.method for t in s.trials if t.stage == "k"] == ["ntk-mixed"]  # k = 2.5 hurt: one step
    assert [t.setting.factor for t in s.trials if t.stage == "NTK-aware"] == [None, 4.0]  # None: k = n_ctx / L
    assert best.setting.method == "ntk" and best.setting.factor == 4.0 and best.score == 2.0
    (dyn,) = [t.setting for t in s.trials if t.stage == "dynamic"]
    assert dyn.method == "ntk" and dyn.dynamic


def test_log_n_off_and_dynamic_win_when_the_objective_says_so():
    f, _ = objective(logn_bonus=-0.2, dyn_cost=-0.5)  # log-n hurts, dynamic k helps
    best = T.Search(f, 2.0).run()
    assert best.setting.dynamic and best.setting.factor is None
    assert not best.setting.logn


def test_quick_is_cheap():
    f, calls = objective()
    best = T.Search(f, 2.0, quick=True).run()
    assert len(calls) == 8  # 2 references, 4 b, log-n, one attention factor
    assert best.setting.attn_factor == 1.035


def test_references_are_never_chosen():
    f, _ = objective()
    g = lambda s: 0.1 if s.method == "yarn" else f(s)  # noqa: E731
    s = T.Search(g, 2.0)
    assert s.run().setting.method != "yarn"


def test_retrieval_chooses_among_the_top_three_and_the_seed_default():
    f, _ = objective()
    s = T.Search(f, 2.0, quick=True)
    s.run()
    ranked = sorted((t for t in s.trials if t.role == "candidate"), key=lambda t: t.score)
    top3, sd = ranked[:3], next(t for t in ranked if t.setting == T.seed_default())
    assert sd not in top3  # 5th of 6 here: by hand 5 + 10 * (0.625 - 0.875)^2 + 300 * 0.035^2 = 5.9925
    ch = T.choose_with_retrieval(s.trials, lambda st: 100.0 if st == top3[2].setting else 50.0)
    assert ch is top3[2] and ch.extra["niah_single"] == 100.0
    yarn, linear = (next(t for t in s.trials if t.setting.method == m) for m in ("yarn", "linear"))
    assert yarn.extra["niah_single"] == 50.0 and "niah_single" not in linear.extra  # YaRN: for the report
    assert sd.extra["niah_single"] == 50.0  # measured too, though 4th or lower by perplexity
    assert sum("niah_single" in t.extra for t in s.trials) == 5  # and nothing else
    md = T.markdown(s.trials, ch, n_ctx=16384, L=8192, texts=["doc"], samples=10)
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and "(chosen)" in ln]
    assert len(rows) == 1 and rows[0].startswith("| 3 | ") and rows[0].endswith(" | 100 % |")
    assert "niah_single: RULER-lite at n_ctx 16384 over 10 samples (seed 0), percent of gold values found, run on " \
           "the three best candidates by perplexity and the seed default" in md
    assert "finds more needles than the choice" not in md  # YaRN 50 % against 100 %
    assert "Ranked by perplexity only" not in md
    assert f"the best by perplexity alone is {top3[0].setting.label()} ({top3[0].score:.4f}, niah_single 50 %)" in md
    assert T.choose_with_retrieval(s.trials, lambda st: 70.0 if st == T.seed_default() else 30.0) is sd
    # YaRN retrieves best: never chosen (a reference), and the report says so
    ch_y = T.choose_with_retrieval(s.trials, lambda st: {"yarn": 90.0}.get(st.method, 70.0 if st == T.seed_default()
                                                                                   else 30.0))
    assert ch_y is sd and T.retrieval_rival(s.trials, ch_y) is yarn
    assert "Stock llama.cpp's yarn k=2 finds more needles than the choice (90 % against 70 %): for retrieval on this " \
           "model at this n_ctx, llama.cpp's own --rope-scaling yarn does better." in \
           T.markdown(s.trials, ch_y, n_ctx=16384, L=8192, texts=["doc"], label=lambda st: st.label(16384, 8192))
    ch0 = T.choose_with_retrieval(s.trials, lambda st: 50.0)  # a tie: the lower perplexity wins, nothing changed
    assert ch0 is top3[0]
    assert "Retrieval changed the choice" not in T.markdown(s.trials, ch0, n_ctx=16384, L=8192, texts=["doc"])


def test_retrieval_also_scores_ntk_aware_at_twice_n_ctx_over_L():
    """Stage 6's NTK-aware at k = 2 n_ctx / L is re-ranked by retrieval however far down it ranks
    by perplexity (on SmolLM2 at 2x: 16th of 17, and the only setting that found 10 of 10)."""
    f, _ = objective()
    s = T.Search(f, 2.0)
    s.run()
    ranked = sorted((t for t in s.trials if t.role == "candidate"), key=lambda t: t.score)
    (raised,) = [t for t in ranked if t.setting.method == "ntk" and t.setting.factor == 4.0]
    (plain,) = [t for t in ranked if t.setting.method == "ntk" and t.setting.factor is None]
    # the fixture's NTK-aware stands at b = 0.2, with the best's log-n and attention 1.035: by hand
    # 5 + 10 * (0.2 - 0.875)^2 = 9.55625, the worst candidate
    assert raised.score == pytest.approx(9.55625) and raised is ranked[-1] and raised.stage == "NTK-aware"
    ch = T.choose_with_retrieval(s.trials, lambda st: 100.0 if st.method == "ntk" else 50.0)
    assert ch is raised and raised.extra["niah_single"] == 100.0
    assert "niah_single" not in plain.extra  # k = n_ctx / L: not a retrieval candidate
    sd = next(t for t in ranked if t.setting == T.seed_default())
    assert sd not in ranked[:3] and "niah_single" in sd.extra
    scored = [t for t in s.trials if "niah_single" in t.extra]
    assert len(scored) == 6  # the three best, the seed default, NTK-aware k = 4, YaRN
    md = T.markdown(s.trials, ch, n_ctx=16384, L=8192, texts=["doc"], samples=10)
    assert "run on the three best candidates by perplexity, the seed default and NTK-aware at k = 2·n_ctx/L (the " \
           "best score is chosen" in md
    assert f"Retrieval changed the choice: the best by perplexity alone is {ranked[0].setting.label()}" in md
    # a tie with the perplexity leader: the lower perplexity wins
    assert T.choose_with_retrieval(s.trials, lambda st: 50.0) is ranked[0]


def test_report_ranks_and_states_the_held_out_result():
    f, _ = objective()
    s = T.Search(f, 2.0, quick=True)
    best = s.run()
    md = T.markdown(s.trials, best, n_ctx=16384, L=8192, texts=["doc"],
                    held_out={"chosen": {"ppl_beyond": 6.9}, "seed default": {"ppl_beyond": 7.0},
                              "yarn": {"ppl_beyond": 7.1}}, held_texts=["other"])
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert "(chosen)" in lines[1] and "yarn (stock)" in md
    assert "| seed default | 7.0000 | 0.0 % | -1.4 % |" in md  # 7.0/7.1 - 1 = -1.41 %
    assert "| chosen | 6.9000 | -1.4 % | -2.8 % |" in md  # 6.9/7.0 - 1 = -1.43 %, 6.9/7.1 - 1 = -2.82 %
    assert "beats both the seed default and YaRN" in md
    assert "Ranked by perplexity only, which does not rank retrieval" in md  # no --retrieval: the report says so
    md2 = T.markdown(s.trials, best, n_ctx=16384, L=8192, texts=["doc"],
                     held_out={"chosen": {"ppl_beyond": 7.2}, "seed default": {"ppl_beyond": 7.0},
                               "yarn": {"ppl_beyond": 7.1}}, held_texts=["other"])
    assert "does NOT beat" in md2


def test_report_says_when_a_stock_reference_beats_the_choice():
    f, _ = objective()
    s = T.Search(lambda st: 4.0 if st.method == "linear" else f(st), 2.0, quick=True)
    best = s.run()
    assert best.setting.method != "linear"  # references are never chosen
    rival = T.stock_rival(s.trials, best)
    assert rival is not None and rival.setting.method == "linear"
    md = T.markdown(s.trials, best, n_ctx=16384, L=8192, texts=["doc"])
    # 4.0 / best - 1, by hand from the objective: best = b 0.75 + log-n + attn 1.035 = 5 + 10 * 0.125^2 = 5.15625
    assert best.score == pytest.approx(5.15625)
    assert "Stock llama.cpp's linear scores better than the choice on the calibration text (4.0000 against 5.1562, -22.4 %)" in md
    assert "--rope-scaling linear" in md
    s2 = T.Search(f, 2.0, quick=True)  # yarn 9.0, linear 20.0: both worse than every candidate
    b2 = s2.run()
    assert T.stock_rival(s2.trials, b2) is None
    assert "Stock llama.cpp" not in T.markdown(s2.trials, b2, n_ctx=16384, L=8192, texts=["doc"])


@pytest.mark.parametrize("a,b,want", [(105.178, 108.828, "-3.4 %"), (113.292, 120.329, "-5.8 %"), (2.0, 1.0, "+100.0 %"),
                                     # 18.8245 / 18.8263 - 1 = -0.0018 / 18.8263 = -0.0096 %; 7.0 / 7.0 - 1 = 0
                                     (18.8245, 18.8263, "-0.01 %"), (7.0, 7.0, "0.0 %"), (1.0004, 1.0, "+0.04 %")])
def test_pct_hand_values(a, b, want):
    assert T.pct(a, b) == want


# --- --write -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("st", [
    ED.Setting("ntk-mixed", 2.0, 0.75, True, False, attn_factor=1.2),
    ED.Setting("ntk-fixed", 2.5, None, False, False),
    ED.Setting("ntk-mixed", None, 0.875, True, True, attn_factor=0.9),
], ids=lambda s: s.label())
def test_write_gives_the_setting_without_overrides(patched_lib, tiny, tmp_path, st):
    out = tmp_path / "w.gguf"
    line = T.write(str(tiny.path), str(out), st, 128)
    assert ("rope.scaling.attn_factor" in line) == (st.attn_factor != 1.0)
    got = np.array(_logits(str(out), None, plain=True))
    want = np.array(_logits(str(tiny.path), st))
    plain = np.array(_logits(str(tiny.path), ED.Setting("none")))
    assert np.array_equal(got, want)
    assert not np.allclose(got, plain)


def test_write_refuses_stock_methods(patched_lib, tiny, tmp_path):
    from ggufrope.errors import GGUFRopeError

    with pytest.raises(GGUFRopeError, match="yarn is stock llama.cpp's own"):
        T.write(str(tiny.path), str(tmp_path / "x.gguf"), T.candidate("yarn"), 128)
    assert not (tmp_path / "x.gguf").exists()


@pytest.mark.real_model
@pytest.mark.parametrize("name", ["smollm2-16384", "smollm2-32768", "gemma3-65536", "gemma3-131072", "smollm2-16384-retrieval",
                                  "smollm2-32768-full", "gemma3-65536-full",
                                  "gemma3-65536-retrieval"])
def test_published_tune_is_the_cached_units(patched_lib, request, tmp_path, name):
    """docs/results/tune/*/tune.md (quoted in docs/results.md) is what `ggufrope tune --report-only`
    writes from the units committed in docs/results/cache: the search, the niah_single re-ranking
    (--retrieval) and the held-out check redone, nothing typed by hand. The directory is named
    MODEL-N_CTX[-retrieval|-full] (MODEL: the fixture of that model)."""
    from pathlib import Path

    model = str(request.getfixturevalue(name.split("-", 1)[0]))

    root = Path(__file__).resolve().parents[1]
    copy_committed_cache(tmp_path / "cache")
    pub = root / "docs" / "results" / "tune" / name
    n_ctx = int(name.split("-")[1])
    meta = json.loads((pub / "tune.json").read_text())
    assert meta["n_ctx"] == n_ctx and meta["held_out_texts"] == ["docutils_manual"]
    assert (meta.get("retrieval_samples") is not None) == name.endswith("-retrieval")
    args = ["tune", model, "-c", str(n_ctx), "--cache", str(tmp_path / "cache"), "-q",
            "--report-only", "-o", str(tmp_path / "out")]
    args += [a for t in meta["texts"] for a in ("--text", t)]  # the run's calibration texts (default loc_workshop)
    args += ["--quick"] if meta.get("quick") else []
    args += ["--any-build"] if meta.get("any_build") else []
    args += ["--retrieval", "--samples", str(meta["retrieval_samples"])] if meta.get("retrieval_samples") else []
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "tune.md").read_text() == (pub / "tune.md").read_text()
    results_md = (root / "docs" / "results.md").read_text()
    for line in (pub / "tune.md").read_text().splitlines():
        if line.startswith("| ") and ("(chosen)" in line or "seed default" in line or "yarn" in line):
            assert line in results_md, line
