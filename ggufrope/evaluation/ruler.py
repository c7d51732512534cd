"""RULER-lite: the synthetic retrieval and aggregation tasks of RULER (Hsieh et al. 2024,
"RULER: What's the Real Context Size of Your Long-Context Language Models?",
github.com/NVIDIA/RULER) that need no download, written here for llama.cpp models.

Tasks (RULER's names; each sample is a user message, an answer prefix and the gold strings):

- ``niah_single`` (RULER's niah_single_1): a 7-digit "special magic number" for a word key
  (adjective-noun) in the repeated filler "The grass is green. ..."; gold: the number.
- ``niah_multikey`` (niah_multikey_2): every filler line is itself a needle for another
  random key (distractors); gold: the number of the queried key.
- ``niah_multikey_uuid`` (niah_multikey_3): the same with uuid keys and uuid values.
- ``vt`` (variable tracking): one chain of 4 hops ``VAR A = 12345``, ``VAR B = VAR A`` ...
  hidden in the filler, one worked example first (as RULER does); gold: the 5 variable names.
- ``cwe`` (common word extraction): a numbered list of words where 10 appear far more often
  (30 times each beyond 4096 tokens, 6 below, the rest 3 and 1), one worked example first;
  gold: the 10 common words.
- ``fwe`` (frequent word extraction): coded 6-letter words drawn with Zipf counts
  (alpha = 2, the top word replaced by ``...``); gold: the ranks 2-4.

**Lengths.** The prompt (chat template, message, answer prefix) fills ``n_ctx - n_gen``
tokens: the haystack size is the largest that fits, found with the model's own tokenizer (a
secant estimate, then a bisection around it: :func:`fit_sample`), so every sample is as long as
the context allows; a process builds each prompt once per model file
(:func:`ggufrope.evaluation.decoder.memo_prompt`), whichever cell or truncation baseline asks
for it. A sample is a pure function of
(task, seed, index, haystack size): the same seed gives the same prompts on every machine.

**Chat template.** When the GGUF has a ``tokenizer.chat_template`` (SmolLM2-Instruct,
Gemma 3) the message is rendered in it as one user turn with the generation prompt, and the
answer prefix follows, as RULER does for chat models; without one the text is used as is.

**Scoring** is RULER's ``string_match_all``: per sample the fraction of gold strings that
appear in the greedy answer (case-insensitive); a task's score is the mean, in percent.
The **shuffled control** scores each answer against the gold of another sample (the next
one, cyclically): a grader that a random answer could satisfy would show there.

**Truncation baseline** (``keep_last``): the same prompt tokens cut to their last
``keep_last`` tokens (the BOS token kept first where the vocabulary adds one), decoded by the
model without any method at its trained context L: what a user gets by dropping the start of
an over-long prompt.
"""

from __future__ import annotations

import functools
import random
import string
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import GGUFRopeError

#: task name -> greedy tokens decoded for the answer (RULER: niah 128, vt 30, cwe 120, fwe 50; the
#: niah answers here are one number or uuid, so fewer suffice)
N_GEN = {"niah_single": 32, "niah_multikey": 32, "niah_multikey_uuid": 64, "vt": 30, "cwe": 120, "fwe": 50}
TASKS = tuple(N_GEN)
DEFAULT_TASKS = ("niah_single", "vt")

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_NIAH_TEMPLATE = ("Some special magic {v} are hidden within the following text. Make sure to memorize it. "
                  "I will quiz you about the {v} afterwards.\n{context}\n"
                  "What are all the special magic {v} for {query} mentioned in the provided text?")
_NIAH_PREFIX = " The special magic {v} for {query} mentioned in the provided text are"
_NEEDLE = "One of the special magic {v} for {key} is: {value}."
_VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
                "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above.")
_VT_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
              "assigned the value {query}, they are: ")
_CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                 "Memorize the ones that appear most often.\n{context}\n"
                 "Question: What are the 10 most common words in the above list?")
_CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
_FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                 "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                 "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?")
_FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"


