"""A tiny random gemma3 model: sliding-window (SWA) layers keep plain RoPE (issue 12, part 3).

Rule (stock llama.cpp and transformers): context scaling applies to the global (non-SWA)
layers only, and log-n likewise; a layer that attends W tokens never sees a distance beyond
L. The torch reference (``torch_reference.forward_gemma3``) applies the method's frequencies
and log-n to the global layers and plain RoPE at the SWA base plus the window mask to the
SWA layers.

The model: 6 layers, SWA pattern 3 (layers 2 and 5 global), window 24, L = 64, global base
10000, SWA base 1000, head_dim 16; llama.cpp runs 256 tokens (positions up to 4·L, ten
windows), and 512 in 64-token ubatches with the small SWA cache.

Tolerance: 2e-3 (max over positions of ||a - b|| / ||b||), twice the other tiny models'.
ggml's CPU GELU reads a float16 table; the reference models that table, and what is left is
inputs that round to the neighbouring float16 cell in float32 (llama.cpp) and float64 (the
reference): measured max 2.2e-4 .. 5.8e-4 on seeds 1-3 for none, none + log-n and
ntk-mixed + log-n (4.5e-4 for the 512-token chunked run). Every difference the tests tell apart is above 0.1 (asserted; measured
0.3 .. 1.7).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest

from test_reference_forward import _overrides, assert_close, rel_err, require_patched, run_llama_cpp, tokens_for
from tiny_models import write_tiny_gemma3
from torch_reference import forward

L = 64  # n_ctx_train of the tiny gemma3
N_CTX = 4 * L
K = 4.0
B = 0.625
TOL = 2e-3
#: what the comparisons must be able to tell apart: 50 x TOL
POWER = 0.1
#: ggml's CPU GELU table is what llama.cpp computes unless layers are offloaded
GELU_F16 = int(os.environ.get("GGUFROPE_TEST_NGL", "0")) == 0


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3") / "gemma3.gguf", seed=1)


def ref(m, toks, **kw):
    kw.setdefault("gelu_f16", GELU_F16)
    return forward(m, toks, **kw)


# ----------------------------------------------------------------------------- the writer, the reference


def test_writer_roundtrip(tiny_gemma3):
    from gguf import GGUFReader, GGUFValueType

    m = tiny_gemma3
    r = GGUFReader(m.path)
    f = r.fields
    assert f["general.architecture"].contents() == "gemma3"
    assert f["gemma3.context_length"].contents() == L
    assert f["gemma3.attention.sliding_window"].contents() == 24
    assert f["gemma3.attention.sliding_window_pattern"].contents() == 3
    assert f["gemma3.rope.freq_base_swa"].types == [GGUFValueType.FLOAT32]
    assert f["gemma3.rope.freq_base_swa"].contents() == 1000.0
    assert f["gemma3.rope.freq_base"].contents() == 10000.0
    assert m.swa_layers == (True, True, False, True, True, False)
    t = {x.name: x for x in r.tensors}
    for i, layer in enumerate(m.layers):
        for n, a in [("attn_q_norm.weight", layer.attn_q_norm), ("attn_k_norm.weight", layer.attn_k_norm),
                     ("post_attention_norm.weight", layer.attn_post_norm), ("post_ffw_norm.weight", layer.ffn_post_norm),
                     ("attn_q.weight", layer.wq), ("ffn_down.weight", layer.ffn_down)]:
            assert list(t[f"blk.{i}.{n}"].shape) == list(reversed(a.shape)), n
            np.testing.assert_array_equal(np.asarray(t[f"blk.{i}.{n}"].data).reshape(a.shape), a)
    assert len(t) == 3 + 13 * m.n_layer


def test_reference_properties(tiny_gemma3):
    """The reference's SWA base and window matter, the method touches only global layers."""
    m = tiny_gemma3
    toks = tokens_for(m, 160)
    plain = ref(m, toks)
    # causal: a prefix sees the same logits
    np.testing.assert_allclose(ref(m, toks[:50]), plain[:50], rtol=1e-12, atol=1e-12)
    # relative: shifting every position changes nothing
    np.testing.assert_allclose(ref(m, toks, positions=np.arange(160) + 500, gelu_f16=False),
                               ref(m, toks, gelu_f16=False), rtol=1e-9, atol=1e-9)
    # the SWA base and the window are both visible in the logits (test (a) can see them)
    assert rel_err(ref(dataclasses.replace(m, freq_base_swa=m.freq_base), toks), plain).max() > POWER
    assert rel_err(ref(dataclasses.replace(m, n_swa=10**6), toks), plain).max() > POWER
    # a model whose every layer is global: the method changes all of them
    every_global = dataclasses.replace(m, swa_layers=(False,) * m.n_layer)
    assert rel_err(ref(every_global, toks, method="ntk-mixed", k=K), ref(every_global, toks)).max() > POWER
    # and on the real layout, through the two global layers
    meth = ref(m, toks, method="ntk-mixed", k=K, b=B, logn_ctx=L)
    assert rel_err(meth, plain).max() > POWER


