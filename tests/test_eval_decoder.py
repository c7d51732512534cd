"""ggufrope/evaluation/decoder.py: the token NLL, the Setting's attention factor, and every
method reaching the library through load_model.

a. The token NLL is a float64 log-softmax.
b. A constant attention scale s (``Setting.attn_factor``, llama.cpp's ``yarn_attn_factor``):
   its checks; a unit key with s != 1 differs, one with s = 1 is the key of before; and on a
   tiny model llama.cpp's logits are the torch reference's with every attention logit
   multiplied by s².
c. Every method reaches the library (the real model at a short context): logits differ from
   `none` and from each other at every position > 0 and agree where the math says they must
   (position 0; ntk-mixed with k = 1; log-n below L), so a silently ignored override cannot pass.
d. The factor k the evaluation applies: passed explicitly and checked against the one in use.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from ggufrope.errors import GGUFRopeError
from ggufrope.evaluation import cache as EC, decoder as ED

THREADS = os.cpu_count() or 1
L = 64  # n_ctx_train of the tiny models
FP = {"sha256": "ab" * 32, "size": 1234}


# --- a. the token NLL -------------------------------------------------------------------------------


@pytest.mark.real_model
def test_token_nll_is_float64_log_softmax():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((300, 1000)) * 20).astype(np.float32)
    t = rng.integers(0, 1000, 300)
    x64 = x.astype(np.float64)
    ref = np.log(np.exp(x64 - x64.max(1, keepdims=True)).sum(1)) + x64.max(1) - x64[np.arange(300), t]
    np.testing.assert_allclose(ED.token_nll(x, t, block=64), ref, rtol=1e-12)


def test_token_nll_does_not_depend_on_the_split():
    """Rows are split into blocks over threads (a Gemma 3 window scores 13 G exponentials); the
    cached units of earlier runs stay comparable only if every split gives the same bits."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((301, 777)) * 20).astype(np.float32)
    t = rng.integers(0, 777, 301)
    one = ED.token_nll(x, t, block=301, workers=1)
    for block, workers in [(128, 1), (7, 3), (64, 16), (1, 2)]:
        assert np.array_equal(ED.token_nll(x, t, block=block, workers=workers), one), (block, workers)


# --- b. attention factor: key, label, checks ------------------------------------------------------


def test_attn_factor_key_and_label():
    old = {"eval_version": 1, "model": FP, "method": "ntk-mixed", "factor": 2.0, "exponent": 0.625, "logn": True,
           "n_ctx": 128, "n_ctx_orig": L}  # the key as written before attn_factor existed
    one = ED.Setting.for_grid("ntk-mixed", None, 0.625, True)
    assert EC.unit_key(one, 128, L, FP) == old
    assert EC.unit_key(ED.Setting("ntk-mixed", None, 0.625, True, attn_factor=1), 128, L, FP) == old
    s = ED.Setting.for_grid("ntk-mixed", None, 0.625, True, attn_factor=1.035)
    key = EC.unit_key(s, 128, L, FP)
    assert key == {**old, "attn_factor": 1.035} and key != old
    cache = EC.Cache.__new__(EC.Cache)
    cache.root = pathlib.Path("cache")
    assert cache.path({**key, "kind": "passkey"}) != cache.path({**old, "kind": "passkey"})
    assert s.label(128, L) == "ntk-mixed (b=0.625) k=2 + log-n attn×1.035"
    assert one.label(128, L) == "ntk-mixed (b=0.625) k=2 + log-n"
    assert s != one and hash(s) != hash(one)


def test_attn_factor_checks():
    for bad in (0, -1.0, float("nan"), float("inf"), "x"):
        with pytest.raises(GGUFRopeError, match="attention factor must be a number > 0"):
            ED.Setting("none", attn_factor=bad)
    with pytest.raises(GGUFRopeError, match="attention factor 1.1 with yarn: .* use 1 with yarn"):
        ED.Setting("yarn", 2.0, attn_factor=1.1)
    assert ED.Setting("yarn", 2.0, attn_factor=1).attn_factor == 1.0


# --- b. attention factor: llama.cpp against the torch reference -------------------------------------


def _logits(model, setting, toks):
    # F32 KV cache and no flash attention, as tests/test_reference_forward.py compares them
    llm = ED.load_model(model.path, setting, len(toks), n_batch=len(toks), threads=2, flash_attn=False,
                       type_k=0, type_v=0)
    with ED.Decoder(llm) as dec:
        buf = np.empty((len(toks), dec.n_vocab), dtype=np.float64)

        def take(rows, logits):
            buf[rows] = logits

        dec.clear()
        dec.decode(toks, 0, range(len(toks)), take)
    del llm
    return buf


