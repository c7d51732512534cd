"""The model and the low-level decoding of the evaluation: :class:`Setting` (a method as the
evaluation applies it), :func:`load_model`, :class:`Decoder` (batched decoding with logits only
where asked), :func:`token_nll` and :func:`greedy_answer`.

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

**Prefix reuse** (retrieval prompts): :func:`greedy_answer` starts a prompt from the KV cache
of the previous one where both begin alike (the filler before a needle), as llama-server reuses
its prompt cache, where :func:`prefix_reuse_ok` allows it, from a batch boundary, so that
the logits are those of a prefill from empty. Retrieval rows record ``reused_tokens``.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..errors import GGUFRopeError
from ..methods import DEFAULT_DYNAMIC_RATIO, METHODS, auto_factor, entry, to_float32
from ..runtime import RopeChoice

DEFAULT_N_GEN = 10  #: greedy tokens decoded for the answer (SmolLM2 spells digits one a token)


@dataclasses.dataclass(frozen=True)
class Setting(RopeChoice):
    """A method as the evaluation applies it: :class:`ggufrope.runtime.RopeChoice` (same fields
    and the registry's checks; ``factor`` None means k = max(1, n_ctx / L), see the module
    docstring) with k resolved per context. ``dynamic`` is a bool here: True runs dynamic k
    (no k is passed), False (or None) one explicit k per context.

    ``attn_factor`` s > 0: a constant attention scale, llama.cpp's own ``yarn_attn_factor``
    context parameter, which multiplies cos and sin of the rope op on Q and K, so the attention
    logits by s². 1 (the default) passes nothing; with ``yarn``, which applies its own scale
    0.1 ln k + 1 in the same rope op, only 1 is accepted (no silent combination)."""

    attn_factor: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "dynamic", bool(self.dynamic))
        try:
            s = float(self.attn_factor)
        except (TypeError, ValueError):
            raise GGUFRopeError(f"attention factor must be a number > 0, got {self.attn_factor!r}") from None
        if not (math.isfinite(s) and s > 0):
            raise GGUFRopeError(f"attention factor must be a number > 0, got {self.attn_factor!r}")
        if s != 1.0 and self.method == "yarn":
            raise GGUFRopeError(f"attention factor {s:g} with yarn: yarn scales attention itself (0.1 ln k + 1, in "
                                "the same rope op); the two are not combined, use 1 with yarn")
        object.__setattr__(self, "attn_factor", s)

    @classmethod
    def for_grid(cls, method: str, factor: float | None, exponent: float | None, logn: bool,
                 dynamic: bool = False, dynamic_ratio: float | None = None, attn_factor: float = 1.0) -> Setting:
        """The setting of ``method`` in a grid whose k and b are given once for all methods: k
        goes only to methods that take one (and not with dynamic k, which chooses its own), b
        only to ntk-mixed (the registry's parameters), the ratio r only to dynamic rows; the
        attention factor s to every row."""
        try:
            m = entry(method)
        except ValueError as e:
            raise GGUFRopeError(str(e)) from None
        return cls(m.name, factor if m.uses_factor and not dynamic else None, exponent if m.uses_exponent else None,
                   logn, dynamic, dynamic_ratio=dynamic_ratio if dynamic else None, attn_factor=attn_factor)

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
        s += " + log-n" if self.logn else ""
        return s + (f" attn×{self.attn_factor:g}" if self.attn_factor != 1.0 else "")

    def key_fields(self) -> dict[str, Any]:
        """What dynamic k and an attention factor add to a cached unit's key: ``{"dynamic": True,
        "dynamic_ratio": r}`` with dynamic k, ``{"attn_factor": s}`` when s != 1; nothing for a
        static setting with s = 1 (its key is the one it had before either existed)."""
        out: dict[str, Any] = {}
        if self.dynamic:
            r = self.dynamic_ratio
            out.update(dynamic=True, dynamic_ratio=float(DEFAULT_DYNAMIC_RATIO if r is None else r))
        if self.attn_factor != 1.0:
            out["attn_factor"] = self.attn_factor
        return out


def n_ctx_orig_of(model: str | os.PathLike) -> int:
    """L, the model's trained context (``read_rope_metadata(model)["n_ctx_orig"]``)."""
    from ..rope_metadata import read_rope_metadata

    L = read_rope_metadata(model)["n_ctx_orig"]
    if not L:
        raise GGUFRopeError(f"{os.fspath(model)}: no context length (L) in the file")
    return int(L)


