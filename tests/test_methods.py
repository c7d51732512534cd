"""ggufrope.methods: the one method registry (tables, parameters and their checks, words),
and that the rest of ggufrope validates through it.

The expected tables are computed by hand here from the seeds' formulas (seed 000 eq. 5 and 7,
seed 001), for parameters that make them exact powers of two, not from the code under test.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from ggufrope import methods as M
from ggufrope.errors import GGUFRopeError


# --------------------------------------------------------------------------- the registry


def test_registry_entries() -> None:
    assert list(M.METHODS) == ["none", "linear", "yarn", "ntk", "ntk-fixed", "ntk-mixed"]
    for name, m in M.METHODS.items():
        assert m.name == name and m.title and m.source and m.description
        assert (m.table is None) == (name == "yarn")  # yarn is llama.cpp's own, not a divisor table
        assert m.uses_factor == (name != "none")
        assert m.uses_exponent == (name == "ntk-mixed")
        assert m.ntk_family == name.startswith("ntk")
        assert m.stored == (name in ("none", "ntk", "ntk-fixed", "ntk-mixed"))
        if m.stock and name != "none":
            assert m.stock_options and "--rope-scaling" in m.stock_options
        if m.table is not None:
            assert m.table.__doc__, name  # each table says which equation it is
    assert M.FILE_METHODS == ("none", "ntk", "ntk-fixed", "ntk-mixed")
    assert M.NTK_FAMILY == ("ntk", "ntk-fixed", "ntk-mixed")
    for alias, name in [("mixed", "ntk-mixed"), ("fixed", "ntk-fixed"), ("ntk-aware", "ntk"), ("pi", "linear"),
                        (" NTK-Mixed ", "ntk-mixed")]:
        assert M.canonical(alias) == name and M.entry(alias) is M.METHODS[name]


# Hand-computed tables (d = 8, so i = 0..3):
#   ntk, k = 8:           ff_i = 8^(2i/6) = 2^i                       -> 1, 2, 4, 8
#   ntk-fixed, k = 16:    lambda = 16^(2/8) = 2, ff_i = 2^(i+1)        -> 2, 4, 8, 16
#   ntk-mixed, k = 4, b = 1/2: a = ln 4 / 4^(1/2) = ln 2, ff_i = 2^sqrt(i+1)
#                                                                      -> 2, 2^1.41421356, 2^1.73205081, 4
#   ntk-mixed, b = 1 is ntk-fixed: a = ln 16 / 4 = ln 2                -> 2, 4, 8, 16
#   linear, k = 3:                                                     -> 3, 3, 3, 3
HAND = [
    ("ntk", 8.0, None, [1.0, 2.0, 4.0, 8.0]),
    ("ntk-fixed", 16.0, None, [2.0, 4.0, 8.0, 16.0]),
    ("ntk-mixed", 4.0, 0.5, [2.0, 2.0 ** 1.4142135623730951, 2.0 ** 1.7320508075688772, 4.0]),
    ("ntk-mixed", 16.0, 1.0, [2.0, 4.0, 8.0, 16.0]),
    ("linear", 3.0, None, [3.0, 3.0, 3.0, 3.0]),
    ("none", 5.0, None, [1.0, 1.0, 1.0, 1.0]),
]


@pytest.mark.parametrize("name, k, b, want", HAND)
def test_tables_by_hand(name, k, b, want) -> None:
    got = M.freq_factors(name, 8, k, b if b is not None else M.DEFAULT_EXPONENT)
    assert got.dtype == np.float64 and got.shape == (4,)
    np.testing.assert_allclose(got, want, rtol=1e-14)
    # the table function of the entry, called with the one signature, is what freq_factors returns
    np.testing.assert_array_equal(M.METHODS[name].table(8, k, b if b is not None else M.DEFAULT_EXPONENT), got)


@pytest.mark.parametrize("name", ["ntk", "ntk-fixed", "ntk-mixed"])
@pytest.mark.parametrize("d", [4, 64, 128, 256])
def test_ntk_family_interpolates_the_lowest_frequency_by_k(name, d) -> None:
    ff = M.freq_factors(name, d, 3.7, 0.4)
    assert math.isclose(ff[-1], 3.7, rel_tol=1e-12)
    assert (np.diff(ff) >= 0).all() and ff[0] >= 1.0


def test_freq_factors_errors() -> None:
    for args, msg in [
        (("yarn", 8, 2.0), "not a divisor table"),
        (("bogus", 8, 2.0), "unknown method"),
        (("ntk", 6.5, 2.0), "n_dims"),
        (("ntk", 2, 2.0), "n_dims"),
        (("ntk", 8, 0.5), "factor k must be finite and >= 1"),
        (("ntk-mixed", 8, 2.0, 0.0), "exponent b must be in"),
    ]:
        with pytest.raises(ValueError, match=msg):
            M.freq_factors(*args)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "args, kw, want",
    [
        (("none",), {}, ("none", None, None, False)),
        (("mixed",), {}, ("ntk-mixed", None, 0.625, True)),
        (("ntk-mixed", 2, 0.5), {}, ("ntk-mixed", 2.0, 0.5, False)),
        (("ntk-aware", 4.0), {}, ("ntk", 4.0, None, False)),
        (("linear", 2.5), {}, ("linear", 2.5, None, False)),
        (("yarn",), {}, ("yarn", None, None, False)),
        (("ntk", 1.1), {"float32": True}, ("ntk", float(np.float32(1.1)), None, False)),
        (("mixed", None, 0.3), {"stored": True, "float32": True}, ("ntk-mixed", None, float(np.float32(0.3)), False)),
    ],
)
def test_validate_accepts(args, kw, want) -> None:
    p = M.validate(*args, **kw)
    assert (p.method, p.factor, p.exponent, p.exponent_default) == want


@pytest.mark.parametrize(
    "args, kw, msg",
    [
        (("rope9",), {}, "unknown method 'rope9'"),
        (("none", 2.0), {}, "a factor k has no effect with method 'none'"),
        (("ntk", None, 0.5), {}, "the exponent b applies to ntk-mixed only, not to 'ntk'"),
        (("linear", None, 0.5), {}, "applies to ntk-mixed only"),
        (("none", None, 0.625), {}, "applies to ntk-mixed only"),
        (("ntk", 0.99), {}, "factor k must be finite and >= 1"),
        (("ntk", float("nan")), {}, "factor k must be finite"),
        (("ntk", float("inf")), {}, "factor k must be finite"),
        (("ntk", 1e39), {}, "factor k must be finite"),  # finite as a double, inf as float32
        (("ntk", 0.0), {}, "factor k must be finite and >= 1"),  # 0 is the file's "auto", not a user's k
        (("ntk", "2"), {}, "factor k must be a number"),
        (("ntk", True), {}, "factor k must be a number"),
        (("mixed", None, 0.0), {}, "exponent b must be in (0, 1]"),
        (("mixed", None, 1.0001), {}, "exponent b must be in (0, 1]"),
        (("mixed", None, 1e-50), {}, "exponent b must be in (0, 1]"),  # 0 as float32
        (("mixed", None, False), {}, "exponent b must be a number"),
        (("linear",), {"stored": True}, "use llama.cpp's --rope-scaling linear --rope-scale K instead"),
        (("pi",), {"stored": True}, "use llama.cpp's --rope-scaling linear"),
        (("yarn", 2.0), {"stored": True}, "use llama.cpp's --rope-scaling yarn --rope-scale K --yarn-orig-ctx L"),
    ],
)
def test_validate_refuses(args, kw, msg) -> None:
    with pytest.raises(ValueError) as ei:
        M.validate(*args, **kw)
    assert msg in str(ei.value) and "\n" not in str(ei.value)


@pytest.mark.parametrize(
    "stored, want",
    [
        (("ntk-mixed", None, None), ("ntk-mixed", None, 0.625, True)),  # the library's default b
        (("ntk-mixed", 0.0, 0.5), ("ntk-mixed", None, 0.5, False)),  # k = 0: auto
        (("ntk", 2.0, None), ("ntk", 2.0, None, False)),
        (("ntk", 2.0, 0.5), ("ntk", 2.0, 0.5, False)),  # an unused b is accepted (and ignored)
        (("none", None, None), ("none", None, None, False)),
        (("none", 3.0, None), ("none", 3.0, None, False)),  # an unused k likewise
    ],
)
def test_validate_stored_accepts_what_the_library_loads(stored, want) -> None:
    p = M.validate_stored(*stored)
    assert (p.method, p.factor, p.exponent, p.exponent_default) == want


@pytest.mark.parametrize(
    "stored, msg",
    [
        (("yarn", None, None), "method 'yarn' is not one of none, ntk, ntk-fixed, ntk-mixed"),
        (("mixed", None, None), "is not one of"),  # aliases are the tool's, not the file's
        (("ntk", 0.5, None), "factor k must be finite and >= 1"),
        (("ntk", float("nan"), None), "factor k must be finite"),
        (("ntk-mixed", 2.0, 1.5), "exponent b must be in (0, 1]"),
    ],
)
def test_validate_stored_refuses_what_the_library_refuses(stored, msg) -> None:
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace("]", r"\]")):
        M.validate_stored(*stored)


def test_auto_factor_is_for_the_stock_methods() -> None:
    assert M.auto_factor(200, 64) == 3.125 and M.auto_factor(32, 64) == 1.0
    with pytest.raises(ValueError):
        M.auto_factor(200, 0)
    assert M.AUTO_FACTOR == 0.0


def test_summary_words() -> None:
    assert M.summary("ntk-mixed", "2", "0.5", True) == "ntk-mixed, b = 0.5, k = 2, log-n on"
    assert M.summary("none", "2", "0.5", False) == "none, log-n off"  # none takes neither
    assert M.summary("ntk", "auto", "0.5", False) == "ntk, k = auto, log-n off"
    dyn = "k dynamic: 1 within L, then powers of 2 >= n/L, KV cache re-rotated"
    assert M.summary("ntk-mixed", None, "0.625", False, dynamic=True) == f"ntk-mixed, b = 0.625, {dyn}, log-n off"
    assert M.summary("ntk", "4", None, True, dynamic=True) == f"ntk, {dyn} (k now 4), log-n on"
    assert M.summary("ntk-fixed", None, None, False, dynamic=True, dynamic_ratio=1.5) == \
        "ntk-fixed, k dynamic: 1 within L, then powers of 1.5 >= n/L, KV cache re-rotated, log-n off"
    # a float32 ratio reads back as typed
    assert M.dynamic_words(float(np.float32(1.1))) == "k dynamic: 1 within L, then powers of 1.1 >= n/L, KV cache re-rotated"
    assert M.summary("none", None, None, True, dynamic=True) == "none, log-n on"  # none has no dynamic k


# --------------------------------------------------------------------------- dynamic k (issue 13)


@pytest.mark.parametrize(
    "args, kw, want",
    [
        (("mixed",), {"dynamic": True}, ("ntk-mixed", None, 0.625, True, None)),
        (("ntk",), {"dynamic": True, "dynamic_ratio": 1.5}, ("ntk", None, None, True, 1.5)),
        (("ntk-fixed",), {"dynamic": False}, ("ntk-fixed", None, None, False, None)),
        (("ntk", 2.0), {"dynamic": False}, ("ntk", 2.0, None, False, None)),
        (("none",), {"dynamic": False}, ("none", None, None, False, None)),  # static none: nothing to refuse
        (("linear", 2.0), {"dynamic": False}, ("linear", 2.0, None, False, None)),
        (("ntk",), {"dynamic": True, "dynamic_ratio": 1.1, "float32": True}, ("ntk", None, None, True, float(np.float32(1.1)))),
        (("ntk",), {}, ("ntk", None, None, None, None)),  # not given stays not given
    ],
)
def test_validate_dynamic_accepts(args, kw, want) -> None:
    p = M.validate(*args, **kw)
    assert (p.method, p.factor, p.exponent, p.dynamic, p.dynamic_ratio) == want


@pytest.mark.parametrize(
    "args, kw, msg",
    [
        (("none",), {"dynamic": True}, "dynamic k needs an NTK-family method (ntk, ntk-fixed, ntk-mixed), not 'none'"),
        (("linear",), {"dynamic": True}, "not 'linear'"),
        (("yarn",), {"dynamic": True}, "not 'yarn'"),
        (("ntk", 2.0), {"dynamic": True}, ("dynamic k chooses k itself (1 within L, then by its schedule): "
                                           "leave the factor k out (got 2.0)")),
        (("ntk", 1.0), {"dynamic": True}, "leave the factor k out"),
        (("ntk", 2.0), {"dynamic_ratio": 2.0}, "the dynamic ratio r applies to dynamic k only"),
        (("none",), {"dynamic_ratio": 2.0}, "the dynamic ratio r applies to dynamic k only"),
        (("ntk",), {"dynamic": False, "dynamic_ratio": 2.0}, "the dynamic ratio r applies to dynamic k only"),
        (("ntk",), {"dynamic": True, "dynamic_ratio": 1.0}, "dynamic ratio r must be finite and > 1, got 1.0"),
        (("ntk",), {"dynamic": True, "dynamic_ratio": 0.0}, "dynamic ratio r must be finite and > 1"),
        (("ntk",), {"dynamic": True, "dynamic_ratio": -3.0}, "dynamic ratio r must be finite and > 1"),
        (("ntk",), {"dynamic": True, "dynamic_ratio": float("nan")}, "dynamic ratio r must be finite and > 1"),
        (("ntk",), {"dynamic": True, "dynamic_ratio": float("inf")}, "dynamic ratio r must be finite and > 1"),
        (("ntk",), {"dynamic": True, "dynamic_ratio": 1.00000001}, "(1.0 as float32)"),
        (("ntk",), {"dynamic": True, "dynamic_ratio": "2"}, "dynamic ratio r must be a number"),
        (("ntk",), {"dynamic": True, "dynamic_ratio": True}, "dynamic ratio r must be a number"),
        (("ntk",), {"dynamic": "yes"}, "dynamic must be true, false or left out, got 'yes'"),
        (("ntk",), {"dynamic": 1}, "dynamic must be true, false or left out"),
        (("linear",), {"dynamic": True, "stored": True}, "use llama.cpp's --rope-scaling linear"),  # stored first
    ],
)
def test_validate_dynamic_refuses(args, kw, msg) -> None:
    with pytest.raises(ValueError) as ei:
        M.validate(*args, **kw)
    assert msg in str(ei.value) and "\n" not in str(ei.value)


@pytest.mark.parametrize(
    "stored, want",
    [
        (("ntk-mixed", None, None, True, None), ("ntk-mixed", None, True, 2.0)),  # the default ratio
        (("ntk", 0.0, None, True, 3.0), ("ntk", None, True, 3.0)),  # factor 0: auto, allowed
        (("ntk", 2.0, None, False, None), ("ntk", 2.0, False, None)),
        (("ntk", 2.0, None, False, 1.5), ("ntk", 2.0, False, 1.5)),  # a ratio beside static k: checked, no effect
        (("ntk", None, None, None, None), ("ntk", None, True, 2.0)),  # absent: DYNAMIC_DEFAULT (True), NTK, no k
        (("ntk-fixed", 0.0, None, None, None), ("ntk-fixed", None, True, 2.0)),  # absent, factor 0 (auto): dynamic
        (("ntk-mixed", None, None, None, 1.5), ("ntk-mixed", None, True, 1.5)),  # absent, the file's ratio
        (("ntk", 2.0, None, None, None), ("ntk", 2.0, False, None)),  # absent, an explicit k: static
        (("ntk", None, None, False, None), ("ntk", None, False, None)),  # false: static auto k
        (("none", None, None, None, None), ("none", None, False, None)),  # absent, method none: static
        (("none", None, None, False, None), ("none", None, False, None)),
    ],
)
def test_validate_stored_dynamic(stored, want) -> None:
    p = M.validate_stored(*stored)
    assert (p.method, p.factor, p.dynamic, p.dynamic_ratio) == want


@pytest.mark.parametrize(
    "stored, msg",
    [
        (("none", None, None, True, None), "dynamic k needs an NTK-family method (ntk, ntk-fixed, ntk-mixed), not 'none'"),
        (("ntk-mixed", 2.0, None, True, None), "the factor k must be absent or 0 (got 2.0)"),
        (("ntk-mixed", 1.0, None, True, None), "the factor k must be absent or 0 (got 1.0)"),
        (("ntk", None, None, True, 1.0), "dynamic ratio r must be finite and > 1, got 1.0"),
        (("ntk", None, None, False, 0.5), "dynamic ratio r must be finite and > 1, got 0.5"),  # refused even when static
        (("ntk", None, None, None, float("inf")), "dynamic ratio r must be finite and > 1"),
    ],
)
def test_validate_stored_dynamic_refuses(stored, msg) -> None:
    with pytest.raises(ValueError) as ei:
        M.validate_stored(*stored)
    assert msg in str(ei.value)


def test_dynamic_effective_and_its_default(monkeypatch) -> None:
    """The default is dynamic (the key absent): an NTK-family method with no k (None or 0) runs
    dynamic k; an explicit k, method none or a stock method stay static; explicit true/false win."""
    assert M.DYNAMIC_DEFAULT is True
    assert M.dynamic_effective("ntk", None, None) is True
    assert M.dynamic_effective("ntk-fixed", None, None) is True
    assert M.dynamic_effective("ntk-mixed", M.AUTO_FACTOR, None) is True
    assert M.dynamic_effective("ntk", 2.0, None) is False  # an explicit k stays static
    assert M.dynamic_effective("ntk-mixed", 1.0, None) is False  # k = 1 is explicit too
    assert M.dynamic_effective("none", None, None) is False
    assert M.dynamic_effective("linear", None, None) is False
    assert M.dynamic_effective("yarn", None, None) is False
    assert M.dynamic_effective("ntk", None, False) is False  # explicit false: static auto k
    assert M.dynamic_effective("ntk", None, True) is True
    assert M.dynamic_effective("ntk", 2.0, False) is False
    assert M.validate_stored("ntk", None, None).dynamic is True
    assert M.validate_stored("ntk", None, None).dynamic_ratio == 2.0
    assert M.validate_stored("ntk", 2.0, None).dynamic is False
    assert M.validate_stored("ntk", None, None, False).dynamic is False
    # the registry follows the one constant: flipped back to False, absent means static
    monkeypatch.setattr(M, "DYNAMIC_DEFAULT", False)
    assert M.dynamic_effective("ntk", None, None) is False
    assert M.dynamic_effective("ntk-mixed", M.AUTO_FACTOR, None) is False
    assert M.dynamic_effective("ntk", None, True) is True
    assert M.dynamic_effective("ntk", 2.0, False) is False
    assert M.validate_stored("ntk", None, None).dynamic is False
    assert M.validate_stored("ntk", None, None).dynamic_ratio is None


# --------------------------------------------------------------------------- everything else calls it


def test_every_consumer_validates_through_the_registry(monkeypatch) -> None:
    """Change the registry (ntk takes b; none takes k) and the set-side values, the load-time
    choice, the evaluation setting and the file reader all follow: none of them keeps a copy
    of the rules."""
    from ggufrope.evaluation import decoder as ED
    from ggufrope import rope_metadata as RM
    from ggufrope import runtime as R

    # today's rules
    with pytest.raises(GGUFRopeError, match="applies to ntk-mixed only"):
        RM._rope_values("ntk", None, 0.5, False)
    with pytest.raises(GGUFRopeError, match="applies to ntk-mixed only"):
        R.RopeChoice("ntk", None, 0.5)
    with pytest.raises(GGUFRopeError, match="applies to ntk-mixed only"):
        ED.Setting("ntk", None, 0.5)
    with pytest.raises(GGUFRopeError, match="no effect with method 'none'"):
        R.RopeChoice("none", 2.0)
    assert ED.Setting.for_grid("ntk", 2.0, 0.5, False).exponent is None

    monkeypatch.setitem(M.METHODS, "ntk", dataclasses.replace(M.METHODS["ntk"], params=("factor", "exponent")))
    monkeypatch.setitem(M.METHODS, "none", dataclasses.replace(M.METHODS["none"], params=("factor",)))
    assert RM._rope_values("ntk", None, 0.5, False)[2] == 0.5
    assert R.RopeChoice("ntk", None, 0.5).exponent == 0.5
    assert ED.Setting("ntk", None, 0.5).exponent == 0.5
    assert ED.Setting.for_grid("ntk", 2.0, 0.5, False).exponent == 0.5
    assert R.RopeChoice("none", 2.0).factor == 2.0
    assert ED.Setting("none", 2.0).resolved_factor(128, 64) == 2.0

    # dynamic k: the registry says which methods have it (today the NTK family)
    for make in (lambda: RM._rope_values("none", None, None, False, True), lambda: R.RopeChoice("none", dynamic=True),
                 lambda: ED.Setting("none", dynamic=True)):
        with pytest.raises(GGUFRopeError, match="dynamic k needs an NTK-family method"):
            make()
    monkeypatch.setattr(M.Method, "supports_dynamic", property(lambda self: self.name in ("none", "ntk-mixed")))
    assert RM._rope_values("none", None, None, False, True)[4] is True
    assert R.RopeChoice("none", dynamic=True).runs_dynamic
    assert ED.Setting("none", dynamic=True).dynamic
    with pytest.raises(GGUFRopeError, match=r"dynamic k needs an NTK-family method \(none, ntk-mixed\), not 'ntk'"):
        R.RopeChoice("ntk", dynamic=True)
    with pytest.raises(ValueError, match="not 'ntk-fixed'"):
        M.validate_stored("ntk-fixed", None, None, True)

    # the checks on values too: a registry whose k must be >= 2
    def check_factor(k):
        if not k >= 2:
            raise ValueError(f"factor k must be >= 2 here, got {k!r}")
        return float(k)

    monkeypatch.setattr(M, "check_factor", check_factor)
    for make in (lambda: RM._rope_values("ntk", 1.5, None, False), lambda: R.RopeChoice("ntk", 1.5),
                 lambda: ED.Setting("ntk", 1.5)):
        with pytest.raises(GGUFRopeError, match="must be >= 2 here"):
            make()
