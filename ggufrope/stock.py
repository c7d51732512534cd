"""The stock-readable export (``ggufrope set MODEL --method M -k K --stock -o OUT``).

Stock engines (ollama, LM Studio, an unpatched llama.cpp) ignore the ggufrope keys
(``{arch}.rope.ntk.*``, ``{arch}.attention.logn_scaling``): beyond L they run plain RoPE. What
they do read, and what this export writes instead, for one FIXED factor k:

* **``rope_freqs.weight``**, an F32 tensor of n_rot/2 per-pair divisors ff_i of the rope
  frequencies (θ_i = p·β^(-2i/d) / ff_i; Llama 3.x files carry their own). Stock llama.cpp loads
  it with shape ``{n_rot/2}`` for every layer and passes it, through
  ``llama_model::get_rope_factors``, as the ``freq_factors`` of ``ggml_rope_ext`` to the Q and K
  ropes of every layer, for the architectures of :data:`ROPE_FREQS_ARCHS` (checked in the
  vendored tree, ``src/models/<arch>.cpp``: no sliding-window layers, no other ropes; not, for
  example, ``falcon-h1``, which loads the tensor but passes no factors, or ``exaone4`` and
  ``llama4``, whose sliding-window / chunked layers would get it too). The values are what the
  patched library feeds the same op (patch 0002, ``rope_ntk_set_tables``): the method's table
  from the registry (:func:`ggufrope.methods.freq_factors`, float64, rounded to float32), times
  the file's own ``rope_freqs`` in float32 when it has one (that tensor's data is then
  replaced; otherwise the tensor is appended). Any NTK-family method.
* **``{arch}.rope.freq_base``**, for the other architectures that the patched library serves:
  NTK-aware (``ntk``) only, as the base β·k^(d/(d-2)) (:func:`ggufrope.methods.ntk_freq_base`,
  the registry's table ``k^(2i/(d-2))`` as a base). The patched library scales the global
  (non sliding-window) layers only; stock llama.cpp gives sliding-window layers of several
  architectures the same base as the global ones, so a file of an architecture with
  sliding-window layers is exported only for :data:`SWA_OWN_BASE_ARCHS` (``gemma3``: its
  sliding-window layers take ``{arch}.rope.freq_base_swa``, or 10000 without the key, never
  ``{arch}.rope.freq_base``). ``ntk-fixed``/``ntk-mixed`` are not a base change and are refused
  there (one line naming the architectures that take them, suggesting ``--method ntk``).

Always: ``{arch}.context_length`` = round(k·L) and
``{arch}.rope.scaling.original_context_length`` = L (L: the file's original_context_length,
else its context_length); every ggufrope key of an earlier ``set`` is removed; the key
:data:`KEY_STOCK_EXPORT` (STRING, ignored by every engine) says what was exported, so that a
second export or a ``ggufrope set`` of the export, which would scale twice, is refused
(:func:`refuse_exported`).

**Lost** in a stock file: log-n (no stock engine scales queries by position) and dynamic k (the
one k applies at every position, within L too). ``--logn``, ``--dynamic`` and
``--dynamic-ratio`` with ``--stock`` are refused, as is a missing k (an automatic or dynamic k
cannot be written in a stock file); the command says what is lost otherwise. A file with stock
rope scaling (``{arch}.rope.scaling.type`` linear, yarn, longrope) is refused: the stock engine
would stack it on the exported table, where the patched library replaces it.

The file is written by the rewrite path of :mod:`ggufrope.gguf_writer` (new header, the data
section copied as one block, the new tensor data written after it or over it, atomically;
the source is never modified).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from . import keys as K
from . import methods as M
from .errors import GGUFRopeError
from .gguf_constants import GGMLQuantizationType, GGUFValueType

#: architectures whose stock llama.cpp graph applies ``rope_freqs.weight`` (shape n_rot/2, every
#: layer) as the freq_factors of the Q and K ropes of every layer, and has no sliding-window
#: layers (vendored llama.cpp of llama-cpp-python 0.3.36, ``src/models/<arch>.cpp``)
ROPE_FREQS_ARCHS = ("llama", "arcee", "apertus", "deci", "exaone", "granite", "mistral3")
#: architectures with sliding-window layers whose stock rope base never follows
#: ``{arch}.rope.freq_base`` (so the NTK-aware base change reaches the global layers only, as
#: the patched library's table does)
SWA_OWN_BASE_ARCHS = ("gemma3",)
#: architectures of the vendored tree that can have sliding-window (or chunked) layers
#: (``swa_type`` set in ``src/models/<arch>.cpp``)
SWA_ARCHS = (
    "afmoe", "cohere2", "cohere2moe", "deepseek4", "dflash", "dots3note", "exaone-moe", "exaone4",
    "gemma-embedding", "gemma2", "gemma3", "gemma3n", "gemma4-assistant", "gemma4", "granite_swa", "laguna",
    "lfm2", "llama4", "maple", "mellum", "mimo2", "modern-bert", "muse-glimmer", "olmo2", "gpt-oss", "phi3",
    "plamo3", "smallthinker", "spark2_5", "step35",
)
ROPE_FREQS = "rope_freqs.weight"
#: written to every export: what it holds, in words (no engine reads it; ggufrope refuses to
#: export or ``set`` such a file again)
KEY_STOCK_EXPORT = "ggufrope.stock_export"
#: what a stock file cannot carry
LOST = "log-n, dynamic k"


@dataclass(frozen=True)
class StockExport:
    """What :func:`export_stock` wrote: ``route`` (``"rope_freqs"`` or ``"freq_base"``),
    the method, k, b (ntk-mixed only), L, the new context length, and ``what`` in words."""

    route: str
    method: str
    factor: float
    exponent: float | None
    n_ctx_orig: int
    context_length: int
    what: str


def _fail(h: Any, msg: str) -> GGUFRopeError:
    from .errors import show

    return GGUFRopeError(f"{show(h.path)}: {msg}")


def check_request(method: str, factor: float | None, exponent: float | None = None, *, logn: bool = False,
                  dynamic: bool | None = None, dynamic_ratio: float | None = None) -> M.Params:
    """The checks of ``--stock`` that need no file: a fixed k, no log-n, no dynamic k, an
    NTK-family method (validated by the registry, rounded to float32 as a file stores it).
    Returns the :class:`ggufrope.methods.Params`; raises :class:`GGUFRopeError` (one line)."""
    try:
        entry = M.entry(method)
    except ValueError as e:
        raise GGUFRopeError(str(e)) from None
    if not entry.ntk_family:
        raise GGUFRopeError(f"--stock exports an NTK-family method ({', '.join(M.NTK_FAMILY)}), not {entry.name!r}")
    if logn:
        raise GGUFRopeError("--stock cannot carry log-n (no stock engine scales queries by position): leave out --logn")
    if dynamic or dynamic_ratio is not None:
        raise GGUFRopeError("--stock cannot carry dynamic k (a stock file has one fixed k): give -k K without --dynamic")
    if factor is None:
        raise GGUFRopeError("--stock needs a fixed factor -k K (an automatic or dynamic k cannot be written in a stock "
                            "file); e.g. -k 2 for twice the trained context")
    try:
        p = M.validate(method, factor, exponent, stored=True, float32=True)
    except ValueError as e:
        raise GGUFRopeError(str(e)) from None
    return p


def stock_export_marker(path: str | os.PathLike) -> str | None:
    """The value of :data:`KEY_STOCK_EXPORT` in the file at ``path`` (None: not an export)."""
    from .gguf_reader import read_header

    v = read_header(path).value(KEY_STOCK_EXPORT)
    return v if isinstance(v, str) else None


def refuse_exported(path: str | os.PathLike, what: str) -> None:
    """Raise :class:`GGUFRopeError` when ``path`` is a stock export (``what``: the refused
    action, e.g. ``"ggufrope set"``): its rope already holds a method, a second one would scale
    twice. A file that cannot be read passes: the caller's own reading reports it, in its order
    of checks."""
    from .errors import show

    try:
        m = stock_export_marker(path)
    except GGUFRopeError:
        return
    if m is not None:
        raise GGUFRopeError(f"{show(path)} is a stock export ({m}); {what} would scale its rope twice: "
                            "start from the original file")


def _read_tensor(h: Any, t: Any) -> bytes:
    with open(h.path, "rb", buffering=0) as f:
        data = os.pread(f.fileno(), t.nbytes, h.data_offset + t.offset)
    if len(data) != t.nbytes:
        raise _fail(h, f"tensor {t.name!r} is truncated")
    return data


def export_stock(src: str | os.PathLike, dst: str | os.PathLike, *, method: str, factor: float | None,
                 exponent: float | None = None, logn: bool = False, dynamic: bool | None = None,
                 dynamic_ratio: float | None = None) -> tuple[Any, StockExport]:
    """Write the stock-readable export of ``src`` to ``dst`` (a new file, never ``src``; see
    the module docstring). Returns ``(WriteResult, StockExport)``; raises
    :class:`GGUFRopeError` with a one-line message for everything refused."""
    import numpy as np

    from . import rope_metadata as RM
    from .atomic_write import same_file
    from .gguf_reader import f32_repr
    from .gguf_writer import TensorWrite, rewrite

    p = check_request(method, factor, exponent, logn=logn, dynamic=dynamic, dynamic_ratio=dynamic_ratio)
    m, k, b = p.method, float(p.factor), p.exponent
    if dst is None or (os.path.exists(dst) and same_file(os.fspath(src), os.fspath(dst))):
        raise GGUFRopeError("--stock writes a new file: give -o OUT (the source is never modified)")
    info: dict[str, Any] = {}

    def build(h: Any) -> tuple[dict, list, list]:
        arch = RM._architecture(h)
        RM._check_types(h, arch, ggufrope_keys=False)
        marker = h.value(KEY_STOCK_EXPORT)
        if isinstance(marker, str):
            raise _fail(h, f"already a stock export ({marker}); a second export would scale its rope twice: "
                           "start from the original file")
        stype = h.value(K.key(K.KEY_SCALING_TYPE, arch))
        if isinstance(stype, str) and stype not in ("", "none"):
            raise _fail(h, f"the file has stock rope scaling {K.key(K.KEY_SCALING_TYPE, arch)} = {stype!r}, which a "
                           "stock engine would stack on the export (the patched library replaces it); not exportable")
        L, _ = RM._n_ctx_orig(h, arch)
        if L is None:
            raise _fail(h, f"no {K.key(K.KEY_CONTEXT_LENGTH, arch)}: L is unknown")
        d, _ = RM._rope_dims(h, arch)
        if d is None or d < 4 or d % 2:
            raise _fail(h, f"cannot tell the rope dimensions (n_rot = {d}) of architecture {arch!r}")
        n_ctx = int(math.floor(k * L + 0.5))
        if n_ctx >= 1 << 32:
            raise _fail(h, f"k * L = {k * L:g} does not fit {K.key(K.KEY_CONTEXT_LENGTH, arch)} (UINT32)")
        values: dict[str, tuple[GGUFValueType, Any]] = {
            K.key(K.KEY_CONTEXT_LENGTH, arch): (GGUFValueType.UINT32, n_ctx),
            K.key(K.KEY_ORIG_CTX, arch): (GGUFValueType.UINT32, L),
        }
        words = M.summary(m, f32_repr(k), None if b is None else f32_repr(b), False).rsplit(", log-n", 1)[0]
        writes = []
        if arch in ROPE_FREQS_ARCHS:
            table = M.freq_factors(m, d, k, b if b is not None else M.DEFAULT_EXPONENT).astype(np.float32)
            dt = np.dtype(np.float32).newbyteorder(h.endian)
            own = next((t for t in h.tensors if t.name == ROPE_FREQS), None)
            if own is not None:
                if own.ggml_type != GGMLQuantizationType.F32 or own.shape != (d // 2,):
                    raise _fail(h, f"its {ROPE_FREQS} has ggml type {own.ggml_type} and shape {own.shape}, "
                                   f"not F32 ({d // 2},)")
                mf = np.frombuffer(_read_tensor(h, own), dtype=dt).astype(np.float32)
                table = table * mf  # float32 products, as the patched library composes them
            writes.append(TensorWrite(ROPE_FREQS, (d // 2,), int(GGMLQuantizationType.F32), table.astype(dt).tobytes()))
            route = "rope_freqs"
            how = "composed with the file's own, replaced" if own is not None else "appended"
            what = f"{words} in {ROPE_FREQS} ({how})"
        else:
            if m != "ntk":
                raise _fail(h, f"--stock cannot export method {m!r} for architecture {arch!r}: stock llama.cpp applies a "
                               f"{ROPE_FREQS} table only for {', '.join(ROPE_FREQS_ARCHS)}; use --method ntk (NTK-aware, "
                               f"exported through {K.key(K.KEY_FREQ_BASE, arch)})")
            from .runtime import arch_supported

            if not arch_supported(arch, "ggufrope set --stock"):
                raise _fail(h, f"architecture {arch!r} is not served by the patched llama.cpp (no RoPE, or ropes other "
                               "than the per-layer Q/K NORMAL/NEOX ropes): its NTK-aware scaling is not defined here")
            if arch in SWA_ARCHS and arch not in SWA_OWN_BASE_ARCHS:
                raise _fail(h, f"architecture {arch!r} can have sliding-window layers whose stock rope base may follow "
                               f"{K.key(K.KEY_FREQ_BASE, arch)} (the patched library scales global layers only); --stock "
                               f"exports NTK-aware through the base only for {', '.join(SWA_OWN_BASE_ARCHS)} of those")
            base = h.value(K.key(K.KEY_FREQ_BASE, arch))
            if not isinstance(base, float) or not base > 0:
                raise _fail(h, f"no {K.key(K.KEY_FREQ_BASE, arch)} to scale")
            new_base = M.ntk_freq_base(base, d, k)
            if not math.isfinite(M.to_float32(new_base)):
                raise _fail(h, f"the NTK-aware base {new_base:g} does not fit FLOAT32")
            values[K.key(K.KEY_FREQ_BASE, arch)] = (GGUFValueType.FLOAT32, new_base)
            route = "freq_base"
            what = f"{words} as {K.key(K.KEY_FREQ_BASE, arch)} {f32_repr(base)} -> {f32_repr(new_base)}"
        what += f", {K.key(K.KEY_CONTEXT_LENGTH, arch)} {n_ctx} (L = {L})"
        values[KEY_STOCK_EXPORT] = (GGUFValueType.STRING, what)
        info["export"] = StockExport(route, m, k, b, L, n_ctx, what)
        return values, K.ggufrope_keys(arch), writes

    r = rewrite(src, dst, build, reserve=True)
    return r, info["export"]
