"""Dynamic k on the real models (issue 13): below L the unmodified model, bit for bit.

SmolLM2-135M-Instruct Q4_1 (llama, NORMAL, L = 8192) and Gemma 3 270M Q4_K_M (gemma3, NEOX,
sliding-window layers, L = 32768). 1024 tokens of real text, logits read at every 8th position
and the last (the low-level API, so that no n_ctx x n_vocab score matrix is allocated), ubatches
of 512. ntk-mixed + log-n by kv overrides at a context far beyond L:

- dynamic k gives exactly the logits of method none (no table, no log-n) at the same n_ctx;
- a static table at the k that context would get (n_ctx / L) does not: what dynamic k saves on
  text that fits in L.

And beyond L, SmolLM2, one ubatch of 8704 tokens: with nothing cached before it, the ubatch runs
at k = 2 (its last position is beyond L), exactly as the static table at k = 2 does (slow: two
8.7k prefills).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytestmark = pytest.mark.real_model

N_TOK = 1024
EVERY = 8


def _text_tokens(llm, n: int) -> list[int]:
    from ggufrope.corpus import demo_text

    toks = llm.tokenize(demo_text().encode(), add_bos=True)
    assert len(toks) >= n
    return toks[:n]


def _decode_logits(llm, tokens: list[int], positions: list[int], n_ubatch: int) -> np.ndarray:
    """Decode ``tokens`` from an empty cache in calls of ``n_ubatch`` tokens; logits at ``positions``."""
    import llama_cpp

    ctx = llm._ctx.ctx
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    n_vocab = llm.n_vocab()
    want = set(positions)
    out = {}
    for start in range(0, len(tokens), n_ubatch):
        chunk = tokens[start:start + n_ubatch]
        batch = llama_cpp.llama_batch_init(len(chunk), 0, 1)
        try:
            rows = []
            for i, t in enumerate(chunk):
                p = start + i
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = t, p, 1, 0
                batch.logits[i] = 1 if p in want else 0
                if p in want:
                    rows.append((i, p))
            batch.n_tokens = len(chunk)
            assert llama_cpp.llama_decode(ctx, batch) == 0
            for i, p in rows:
                out[p] = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
        finally:
            llama_cpp.llama_batch_free(batch)
    return np.array([out[p] for p in positions], dtype=np.float32)


def _run(model, arch: str, n_ctx: int, kv: dict, tokens_from=None, n_tok=N_TOK, n_ubatch=512, positions=None):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=n_ctx, n_batch=n_ubatch, n_ubatch=n_ubatch, flash_attn=True,
                          n_threads=2, n_threads_batch=2, verbose=False, kv_overrides=kv)
    try:
        toks = _text_tokens(llm, n_tok) if tokens_from is None else tokens_from
        pos = positions if positions is not None else sorted(set(range(0, len(toks), EVERY)) | {len(toks) - 1})
        f = llama_cpp.llama_cpp._lib.llama_ggufrope_factor
        f.restype, f.argtypes = ctypes.c_float, [ctypes.c_void_p]
        logits = _decode_logits(llm, toks, pos, n_ubatch)
        return logits, float(f(llm._ctx.ctx)), toks
    finally:
        llm.close()


def _kv(arch: str, dynamic: bool | None, method: str = "ntk-mixed", logn: bool = True, factor: float | None = None) -> dict:
    kv = {f"{arch}.rope.ntk.method": method, f"{arch}.attention.logn_scaling": logn}
    if dynamic is not None:
        kv[f"{arch}.rope.ntk.dynamic"] = dynamic
    if factor is not None:
        kv[f"{arch}.rope.ntk.factor"] = float(factor)
    return kv


@pytest.mark.parametrize("name,arch,n_ctx,L", [("smollm2", "llama", 32768, 8192), ("gemma3", "gemma3", 65536, 32768)])
def test_below_L_dynamic_is_the_unmodified_model(patched_lib, name, arch, n_ctx, L):
    from ggufrope.models import model_path

    model = model_path(name)
    dyn, k_dyn, toks = _run(model, arch, n_ctx, _kv(arch, True))
    none, _, _ = _run(model, arch, n_ctx, _kv(arch, None, method="none", logn=False), tokens_from=toks)
    assert k_dyn == 1.0
    assert np.array_equal(dyn, none), f"{name}: dynamic k below L differs from method none"
    static, k_static, _ = _run(model, arch, n_ctx, _kv(arch, False, factor=n_ctx / L), tokens_from=toks)
    assert k_static == n_ctx / L
    d = np.abs(static - none).max()
    print(f"{name}: static k = {k_static:g} moves the logits below L by up to {d:.3f}")
    assert d > 0.1


@pytest.mark.slow
def test_one_ubatch_beyond_L_is_the_static_table(patched_lib):
    from ggufrope.models import model_path

    model = model_path("smollm2")
    n = 8704  # 17 x 512: the last position is beyond L = 8192
    pos = [0, 4096, 8191, 8192, 8703]
    dyn, k_dyn, toks = _run(model, "llama", 16384, _kv("llama", True), n_tok=n, n_ubatch=n, positions=pos)
    static, k_static, _ = _run(model, "llama", 16384, _kv("llama", False, factor=2.0), tokens_from=toks, n_ubatch=n,
                               positions=pos)
    assert (k_dyn, k_static) == (2.0, 2.0)
    assert np.array_equal(dyn, static)