def _rel_err(a, b):
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("method,k,logn", [("none", 1.0, False), ("ntk-mixed", 4.0, True)])
def test_attn_factor_scales_attention_logits_by_its_square(patched_lib, tiny, method, k, logn):
    from torch_reference import forward

    s = 1.3
    toks = np.random.default_rng(0).integers(4, tiny.n_vocab, size=4 * L).tolist()
    st = ED.Setting(method, k if method != "none" else None, logn=logn, attn_factor=s)
    got = _logits(tiny, st, toks)
    ref = forward(tiny, toks, method=method, k=k, logn_ctx=L if logn else 0, attn_logit_scale=s * s)
    plain = forward(tiny, toks, method=method, k=k, logn_ctx=L if logn else 0)
    err, moved = _rel_err(got, ref).max(), _rel_err(plain, ref).max()
    print(f"\n{st.label()}: max rel err {err:.2e} against the reference with logits x s^2; s = 1 is {moved:.2e} away")
    assert err <= 1e-3 and moved > 1e-2
    assert _rel_err(_logits(tiny, ED.Setting(method, k if method != "none" else None, logn=logn), toks),
                    plain).max() <= 1e-3


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


@pytest.mark.real_model
def test_methods_differ_where_they_must(all_logits):
    moved = ["linear", "yarn", "ntk", "ntk-fixed", "ntk-mixed", "ntk-mixed b=0.4"]
    for i, a in enumerate(["none"] + moved):
        for b in moved[i:]:
            if a == b:
                continue
            d = _maxdiff(all_logits[a], all_logits[b])
            assert d[0] == 0.0, f"{a} vs {b} at position 0: rope is the identity there"
            assert d[1:].min() > 1e-3, f"{a} vs {b}: logits equal at position {int(np.argmin(d[1:])) + 1}"


@pytest.mark.real_model
def test_methods_agree_where_they_must(all_logits):
    none = all_logits["none"]
    assert np.array_equal(none, all_logits["none again"])  # the engine is deterministic
    assert np.array_equal(none, all_logits["ntk-mixed k=1"])  # every ff_i = exp(0) = 1
    assert np.array_equal(none, all_logits["none+logn"])  # every position < L = 8192
    # b = 1 is ntk-fixed: a*(i+1) with a = ln k / (d/2) is (i+1) ln lambda (float rounding only)
    close = _maxdiff(all_logits["ntk-mixed b=1"], all_logits["ntk-fixed"]).max()
    apart = _maxdiff(all_logits["ntk-mixed"], all_logits["ntk-fixed"]).max()
    assert close < 0.05 * apart, (close, apart)


@pytest.mark.real_model
def test_logn_changes_exactly_the_positions_beyond_L(all_logits):
    d = _maxdiff(all_logits["none"], all_logits["none+logn L=100"])
    assert (d[:L_SHORT] == 0).all(), f"log-n changed positions < L: {np.nonzero(d[:L_SHORT])[0]}"
    assert d[L_SHORT:].min() > 1e-4, f"log-n left position {L_SHORT + int(np.argmin(d[L_SHORT:]))} unchanged"


# --- d. the factor k the evaluation applies --------------------------------------------------------


@pytest.mark.real_model
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


# --- e. prefix reuse: a prompt started from the previous one's KV cache -------------------------------