# ----------------------------------------------------------------------------- (a) stock: method none


#: chunked runs: 512 tokens in 64-token ubatches with the small SWA cache (swa_full=False:
#: n_swa + n_ubatch cells padded to 256, so SWA cells are reused past position 256)
N_LONG = 512


@pytest.mark.parametrize("chunked", [False, True], ids=["one-batch", "chunked-small-swa-cache"])
def test_plain_matches_reference(tiny_gemma3, chunked):
    """Method none: llama.cpp's gemma3 graph equals the reference (the reference is right)."""
    m = tiny_gemma3
    if chunked:
        toks = tokens_for(m, N_LONG)
        got = run_llama_cpp(m, toks, n_ctx=N_LONG, n_batch=64, swa_full=False)
    else:
        toks = tokens_for(m)
        got = run_llama_cpp(m, toks)
    assert_close(got, ref(m, toks), f"gemma3 plain chunked={chunked}", tol=TOL)


# ----------------------------------------------------------------------------- (b) patched: global layers only

CASES = [("ntk-mixed", True), ("ntk-mixed", False), ("none", True)]


@pytest.mark.parametrize("method,logn", CASES, ids=["ntk-mixed+logn", "ntk-mixed", "none+logn"])
def test_method_applies_to_global_layers_only(tiny_gemma3, method, logn):
    """ntk-mixed and/or log-n by kv overrides: the SWA layers keep plain RoPE at their own base
    and no log-n. (A library that scales the SWA layers too, as the patch did before this rule,
    is off by 0.7 .. 1.6 here; it matched ``scale_swa=True`` to 5e-4 .. 1.1e-3.)"""
    require_patched()
    m = tiny_gemma3
    toks = tokens_for(m)
    kv = _overrides("gemma3", method, K if method != "none" else None, B if method == "ntk-mixed" else None, logn)
    got = run_llama_cpp(m, toks, kv_overrides=kv)
    want = ref(m, toks, method=method, k=K, b=B, logn_ctx=L if logn else 0)
    assert_close(got, want, f"gemma3 {method} logn={logn}: global layers only", tol=TOL)


def test_method_chunked_small_swa_cache(tiny_gemma3):
    """The same over 512 tokens in 64-token ubatches with the small SWA cache (cells reused)."""
    require_patched()
    m = tiny_gemma3
    toks = tokens_for(m, N_LONG)
    got = run_llama_cpp(m, toks, n_ctx=N_LONG, n_batch=64, swa_full=False,
                        kv_overrides=_overrides("gemma3", "ntk-mixed", K, B, True))
    assert_close(got, ref(m, toks, method="ntk-mixed", k=K, b=B, logn_ctx=L), "gemma3 ntk-mixed+logn chunked", tol=TOL)


# ----------------------------------------------------------------------------- (c) power


@pytest.mark.parametrize("method,logn", CASES, ids=["ntk-mixed+logn", "ntk-mixed", "none+logn"])
def test_wrong_rule_is_far_from_the_right_one(tiny_gemma3, method, logn):
    """The reference with the method (and log-n) wrongly applied to the SWA layers differs
    from the right one by far more than the tolerance, and so does plain RoPE: test (b) can
    tell all three apart."""
    m = tiny_gemma3
    toks = tokens_for(m)
    kw = dict(method=method, k=K, b=B, logn_ctx=L if logn else 0)
    right = ref(m, toks, **kw)
    wrong = ref(m, toks, scale_swa=True, **kw)
    assert rel_err(wrong, right).max() > POWER
    assert rel_err(right, ref(m, toks)).max() > POWER
    # below L log-n is 1 and every distance is < L: the method (ntk-mixed's table) still differs
    # there, log-n alone does not
    if method == "none":
        np.testing.assert_allclose(right[:L], ref(m, toks)[:L], rtol=1e-12, atol=1e-12)
