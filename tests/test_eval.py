"""The evaluation code (the package ggufrope/evaluation, `ggufrope eval ...`) on the real model at short contexts.

a. Perplexity of method `none` at n_ctx <= L agrees within 1 % (in fact to ~1e-4) with
   llama.cpp's `llama-perplexity` protocol on the same tokens and windows. There is no
   llama-perplexity binary in this build, so the protocol of tools/perplexity/perplexity.cpp
   (tokenize the whole text once with the vocabulary's special prefix, windows of n_ctx tokens,
   first token -> BOS when the vocabulary adds BOS, score the second half: logits at p predict
   token p + 1 for n_ctx/2 <= p <= n_ctx - 2) is re-implemented here the straightforward way:
   stock `llama_cpp.Llama(logits_all=True)` (not through ggufrope.runtime; flash attention on,
   as llama-perplexity's "auto" resolves on the CPU; one n_ctx-sized batch) and `.eval()` on
   each window, then a float64 log-softmax over every row. The evaluation under test takes a
   different path (runtime.load, the low-level llama_batch with logits only at scored
   positions, 128-token batches). Note: flash attention itself moves this model's per-token
   NLL by up to ~0.36 nats and the perplexity by ~0.5 %, so compare like with like.
   Building the real llama-perplexity tool and comparing with its printed value is the
   stronger check.
b. Passkey retrieval at 1024 tokens reaches >= 80 % with SmolLM2-135M-Instruct (measured:
   10/10 at 512, 1024 and 2048 tokens), and the grader is not blind: the same answer graded
   against another key fails.
c. Every method reaches the library: logits differ from `none` and from each other at every
   position > 0 and agree where the math says they must (position 0; ntk-mixed with k = 1;
   log-n below L), so a silently ignored override cannot pass.
d. `ggufrope eval compare` on a tiny grid writes results.json, results.md and ppl.png, and
   resumes from its cache (a second run computes nothing; a deleted unit is recomputed alone).
"""

from __future__ import annotations

import json
import os
import math

import numpy as np
import pytest

from ggufrope.evaluation import cli as ECLI, decoder as ED, grid as EG, passkey as EPK, ppl as EP, report as ER
from ggufrope.errors import GGUFRopeError

pytestmark = pytest.mark.real_model

THREADS = os.cpu_count() or 1


@pytest.fixture(scope="module")
def text_slice():
    """A tiny slice of a real corpus document (Hamlet, First Folio): ~2,800 tokens."""
    from ggufrope.corpus import load_text

    return load_text("hamlet")[20_000:30_000]


# --- no model needed ------------------------------------------------------------------------------


def test_passkey_prompt_format():
    t = EPK.passkey_text(12345, 12, 0.5)
    lines = t.split("\n")
    assert lines[0] == ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
                        "I will quiz you about the important information there.")
    assert lines[1] == " ".join(["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                                 "There and back again.", "The grass is green."])
    assert lines[2] == "The pass key is 12345. Remember it. 12345 is the pass key."
    assert lines[-1] == "What is the pass key? The pass key is"
    assert EPK.passkey_text(1, 10, 0.0).split("\n")[1].startswith("The pass key is 1.")
    assert EPK.passkey_text(1, 10, 1.0).split("\n")[-2].startswith("The pass key is 1.")
    trials = EPK.passkey_trials(7, seed=3, depths=EPK.DEFAULT_DEPTHS)
    assert trials == EPK.passkey_trials(7, seed=3, depths=EPK.DEFAULT_DEPTHS)  # fixed seed
    assert all(10000 <= k <= 99999 for k, _ in trials)
    assert [d for _, d in trials] == [0.0, 0.25, 0.5, 0.75, 1.0, 0.0, 0.25]
    assert EPK.depth_bucket(0.13) == 0.25 and EPK.depth_bucket(0.1) == 0.0


def test_token_nll_is_float64_log_softmax():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((300, 1000)) * 20).astype(np.float32)
    t = rng.integers(0, 1000, 300)
    x64 = x.astype(np.float64)
    ref = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1) - x64[np.arange(300), t]
    np.testing.assert_allclose(ED.token_nll(x, t, block=64), ref, rtol=1e-12)


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


# --- a. perplexity against llama-perplexity's protocol ---------------------------------------------


