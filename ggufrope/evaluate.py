"""Evaluation beyond the trained context: perplexity on long documents, passkey retrieval, and
the method-by-method comparison grid behind ``ggufrope eval ppl | passkey | compare``.

Every method is applied at load time through :func:`ggufrope.runtime.load` (kv overrides for
the NTK family and log-n, llama.cpp's own context parameters for ``linear`` and ``yarn``);
no file is rewritten.

**The factor k.** The evaluation compares methods at one k per context: left out, k is
max(1, n_ctx / L) for every method that takes one (:func:`ggufrope.methods.auto_factor`, the
rule by which Python chooses k for the stock methods linear and yarn), and it is passed to
the library explicitly, for the NTK family too, so that a unit's k is known before any model
is loaded (it is part of the cache key) and is the same for stock and NTK-family methods. The
windows of the evaluation are exactly n_ctx tokens, so k maps the window onto L. After each
load the k in use is read back from the library (:func:`ggufrope.runtime.factor_in_use`)
and must be the one passed. (``ggufrope generate`` instead leaves the NTK family's automatic
k to the library: dynamic k by default, or with ``--static`` one k resolved from n_ctx_seq.)

**Dynamic k** (``--dynamic``, the NTK family only): the factor passed is
:data:`~ggufrope.methods.AUTO_FACTOR` (0) with the dynamic override, and the library chooses k
as each window fills (1 within L, then the smallest power of 2 with k·L >= n, the cached keys
re-rotated). The k read back after a load must be 1 (an empty context), and the k reached at
the end of a unit is stored with it (``factor_end``). A dynamic unit's cache key carries
``"dynamic": true`` and its ratio r; a static unit's key has no such field, so it is the key
it had before dynamic k existed. Report labels say ``dyn`` (``ntk-mixed (b=0.625) dyn``).

**Perplexity** follows llama.cpp's ``llama-perplexity`` (tools/perplexity/perplexity.cpp,
default mode): the document is tokenized once (BOS prepended when the vocabulary asks for
it), cut into consecutive windows of ``n_ctx`` tokens, each window is evaluated from an empty
context in one pass (its first token replaced by BOS when the vocabulary adds BOS), and the
tokens of the second half are scored: the logits at window position ``p`` (for ``score_from
<= p <= n_ctx - 2``) predict the token at ``p + 1``. The decode is batched with the
low-level API (``llama_batch`` with the logits flag set only at scored positions, read back
with ``llama_get_logits_ith``), the log-softmax is taken in float64.

A scored token counts as **beyond L** (L = the model's trained context, ``n_ctx_orig``) when
the position ``p`` that predicts it is >= L: that query attends across more than L
positions, which the model never saw in training (log-n scales exactly these queries).

**Passkey retrieval** uses the prompt of Mohtashami & Jaggi (2023), as in the PI and YaRN
papers: a task line, the filler "The grass is green. The sky is blue. ..." repeated, the line
"The pass key is 12345. Remember it. 12345 is the pass key." at a depth in [0, 1] of the
filler, then "What is the pass key? The pass key is"; the prompt fills the context less the
tokens to generate, the answer is decoded greedily and counts as correct when the 5-digit key
appears in it.

**compare** runs a grid (contexts x methods x dynamic k x log-n; dynamic k for the NTK family
only), one cached JSON file per unit (model fingerprint, method, k, b, dynamic k, log-n, n_ctx,
document or passkey trial set, protocol version), so an interrupted run resumes where it
stopped; it writes ``results.json``, a
markdown table shaped like seed 000's Table 1 and a PNG plot.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from .errors import GGUFRopeError
from .methods import DEFAULT_DYNAMIC_RATIO, DEFAULT_EXPONENT, METHODS, auto_factor, canonical, dynamic_words, entry, \
    to_float32
from .runtime import RopeChoice

#: bump when a change to this module changes what a cached result means
EVAL_VERSION = 1

#: grid order of ``--methods all``
ALL_METHODS = ("none", "linear", "yarn", "ntk", "ntk-fixed", "ntk-mixed")

#: names of the seed's Table 1 (seed 000) for the rows of the markdown table
SEED_NAMES = {
    "none": "Baseline",
    "linear": "PI-RoPE (linear)",
    "yarn": "YaRN",
    "ntk": "NTK-RoPE (ntk, NTK-aware)",
    "ntk-fixed": "NTK-RoPE-fixed",
    "ntk-mixed": "NTK-RoPE-mixed",
}

# --- passkey prompt (Mohtashami & Jaggi 2023; PI and YaRN papers) ---------------------------

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
DEFAULT_N_GEN = 10  #: greedy tokens decoded for the answer (SmolLM2 spells digits one a token)


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


# --- model and low-level decoding -------------------------------------------------------------


class Setting(RopeChoice):
    """A method as the evaluation applies it: :class:`ggufrope.runtime.RopeChoice` (same fields
    and the registry's checks; ``factor`` None means k = max(1, n_ctx / L), see the module
    docstring) with k resolved per context. ``dynamic`` is a bool here: True runs dynamic k
    (no k is passed), False (or None) one explicit k per context."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "dynamic", bool(self.dynamic))

    @classmethod
    def for_grid(cls, method: str, factor: float | None, exponent: float | None, logn: bool,
                 dynamic: bool = False, dynamic_ratio: float | None = None) -> Setting:
        """The setting of ``method`` in a grid whose k and b are given once for all methods: k
        goes only to methods that take one (and not with dynamic k, which chooses its own), b
        only to ntk-mixed (the registry's parameters), the ratio r only to dynamic rows."""
        try:
            m = entry(method)
        except ValueError as e:
            raise GGUFRopeError(str(e)) from None
        return cls(m.name, factor if m.uses_factor and not dynamic else None, exponent if m.uses_exponent else None,
                   logn, dynamic, dynamic_ratio=dynamic_ratio if dynamic else None)

    def resolved_factor(self, n_ctx: int, n_ctx_orig: int) -> float | None:
        """k as applied at ``n_ctx`` (None for ``none``, which has no k, and for dynamic k,
        which the library chooses as the context fills)."""
        if not METHODS[self.method].uses_factor or self.dynamic:
            return None
        return float(self.factor) if self.factor is not None else auto_factor(n_ctx, n_ctx_orig)

    def label(self, n_ctx: int | None = None, n_ctx_orig: int | None = None) -> str:  # type: ignore[override]
        s = self.method + (f" (b={self.exponent:g})" if self.method == "ntk-mixed" else "")
        if self.dynamic:
            r = self.dynamic_ratio
            s += " dyn" + (f" (r={r:g})" if r is not None and r != DEFAULT_DYNAMIC_RATIO else "")
        elif n_ctx is not None and n_ctx_orig is not None and self.method != "none":
            s += f" k={self.resolved_factor(n_ctx, n_ctx_orig):g}"
        return s + (" + log-n" if self.logn else "")

    def key_fields(self) -> dict[str, Any]:
        """What dynamic k adds to a cached unit's key: ``{"dynamic": True, "dynamic_ratio": r}``;
        nothing for a static setting (its key is the one it had before dynamic k existed)."""
        if not self.dynamic:
            return {}
        r = self.dynamic_ratio
        return {"dynamic": True, "dynamic_ratio": float(DEFAULT_DYNAMIC_RATIO if r is None else r)}


