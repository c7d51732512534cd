"""Load a GGUF model through llama-cpp-python with a context-extension method chosen at load time.

The method is applied without rewriting the file:

- the NTK family (``ntk``, ``ntk-fixed``, ``ntk-mixed``) and log-n go through llama.cpp's kv
  overrides (``Llama(kv_overrides=...)``) of the keys in :mod:`ggufrope.keys`, read by the
  patched library when the model loads. A factor k left out is passed as
  :data:`ggufrope.methods.AUTO_FACTOR` (0): with ``dynamic=False`` the library resolves
  k = max(1, n_ctx_seq / L) when the context is created, and :func:`load` reads the k in use
  back from the context (``llama_ggufrope_factor``); Python never computes it. Without
  ``dynamic`` an NTK-family method without k runs dynamic k, the library's default
  (:data:`ggufrope.methods.DYNAMIC_DEFAULT`, :func:`ggufrope.methods.dynamic_effective`);
- ``linear`` (PI) and ``yarn`` are stock llama.cpp's own context parameters
  (``rope_scaling_type``, ``rope_freq_scale = 1/k``, ``yarn_orig_ctx``); Python chooses their
  k (max(1, n_ctx / L) when left out) and they combine with log-n;
- dynamic k (the NTK family only, ``{arch}.rope.ntk.dynamic``, issue 13): the factor override
  is :data:`~ggufrope.methods.AUTO_FACTOR` and the library chooses k as the KV cache fills
  (1 within L, then the smallest r^e with r^e·L >= n), re-rotating the cached keys;
  :func:`dynamic_in_use` and :func:`factor_in_use` read the mode and the k in use *now* back
  from the context (``llama_ggufrope_dynamic``, ``llama_ggufrope_factor``).

Every method other than ``none`` without log-n needs the patched library (``make build``);
:func:`load` refuses, with :class:`GGUFRopeError`, to apply one on a library that would ignore
it, and also refuses to run a file whose own ggufrope keys such a library would ignore.

Method names, k and b are validated by the registry (:func:`ggufrope.methods.validate`).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any

from . import keys as K
from . import methods as M
from .errors import GGUFRopeError
from .methods import DEFAULT_EXPONENT, METHODS

PATCH_VERSION = "0.1.0"  #: the patch series in patches/ that this package expects


def _lib() -> Any:
    try:
        import llama_cpp.llama_cpp as lc
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise GGUFRopeError(f"llama-cpp-python is not installed ({e}); run: make build") from None
    return lc._lib


_light: Any = None


def _library_without_import(what: str) -> Any:
    """libllama as llama-cpp-python loads it (``$LLAMA_CPP_LIB_PATH``, else the package's
    ``lib/``), opened with ctypes without importing the ``llama_cpp`` package (whose import
    costs about half a second); the loaded one when ``llama_cpp`` is already imported.
    ``what`` names the need in the :class:`GGUFRopeError` raised when there is none."""
    global _light
    mod = sys.modules.get("llama_cpp.llama_cpp")
    if mod is not None:
        return mod._lib
    if _light is not None:
        return _light
    base = os.environ.get("LLAMA_CPP_LIB_PATH")
    if not base:
        import importlib.util

        try:
            spec = importlib.util.find_spec("llama_cpp")
        except (ImportError, ValueError):
            spec = None
        locs = list(spec.submodule_search_locations or []) if spec is not None else []
        if not locs:
            raise GGUFRopeError(f"{what} needs the patched llama.cpp library, and llama-cpp-python is not installed; "
                                "build it with: make build")
        base = os.path.join(locs[0], "lib")
    names = {"win32": ("llama.dll", "libllama.dll"), "darwin": ("libllama.so", "libllama.dylib")}.get(
        sys.platform, ("libllama.so",))
    for n in names:
        p = os.path.join(base, n)
        if os.path.exists(p):
            try:
                _light = ctypes.CDLL(p, mode=getattr(ctypes, "RTLD_GLOBAL", 0))
            except OSError as e:
                raise GGUFRopeError(f"{what} needs the patched llama.cpp library, and {p} does not load ({e})") from None
            return _light
    raise GGUFRopeError(f"{what} needs the patched llama.cpp library, and there is no {names[0]} in {base}; "
                        "build it with: make build")


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


@functools.cache
def has_gpu() -> bool:
    """Whether the loaded llama.cpp has a GPU device (ggml's ``GGML_BACKEND_DEVICE_TYPE_GPU`` or
    ``_IGPU``, through ``ggml_backend_dev_by_type``). Unlike ``llama_supports_gpu_offload``, which
    is also true for a CPU build with the RPC backend (llama-cpp-python builds one), it is false
    on a CPU-only build. Asked once per process: the loaded backends do not change."""
    import llama_cpp

    llama_cpp.llama_supports_gpu_offload()  # loads the backends, as llama.cpp does before it asks
    f = _lib().ggml_backend_dev_by_type
    f.argtypes, f.restype = [ctypes.c_int], ctypes.c_void_p
    return any(f(t) for t in (1, 2))  # GGML_BACKEND_DEVICE_TYPE_GPU, GGML_BACKEND_DEVICE_TYPE_IGPU


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


def arch_supported(arch: str, what: str = "ggufrope set") -> bool:
    """Whether the patched library serves ``arch`` (a ``general.architecture`` name): asks its
    ``llama_ggufrope_arch_supported``, the one list of the architectures whose ropes the patch
    applies a method to. The library is opened without importing ``llama_cpp``
    (see :func:`_library_without_import`; a few milliseconds).

    Raises :class:`GGUFRopeError` (``what`` names the need) when no library is installed, when
    it is stock, or when its patch predates the function."""
    lib = _library_without_import(what)
    if not hasattr(lib, "llama_ggufrope_version"):
        raise GGUFRopeError(f"{what} asks the patched llama.cpp which architectures it serves, but the installed "
                            "llama-cpp-python library is stock; build the patched one with: make build")
    try:
        f = lib.llama_ggufrope_arch_supported
    except AttributeError:
        raise GGUFRopeError(f"{what} asks the patched llama.cpp which architectures it serves, but the installed "
                            "patch predates llama_ggufrope_arch_supported; rebuild it with: make build") from None
    f.argtypes = [ctypes.c_char_p]
    f.restype = ctypes.c_bool
    raw = arch.encode("utf-8")
    return b"\0" not in raw and bool(f(raw))


def factor_in_use(llm_or_ctx: Any) -> float | None:
    """The factor k that a context applies to its NTK-family table, as the patched library
    resolved it (``llama_ggufrope_factor``): an explicit k, or the automatic
    max(1, n_ctx_seq / L); with dynamic k the k in use now (1 after creation, growing as the
    KV cache fills beyond L). ``llm_or_ctx``: a ``llama_cpp.Llama`` or a ``llama_context *``.

    Returns None when the context applies no NTK-family method (none, linear, yarn). Raises
    :class:`GGUFRopeError` when the loaded library lacks the function (stock, or an older
    patch)."""
    k = float(_read_back(llm_or_ctx, "llama_ggufrope_factor", ctypes.c_float, "the factor k", "an older patch"))
    return None if k == 0.0 else k


def _read_back(llm_or_ctx: Any, symbol: str, restype: Any, what: str, older: str) -> Any:
    """Call the patched library's per-context getter ``symbol`` (``restype``) on a
    ``llama_cpp.Llama`` or a ``llama_context *``; :class:`GGUFRopeError` naming ``what`` when
    the loaded library lacks it (stock, or ``older``)."""
    try:
        f = getattr(_lib(), symbol)
    except AttributeError:
        raise GGUFRopeError(f"reading back {what} needs {symbol}, which the loaded llama.cpp "
                            f"lacks (stock, or {older}); rebuild it with: make build") from None
    f.argtypes = [ctypes.c_void_p]
    f.restype = restype
    return f(getattr(llm_or_ctx, "ctx", llm_or_ctx))


def has_dynamic() -> bool:
    """Whether the loaded library knows dynamic k (exports ``llama_ggufrope_dynamic``; a
    patch older than issue 13 does not, and would silently run a static k)."""
    try:
        return hasattr(_lib(), "llama_ggufrope_dynamic")
    except GGUFRopeError:
        return False


def require_dynamic(what: str) -> None:
    """Raise :class:`GGUFRopeError` unless the loaded library runs dynamic k; ``what`` names the need."""
    if not has_dynamic():
        raise GGUFRopeError(
            f"{what} needs dynamic k, which the loaded llama.cpp lacks (no llama_ggufrope_dynamic: stock, or a "
            "patch older than dynamic k; it would run a static k); rebuild it with: make build"
        )


def dynamic_in_use(llm_or_ctx: Any) -> bool:
    """Whether a context runs dynamic k (``llama_ggufrope_dynamic``): k = 1 while the KV cache
    holds positions < L, then growing as it fills (:func:`factor_in_use` reads the k of now).
    ``llm_or_ctx``: a ``llama_cpp.Llama`` or a ``llama_context *``. Raises
    :class:`GGUFRopeError` when the loaded library lacks the function (stock, or an older
    patch)."""
    return bool(_read_back(llm_or_ctx, "llama_ggufrope_dynamic", ctypes.c_bool, "dynamic k",
                           "a patch older than dynamic k"))


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
    """A method chosen at load time, validated by the registry
    (:func:`ggufrope.methods.validate`): ``method`` any method or alias (stored canonical);
    ``factor`` k, None for auto (the NTK family: dynamic k unless ``dynamic`` is False, then
    the library resolves one k; linear/yarn: max(1, n_ctx / L)); ``exponent`` b, ntk-mixed only (None there means 0.625, elsewhere
    b must be left out); ``logn``; ``dynamic`` True (dynamic k: NTK family, no factor), False
    (static) or None (not chosen: the library's default, :func:`ggufrope.methods.dynamic_effective`)
    and ``dynamic_ratio`` r (with dynamic only; None: 2). Raises :class:`GGUFRopeError` for an
    invalid choice."""

    method: str = "none"
    factor: float | None = None
    exponent: float | None = None
    logn: bool = False
    dynamic: bool | None = None
    dynamic_ratio: float | None = None
    #: b was left out and is the default 0.625 (set by the validation)
    exponent_default: bool = field(default=False, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        try:
            p = M.validate(self.method, self.factor, self.exponent, dynamic=self.dynamic,
                           dynamic_ratio=self.dynamic_ratio)
        except ValueError as e:
            raise GGUFRopeError(str(e)) from None
        object.__setattr__(self, "method", p.method)
        object.__setattr__(self, "factor", p.factor)
        object.__setattr__(self, "exponent", p.exponent)
        object.__setattr__(self, "exponent_default", p.exponent_default)
        object.__setattr__(self, "logn", bool(self.logn))
        object.__setattr__(self, "dynamic", p.dynamic)
        object.__setattr__(self, "dynamic_ratio", p.dynamic_ratio)

    @property
    def runs_dynamic(self) -> bool:
        """Whether the library runs this choice with dynamic k (:func:`ggufrope.methods.dynamic_effective`)."""
        return M.dynamic_effective(self.method, self.factor, self.dynamic)

    @property
    def label(self) -> str:
        """Short name, e.g. ``ntk-mixed(b=0.625)+logn``, ``ntk-mixed(b=0.625)+dyn+logn``."""
        s = self.method + (f"(b={self.exponent:g})" if self.method == "ntk-mixed" else "")
        if self.runs_dynamic:
            r = self.dynamic_ratio
            s += "+dyn" + (f"(r={r:g})" if r is not None and r != M.DEFAULT_DYNAMIC_RATIO else "")
        return s + ("+logn" if self.logn else "")

    def needs_patch(self) -> bool:
        return METHODS[self.method].ntk_family or self.logn


def llama_kwargs(choice: RopeChoice, arch: str, n_ctx: int, n_ctx_orig: int, *,
                 keep_stock_scaling: bool = False) -> dict[str, Any]:
    """The ``llama_cpp.Llama`` keyword arguments that apply ``choice`` to a model of ``arch``.

    ``kv_overrides`` set the method, log-n and dynamic keys always (so the file's own keys are
    replaced; dynamic is ``choice.runs_dynamic``, a bool); for the NTK family also the factor
    (``choice.factor``, or :data:`~ggufrope.methods.AUTO_FACTOR` 0 for auto, which the library
    resolves even when the file has an explicit k; always 0 with dynamic k) and the exponent
    (unused but valid for ntk/ntk-fixed); with dynamic k the ratio r (``choice.dynamic_ratio``,
    else :data:`~ggufrope.methods.DEFAULT_DYNAMIC_RATIO`).
    ``linear``/``yarn`` add stock parameters with ``rope_freq_scale = 1/k``, k =
    ``choice.factor`` or max(1, ``n_ctx`` / ``n_ctx_orig``); ``none`` switches a stock scaling
    of the file off (``rope_scaling_type`` 0) unless ``keep_stock_scaling`` (the file's own
    method none with log-n given at load time: log-n alone keeps the stock scaling, as it does
    when the file itself says so).
    """
    m = choice.method
    file_method = m if METHODS[m].ntk_family else "none"
    dyn = choice.runs_dynamic
    kv: dict[str, Any] = {
        K.key(K.KEY_METHOD, arch): file_method,
        K.key(K.KEY_LOGN, arch): bool(choice.logn),
        K.key(K.KEY_DYNAMIC, arch): dyn,
    }
    if file_method != "none":
        kv[K.key(K.KEY_FACTOR, arch)] = float(choice.factor) if choice.factor is not None and not dyn else M.AUTO_FACTOR
        kv[K.key(K.KEY_EXPONENT, arch)] = float(choice.exponent if choice.exponent is not None else DEFAULT_EXPONENT)
    if dyn:
        r = choice.dynamic_ratio
        kv[K.key(K.KEY_DYNAMIC_RATIO, arch)] = float(r if r is not None else M.DEFAULT_DYNAMIC_RATIO)
    out: dict[str, Any] = {"kv_overrides": kv}
    if m in ("linear", "yarn"):
        k = _stock_factor(choice, n_ctx, n_ctx_orig)
        if m == "linear":
            out.update(rope_scaling_type=1, rope_freq_scale=1.0 / k)  # LLAMA_ROPE_SCALING_TYPE_LINEAR
        else:
            out.update(rope_scaling_type=2, rope_freq_scale=1.0 / k, yarn_orig_ctx=int(n_ctx_orig))  # ..._YARN
    elif m == "none" and not keep_stock_scaling:
        out.update(rope_scaling_type=0)  # LLAMA_ROPE_SCALING_TYPE_NONE: ignore a stock scaling in the file
    return out


def _stock_factor(choice: RopeChoice, n_ctx: int, n_ctx_orig: int) -> float:
    """k of the stock methods linear/yarn: the one given, else the one Python chooses,
    max(1, n_ctx / L) (llama.cpp takes ``rope_freq_scale = 1/k``, not an automatic k)."""
    return choice.factor if choice.factor is not None else M.auto_factor(n_ctx, n_ctx_orig)


def _resolve(meta: dict[str, Any], method: str | None, factor: float | None, exponent: float | None,
             logn: bool | None, dynamic: bool | None = None, dynamic_ratio: float | None = None) -> RopeChoice | None:
    """The choice :func:`load` applies: None when the file's own keys decide (no method, no
    log-n and no dynamic given). Only log-n and/or dynamic given keep the file's method and b,
    and the file's log-n, dynamic k and ratio where not given; the file's k too (auto stays
    auto), except that ``dynamic`` True drops it (dynamic k chooses k itself). A method chosen
    at load time replaces every key of the file: log-n not given is off, dynamic not given
    the library's default. A factor or an exponent without a method is an error, and so is a
    ratio without dynamic k."""
    if method is None and (factor is not None or exponent is not None):
        raise GGUFRopeError("a factor k or an exponent b applies to a method chosen at load time: give the method "
                            "too (without one, the model's own metadata decides)")
    if method is None and logn is None and dynamic is None and dynamic_ratio is None:
        return None
    if method is None:
        m = METHODS[meta["method"] or "none"]
        b = meta["exponent"] if m.uses_exponent and not meta.get("exponent_default") else None
        dyn = bool(meta.get("dynamic")) if dynamic is None else dynamic  # the file's, unless given
        r = dynamic_ratio
        if r is None and dyn and meta.get("dynamic"):
            r = meta.get("dynamic_ratio")  # the file's ratio goes with the file's dynamic k
        k = meta["factor"] if m.uses_factor and not dyn else None
        ln = bool(meta["logn"]) if logn is None else bool(logn)
        return RopeChoice(m.name, k, b, ln, dyn, r)
    return RopeChoice(method, factor, exponent, bool(logn) if logn is not None else False, dynamic, dynamic_ratio)


@dataclass(frozen=True)
class RopeInUse:
    """What a context loaded by :func:`load` applies (``llm.ggufrope``).

    ``method`` canonical; ``factor`` the k in use (NTK family: read back from the library;
    linear/yarn: the k passed; None for none; with dynamic k the k when the context was
    created, 1: :func:`describe` and :func:`factor_in_use` read the k of now); ``auto`` whether
    k was left to the automatic rule (False with dynamic k, which has its own); ``exponent``
    b (ntk-mixed) and ``exponent_default`` (b was not given); ``logn``; ``source``
    ``"from the file"``, ``"chosen at load time"`` or ``"from the file, log-n chosen at load
    time"`` (likewise dynamic k); ``n_ctx`` as asked for (the
    context may be larger: llama.cpp rounds it up to a multiple of 256) and ``n_ctx_seq`` as
    the context has it (the context of one sequence, tokens); ``n_ctx_orig`` L; ``stock_scaling`` the file's
    ``{arch}.rope.scaling.type`` (yarn/linear) or None, and ``stock_scaling_effect`` what
    became of it: ``"kept"`` (no method, or method none from the file), ``"replaced"`` (an
    NTK-family method, or linear/yarn chosen at load time) or ``"off"`` (none chosen at load
    time: plain RoPE); ``library`` the patch version or None (stock); ``dynamic`` whether the
    context runs dynamic k (read back with ``llama_ggufrope_dynamic``) and ``dynamic_ratio``
    its ratio r (None when static)."""

    method: str
    factor: float | None
    auto: bool
    exponent: float | None
    exponent_default: bool
    logn: bool
    source: str
    n_ctx: int
    n_ctx_seq: int
    n_ctx_orig: int | None
    stock_scaling: str | None
    stock_scaling_effect: str | None
    library: str | None
    dynamic: bool = False
    dynamic_ratio: float | None = None

    def line(self) -> str:
        """One line, e.g. ``rope: ntk-mixed, b = 0.625, k = 4 (auto, resolved by llama.cpp at
        n_ctx_seq 256, L 64), log-n on (from the file); llama.cpp patched 0.1.0``; with dynamic
        k, ``k dynamic: 1 within L, then powers of 2 >= n/L, KV cache re-rotated (k now 1,
        L 64)`` in place of k."""
        m = METHODS[self.method]
        kt = None
        if m.uses_factor and self.factor is not None:
            kt = f"{self.factor:g}"
            if self.dynamic and m.supports_dynamic:
                kt += f", L {self.n_ctx_orig}"
            elif self.auto and m.ntk_family:
                kt += f" (auto, resolved by llama.cpp at n_ctx_seq {self.n_ctx_seq}, L {self.n_ctx_orig})"
            elif self.auto:
                kt += f" (auto: n_ctx {self.n_ctx} / L {self.n_ctx_orig})"
        bt = None if self.exponent is None else f"{self.exponent:g}" + (" (default)" if self.exponent_default else "")
        s = M.summary(self.method, kt, bt, self.logn, dynamic=self.dynamic,
                      dynamic_ratio=self.dynamic_ratio) + f" ({self.source})"
        if self.stock_scaling:
            s += {"kept": f"; the file's stock {self.stock_scaling} scaling stays in effect",
                  "replaced": f"; replaces the file's stock {self.stock_scaling} scaling",
                  "off": f"; the file's stock {self.stock_scaling} scaling is switched off"}[self.stock_scaling_effect]
        lib = f"patched {self.library}" if self.library else "stock"
        return f"rope: {s}; llama.cpp {lib}"


def _expected_dynamic(meta: dict[str, Any], choice: RopeChoice | None) -> tuple[bool, float | None]:
    """Whether the context should run dynamic k, and its ratio r (None when static)."""
    if choice is None:
        return bool(meta.get("dynamic")), meta.get("dynamic_ratio") if meta.get("dynamic") else None
    if not choice.runs_dynamic:
        return False, None
    return True, choice.dynamic_ratio if choice.dynamic_ratio is not None else M.DEFAULT_DYNAMIC_RATIO


def _in_use(llm: Any, meta: dict[str, Any], choice: RopeChoice | None, n_ctx: int, from_file: bool,
            chosen: str = "log-n") -> RopeInUse:
    import llama_cpp

    if choice is None:
        m = METHODS[meta["method"] or "none"]
        auto, b, b_default, ln, src = meta["factor"] is None, meta["exponent"], meta.get("exponent_default", False), \
            meta["logn"], "from the file"
    else:
        m = METHODS[choice.method]
        auto, b, b_default, ln = choice.factor is None, choice.exponent, choice.exponent_default, choice.logn
        src = f"from the file, {chosen} chosen at load time" if from_file else "chosen at load time"
    dyn, ratio = _expected_dynamic(meta, choice)
    if has_dynamic():
        got = dynamic_in_use(llm)
        if got != dyn:
            raise GGUFRopeError(f"llama.cpp runs {'dynamic' if got else 'static'} k although "
                                f"{'dynamic' if dyn else 'static'} k was asked for")
    elif dyn:  # load() refuses this before loading; a safety net
        require_dynamic(f"{m.name} with dynamic k")
    if not m.uses_exponent:
        b, b_default = None, False
    lib = library_version() if is_patched() else None
    k: float | None = None
    if m.ntk_family:
        k = factor_in_use(llm)
        if k is None:
            raise GGUFRopeError(f"llama.cpp applies no NTK-family table although {m.name} was asked for; "
                                "is the loaded library the patched one? (make build)")
    elif choice is not None and m.stock and m.uses_factor:
        k = _stock_factor(choice, n_ctx, meta["n_ctx_orig"])  # what llama_kwargs passed
    st = meta.get("stock_scaling_type")
    st = st if st in ("yarn", "linear") else None
    effect = None
    if st is not None:
        effect = "replaced" if m.name != "none" else "kept" if from_file else "off"
    ctx = llm.ctx
    return RopeInUse(m.name, k, auto and m.uses_factor and not dyn, b, b_default, bool(ln), src,
                     n_ctx, int(llama_cpp.llama_n_ctx_seq(ctx)), meta["n_ctx_orig"],
                     st, effect, lib, dyn, ratio)


def describe(llm: Any) -> str:
    """One line naming the method that ``llm`` (loaded by :func:`load`) applies, with the k in
    use (for the NTK family as the library resolved it), e.g. ``rope: ntk-mixed, b = 0.625,
    k = 2 (auto, resolved by llama.cpp at n_ctx_seq 16384, L 8192), log-n on (from the file);
    llama.cpp patched 0.1.0``. With dynamic k the k is the one in use now, read back from the
    library: ``k dynamic: 1 within L, then powers of 2 >= n/L, KV cache re-rotated (k now 4,
    L 8192)``. Raises :class:`GGUFRopeError` for a model not loaded by :func:`load`."""
    return in_use(llm).line()


def in_use(llm: Any) -> RopeInUse:
    """``llm.ggufrope`` (:class:`RopeInUse`), with the factor k of now when the context runs
    dynamic k (read back with :func:`factor_in_use`; ``llm.ggufrope.factor`` keeps the k it had
    when created). Raises :class:`GGUFRopeError` for a model not loaded by :func:`load`."""
    info = getattr(llm, "ggufrope", None)
    if not isinstance(info, RopeInUse):
        raise GGUFRopeError("describe() needs a model loaded with ggufrope.runtime.load")
    if info.dynamic:
        info = replace(info, factor=factor_in_use(llm))
    return info


def load(
    model_path: str | os.PathLike,
    *,
    method: str | None = None,
    factor: float | None = None,
    exponent: float | None = None,
    logn: bool | None = None,
    dynamic: bool | None = None,
    dynamic_ratio: float | None = None,
    n_ctx: int = 4096,
    n_gpu_layers: int = 0,
    verbose: bool = False,
    **kwargs: Any,
):
    """Load ``model_path`` with ``llama_cpp.Llama``, applying a method at load time.

    ``method``, ``logn``, ``dynamic`` and ``dynamic_ratio`` None: the file's own ggufrope keys
    decide (written by ``ggufrope set``). Otherwise the method (any of
    :data:`ggufrope.methods.METHODS` or an alias), factor k (None: auto, see
    :func:`llama_kwargs`), exponent b (ntk-mixed only; None: 0.625), log-n and dynamic k
    (``dynamic`` True: NTK family, no factor; False: static; None: the library's default,
    :func:`ggufrope.methods.dynamic_effective`) with its ratio r (None: 2) replace them,
    through kv overrides; the file is not rewritten. Only ``logn`` and/or ``dynamic`` given
    keep the file's method and b (and its k, unless ``dynamic`` is True: dynamic k chooses
    k itself). ``n_gpu_layers`` -1 offloads every layer.
    Other keyword arguments go to ``Llama`` (``flash_attn`` defaults to True, ``n_threads``
    to the machine's cores).

    Returns a ``llama_cpp.Llama`` whose attribute ``ggufrope`` (:class:`RopeInUse`) says what
    its context applies, the factor k in use included (:func:`describe` prints it; with dynamic
    k the one of now). Raises :class:`GGUFRopeError` for an unreadable model, an invalid
    choice, a method the loaded library would ignore (unpatched, or dynamic k on a library
    without it: :func:`require_dynamic`), a context whose dynamic mode read back is not the
    one asked for, or a model that llama.cpp refuses to load (its message is in llama.cpp's
    log; pass ``verbose=True``).
    """
    from .rope_metadata import read_rope_metadata

    meta = read_rope_metadata(model_path)
    arch, L = meta["architecture"], meta["n_ctx_orig"]
    choice = _resolve(meta, method, factor, exponent, logn, dynamic, dynamic_ratio)
    if choice is None:
        if meta["method"] not in (None, "none") or meta["logn"]:
            require_patched(f"{os.fspath(model_path)}: its ggufrope metadata ({meta['description']})")
        if meta["dynamic"]:
            require_dynamic(f"{os.fspath(model_path)}: its ggufrope metadata ({meta['description']})")
        params: dict[str, Any] = {}
    else:
        if L is None:
            raise GGUFRopeError(f"{os.fspath(model_path)}: no context length (L) in the file")
        if choice.needs_patch() or meta["ggufrope_keys"]:
            require_patched(f"method {choice.label}")
        if choice.runs_dynamic:
            require_dynamic(f"method {choice.label}")
        params = llama_kwargs(choice, arch, n_ctx, L, keep_stock_scaling=method is None)
        if not is_patched():
            params.pop("kv_overrides")
    import llama_cpp

    kwargs.setdefault("flash_attn", True)
    kwargs.setdefault("n_threads", os.cpu_count() or 1)
    try:
        llm = llama_cpp.Llama(
            model_path=os.fspath(model_path), n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, verbose=verbose, **params, **kwargs
        )
    except ValueError as e:
        what = choice.label if choice else meta["description"]
        raise GGUFRopeError(
            f"llama.cpp refused to load {os.fspath(model_path)} with {what} ({e}); run with --verbose for its log"
        ) from None
    chosen = " and ".join(w for w, x in (("log-n", logn), ("dynamic k", dynamic if dynamic is not None else dynamic_ratio))
                          if x is not None)
    llm.ggufrope = _in_use(llm, meta, choice, n_ctx, from_file=method is None, chosen=chosen)
    return llm