def reference_llama_perplexity(model_path, text: str, n_ctx: int, n_chunks: int) -> tuple[float, np.ndarray]:
    """llama-perplexity's default mode, written out with stock llama_cpp.Llama(logits_all=True)."""
    import llama_cpp

    # llama-perplexity's defaults on the CPU: flash attention "auto" resolves to on; n_batch
    # 2048 >= n_ctx, so each window is one batch
    llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, logits_all=True,
                          flash_attn=True, n_threads=THREADS, n_threads_batch=THREADS, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    add_bos = llama_cpp.llama_vocab_get_add_bos(vocab)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)  # common_tokenize(.., true)
    assert len(tokens) >= n_chunks * n_ctx
    first = n_ctx // 2
    nlls = []
    for i in range(n_chunks):
        chunk = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if add_bos:
            chunk[0] = llama_cpp.llama_vocab_bos(vocab)
        llm.reset()
        llm.eval(chunk)
        logits = np.array(llm.scores[:n_ctx], dtype=np.float64)
        for j in range(first, n_ctx - 1):
            row = logits[j]
            m = row.max()
            nlls.append(m + math.log(np.exp(row - m).sum()) - row[chunk[j + 1]])
    nlls = np.array(nlls)
    return math.exp(nlls.mean()), nlls