def n_ctx_orig_of(model: str | os.PathLike) -> int:
    """L, the model's trained context (``read_rope_metadata(model)["n_ctx_orig"]``)."""
    from .gguf_file import read_rope_metadata

    L = read_rope_metadata(model)["n_ctx_orig"]
    if not L:
        raise GGUFRopeError(f"{os.fspath(model)}: no context length (L) in the file")
    return int(L)


def load_model(
    model: str | os.PathLike,
    setting: Setting,
    n_ctx: int,
    *,
    n_batch: int = 512,
    n_ubatch: int | None = None,
    gpu_layers: int = 0,
    threads: int | None = None,
    verbose: bool = False,
    **kwargs: Any,
) -> Any:
    """``runtime.load`` with ``setting`` at ``n_ctx``; ``n_ubatch`` defaults to ``n_batch``.

    k is passed explicitly (:meth:`Setting.resolved_factor`, see the module docstring) and the
    k the context applies is read back: a library that applies another k (or none) raises
    :class:`GGUFRopeError`. With dynamic k no k is passed (auto, with the dynamic override) and
    the k read back must be 1 (the context is empty). The returned ``Llama`` carries
    ``llm.ggufrope`` (:class:`ggufrope.runtime.RopeInUse`)."""
    from .runtime import load

    L = n_ctx_orig_of(model)
    kw: dict[str, Any] = dict(kwargs)
    if threads:
        kw["n_threads"] = kw["n_threads_batch"] = threads
    n_batch = max(1, min(int(n_batch), int(n_ctx)))
    k = setting.resolved_factor(n_ctx, L)
    llm = load(
        model, method=setting.method, factor=k, exponent=setting.exponent,
        logn=setting.logn, dynamic=setting.dynamic, dynamic_ratio=setting.dynamic_ratio if setting.dynamic else None,
        n_ctx=n_ctx, n_gpu_layers=gpu_layers, verbose=verbose,
        n_batch=n_batch, n_ubatch=min(n_batch, n_ubatch or n_batch), **kw,
    )
    used = llm.ggufrope.factor
    if setting.dynamic:
        if not llm.ggufrope.dynamic or used != 1.0:
            raise GGUFRopeError(f"{setting.label()}: llama.cpp starts the context with k = {used}"
                                f"{'' if llm.ggufrope.dynamic else ', static'}, where dynamic k starts at 1")
    elif (k is None) != (used is None) or (k is not None and to_float32(used) != to_float32(k)):
        raise GGUFRopeError(f"{setting.label()}: llama.cpp applies k = {used} where k = {k} was passed")
    return llm


