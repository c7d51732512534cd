"""ggufrope/evaluation/passkey.py: the passkey prompt and its trials, and retrieval on the real model.

Passkey retrieval at 1024 tokens reaches >= 80 % with SmolLM2-135M-Instruct (measured:
10/10 at 512, 1024 and 2048 tokens), and the grader is not blind: the same answer graded
against another key fails. The `eval passkey` command: tests/test_eval_cli.py.
"""

from __future__ import annotations

import os

import pytest

from ggufrope.evaluation import decoder as ED, passkey as EPK

pytestmark = pytest.mark.real_model

THREADS = os.cpu_count() or 1


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


# --- the real model ------------------------------------------------------------------------------


def test_passkey_short_context_solved_and_grader_not_blind(patched_lib, smollm2):
    n_ctx = 1024
    llm = ED.load_model(smollm2, ED.Setting("none"), n_ctx, n_batch=512, threads=THREADS)
    with ED.Decoder(llm) as dec:
        r = EPK.passkey(dec, n_ctx, trials=10, seed=0)
        assert dec.reuse_prefix  # deepest key first, each trial keeping the filler it shares with the last
        dec.reuse_prefix = False
        full = EPK.passkey(dec, n_ctx, trials=5, seed=0)  # the first 5 trials, each from an empty cache
        dec.reuse_prefix = True
        # control: the answer to a prompt holding key A, graded against key B
        toks, _ = EPK.build_passkey_tokens(dec, 24680, 0.5, 256)
        answer = ED.greedy_answer(dec, toks)
    print(f"\npasskey @ {n_ctx}: {r['correct']}/{r['trials']}; by depth {r['by_depth']}")
    assert all(n_ctx - ED.DEFAULT_N_GEN - 8 <= row["prompt_tokens"] <= n_ctx - ED.DEFAULT_N_GEN for row in r["rows"])
    assert set(r["by_depth"]) == {"0", "0.25", "0.5", "0.75", "1"}
    assert r["accuracy"] >= 0.8
    saved = sum(row["reused_tokens"] for row in r["rows"]) / sum(row["prompt_tokens"] for row in r["rows"])
    assert saved > 0.1 and all(row["reused_tokens"] % 512 == 0 for row in r["rows"])
    assert all(row["reused_tokens"] == 0 for row in full["rows"])
    assert [row["answer"] for row in full["rows"]] == [row["answer"] for row in r["rows"][:5]]
    assert "24680" in answer and "13579" not in answer


def test_passkey_prompt_takes_the_most_filler_that_fits(patched_lib, smollm2):
    """build_passkey_tokens' secant estimate and bracket give the most filler sentences that fit:
    one more would not (the counts equal those of the committed units, which a walk one sentence
    at a time chose: checked at 16384 on SmolLM2 and 65536 on Gemma 3, 2026-11-28); the prompts of
    a trial set are built once per model file (a second run tokenizes nothing)."""
    llm = ED.load_model(smollm2, ED.Setting("none"), 1024, n_batch=512, threads=THREADS)
    with ED.Decoder(llm) as dec:
        for budget, depth in ((300, 0.0), (1000, 0.5), (7000, 1.0)):
            toks, n = EPK.build_passkey_tokens(dec, 31337, depth, budget)
            assert len(toks) <= budget and toks == dec.tokenize(EPK.passkey_text(31337, n, depth))
            assert len(dec.tokenize(EPK.passkey_text(31337, n + 1, depth))) > budget, (budget, n)
        ED._PROMPTS.clear()
        EPK.passkey(dec, 1024, trials=2, seed=7)
        n0 = dec.n_decoded
        real, calls = dec.tokenize, []
        dec.tokenize = lambda text, add_bos=True: calls.append(1) or real(text, add_bos)
        r = EPK.passkey(dec, 1024, trials=2, seed=7)
        assert calls == [] and dec.n_decoded > n0 and r["trials"] == 2