@dataclass(frozen=True)
class Sample:
    """One RULER-lite sample: ``message`` (the user turn: instructions, haystack, question),
    ``answer_prefix`` (put after the generation prompt), ``gold`` (the strings to find) and
    ``depth`` (where the needle sits in the haystack, 0..1, or None)."""

    task: str
    index: int
    size: int  #: haystack units (lines, words)
    message: str
    answer_prefix: str
    gold: tuple[str, ...]
    depth: float | None = None


# --- word lists (wonderwords, MIT, the lists RULER draws its keys from) ------------------------

_WORDS: dict[str, list[str]] = {}


def _wordlist(name: str) -> list[str]:
    if name not in _WORDS:
        from importlib import resources

        try:
            text = resources.files("wonderwords.assets").joinpath(f"{name}.txt").read_text(encoding="utf-8")
        except ModuleNotFoundError:
            raise GGUFRopeError("RULER-lite needs the word lists of the package wonderwords: "
                                "pip install 'ggufrope[eval]'") from None
        _WORDS[name] = sorted({w.strip().lower() for w in text.splitlines()
                               if w.strip().isalpha() and w.strip().isascii()})
    return _WORDS[name]


def _key_word(rng: random.Random) -> str:
    """An adjective-noun key as RULER's (``wonderwords`` adjective and noun lists)."""
    return f"{rng.choice(_wordlist('adjectivelist'))}-{rng.choice(_wordlist('nounlist'))}"


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _rng(task: str, seed: int, index: int, part: str = "") -> random.Random:
    # a str seed is hashed with sha512 by random.seed: the same on every machine and run
    return random.Random(f"ruler-lite|{task}|{seed}|{index}|{part}")


# --- generators: (task, seed, index, size) -> Sample ---------------------------------------------


def _niah(task: str, seed: int, index: int, size: int) -> Sample:
    rng = _rng(task, seed, index)
    uuids = task == "niah_multikey_uuid"
    key = _uuid(rng) if uuids else _key_word(rng)
    value = _uuid(rng) if uuids else _number(rng)
    kind = "uuids" if uuids else "numbers"
    depth = rng.random()
    hay = _rng(task, seed, index, "haystack")
    if task == "niah_single":
        lines = [NOISE] * size
    else:  # every line a needle for another key: distractors
        lines = []
        for _ in range(size):
            k = _uuid(hay) if uuids else _key_word(hay)
            while k == key:
                k = _uuid(hay) if uuids else _key_word(hay)
            lines.append(_NEEDLE.format(v=kind, key=k, value=_uuid(hay) if uuids else _number(hay)))
    at = int(round(depth * size))
    lines.insert(at, _NEEDLE.format(v=kind, key=key, value=value))
    # one needle, one query: RULER's singular wording
    one = kind[:-1]
    tmpl = _NIAH_TEMPLATE.replace("Some", "A").replace("are all", "is").replace("are hidden", "is hidden")
    msg = tmpl.format(v=one, context="\n".join(lines), query=key)
    prefix = _NIAH_PREFIX.replace(" are", " is").format(v=one, query=key)
    return Sample(task, index, size, msg, prefix, (value,), at / size if size else 0.0)


def _vt_chain(rng: random.Random, hops: int = 4) -> tuple[list[str], list[str], str]:
    names: list[str] = []
    while len(names) < hops + 1:
        n = "".join(rng.choices(string.ascii_uppercase, k=5))
        if n not in names:
            names.append(n)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(hops)]
    return names, chain, value


def _vt_text(rng: random.Random, size: int) -> tuple[str, list[str], str, float]:
    names, chain, value = _vt_chain(rng)
    lines = [NOISE] * size
    spots = sorted(rng.sample(range(size + 1), len(chain))) if size + 1 >= len(chain) else list(range(len(chain)))
    for j, (p, line) in enumerate(zip(spots, chain)):
        lines.insert(p + j, line)
    return "\n".join(lines), names, value, spots[0] / max(1, size)


def _vt(task: str, seed: int, index: int, size: int) -> Sample:
    # a worked example first (RULER's in-context example for vt): a short chain with its answer
    ex_ctx, ex_names, ex_value = _vt_text(_rng(task, seed, index, "example"), 5)[:3]
    example = (_VT_TEMPLATE.format(context=ex_ctx, query=ex_value)
               + _VT_PREFIX.format(n=len(ex_names), query=ex_value) + " ".join(ex_names))
    ctx, names, value, depth = _vt_text(_rng(task, seed, index), size)
    msg = example + "\n\n" + _VT_TEMPLATE.format(context=ctx, query=value)
    return Sample(task, index, size, msg, _VT_PREFIX.format(n=len(names), query=value), tuple(names), depth)