class Decoder:
    """Batched decoding of one sequence on a loaded ``llama_cpp.Llama`` with the low-level API:
    logits are computed only where asked and read back row by row with ``llama_get_logits_ith``."""

    def __init__(self, llm: Any):
        import llama_cpp

        self.lc = llama_cpp
        self.llm = llm
        self.ctx = llm.ctx
        self.n_ctx = int(llama_cpp.llama_n_ctx(self.ctx))
        self.n_batch = int(llama_cpp.llama_n_batch(self.ctx))
        self.vocab = llama_cpp.llama_model_get_vocab(llm.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.add_bos = bool(llama_cpp.llama_vocab_get_add_bos(self.vocab))
        self.bos = int(llama_cpp.llama_vocab_bos(self.vocab))
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.n_decoded = 0  #: tokens decoded so far (for tests and timings)

    def close(self) -> None:
        if self._batch is not None:
            self.lc.llama_batch_free(self._batch)
            self._batch = None

    def __enter__(self) -> Decoder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # pragma: no cover - safety net
        try:
            self.close()
        except Exception:
            pass

    def clear(self) -> None:
        """Empty the context (KV cache) before a new sequence."""
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        """``add_bos``: add the vocabulary's special prefix when it asks for one (as llama.cpp's
        ``common_tokenize(..., add_special=true)``)."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)

    def decode(self, tokens: Sequence[int], pos0: int, outputs: Iterable[int],
               on_rows: Callable[[list[int], np.ndarray], None]) -> None:
        """Decode ``tokens`` at positions ``pos0, pos0 + 1, ...`` in batches of ``n_batch``;
        for every batch, call ``on_rows(indices, logits)`` with the sorted indices (into
        ``tokens``) of the requested outputs in it and their logits, float32, shape
        ``(len(indices), n_vocab)`` (a buffer reused between calls)."""
        want = np.zeros(len(tokens), dtype=bool)
        idx = np.fromiter(outputs, dtype=np.int64)
        if idx.size:
            if idx.min() < 0 or idx.max() >= len(tokens):
                raise ValueError("output index out of range")
            want[idx] = True
        if pos0 + len(tokens) > self.n_ctx:
            raise GGUFRopeError(f"{pos0 + len(tokens)} positions do not fit in n_ctx {self.n_ctx}")
        b = self._batch
        buf: np.ndarray | None = None
        for s in range(0, len(tokens), self.n_batch):
            e = min(len(tokens), s + self.n_batch)
            rows = []
            for j in range(s, e):
                i = j - s
                b.token[i] = int(tokens[j])
                b.pos[i] = pos0 + j
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = 1 if want[j] else 0
                if want[j]:
                    rows.append(j)
            b.n_tokens = e - s
            rc = self.lc.llama_decode(self.ctx, b)
            if rc != 0:
                raise GGUFRopeError(f"llama_decode failed (status {rc}) at positions {pos0 + s}..{pos0 + e - 1}")
            self.n_decoded += e - s
            if not rows:
                continue
            if buf is None or buf.shape[0] < len(rows):
                buf = np.empty((len(rows), self.n_vocab), dtype=np.float32)
            for r, j in enumerate(rows):
                ptr = self.lc.llama_get_logits_ith(self.ctx, j - s)
                if not ptr:
                    raise GGUFRopeError(f"no logits for batch index {j - s}")
                buf[r] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
            on_rows(rows, buf[: len(rows)])


def token_nll(logits: np.ndarray, targets: np.ndarray, block: int = 128) -> np.ndarray:
    """-log softmax(logits)[target] per row, computed in float64 (``logits``: (n, V))."""
    out = np.empty(len(targets), dtype=np.float64)
    for s in range(0, len(targets), block):
        x = logits[s : s + block].astype(np.float64)
        m = x.max(axis=1)
        lse = m + np.log(np.exp(x - m[:, None]).sum(axis=1))
        out[s : s + block] = lse - x[np.arange(len(x)), targets[s : s + block]]
    return out


# --- perplexity ---------------------------------------------------------------------------------


@dataclasses.dataclass
class WindowResult:
    index: int  #: window number in the document
    start: int  #: offset of the window in the document's tokens
    nll: float  #: sum of the negative log-likelihoods of the scored tokens (nats)
    count: int  #: scored tokens
    nll_beyond: float  #: the same over tokens predicted from positions >= L
    count_beyond: int
    seconds: float


def ppl_windows(tokens: Sequence[int], n_ctx: int, max_windows: int | None = None) -> list[int]:
    """Start offsets of the windows: ``len(tokens) // n_ctx`` consecutive ones (llama-perplexity's
    chunks), at most ``max_windows``."""
    n = len(tokens) // n_ctx
    if max_windows is not None:
        n = min(n, max_windows)
    return [i * n_ctx for i in range(n)]


def score_window(dec: Decoder, window: Sequence[int], score_from: int, n_ctx_orig: int,
                 bos: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Evaluate one window from an empty context; return (positions p, nll of token p + 1) for
    ``score_from <= p <= len(window) - 2``. The first token is replaced by BOS when ``bos``
    (default: when the vocabulary adds BOS), as llama-perplexity does."""
    n = len(window)
    if not 0 <= score_from <= n - 2:
        raise GGUFRopeError(f"score-from {score_from} leaves no token to score in a window of {n}")
    toks = list(window)
    if dec.add_bos if bos is None else bos:
        toks[0] = dec.bos
    targets = np.asarray(toks, dtype=np.int64)
    pos = np.arange(score_from, n - 1)
    nll = np.empty(len(pos), dtype=np.float64)

    def take(rows: list[int], logits: np.ndarray) -> None:
        r = np.asarray(rows)
        nll[r - score_from] = token_nll(logits, targets[r + 1])

    dec.clear()
    dec.decode(toks, 0, pos, take)
    return pos, nll


