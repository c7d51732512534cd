"""The patched ggml rope op on the CPU, called directly, against the registry's float64 math.

Every NTK-family method (b in {0.5, 0.625, 0.75, 1.0} for ntk-mixed), with and without log-n,
NORMAL and NEOX, F32 and F16, positions below and beyond L up to 2^20. The divisor table
comes from the patched library's own ``llama_ggufrope_freq_factors`` (the C math), which is
first checked against :func:`ggufrope.methods.freq_factors`.

Bounds (inputs uniform in [-1, 1]):

- F32, positions < 4096: max |out - ref| <= 1e-4.
- F16 (input and output in half precision; the reference starts from the same half inputs),
  positions < 4096: max |out - ref| <= 1e-3 (an F16 output of magnitude <= sqrt(2) has a
  half-ulp of 2^-11 ~ 4.9e-4 at most, and the F32 angle error adds < 1e-4).
- Positions >= 4096: float32 angles lose about p * 2^-24 radians, so the bound is relative to
  plain RoPE computed by the same library with no factors and no log-n (the code path the patch
  leaves bit-for-bit as upstream), against the same float64 reference at the same position:
  err_method(p) / s(p) <= err_plain(p) + 1e-5 (F32) or + 1e-3 (F16), where s(p) >= 1 is the
  log-n scale (1 without log-n): log-n multiplies the output, and with it the angle error, by s(p).
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

POS_LO = np.unique(np.concatenate([np.arange(64), np.random.default_rng(0).integers(64, 4096, 48), [4095]]))
POS_HI = np.array([4096, 5000, 8191, 8192, 8193, 12345, 16384, 65535, 65536, 131075, 262144, 524295, 1048575, 1048576])
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

    lo = POS < 4096
    bound_lo, slack_hi = (1e-4, 1e-5) if dtype == "f32" else (1e-3, 1e-3)
    assert err[lo].max() <= bound_lo, f"max error {err[lo].max():.3g} below p=4096"

    s = methods.logn_scale(POS, L) if logn else np.ones(len(POS))
    hi = ~lo
    excess = err[hi] / s[hi] - (err_plain[hi] + slack_hi)
    assert (excess <= 0).all(), (
        f"positions {POS[hi][excess > 0]}: error {err[hi][excess > 0]} vs plain RoPE {err_plain[hi][excess > 0]}"
    )


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_logn_scales_unrotated_channels(ggml, mode):
    """Partial rotary (n_dims < head_dim): log-n scales the pass-through channels too."""
    x = _input("f32", len(POS))
    ff32 = np.asarray(methods.freq_factors("ntk-mixed", 32, 4.0), dtype=np.float32)
    out = ggml.rope(x, POS, n_dims=32, mode=mode, freq_base=BASE, freq_factors=ff32, n_ctx_logn=L)
    ref = methods.rope_reference(x, POS, 32, BASE, mode, factors=ff32.astype(np.float64), logn_ctx=L)
    s = methods.logn_scale(POS, L)
    np.testing.assert_allclose(out[:, :, 32:], x[:, :, 32:] * s[:, None, None], rtol=1e-6, atol=0)
    assert np.abs(out - ref)[POS < 4096].max() <= 1e-4


def test_logn_is_identity_below_L_and_scales_beyond(ggml):
    x = _input("f32", len(POS))
    plain = ggml.rope(x, POS, n_dims=HEAD_DIM, mode="normal", freq_base=BASE)
    logn = ggml.rope(x, POS, n_dims=HEAD_DIM, mode="normal", freq_base=BASE, n_ctx_logn=L)
    below = POS < L
    assert np.array_equal(plain[below], logn[below])  # bit-identical: s(p) = 1 exactly
    ratio = np.linalg.norm(logn[~below], axis=(1, 2)) / np.linalg.norm(plain[~below], axis=(1, 2))
    np.testing.assert_allclose(ratio, methods.logn_scale(POS[~below], L), rtol=1e-6)
    assert (ratio[POS[~below] > L] > 1).all()
