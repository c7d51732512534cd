"""Consistent dynamic k in the patched library against the torch reference (issue 13).

``{arch}.rope.ntk.dynamic = true``: k = 1 while every position of the context is < L (the
unmodified model), then k = the smallest 2^e (or ``dynamic_ratio``^e) with k·L >= n, n = 1 + the
largest position the context holds once a ubatch is stored; before that ubatch runs, every cached
key of every global layer is re-rotated to the new table (seed 002 eq. 3). A ubatch takes the k of
its last position.

The reference is :func:`torch_reference.forward_dynamic` (float64, independent of ggufrope),
chunked exactly as llama.cpp's ubatches are: llama-cpp-python's ``eval`` decodes ``n_batch``
tokens per call and ``n_ubatch = n_batch`` here, so ``n_batch = c`` means chunks of c tokens.

Tiny models, L = 64, F32 weights and KV cache; tolerance 1e-3 (2e-3 for gemma3, whose CPU GELU
reads a float16 table: see test_gemma3_swa.py). Every difference these tests rely on to tell
two computations apart is asserted to be above 0.1 (POWER).
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from test_reference_forward import _overrides, assert_close, gpu_tol, rel_err, require_patched, tokens_for
from tiny_models import assert_refused_to_load, write_tiny_gemma3, write_tiny_llama, write_tiny_qwen2
from torch_reference import dynamic_factor, forward, forward_dynamic

L = 64
N = 200  # positions 0..199: k = 1 (n <= 64), 2 (65..128), 4 (129..256)
TOL = 1e-3
TOL_GEMMA3 = 2e-3
POWER = 0.1
GELU_F16 = int(os.environ.get("GGUFROPE_TEST_NGL", "0")) == 0
ARCHS = ("llama", "qwen2", "gemma3")  # NORMAL; NEOX with biases; NEOX with sliding-window layers


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("dynamic")
    return {
        "llama": write_tiny_llama(d / "llama.gguf", seed=61),
        "qwen2": write_tiny_qwen2(d / "qwen2.gguf", seed=62),
        "gemma3": write_tiny_gemma3(d / "gemma3.gguf", seed=63),
    }


def dyn(arch: str, method: str = "ntk-mixed", b: float | None = 0.625, logn: bool = False, ratio: float | None = None) -> dict:
    kv = _overrides(arch, method, None, b if method == "ntk-mixed" else None, logn)
    kv[f"{arch}.rope.ntk.dynamic"] = True
    if ratio is not None:
        kv[f"{arch}.rope.ntk.dynamic_ratio"] = float(ratio)
    return kv


def static_auto(arch: str, logn: bool) -> dict:
    """ntk-mixed with the static automatic k = max(1, n_ctx / L) (dynamic explicitly off)."""
    kv = _overrides(arch, "ntk-mixed", None, 0.625, logn)
    kv[f"{arch}.rope.ntk.dynamic"] = False
    return kv


def tol(arch: str) -> float:
    return TOL_GEMMA3 if arch == "gemma3" else TOL


def ref(m, toks, chunks, **kw):
    if m.arch == "gemma3":
        kw.setdefault("gelu_f16", GELU_F16)
    return forward_dynamic(m, toks, chunks=chunks, **kw)


def chunks_of(n: int, c: int) -> list[int]:
    return [c] * (n // c) + ([n % c] if n % c else [])


def _lib():
    import llama_cpp

    lib = llama_cpp.llama_cpp._lib
    lib.llama_ggufrope_factor.restype = ctypes.c_float
    lib.llama_ggufrope_factor.argtypes = [ctypes.c_void_p]
    lib.llama_ggufrope_dynamic.restype = ctypes.c_bool
    lib.llama_ggufrope_dynamic.argtypes = [ctypes.c_void_p]
    return lib


def open_llm(m, kv, n_ctx=256, n_batch=64, **kw):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(m.path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, logits_all=True,
                           type_k=kw.pop("type_k", 0), type_v=kw.pop("type_v", 0), n_threads=2, n_threads_batch=2,
                           n_gpu_layers=int(os.environ.get("GGUFROPE_TEST_NGL", "0")), verbose=False, kv_overrides=kv, **kw)


def run_llama_cpp(m, toks, *, n_ctx=256, n_batch=64, kv_overrides=None, **kw) -> np.ndarray:
    """All logits ``(len(toks), n_vocab)`` of one ``eval`` (chunks of ``n_batch`` tokens)."""
    llm = open_llm(m, kv_overrides, n_ctx=n_ctx, n_batch=n_batch, **kw)
    try:
        llm.eval(toks)
        return np.array(llm.scores[: len(toks)], dtype=np.float64)
    finally:
        llm.close()


def k_now(llm) -> float:
    return float(_lib().llama_ggufrope_factor(llm._ctx.ctx))


@pytest.fixture(autouse=True)
def _patched():
    require_patched()


# ----------------------------------------------------------------------------- below L: the unmodified model


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("logn", [False, True])
@pytest.mark.parametrize("n_ctx,n_batch", [(256, 64), (512, 16), (1024, 1)])
def test_below_L_bit_identical_to_none(models, arch, logn, n_ctx, n_batch):
    """Positions < L: the same logits bit for bit as method none, at any n_ctx and ubatch size."""
    m = models[arch]
    toks = tokens_for(m, L, seed=1)
    got = run_llama_cpp(m, toks, n_ctx=n_ctx, n_batch=n_batch, kv_overrides=dyn(arch, logn=logn))
    none = run_llama_cpp(m, toks, n_ctx=n_ctx, n_batch=n_batch, kv_overrides=_overrides(arch, "none", None, None, logn))
    assert np.array_equal(got, none)
    # and a static table at k = n_ctx / L is not: what dynamic mode saves on short text
    static = run_llama_cpp(m, toks, n_ctx=n_ctx, n_batch=n_batch, kv_overrides=static_auto(arch, logn))
    assert rel_err(static, none).max() > POWER


def test_below_L_k_reads_one_then_follows_the_length(models):
    m = models["llama"]
    llm = open_llm(m, dyn("llama"), n_ctx=512, n_batch=32)
    try:
        assert _lib().llama_ggufrope_dynamic(llm._ctx.ctx)
        assert k_now(llm) == 1.0
        toks = tokens_for(m, 300, seed=2)
        seen = []
        for end in (32, 64, 96, 128, 160, 256, 288):
            llm.eval(toks[llm.n_tokens:end])
            seen.append(k_now(llm))
        # n = 32, 64 -> 1; 96, 128 -> 2; 160, 256 -> 4; 288 -> 8 (hand values of the pow2 schedule)
        assert seen == [1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0]
    finally:
        llm.close()


def test_static_context_reports_not_dynamic(models):
    llm = open_llm(models["llama"], static_auto("llama", False))
    try:
        assert not _lib().llama_ggufrope_dynamic(llm._ctx.ctx)
        assert k_now(llm) == 4.0  # auto: 256 / 64
    finally:
        llm.close()


def test_dynamic_is_the_default_without_a_factor(models):
    """No dynamic key and no factor: the library runs dynamic k (the default of issue 13); a
    factor in the overrides makes it static."""
    m = models["llama"]
    llm = open_llm(m, _overrides("llama", "ntk-mixed", None, 0.625, False))
    try:
        assert _lib().llama_ggufrope_dynamic(llm._ctx.ctx)
        assert k_now(llm) == 1.0
        llm.eval(tokens_for(m, 100, seed=17))
        assert k_now(llm) == 2.0
    finally:
        llm.close()
    llm = open_llm(m, _overrides("llama", "ntk-mixed", 3.0, 0.625, False))
    try:
        assert not _lib().llama_ggufrope_dynamic(llm._ctx.ctx)
        assert k_now(llm) == 3.0
    finally:
        llm.close()


# ----------------------------------------------------------------------------- beyond L: the consistent reference


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("logn", [False, True])
@pytest.mark.parametrize("n_batch", [N, 32, 48, 1], ids=["one-call", "ubatch32", "ubatch48-straddles-L", "token-by-token"])
def test_beyond_L_matches_consistent_reference(models, arch, logn, n_batch):
    m = models[arch]
    toks = tokens_for(m, N, seed=3)
    chunks = chunks_of(N, n_batch)
    got = run_llama_cpp(m, toks, n_ctx=256, n_batch=n_batch, kv_overrides=dyn(arch, logn=logn))
    want = ref(m, toks, chunks, method="ntk-mixed", b=0.625, logn_ctx=L if logn else 0)
    assert_close(got, want, f"{arch} dynamic logn={logn} chunks of {n_batch}", tol(arch))
    if len(chunks) > 1:  # keys written before a step: without the re-rotation they would be far off
        inconsistent = ref(m, toks, chunks, method="ntk-mixed", b=0.625, logn_ctx=L if logn else 0, consistent=False)
        assert rel_err(inconsistent, want).max() > POWER


@pytest.mark.parametrize("method,b", [("ntk", None), ("ntk-fixed", None), ("ntk-mixed", 0.5), ("ntk-mixed", 1.0)])
def test_beyond_L_every_method(models, method, b):
    m = models["qwen2"]
    toks = tokens_for(m, N, seed=4)
    got = run_llama_cpp(m, toks, n_ctx=256, n_batch=16, kv_overrides=dyn("qwen2", method, b))
    want = ref(m, toks, chunks_of(N, 16), method=method, b=b if b is not None else 0.625)
    assert_close(got, want, f"qwen2 dynamic {method} b={b}")


def test_ratio_schedule(models):
    """dynamic_ratio 1.5: k = 1.5, 2.25, 3.375 ... (steps at n = 97, 145, 217)."""
    m = models["llama"]
    toks = tokens_for(m, N, seed=5)
    assert [dynamic_factor(n, L, 1.5) for n in (64, 65, 96, 97, 144, 145, 200)] == [1.0, 1.5, 1.5, 2.25, 2.25, 3.375, 3.375]
    got = run_llama_cpp(m, toks, n_ctx=256, n_batch=8, kv_overrides=dyn("llama", ratio=1.5))
    want = ref(m, toks, chunks_of(N, 8), method="ntk-mixed", schedule=1.5)
    assert_close(got, want, "llama dynamic ratio 1.5")
    pow2 = ref(m, toks, chunks_of(N, 8), method="ntk-mixed")
    assert rel_err(pow2, want).max() > POWER


def test_rope_freqs_compose(tmp_path):
    rf = np.linspace(1.0, 3.0, 8).astype(np.float32)
    m = write_tiny_llama(tmp_path / "rf.gguf", seed=64, rope_freqs=rf)
    toks = tokens_for(m, N, seed=6)
    got = run_llama_cpp(m, toks, n_ctx=256, n_batch=32, kv_overrides=dyn("llama", logn=True))
    assert_close(got, ref(m, toks, chunks_of(N, 32), method="ntk-mixed", logn_ctx=L), "llama rope_freqs x dynamic")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("type_k,tolerance", [(1, 2e-3), (8, 3e-2)], ids=["f16", "q8_0"])
def test_flash_attention_and_k_cache_types(tmp_path, arch, type_k, tolerance):
    """F16 and Q8_0 K caches with flash attention: the re-rotation dequantizes, ropes and
    requantizes the keys (the K-shift's path), so every step adds the cache type's rounding once
    more. Tolerance: the F32 one doubled for F16 (two steps, each a fresh F16 rounding of every
    key: measured 1.1e-3, the static table in one chunk 3.6e-4), 3e-2 for Q8_0; the inconsistent
    reference stays > POWER away. head_dim 32 (Q8_0 blocks are 32 wide)."""
    writer = {"llama": write_tiny_llama, "qwen2": write_tiny_qwen2}[arch]
    m = writer(tmp_path / f"{arch}.gguf", seed=66, n_embd=128, n_head=4, n_head_kv=2)
    toks = tokens_for(m, N, seed=7)
    chunks = chunks_of(N, 32)
    want = ref(m, toks, chunks, method="ntk-mixed", logn_ctx=L)
    got = run_llama_cpp(m, toks, n_ctx=256, n_batch=32, flash_attn=True, type_k=type_k, type_v=1,
                        kv_overrides=dyn(arch, logn=True))
    e = assert_close(got, want, f"{arch} dynamic flash-attn type_k={type_k}", tolerance)
    static = run_llama_cpp(m, toks, n_ctx=256, n_batch=N, flash_attn=True, type_k=type_k, type_v=1,
                           kv_overrides=_overrides(arch, "ntk-mixed", 4.0, 0.625, True))
    e_static = rel_err(static, forward(m, toks, method="ntk-mixed", k=4.0, logn_ctx=L)).max()
    print(f"same cache type, static table in one chunk: {e_static:.3e}; dynamic: {e:.3e}")
    inconsistent = ref(m, toks, chunks, method="ntk-mixed", logn_ctx=L, consistent=False)
    assert rel_err(inconsistent, want).max() > POWER


# ----------------------------------------------------------------------------- removal, several sequences, state


def test_seq_rm_steps_k_down_and_rerotates(models):
    """A new prompt sharing a prefix: 200 tokens (k = 4), cut back to 60 (llama-cpp-python's eval
    removes the cells from position 60) and 30 new tokens: n = 90, k = 2, the 60 kept keys rotated
    from 4 down to 2. Reference: the chunks that wrote the kept tokens ([32, 28]: tokens 32..59
    ran in the ubatch 32..63 at k = 1, causal) then the new ones [30]."""
    m = models["llama"]
    toks = tokens_for(m, N, seed=8)
    new = tokens_for(m, 30, seed=9)
    llm = open_llm(m, dyn("llama", logn=True), n_batch=32)
    try:
        llm.eval(toks)
        assert k_now(llm) == 4.0
        llm.n_tokens = 60
        llm.eval(new)
        assert k_now(llm) == 2.0
        got = np.array(llm.scores[60:90], dtype=np.float64)
    finally:
        llm.close()
    want = ref(m, toks[:60] + new, [32, 28, 30], method="ntk-mixed", logn_ctx=L)[60:]
    assert_close(got, want, "llama dynamic after seq_rm")


def test_memory_clear_returns_to_the_unmodified_model(models):
    m = models["qwen2"]
    toks = tokens_for(m, N, seed=10)
    short = tokens_for(m, L, seed=11)
    llm = open_llm(m, dyn("qwen2"), n_batch=32)
    try:
        llm.eval(toks)
        assert k_now(llm) == 4.0
        llm.reset()  # n_tokens = 0: the next eval removes every cell
        llm.eval(short)
        assert k_now(llm) == 1.0
        got = np.array(llm.scores[:L], dtype=np.float64)
    finally:
        llm.close()
    none = run_llama_cpp(m, short, n_ctx=256, n_batch=32, kv_overrides=_overrides("qwen2", "none", None, None, False))
    assert np.array_equal(got, none)


def _batch_decode(llama_cpp, ctx, tokens, pos0, seq_id):
    """Decode ``tokens`` at positions pos0.. in sequence seq_id, logits for every token."""
    n = len(tokens)
    batch = llama_cpp.llama_batch_init(n, 0, 1)
    try:
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = pos0 + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq_id
            batch.logits[i] = 1
        batch.n_tokens = n
        assert llama_cpp.llama_decode(ctx, batch) == 0
        n_vocab = llama_cpp.llama_n_vocab(llama_cpp.llama_model_get_vocab(llama_cpp.llama_get_model(ctx)))
        return np.array([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)) for i in range(n)],
                        dtype=np.float64)
    finally:
        llama_cpp.llama_batch_free(batch)


def test_two_sequences_share_the_longest_ones_k(models):
    """Two sequences in one context (n_seq_max 2, unified cache): one table for the context, k
    follows the longest sequence; the short one's keys are re-rotated with it. Reference for the
    short sequence: its own chunks, each run at the k the context had then."""
    import llama_cpp

    m = models["llama"]
    a = tokens_for(m, 150, seed=12)
    s = tokens_for(m, 40, seed=13)
    llm = open_llm(m, dyn("llama"), n_ctx=512, n_batch=64)  # the model, loaded with the overrides
    params = llama_cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max, params.kv_unified = 512, 128, 128, 2, True
    params.type_k = params.type_v = 0
    params.n_threads = params.n_threads_batch = 2
    ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
    assert ctx
    try:
        _batch_decode(llama_cpp, ctx, s[:20], 0, 1)          # seq 1: 20 tokens, k = 1
        _batch_decode(llama_cpp, ctx, a[:64], 0, 0)          # seq 0: k = 1
        _batch_decode(llama_cpp, ctx, a[64:150], 64, 0)      # seq 0 to 150: k = 4, seq 1's keys re-rotated
        assert _lib().llama_ggufrope_factor(ctx) == 4.0
        got = _batch_decode(llama_cpp, ctx, s[20:40], 20, 1)  # seq 1 continues at k = 4
    finally:
        llama_cpp.llama_free(ctx)
        llm.close()
    # the short sequence as the reference sees it: chunk [20] at k = 1, then [20] at k = 4 (the
    # geometric schedule with L = 20, r = 4 gives exactly these: n = 20 -> 1, n = 40 -> 4)
    assert [dynamic_factor(n, 20, 4.0) for n in (20, 40)] == [1.0, 4.0]
    want = forward_dynamic(m, s, chunks=[20, 20], L=20, schedule=4.0, method="ntk-mixed")[20:]
    assert_close(got, want, "seq 1 beside a longer seq 0")


def test_state_roundtrip_carries_k(models):
    """Full state saved at k = 4 and restored into a fresh context (k = 1): the context adopts k = 4
    and the next tokens' logits are those of the context that saved it."""
    m = models["llama"]
    toks = tokens_for(m, N, seed=14)
    kv = dyn("llama", logn=True)
    llm = open_llm(m, kv, n_batch=32)
    try:
        llm.eval(toks[:150])
        state = llm.save_state()
        llm.eval(toks[150:])
        cont = np.array(llm.scores[150:N], dtype=np.float64)
    finally:
        llm.close()
    llm = open_llm(m, kv, n_batch=32)
    try:
        assert k_now(llm) == 1.0
        llm.load_state(state)
        assert k_now(llm) == 4.0
        llm.eval(toks[150:])
        got = np.array(llm.scores[150:N], dtype=np.float64)
    finally:
        llm.close()
    assert np.array_equal(got, cont)
    # a static context refuses the dynamic state
    static = open_llm(m, _overrides("llama", "ntk-mixed", 4.0, 0.625, True), n_batch=32)
    try:
        with pytest.raises(RuntimeError):
            static.load_state(state)
    finally:
        static.close()


def test_seq_state_restored_into_another_k(models):
    """A sequence saved at k = 2 (n = 100) restored into a context at k = 1: its keys are rotated
    from 2 to 1 on load, then to 4 with the next ubatch (n = 130; the saving context went 2 -> 4);
    the continuation matches the context that saved it (within float rounding of the extra rotation)."""
    import llama_cpp

    m = models["qwen2"]
    toks = tokens_for(m, 130, seed=15)
    kv = dyn("qwen2")
    llm = open_llm(m, kv, n_batch=64)
    try:
        ctx = llm._ctx.ctx
        _batch_decode(llama_cpp, ctx, toks[:64], 0, 0)
        _batch_decode(llama_cpp, ctx, toks[64:100], 64, 0)
        assert k_now(llm) == 2.0
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        assert llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0) == size
        cont = _batch_decode(llama_cpp, ctx, toks[100:130], 100, 0)
    finally:
        llm.close()
    llm = open_llm(m, kv, n_batch=64)
    try:
        ctx = llm._ctx.ctx
        assert llama_cpp.llama_state_seq_set_data(ctx, buf, size, 0) == size
        assert k_now(llm) == 1.0  # the context keeps its k; the restored keys were rotated to it
        got = _batch_decode(llama_cpp, ctx, toks[100:130], 100, 0)
        assert k_now(llm) == 4.0  # n = 130
    finally:
        llm.close()
    e = rel_err(got, cont).max()
    print(f"seq state restored across k: max rel err {e:.2e}")
    assert e < gpu_tol(1e-5)