def batch_sizes(n_batch: int, n_ubatch: int | None, n_ctx: int) -> tuple[int, int]:
    """(n_batch, n_ubatch) as :func:`load_model` passes them: n_batch capped by ``n_ctx``,
    n_ubatch (default: n_batch) capped by n_batch."""
    n_batch = max(1, min(int(n_batch), int(n_ctx)))
    return n_batch, min(n_batch, n_ubatch or n_batch)


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
    """``runtime.load`` with ``setting`` at ``n_ctx``; ``n_batch`` is capped by ``n_ctx`` and
    ``n_ubatch`` defaults to it (:func:`batch_sizes`). An attention factor s != 1 is passed as
    ``yarn_attn_factor``.

    k is passed explicitly (:meth:`Setting.resolved_factor`, see the module docstring) and the
    k the context applies is read back: a library that applies another k (or none) raises
    :class:`GGUFRopeError`. With dynamic k no k is passed (auto, with the dynamic override) and
    the k read back must be 1 (the context is empty). The returned ``Llama`` carries
    ``llm.ggufrope`` (:class:`ggufrope.runtime.RopeInUse`)."""
    from ..runtime import load

    L = n_ctx_orig_of(model)
    kw: dict[str, Any] = dict(kwargs)
    if threads:
        kw["n_threads"] = kw["n_threads_batch"] = threads
    n_batch, n_ubatch = batch_sizes(n_batch, n_ubatch, n_ctx)
    if setting.attn_factor != 1.0:
        if "yarn_attn_factor" in kw:
            raise GGUFRopeError(f"{setting.label()}: yarn_attn_factor given twice (the setting's attention factor)")
        kw["yarn_attn_factor"] = setting.attn_factor
    k = setting.resolved_factor(n_ctx, L)
    llm = load(
        model, method=setting.method, factor=k, exponent=setting.exponent,
        logn=setting.logn, dynamic=setting.dynamic, dynamic_ratio=setting.dynamic_ratio if setting.dynamic else None,
        n_ctx=n_ctx, n_gpu_layers=gpu_layers, verbose=verbose,
        n_batch=n_batch, n_ubatch=n_ubatch, **kw,
    )
    used = llm.ggufrope.factor
    if setting.dynamic:
        if not llm.ggufrope.dynamic or used != 1.0:
            raise GGUFRopeError(f"{setting.label()}: llama.cpp starts the context with k = {used}"
                                f"{'' if llm.ggufrope.dynamic else ', static'}, where dynamic k starts at 1")
    elif (k is None) != (used is None) or (k is not None and to_float32(used) != to_float32(k)):
        raise GGUFRopeError(f"{setting.label()}: llama.cpp applies k = {used} where k = {k} was passed")
    return llm


def prefix_reuse_ok(llm: Any) -> bool:
    """Whether :func:`greedy_answer` may start a prompt on ``llm`` (a ``llama_cpp.Llama``) from
    the longest prefix that its KV cache already holds: a CPU-only library (on a GPU the kernels
    are chosen by batch size, and a CUDA build offloads large batches even with no layer
    offloaded), static k (dynamic k re-rotates the cached keys as the sequence grows) and, with
    sliding-window layers (``llama_model_n_swa`` > 0, Gemma 3), a full-size SWA cache
    (``swa_full``, llama.cpp's default): the small SWA cache reuses the cells of positions older
    than the window, so the positions just before the prefix's end may be gone; the full-size
    one holds every position at the cell of its index, as a prefill from empty does. The prefix
    kept ends on a batch boundary (:meth:`Decoder.keep_prefix`), so every batch decoded is one
    that a prefill from empty decodes too: tests/test_eval_decoder.py shows the logits bit for
    bit equal (tiny llama and tiny gemma3 with a kept prefix 4 windows long, NTK-mixed + log-n
    and YaRN beyond L), tests/test_eval_ruler.py the answers on SmolLM2. (A prefix kept off the
    batch boundary changed 3 of 10 greedy answers of SmolLM2 at 16384 tokens,
    docs/results.md.)"""
    import llama_cpp

    from ..runtime import dynamic_in_use, has_dynamic, has_gpu

    rope = getattr(llm, "ggufrope", None)
    dynamic = rope.dynamic if rope is not None else (has_dynamic() and dynamic_in_use(llm))
    swa_ok = int(llama_cpp.llama_model_n_swa(llm.model)) == 0 or bool(llm.context_params.swa_full)
    return not has_gpu() and swa_ok and not dynamic


