"""Passkey retrieval: the prompt with a 5-digit key hidden at a depth of the filler, and its
greedy, graded trials.

The prompt is the one of Mohtashami & Jaggi (2023), as in the PI and YaRN papers: a task line,
the filler "The grass is green. The sky is blue. ..." repeated, the line "The pass key is
12345. Remember it. 12345 is the pass key." at a depth in [0, 1] of the filler, then "What is
the pass key? The pass key is"; the prompt fills the context less the tokens to generate, the
answer is decoded greedily (:func:`ggufrope.evaluation.decoder.greedy_answer`) and counts as
correct when the 5-digit key appears in it.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import GGUFRopeError
from .decoder import DEFAULT_N_GEN, Decoder, answer_order, greedy_answer, memo_prompt

PASSKEY_TASK = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there."
)
PASSKEY_FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
PASSKEY_QUESTION = "What is the pass key? The pass key is"
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def passkey_line(key: int) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def passkey_text(key: int, n_sentences: int, depth: float) -> str:
    """The prompt with ``n_sentences`` filler sentences, the key line after ``round(depth *
    n_sentences)`` of them (depth 0: right after the task line, 1: right before the question)."""
    if not 0.0 <= depth <= 1.0:
        raise GGUFRopeError(f"passkey depth must be in [0, 1], got {depth}")
    filler = [PASSKEY_FILLER[i % len(PASSKEY_FILLER)] for i in range(n_sentences)]
    cut = int(round(depth * n_sentences))
    parts = [PASSKEY_TASK, " ".join(filler[:cut]), passkey_line(key), " ".join(filler[cut:]), PASSKEY_QUESTION]
    return "\n".join(p for p in parts if p)



def build_passkey_tokens(dec: Decoder, key: int, depth: float, budget: int) -> tuple[list[int], int]:
    """The passkey prompt for ``key`` at ``depth`` with as many filler sentences as fit in
    ``budget`` tokens (BOS included; :func:`ggufrope.evaluation.ruler.largest_fitting` over the
    number of sentences); returns (tokens, filler sentences)."""
    from .ruler import largest_fitting

    built: dict[int, list[int]] = {}

    def length(n: int) -> int:
        if n not in built:
            built[n] = dec.tokenize(passkey_text(key, n, depth))
        return len(built[n])

    if length(0) > budget:
        raise GGUFRopeError(f"the passkey prompt needs {length(0)} tokens without filler; the context is too small")
    n = largest_fitting(length, budget, 0, 100)
    return built[n], n


def passkey_trials(trials: int, seed: int, depths: Sequence[float] | None) -> list[tuple[int, float]]:
    """(key, depth) per trial: a random 5-digit key each; depths cycle through ``depths`` (or
    are uniform in [0, 1] when ``depths`` is None). Deterministic in ``seed``."""
    rng = random.Random(seed)
    out = []
    for t in range(trials):
        key = rng.randint(10000, 99999)
        depth = rng.random() if depths is None else float(depths[t % len(depths)])
        out.append((key, depth))
    return out


def depth_bucket(depth: float, buckets: Sequence[float] = DEFAULT_DEPTHS) -> float:
    return float(min(buckets, key=lambda b: (abs(b - depth), b)))



def passkey(dec: Decoder, n_ctx: int, *, trials: int = 10, seed: int = 0,
            depths: Sequence[float] | None = DEFAULT_DEPTHS, n_gen: int = DEFAULT_N_GEN,
            progress: bool = False, desc: str = "passkey", keep_last: int | None = None,
            done: Mapping[int, dict[str, Any]] | None = None,
            on_trial: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run ``trials`` passkey retrievals, each prompt filling ``n_ctx - n_gen`` tokens.

    ``keep_last``: the truncation baseline: each prompt cut to its last ``keep_last - n_gen``
    tokens (:func:`ggufrope.evaluation.ruler.truncate`; ``dec`` then holds the model at
    ``keep_last`` without a method). ``done``: trials answered before (by trial index, rows as
    returned here), kept instead of answered again; ``on_trial(index, row)`` is called after
    each trial answered here. Returns a dict with the accuracy, the accuracy by depth bucket and
    every trial (key, depth, prompt tokens, the greedy answer, correct)."""
    from tqdm import tqdm

    from .ruler import truncate

    if (keep_last or n_ctx) > dec.n_ctx:
        raise GGUFRopeError(f"passkey length {keep_last or n_ctx} exceeds the context {dec.n_ctx}")
    built = []
    for key, depth in passkey_trials(trials, seed, depths):
        toks, n_fill = memo_prompt(dec.llm, ("passkey", key, depth, n_ctx - n_gen),
                                   lambda key=key, depth=depth: build_passkey_tokens(dec, key, depth, n_ctx - n_gen))
        if keep_last is not None:
            toks = truncate(toks, keep_last - n_gen, dec.bos if dec.add_bos else None)
        built.append((key, depth, toks, n_fill))
    rows = {t: r for t, r in (done or {}).items() if t < trials}
    with tqdm(total=trials, initial=len(rows), unit="trial", desc=desc, disable=not progress, file=sys.stderr,
              dynamic_ncols=True, leave=False) as bar:
        for t in answer_order(dec, [depth for _, depth, _, _ in built]):
            if t in rows:
                continue
            t0 = time.perf_counter()
            key, depth, toks, n_fill = built[t]
            answer = greedy_answer(dec, toks, n_gen)
            rows[t] = {"key": key, "depth": depth, "bucket": depth_bucket(depth), "filler_sentences": n_fill,
                       "prompt_tokens": len(toks), "answer": answer, "correct": str(key) in answer,
                       "seconds": time.perf_counter() - t0, "reused_tokens": dec.last_reused}
            if on_trial is not None:
                on_trial(t, rows[t])
            bar.set_postfix(acc=f"{sum(r['correct'] for r in rows.values())}/{len(rows)}")
            bar.update(1)
    return summarize_passkey([rows[t] for t in range(trials)])


def summarize_passkey(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[float, list[bool]] = {}
    for r in rows:
        by.setdefault(r["bucket"], []).append(r["correct"])
    return {
        "accuracy": sum(r["correct"] for r in rows) / len(rows) if rows else None,
        "correct": sum(r["correct"] for r in rows),
        "trials": len(rows),
        "by_depth": {f"{b:g}": {"accuracy": sum(v) / len(v), "trials": len(v)} for b, v in sorted(by.items())},
        "rows": rows,
        "seconds": sum(r["seconds"] for r in rows),
    }
