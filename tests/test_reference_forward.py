"""The torch reference forward against ``methods.rope_reference`` and against llama.cpp.

The reference (``tests/torch_reference.py``) computes the frequencies and log-n itself from
the seeds' formulas (method, k, b), never from ``ggufrope.methods``, so that a misreading of
the seeds shared by ``ggufrope.methods`` and the C patch cannot pass these tests.

Three groups:

1. unit tests (always run): the torch RoPE with the seed's frequencies equals
   ``methods.rope_reference`` with ``methods.freq_factors`` (two transcriptions agree); the tiny
   writers produce files gguf-py reads back; the reference forward has the properties of a
   causal RoPE transformer; every method changes the logits by far more than the tolerance
   (so the llama.cpp comparisons have power).
2. stock equivalences (need ``llama_cpp``; valid for stock and patched builds): plain RoPE
   extrapolated to 4·L, ``linear`` as ``rope_freq_scale = 1/k``, ``ntk`` as
   ``rope_freq_base = β·k^(d/(d-2))``, a file's ``rope_freqs`` tensor, chunked decoding.
3. patched-library cases (need ``ggufrope.runtime.is_patched()``): every NTK-family method
   with and without log-n, chosen by kv overrides or by file keys.

Metric: per position, ||a - b|| / ||b|| over the vocabulary; the maximum must be <= 1e-3.
Measured with stock 0.3.36 (CPU, F32 weights and KV cache): about 1e-6 without flash
attention; about 4e-4 with it, because llama.cpp casts F32 K/V to F16 for
``ggml_flash_attn_ext`` (``build_attn_mha``). So the method cases run without it.
Set ``GGUFROPE_TEST_NGL`` to offload layers (e.g. ``99`` on a CUDA build).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ggufrope import methods
from tiny_models import N_SPECIAL, write_tiny_llama, write_tiny_qwen2, write_tiny_qwen2vl
from torch_reference import apply_rope, forward, rope_inv_freq, seed_inv_freq, seed_logn_scale

L = 64  # n_ctx_train of every tiny model
N_CTX = 4 * L
N_TOK = N_CTX  # tokens per llama.cpp run: positions 0 .. 4L-1
TOL = 1e-3
#: layers offloaded (``GGUFROPE_TEST_NGL``, e.g. 99 on a CUDA build), see :func:`gpu_tol`
NGL = int(os.environ.get("GGUFROPE_TEST_NGL", "0"))


def gpu_tol(tol: float) -> float:
    """A tolerance of these tests where the layers run: ``tol`` on the CPU; on a GPU 8 × ``tol``,
    at least 2e-3 and at most 0.05. The CUDA backend runs F32 matrix products in TF32 (its cuBLAS
    handles are set to ``CUBLAS_TF32_TENSOR_OP_MATH``, ggml-cuda/common.cuh: a 10-bit mantissa), so
    every model, plain RoPE included, lands further from the float64 reference than on the CPU: on
    an H200 (2026-11-26, docs/gpu.md) up to 2.7e-3 for llama and qwen2 (qwen2vl with plain RoPE:
    1.9e-3), 9.6e-3 for gemma3, and 4.4e-4 between two llama.cpp runs that agree to 1e-5 on the CPU.
    The cap, 0.05, is half the smallest difference between the computations these tests tell apart
    (0.15 here, test_methods_change_the_logits; 0.1 in test_dynamic.py, ``POWER``)."""
    return tol if NGL == 0 else min(max(8 * tol, 2e-3), 5e-2)
K = 4.0  # extension factor of the method cases
EXPONENTS = (0.5, 0.625, 0.75, 1.0)
WRITERS = {"llama": write_tiny_llama, "qwen2": write_tiny_qwen2, "qwen2vl": write_tiny_qwen2vl}


# ----------------------------------------------------------------------------- helpers


def rel_err(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row ||a - b|| / ||b||."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


def assert_close(got: np.ndarray, ref: np.ndarray, what: str, tol: float = TOL) -> float:
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.all(np.isfinite(got)), f"{what}: non-finite logits"
    tol = gpu_tol(tol)
    e = rel_err(got, ref)
    worst = int(np.argmax(e))
    print(f"\n{what}: max rel err {e.max():.3e} at position {worst}, mean {e.mean():.3e}")
    assert e.max() <= tol, f"{what}: max rel err {e.max():.3e} at position {worst} > {tol}"
    return float(e.max())


def tokens_for(model, n: int = N_TOK, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(N_SPECIAL, model.n_vocab, size=n).tolist()


def _llama_cpp():
    return pytest.importorskip("llama_cpp")


def run_llama_cpp(
    model,
    tokens: list[int],
    *,
    n_ctx: int = N_CTX,
    n_batch: int = 512,
    flash_attn: bool = False,
    kv_overrides: dict | None = None,
    **kwargs,
) -> np.ndarray:
    """All logits ``(len(tokens), n_vocab)`` of llama.cpp on ``tokens`` (positions 0..n-1),
    F32 weights and F32 KV cache."""
    llama_cpp = _llama_cpp()
    llm = llama_cpp.Llama(
        model_path=str(model.path),
        n_ctx=n_ctx,
        n_batch=n_batch,
        n_ubatch=n_batch,
        logits_all=True,
        type_k=0,  # GGML_TYPE_F32
        type_v=0,
        flash_attn=flash_attn,
        n_threads=2,
        n_threads_batch=2,
        n_gpu_layers=int(os.environ.get("GGUFROPE_TEST_NGL", "0")),
        verbose=False,
        kv_overrides=kv_overrides,
        **kwargs,
    )
    try:
        llm.eval(tokens)
        return np.array(llm.scores[: len(tokens)], dtype=np.float64)
    finally:
        llm.close()


def require_patched():
    _llama_cpp()
    from ggufrope.runtime import is_patched
    if not is_patched():
        if os.environ.get("GGUFROPE_ALLOW_STOCK") == "1":  # running the file against a stock build on purpose
            pytest.skip("llama_cpp is a stock build, not the ggufrope-patched library")
        pytest.fail("llama_cpp is a stock build, not the ggufrope-patched library: run make build")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    return {
        "llama": write_tiny_llama(d / "llama.gguf", seed=1),
        "qwen2": write_tiny_qwen2(d / "qwen2.gguf", seed=2),
        "qwen2vl": write_tiny_qwen2vl(d / "qwen2vl.gguf", seed=3),
    }


# ----------------------------------------------------------------------------- 1. unit tests


ROPE_CASES = [
    ("none", 1.0, 0.625),
    ("linear", 4.0, 0.625),
    ("ntk", 4.0, 0.625),
    ("ntk-fixed", 8.0, 0.625),
    ("ntk-mixed", 4.0, 0.5),
    ("ntk-mixed", 16.0, 0.625),
]


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("method,k,b", ROPE_CASES)
@pytest.mark.parametrize("logn_ctx", [0, 64])
@pytest.mark.parametrize("head_dim,n_dims", [(16, 16), (64, 64), (32, 24)])
def test_torch_rope_matches_rope_reference(mode, method, k, b, logn_ctx, head_dim, n_dims):
    rng = np.random.default_rng(7)
    x = rng.standard_normal((300, 3, head_dim))
    pos = rng.permutation(1000)[:300]
    ff = methods.freq_factors(method, n_dims, k, b)
    ref = methods.rope_reference(x, pos, n_dims, 10000.0, mode=mode, factors=ff, logn_ctx=logn_ctx)
    inv = seed_inv_freq(method, n_dims, 10000.0, k, b)
    logn = seed_logn_scale(pos, logn_ctx) if logn_ctx else None
    got = apply_rope(torch.as_tensor(x), torch.as_tensor(pos), inv, mode, logn).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-12, atol=1e-12)


def test_torch_rope_is_a_rotation_of_relative_position():
    # <R(p)q, R(p')k> depends on p - p' only, in both layouts
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((2, 1, 1, 16))
    inv = seed_inv_freq("ntk-mixed", 16, 10000.0, 4.0)
    for mode in ("normal", "neox"):
        dots = []
        for shift in (0, 37, 500):
            rq = apply_rope(torch.as_tensor(q), torch.tensor([shift + 9.0]), inv, mode)
            rk = apply_rope(torch.as_tensor(k), torch.tensor([shift + 2.0]), inv, mode)
            dots.append(float((rq * rk).sum()))
        np.testing.assert_allclose(dots, dots[0], rtol=1e-10)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2vl"])
def test_writer_roundtrip(tmp_path, arch):
    from gguf import GGUFReader, GGUFValueType

    extra = {
        "{arch}.rope.ntk.method": "ntk-mixed",
        "{arch}.rope.ntk.factor": 4,
        "{arch}.rope.ntk.exponent": 0.625,
        "{arch}.attention.logn_scaling": True,
    }
    kw = {"rope_freqs": np.linspace(1, 3, 8)} if arch == "llama" else {}
    m = WRITERS[arch](tmp_path / f"{arch}.gguf", seed=5, extra_kv=extra, **kw)
    r = GGUFReader(m.path)
    t = {x.name: x for x in r.tensors}
    expect = {
        "token_embd.weight": m.tok_embd,
        "output_norm.weight": m.output_norm,
        "output.weight": m.output,
    }
    if arch == "llama":
        expect["rope_freqs.weight"] = m.rope_freqs
    for i, layer in enumerate(m.layers):
        for n, a in [
            ("attn_norm.weight", layer.attn_norm), ("attn_q.weight", layer.wq),
            ("attn_k.weight", layer.wk), ("attn_v.weight", layer.wv),
            ("attn_output.weight", layer.wo), ("ffn_norm.weight", layer.ffn_norm),
            ("ffn_gate.weight", layer.ffn_gate), ("ffn_up.weight", layer.ffn_up),
            ("ffn_down.weight", layer.ffn_down),
            ("attn_q.bias", layer.bq), ("attn_k.bias", layer.bk), ("attn_v.bias", layer.bv),
        ]:
            if a is not None:
                expect[f"blk.{i}.{n}"] = a
    assert set(t) == set(expect)
    for n, a in expect.items():
        # ggml ne is the reversed numpy shape: a (n_out, n_in) weight is ne = [n_in, n_out]
        assert list(t[n].shape) == list(reversed(a.shape)), n
        np.testing.assert_array_equal(np.asarray(t[n].data).reshape(a.shape), a)
    assert m.n_layer >= 2 and m.n_head_kv < m.n_head
    if arch != "llama":
        assert m.layers[0].bq is not None

    f = r.fields
    assert f["general.architecture"].contents() == arch
    assert f[f"{arch}.context_length"].contents() == L
    assert f["tokenizer.ggml.model"].contents() == "llama"
    assert len(f["tokenizer.ggml.tokens"].contents()) == m.n_vocab
    want_types = {
        f"{arch}.rope.ntk.method": (GGUFValueType.STRING, "ntk-mixed"),
        f"{arch}.rope.ntk.factor": (GGUFValueType.FLOAT32, 4.0),
        f"{arch}.rope.ntk.exponent": (GGUFValueType.FLOAT32, 0.625),
        f"{arch}.attention.logn_scaling": (GGUFValueType.BOOL, True),
    }
    for key, (vtype, val) in want_types.items():
        assert f[key].types == [vtype], key
        assert f[key].contents() == val, key
    if arch == "qwen2vl":
        secs = f["qwen2vl.rope.dimension_sections"]
        assert secs.types == [GGUFValueType.ARRAY, GGUFValueType.INT32]
        assert sum(secs.contents()) == m.n_rot // 2 and secs.contents()[3] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_reference_forward_properties(models, arch):
    m = models[arch]
    toks = tokens_for(m, 80)
    full = forward(m, toks)
    assert full.shape == (80, m.n_vocab)
    # causal: a prefix sees the same logits
    np.testing.assert_allclose(forward(m, toks[:30]), full[:30], rtol=1e-12, atol=1e-12)
    # RoPE is relative: shifting every position leaves the logits unchanged
    np.testing.assert_allclose(forward(m, toks, positions=np.arange(80) + 1000), full, rtol=1e-9, atol=1e-9)
    # log-n leaves positions < L unchanged and changes positions >= L
    ln = forward(m, toks, logn_ctx=32)
    np.testing.assert_allclose(ln[:32], full[:32], rtol=1e-12, atol=1e-12)
    assert rel_err(ln[32:], full[32:]).max() > 10 * TOL
    # ntk-fixed is ntk-mixed with b = 1 (seed 000)
    np.testing.assert_allclose(
        forward(m, toks, method="ntk-fixed", k=K), forward(m, toks, method="ntk-mixed", k=K, b=1.0),
        rtol=1e-12, atol=1e-12,
    )
    # linear (PI) rotates position p as plain RoPE rotates p/k
    np.testing.assert_allclose(
        forward(m, toks, method="linear", k=K), forward(m, toks, positions=np.arange(80) / K),
        rtol=1e-9, atol=1e-9,
    )


def test_rope_freqs_compose_with_factors(tmp_path):
    rf = np.linspace(1.0, 2.5, 8).astype(np.float32)
    m = write_tiny_llama(tmp_path / "rf.gguf", seed=11, rope_freqs=rf)
    mixed = seed_inv_freq("ntk-mixed", m.n_rot, m.freq_base, K).numpy()
    np.testing.assert_allclose(rope_inv_freq(m, "ntk-mixed", K).numpy(), mixed / rf.astype(np.float64), rtol=1e-15)
    plain = seed_inv_freq("none", m.n_rot, m.freq_base).numpy()
    np.testing.assert_allclose(rope_inv_freq(m).numpy(), plain / rf.astype(np.float64), rtol=1e-15)
    q = write_tiny_qwen2(tmp_path / "q.gguf", seed=11)  # qwen2's graph passes no rope factors
    np.testing.assert_allclose(rope_inv_freq(q, "ntk-mixed", K).numpy(), mixed, rtol=1e-15)


METHOD_CASES = [("ntk", 1.0), ("ntk-fixed", 1.0)] + [("ntk-mixed", b) for b in EXPONENTS]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method,b", METHOD_CASES)
def test_methods_change_the_logits(models, arch, method, b):
    """The comparisons below can tell the methods apart: every pair differs by >> TOL."""
    m = models[arch]
    toks = tokens_for(m)
    plain = forward(m, toks)
    meth = forward(m, toks, method=method, k=K, b=b)
    assert rel_err(meth, plain).max() > 10 * TOL
    assert rel_err(forward(m, toks, method=method, k=K, b=b, logn_ctx=L), meth).max() > 10 * TOL
    if method == "ntk-mixed" and b != 1.0:
        fixed = forward(m, toks, method="ntk-fixed", k=K)
        assert rel_err(meth, fixed).max() > 10 * TOL


# ----------------------------------------------------------------------------- 2. stock llama.cpp


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2vl"])
@pytest.mark.parametrize("flash_attn", [False, True])
def test_llama_cpp_plain_rope(models, arch, flash_attn):
    """Method none: plain RoPE extrapolated to 4·L (positions 0 .. 255, n_ctx = 256).

    Flash attention casts K/V to F16 (stock: ~4e-4 rel err, still within TOL)."""
    m = models[arch]
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, flash_attn=flash_attn)
    assert_close(got, forward(m, toks), f"{arch} plain fa={flash_attn}")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_cpp_linear(models, arch):
    """PI: stock ``rope_freq_scale = 1/k`` == factors all k."""
    m = models[arch]
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, rope_freq_scale=1.0 / K)
    assert_close(got, forward(m, toks, method="linear", k=K), f"{arch} linear")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_cpp_ntk_as_base(models, arch):
    """NTK-aware: stock ``rope_freq_base = β·k^(d/(d-2))`` == factors k^(2i/(d-2))."""
    m = models[arch]
    toks = tokens_for(m)
    d = m.n_rot
    got = run_llama_cpp(m, toks, rope_freq_base=m.freq_base * K ** (d / (d - 2)))
    assert_close(got, forward(m, toks, method="ntk", k=K), f"{arch} ntk-as-base")


def test_llama_cpp_rope_freqs_tensor(tmp_path):
    """A file's ``rope_freqs.weight`` divides θ_i (Llama-3.1 style)."""
    rf = np.linspace(1.0, 3.0, 8).astype(np.float32)
    m = write_tiny_llama(tmp_path / "rf.gguf", seed=13, rope_freqs=rf)
    toks = tokens_for(m)
    plain = forward(m, toks)
    got = run_llama_cpp(m, toks)
    assert_close(got, plain, "llama rope_freqs")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llama_cpp_chunked_decode(models, arch):
    """Ubatches of 64 tokens: later chunks read rotated keys from the KV cache."""
    m = models[arch]
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, n_batch=64)
    assert_close(got, forward(m, toks), f"{arch} chunked")