def check_score_from(n_ctx: int, score_from: int | None) -> int:
    """The first scored position (default ``n_ctx // 2``); GGUFRopeError if nothing is left to score."""
    sf = n_ctx // 2 if score_from is None else int(score_from)
    if not 0 <= sf <= n_ctx - 2:
        raise GGUFRopeError(f"--score-from {sf} leaves no token to score in a window of n_ctx {n_ctx}")
    return sf


def perplexity(dec: Decoder, tokens: Sequence[int], n_ctx: int, n_ctx_orig: int, *,
               score_from: int | None = None, max_windows: int | None = None, progress: bool = False,
               desc: str = "ppl", per_token: list | None = None) -> list[WindowResult]:
    """Score every window of ``tokens`` (the whole document, tokenized with BOS as
    llama-perplexity does); ``score_from`` defaults to ``n_ctx // 2``. When ``per_token`` is a
    list, (positions, nll) of every window are appended to it."""
    from tqdm import tqdm

    sf = check_score_from(n_ctx, score_from)
    starts = ppl_windows(tokens, n_ctx, max_windows)
    if not starts:
        raise GGUFRopeError(f"{desc}: {len(tokens)} tokens, fewer than one window of n_ctx {n_ctx}")
    out: list[WindowResult] = []
    tot, cnt = 0.0, 0
    with tqdm(total=len(starts), unit="window", desc=desc, disable=not progress, file=sys.stderr,
              dynamic_ncols=True, leave=False) as bar:
        for w, s in enumerate(starts):
            t0 = time.perf_counter()
            pos, nll = score_window(dec, tokens[s : s + n_ctx], sf, n_ctx_orig)
            if per_token is not None:
                per_token.append((pos, nll))
            beyond = pos >= n_ctx_orig
            r = WindowResult(w, s, float(nll.sum()), int(len(nll)), float(nll[beyond].sum()), int(beyond.sum()),
                             time.perf_counter() - t0)
            out.append(r)
            tot, cnt = tot + r.nll, cnt + r.count
            bar.set_postfix(ppl=f"{math.exp(tot / cnt):.3f}")
            bar.update(1)
    return out


def summarize_windows(windows: Iterable[WindowResult | dict]) -> dict[str, Any]:
    """Pool windows: perplexity over all scored tokens and over tokens beyond L (None if none)."""
    ws = [w if isinstance(w, dict) else dataclasses.asdict(w) for w in windows]
    nll, cnt = sum(w["nll"] for w in ws), sum(w["count"] for w in ws)
    nb, cb = sum(w["nll_beyond"] for w in ws), sum(w["count_beyond"] for w in ws)
    return {
        "ppl": math.exp(nll / cnt) if cnt else None,
        "ppl_beyond": math.exp(nb / cb) if cb else None,
        "nll": nll, "count": cnt, "nll_beyond": nb, "count_beyond": cb,
        "n_windows": len(ws), "seconds": sum(w["seconds"] for w in ws),
    }


# --- passkey -------------------------------------------------------------------------------------


def build_passkey_tokens(dec: Decoder, key: int, depth: float, budget: int) -> tuple[list[int], int]:
    """The passkey prompt for ``key`` at ``depth`` with as many filler sentences as fit in
    ``budget`` tokens (BOS included); returns (tokens, filler sentences)."""

    def toks(n: int) -> list[int]:
        return dec.tokenize(passkey_text(key, n, depth))

    base = len(toks(0))
    if base > budget:
        raise GGUFRopeError(f"the passkey prompt needs {base} tokens without filler; the context is too small")
    per = (len(toks(100)) - base) / 100.0
    n = max(0, int((budget - base) / per))
    t = toks(n)
    while len(t) > budget and n > 0:
        n -= 1
        t = toks(n)
    while True:
        t2 = toks(n + 1)
        if len(t2) > budget:
            break
        n, t = n + 1, t2
    return t, n


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


def greedy_answer(dec: Decoder, tokens: Sequence[int], n_gen: int = DEFAULT_N_GEN) -> str:
    """Evaluate ``tokens`` from an empty context, then decode up to ``n_gen`` tokens greedily
    (stopping at an end-of-generation token); return the decoded text."""
    import llama_cpp

    dec.clear()
    nxt: list[int] = []

    def take(rows: list[int], logits: np.ndarray) -> None:
        nxt.append(int(np.argmax(logits[-1])))

    dec.decode(tokens, 0, [len(tokens) - 1], take)
    out: list[int] = []
    while True:
        tok = nxt[-1]
        if llama_cpp.llama_vocab_is_eog(dec.vocab, tok) or len(out) >= n_gen:
            break
        out.append(tok)
        if len(out) < n_gen:
            dec.decode([tok], len(tokens) + len(out) - 1, [0], take)
    return dec.llm.detokenize(out).decode("utf-8", errors="replace")


