"""The method registry: every context-extension method, its rope math in float64, its
parameters and their checks, and its description. One entry per method in :data:`METHODS`.

This module is the one reference that the patched llama.cpp (C and CUDA) and the torch
reference forward are tested against, and the one place where a method name, a factor k or
an exponent b is validated: ``ggufrope set`` (:mod:`ggufrope.rope_metadata`), ``show``, the
load-time choice (:mod:`ggufrope.runtime`), the command line and the evaluation all call
:func:`validate` (a choice made by the user) or :func:`validate_stored` (values read from a
file), and nothing else re-derives a formula or a check. The model is transformers'
``ROPE_INIT_FUNCTIONS`` (one function per rope type) with its per-type validation functions
(``_validate_*_rope_parameters``: which parameters a type takes, and their ranges).

Notation (design notes §1): ``n_dims`` = d, the rotary dimensions (``n_rot``); pair
index i = 0 .. d/2-1 (the seeds' digit m = i+1); ``freq_base`` = β; position p (0-based);
``n_ctx_orig`` = L, the pretraining context; ``factor`` = k, the extension factor;
``exponent`` = b, the exponent of NTK-RoPE-mixed.

Stock RoPE rotates pair i of a vector at position p by θ_i(p) = p · β^(-2i/d). Every
method here is a per-pair divisor ``ff_i`` (llama.cpp's rope ``freq_factors``):
θ_i(p) = p · β^(-2i/d) / ff_i.

=============  ============================  =========================================
method         ff_i                          source
=============  ============================  =========================================
none           1                             extrapolation, the baseline
linear         k                             position interpolation (Chen et al. 2023;
                                             seed 004)
ntk            k^(2i/(d-2))                  NTK-aware, base·k^(d/(d-2)) (seed 001)
ntk-fixed      λ^(i+1), λ = k^(2/d)          seed 000 eq. 5 ("NTK-RoPE-fixed")
ntk-mixed      exp(a·(i+1)^b),               seed 000 eq. 7 and its constraint
               a = ln k / (d/2)^b            a·(d/2)^b = ln k ("NTK-RoPE-mixed")
=============  ============================  =========================================

For every NTK-family method ``ff_{d/2-1} = k``: the lowest frequency is interpolated by
exactly k. ``yarn`` is stock llama.cpp's YaRN (seed 004) and is listed for comparison
only: it is not a divisor table and has no table function.

**Parameters.** ``none`` takes no parameter (a factor k with it is an error); ``linear``,
``yarn`` and the NTK family take k >= 1 (finite, also once rounded to float32, the type the
library reads); only ``ntk-mixed`` takes b, 0 < b <= 1 (default 0.625; b = 1 is
ntk-fixed). k left out means "auto": for the NTK family, unless dynamic k applies (by
default it does when ``{arch}.rope.ntk.dynamic`` is absent, see below), the patched library
resolves k = max(1, n_ctx_seq / L) when the context is created (n_ctx_seq: the context of one
sequence, n_ctx rounded up to a multiple of 256 and divided by n_seq_max), and Python never
computes that value itself (``{arch}.rope.ntk.factor`` = 0 or absent asks for it, with
``{arch}.rope.ntk.dynamic`` false); for the stock methods ``linear``/``yarn``, whose k is
llama.cpp's own ``rope_freq_scale = 1/k``, Python chooses k = max(1, n_ctx / L)
(:func:`auto_factor`).

log-n attention scaling (seed 000, Table 2, the variant for models not trained with it):
every query at position p is multiplied after RoPE by s(p) = max(1, ln(p+1) / ln L).
Keys are never scaled. It is not a method but a switch beside any of them.

**Dynamic k** (issue 13, seed 002, the *consistent* variant): instead of one k for the whole
context, the patched library keeps the model unmodified (k = 1) while the KV cache holds
positions < L only, and beyond L raises k on a schedule, k = the smallest r^e (e an integer
>= 1) with r^e · L >= n, n = 1 + the largest position in the KV cache, r the ratio
(``{arch}.rope.ntk.dynamic_ratio``, default :data:`DEFAULT_DYNAMIC_RATIO` = 2: powers of
two); every cached key is re-rotated to the new table when k changes, so queries and keys
always share one table. Only the NTK family has it (:attr:`Method.supports_dynamic`), and it
chooses k itself: a factor k with it is an error (the file's factor must be absent or 0).
:data:`DYNAMIC_DEFAULT` says what the library does when ``{arch}.rope.ntk.dynamic`` is
absent (:func:`dynamic_effective`): True, so an NTK-family method without a factor k (absent
or 0) runs dynamic k unless the key is false; an explicit k >= 1 or method none stay static.
Nothing else in ggufrope assumes it. Like log-n, it is a switch beside the method (log-n and
dynamic combine).
"""

