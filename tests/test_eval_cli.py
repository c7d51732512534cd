"""ggufrope/evaluation/cli.py: the flag parsers, the one-line errors and the commands end to end.

`eval passkey` at two contexts and `eval ruler` (with --truncate) on the real model; ``ggufrope
tune`` on a tiny model (L = 64, n_ctx 128): the ranked table, the held-out check, resuming from
the cache, and --write, whose file gives the tuned setting's logits bit for bit without any
override (the attention factor through llama.cpp's own rope.scaling.attn_factor key).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from click.testing import CliRunner

from conftest import tiny_logits as _logits
from ggufrope.cli import main
from ggufrope.errors import GGUFRopeError
from ggufrope.evaluation import cli as ECLI, decoder as ED, grid as EG

THREADS = os.cpu_count() or 1
L = 64  # n_ctx_train of the tiny model of the tune tests


# --- flag parsers and one-line errors -----------------------------------------------------------------


@pytest.mark.real_model
def test_parsers():
    assert ECLI.parse_methods("all") == list(EG.ALL_METHODS)
    assert ECLI.parse_methods("mixed,none,pi") == ["ntk-mixed", "none", "linear"]
    assert ECLI.parse_ints("16384, 32768") == [16384, 32768]
    assert ECLI.parse_depths("random") is None and ECLI.parse_depths("0,1") == [0.0, 1.0]
    assert ECLI.parse_logn("both") == [False, True]
    for bad in (lambda: ECLI.parse_methods("rope9"), lambda: ECLI.parse_ints("x"), lambda: ECLI.parse_depths("2"),
                lambda: ECLI.parse_logn("maybe")):
        with pytest.raises(GGUFRopeError):
            bad()


@pytest.mark.real_model
def test_eval_cli_errors_are_one_line(smollm2):
    from click.testing import CliRunner

    from ggufrope.cli import main

    r = CliRunner().invoke(main, ["eval", "ppl", str(smollm2), "--n-ctx", "256", "--text", "no-such-document"])
    assert r.exit_code == 2 and "ggufrope: error:" in r.output and "neither a file nor a corpus document" in r.output
    r = CliRunner().invoke(main, ["eval", "compare", str(smollm2), "--methods", "rope9"])
    assert r.exit_code == 2 and "unknown method" in r.output
    # a grid that would measure nothing is refused before anything loads, so the retrieval-only
    # report (markdown_table) always has a RULER-lite table to point to
    r = CliRunner().invoke(main, ["eval", "compare", str(smollm2), "--no-ppl", "--trials", "0"])
    assert r.exit_code == 2 and r.output.count("\n") == 1
    assert "nothing to run: --no-ppl with --trials 0 and no --tasks" in r.output


# --- eval passkey, eval ruler ----------------------------------------------------------------------------


@pytest.mark.real_model
def test_eval_passkey_command_runs_each_context_in_turn(patched_lib, smollm2):
    """The command end to end at two contexts: one model load per context, each with its rope
    line, and the per-context results in the JSON (the 512 context solves its trials)."""
    from click.testing import CliRunner

    from ggufrope.cli import main

    r = CliRunner().invoke(main, ["eval", "passkey", str(smollm2), "-c", "256,512", "--trials", "2", "--json",
                                  "-t", str(THREADS)])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert list(out["results"]) == ["256", "512"] and out["n_ctx_orig"] == 8192 and out["method"] == "none"
    assert [v["trials"] for v in out["results"].values()] == [2, 2]
    assert all(row["prompt_tokens"] <= int(c) - ED.DEFAULT_N_GEN for c, v in out["results"].items() for row in v["rows"])
    assert out["results"]["512"]["correct"] == 2
    assert r.stderr.count("[ggufrope] ") == 2  # one rope line per context


@pytest.mark.real_model
def test_eval_ruler_command_and_truncate_refusal(patched_lib, smollm2_l512):
    import json

    from click.testing import CliRunner

    from ggufrope.cli import main

    r = CliRunner().invoke(main, ["eval", "ruler", smollm2_l512, "-c", "512", "--tasks", "niah_single,fwe",
                                  "--samples", "2", "-t", str(THREADS), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output[r.output.index("{"):])
    assert set(out["results"]["512"]) == {"niah_single", "fwe"}
    rows = out["results"]["512"]["niah_single"]["rows"]
    assert len(rows) == 2 and all(512 - 32 - 30 <= x["prompt_tokens"] <= 512 - 32 for x in rows)
    bad = CliRunner().invoke(main, ["eval", "ruler", smollm2_l512, "-c", "1024", "--truncate", "-m", "ntk-mixed"])
    assert bad.exit_code != 0 and "--truncate is the baseline without a method" in bad.output
    assert "Traceback" not in bad.output
    t = CliRunner().invoke(main, ["eval", "ruler", smollm2_l512, "-c", "1024", "--truncate", "--tasks", "niah_single",
                                  "--samples", "2", "-t", str(THREADS), "--json"])
    assert t.exit_code == 0, t.output
    tr = json.loads(t.output[t.output.index("{"):])["results"]["1024"]["niah_single"]["rows"]
    assert all(x["prompt_tokens"] == 512 - 32 for x in tr)  # the last L - n_gen tokens


# --- tune ----------------------------------------------------------------------------------------------


def _text(path, seed):
    rng = np.random.default_rng(seed)
    path.write_text("".join(f"t{4 + int(i)}" for i in rng.integers(0, 6, size=400)), encoding="utf-8")
    return str(path)


def test_tune_quick_ranks_holds_out_resumes_and_writes(patched_lib, tiny, tmp_path):
    cal, held = _text(tmp_path / "cal.txt", 1), _text(tmp_path / "held.txt", 2)
    out, cache, w = tmp_path / "out", tmp_path / "cache", tmp_path / "tuned.gguf"
    args = ["tune", str(tiny.path), "-c", "128", "--text", cal, "--held-out", held, "--quick", "-o", str(out),
            "--cache", str(cache), "-q", "-t", "2", "--batch-size", "128"]
    r = CliRunner().invoke(main, args + ["-w", str(w)])
    assert r.exit_code == 0, r.output
    res = json.loads((out / "tune.json").read_text())
    trials = res["trials"]
    assert len(trials) == 8 and res["units"]["computed"] == 8 + 3 and res["units"]["cached"] == 0
    cands = [t for t in trials if t["role"] == "candidate"]
    assert {t["label"].split(" ")[0] for t in trials if t["role"] == "reference"} == {"yarn", "linear"}
    best = min(cands, key=lambda t: t["ppl_beyond"])
    assert res["chosen"] == best["setting"]  # the lowest calibration perplexity among the candidates
    assert [t["ppl_beyond"] for t in trials] == sorted(t["ppl_beyond"] for t in trials)  # ranked
    assert set(res["held_out"]) == {"chosen", "seed default", "yarn"}
    md = (out / "tune.md").read_text()
    assert res["retrieval_samples"] is None and "niah_single" not in md
    assert "(chosen)" in md and "Held-out check (held.txt" in md and "beat" in md
    # resumable: a second run computes nothing
    r2 = CliRunner().invoke(main, args)
    assert r2.exit_code == 0, r2.output
    assert json.loads((out / "tune.json").read_text())["units"] == {"computed": 0, "cached": 11, "stale": 0}
    # --report-only: the same report from the cache, computing nothing; an empty cache: one line
    base = ["tune", str(tiny.path), "-c", "128", "--text", cal, "--held-out", held, "--quick", "-q", "--report-only"]
    r3 = CliRunner().invoke(main, base + ["-o", str(tmp_path / "again"), "--cache", str(cache)])
    assert r3.exit_code == 0, r3.output
    assert (tmp_path / "again" / "tune.md").read_text() == md
    r4 = CliRunner().invoke(main, base + ["-o", str(tmp_path / "x"), "--cache", str(tmp_path / "empty")])
    assert r4.exit_code != 0 and "--report-only: yarn k=2 @ 128 cal.txt is not cached" in r4.output
    # --write: the file alone gives the chosen setting's logits
    st = ED.Setting(**{k: v for k, v in res["chosen"].items()})
    assert _logits(str(w), ED.Setting("none"), plain=True) == pytest.approx(_logits(str(tiny.path), st), abs=0)


def test_eval_ppl_attn_factor_is_llama_cpps_own_key(patched_lib, tiny, tmp_path):
    """`eval ppl --attn-factor S` (the constant attention scale tune searches) gives the perplexity
    of a copy whose {arch}.rope.scaling.attn_factor = S, read by llama.cpp itself with no override;
    S = 1 is no flag at all, S = 1.2 changes the result, S <= 0 is a one-line error."""
    from ggufrope.gguf_writer import set_keys

    txt = _text(tmp_path / "t.txt", 3)
    scaled = tmp_path / "scaled.gguf"
    set_keys(str(tiny.path), str(scaled), {"llama.rope.scaling.attn_factor": 1.2})

    def ppl(model, *flags):
        r = CliRunner().invoke(main, ["eval", "ppl", str(model), "-c", "128", "--text", txt, "-m", "ntk-mixed",
                                      "--json", "-t", "2", "--batch-size", "128", *flags])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        return out["method"], out["all"]["ppl"]

    label, with_flag = ppl(tiny.path, "--attn-factor", "1.2")
    assert label.endswith("attn×1.2")
    assert with_flag == pytest.approx(ppl(scaled)[1], rel=1e-9)
    assert ppl(tiny.path, "--attn-factor", "1")[1] == ppl(tiny.path)[1] != pytest.approx(with_flag, rel=1e-3)
    bad = CliRunner().invoke(main, ["eval", "ppl", str(tiny.path), "-c", "128", "--text", txt, "--attn-factor", "0"])
    assert bad.exit_code != 0 and "attention factor must be a number > 0" in bad.output
    assert "Traceback" not in bad.output


def test_tune_refuses_a_text_shorter_than_n_ctx_before_searching(patched_lib, tiny, tmp_path):
    """A held-out text that cannot fill one window is refused up front, not after the search."""
    short = tmp_path / "short.txt"
    short.write_text("t4t5t6" * 10, encoding="utf-8")  # 30 tokens of the tiny vocabulary (it adds no BOS)
    cache = tmp_path / "c"
    r = CliRunner().invoke(main, ["tune", str(tiny.path), "-c", "128", "--text", _text(tmp_path / "c.txt", 1),
                                  "--held-out", str(short), "--quick", "--cache", str(cache), "-q"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--held-out short.txt: 30 tokens, fewer than one window of n_ctx 128" in lines[0]
    assert not list(cache.rglob("ppl-*.json"))  # no unit computed (the model's sha256 may be cached)


def test_tune_refuses_a_context_within_L_in_one_line(patched_lib, tiny, tmp_path):
    r = CliRunner().invoke(main, ["tune", str(tiny.path), "-c", "64", "--text", _text(tmp_path / "c.txt", 1),
                                  "--held-out", _text(tmp_path / "h.txt", 2), "--cache", str(tmp_path / "c"), "-q"])
    assert r.exit_code != 0 and "within the trained context L = 64" in r.output
    assert "Traceback" not in r.output


def test_tune_any_build_reuses_units_of_another_build(patched_lib, tiny, tmp_path):
    """Units whose recorded build differs from the loaded library (a rebuild, another CPU) are
    stale and recomputed by default; --any-build reuses them and tune.md counts the units per build."""
    cal, held = _text(tmp_path / "cal.txt", 1), _text(tmp_path / "held.txt", 2)
    cache = tmp_path / "cache"
    args = ["tune", str(tiny.path), "-c", "128", "--text", cal, "--held-out", held, "--quick",
            "--cache", str(cache), "-q", "-t", "2", "--batch-size", "128"]
    r = CliRunner().invoke(main, args + ["-o", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    md = (tmp_path / "a" / "tune.md").read_text()
    assert "Units computed by" not in md  # one build: no count line
    files = sorted(p for p in cache.glob("ppl-*.json"))
    assert len(files) == 11
    for p in files[:4]:  # as if another build had computed 4 of the 11 units
        u = json.loads(p.read_text())
        u["build"] = {**u["build"], "library": "0123456789abcdef"}
        p.write_text(json.dumps(u))
    r = CliRunner().invoke(main, args + ["-o", str(tmp_path / "b"), "--any-build"])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "b" / "tune.json").read_text())
    assert res["units"] == {"computed": 0, "cached": 11, "stale": 0}
    assert sorted(res["builds"].values()) == [4, 7]
    md_b = (tmp_path / "b" / "tune.md").read_text()
    note = md_b.rstrip("\n").rsplit("\n", 1)[1]
    assert note.startswith("Units computed by: llama.cpp 0123456789abcdef (patch ") and " (4 units); llama.cpp " in note
    assert note.endswith(" (7 units).")
    assert md_b.split("\nUnits computed by")[0] == md.rstrip("\n") + "\n"  # the same numbers: nothing recomputed
    r = CliRunner().invoke(main, args + ["-o", str(tmp_path / "c")])  # default: the 4 are stale, recomputed
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "c" / "tune.json").read_text())["units"] == {"computed": 4, "cached": 7, "stale": 4}
    assert (tmp_path / "c" / "tune.md").read_text() == md