# ----------------------------------------------------------------------------- 3. patched library


def _overrides(arch: str, method: str, k: float | None, b: float | None, logn: bool,
               dynamic: bool | None = None) -> dict:
    """kv overrides of the ggufrope keys; ``dynamic`` None leaves ``{arch}.rope.ntk.dynamic``
    out (the library's default: dynamic k for an NTK-family method without k)."""
    kv: dict = {f"{arch}.rope.ntk.method": method, f"{arch}.attention.logn_scaling": bool(logn)}
    if k is not None:
        kv[f"{arch}.rope.ntk.factor"] = float(k)
    if b is not None:
        kv[f"{arch}.rope.ntk.exponent"] = float(b)
    if dynamic is not None:
        kv[f"{arch}.rope.ntk.dynamic"] = bool(dynamic)
    return kv


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method,b", METHOD_CASES)
@pytest.mark.parametrize("logn", [False, True])
def test_patched_method_by_overrides(models, arch, method, b, logn):
    require_patched()
    m = models[arch]
    toks = tokens_for(m)
    kv = _overrides(arch, method, K, b if method == "ntk-mixed" else None, logn)
    got = run_llama_cpp(m, toks, kv_overrides=kv)
    ref = forward(m, toks, method=method, k=K, b=b, logn_ctx=L if logn else 0)
    assert_close(got, ref, f"{arch} {method} b={b} logn={logn} (overrides)")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("logn", [False, True])