from __future__ import annotations

import math
import numbers
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import numpy as np

DEFAULT_EXPONENT = 0.625  #: seed 000's empirical b for NTK-RoPE-mixed
#: the value of ``{arch}.rope.ntk.factor`` (and of its kv override) that asks the library for
#: an automatic k: dynamic k (by default, or with ``{arch}.rope.ntk.dynamic`` true), or with the
#: dynamic key false the static k = max(1, n_ctx_seq / L)
AUTO_FACTOR = 0.0
#: what the patched library does when ``{arch}.rope.ntk.dynamic`` is absent: True, dynamic k
#: wherever it can run (an NTK-family method whose factor is absent or 0); an explicit factor
#: k >= 1 or method none stay static. The one place this default is written down: every other
#: part of ggufrope asks :func:`dynamic_effective`.
DYNAMIC_DEFAULT = True
#: the ratio r of the dynamic schedule when ``{arch}.rope.ntk.dynamic_ratio`` is absent
#: (k = 1, 2, 4, 8, ... beyond L)
DEFAULT_DYNAMIC_RATIO = 2.0

_F32 = struct.Struct("<f")


def to_float32(x: float) -> float:
    """The float32 value nearest to ``x`` (round half to even) as a Python float, ``inf``
    on overflow: what the library reads from a FLOAT32 key or a float kv override."""
    x = float(x)
    try:
        return _F32.unpack(_F32.pack(x))[0]
    except OverflowError:  # rounds beyond the largest float32
        return math.copysign(math.inf, x)


# --------------------------------------------------------------------------- tables
# One signature for every table: (n_dims d, factor k, exponent b) -> ff, float64, shape
# (d/2,). The arguments are validated by freq_factors() before the call.