def _cwe_list(rng: random.Random, n_words: int, common: int, rare: int, n_common: int = 10) -> tuple[str, list[str]]:
    nouns = _wordlist("nounlist")
    n_rare = max(0, n_words - n_common)
    words = rng.sample(nouns, min(len(nouns), n_common + n_rare))
    top, rest = words[:n_common], words[n_common:]
    seq = top * common + rest * rare
    rng.shuffle(seq)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(seq)), top


def _cwe(task: str, seed: int, index: int, size: int, long: bool = False) -> Sample:
    common, rare = (30, 3) if long else (6, 1)
    ex_ctx, ex_top = _cwe_list(_rng(task, seed, index, "example"), 20, 3, 1)
    example = _CWE_TEMPLATE.format(context=ex_ctx) + _CWE_PREFIX + " " + " ".join(
        f"{i + 1}. {w}" for i, w in enumerate(ex_top))
    ctx, top = _cwe_list(_rng(task, seed, index), size, common, rare)
    return Sample(task, index, size, example + "\n" + _CWE_TEMPLATE.format(context=ctx), _CWE_PREFIX, tuple(top))


@functools.lru_cache(maxsize=None)
def _zeta(alpha: float) -> float:
    """Riemann zeta(alpha), alpha > 1: the first 99,999 terms and the integral of the tail (computed
    once per alpha: :func:`fit_sample` builds a sample several times)."""
    return sum(k ** -alpha for k in range(1, 100_000)) + 1.0 / ((alpha - 1) * 100_000 ** (alpha - 1))


def _fwe(task: str, seed: int, index: int, size: int, alpha: float = 2.0, vocab_size: int = 2000) -> Sample:
    rng = _rng(task, seed, index)
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < vocab_size:
        w = "".join(rng.choices(string.ascii_lowercase, k=6))
        if w not in seen:
            seen.add(w)
            vocab.append(w)
    vocab[0] = "..."  # the most frequent "word" is noise, as in RULER
    zeta = _zeta(alpha)
    counts = [int(size * k ** -alpha / zeta) for k in range(1, vocab_size + 1)]
    words = [w for w, c in zip(vocab, counts) for _ in range(c)]
    rng.shuffle(words)
    return Sample(task, index, size, _FWE_TEMPLATE.format(context=" ".join(words)), _FWE_PREFIX, tuple(vocab[1:4]))


def make_sample(task: str, seed: int, index: int, size: int, *, long: bool = False) -> Sample:
    """Sample ``index`` of ``task`` with a haystack of ``size`` units (lines for niah/vt, list
    entries for cwe, coded words for fwe); ``long`` (cwe only): RULER's frequencies beyond
    4096 tokens (30/3 instead of 6/1). Deterministic in all arguments. Raises GGUFRopeError
    for an unknown task."""
    if task not in N_GEN:
        raise GGUFRopeError(f"unknown RULER-lite task {task!r} (tasks: {', '.join(TASKS)})")
    if size < 1:
        raise GGUFRopeError(f"{task}: haystack size must be >= 1, got {size}")
    if task.startswith("niah"):
        return _niah(task, seed, index, size)
    if task == "vt":
        return _vt(task, seed, index, size)
    if task == "cwe":
        return _cwe(task, seed, index, size, long)
    return _fwe(task, seed, index, size)


# --- scoring (RULER's string_match_all) ---------------------------------------------------------


def score(answer: str, gold: Sequence[str]) -> float:
    """Fraction of ``gold`` strings found in ``answer``, case-insensitive (RULER's
    ``string_match_all`` for one sample), in [0, 1]."""
    a = answer.lower()
    return sum(g.lower() in a for g in gold) / len(gold) if gold else 0.0


