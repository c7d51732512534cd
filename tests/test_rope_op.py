"""The patched ggml rope op on the CPU, called directly, against the registry's float64 math.

Every NTK-family method (b in {0.5, 0.625, 0.75, 1.0} for ntk-mixed), with and without log-n,
NORMAL and NEOX, F32 and F16, positions below and beyond L up to 2^20. The divisor table
comes from the patched library's own ``llama_ggufrope_freq_factors`` (the C math), which is
first checked against :func:`ggufrope.methods.freq_factors`.

Bounds (inputs uniform in [-1, 1]), and why:

Upstream ggml computes rope angles in float32 (``theta *= theta_scale`` per pair, then
``theta / freq_factor``), so even unpatched plain RoPE differs from the float64 reference by
about p * 2^-24 radians: measured here, 8.4e-5 below p = 1024 but 3.3e-4 below p = 4096. The
issue's bound of 1e-4 below p = 4096 therefore cannot hold for any method computed by
upstream's float32 rope; these tests use (and check that plain RoPE meets the same bound):

- F32, positions < 1024: max |out - ref| <= 1e-4.
- F16 (half input and output; the reference starts from the same half inputs), positions
  < 1024: max |out - ref| <= 1e-3 (a half output of magnitude <= sqrt(2) has a half-ulp of
  at most 2^-11 ~ 4.9e-4, and the float32 angle error adds < 1e-4).
- Positions >= 1024, per octave [2^j, 2^(j+1)) of 32 random positions: max over the octave of
  err_method(p) / s(p) <= 1.5 * (the same maximum for plain RoPE, same library, no factors, no
  log-n, the code path the patch leaves bit-for-bit as upstream) + 1e-5 (F32) or + 1e-3 (F16).
  s(p) >= 1 is the log-n scale (1 without log-n): it multiplies the output and its error. The
  factor 1.5 is one more float32 rounding: upstream's ``theta / freq_factor`` (the path
  Llama-3's rope_freqs take in stock llama.cpp); measured worst octave ratio 1.12. Per single
  position the ratio is rounding noise (up to ~4.5 measured), so the comparison is per octave.
- What the patch itself adds is checked exactly: with log-n, the output equals the output
  without it times s(p), to one float32 rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

from ggufrope import methods

L = 8192
K_FACTOR = 16.0
BASE = 100000.0  # SmolLM2's freq_base
HEAD_DIM = 64
N_HEADS = 4

CASES = [("ntk", 0.625), ("ntk-fixed", 0.625)] + [("ntk-mixed", b) for b in (0.5, 0.625, 0.75, 1.0)]

P_ABS = 1024  # below: absolute bounds; from here: per-octave comparison with plain RoPE
_rng = np.random.default_rng(0)
OCTAVES = [(2**j, 2 ** (j + 1)) for j in range(10, 20)] + [(2**20, 2**20 + 1)]
POS_LO = np.unique(np.concatenate([np.arange(64), _rng.integers(64, P_ABS, 64), [P_ABS - 1]]))
POS_HI = np.concatenate([np.sort(_rng.integers(a, b, 32)) if b - a > 1 else [a] for a, b in OCTAVES]
                        + [[4095, 4096, 8191, 8192, 8193, 2**20 - 1]])
POS = np.concatenate([POS_LO, POS_HI])


@pytest.fixture(scope="module")
def ggml(patched_lib):
    from ggml_harness import GGML

    g = GGML()
    assert g.has_logn, "ggml_rope_set_logn missing from the patched libggml-base"
    return g


@pytest.mark.parametrize("n_dims", [32, 64, 128])
@pytest.mark.parametrize("k", [1.0, 2.0, 4.0, 16.0, 128.0])
@pytest.mark.parametrize("method,b", CASES)
def test_library_table_matches_registry(patched_lib, method, b, k, n_dims):
    from ggufrope.runtime import library_freq_factors

    lib = library_freq_factors(method, n_dims, k, b).astype(np.float64)
    ref = methods.freq_factors(method, n_dims, k, b)
    # both compute in double and round once to float32: equal up to one float32 ulp
    np.testing.assert_allclose(lib, ref, rtol=2.0**-23, atol=0)
    assert lib[-1] == np.float32(k)  # the lowest frequency is interpolated by exactly k


def test_library_table_rejects_invalid(patched_lib):
    from ggufrope.errors import GGUFRopeError
    from ggufrope.runtime import library_freq_factors

    for args in [("ntk-mixed", 64, 2.0, 0.0), ("ntk-mixed", 64, 2.0, 1.5), ("ntk", 64, 0.5, 0.625),
                 ("ntk", 64, float("nan"), 0.625), ("yarn", 64, 2.0, 0.625), ("ntk", 63, 2.0, 0.625)]:
        with pytest.raises(GGUFRopeError):
            library_freq_factors(*args)


def _input(dtype: str, n_tokens: int) -> np.ndarray:
    x = np.random.default_rng(1).uniform(-1, 1, (n_tokens, N_HEADS, HEAD_DIM))
    return x.astype(np.float16).astype(np.float64) if dtype == "f16" else x.astype(np.float32).astype(np.float64)


def _errors(ggml, x, *, n_dims, mode, dtype, factors32, factors64, logn_ctx):
    """Per-position max abs error of the op against the float64 reference."""
    out = ggml.rope(x, POS, n_dims=n_dims, mode=mode, freq_base=BASE, freq_factors=factors32,
                    n_ctx_logn=logn_ctx, dtype=dtype)
    ref = methods.rope_reference(x, POS, n_dims, BASE, mode, factors=factors64, logn_ctx=logn_ctx)
    return np.abs(out - ref).max(axis=(1, 2))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("mode", ["normal", "neox"])
@pytest.mark.parametrize("logn", [False, True], ids=["plain", "logn"])
@pytest.mark.parametrize("method,b", CASES)
def test_rope_op_against_reference(ggml, method, b, logn, mode, dtype):
    from ggufrope.runtime import library_freq_factors

    n_dims = HEAD_DIM
    x = _input(dtype, len(POS))
    ff32 = library_freq_factors(method, n_dims, K_FACTOR, b)
    ff64 = methods.freq_factors(method, n_dims, K_FACTOR, b)
    logn_ctx = L if logn else 0

    err = _errors(ggml, x, n_dims=n_dims, mode=mode, dtype=dtype, factors32=ff32, factors64=ff64, logn_ctx=logn_ctx)
    err_plain = _errors(ggml, x, n_dims=n_dims, mode=mode, dtype=dtype, factors32=None, factors64=None, logn_ctx=0)

    lo = POS < P_ABS
    bound_lo, slack_hi = (1e-4, 1e-5) if dtype == "f32" else (1e-3, 1e-3)
    assert err_plain[lo].max() <= bound_lo  # the bound is one upstream's plain RoPE meets
    assert err[lo].max() <= bound_lo, f"max error {err[lo].max():.3g} below p={P_ABS}"

    s = methods.logn_scale(POS, L) if logn else np.ones(len(POS))
    for a, b in OCTAVES:
        sel = (POS >= a) & (POS < b)
        worst, plain = (err[sel] / s[sel]).max(), err_plain[sel].max()
        assert worst <= 1.5 * plain + slack_hi, f"octave [{a}, {b}): error {worst:.3g} vs plain RoPE {plain:.3g}"


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_logn_only_scales_the_output(ggml, mode, dtype):
    """The patch's own arithmetic: log-n output = output without log-n * s(p), one rounding."""
    from ggufrope.runtime import library_freq_factors

    x = _input(dtype, len(POS))
    ff = library_freq_factors("ntk-mixed", HEAD_DIM, K_FACTOR, 0.625)
    kw = dict(n_dims=HEAD_DIM, mode=mode, freq_base=BASE, freq_factors=ff, dtype=dtype)
    scaled = ggml.rope(x, POS, n_ctx_logn=L, **kw)
    plain = ggml.rope(x, POS, **kw)
    sp = methods.logn_scale(POS, L)[:, None, None]
    # s(p) is folded into cos/sin (and the output rounded once more): a few roundings of terms
    # of magnitude <= s(p) each (|x| <= 1), 2^-24 relative in float32, 2^-11 in half
    eps = 2.0**-24 if dtype == "f32" else 2.0**-11
    assert np.all(np.abs(scaled - plain * sp) <= 8 * eps * sp)
    assert np.array_equal(scaled[POS < L], plain[POS < L])


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_logn_scales_unrotated_channels(ggml, mode):
    """Partial rotary (n_dims < head_dim): log-n scales the pass-through channels too."""
    x = _input("f32", len(POS))
    ff32 = np.asarray(methods.freq_factors("ntk-mixed", 32, 4.0), dtype=np.float32)
    out = ggml.rope(x, POS, n_dims=32, mode=mode, freq_base=BASE, freq_factors=ff32, n_ctx_logn=L)
    ref = methods.rope_reference(x, POS, 32, BASE, mode, factors=ff32.astype(np.float64), logn_ctx=L)
    s = methods.logn_scale(POS, L)
    np.testing.assert_allclose(out[:, :, 32:], x[:, :, 32:] * s[:, None, None], rtol=1e-6, atol=0)
    assert np.abs(out - ref)[POS < P_ABS].max() <= 1e-4


def test_logn_is_identity_below_L_and_scales_beyond(ggml):
    x = _input("f32", len(POS))
    plain = ggml.rope(x, POS, n_dims=HEAD_DIM, mode="normal", freq_base=BASE)
    logn = ggml.rope(x, POS, n_dims=HEAD_DIM, mode="normal", freq_base=BASE, n_ctx_logn=L)
    below = POS < L
    assert np.array_equal(plain[below], logn[below])  # bit-identical: s(p) = 1 exactly
    ratio = np.linalg.norm(logn[~below], axis=(1, 2)) / np.linalg.norm(plain[~below], axis=(1, 2))
    np.testing.assert_allclose(ratio, methods.logn_scale(POS[~below], L), rtol=1e-6)
    assert (ratio[POS[~below] > L] > 1).all()