#: fitted retrieval prompts kept by :func:`memo_prompt`, the most recent last
_PROMPTS: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
#: how many :func:`memo_prompt` keeps: the prompts of several cells of 10 samples (a 131,072-token
#: prompt is about 5 MB as a list of ints)
PROMPT_MEMO_SIZE = 40


def memo_prompt(llm: Any, what: tuple, build: Callable[[], Any]) -> Any:
    """``build()``, remembered for the model file of ``llm`` (real path, size, mtime) and
    ``what`` (the prompt's recipe: task, seed, index, token budget, ...): the cells of a grid load
    the same model once per setting and build the same retrieval prompts, and so does the
    truncation baseline (cut afterwards), and at 131,072 tokens a prompt takes seconds of
    tokenization to fit. Only the tokenizer and the chat template of the file decide the result,
    which the rope settings of a load do not change. The caller must not modify what it gets."""
    path = getattr(llm, "model_path", None)
    if not path:
        return build()
    try:
        st = os.stat(path)
    except OSError:
        return build()
    key = (os.path.realpath(path), st.st_size, st.st_mtime_ns, *what)
    if key in _PROMPTS:
        _PROMPTS.move_to_end(key)
        return _PROMPTS[key]
    value = build()
    _PROMPTS[key] = value
    while len(_PROMPTS) > PROMPT_MEMO_SIZE:
        _PROMPTS.popitem(last=False)
    return value


class Decoder:
    """Batched decoding of one sequence on a loaded ``llama_cpp.Llama`` with the low-level API:
    logits are computed only where asked and read back row by row with ``llama_get_logits_ith``.

    ``reuse_prefix`` (:func:`prefix_reuse_ok`, settable): :func:`greedy_answer` keeps the
    prefix of its prompt that the KV cache holds (:meth:`keep_prefix`); ``last_reused`` is the
    number of tokens it kept last time."""

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
        self._kv: list[int] | None = []  #: the tokens at positions 0.. of the KV cache (None: unknown)
        self.reuse_prefix = prefix_reuse_ok(llm)
        self.last_reused = 0

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
        self._kv = []

    def keep_prefix(self, tokens: Sequence[int]) -> int:
        """Keep in the KV cache the longest prefix of ``tokens`` that it holds at positions 0..,
        cut down to a multiple of n_batch (so that the rest is decoded in the batches, and
        llama.cpp's ubatches, of a prefill from empty: same shapes, same kernels, same
        rounding) and to at most ``len(tokens) - 1`` tokens (one is left to decode for its
        logits); drop the rest of the sequence and return the prefix's length, 0 when nothing is
        kept (the cache is then empty). Decode ``tokens[n:]`` at ``n`` next."""
        kv = self._kv or []
        n = min(len(kv), len(tokens) - 1)
        p = 0
        if n > 0:
            diff = np.flatnonzero(np.asarray(kv[:n]) != np.asarray(tokens[:n]))
            p = int(diff[0]) if diff.size else n
            p -= p % self.n_batch
        if p == 0 or not self.lc.llama_memory_seq_rm(self.lc.llama_get_memory(self.ctx), 0, p, -1):
            self.clear()
            return 0
        del kv[p:]
        return p

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        """``add_bos``: add the vocabulary's special prefix when it asks for one (as llama.cpp's
        ``common_tokenize(..., add_special=true)``)."""
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)

    def decode(self, tokens: Sequence[int], pos0: int, outputs: Iterable[int],
               on_rows: Callable[[list[int], np.ndarray], None],
               on_batch: Callable[[int], None] | None = None) -> None:
        """Decode ``tokens`` at positions ``pos0, pos0 + 1, ...`` in batches of ``n_batch``;
        for every batch, call ``on_rows(indices, logits)`` with the sorted indices (into
        ``tokens``) of the requested outputs in it and their logits, float32, shape
        ``(len(indices), n_vocab)`` (a buffer reused between calls), then ``on_batch(n)`` with
        the batch's number of tokens (for a progress bar)."""
        want = np.zeros(len(tokens), dtype=bool)
        idx = np.fromiter(outputs, dtype=np.int64)
        if idx.size:
            if idx.min() < 0 or idx.max() >= len(tokens):
                raise ValueError("output index out of range")
            want[idx] = True
        if pos0 + len(tokens) > self.n_ctx:
            raise GGUFRopeError(f"{pos0 + len(tokens)} positions do not fit in n_ctx {self.n_ctx}")
        if self._kv is not None and pos0 != len(self._kv):
            self._kv = None  # not appended to the cached sequence: its content is no longer known
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
            if self._kv is not None:
                if rc == 0:
                    self._kv.extend(int(t) for t in tokens[s:e])
                else:
                    self._kv = None
            if rc != 0:
                raise GGUFRopeError(f"llama_decode failed (status {rc}) at positions {pos0 + s}..{pos0 + e - 1}")
            self.n_decoded += e - s
            if rows:
                if buf is None or buf.shape[0] < len(rows):
                    buf = np.empty((len(rows), self.n_vocab), dtype=np.float32)
                for r, j in enumerate(rows):
                    ptr = self.lc.llama_get_logits_ith(self.ctx, j - s)
                    if not ptr:
                        raise GGUFRopeError(f"no logits for batch index {j - s}")
                    buf[r] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))
                on_rows(rows, buf[: len(rows)])
            if on_batch is not None:
                on_batch(e - s)


