"""RULER-lite (ggufrope/evaluation/ruler.py): the generators against RULER's task definitions,
the scorer against hand-computed values, and every task on the real model at a short context
(within L), with the shuffled control and the truncation baseline. The `eval ruler` command:
tests/test_eval_cli.py; compare's retrieval table: tests/test_eval_grid.py.

References: RULER (Hsieh et al. 2024), github.com/NVIDIA/RULER scripts/data/synthetic/*.py and
scripts/eval/synthetic/constants.py (string_match_all). The expected values below are written
from those definitions, not from the code under test.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ggufrope.errors import GGUFRopeError
from ggufrope.evaluation import ruler as R

THREADS = os.cpu_count() or 1


# --- generators: deterministic, and shaped as RULER defines the tasks ---------------------------


@pytest.mark.parametrize("task", R.TASKS)
def test_generator_is_deterministic_and_seeded(task):
    a = R.make_sample(task, 0, 3, 200)
    assert a == R.make_sample(task, 0, 3, 200)
    assert a.message != R.make_sample(task, 1, 3, 200).message  # another seed, another sample
    assert a.message != R.make_sample(task, 0, 4, 200).message  # another index, another sample
    assert a.gold and all(g for g in a.gold)


def test_niah_single_one_needle_with_a_seven_digit_value_in_the_noise():
    s = R.make_sample("niah_single", 0, 0, 300)
    (value,) = s.gold
    assert re.fullmatch(r"[1-9]\d{6}", value)
    lines = s.message.split("\n")
    needles = [ln for ln in lines if ln.startswith("One of the special magic numbers for ")]
    assert len(needles) == 1 and needles[0].endswith(f" is: {value}.")
    key = needles[0][len("One of the special magic numbers for "):].split(" is: ")[0]
    assert re.fullmatch(r"[a-z]+-[a-z]+", key)  # adjective-noun, as RULER's wonderwords keys
    assert lines.count("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.") == 300
    assert lines[-1] == f"What is the special magic number for {key} mentioned in the provided text?"
    assert s.answer_prefix == f" The special magic number for {key} mentioned in the provided text is"
    assert s.message.count(value) == 1
    # the needle sits where the depth says
    assert lines.index(needles[0]) - 1 == round(s.depth * 300)


@pytest.mark.parametrize("task,pat", [("niah_multikey", r"[1-9]\d{6}"),
                                      ("niah_multikey_uuid", r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")])
def test_niah_multikey_every_line_is_a_needle_only_one_for_the_query(task, pat):
    s = R.make_sample(task, 2, 1, 120)
    kind = "uuids" if "uuid" in task else "numbers"
    lines = s.message.split("\n")[1:-1]
    assert len(lines) == 121
    keys = []
    for ln in lines:
        m = re.fullmatch(rf"One of the special magic {kind} for (\S+) is: ({pat})\.", ln)
        assert m, ln
        keys.append(m.group(1))
    query = re.search(r"for (\S+) mentioned", s.answer_prefix).group(1)
    assert keys.count(query) == 1  # the distractors never reuse the queried key
    assert lines[keys.index(query)].endswith(f" is: {s.gold[0]}.")


def test_vt_one_chain_of_four_hops_after_a_worked_example():
    s = R.make_sample("vt", 0, 0, 200)
    assert len(s.gold) == 5 and all(re.fullmatch(r"[A-Z]{5}", v) for v in s.gold)
    example, task = s.message.split("\n\n", 2)[0:2], s.message.split("\n\n")[-2:]
    body = s.message[s.message.rindex("Memorize and track"):]
    assigns = re.findall(r"^VAR ([A-Z]{5}) = (.+)$", body, flags=re.M)
    assert len(assigns) == 5
    value = re.search(r"assigned the value (\d{5}) in the text above", body).group(1)
    # follow the chain from the value as a reader would
    chain = {a: b for a, b in assigns}
    found = [a for a, b in assigns if b == value]
    while len(found) < 5:
        nxt = [a for a, b in chain.items() if b == f"VAR {found[-1]}"]
        assert len(nxt) == 1
        found.append(nxt[0])
    assert tuple(found) == s.gold
    assert s.answer_prefix.startswith(" Answer: According to the chain(s) of variable assignment in the text above, 5 ")
    # the worked example carries its own answer (5 names) before the task
    head = s.message[: s.message.rindex("Memorize and track")]
    assert re.search(r"they are: ([A-Z]{5} ){4}[A-Z]{5}\n", head)
    del example, task


@pytest.mark.parametrize("long,common,rare", [(False, 6, 1), (True, 30, 3)])
def test_cwe_ten_words_repeated_more_than_the_rest(long, common, rare):
    s = R.make_sample("cwe", 0, 0, 60, long=long)
    listing = s.message.split("\n")[-2]
    words = re.findall(r"\d+\. ([a-z]+)", listing)
    c = Counter(words)
    assert len(s.gold) == 10 and all(c[g] == common for g in s.gold)
    assert all(n == rare for w, n in c.items() if w not in s.gold)
    assert len(c) == 60
    # numbered 1..N in order
    assert re.findall(r"(\d+)\. ", listing) == [str(i) for i in range(1, len(words) + 1)]


def test_fwe_zipf_counts_and_the_dots_excluded():
    s = R.make_sample("fwe", 0, 0, 3000)
    body = s.message.split("coded words. ", 1)[1].split("\nQuestion:")[0]
    c = Counter(body.split())
    # Zipf with alpha = 2: count(rank r) = int(3000 r^-2 / zeta(2)), zeta(2) = pi^2/6 = 1.6449
    assert c["..."] == 1823  # int(3000 / 1.644934)
    assert [c[g] for g in s.gold] == [455, 202, 113]  # int(3000/4/1.6449), int(3000/9/...), int(3000/16/...)
    assert c.most_common(4)[0][0] == "..." and tuple(w for w, _ in c.most_common(4)[1:]) == s.gold


def test_unknown_task_and_bad_size_are_one_line_errors():
    with pytest.raises(GGUFRopeError, match="unknown RULER-lite task 'qa'"):
        R.make_sample("qa", 0, 0, 10)
    with pytest.raises(GGUFRopeError, match="--tasks: unknown nope"):
        R.parse_tasks("niah_single,nope")
    assert R.parse_tasks("all") == list(R.TASKS)
    assert R.parse_tasks("vt, vt,cwe") == ["vt", "cwe"]


# --- scoring: RULER's string_match_all ----------------------------------------------------------


def test_score_is_string_match_all():
    assert R.score(" 1234567.", ["1234567"]) == 1.0
    assert R.score("ABCDE, FGHIJ", ["abcde", "fghij", "klmno", "pqrst", "uvwxy"]) == 0.4  # 2 of 5, any case
    assert R.score("nothing here", ["x1"]) == 0.0
    # the control pairs answer i with the gold of i + 1
    # "a b" vs ["b"]: 1, "c" vs ["c"]: 1, "d" vs ["a"]: 0
    assert R.shuffled_control(["a b", "c", "d"], [["a"], ["b"], ["c"]]) == pytest.approx(100 * 2 / 3)
    assert R.shuffled_control(["7"], [["7"]]) == 0.0


def test_truncate_keeps_the_end_and_bos():
    assert R.truncate([9, 1, 2, 3, 4, 5], 3, None) == [3, 4, 5]
    assert R.truncate([9, 1, 2, 3, 4, 5], 3, 9) == [9, 4, 5]
    assert R.truncate([9, 1, 2], 5, 9) == [9, 1, 2]


# --- the real model (SmolLM2-135M-Instruct, L = 8192), within L ---------------------------------

N_CTX = 2048
SAMPLES = 10


@pytest.fixture(scope="module")
def dec(patched_lib, smollm2):
    from ggufrope.evaluation.decoder import Decoder, Setting, load_model

    llm = load_model(smollm2, Setting("none"), N_CTX, n_batch=512, threads=THREADS)
    with Decoder(llm) as d:
        yield d


@pytest.mark.real_model
def test_prompts_fill_the_context_in_the_chat_template(dec):
    p = R.Prompter(dec.llm)
    assert p.chat  # SmolLM2-Instruct ships a chat template: ChatML markers
    s, toks = R.fit_sample(p, "niah_single", 0, 0, N_CTX - 32)
    text = p.text(s)
    assert text.startswith("<|im_start|>") and "<|im_start|>assistant\n" in text
    assert text.endswith("mentioned in the provided text is")
    assert N_CTX - 32 - 30 <= len(toks) <= N_CTX - 32  # one more line of noise would not fit
    bigger = R.make_sample("niah_single", 0, 0, s.size + 1)
    assert len(p.tokens(bigger)) > N_CTX - 32
    assert R.fit_sample(p, "niah_single", 0, 0, N_CTX - 32)[1] == toks  # deterministic


#: the context of each task's CI test (niah_single at 2048, as the issue asks; the rest at 1024 to keep
#: CI short) and the score measured on this project's machine (2026-11-23, 2-core AMD EPYC, CPU build,
#: 10 samples, seed 0). SmolLM2-135M finds a single needle every time but fails the harder tasks even
#: within L; the bounds leave room for another CPU's float rounding, not for another result.
CTX = {"niah_single": 2048, "niah_multikey": 1024, "niah_multikey_uuid": 1024, "vt": 1024, "cwe": 1024, "fwe": 1024}
MEASURED = {"niah_single": 100.0, "niah_multikey": 30.0, "niah_multikey_uuid": 10.0, "vt": 4.0, "cwe": 9.0,
            "fwe": 40.0}
_RUNS: dict = {}


def _run(dec, task, **kw):
    key = (task, tuple(sorted(kw.items())))
    if key not in _RUNS:
        _RUNS[key] = R.run_task(dec, task, CTX[task], samples=SAMPLES, seed=0, **kw)
    return _RUNS[key]


@pytest.mark.real_model
@pytest.mark.parametrize("task", R.TASKS)
def test_task_on_the_real_model_within_L(dec, task):
    n_ctx = CTX[task]
    r = _run(dec, task)
    print(f"\n{task} @ {n_ctx}: score {r['score']:.1f} %, shuffled control {r['control']:.1f} %; answers "
          + " | ".join(repr(x["answer"][:40]) for x in r["rows"][:3]))
    assert r["samples"] == SAMPLES
    assert all(n_ctx - R.N_GEN[task] - 200 <= x["prompt_tokens"] <= n_ctx - R.N_GEN[task] for x in r["rows"])
    assert r["control"] <= 10.0  # answers graded against another sample's gold: near zero
    if task == "niah_single":
        assert r["score"] >= 80.0  # the within-L bar
    m = MEASURED[task]
    if m is not None:
        assert abs(r["score"] - m) <= 20.0


@pytest.mark.real_model
def test_truncation_baseline_cannot_answer_what_it_cut(dec):
    """The same niah_single prompts cut to their last 1024 tokens: where the needle's value is no
    longer in the prompt the answer is wrong (a random 7-digit number cannot be guessed); where it
    is, the model still finds it."""
    full = _run(dec, "niah_single")
    cut = _run(dec, "niah_single", keep_last=1024)
    p = R.Prompter(dec.llm)
    kept_any = cut_any = False
    for i, (a, b) in enumerate(zip(full["rows"], cut["rows"])):
        assert b["prompt_tokens"] == 1024 - R.N_GEN["niah_single"]
        s, toks = R.fit_sample(p, "niah_single", 0, i, N_CTX - R.N_GEN["niah_single"])
        kept = R.truncate(toks, 1024 - R.N_GEN["niah_single"], None)
        visible = s.gold[0] in dec.llm.detokenize(kept).decode("utf-8", "replace")
        if visible:
            kept_any = True
        else:
            cut_any = True
            assert b["score"] == 0.0, (i, b["answer"])
    assert kept_any and cut_any  # depths are spread: both cases occur in 10 samples
    assert cut["score"] < full["score"]


@pytest.mark.real_model
def test_prefix_reuse_gives_the_answers_of_full_prefills(dec):
    """The CI run of niah_single keeps, for each prompt, the filler it shares with the one before
    (deepest needle first; Decoder.reuse_prefix, on for this CPU build) up to a batch boundary:
    the first 4 samples prefilled from an empty cache give the same answers, and reuse saved a
    part of the prefill (at 2048 tokens and n_batch 512, the cut to a batch boundary costs much
    of it)."""
    r = _run(dec, "niah_single")
    assert dec.reuse_prefix
    rows = r["rows"]
    saved = sum(x["reused_tokens"] for x in rows) / sum(x["prompt_tokens"] for x in rows)
    deepest = max(rows, key=lambda x: x["depth"])
    print(f"\nniah_single @ {CTX['niah_single']}: prefix reuse kept {100 * saved:.0f} % of the prompt tokens")
    assert deepest["reused_tokens"] == 0 and saved > 0.1
    assert all(x["reused_tokens"] % dec.n_batch == 0 for x in rows)  # kept up to a batch boundary
    dec.reuse_prefix = False
    try:
        full = R.run_task(dec, "niah_single", CTX["niah_single"], samples=4, seed=0)
    finally:
        dec.reuse_prefix = True
    assert all(x["reused_tokens"] == 0 for x in full["rows"])
    assert [x["answer"] for x in full["rows"]] == [x["answer"] for x in rows[:4]]


@pytest.mark.real_model
@pytest.mark.parametrize("task", R.TASKS)
def test_fit_sample_takes_the_largest_haystack_that_fits(dec, task):
    """fit_sample's secant estimate and bracket give the largest haystack whose prompt fits the
    budget: one more line of haystack would not fit (with the long variants above 4096 tokens).
    The sizes equal those of the committed units, which a bisection over [1, 2 x budget /
    tokens-per-size] chose (checked at 16384 and 32768 tokens on SmolLM2 and at 65536 and 131072
    on Gemma 3 when the estimate replaced it, 2026-11-28)."""
    p = R.Prompter(dec.llm)
    for budget in (1000, N_CTX - R.N_GEN[task], 6000):
        s, toks = R.fit_sample(p, task, 1, 2, budget)
        assert len(toks) <= budget, (task, budget)
        bigger = R.make_sample(task, 1, 2, s.size + 1, long=budget > 4096)
        assert len(p.tokens(bigger)) > budget, (task, budget, s.size)


@pytest.mark.real_model
def test_prompts_are_built_once_per_model_file_and_recipe(dec, monkeypatch):
    """The cells of a grid (a model loaded per setting) and the truncation baseline build the same
    prompts: the second run tokenizes nothing, with the same prompts; another seed builds anew."""
    from ggufrope.evaluation import decoder as ED

    calls = []
    real = R.Prompter.tokens
    monkeypatch.setattr(R.Prompter, "tokens", lambda self, s: calls.append(s.size) or real(self, s))
    monkeypatch.setattr(ED, "_PROMPTS", type(ED._PROMPTS)())
    first = R.run_task(dec, "vt", 1024, samples=2, seed=5)
    assert calls
    calls.clear()
    again = R.run_task(dec, "vt", 1024, samples=2, seed=5)
    cut = R.run_task(dec, "vt", 1024, samples=2, seed=5, keep_last=512)
    assert calls == []
    assert [r["prompt_tokens"] for r in again["rows"]] == [r["prompt_tokens"] for r in first["rows"]]
    assert [r["answer"] for r in again["rows"]] == [r["answer"] for r in first["rows"]]
    assert all(r["prompt_tokens"] == 512 - R.N_GEN["vt"] for r in cut["rows"])
    R.run_task(dec, "vt", 1024, samples=1, seed=6)
    assert calls  # another recipe: built


@given(a=st.integers(20, 400), per=st.integers(1, 40), wobble=st.integers(0, 9), first=st.sampled_from([0, 1]),
       budget=st.integers(0, 200_000))
@settings(max_examples=300, deadline=None)
def test_largest_fitting_is_the_largest_size_that_fits(a, per, wobble, first, budget):
    """largest_fitting against its definition, max{n >= first: length(n) <= budget}, found by a
    scan, for non-decreasing lengths that grow nearly linearly (a fixed part, a per-size part and
    a rounding wobble, as a tokenizer gives) and every budget the first size fits."""
    def length(n):
        return a + per * n + (n * wobble) // 7

    if length(first) > budget:
        return
    # the scan starts at a size that fits for sure (length(n) <= a + (per + wobble / 7) n)
    want = max(first, int((budget - a) / (per + wobble / 7)) - 1)
    assert length(want) <= budget
    while length(want + 1) <= budget:
        want += 1
    assert R.largest_fitting(length, budget, first, 64) == want


def test_largest_fitting_evaluates_few_full_lengths():
    """On a 131,072-token budget with 25 tokens a size (niah_single's line), a handful of
    evaluations, each counted."""
    seen = []

    def length(n):
        seen.append(n)
        return 300 + 25 * n + n // 3

    n = R.largest_fitting(length, 131_040, 1, 64)
    assert length(n) <= 131_040 < length(n + 1)
    assert len(set(seen) - {1, 64, n + 1}) <= 6, sorted(set(seen))