def passkey(dec: Decoder, n_ctx: int, *, trials: int = 10, seed: int = 0,
            depths: Sequence[float] | None = DEFAULT_DEPTHS, n_gen: int = DEFAULT_N_GEN,
            progress: bool = False, desc: str = "passkey") -> dict[str, Any]:
    """Run ``trials`` passkey retrievals, each prompt filling ``n_ctx - n_gen`` tokens.

    Returns a dict with the accuracy, the accuracy by depth bucket and every trial (key, depth,
    prompt tokens, the greedy answer, correct)."""
    from tqdm import tqdm

    if n_ctx > dec.n_ctx:
        raise GGUFRopeError(f"passkey length {n_ctx} exceeds the context {dec.n_ctx}")
    rows = []
    with tqdm(total=trials, unit="trial", desc=desc, disable=not progress, file=sys.stderr,
              dynamic_ncols=True, leave=False) as bar:
        for key, depth in passkey_trials(trials, seed, depths):
            t0 = time.perf_counter()
            toks, n_fill = build_passkey_tokens(dec, key, depth, n_ctx - n_gen)
            answer = greedy_answer(dec, toks, n_gen)
            ok = str(key) in answer
            rows.append({"key": key, "depth": depth, "bucket": depth_bucket(depth), "filler_sentences": n_fill,
                         "prompt_tokens": len(toks), "answer": answer, "correct": ok,
                         "seconds": time.perf_counter() - t0})
            bar.set_postfix(acc=f"{sum(r['correct'] for r in rows)}/{len(rows)}")
            bar.update(1)
    return summarize_passkey(rows)


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


# --- texts -------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Text:
    name: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()


def resolve_texts(names: Sequence[str] | None) -> list[Text]:
    """Each of ``names`` is an existing file (UTF-8) or a corpus document name; none given:
    every long corpus document (:func:`ggufrope.corpus.documents`)."""
    from . import corpus

    if not names:
        return [Text(d.name, corpus.load_text(d.name)) for d in corpus.documents()]
    out = []
    for n in names:
        if os.path.isfile(n):
            from .generate import read_prompt

            out.append(Text(os.path.basename(n), read_prompt(None, n)))
        else:
            try:
                corpus.get(n)
            except GGUFRopeError:
                raise GGUFRopeError(
                    f"--text {n!r} is neither a file nor a corpus document "
                    f"(documents: {', '.join(d.name for d in corpus.all_documents())})"
                ) from None
            out.append(Text(n, corpus.load_text(n)))
    return out


# --- the comparison grid, with its cache ----------------------------------------------------------


def _atomic_json(path: pathlib.Path, obj: Any) -> None:
    from .models import atomic_open

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")


def model_fingerprint(model: str | os.PathLike, cache_dir: pathlib.Path) -> dict[str, Any]:
    """sha256 and size of ``model``; the sha256 is remembered in ``cache_dir`` under (real path,
    size, mtime), so a file is hashed once until it changes."""
    p = os.path.realpath(os.fspath(model))
    try:
        st = os.stat(p)
    except OSError as e:
        raise GGUFRopeError(f"{os.fspath(model)}: {e.strerror}") from None
    memo_path = cache_dir / "model-sha256.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    mk = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    sha = memo.get(mk)
    if sha is None:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        sha = h.hexdigest()
        memo[mk] = sha
        _atomic_json(memo_path, memo)
    return {"sha256": sha, "size": st.st_size, "name": os.path.basename(p)}


class Cache:
    """One JSON file per unit, named by the sha256 of its key; the key is stored in the file and
    checked when read."""

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: dict[str, Any]) -> pathlib.Path:
        h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        dyn = "-dyn" if key.get("dynamic") else ""
        return self.root / f"{key['kind']}-{key['method']}{dyn}{'-logn' if key['logn'] else ''}-{key['n_ctx']}-{h}.json"

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        try:
            obj = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        return obj["result"] if obj.get("key") == json.loads(json.dumps(key)) else None

    def put(self, key: dict[str, Any], result: dict[str, Any]) -> None:
        _atomic_json(self.path(key), {"key": key, "result": result})


def parse_methods(spec: str) -> list[str]:
    if spec.strip().lower() == "all":
        return list(ALL_METHODS)
    out = []
    for s in spec.split(","):
        if s.strip():
            try:
                m = canonical(s)
            except ValueError as e:
                raise GGUFRopeError(str(e)) from None
            if m not in out:
                out.append(m)
    if not out:
        raise GGUFRopeError("no method given")
    return out