def shuffled_control(answers: Sequence[str], golds: Sequence[Sequence[str]]) -> float:
    """Mean score of answer i against the gold of sample i + 1 (cyclically): what a grader gives
    answers that do not belong to the question. Percent; None-safe for fewer than 2 samples (0)."""
    n = len(answers)
    if n < 2:
        return 0.0
    return 100.0 * sum(score(answers[i], golds[(i + 1) % n]) for i in range(n)) / n


# --- prompts in the model's tokens ----------------------------------------------------------------


class Prompter:
    """Renders a sample as the model sees it: in its chat template when the GGUF has one
    (``chat=None``: auto), one user turn plus the generation prompt, then the answer prefix;
    tokenized with special tokens parsed, BOS added when the vocabulary asks for one and the
    template did not write it."""

    def __init__(self, llm: Any, chat: bool | None = None):
        from ..generate import TemplateRenderer

        self.llm = llm
        self._renderer = TemplateRenderer(llm)
        self.chat = self._renderer.template.from_gguf if chat is None else chat

    def text(self, s: Sample) -> str:
        if not self.chat:
            return s.message + s.answer_prefix
        head = self._renderer.render([{"role": "user", "content": s.message}], "a RULER-lite prompt")
        return head + s.answer_prefix.lstrip()

    def tokens(self, s: Sample) -> list[int]:
        return self._renderer.tokenize(self.text(s))


