"""``ggufrope tune`` end to end on a tiny model (L = 64, n_ctx 128): the ranked table, the
held-out check, resuming from the cache, and --write, whose file gives the tuned setting's logits
bit for bit without any override (the attention factor through llama.cpp's own
rope.scaling.attn_factor key)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from ggufrope.cli import main
from ggufrope.evaluation import decoder as ED
from ggufrope.evaluation import tune as T

L = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import write_tiny_llama

    extra = {"tokenizer.ggml.add_space_prefix": False}  # texts of the vocabulary's pieces t4..t9
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama.gguf", seed=7, extra_kv=extra)


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


def _logits(path, setting, plain=False):
    toks = np.random.default_rng(3).integers(4, 10, size=128).tolist()
    if plain:  # no override at all: what the file says
        from ggufrope.runtime import load

        llm = load(path, n_ctx=128, n_batch=128, n_ubatch=128, n_threads=2, n_threads_batch=2, verbose=False,
                   type_k=0, type_v=0, flash_attn=False)
    else:
        llm = ED.load_model(path, setting, 128, n_batch=128, threads=2, flash_attn=False, type_k=0, type_v=0)
    with ED.Decoder(llm) as dec:
        buf = np.empty((128, dec.n_vocab))

        def take(rows, logits):
            buf[rows] = logits

        dec.decode(toks, 0, range(128), take)
    return buf.ravel().tolist()


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


def test_tune_refuses_a_context_within_L_in_one_line(patched_lib, tiny, tmp_path):
    r = CliRunner().invoke(main, ["tune", str(tiny.path), "-c", "64", "--text", _text(tmp_path / "c.txt", 1),
                                  "--held-out", _text(tmp_path / "h.txt", 2), "--cache", str(tmp_path / "c"), "-q"])
    assert r.exit_code != 0 and "within the trained context L = 64" in r.output
    assert "Traceback" not in r.output


@pytest.mark.real_model
def test_published_tune_is_the_cached_units(patched_lib, smollm2, tmp_path):
    """docs/results/tune/*/tune.md (quoted in docs/results.md) is what `ggufrope tune --report-only`
    writes from the units committed in docs/results/cache: the search and the held-out check redone,
    nothing typed by hand."""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "docs" / "results" / "cache", tmp_path / "cache",
                    ignore=shutil.ignore_patterns("model-sha256.json"))
    pub = root / "docs" / "results" / "tune" / "smollm2-16384"
    meta = json.loads((pub / "tune.json").read_text())
    assert meta["n_ctx"] == 16384 and meta["texts"] == ["loc_workshop"] and meta["held_out_texts"] == ["docutils_manual"]
    r = CliRunner().invoke(main, ["tune", smollm2, "-c", "16384", "--cache", str(tmp_path / "cache"), "-q",
                                  "--report-only", "-o", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "out" / "tune.md").read_text() == (pub / "tune.md").read_text()
    results_md = (root / "docs" / "results.md").read_text()
    for line in (pub / "tune.md").read_text().splitlines():
        if line.startswith("| ") and ("(chosen)" in line or "seed default" in line or "yarn" in line):
            assert line in results_md, line
