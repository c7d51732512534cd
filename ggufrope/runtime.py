"""Load a GGUF model through llama-cpp-python with a context-extension method chosen at load time.

The method is applied without rewriting the file:

- the NTK family (``ntk``, ``ntk-fixed``, ``ntk-mixed``) and log-n go through llama.cpp's kv
  overrides (``Llama(kv_overrides=...)``) of the keys in :mod:`ggufrope.keys`, read by the
  patched library when the model loads;
- ``linear`` (PI) and ``yarn`` are stock llama.cpp's own context parameters
  (``rope_scaling_type``, ``rope_freq_scale``, ``yarn_orig_ctx``); they combine with log-n.

Every method other than ``none`` without log-n needs the patched library (``make build``);
:func:`load` refuses, with :class:`GGUFRopeError`, to apply one on a library that would ignore
it, and also refuses to run a file whose own ggufrope keys such a library would ignore.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any

from . import keys as K
from .errors import GGUFRopeError
from .methods import DEFAULT_EXPONENT, METHODS, auto_factor, canonical, check_exponent, check_factor

PATCH_VERSION = "0.1.0"  #: the patch series in patches/ that this package expects


def _lib() -> Any:
    try:
        import llama_cpp.llama_cpp as lc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise GGUFRopeError(f"llama-cpp-python is not installed ({e}); run: make build") from None
    return lc._lib


def library_version() -> str | None:
    """Version of the ggufrope patch in the loaded libllama, or None for an unpatched library.

    Reads the exported ``llama_ggufrope_version()``; raises :class:`GGUFRopeError` when
    llama-cpp-python is not importable.
    """
    lib = _lib()
    try:
        f = lib.llama_ggufrope_version
    except AttributeError:
        return None
    f.restype = ctypes.c_char_p
    f.argtypes = []
    return f().decode()


def is_patched() -> bool:
    """True when the loaded libllama carries the ggufrope patch."""
    try:
        return library_version() is not None
    except GGUFRopeError:
        return False


def require_patched(what: str) -> None:
    """Raise :class:`GGUFRopeError` unless the loaded libllama is patched; ``what`` names the need."""
    if not is_patched():
        raise GGUFRopeError(
            f"{what} needs the patched llama.cpp, but the loaded llama-cpp-python library is stock "
            "(it would silently run plain RoPE); build it with: make build"
        )


def library_freq_factors(method: str, n_dims: int, factor: float, exponent: float = DEFAULT_EXPONENT):
    """The per-pair divisors computed by the patched library (``llama_ggufrope_freq_factors``).

    Returns a float32 NumPy array of shape ``(n_dims // 2,)``. For tests that compare the C math
    with :func:`ggufrope.methods.freq_factors`. Raises :class:`GGUFRopeError` on an unpatched
    library or invalid input.
    """
    import numpy as np

    require_patched("llama_ggufrope_freq_factors")
    f = _lib().llama_ggufrope_freq_factors
    f.restype = ctypes.c_int32
    f.argtypes = [ctypes.c_char_p, ctypes.c_int32, ctypes.c_float, ctypes.c_float, ctypes.POINTER(ctypes.c_float)]
    out = np.zeros(n_dims // 2, dtype=np.float32)
    rc = f(method.encode(), n_dims, factor, exponent, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
    if rc != 0:
        raise GGUFRopeError(f"llama_ggufrope_freq_factors rejected method={method!r} n_dims={n_dims} k={factor} b={exponent}")
    return out


@dataclass(frozen=True)
class RopeChoice:
    """A method chosen at load time. ``factor`` None means k = max(1, n_ctx / L)."""

    method: str = "none"
    factor: float | None = None
    exponent: float = DEFAULT_EXPONENT
    logn: bool = False

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "method", canonical(self.method))
            if self.factor is not None:
                object.__setattr__(self, "factor", check_factor(self.factor))
            object.__setattr__(self, "exponent", check_exponent(self.exponent))
        except ValueError as e:
            raise GGUFRopeError(str(e)) from None

    @property
    def label(self) -> str:
        """Short name, e.g. ``ntk-mixed(b=0.625)+logn``."""
        s = self.method + (f"(b={self.exponent:g})" if self.method == "ntk-mixed" else "")
        return s + ("+logn" if self.logn else "")

    def needs_patch(self) -> bool:
        return METHODS[self.method].ntk_family or self.logn


def llama_kwargs(choice: RopeChoice, arch: str, n_ctx: int, n_ctx_orig: int) -> dict[str, Any]:
    """The ``llama_cpp.Llama`` keyword arguments that apply ``choice`` to a model of ``arch``.

    ``kv_overrides`` always set every ggufrope key (so the file's own keys, if any, are
    replaced, and an explicit k is used when the file had one); ``linear``/``yarn`` add stock
    parameters with ``rope_freq_scale = 1/k``. ``n_ctx`` and ``n_ctx_orig`` (L) give the
    automatic k = max(1, n_ctx / L) when ``choice.factor`` is None.
    """
    k = choice.factor if choice.factor is not None else auto_factor(n_ctx, n_ctx_orig)
    m = choice.method
    file_method = m if METHODS[m].ntk_family else "none"
    kv: dict[str, Any] = {
        K.key(K.KEY_METHOD, arch): file_method,
        K.key(K.KEY_LOGN, arch): bool(choice.logn),
    }
    if file_method != "none":
        kv[K.key(K.KEY_FACTOR, arch)] = float(k)
        kv[K.key(K.KEY_EXPONENT, arch)] = float(choice.exponent)
    out: dict[str, Any] = {"kv_overrides": kv}
    if m == "linear":
        out.update(rope_scaling_type=1, rope_freq_scale=1.0 / k)  # LLAMA_ROPE_SCALING_TYPE_LINEAR
    elif m == "yarn":
        out.update(rope_scaling_type=2, rope_freq_scale=1.0 / k, yarn_orig_ctx=int(n_ctx_orig))  # ..._YARN
    elif m == "none":
        out.update(rope_scaling_type=0)  # LLAMA_ROPE_SCALING_TYPE_NONE: ignore a stock scaling in the file
    return out


def _resolve(meta: dict[str, Any], method: str | None, factor: float | None, exponent: float,
             logn: bool | None) -> RopeChoice | None:
    """The choice :func:`load` applies: None when the file's own keys decide (no method and no
    log-n given); only log-n given keeps the file's method, k and b."""
    if method is None and logn is None:
        return None
    if method is None:
        return RopeChoice(meta["method"] or "none", meta["factor"], meta["exponent"] or DEFAULT_EXPONENT, bool(logn))
    return RopeChoice(method, factor, exponent, bool(logn) if logn is not None else False)