def token_nll(logits: np.ndarray, targets: np.ndarray, block: int = 128, workers: int | None = None) -> np.ndarray:
    """-log softmax(logits)[target] per row, computed in float64 (``logits``: (n, V), ``targets``:
    (n,) token ids; returns (n,) nats). Blocks of at most ``block`` rows run on ``workers`` threads
    (default: the CPU count; numpy releases the GIL), each row's arithmetic the same whatever the
    split, so the result does not depend on ``block`` or ``workers``. With Gemma 3's 262,144-token
    vocabulary one 65,536-token window scores 49,152 rows: 13 G exponentials."""
    n = len(targets)
    out = np.empty(n, dtype=np.float64)
    workers = max(1, workers or os.cpu_count() or 1)
    step = max(1, min(block, -(-n // workers)))

    def one(s: int) -> None:
        x = logits[s : s + step].astype(np.float64)
        m = x.max(axis=1)
        tgt = x[np.arange(len(x)), targets[s : s + step]]
        np.subtract(x, m[:, None], out=x)
        np.exp(x, out=x)
        out[s : s + step] = m + np.log(x.sum(axis=1)) - tgt

    starts = range(0, n, step)
    if workers == 1 or len(starts) == 1:
        for s in starts:
            one(s)
    else:
        with ThreadPoolExecutor(min(workers, len(starts))) as ex:
            list(ex.map(one, starts))
    return out


def answer_order(dec: Decoder, depths: Sequence[float | None]) -> list[int]:
    """The order in which to answer prompts whose needles sit at ``depths`` (0..1; None: no
    needle, counted as 0): with ``dec.reuse_prefix`` deepest first, so that each prompt shares
    its filler up to its own needle with the one answered before it (:meth:`Decoder.keep_prefix`),
    else as given."""
    if not dec.reuse_prefix:
        return list(range(len(depths)))
    return sorted(range(len(depths)), key=lambda i: -(depths[i] or 0.0))


def greedy_answer(dec: Decoder, tokens: Sequence[int], n_gen: int = DEFAULT_N_GEN) -> str:
    """Evaluate ``tokens`` from an empty context, then decode up to ``n_gen`` tokens greedily
    (stopping at an end-of-generation token); return the decoded text. With
    ``dec.reuse_prefix`` the tokens that the KV cache already holds at the start of
    ``tokens`` are kept instead of evaluated again (:meth:`Decoder.keep_prefix`; their number
    in ``dec.last_reused``)."""
    import llama_cpp

    if dec.reuse_prefix and tokens:
        p = dec.keep_prefix(tokens)
    else:
        dec.clear()
        p = 0
    dec.last_reused = p
    nxt: list[int] = []

    def take(rows: list[int], logits: np.ndarray) -> None:
        nxt.append(int(np.argmax(logits[-1])))

    dec.decode(tokens[p:], p, [len(tokens) - p - 1], take)
    out: list[int] = []
    while True:
        tok = nxt[-1]
        if llama_cpp.llama_vocab_is_eog(dec.vocab, tok) or len(out) >= n_gen:
            break
        out.append(tok)
        if len(out) < n_gen:
            dec.decode([tok], len(tokens) + len(out) - 1, [0], take)
    return dec.llm.detokenize(out).decode("utf-8", errors="replace")