@pytest.mark.parametrize("logn", [False, True])
def test_k_shift_then_step_down(tmp_path, logn):
    """Context shift (K-shift) with dynamic k, as test_patched_model's K-shift test: one layer, so a
    token's key and value do not depend on the tokens before it. prefix (120) + body (79): n = 199,
    k = 4. Remove the prefix and shift the body to positions 0..78, then one more token at 79: the
    K-shift runs with the current table (k = 4), then n = 80 gives k = 2 and the keys are rotated
    from 4 to 2. The next token's logits must equal a fresh dynamic context that saw only the body
    (one ubatch of 80 tokens, k = 2)."""
    m = write_tiny_llama(tmp_path / "m.gguf", seed=67, n_layer=1)
    toks = tokens_for(m, 200, seed=16)
    prefix, body, nxt = toks[:120], toks[120:199], toks[199]
    kv = dyn("llama", logn=logn)

    fresh = open_llm(m, kv, n_batch=256)
    try:
        fresh.eval(body + [nxt])
        assert k_now(fresh) == 2.0
        want = np.array(fresh.scores[len(body)], dtype=np.float64)
    finally:
        fresh.close()

    llm = open_llm(m, kv, n_batch=256)
    try:
        llm.eval(prefix + body)
        assert k_now(llm) == 4.0
        n_pre = len(prefix)
        assert llm._ctx.kv_cache_seq_rm(0, 0, n_pre)
        llm._ctx.kv_cache_seq_shift(0, n_pre, -1, -n_pre)
        llm.n_tokens = len(body)
        llm.input_ids[: len(body)] = body
        llm.eval([nxt])
        assert k_now(llm) == 2.0
        got = np.array(llm.scores[len(body)], dtype=np.float64)
    finally:
        llm.close()
    assert_close(got[None], want[None], f"K-shift then dynamic step down, logn={logn}", tol=1e-4)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("extra,message", [
    ({"method": "none", "dynamic": True}, "invalid llama.rope.ntk.dynamic: dynamic k needs an NTK-family method"),
    ({"factor": 2.0, "dynamic": True}, "invalid llama.rope.ntk.dynamic: dynamic k is chosen from the length"),
    ({"dynamic": True, "dynamic_ratio": 1.0}, "invalid llama.rope.ntk.dynamic_ratio: 1 (expected a ratio > 1)"),
], ids=["method-none", "factor", "ratio"])
def test_invalid_dynamic_refuses_to_load(tmp_path, extra, message):
    """Written into the file (bypassing ggufrope set's checks): the library refuses with a message."""
    kv = {"llama.rope.ntk.method": "ntk-mixed"} | {f"llama.rope.ntk.{k}": v for k, v in extra.items()}
    m = write_tiny_llama(tmp_path / "bad.gguf", seed=65, extra_kv=kv)
    assert_refused_to_load(m.path, message)