def _reuse_case(path, st, n_ctx, n_batch=48, shared=100, every=1):
    """Prompt a (then 3 greedy tokens, which stay in the cache) and prompt b, which shares its first
    ``shared`` tokens with a: b's logits at every ``every``-th position after the prefix kept (cut
    to the last multiple of n_batch: 96 of 100 with the defaults), once with that prefix kept from
    a, once from an empty cache."""
    llm = ED.load_model(path, st, n_ctx, n_batch=n_batch, threads=THREADS)
    out = {}
    with ED.Decoder(llm) as dec:
        rng = np.random.default_rng(11)
        a = rng.integers(4, dec.n_vocab, size=n_ctx - 20).tolist()
        b = a[:shared] + [(t % (dec.n_vocab - 4)) + 4 for t in np.array(a[shared:n_ctx - 30]) + 1]
        assert b[shared] != a[shared]

        def logits_of(p, start):
            want = range(start - p, len(b) - p, every)
            buf = np.empty((len(want), dec.n_vocab), dtype=np.float32)

            def take(rows, logits):
                buf[(np.asarray(rows) - (start - p)) // every] = logits

            dec.decode(b[p:], p, want, take)
            return buf

        out["exact"] = dec.reuse_prefix
        ED.greedy_answer(dec, a, 3)
        assert dec.last_reused == 0  # an empty cache to start from
        p = dec.keep_prefix(b)
        out["kept"], out["reused"] = p, logits_of(p, p)
        dec.clear()
        out["fresh"] = logits_of(0, p)
        whole = dec.keep_prefix(b)  # all of b is cached: all but the last token (wanted), cut to a batch
        assert whole == (len(b) - 1) // n_batch * n_batch
    del llm
    return out


def _assert_reuse_exact(r, kept):
    """``r`` of :func:`_reuse_case`: reuse on, ``kept`` tokens kept, the logits after them bit for
    bit a prefill from empty's, and rows that differ (a real comparison)."""
    assert r["exact"] and r["kept"] == kept
    assert np.array_equal(r["reused"], r["fresh"])
    assert np.abs(r["fresh"][1:] - r["fresh"][:-1]).max() > 1e-3


@pytest.mark.real_model
@pytest.mark.parametrize("st", [ED.Setting("ntk-mixed", 4.0, 0.625, logn=True), ED.Setting("yarn", 4.0)],
                         ids=["ntk-mixed+log-n", "yarn"])
def test_prefix_reuse_gives_the_logits_of_an_empty_cache_bit_for_bit(patched_lib, tiny, st):
    """At 4 x L (log-n and the NTK table beyond L), with flash attention and the F16 cache the
    evaluation uses: keeping the tokens that the cache holds from the previous prompt up to a
    batch boundary (and dropping the rest, that prompt's answer included) gives exactly the
    logits of a prefill from empty."""
    _assert_reuse_exact(_reuse_case(tiny.path, st, 4 * L), 96)


@pytest.mark.real_model
def test_prefix_reuse_is_off_with_dynamic_k(patched_lib, tiny):
    """Dynamic k re-rotates the cached keys as the sequence grows, so the cache of a longer prompt
    is not the prefix of a shorter one: the decoder evaluates every prompt from empty."""
    llm = ED.load_model(tiny.path, ED.Setting("ntk-mixed", None, 0.625, dynamic=True), 4 * L, threads=THREADS)
    with ED.Decoder(llm) as dec:
        assert not dec.reuse_prefix
        toks = [4 + i % (tiny.n_vocab - 4) for i in range(2 * L)]
        ED.greedy_answer(dec, toks, 2)
        ED.greedy_answer(dec, toks, 2)
        assert dec.last_reused == 0
    del llm


@pytest.fixture(scope="module")
def tiny_swa(tmp_path_factory):
    """A tiny gemma3 (tests/tiny_models.py: window 24, layers 2 and 5 global, L = 64)."""
    from tiny_models import write_tiny_gemma3

    return write_tiny_gemma3(tmp_path_factory.mktemp("swa") / "gemma3.gguf", seed=5)


@pytest.mark.real_model
@pytest.mark.parametrize("st", [ED.Setting("ntk-mixed", 4.0, 0.625, logn=True), ED.Setting("yarn", 4.0)],
                         ids=["ntk-mixed+log-n", "yarn"])
def test_prefix_reuse_with_sliding_window_layers_is_bit_for_bit(patched_lib, tiny_swa, st):
    """Sliding-window layers with llama.cpp's default full-size SWA cache: the kept prefix (96
    tokens, four windows of 24) holds every position at the cell of its index, so the logits after
    it are exactly those of a prefill from empty, in the SWA layers (plain RoPE, the window mask)
    and the global ones (the method, log-n)."""
    _assert_reuse_exact(_reuse_case(tiny_swa.path, st, 4 * L), 96)


@pytest.mark.real_model
def test_prefix_reuse_on_gemma3_is_bit_for_bit(patched_lib, gemma3, tmp_path):
    """The real Gemma 3 (window 512) at 4 x L of a copy whose context_length says L = 512 (the NTK
    table and log-n in use at 2048 tokens): after a kept prefix of two windows, every 16th row of
    the logits is a prefill from empty's, bit for bit."""
    from ggufrope.gguf_writer import set_keys

    path = tmp_path / "gemma3-L512.gguf"
    set_keys(gemma3, path, {"gemma3.context_length": 512})
    r = _reuse_case(path, ED.Setting("ntk-mixed", 4.0, 0.625, logn=True), 2048, n_batch=512, shared=1100, every=16)
    _assert_reuse_exact(r, 1024)


@pytest.mark.real_model
def test_prefix_reuse_needs_the_full_size_swa_cache(patched_lib, gemma3):
    """Gemma 3 (window 512): on with llama.cpp's default full-size SWA cache; off with the small
    one (``swa_full=False``), whose cells of positions older than the window are reused."""
    for swa_full, on in ((None, True), (True, True), (False, False)):
        kw = {} if swa_full is None else {"swa_full": swa_full}
        llm = ED.load_model(gemma3, ED.Setting("none"), 512, threads=THREADS, **kw)
        with ED.Decoder(llm) as dec:
            assert dec.reuse_prefix is on, swa_full
        del llm