def largest_fitting(length: Callable[[int], int], budget: int, first: int, probe: int) -> int:
    """The largest size n >= ``first`` with ``length(n) <= budget``, for a prompt length that grows
    with n nearly linearly (``length(first) <= budget`` is the caller's to check): a secant
    estimate through ``first`` and ``probe``, one secant step from it, then a bracket around it
    (widened by doubling steps until one end fits and the other does not) bisected. A prompt
    filling 131,072 tokens takes about 5 evaluations of ``length`` at its full size, where a
    bisection over [first, 2 x budget / tokens-per-size] took ~15. With ``length`` non-decreasing
    the result is that bisection's."""
    base = length(first)

    def estimate(n: int) -> int:  # where the line through (first, base) and (n, length(n)) meets budget
        return max(first, first + int((budget - base) * (n - first) / max(1, length(n) - base)))

    n = estimate(probe)
    if n > first:
        n = estimate(n)
    step = max(2, n // 2000)
    if length(n) <= budget:
        lo, hi = n, n + step
        while length(hi) <= budget:
            lo, hi, step = hi, hi + step, step * 2
    else:
        lo, hi = max(first, n - step), n
        while length(lo) > budget:
            lo, hi, step = max(first, lo - step), lo, step * 2
    while lo < hi - 1:
        mid = (lo + hi) // 2
        if length(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def fit_sample(prompter: Prompter, task: str, seed: int, index: int, budget: int) -> tuple[Sample, list[int]]:
    """The sample with the largest haystack whose prompt takes <= ``budget`` tokens
    (:func:`largest_fitting` over the haystack size), and its tokens. Raises GGUFRopeError when
    not even a haystack of 1 fits."""
    long = budget > 4096
    built: dict[int, tuple[Sample, list[int]]] = {}

    def length(n: int) -> int:
        if n not in built:
            s = make_sample(task, seed, index, n, long=long)
            built[n] = (s, prompter.tokens(s))
        return len(built[n][1])

    if length(1) > budget:
        raise GGUFRopeError(f"{task}: the prompt needs {length(1)} tokens with the smallest haystack; "
                            f"the context leaves {budget}")
    return built[largest_fitting(length, budget, 1, 64)]


def truncate(tokens: Sequence[int], keep_last: int, bos: int | None) -> list[int]:
    """The last ``keep_last`` tokens of ``tokens``; with ``bos`` (vocabularies that add one),
    BOS followed by the last ``keep_last - 1``. Unchanged when short enough."""
    if len(tokens) <= keep_last:
        return list(tokens)
    if bos is not None:
        return [bos] + list(tokens[len(tokens) - keep_last + 1:])
    return list(tokens[len(tokens) - keep_last:])


def run_task(dec: Any, task: str, n_ctx: int, *, samples: int = 10, seed: int = 0, keep_last: int | None = None,
             chat: bool | None = None, progress: bool = False, desc: str | None = None,
             on_sample: Callable[[dict[str, Any]], None] | None = None,
             done: Mapping[int, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run ``samples`` samples of ``task`` whose prompts fill ``n_ctx - N_GEN[task]`` tokens, on
    the decoder ``dec`` (:class:`ggufrope.evaluation.decoder.Decoder`); greedy answers.

    ``keep_last``: the truncation baseline: the same prompts cut to their last ``keep_last -
    N_GEN[task]`` tokens (``dec`` then holds a model at L without a method). ``done``: rows of
    samples answered before (by index, as this function returns them), kept instead of answered
    again; ``on_sample(row)`` is called after each sample answered here. Returns a dict:
    ``score`` (percent, RULER's string_match_all), ``control`` (the shuffled control, percent),
    ``rows`` (per sample: index, haystack size, depth, prompt tokens, answer, gold, score,
    seconds), ``seconds``. Raises GGUFRopeError when the task or length is impossible."""
    from tqdm import tqdm

    from .decoder import answer_order, greedy_answer, memo_prompt

    if task not in N_GEN:
        raise GGUFRopeError(f"unknown RULER-lite task {task!r} (tasks: {', '.join(TASKS)})")
    if samples < 1:
        raise GGUFRopeError(f"--samples must be >= 1, got {samples}")
    n_gen = N_GEN[task]
    limit = keep_last if keep_last is not None else n_ctx
    if limit > dec.n_ctx:
        raise GGUFRopeError(f"{task}: {limit} tokens do not fit the context {dec.n_ctx}")
    prompter = Prompter(dec.llm, chat)
    built = []
    for i in range(samples):
        s, toks = memo_prompt(dec.llm, ("ruler", prompter.chat, task, seed, i, n_ctx - n_gen),
                              lambda i=i: fit_sample(prompter, task, seed, i, n_ctx - n_gen))
        if keep_last is not None:
            toks = truncate(toks, keep_last - n_gen, dec.bos if dec.add_bos else None)
        built.append((s, toks))
    order = answer_order(dec, [s.depth for s, _ in built])  # cwe/fwe have no depth
    rows: list[dict[str, Any]] = [r for i, r in (done or {}).items() if i < samples]
    with tqdm(total=samples, initial=len(rows), unit="sample", desc=desc or task, disable=not progress,
              file=sys.stderr, dynamic_ncols=True, leave=False) as bar:
        for i in order:
            if done and i in done:
                continue
            t0 = time.perf_counter()
            s, toks = built[i]
            answer = greedy_answer(dec, toks, n_gen)
            r = {"index": i, "size": s.size, "depth": s.depth, "prompt_tokens": len(toks), "answer": answer,
                 "gold": list(s.gold), "score": score(answer, s.gold), "seconds": time.perf_counter() - t0,
                 "reused_tokens": dec.last_reused}
            rows.append(r)
            if on_sample is not None:
                on_sample(r)
            bar.set_postfix(score=f"{100 * sum(x['score'] for x in rows) / len(rows):.0f}%")
            bar.update(1)
    return summarize(sorted(rows, key=lambda r: r["index"]))


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Task score and shuffled control (percent) of per-sample rows (see :func:`run_task`)."""
    n = len(rows)
    return {
        "score": 100.0 * sum(r["score"] for r in rows) / n if n else None,
        "control": shuffled_control([r["answer"] for r in rows], [r["gold"] for r in rows]),
        "samples": n,
        "rows": rows,
        "seconds": sum(r["seconds"] for r in rows),
    }


def parse_tasks(spec: str) -> list[str]:
    """``all`` or comma-separated task names; GGUFRopeError naming the valid ones."""
    if spec.strip().lower() == "all":
        return list(TASKS)
    out = [t.strip() for t in spec.split(",") if t.strip()]
    bad = [t for t in out if t not in N_GEN]
    if bad or not out:
        raise GGUFRopeError(f"--tasks: unknown {', '.join(bad) or 'empty list'} (tasks: {', '.join(TASKS)}, or all)")
    return list(dict.fromkeys(out))


__all__ = ["TASKS", "DEFAULT_TASKS", "N_GEN", "Sample", "make_sample", "score", "shuffled_control", "Prompter",
           "largest_fitting", "fit_sample", "truncate", "run_task", "summarize", "parse_tasks"]