def _pairs(n_dims: int) -> np.ndarray:
    import numpy as np

    return np.arange(n_dims // 2, dtype=np.float64)


def table_none(n_dims: int, factor: float, exponent: float) -> np.ndarray:
    """ff_i = 1: plain RoPE, extrapolation beyond L (RoPE, Su et al. 2021)."""
    import numpy as np

    return np.ones(n_dims // 2)


def table_linear(n_dims: int, factor: float, exponent: float) -> np.ndarray:
    """ff_i = k: position interpolation, every frequency divided by k (Chen et al. 2023;
    seed 004). llama.cpp's own ``rope_freq_scale = 1/k``."""
    import numpy as np

    return np.full(n_dims // 2, float(factor))


def table_ntk(n_dims: int, factor: float, exponent: float) -> np.ndarray:
    """ff_i = k^(2i/(d-2)): NTK-aware scaling (seed 001), the base β replaced by
    β·k^(d/(d-2)) so that the lowest frequency (i = d/2-1) is divided by exactly k;
    seed 000 calls it NTK-RoPE-old (its eq. 3)."""
    return float(factor) ** (2.0 * _pairs(n_dims) / (n_dims - 2))


def ntk_freq_base(freq_base: float, n_dims: int, factor: float) -> float:
    """β·k^(d/(d-2)): the rope base whose plain RoPE is NTK-aware scaling, the table of
    :func:`table_ntk` as a new base, since (β·k^(d/(d-2)))^(-2i/d) = β^(-2i/d) / k^(2i/(d-2)).
    What an engine without the patch can carry in ``{arch}.rope.freq_base``
    (:mod:`ggufrope.stock`). ``ValueError`` for k < 1 or d odd or < 4."""
    if n_dims < 4 or n_dims % 2:
        raise ValueError(f"n_dims must be even and >= 4, got {n_dims}")
    return float(freq_base) * check_factor(factor) ** (n_dims / (n_dims - 2.0))


def table_ntk_fixed(n_dims: int, factor: float, exponent: float) -> np.ndarray:
    """ff_i = λ^(i+1), λ = k^(2/d): seed 000 eq. 5 (NTK-RoPE-fixed),
    θ_m = n / (λ (βλ)^(m-1)) for digit m = i+1, i.e. base βλ and the period of every digit
    scaled by λ too."""
    return (float(factor) ** (2.0 / n_dims)) ** (_pairs(n_dims) + 1.0)


def table_ntk_mixed(n_dims: int, factor: float, exponent: float) -> np.ndarray:
    """ff_i = exp(a·(i+1)^b), a = ln k / (d/2)^b: seed 000 eq. 7 (NTK-RoPE-mixed), a mixed
    base with digit m scaled by λ_1 λ_2 … λ_m = exp(a m^b), under the constraint
    a (d/2)^b = ln k (the last digit is interpolated by k)."""
    import numpy as np

    half = n_dims // 2
    a = math.log(float(factor)) / half ** float(exponent)
    return np.exp(a * (_pairs(n_dims) + 1.0) ** float(exponent))


# --------------------------------------------------------------------------- the registry

Table = Callable[[int, float, float], "np.ndarray"]


@dataclass(frozen=True)
class Method:
    """One context-extension method.

    ``name`` is the canonical name (the value of ``{arch}.rope.ntk.method`` for the NTK
    family); ``title``, ``source`` and ``description`` are its words; ``ntk_family`` says
    whether the patched library implements it as a divisor table chosen by the file's keys;
    ``stock`` whether stock llama.cpp provides it through its own parameters; ``params`` the
    parameters it takes (``"factor"`` k, ``"exponent"`` b); ``table`` its divisor-table
    function (``(n_dims, factor, exponent) -> ff``, None for yarn); ``stock_options`` the
    llama.cpp options that select a stock method.
    """

    name: str
    title: str
    source: str
    ntk_family: bool
    stock: bool
    params: tuple[str, ...]
    table: Table | None
    description: str
    stock_options: str | None = None

    @property
    def uses_exponent(self) -> bool:
        """Whether the method takes the exponent b (ntk-mixed only)."""
        return "exponent" in self.params

    @property
    def uses_factor(self) -> bool:
        """Whether the method takes a factor k (every method but none)."""
        return "factor" in self.params

    @property
    def supports_dynamic(self) -> bool:
        """Whether the library can run the method with dynamic k (the NTK family)."""
        return self.ntk_family

    @property
    def stored(self) -> bool:
        """Whether ``{arch}.rope.ntk.method`` can hold it (none and the NTK family)."""
        return self.ntk_family or self.name == "none"


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("none", "no scaling (extrapolation)", "RoPE, Su et al. 2021", False, True, (), table_none,
               "plain RoPE: positions beyond L are extrapolated"),
        Method("linear", "position interpolation (PI)", "Chen et al. 2023; seed 004", False, True, ("factor",),
               table_linear, "every frequency divided by k (stock llama.cpp's rope_freq_scale = 1/k)",
               "--rope-scaling linear --rope-scale K"),
        Method("yarn", "YaRN", "Peng et al. 2023; seed 004", False, True, ("factor",), None,
               "stock llama.cpp's YaRN with factor k", "--rope-scaling yarn --rope-scale K --yarn-orig-ctx L"),
        Method("ntk", "NTK-aware (NTK-RoPE-old)", "seed 001", True, False, ("factor",), table_ntk,
               "NTK-aware: base multiplied by k^(d/(d-2)), ff_i = k^(2i/(d-2))"),
        Method("ntk-fixed", "NTK-RoPE-fixed", "seed 000 eq. 5", True, False, ("factor",), table_ntk_fixed,
               "NTK-RoPE-fixed: ff_i = λ^(i+1), λ = k^(2/d)"),
        Method("ntk-mixed", "NTK-RoPE-mixed", "seed 000 eq. 7", True, False, ("factor", "exponent"), table_ntk_mixed,
               "NTK-RoPE-mixed: ff_i = exp(a·(i+1)^b), a = ln k / (d/2)^b"),
    )
}

ALIASES = {"mixed": "ntk-mixed", "fixed": "ntk-fixed", "ntk-aware": "ntk", "pi": "linear"}

#: methods the patched library reads from ``{arch}.rope.ntk.method`` (``none`` included)
FILE_METHODS = tuple(n for n, m in METHODS.items() if m.stored)
NTK_FAMILY = tuple(n for n, m in METHODS.items() if m.ntk_family)


def canonical(name: str) -> str:
    """Canonical method name for ``name`` or an alias (``mixed`` -> ``ntk-mixed``).

    Raises ``ValueError`` naming the known methods when ``name`` is unknown.
    """
    n = str(name).strip().lower()
    n = ALIASES.get(n, n)
    if n not in METHODS:
        known = ", ".join(list(METHODS) + sorted(ALIASES))
        raise ValueError(f"unknown method {name!r} (known: {known})")
    return n


def entry(name: str) -> Method:
    """The registry entry of ``name`` or an alias; ``ValueError`` when unknown."""
    return METHODS[canonical(name)]


def check_factor(factor: float) -> float:
    """Return ``factor`` as float; ``ValueError`` unless it is finite and >= 1."""
    k = float(factor)
    if not math.isfinite(k) or k < 1.0:
        raise ValueError(f"factor k must be finite and >= 1, got {factor!r}")
    return k


def check_exponent(exponent: float) -> float:
    """Return ``exponent`` as float; ``ValueError`` unless 0 < b <= 1 (seed 000 appendix)."""
    b = float(exponent)
    if not math.isfinite(b) or not (0.0 < b <= 1.0):
        raise ValueError(f"exponent b must be in (0, 1], got {exponent!r}")
    return b


def _number(name: str, x: object) -> None:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise ValueError(f"{name} must be a number, got {x!r}")


def check_dynamic_ratio(ratio: float) -> float:
    """Return ``ratio`` as float; ``ValueError`` unless r is finite and > 1 (the geometric step
    of the dynamic schedule, :data:`DEFAULT_DYNAMIC_RATIO` when absent)."""
    r = float(ratio)
    if not math.isfinite(r) or not r > 1.0:
        raise ValueError(f"dynamic ratio r must be finite and > 1, got {ratio!r}")
    return r


def _flag(name: str, x: object) -> None:
    if x is not None and not isinstance(x, bool):
        raise ValueError(f"{name} must be true, false or left out, got {x!r}")


@dataclass(frozen=True)
class Params:
    """A validated method choice: canonical ``method``; ``factor`` k (None: auto, or a
    method without k, or dynamic k); ``exponent`` b (ntk-mixed only, else None);
    ``exponent_default``: b was not given and is :data:`DEFAULT_EXPONENT`; ``dynamic`` and
    ``dynamic_ratio``: from :func:`validate`, as given (None: not given); from
    :func:`validate_stored`, ``dynamic`` is what the library runs (:func:`dynamic_effective`)
    and ``dynamic_ratio`` the file's r, or :data:`DEFAULT_DYNAMIC_RATIO` when the file runs
    dynamic k without one."""

    method: str
    factor: float | None
    exponent: float | None
    exponent_default: bool = False
    dynamic: bool | None = None
    dynamic_ratio: float | None = None


def _check_dynamic(m: Method, factor: object, dynamic: bool | None, ratio: object, *, stored: bool) -> None:
    """The rules of dynamic k shared by :func:`validate` and :func:`validate_stored` (the
    library's refusals): an NTK-family method, no factor k (a stored 0 is auto, allowed)."""
    if dynamic:
        if not m.supports_dynamic:
            family = ", ".join(n for n, e in METHODS.items() if e.supports_dynamic)
            raise ValueError(f"dynamic k needs an NTK-family method ({family}), not {m.name!r}")
        if factor is not None and not (stored and factor == AUTO_FACTOR):
            how = "the factor k must be absent or 0" if stored else "leave the factor k out"
            raise ValueError(f"dynamic k chooses k itself (1 within L, then by its schedule): {how} (got {factor!r})")
    if ratio is not None:
        _number("dynamic ratio r", ratio)
        if not stored and not dynamic_effective(m.name, factor, dynamic):
            raise ValueError("the dynamic ratio r applies to dynamic k only, and this choice runs static k "
                             "(a factor k, method none, or --static)")
        check_dynamic_ratio(ratio)
        r32 = to_float32(float(ratio))
        if not (math.isfinite(r32) and r32 > 1.0):
            raise ValueError(f"dynamic ratio r must be finite and > 1, got {ratio!r} ({r32!r} as float32)")


def validate(name: str, factor: float | None = None, exponent: float | None = None, *,
             dynamic: bool | None = None, dynamic_ratio: float | None = None,
             stored: bool = False, float32: bool = False) -> Params:
    """Check a method chosen by the user, with its factor k and exponent b (None: not given),
    and dynamic k (``dynamic`` True/False, None: not given) with its ratio r.

    The checks, in this order: the method is known (an alias is resolved); with ``stored``
    (``ggufrope set``) it is one ``{arch}.rope.ntk.method`` can hold; k and b are numbers,
    ``dynamic`` a bool or None; dynamic k goes only with an NTK-family method and without a
    factor k; r is given only with dynamic k, and is finite and > 1, also as float32; k is
    given only to a method that takes one (not ``none``), and is finite and >= 1, also as
    float32; b is given only to ``ntk-mixed``, and 0 < b <= 1, also as float32. b not given
    to ``ntk-mixed`` is :data:`DEFAULT_EXPONENT`. With ``float32`` the values returned are
    rounded to float32 (what a file stores).

    Returns :class:`Params`. Raises ``ValueError`` with a one-line message.
    """
    m = entry(name)
    if stored and not m.stored:
        how = m.stock_options or "its own options"
        raise ValueError(
            f"method {m.name!r} ({m.title}) is stock llama.cpp's own and is not stored by ggufrope; "
            f"use llama.cpp's {how} instead"
        )
    for what, x in (("factor k", factor), ("exponent b", exponent)):
        if x is not None:
            _number(what, x)
    _flag("dynamic", dynamic)
    _check_dynamic(m, factor, dynamic, dynamic_ratio, stored=False)
    r = None
    if dynamic_ratio is not None:
        r = to_float32(dynamic_ratio) if float32 else float(dynamic_ratio)
    k = b = None
    if factor is not None:
        if not m.uses_factor:
            raise ValueError(f"a factor k has no effect with method {m.name!r}")
        k = check_factor(factor)
        check_factor(to_float32(k))
        if float32:
            k = to_float32(k)
    default = False
    if m.uses_exponent:
        default = exponent is None
        b = check_exponent(DEFAULT_EXPONENT if default else exponent)
        check_exponent(to_float32(b))
        if float32:
            b = to_float32(b)
    elif exponent is not None:
        raise ValueError(f"the exponent b applies to ntk-mixed only, not to {m.name!r}")
    return Params(m.name, k, b, default, dynamic, r)


def dynamic_effective(name: str, factor: float | None, dynamic: bool | None) -> bool:
    """Whether the library runs dynamic k for method ``name`` (canonical) with the factor
    ``factor`` (None or :data:`AUTO_FACTOR`: auto) and ``{arch}.rope.ntk.dynamic`` =
    ``dynamic`` (None: the key absent). An explicit True or False decides. Absent, the
    library's default :data:`DYNAMIC_DEFAULT` applies where dynamic k can run at all: an
    NTK-family method whose k is automatic (an explicit k or method none stay static)."""
    if dynamic is not None:
        return bool(dynamic)
    return bool(DYNAMIC_DEFAULT) and METHODS[name].supports_dynamic and (factor is None or factor == AUTO_FACTOR)


def validate_stored(name: str, factor: float | None, exponent: float | None,
                    dynamic: bool | None = None, dynamic_ratio: float | None = None) -> Params:
    """Check the values of the ggufrope keys of a file, as the patched library does when it
    loads the model: ``name`` one of :data:`FILE_METHODS`; ``factor`` absent (None) or
    :data:`AUTO_FACTOR` (0) means auto (returned as None), else finite and >= 1;
    ``exponent`` in (0, 1] when present; ``ntk-mixed`` without it takes
    :data:`DEFAULT_EXPONENT` (``exponent_default`` True); ``dynamic`` (``{arch}.rope.ntk.dynamic``,
    None: absent) True only with an NTK-family method and a factor absent or 0;
    ``dynamic_ratio`` r finite and > 1 when present. A factor, an exponent or a ratio that
    the method does not use is checked and returned but has no effect (the library ignores
    it). The returned ``dynamic`` is what the library runs (:func:`dynamic_effective`), and
    ``dynamic_ratio`` the r it uses (the default when the file runs dynamic k without one).

    Raises ``ValueError`` with a one-line message.
    """
    if name not in FILE_METHODS:
        raise ValueError(f"method {name!r} is not one of {', '.join(FILE_METHODS)}")
    _flag("dynamic", dynamic)
    dyn = dynamic_effective(name, factor, dynamic)
    _check_dynamic(METHODS[name], factor, dyn, dynamic_ratio, stored=True)
    k = None
    if factor is not None and factor != AUTO_FACTOR:
        k = check_factor(factor)
    b = None if exponent is None else check_exponent(exponent)
    default = False
    if METHODS[name].uses_exponent and b is None:
        b, default = DEFAULT_EXPONENT, True
    r = float(dynamic_ratio) if dynamic_ratio is not None else (DEFAULT_DYNAMIC_RATIO if dyn else None)
    return Params(name, k, b, default, dyn, r)


def auto_factor(n_ctx: int, n_ctx_orig: int) -> float:
    """k = max(1, n_ctx / L): the factor Python chooses for the stock methods linear and yarn
    when none is given (llama.cpp's own ``rope_freq_scale = 1/k``), and the one the evaluation
    grid passes to every method at a context of ``n_ctx`` tokens. Never the NTK family's
    automatic k, which only the library resolves (from n_ctx_seq; see the module docstring).
    ``ValueError`` when L <= 0."""
    if n_ctx_orig <= 0:
        raise ValueError(f"n_ctx_orig must be > 0, got {n_ctx_orig}")
    return max(1.0, float(n_ctx) / float(n_ctx_orig))


def freq_factors(method: str, n_dims: int, factor: float, exponent: float = DEFAULT_EXPONENT) -> np.ndarray:
    """Per-pair divisors ff_i of ``method`` (the table in the module docstring), from its
    registry entry's table function.

    Shape ``(n_dims // 2,)``, float64, unitless, every entry >= 1 and non-decreasing in i.
    ``n_dims`` must be even and >= 4 (``ntk`` divides by d-2). Raises ``ValueError`` for
    ``yarn`` (not a divisor table), an unknown method, k < 1, or b outside (0, 1] (b is
    checked for ntk-mixed only, the one method that uses it).
    """
    m = entry(method)
    if n_dims < 4 or n_dims % 2:
        raise ValueError(f"n_dims must be even and >= 4, got {n_dims}")
    k = check_factor(factor)
    if m.table is None:
        raise ValueError(f"method {m.name!r} is not a divisor table (it is stock llama.cpp's own)")
    b = check_exponent(exponent) if m.uses_exponent else DEFAULT_EXPONENT
    return m.table(n_dims, k, b)


def _short(x: float) -> str:
    """The shortest ``%g`` text that reads back as the same float32 (``2``, ``1.5``, ``1.1``)."""
    x32 = to_float32(x)
    for digits in range(1, 10):
        t = f"{x32:.{digits}g}"
        if to_float32(float(t)) == x32:
            return t
    return repr(x32)  # pragma: no cover


def dynamic_words(ratio: float | None = None) -> str:
    """The words for dynamic k with ratio r (None: :data:`DEFAULT_DYNAMIC_RATIO`), e.g.
    ``k dynamic: 1 within L, then powers of 2 >= n/L, KV cache re-rotated``."""
    r = DEFAULT_DYNAMIC_RATIO if ratio is None else ratio
    return f"k dynamic: 1 within L, then powers of {_short(r)} >= n/L, KV cache re-rotated"


def summary(name: str, factor: str | None, exponent: str | None, logn: bool, *,
            dynamic: bool = False, dynamic_ratio: float | None = None) -> str:
    """The words for a method with its parameters, e.g. ``ntk-mixed, b = 0.625, k = 2, log-n on``:
    ``factor`` and ``exponent`` are the caller's text for k and b (None: left out; k is left
    out for a method without one, b for any method but ntk-mixed). With ``dynamic`` (a method
    that supports it) k is described by its schedule (:func:`dynamic_words`, ratio
    ``dynamic_ratio``), and ``factor``, when given, is the k in use now: ``ntk-mixed, b = 0.625,
    k dynamic: 1 within L, then powers of 2 >= n/L, KV cache re-rotated (k now 1), log-n off``."""
    m = METHODS[name]
    parts = [m.name]
    if m.uses_exponent and exponent is not None:
        parts.append(f"b = {exponent}")
    if dynamic and m.supports_dynamic:
        parts.append(dynamic_words(dynamic_ratio) + (f" (k now {factor})" if factor is not None else ""))
    elif m.uses_factor and factor is not None:
        parts.append(f"k = {factor}")
    parts.append("log-n on" if logn else "log-n off")
    return ", ".join(parts)


def inv_freq(n_dims: int, freq_base: float, factors: np.ndarray | None = None) -> np.ndarray:
    """θ_i / p = β^(-2i/d) / ff_i in radians per token, shape ``(n_dims // 2,)``, float64."""
    import numpy as np

    i = np.arange(n_dims // 2, dtype=np.float64)
    w = float(freq_base) ** (-2.0 * i / n_dims)
    if factors is not None:
        w = w / np.asarray(factors, dtype=np.float64)
    return w


def logn_scale(pos, n_ctx_orig: int) -> np.ndarray:
    """s(p) = max(1, ln(p+1) / ln L) for 0-based positions ``pos`` (seed 000, Table 2).

    Same shape as ``pos``, float64; 1 for every p < L, > 1 beyond L.
    """
    import numpy as np

    if n_ctx_orig <= 1:
        raise ValueError(f"log-n needs n_ctx_orig > 1, got {n_ctx_orig}")
    p = np.asarray(pos, dtype=np.float64)
    return np.maximum(1.0, np.log(p + 1.0) / np.log(float(n_ctx_orig)))


def rope_reference(
    x: np.ndarray,
    pos: np.ndarray,
    n_dims: int,
    freq_base: float,
    mode: str = "normal",
    factors: np.ndarray | None = None,
    logn_ctx: int = 0,
) -> np.ndarray:
    """Apply RoPE (and log-n, when ``logn_ctx`` = L > 0) to ``x`` in float64.

    ``x``: shape ``(n_tokens, n_heads, head_dim)`` (ggml's ``[head_dim, n_heads,
    n_tokens]`` read in C order); ``pos``: shape ``(n_tokens,)``, 0-based integer positions.
    ``mode``: ``"normal"`` rotates pairs (2i, 2i+1) (LLaMA, ``LLAMA_ROPE_TYPE_NORM``),
    ``"neox"`` pairs (i, i + n_dims/2) (Qwen2, GPT-NeoX). Channels >= ``n_dims`` are passed
    through. With log-n, every channel of the token at position p is then multiplied by
    s(p) (:func:`logn_scale`). Returns a new float64 array of the shape of ``x``.
    """
    import numpy as np

    x = np.asarray(x, dtype=np.float64)
    pos = np.asarray(pos, dtype=np.float64)
    if x.ndim != 3 or pos.shape != (x.shape[0],):
        raise ValueError(f"x must be (n_tokens, n_heads, head_dim) and pos (n_tokens,), got {x.shape}, {pos.shape}")
    if n_dims > x.shape[2] or n_dims % 2:
        raise ValueError(f"n_dims {n_dims} must be even and <= head_dim {x.shape[2]}")
    half = n_dims // 2
    theta = pos[:, None] * inv_freq(n_dims, freq_base, factors)[None, :]  # (n_tokens, half)
    cos, sin = np.cos(theta)[:, None, :], np.sin(theta)[:, None, :]
    y = x.copy()
    if mode == "normal":
        x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        y[..., 0:n_dims:2] = x0 * cos - x1 * sin
        y[..., 1:n_dims:2] = x0 * sin + x1 * cos
    elif mode == "neox":
        x0, x1 = x[..., :half], x[..., half:n_dims]
        y[..., :half] = x0 * cos - x1 * sin
        y[..., half:n_dims] = x0 * sin + x1 * cos
    else:
        raise ValueError(f"mode must be 'normal' or 'neox', got {mode!r}")
    if logn_ctx:
        y *= logn_scale(pos, logn_ctx)[:, None, None]
    return y
