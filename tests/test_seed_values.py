"""Hand-computed per-pair divisors and log-n values, against every implementation.

The values below were worked out by hand (the arithmetic is in the comments) from the seeds'
formulas, not by running any code of this repository. They are checked against
``ggufrope.methods`` (the Python registry), the patched library's own table
(``runtime.library_freq_factors``, float32) and the torch reference's transcription of the
seeds (``torch_reference.seed_freq_factors``). A misreading of the seeds shared by all three
fails here.

Case: d = 8 rotary dims (pairs i = 0..3, the seed's digit m = i + 1 = 1..4), k = 16.
"""

from __future__ import annotations

import numpy as np
import pytest

from ggufrope import methods
from torch_reference import seed_freq_factors, seed_logn_scale

D, K = 8, 16.0

# NTK-aware (seed 001): base' = base·k^(d/(d-2)), so ff_i = k^(2i/(d-2)) = 16^(i/3):
#   i = 0: 1
#   i = 1: 16^(1/3) = 2·2^(1/3) = 2 × 1.2599210 = 2.5198421
#   i = 2: 16^(2/3) = (16^(1/3))² = 2.5198421² = 6.3496042
#   i = 3: 16 = k
NTK = [1.0, 2.5198421, 6.3496042, 16.0]

# NTK-RoPE-fixed (seed 000 eq. 5): λ = k^(2/d) = 16^(1/4) = 2, ff_i = λ^m:
#   m = 1..4: 2, 4, 8, 16 (interior pairs: 4 and 8)
FIXED = [2.0, 4.0, 8.0, 16.0]

# NTK-RoPE-mixed (seed 000 eq. 7), b = 0.5: λ_1···λ_m = exp(a·m^b), a·(d/2)^b = ln k
#   a = ln 16 / 4^0.5 = ln 16 / 2 = ln 4, so ff_i = exp(ln 4 · √m) = 4^√m = 2^(2√m):
#   m = 1: 4^1 = 4
#   m = 2: 2√2 = 2.8284271; 2^0.8284271 = e^(0.8284271 × 0.6931472) = e^0.5742220
#          = e^0.5 × e^0.0742220 = 1.6487213 × 1.0770460 = 1.7757484; × 2² = 7.1029933
#   m = 3: 2√3 = 3.4641016; 2^0.4641016 = e^(0.4641016 × 0.6931472) = e^0.3216907
#          = e^0.3 × e^0.0216907 = 1.3498588 × 1.0219277 = 1.3794580; × 2³ = 11.035664
#   m = 4: 4^2 = 16 = k
MIXED_B = 0.5
MIXED = [4.0, 7.1029933, 11.035664, 16.0]

# ntk-mixed with b = 1 is ntk-fixed (seed 000: "When b = 1 ... NTK-RoPE-fixed")
HAND = {
    ("ntk", MIXED_B): NTK,
    ("ntk-fixed", MIXED_B): FIXED,
    ("ntk-mixed", MIXED_B): MIXED,
    ("ntk-mixed", 1.0): FIXED,
}
RTOL = 2e-7  # the hand values carry 8 significant digits; float32 tables are within 6e-8


IMPLEMENTATIONS = {
    "methods": lambda m, b: methods.freq_factors(m, D, K, b),
    "torch_reference": lambda m, b: seed_freq_factors(m, D, K, b),
}


@pytest.mark.parametrize("method,b", list(HAND), ids=[f"{m}-b{b}" for m, b in HAND])
@pytest.mark.parametrize("impl", ["methods", "torch_reference"])
def test_hand_values_python(method, b, impl):
    got = np.asarray(IMPLEMENTATIONS[impl](method, b), dtype=np.float64)
    np.testing.assert_allclose(got, HAND[(method, b)], rtol=RTOL)


@pytest.mark.parametrize("method,b", list(HAND), ids=[f"{m}-b{b}" for m, b in HAND])
def test_hand_values_library(patched_lib, method, b):
    """The C table of the patched library (float32)."""
    from ggufrope.runtime import library_freq_factors

    got = library_freq_factors(method, D, K, b).astype(np.float64)
    np.testing.assert_allclose(got, HAND[(method, b)], rtol=RTOL)


def test_hand_values_shape_of_the_seed():
    """The hand values themselves have the seed's properties: every table ends at k; with
    b < 1 mixed divides every pair but the last more than fixed; λ_m = ff_m / ff_(m-1) is
    non-increasing and >= 1 (seed 000 appendix: λ_1 >= λ_2 >= ... >= λ_(d/2) >= 1)."""
    assert NTK[-1] == FIXED[-1] == MIXED[-1] == K
    assert all(mx > fx for mx, fx in zip(MIXED[:-1], FIXED[:-1]))
    lam = np.array(MIXED) / np.array([1.0] + MIXED[:-1])
    assert (np.diff(lam) <= 0).all() and (lam >= 1).all()


# log-n (seed 000, Table 2): s(p) = max(1, log_L(p + 1)), L = 64:
#   p = 0: log_64(1) = 0 -> 1;  p = 63: log_64(64) = 1 -> 1
#   p = 511: log_64(512) = 9/6 = 1.5;  p = 4095: log_64(4096) = 12/6 = 2
#   p = 127: log_64(128) = 7/6 = 1.1666667
LOGN_L = 64
LOGN = {0: 1.0, 63: 1.0, 127: 7.0 / 6.0, 511: 1.5, 4095: 2.0}


@pytest.mark.parametrize("impl", ["methods", "torch_reference"])
def test_hand_values_logn(impl):
    pos = np.array(list(LOGN))
    got = methods.logn_scale(pos, LOGN_L) if impl == "methods" else seed_logn_scale(pos, LOGN_L).numpy()
    np.testing.assert_allclose(got, list(LOGN.values()), rtol=1e-12)
