"""Perplexity on long documents, and the texts it is measured on.

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
positions, which the model never saw in training (log-n scales exactly these queries). The
others, predicted from positions p < L, are **within L** (:func:`summarize_windows`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ..errors import GGUFRopeError
from .decoder import Decoder, token_nll


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
                 bos: bool | None = None,
                 on_batch: Callable[[int], None] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Evaluate one window from an empty context; return (positions p, nll of token p + 1) for
    ``score_from <= p <= len(window) - 2``. The first token is replaced by BOS when ``bos``
    (default: when the vocabulary adds BOS), as llama-perplexity does. ``on_batch(n)`` is
    called after each decoded batch of n tokens (:meth:`Decoder.decode`)."""
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
    dec.decode(toks, 0, pos, take, on_batch)
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
    # counted in tokens, not windows: one window of a long context is minutes on a CPU
    with tqdm(total=len(starts) * n_ctx, unit="tok", unit_scale=True, desc=desc, disable=not progress,
              file=sys.stderr, dynamic_ncols=True, leave=False) as bar:
        for w, s in enumerate(starts):
            t0 = time.perf_counter()
            pos, nll = score_window(dec, tokens[s : s + n_ctx], sf, n_ctx_orig, on_batch=bar.update)
            if per_token is not None:
                per_token.append((pos, nll))
            beyond = pos >= n_ctx_orig
            r = WindowResult(w, s, float(nll.sum()), int(len(nll)), float(nll[beyond].sum()), int(beyond.sum()),
                             time.perf_counter() - t0)
            out.append(r)
            tot, cnt = tot + r.nll, cnt + r.count
            bar.set_postfix(window=f"{w + 1}/{len(starts)}", ppl=f"{math.exp(tot / cnt):.3f}")
    return out


def summarize_windows(windows: Iterable[WindowResult | dict]) -> dict[str, Any]:
    """Pool windows: perplexity over all scored tokens, over tokens beyond L and over tokens
    within L (predicted from positions p < L: all scored tokens less those beyond L); None
    where there are no such tokens."""
    ws = [w if isinstance(w, dict) else dataclasses.asdict(w) for w in windows]
    nll, cnt = sum(w["nll"] for w in ws), sum(w["count"] for w in ws)
    nb, cb = sum(w["nll_beyond"] for w in ws), sum(w["count_beyond"] for w in ws)
    nw, cw = nll - nb, cnt - cb
    return {
        "ppl": math.exp(nll / cnt) if cnt else None,
        "ppl_beyond": math.exp(nb / cb) if cb else None,
        "ppl_within": math.exp(nw / cw) if cw else None,
        "nll": nll, "count": cnt, "nll_beyond": nb, "count_beyond": cb, "nll_within": nw, "count_within": cw,
        "n_windows": len(ws), "seconds": sum(w["seconds"] for w in ws),
    }



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
    from .. import corpus

    if not names:
        return [Text(d.name, corpus.load_text(d.name)) for d in corpus.documents()]
    out = []
    for n in names:
        if os.path.isfile(n):
            from ..generate import read_prompt

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