def test_patched_method_from_file(tmp_path, arch, logn):
    require_patched()
    extra = _overrides(arch, "ntk-mixed", K, 0.625, logn)
    m = WRITERS[arch](tmp_path / f"{arch}.gguf", seed=21, extra_kv=extra)
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks)
    ref = forward(m, toks, method="ntk-mixed", k=K, b=0.625, logn_ctx=L if logn else 0)
    assert_close(got, ref, f"{arch} ntk-mixed from file logn={logn}")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_patched_auto_factor(models, arch):
    """No factor key, dynamic false: k = max(1, n_ctx / L) = 256 / 64 = 4; no exponent key: b = 0.625."""
    require_patched()
    m = models[arch]
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, kv_overrides=_overrides(arch, "ntk-mixed", None, None, False, dynamic=False))
    ref = forward(m, toks, method="ntk-mixed", k=N_CTX / L, b=0.625)
    assert_close(got, ref, f"{arch} ntk-mixed auto factor")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_patched_no_factor_no_dynamic_key_is_dynamic(models, arch):
    """The same overrides without ``{arch}.rope.ntk.dynamic``: the library's default for an
    NTK-family method without k is dynamic k. k = 1 right after creation; positions 0 .. 63
    (< L = 64) give plain RoPE's logits; k = 2 once position 64 is in the cache (n = 65)."""
    require_patched()
    llama_cpp = _llama_cpp()
    from ggufrope import runtime

    runtime.require_dynamic("this test")  # GGUFRopeError on a stale build without dynamic k
    m = models[arch]
    toks = tokens_for(m, L + 1)
    llm = llama_cpp.Llama(model_path=str(m.path), n_ctx=N_CTX, n_batch=L, n_ubatch=L, logits_all=True, type_k=0,
                          type_v=0, flash_attn=False, n_threads=2, n_threads_batch=2,
                          n_gpu_layers=int(os.environ.get("GGUFROPE_TEST_NGL", "0")), verbose=False,
                          kv_overrides=_overrides(arch, "ntk-mixed", None, None, False))
    try:
        assert runtime.dynamic_in_use(llm) is True
        assert runtime.factor_in_use(llm) == 1.0
        llm.eval(toks[:L])
        assert runtime.factor_in_use(llm) == 1.0
        assert_close(np.array(llm.scores[:L], dtype=np.float64), forward(m, toks[:L]), f"{arch} dynamic below L = plain")
        llm.eval(toks[L:])
        assert runtime.factor_in_use(llm) == 2.0
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_patched_logn_only(models, arch):
    """Method none with log-n: plain RoPE, queries scaled beyond L."""
    require_patched()
    m = models[arch]
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, kv_overrides=_overrides(arch, "none", None, None, True))
    assert_close(got, forward(m, toks, logn_ctx=L), f"{arch} none + logn")


