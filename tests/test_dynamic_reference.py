"""The torch reference of dynamic NTK (issue 13) against its own defining properties.

``tests/torch_reference.py``: :func:`dynamic_factor` (k from the number of positions seen),
:func:`rerotate_keys` (a change of table as one rotation by p·(inv_new − inv_old)) and
:func:`forward_dynamic` (chunk by chunk with per-layer KV caches; consistent = every cached key
re-rotated to the current table, seed 002 eq. 3; inconsistent = keys keep their table, eq. 1,
Hugging Face's behaviour). The library has no dynamic mode yet, so nothing here runs
llama.cpp: these tests pin the reference down before the library is compared with it.

Properties:

- the schedule: hand values, k = 1 for n <= L, k >= n/L, non-decreasing, minimal on its grid;
- the re-rotation identity (NORMAL, NEOX, partial rotary, rope_freqs, k up and down), 1e-12;
- below L (n <= L) dynamic mode is plain RoPE: the same table bit for bit, logits bit-identical
  to ``method none`` run through the same chunks and within 1e-12 of :func:`forward` (BLAS sums
  in another order for other shapes, so chunked and one-shot float64 runs differ in the last bits);
- one chunk is the static forward at k = schedule(n) (bit-identical as measured; asserted 1e-12);
- chunkings that give every token the same k give the same logits (1e-12); chunkings that
  do not, and the inconsistent variant, differ by > 1e-3 (the tests have power);
- after every step every cached key carries the current table (checked on layer 0, whose
  un-roped keys depend on the tokens only), also after many steps of the ``exact`` schedule.

Metric where a difference is asserted: per position ||a - b|| / ||b|| over the vocabulary.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from tiny_models import N_SPECIAL, write_tiny_gemma3, write_tiny_llama, write_tiny_qwen2
from torch_reference import (
    _rms_norm,
    _t,
    apply_rope,
    chunk_factors,
    dynamic_factor,
    forward,
    forward_dynamic,
    rerotate_keys,
    rope_inv_freq,
    seed_inv_freq,
)

L = 64  # n_ctx_train of every tiny model
N = 200  # tokens beyond L: pow2 steps k = 1 (n <= 64), 2 (65..128), 4 (129..256)
TOL = 1e-3  # the library acceptance tolerance (issue 13); differences asserted must exceed it
EXACT = 1e-12  # float64 agreement of two computations of the same quantity
ARCHS = ("llama", "qwen2", "gemma3")  # NORMAL, NEOX with biases, NEOX with SWA layers


def rel_err(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-row ||a - b|| / ||b||."""
    return np.linalg.norm(np.asarray(a) - np.asarray(b), axis=-1) / np.linalg.norm(np.asarray(b), axis=-1)