def parse_ints(spec: str, what: str = "--n-ctx") -> list[int]:
    try:
        out = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise GGUFRopeError(f"{what}: expected comma-separated integers, got {spec!r}") from None
    if not out or min(out) < 16:
        raise GGUFRopeError(f"{what}: expected integers >= 16, got {spec!r}")
    return out


def parse_depths(spec: str) -> list[float] | None:
    if spec.strip().lower() == "random":
        return None
    try:
        out = [float(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise GGUFRopeError(f"--depths: expected 'random' or comma-separated numbers in [0, 1], got {spec!r}") from None
    if not out or any(not 0.0 <= d <= 1.0 for d in out):
        raise GGUFRopeError(f"--depths: expected numbers in [0, 1], got {spec!r}")
    return out


def parse_logn(spec: str, what: str = "--logn") -> list[bool]:
    """off, on or both (also of ``--dynamic``: ``what`` names the option)."""
    s = spec.strip().lower()
    table = {"both": [False, True], "off": [False], "on": [True]}
    if s not in table:
        raise GGUFRopeError(f"{what}: expected off, on or both, got {spec!r}")
    return table[s]


def grid_configs(n_ctxs: Sequence[int], methods: Sequence[str], logn_modes: Sequence[bool],
                 dynamic_modes: Sequence[bool] = (False,)) -> list[tuple[int, str, bool, bool]]:
    """The cells of the grid, (n_ctx, method, log-n, dynamic), in report order: contexts, then
    methods, then static before dynamic, then log-n; dynamic k only for methods that support it
    (the NTK family)."""
    return [(c, m, ln, dyn) for c in n_ctxs for m in methods for dyn in dynamic_modes for ln in logn_modes
            if not dyn or entry(m).supports_dynamic]


@dataclasses.dataclass
class GridStats:
    computed: int = 0
    cached: int = 0
    missing: int = 0  #: units neither cached nor computed (report_only)
    models_loaded: int = 0


def machine_info() -> dict[str, Any]:
    from .runtime import library_version

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "ggufrope_patch": library_version(),
    }
    try:
        import llama_cpp

        info["llama_cpp_python"] = llama_cpp.__version__
    except Exception:  # pragma: no cover
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def unit_key(setting: Setting, n_ctx: int, n_ctx_orig: int, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The part of a cached unit's key that names the model and the setting at ``n_ctx``
    (the kind of unit, its text or trial set are added by :func:`run_compare`): protocol
    version, model sha256 and size, method, the k applied (None: none, or dynamic k), b
    (ntk-mixed), log-n, n_ctx and L, and with dynamic k ``dynamic`` and ``dynamic_ratio``
    (:meth:`Setting.key_fields`; a static key has neither)."""
    return {
        "eval_version": EVAL_VERSION, "model": {"sha256": fingerprint["sha256"], "size": fingerprint["size"]},
        "method": setting.method, "factor": setting.resolved_factor(n_ctx, n_ctx_orig),
        "exponent": setting.exponent if setting.method == "ntk-mixed" else None, "logn": setting.logn,
        "n_ctx": n_ctx, "n_ctx_orig": n_ctx_orig, **setting.key_fields(),
    }


def run_compare(
    model: str | os.PathLike,
    *,
    n_ctxs: Sequence[int],
    methods: Sequence[str],
    logn_modes: Sequence[bool] = (False, True),
    dynamic_modes: Sequence[bool] = (False,),
    dynamic_ratio: float | None = None,
    factor: float | None = None,
    exponent: float = DEFAULT_EXPONENT,
    texts: Sequence[Text] = (),
    max_windows: int | None = 1,
    score_from: int | None = None,
    trials: int = 10,
    seed: int = 0,
    depths: Sequence[float] | None = DEFAULT_DEPTHS,
    n_gen: int = DEFAULT_N_GEN,
    out_dir: str | os.PathLike = "eval-results",
    cache_dir: str | os.PathLike | None = None,
    n_batch: int = 512,
    n_ubatch: int | None = None,
    gpu_layers: int = 0,
    threads: int | None = None,
    report_only: bool = False,
    progress: bool = True,
    verbose: bool = False,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
) -> tuple[dict[str, Any], GridStats]:
    """Run (or read from the cache) every unit of the grid; write ``results.json``,
    ``results.md`` and ``ppl.png`` into ``out_dir``. Returns (results, stats).

    ``report_only``: compute nothing, build the report from
    the units already cached; a cell whose units are missing is reported as not run (None).
    ``dynamic_modes``: static (False) and/or dynamic k (True, NTK-family methods only), with the
    schedule's ratio ``dynamic_ratio`` (None: the library's 2)."""
    from tqdm import tqdm

    for c in n_ctxs:
        check_score_from(c, score_from)
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cache = Cache(cache_dir if cache_dir is not None else out / "cache")
    L = n_ctx_orig_of(model)
    fp = model_fingerprint(model, cache.root)
    stats = GridStats()
    t_start = time.perf_counter()
    say = log or (lambda s: None)

    tokens_by_text: dict[str, list[int]] = {}  # tokenized once, with the first model loaded
    configs = grid_configs(n_ctxs, methods, logn_modes, dynamic_modes)
    if not configs:
        raise GGUFRopeError("nothing to run: dynamic k applies to the NTK family only (ntk, ntk-fixed, ntk-mixed)")
    units = []
    for c, m, ln, dyn in configs:
        st = Setting.for_grid(m, factor, exponent, ln, dyn, dynamic_ratio)
        base = unit_key(st, c, L, fp)
        for t in texts:
            units.append((st, c, "ppl", t, {**base, "kind": "ppl", "text": t.name, "text_sha256": t.sha256,
                                            "score_from": c // 2 if score_from is None else score_from,
                                            "max_windows": max_windows}))
        if trials > 0:
            units.append((st, c, "passkey", None, {**base, "kind": "passkey", "trials": trials, "seed": seed,
                                                   "depths": None if depths is None else list(depths),
                                                   "n_gen": n_gen}))

    results: dict[tuple, dict[str, Any]] = {}
    llm_key: tuple | None = None
    dec: Decoder | None = None
    llm = None
    with tqdm(total=len(units), unit="unit", desc="compare", disable=not progress, file=sys.stderr,
              dynamic_ncols=True) as bar:
        for st, c, kind, text, key in units:
            label = f"{st.label()} @ {c}" + (f" {text.name}" if text else " passkey")
            bar.set_description(f"compare: {label}")
            r = cache.get(key)
            if r is None and report_only:
                stats.missing += 1
                say(f"missing  {label}")
                bar.update(1)
                continue
            if r is None:
                if llm_key != (st, c):
                    if dec is not None:
                        dec.close()
                    dec = llm = None
                    llm = load_model(model, st, c, n_batch=n_batch, n_ubatch=n_ubatch, gpu_layers=gpu_layers,
                                     threads=threads, verbose=verbose)
                    dec, llm_key = Decoder(llm), (st, c)
                    stats.models_loaded += 1
                t0 = time.perf_counter()
                if kind == "ppl":
                    if text.name not in tokens_by_text:
                        tokens_by_text[text.name] = dec.tokenize(text.text)
                    ws = perplexity(dec, tokens_by_text[text.name], c, L, score_from=score_from,
                                    max_windows=max_windows, progress=progress, desc=text.name)
                    r = {"windows": [dataclasses.asdict(w) for w in ws], **summarize_windows(ws)}
                else:
                    r = passkey(dec, c, trials=trials, seed=seed, depths=depths, n_gen=n_gen, progress=progress)
                if st.dynamic:  # the k the last window / trial reached
                    from .runtime import factor_in_use

                    r["factor_end"] = factor_in_use(llm)
                r["wall_s"] = time.perf_counter() - t0
                cache.put(key, r)
                stats.computed += 1
                say(f"computed {label}")
            else:
                stats.cached += 1
                say(f"cached   {label}")
            results[(st.method, st.logn, st.dynamic, c, kind, text.name if text else None)] = r
            bar.update(1)
    if dec is not None:
        dec.close()
    del llm

    cells = []
    for c, m, ln, dyn in configs:
        st = Setting.for_grid(m, factor, exponent, ln, dyn, dynamic_ratio)
        docs = {t.name: results.get((m, ln, dyn, c, "ppl", t.name)) for t in texts}
        if None in docs.values():  # report_only and some text not run: no partial pooled value
            docs = {}
        pooled = summarize_windows(w for d in docs.values() for w in d["windows"]) if docs else None
        pk = results.get((m, ln, dyn, c, "passkey", None))
        cells.append({
            "n_ctx": c, "method": m, "logn": ln, **({"dynamic": True} if dyn else {}),
            "label": st.label(), "factor": st.resolved_factor(c, L),
            "exponent": st.exponent if m == "ntk-mixed" else None,
            "ppl": pooled and pooled["ppl"], "ppl_beyond": pooled and pooled["ppl_beyond"],
            "scored_tokens": pooled and pooled["count"], "scored_tokens_beyond": pooled and pooled["count_beyond"],
            "ppl_by_text": {n: {"ppl": d["ppl"], "ppl_beyond": d["ppl_beyond"], "windows": d["n_windows"]}
                            for n, d in docs.items()},
            "passkey_accuracy": pk and pk["accuracy"], "passkey_by_depth": pk and pk["by_depth"],
            "passkey_trials": pk and pk["trials"],
        })
    res = {
        "eval_version": EVAL_VERSION,
        "command": command,
        "model": {**fp, "path": os.fspath(model), "n_ctx_orig": L},
        "grid": {"n_ctx": list(n_ctxs), "methods": list(methods), "logn": list(logn_modes),
                 "dynamic": list(dynamic_modes), "dynamic_ratio": dynamic_ratio, "factor": factor,
                 "exponent": exponent, "texts": [{"name": t.name, "sha256": t.sha256} for t in texts],
                 "max_windows": max_windows, "score_from": score_from, "trials": trials, "seed": seed,
                 "depths": None if depths is None else list(depths), "n_gen": n_gen,
                 "n_batch": n_batch, "gpu_layers": gpu_layers},
        "cells": cells,
        "machine": machine_info(),  # of this run: with report_only, not the one that computed the units
        "report_only": report_only,
        "wall_s_this_run": time.perf_counter() - t_start,
        "wall_s_all_units": sum(r.get("wall_s", 0.0) for r in results.values()),
        "units": {"computed": stats.computed, "cached": stats.cached, "missing": stats.missing},
    }
    _atomic_json(out / "results.json", res)
    (out / "results.md").write_text(markdown_table(res), encoding="utf-8")
    plot(res, out / "ppl.png")
    return res, stats


# --- reports -----------------------------------------------------------------------------------


def _row_name(method: str, logn: bool, exponent: float | None, dynamic: bool = False) -> str:
    name = SEED_NAMES.get(method, method)
    if method == "ntk-mixed" and exponent is not None:
        name += f" (b={exponent:g})"
    return name + (" dyn" if dynamic else "") + (" + log n" if logn else "")


def markdown_table(res: dict[str, Any]) -> str:
    """Seed 000's Table 1 shape: rows = methods without and with log-n (static k, then dynamic
    k where the grid has it), columns = contexts, cells = perplexity beyond L / passkey
    accuracy."""
    L = res["model"]["n_ctx_orig"]
    g = res["grid"]
    ctxs = g["n_ctx"]
    by = {(c["method"], c["logn"], c.get("dynamic", False), c["n_ctx"]): c for c in res["cells"]}
    head = ["method"] + [f"{c} ({c / L:.3g}×L)" for c in ctxs]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(ctxs)) + "|"]
    any_paren = False
    rows = [(m, ln, dyn) for m in g["methods"] for dyn in g.get("dynamic", [False]) for ln in g["logn"]
            if (m, ln, dyn, ctxs[0]) in by]
    for m, ln, dyn in rows:
        cells = []
        for c in ctxs:
            cell = by[(m, ln, dyn, c)]
            if cell["ppl_beyond"] is not None:
                p = f"{cell['ppl_beyond']:.3f}"
            elif cell["ppl"] is not None:
                p = f"({cell['ppl']:.3f})"
                any_paren = True
            else:
                p = "–"
            a = "–" if cell["passkey_accuracy"] is None else f"{100 * cell['passkey_accuracy']:.0f}%"
            cells.append(f"{p} / {a}")
        lines.append(f"| {_row_name(m, ln, g['exponent'] if m == 'ntk-mixed' else None, dyn)} | "
                     + " | ".join(cells) + " |")
    notes = [
        "",
        f"Cells: perplexity of the tokens predicted from positions ≥ L = {L} (lower is better) / "
        f"passkey retrieval accuracy over {g['trials']} trials (higher is better; – = not run).",
    ]
    if any_paren:
        notes.append("A perplexity in parentheses is over all scored tokens: at that context no scored token is beyond L.")
    ks = sorted({(c["n_ctx"], c["factor"]) for c in res["cells"] if c["factor"] is not None})
    if ks:
        notes.append("Factor k per context: " + ", ".join(f"{c}: k = {k:g}" for c, k in sorted(set(ks))) + ".")
    if any(c.get("dynamic") for c in res["cells"]):
        notes.append(f"dyn: {dynamic_words()} (llama.cpp chooses k as each window fills; no fixed k).")
    texts = ", ".join(t["name"] for t in g["texts"]) or "none"
    sf = "n_ctx/2" if g["score_from"] is None else str(g["score_from"])
    notes.append(f"Texts: {texts}; windows per text: {g['max_windows'] or 'all'}; scored from position {sf} "
                 "of each window (llama-perplexity's protocol).")
    if res.get("command"):
        notes.append(f"Command: `{res['command']}`")
    return "\n".join(lines + notes) + "\n"


def plot(res: dict[str, Any], path: str | os.PathLike) -> None:
    """Perplexity (beyond L, else over all scored tokens) against context, one line per method,
    dashed with log-n. Small PNG, Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = res["model"]["n_ctx_orig"]
    g = res["grid"]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, m in enumerate(g["methods"]):
        for dyn in g.get("dynamic", [False]):
            for ln in g["logn"]:
                xs, ys = [], []
                for c in res["cells"]:
                    if c["method"] == m and c["logn"] == ln and c.get("dynamic", False) == dyn:
                        y = c["ppl_beyond"] if c["ppl_beyond"] is not None else c["ppl"]
                        if y is not None:
                            xs.append(c["n_ctx"])
                            ys.append(y)
                if xs:
                    ax.plot(xs, ys, marker="s" if dyn else "o", linestyle=(":" if dyn else "--") if ln else
                            ("-." if dyn else "-"), color=colors[i % len(colors)],
                            label=m + (" dyn" if dyn else "") + (" + log n" if ln else ""))
    ax.axvline(L, color="gray", linewidth=0.8, linestyle=":", label=f"L = {L}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context n_ctx (tokens)")
    ax.set_ylabel("perplexity beyond L (else all scored)")
    ax.set_title(f"{res['model']['name']} (L = {L})", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