def test_ppl_matches_llama_perplexity_protocol(patched_lib, smollm2, text_slice):
    n_ctx, n_chunks = 512, 2
    ref_ppl, ref_nll = reference_llama_perplexity(smollm2, text_slice, n_ctx, n_chunks)

    llm = ED.load_model(smollm2, ED.Setting("none"), n_ctx, n_batch=128, threads=THREADS)
    with ED.Decoder(llm) as dec:
        per_token: list = []
        ws = EP.perplexity(dec, dec.tokenize(text_slice), n_ctx, ED.n_ctx_orig_of(smollm2), max_windows=n_chunks,
                           per_token=per_token)
    ours = np.concatenate([nll for _, nll in per_token])
    assert all((pos == np.arange(n_ctx // 2, n_ctx - 1)).all() for pos, _ in per_token)
    s = EP.summarize_windows(ws)
    assert s["n_windows"] == n_chunks and s["count"] == n_chunks * (n_ctx - n_ctx // 2 - 1) == len(ref_nll)
    assert s["ppl_beyond"] is None and s["count_beyond"] == 0  # n_ctx <= L: nothing beyond L
    rel = abs(s["ppl"] - ref_ppl) / ref_ppl
    print(f"\nppl: batched {s['ppl']:.5f}, llama-perplexity protocol {ref_ppl:.5f}, rel. diff {rel:.2e}; "
          f"max |nll diff| per token {np.abs(ours - ref_nll).max():.2e}")
    assert rel < 0.01
    # same kernels, different batching (one batch vs 128-token batches, all logits vs scored only):
    # the same value token by token (measured: bit-identical)
    assert np.abs(ours - ref_nll).max() < 1e-4
    assert 5 < s["ppl"] < 500  # a real language model on real text


# --- b. passkey --------------------------------------------------------------------------------------


def test_passkey_short_context_solved_and_grader_not_blind(patched_lib, smollm2):
    n_ctx = 1024
    llm = ED.load_model(smollm2, ED.Setting("none"), n_ctx, n_batch=512, threads=THREADS)
    with ED.Decoder(llm) as dec:
        r = EPK.passkey(dec, n_ctx, trials=10, seed=0)
        # control: the answer to a prompt holding key A, graded against key B
        toks, _ = EPK.build_passkey_tokens(dec, 24680, 0.5, 256)
        answer = ED.greedy_answer(dec, toks)
    print(f"\npasskey @ {n_ctx}: {r['correct']}/{r['trials']}; by depth {r['by_depth']}")
    assert all(n_ctx - ED.DEFAULT_N_GEN - 8 <= row["prompt_tokens"] <= n_ctx - ED.DEFAULT_N_GEN for row in r["rows"])
    assert set(r["by_depth"]) == {"0", "0.25", "0.5", "0.75", "1"}
    assert r["accuracy"] >= 0.8
    assert "24680" in answer and "13579" not in answer


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


# --- c. every method reaches the library --------------------------------------------------------------

N_C = 160  # tokens evaluated per configuration
L_SHORT = 100  # log-n's L, lowered through llama.cpp's own yarn_orig_ctx parameter


@pytest.fixture(scope="module")
def all_logits(patched_lib, smollm2, text_slice):
    """Logits at every position of the same N_C tokens of real text, per configuration."""
    cfgs = {
        "none": (ED.Setting("none"), {}),
        "none again": (ED.Setting("none"), {}),
        "linear": (ED.Setting("linear", 2.0), {}),
        "yarn": (ED.Setting("yarn", 2.0), {}),
        "ntk": (ED.Setting("ntk", 2.0), {}),
        "ntk-fixed": (ED.Setting("ntk-fixed", 2.0), {}),
        "ntk-mixed": (ED.Setting("ntk-mixed", 2.0, 0.625), {}),
        "ntk-mixed b=0.4": (ED.Setting("ntk-mixed", 2.0, 0.4), {}),
        "ntk-mixed b=1": (ED.Setting("ntk-mixed", 2.0, 1.0), {}),
        "ntk-mixed k=1": (ED.Setting("ntk-mixed", 1.0, 0.625), {}),
        "none+logn": (ED.Setting("none", logn=True), {}),  # L = 8192: no position reaches it
        "none+logn L=100": (ED.Setting("none", logn=True), {"yarn_orig_ctx": L_SHORT}),
    }
    out = {}
    toks = None
    for name, (st, kw) in cfgs.items():
        llm = ED.load_model(smollm2, st, N_C, n_batch=N_C, threads=THREADS, **kw)
        with ED.Decoder(llm) as dec:
            if toks is None:
                toks = dec.tokenize(text_slice)[:N_C]
            buf = np.empty((N_C, dec.n_vocab), dtype=np.float32)

            def take(rows, logits, buf=buf):
                buf[rows] = logits

            dec.clear()
            dec.decode(toks, 0, range(N_C), take)
        out[name] = buf
        del llm
    return out


def _maxdiff(a, b):
    return np.abs(a.astype(np.float64) - b).max(axis=1)  # per position


def test_methods_differ_where_they_must(all_logits):
    moved = ["linear", "yarn", "ntk", "ntk-fixed", "ntk-mixed", "ntk-mixed b=0.4"]
    for i, a in enumerate(["none"] + moved):
        for b in moved[i:]:
            if a == b:
                continue
            d = _maxdiff(all_logits[a], all_logits[b])
            assert d[0] == 0.0, f"{a} vs {b} at position 0: rope is the identity there"
            assert d[1:].min() > 1e-3, f"{a} vs {b}: logits equal at position {int(np.argmin(d[1:])) + 1}"


def test_methods_agree_where_they_must(all_logits):
    none = all_logits["none"]
    assert np.array_equal(none, all_logits["none again"])  # the engine is deterministic
    assert np.array_equal(none, all_logits["ntk-mixed k=1"])  # every ff_i = exp(0) = 1
    assert np.array_equal(none, all_logits["none+logn"])  # every position < L = 8192
    # b = 1 is ntk-fixed: a*(i+1) with a = ln k / (d/2) is (i+1) ln lambda (float rounding only)
    close = _maxdiff(all_logits["ntk-mixed b=1"], all_logits["ntk-fixed"]).max()
    apart = _maxdiff(all_logits["ntk-mixed"], all_logits["ntk-fixed"]).max()
    assert close < 0.05 * apart, (close, apart)


def test_logn_changes_exactly_the_positions_beyond_L(all_logits):
    d = _maxdiff(all_logits["none"], all_logits["none+logn L=100"])
    assert (d[:L_SHORT] == 0).all(), f"log-n changed positions < L: {np.nonzero(d[:L_SHORT])[0]}"
    assert d[L_SHORT:].min() > 1e-4, f"log-n left position {L_SHORT + int(np.argmin(d[L_SHORT:]))} unchanged"


# --- d. compare: outputs and resuming ------------------------------------------------------------------


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
    assert "| Baseline |" in md and "| NTK-RoPE-mixed (b=0.625) |" in md and "ggufrope eval compare" in md
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
    assert "| YaRN | – / – |" in (out / "results.md").read_text()


def test_eval_cli_errors_are_one_line(smollm2):
    from click.testing import CliRunner

    from ggufrope.cli import main

    r = CliRunner().invoke(main, ["eval", "ppl", str(smollm2), "--n-ctx", "256", "--text", "no-such-document"])
    assert r.exit_code == 2 and "ggufrope: error:" in r.output and "neither a file nor a corpus document" in r.output
    r = CliRunner().invoke(main, ["eval", "compare", str(smollm2), "--methods", "rope9"])
    assert r.exit_code == 2 and "unknown method" in r.output


# --- e. the published results are what the cache holds ------------------------------------------


def test_published_results_are_the_cached_units(smollm2, tmp_path):
    """docs/results/results.json and the table in docs/results.md are regenerated, with
    --report-only, from the raw per-unit results committed in docs/results/cache: nothing in the
    published table is typed by hand or left over from another model, text or grid."""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pub = json.loads((root / "docs" / "results" / "results.json").read_text(encoding="utf-8"))
    g = pub["grid"]
    shutil.copytree(root / "docs" / "results" / "cache", tmp_path / "cache",
                    ignore=shutil.ignore_patterns("model-sha256.json"))
    texts = EP.resolve_texts([t["name"] for t in g["texts"]])
    assert [t.sha256 for t in texts] == [t["sha256"] for t in g["texts"]]
    res, stats = EG.run_compare(
        smollm2, n_ctxs=g["n_ctx"], methods=g["methods"], logn_modes=g["logn"], factor=g["factor"],
        exponent=g["exponent"], texts=texts, max_windows=g["max_windows"], score_from=g["score_from"],
        trials=g["trials"], seed=g["seed"], depths=g["depths"], n_gen=g["n_gen"], out_dir=tmp_path / "out",
        cache_dir=tmp_path / "cache", report_only=True, progress=False,
    )
    assert stats.computed == 0 and stats.cached == pub["units"]["cached"] > 0
    assert res["cells"] == pub["cells"]
    md = (root / "docs" / "results.md").read_text(encoding="utf-8")
    rows = [line for line in ER.markdown_table(res).splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(g["methods"]) * len(g["logn"])
    for line in rows:
        assert line in md, line


def _published_dynamic_reports():
    from pathlib import Path

    return sorted((Path(__file__).resolve().parents[1] / "docs" / "results" / "dynamic").glob("*/results.json"))


@pytest.mark.parametrize("report", _published_dynamic_reports(), ids=lambda p: p.parent.name)
def test_published_dynamic_reports_are_the_cached_units(smollm2, tmp_path, report):
    """The dynamic-k tables of docs/results.md (issue 13; `make results-dynamic-report`) are
    regenerated with --report-only from the committed units: every table row quoted in
    docs/results.md is the one the cache gives."""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    pub = json.loads(report.read_text(encoding="utf-8"))
    g = pub["grid"]
    shutil.copytree(root / "docs" / "results" / "cache", tmp_path / "cache",
                    ignore=shutil.ignore_patterns("model-sha256.json"))
    texts = EP.resolve_texts([t["name"] for t in g["texts"]])
    res, stats = EG.run_compare(
        smollm2, n_ctxs=g["n_ctx"], methods=g["methods"], logn_modes=g["logn"], dynamic_modes=g["dynamic"],
        dynamic_ratio=g.get("dynamic_ratio"), factor=g["factor"], exponent=g["exponent"], texts=texts, max_windows=g["max_windows"],
        score_from=g["score_from"], trials=g["trials"], seed=g["seed"], depths=g["depths"], n_gen=g["n_gen"],
        out_dir=tmp_path / "out", cache_dir=tmp_path / "cache", report_only=True, progress=False,
    )
    assert stats.computed == 0 and stats.cached == pub["units"]["cached"] > 0
    assert res["cells"] == pub["cells"]
    md = (root / "docs" / "results.md").read_text(encoding="utf-8")
    table = (report.parent / "results.md").read_text(encoding="utf-8")
    for line in ER.markdown_table(res).splitlines():
        if line.startswith("| "):
            assert line in table, line
            assert line in md, line


# --- f. the factor k the evaluation applies --------------------------------------------------------


def test_eval_passes_its_k_and_checks_the_one_in_use(patched_lib, tmp_path, monkeypatch):
    """The grid's rule, on a tiny model (L = 64) at an n_ctx that is not a multiple of 256: every
    method that takes k gets k = n_ctx / L = 3.125 explicitly (not the library's auto, which would
    be 256 / 64 = 4 here), the k read back from the context is that one, and a library that
    applied another k would be caught."""
    from tiny_models import write_tiny_llama

    from ggufrope import runtime

    m = write_tiny_llama(tmp_path / "t.gguf", seed=4)
    for st in (ED.Setting("ntk-mixed"), ED.Setting("ntk", logn=True), ED.Setting("linear"), ED.Setting("yarn")):
        llm = ED.load_model(m.path, st, 200, threads=2)
        assert llm.ggufrope.factor == 3.125 and not llm.ggufrope.auto, st
        assert st.label(200, 64).endswith("k=3.125" + (" + log-n" if st.logn else ""))
        del llm
    llm = ED.load_model(m.path, ED.Setting("none", logn=True), 200, threads=2)
    assert llm.ggufrope.factor is None
    del llm
    monkeypatch.setattr(runtime, "factor_in_use", lambda llm: 4.0)
    with pytest.raises(GGUFRopeError, match="llama.cpp applies k = 4.0 where k = 3.125 was passed"):
        ED.load_model(m.path, ED.Setting("ntk-mixed"), 200, threads=2)