def assert_same(a: np.ndarray, b: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(a, b, rtol=EXACT, atol=EXACT, err_msg=what)


def tokens_for(model, n: int = N, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(N_SPECIAL, model.n_vocab, size=n).tolist()


def token_factors(chunks, schedule="pow2") -> list[float]:
    """The k each token runs with under ``chunks`` (its chunk's k)."""
    return [k for c, k in zip(chunks, chunk_factors(chunks, L, schedule)) for _ in range(c)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-dynamic")
    rf = np.linspace(1.0, 2.0, 8).astype(np.float32)  # a file rope_freqs: the table composes with it
    return {
        "llama": write_tiny_llama(d / "llama.gguf", seed=1, rope_freqs=rf),
        "qwen2": write_tiny_qwen2(d / "qwen2.gguf", seed=2),
        "gemma3": write_tiny_gemma3(d / "gemma3.gguf", seed=4),
    }


# ----------------------------------------------------------------------------- the schedule


def test_pow2_schedule_hand_values():
    # k = 2^ceil(log2(n/64)): 65/64 -> 2^1, 128/64 = 2 -> 2^1, 129/64 -> 2^2, 300/64 = 4.69 -> 2^3
    want = {0: 1, 1: 1, 63: 1, 64: 1, 65: 2, 128: 2, 129: 4, 256: 4, 257: 8, 300: 8, 512: 8, 513: 16}
    assert {n: dynamic_factor(n, L, "pow2") for n in want} == want
    assert dynamic_factor(2 * L, L) == 2.0  # default schedule pow2; at n = 2L exactly k = 2


def test_exact_and_geometric_schedule_hand_values():
    assert dynamic_factor(64, L, "exact") == 1.0
    assert dynamic_factor(65, L, "exact") == 65 / 64
    assert dynamic_factor(200, L, "exact") == 3.125
    # r = 1.5: grid 1, 1.5, 2.25, 3.375; 1.5·64 = 96, 2.25·64 = 144
    assert [dynamic_factor(n, L, 1.5) for n in (64, 65, 96, 97, 144, 145)] == [1.0, 1.5, 1.5, 2.25, 2.25, 3.375]
    assert [dynamic_factor(n, L, 2.0) for n in (65, 128, 129, 300)] == [2.0, 2.0, 4.0, 8.0]  # r = 2 is pow2


@pytest.mark.parametrize("schedule", ["pow2", "exact", 1.5, math.sqrt(2), 3.0])
def test_schedule_properties(schedule):
    ks = [dynamic_factor(n, L, schedule) for n in range(40 * L)]
    for n, k in enumerate(ks):
        assert k == 1.0 if n <= L else k * L >= n, (n, k)  # k = 1 within L; no position beyond k·L
    assert all(a <= b for a, b in itertools.pairwise(ks)), "k must never decrease as n grows"
    if schedule != "exact":  # a grid: k is its smallest point with k·L >= n
        r = 2.0 if schedule == "pow2" else schedule
        for n, k in enumerate(ks):
            if n > L:
                assert k / r * L < n * (1 + 1e-12), (n, k)
                e = math.log(k) / math.log(r)
                assert abs(e - round(e)) < 1e-9, (n, k)


def test_schedule_rejects_bad_input():
    for bad in ("pow3", 1.0, 0.5, True, None):
        with pytest.raises(ValueError):
            dynamic_factor(100, L, bad)
    with pytest.raises(ValueError):
        dynamic_factor(100, 0)
    with pytest.raises(ValueError):
        dynamic_factor(-1, L)


def test_chunk_factors():
    assert chunk_factors([N], L) == [4.0]
    assert chunk_factors([64, 64, 72], L) == [1.0, 2.0, 4.0]
    assert chunk_factors([60, 10, 130], L) == [1.0, 2.0, 4.0]  # a chunk takes the k of its last position
    assert chunk_factors([1] * 66, L)[62:] == [1.0, 1.0, 2.0, 2.0]
    assert chunk_factors([64, 36], L, "exact") == [1.0, 100 / 64]


# ----------------------------------------------------------------------------- the re-rotation identity


REROTATIONS = [  # (method, k_old, k_new, b)
    ("ntk-mixed", 1.0, 2.0, 0.625),  # leaving L: plain -> first step
    ("ntk-mixed", 2.0, 4.0, 0.625),
    ("ntk-mixed", 8.0, 2.0, 0.5),  # k going down (deltas of the other sign)
    ("ntk-fixed", 2.0, 4.0, 1.0),
    ("ntk", 1.0, 65 / 64, 1.0),  # the exact schedule's smallest step
]


@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("method,k_old,k_new,b", REROTATIONS)
@pytest.mark.parametrize("head_dim,n_dims", [(16, 16), (64, 64), (32, 24)])
def test_rerotation_equals_roping_with_the_new_table(mode, method, k_old, k_new, b, head_dim, n_dims):
    """rope(x, table A) re-rotated by p·θ·(1/ff_B − 1/ff_A) == rope(x, table B), float64."""
    rng = np.random.default_rng(5)
    x = torch.as_tensor(rng.standard_normal((400, 2, head_dim)))
    # positions up to 8·L (the longest context of these tests): angles p·θ_0 of up to 512 rad,
    # whose float64 rounding (~1e-13) stays below 1e-12; at p ~ 2000 it reaches ~1.3e-12
    pos = torch.as_tensor(np.concatenate([np.arange(300), rng.integers(300, 8 * L, 100)]), dtype=torch.float64)
    base = 10000.0
    ff_a = seed_inv_freq("none", n_dims, base) / seed_inv_freq(method, n_dims, base, k_old, b)  # ff_i
    ff_b = seed_inv_freq("none", n_dims, base) / seed_inv_freq(method, n_dims, base, k_new, b)
    inv_a = seed_inv_freq(method, n_dims, base, k_old, b)
    inv_b = seed_inv_freq(method, n_dims, base, k_new, b)
    theta = seed_inv_freq("none", n_dims, base)
    # the design notes' form: one rope with angle p·θ_i·(1/ff_B,i − 1/ff_A,i)
    delta = theta * (1.0 / ff_b - 1.0 / ff_a)
    np.testing.assert_allclose(delta.numpy(), (inv_b - inv_a).numpy(), rtol=1e-12, atol=1e-18)
    want = apply_rope(x, pos, inv_b, mode)
    got = apply_rope(apply_rope(x, pos, inv_a, mode), pos, delta, mode)
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=0, atol=EXACT)
    got2 = rerotate_keys(apply_rope(x, pos, inv_a, mode), pos, inv_a, inv_b, mode)
    np.testing.assert_allclose(got2.numpy(), want.numpy(), rtol=0, atol=EXACT)
    if n_dims < head_dim:  # channels beyond n_dims pass through untouched
        assert torch.equal(got2[..., n_dims:], x[..., n_dims:])


def test_rerotation_composes_with_rope_freqs(models):
    m = models["llama"]  # a file rope_freqs divides every table: the delta is taken between composed tables
    a, bb = rope_inv_freq(m, "ntk-mixed", 2.0), rope_inv_freq(m, "ntk-mixed", 4.0)
    x = torch.as_tensor(np.random.default_rng(1).standard_normal((256, 2, m.head_dim)))
    pos = torch.arange(256, dtype=torch.float64)
    got = rerotate_keys(apply_rope(x, pos, a, "normal"), pos, a, bb, "normal")
    np.testing.assert_allclose(got.numpy(), apply_rope(x, pos, bb, "normal").numpy(), rtol=0, atol=EXACT)


# ----------------------------------------------------------------------------- below L: plain RoPE


BELOW_L_CHUNKS = [[L], [1] * L, [5, 1, 1, 57], [32, 32], [40]]


@pytest.mark.parametrize("method,b", [("ntk", 0.625), ("ntk-fixed", 1.0), ("ntk-mixed", 0.625), ("ntk-mixed", 0.5)])
def test_below_L_the_table_is_plain_rope_bit_for_bit(models, method, b):
    for m in models.values():
        assert torch.equal(rope_inv_freq(m, method, dynamic_factor(L, L), b), rope_inv_freq(m, "none"))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("logn_ctx", [0, L])
@pytest.mark.parametrize("chunks", BELOW_L_CHUNKS, ids=lambda c: f"{len(c)}chunks")
def test_below_L_dynamic_is_method_none(models, arch, logn_ctx, chunks):
    m = models[arch]
    toks = tokens_for(m, sum(chunks))
    dyn = forward_dynamic(m, toks, method="ntk-mixed", logn_ctx=logn_ctx, chunks=chunks)
    none_same_chunks = forward_dynamic(m, toks, method="none", logn_ctx=logn_ctx, chunks=chunks)
    assert np.array_equal(dyn, none_same_chunks)  # bit-identical: same tables, same operations
    assert_same(dyn, forward(m, toks, logn_ctx=logn_ctx), f"{arch} below L vs plain forward")
    # log-n is 1 within L: on or off, the same logits
    assert np.array_equal(dyn, forward_dynamic(m, toks, method="ntk-mixed", chunks=chunks))


# ----------------------------------------------------------------------------- one chunk: the static forward


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "schedule,n", [("pow2", 100), ("pow2", 128), ("pow2", 129), ("pow2", 300), ("exact", 100), (1.5, 150)]
)
@pytest.mark.parametrize("logn_ctx", [0, L])
def test_one_chunk_is_the_static_forward(models, arch, schedule, n, logn_ctx):
    m = models[arch]
    toks = tokens_for(m, n)
    k = dynamic_factor(n, L, schedule)
    static = forward(m, toks, method="ntk-mixed", k=k, logn_ctx=logn_ctx)
    for consistent in (True, False):  # with nothing cached before the chunk the variants agree
        dyn = forward_dynamic(m, toks, method="ntk-mixed", logn_ctx=logn_ctx, schedule=schedule, consistent=consistent)
        assert_same(dyn, static, f"{arch} one chunk n={n} vs static k={k}")


# ----------------------------------------------------------------------------- chunk invariance


SAME_STEPS = [[64, 64, 72], [1] * N, [32, 32, 16, 48, 10, 62], [64] + [1] * 64 + [72], [10, 54, 64, 1, 71]]
OTHER_STEPS = [[N], [100, 100], [60, 10, 130]]  # some token runs with another k


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("logn_ctx", [0, L])
def test_chunkings_with_the_same_steps_agree(models, arch, logn_ctx):
    m = models[arch]
    toks = tokens_for(m)
    ref_k = token_factors(SAME_STEPS[0])
    assert ref_k == [1.0] * 64 + [2.0] * 64 + [4.0] * 72
    ref = forward_dynamic(m, toks, logn_ctx=logn_ctx, chunks=SAME_STEPS[0])
    for chunks in SAME_STEPS[1:]:
        assert token_factors(chunks) == ref_k  # the premise: every token runs with the same k
        assert_same(forward_dynamic(m, toks, logn_ctx=logn_ctx, chunks=chunks), ref, f"{arch} chunks {chunks[:6]}")
    for chunks in OTHER_STEPS:
        assert token_factors(chunks) != ref_k
        e = rel_err(forward_dynamic(m, toks, logn_ctx=logn_ctx, chunks=chunks), ref)
        assert e.max() > TOL, f"{arch} chunks {chunks}: max rel err {e.max():.2e}, the test has no power"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunks", [[1] * N, [64, 64, 72]], ids=["decode", "ubatches"])
def test_consistent_differs_from_inconsistent_after_the_first_step(models, arch, chunks):
    m = models[arch]
    toks = tokens_for(m)
    cons = forward_dynamic(m, toks, chunks=chunks)
    inco = forward_dynamic(m, toks, chunks=chunks, consistent=False)
    assert np.array_equal(cons[:L], inco[:L])  # before the first step nothing is re-rotated
    e = rel_err(inco[L:], cons[L:])
    print(f"\n{arch} {len(chunks)} chunks: consistent vs inconsistent beyond L: "
          f"min {e.min():.2e}, median {np.median(e):.2e}, max {e.max():.2e}")
    assert e.min() > TOL  # every position beyond the first step (measured: min 0.099)


# ----------------------------------------------------------------------------- the cache after each step


def layer0_raw_keys(m, toks) -> torch.Tensor:
    """Layer 0's keys before RoPE, ``(n, n_head_kv, head_dim)``: they depend on the tokens only."""
    x = _t(m.tok_embd)[torch.as_tensor(toks)]
    if m.arch == "gemma3":
        x = x * math.sqrt(m.n_embd)
    L0 = m.layers[0]
    kk = _rms_norm(x, _t(L0.attn_norm), m.rms_eps) @ _t(L0.wk).T
    if L0.bk is not None:
        kk = kk + _t(L0.bk)
    kk = kk.view(len(toks), m.n_head_kv, m.head_dim)
    if m.arch == "gemma3":
        kk = _rms_norm(kk, _t(L0.attn_k_norm), m.rms_eps)
    return kk


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("schedule,n", [("pow2", 300), ("exact", 150)])
def test_every_cached_key_carries_the_current_table(models, arch, schedule, n):
    """Token-by-token decode: k steps 1 -> 2 -> 4 -> 8 (pow2) or at every position beyond L
    (exact, 86 re-rotations); the final cache equals keys roped once with the final table."""
    m = models[arch]
    toks = tokens_for(m, n)
    _, caches = forward_dynamic(m, toks, chunks=[1] * n, schedule=schedule, return_cache=True)
    pos = torch.arange(n, dtype=torch.float64)
    final = rope_inv_freq(m, "ntk-mixed", dynamic_factor(n, L, schedule))
    swa = m.swa_layers if m.arch == "gemma3" else (False,) * m.n_layer
    for il, c in enumerate(caches):
        assert torch.equal(c.pos, pos)
        table = seed_inv_freq("none", m.n_rot, m.freq_base_swa) if swa[il] else final
        assert torch.equal(c.k_inv, table.expand(n, -1)), f"layer {il}: a key with another table"
    # layer 0's keys as roped once with their table (gemma3's layer 0 is a sliding-window layer:
    # plain rope, never re-rotated); not bit for bit: one matmul over all tokens vs one per token
    table0 = seed_inv_freq("none", m.n_rot, m.freq_base_swa) if swa[0] else final
    want = apply_rope(layer0_raw_keys(m, toks), pos, table0, m.rope_mode)
    np.testing.assert_allclose(caches[0].k.numpy(), want.numpy(), rtol=0, atol=EXACT)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_inconsistent_cache_keeps_each_chunks_table(models, arch):
    m = models[arch]
    toks = tokens_for(m)
    chunks = [64, 64, 72]
    _, caches = forward_dynamic(m, toks, chunks=chunks, consistent=False, return_cache=True)
    want = torch.cat([rope_inv_freq(m, "ntk-mixed", k).expand(c, -1) for c, k in zip(chunks, chunk_factors(chunks, L))])
    pos = torch.arange(N, dtype=torch.float64)
    for c in caches:
        assert torch.equal(c.k_inv, want)
    raw = layer0_raw_keys(m, toks)
    got = caches[0].k
    for lo, hi, k in [(0, 64, 1.0), (64, 128, 2.0), (128, N, 4.0)]:
        table = rope_inv_freq(m, "ntk-mixed", k)
        np.testing.assert_allclose(got[lo:hi].numpy(), apply_rope(raw[lo:hi], pos[lo:hi], table, m.rope_mode).numpy(),
                                   rtol=0, atol=EXACT)


def test_forward_dynamic_rejects_bad_chunks(models):
    m = models["llama"]
    toks = tokens_for(m, 10)
    for bad in ([5, 4], [5, 6], [10, 0], [-1, 11]):
        with pytest.raises(ValueError):
            forward_dynamic(m, toks, chunks=bad)