def test_patched_composes_with_rope_freqs(tmp_path):
    require_patched()
    rf = np.linspace(1.0, 3.0, 8).astype(np.float32)
    m = write_tiny_llama(tmp_path / "rf.gguf", seed=13, rope_freqs=rf)
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, kv_overrides=_overrides("llama", "ntk-mixed", K, 0.625, True))
    ref = forward(m, toks, method="ntk-mixed", k=K, b=0.625, logn_ctx=L)
    assert_close(got, ref, "llama rope_freqs x ntk-mixed + logn")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_patched_chunked_decode(models, arch):
    require_patched()
    m = models[arch]
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, n_batch=64, kv_overrides=_overrides(arch, "ntk-mixed", K, 0.625, True))
    ref = forward(m, toks, method="ntk-mixed", k=K, b=0.625, logn_ctx=L)
    assert_close(got, ref, f"{arch} ntk-mixed + logn chunked")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_patched_flash_attn(models, arch):
    """Flash attention path (K/V cast to F16 by llama.cpp: ~4e-4 expected)."""
    require_patched()
    m = models[arch]
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, flash_attn=True, kv_overrides=_overrides(arch, "ntk-mixed", K, 0.625, True))
    ref = forward(m, toks, method="ntk-mixed", k=K, b=0.625, logn_ctx=L)
    assert_close(got, ref, f"{arch} ntk-mixed + logn flash-attn")


def test_patched_unserved_arch_refuses_or_is_exact(models):
    """qwen2vl (multi-section rope): the patched library refuses the method at load or
    applies it exactly; it never runs plain RoPE silently."""
    require_patched()
    m = models["qwen2vl"]
    toks = tokens_for(m)
    kv = _overrides("qwen2vl", "ntk-mixed", K, 0.625, True)
    try:
        got = run_llama_cpp(m, toks, kv_overrides=kv)
    except (ValueError, RuntimeError):
        # refused at load; the same file without the method loads (the refusal is the method's)
        assert_close(run_llama_cpp(m, toks), forward(m, toks), "qwen2vl plain after refusal")
        return
    ref = forward(m, toks, method="ntk-mixed", k=K, b=0.625, logn_ctx=L)
    assert_close(got, ref, "qwen2vl ntk-mixed + logn")


# The stock contract (a file carrying the ggufrope keys, or the same keys as kv overrides, runs
# plain RoPE in an unpatched build) runs against build/stock-lib in tests/test_contract.py.
