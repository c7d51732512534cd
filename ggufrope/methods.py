"""The method registry: the rope math of every context-extension method, in float64.

This module is the one reference that the patched llama.cpp (C and CUDA) and the torch
reference forward are tested against. Nothing else in ggufrope re-derives a formula.

Notation (design notes §1): ``n_dims`` = d, the rotary dimensions (``n_rot``); pair
index i = 0 .. d/2-1 (the seeds' digit m = i+1); ``freq_base`` = β; position p (0-based);
``n_ctx_orig`` = L, the pretraining context; ``factor`` = k, the extension factor.

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
only: it is not a divisor table and has no entry in :func:`freq_factors`.

log-n attention scaling (seed 000, Table 2, the variant for models not trained with it):
every query at position p is multiplied after RoPE by s(p) = max(1, ln(p+1) / ln L).
Keys are never scaled.
"""

from __future__ import annotations

from dataclasses import dataclass

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

DEFAULT_EXPONENT = 0.625  #: seed 000's empirical b for NTK-RoPE-mixed


@dataclass(frozen=True)
class Method:
    """One context-extension method.

    ``name`` is the canonical name (the value of ``{arch}.rope.ntk.method`` for the NTK
    family); ``ntk_family`` says whether the patched library implements it as a divisor
    table; ``stock`` whether stock llama.cpp provides it through its own parameters.
    """

    name: str
    title: str
    source: str
    ntk_family: bool
    stock: bool
    uses_exponent: bool = False


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("none", "no scaling (extrapolation)", "RoPE, Su et al. 2021", False, True),
        Method("linear", "position interpolation (PI)", "Chen et al. 2023; seed 004", False, True),
        Method("yarn", "YaRN", "Peng et al. 2023; seed 004", False, True),
        Method("ntk", "NTK-aware (NTK-RoPE-old)", "seed 001", True, False),
        Method("ntk-fixed", "NTK-RoPE-fixed", "seed 000 eq. 5", True, False),
        Method("ntk-mixed", "NTK-RoPE-mixed", "seed 000 eq. 7", True, False, uses_exponent=True),
    )
}

ALIASES = {"mixed": "ntk-mixed", "fixed": "ntk-fixed", "ntk-aware": "ntk", "pi": "linear"}

#: methods the patched library reads from ``{arch}.rope.ntk.method`` (``none`` included)
FILE_METHODS = ("none", "ntk", "ntk-fixed", "ntk-mixed")
NTK_FAMILY = tuple(n for n, m in METHODS.items() if m.ntk_family)


def canonical(name: str) -> str:
    """Canonical method name for ``name`` or an alias (``mixed`` -> ``ntk-mixed``).

    Raises ``ValueError`` naming the known methods when ``name`` is unknown.
    """
    n = ALIASES.get(name.strip().lower(), name.strip().lower())
    if n not in METHODS:
        known = ", ".join(list(METHODS) + sorted(ALIASES))
        raise ValueError(f"unknown method {name!r} (known: {known})")
    return n


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


def auto_factor(n_ctx: int, n_ctx_orig: int) -> float:
    """k = max(1, n_ctx / L): the factor the patched library takes when the file has none."""
    if n_ctx_orig <= 0:
        raise ValueError(f"n_ctx_orig must be > 0, got {n_ctx_orig}")
    return max(1.0, float(n_ctx) / float(n_ctx_orig))


def freq_factors(method: str, n_dims: int, factor: float, exponent: float = DEFAULT_EXPONENT) -> np.ndarray:
    """Per-pair divisors ff_i of ``method`` (the table in the module docstring).

    Shape ``(n_dims // 2,)``, float64, unitless, every entry >= 1 and non-decreasing in i.
    ``n_dims`` must be even and >= 4 (``ntk`` divides by d-2). Raises ``ValueError`` for
    ``yarn`` (not a divisor table), an unknown method, k < 1, or b outside (0, 1].
    """
    import numpy as np

    m = canonical(method)
    if n_dims < 4 or n_dims % 2:
        raise ValueError(f"n_dims must be even and >= 4, got {n_dims}")
    k = check_factor(factor)
    half = n_dims // 2
    i = np.arange(half, dtype=np.float64)
    if m == "none":
        return np.ones(half)
    if m == "linear":
        return np.full(half, k)
    if m == "ntk":  # seed 001: base' = base * k^(d/(d-2))  <=>  ff_i = k^(2i/(d-2))
        return k ** (2.0 * i / (n_dims - 2))
    if m == "ntk-fixed":  # seed 000 eq. 5: theta_m = n / (lambda (beta lambda)^(m-1))
        return (k ** (2.0 / n_dims)) ** (i + 1.0)
    if m == "ntk-mixed":  # seed 000 eq. 7: lambda_1..lambda_m = exp(a m^b), a (d/2)^b = ln k
        b = check_exponent(exponent)
        a = np.log(k) / half**b
        return np.exp(a * (i + 1.0) ** b)
    raise ValueError(f"method {m!r} is not a divisor table (it is stock llama.cpp's own)")


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