def describe(
    model_path: str | os.PathLike,
    *,
    method: str | None = None,
    factor: float | None = None,
    exponent: float = DEFAULT_EXPONENT,
    logn: bool | None = None,
    n_ctx: int = 4096,
) -> str:
    """One line naming the method :func:`load` applies with these arguments, k resolved,
    e.g. ``rope: ntk-mixed, b = 0.625, k = 2 (auto: n_ctx 16384 / L 8192), log-n on (from the file)``."""
    from .gguf_file import read_rope_metadata

    meta = read_rope_metadata(model_path)
    L = meta["n_ctx_orig"]
    choice = _resolve(meta, method, factor, exponent, logn)
    if choice is None:
        m, k, b, ln, src = meta["method"] or "none", meta["factor"], meta["exponent"] or DEFAULT_EXPONENT, meta["logn"], "from the file"
    else:
        m, k, b, ln, src = choice.method, choice.factor, choice.exponent, choice.logn, "chosen at load time"
    parts = [m]
    if m == "ntk-mixed":
        parts.append(f"b = {b:g}")
    if m != "none":
        parts.append(f"k = {k:g}" if k is not None else f"k = {auto_factor(n_ctx, L):g} (auto: n_ctx {n_ctx} / L {L})")
    parts.append(f"log-n {'on' if ln else 'off'}")
    lib = library_version() if is_patched() else None
    return f"rope: {', '.join(parts)} ({src}); llama.cpp {'patched ' + lib if lib else 'stock'}"


def load(
    model_path: str | os.PathLike,
    *,
    method: str | None = None,
    factor: float | None = None,
    exponent: float = DEFAULT_EXPONENT,
    logn: bool | None = None,
    n_ctx: int = 4096,
    n_gpu_layers: int = 0,
    verbose: bool = False,
    **kwargs: Any,
):
    """Load ``model_path`` with ``llama_cpp.Llama``, applying a method at load time.

    ``method`` None and ``logn`` None: the file's own ggufrope keys decide (written by
    ``ggufrope set``). Otherwise the method (any of :data:`ggufrope.methods.METHODS` or an
    alias), factor k (None: max(1, n_ctx / L)), exponent b and log-n replace them, through kv
    overrides; the file is not rewritten. ``n_gpu_layers`` -1 offloads every layer.
    Other keyword arguments go to ``Llama`` (``flash_attn`` defaults to True, ``n_threads``
    to the machine's cores).

    Returns a ``llama_cpp.Llama``. Raises :class:`GGUFRopeError` for an unreadable model, an
    invalid choice, a method the loaded library would ignore (unpatched), or a model that
    llama.cpp refuses to load (its message is in llama.cpp's log; pass ``verbose=True``).
    """
    from .gguf_file import read_rope_metadata

    meta = read_rope_metadata(model_path)
    arch, L = meta["architecture"], meta["n_ctx_orig"]
    choice = _resolve(meta, method, factor, exponent, logn)
    if choice is None:
        if meta["method"] not in (None, "none") or meta["logn"]:
            require_patched(f"{os.fspath(model_path)}: its ggufrope metadata ({meta['description']})")
        params: dict[str, Any] = {}
    else:
        if L is None:
            raise GGUFRopeError(f"{os.fspath(model_path)}: no context length (L) in the file")
        if choice.needs_patch() or meta["ggufrope_keys"]:
            require_patched(f"method {choice.label}")
        params = llama_kwargs(choice, arch, n_ctx, L)
        if not is_patched():
            params.pop("kv_overrides")
    import llama_cpp

    kwargs.setdefault("flash_attn", True)
    kwargs.setdefault("n_threads", os.cpu_count() or 1)
    try:
        return llama_cpp.Llama(
            model_path=os.fspath(model_path), n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, verbose=verbose, **params, **kwargs
        )
    except ValueError as e:
        what = choice.label if choice else meta["description"]
        raise GGUFRopeError(
            f"llama.cpp refused to load {os.fspath(model_path)} with {what} ({e}); run with --verbose for its log"
        ) from None
