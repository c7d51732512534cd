"""What the rope keys of a GGUF file mean: reading, checking and describing them, and writing and removing ggufrope's own (``ggufrope show``, ``set`` and ``reset``).

The keys are read from a header parsed by :func:`ggufrope.gguf_reader.read_header`, and
written by a rewrite of :mod:`ggufrope.gguf_writer`. A file written by
:func:`write_rope_metadata` (``ggufrope set``) has its ggufrope keys first, right after the
24-byte fixed header, then the reserved key
(:data:`ggufrope.gguf_writer.KEY_RESERVED`), then the source's other records in their
order (the layout, and why, is described in :mod:`ggufrope.gguf_writer`).
:func:`reset_rope_metadata` removes the reserved key with the other ggufrope keys and puts
nothing in their place, so ``set`` followed by ``reset`` gives back the original file byte
for byte (provided the original had no ggufrope keys).

**Errors.** Keys of the wrong type, invalid ggufrope values and unserved architectures are
a :class:`~ggufrope.errors.GGUFRopeError` with a one-line message.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Mapping

from .gguf_constants import GGUFValueType

from . import keys as K
from .errors import GGUFRopeError, show
from . import methods as M
from .methods import METHODS
from .gguf_reader import ArrayValue, Header, f32_repr, read_header
from .gguf_writer import KEY_RESERVED, WriteResult, rewrite

__all__ = [
    "has_rope",
    "read_rope_metadata",
    "describe_method",
    "write_rope_metadata",
    "reset_rope_metadata",
]


# --------------------------------------------------------------------------- rope metadata

#: Types of the keys ggufrope reads, as llama.cpp's loader requires them
#: (``{arch}.attention.head_count`` may also be a per-layer array).
_READ_TYPES: dict[str, tuple[GGUFValueType, ...]] = {
    K.KEY_CONTEXT_LENGTH: (GGUFValueType.UINT32,),
    K.KEY_ORIG_CTX: (GGUFValueType.UINT32,),
    K.KEY_FREQ_BASE: (GGUFValueType.FLOAT32,),
    K.KEY_ROPE_DIMS: (GGUFValueType.UINT32,),
    K.KEY_SCALING_TYPE: (GGUFValueType.STRING,),
    K.KEY_SCALING_FACTOR: (GGUFValueType.FLOAT32,),
    "{arch}.attention.key_length": (GGUFValueType.UINT32,),
    "{arch}.embedding_length": (GGUFValueType.UINT32,),
    "{arch}.attention.head_count": (GGUFValueType.UINT32, GGUFValueType.ARRAY),
}


def _check_types(h: Header, arch: str, *, ggufrope_keys: bool) -> None:
    table = dict(_READ_TYPES)
    if ggufrope_keys:
        table.update({t: (vt,) for t, vt in K.KEY_TYPES.items()})
    for tmpl, types in table.items():
        name = K.key(tmpl, arch)
        kv = h.get(name)
        if kv is not None and kv.vtype not in types:
            want = " or ".join(t.name for t in types)
            raise GGUFRopeError(f"{show(h.path)}: key {name!r} has type {kv.vtype.name}, expected {want}")


def _architecture(h: Header) -> str:
    kv = h.get("general.architecture")
    if kv is None:
        raise GGUFRopeError(f"{show(h.path)}: no general.architecture key")
    if kv.vtype != GGUFValueType.STRING:
        raise GGUFRopeError(f"{show(h.path)}: key 'general.architecture' has type {kv.vtype.name}, expected STRING")
    if not kv.value:
        raise GGUFRopeError(f"{show(h.path)}: general.architecture is empty")
    return kv.value


def has_rope(h: Header, arch: str) -> bool:
    """Whether the file has rope keys (``{arch}.rope.freq_base`` or
    ``{arch}.rope.dimension_count``), as ``show`` reports it. Not the rule of ``set``: converters
    may omit both for architectures that use RoPE, so ``set`` asks the patched library which
    architectures it serves (:func:`_require_served`)."""
    return K.key(K.KEY_FREQ_BASE, arch) in h or K.key(K.KEY_ROPE_DIMS, arch) in h


def _require_served(h: Header, arch: str) -> None:
    """Refuse ``arch`` unless the patched library applies a method to it
    (``llama_ggufrope_arch_supported``, :func:`ggufrope.runtime.arch_supported`): the one list
    of served architectures, the same that makes the library refuse to load a method for the
    others. Raises :class:`GGUFRopeError` also when no patched library is installed."""
    from .runtime import arch_supported

    if not arch_supported(arch, "ggufrope set"):
        raise GGUFRopeError(
            f"{show(h.path)}: architecture {arch!r} is not served by the patched llama.cpp (it would refuse "
            "to load a method for it: no RoPE, or ropes other than the per-layer Q/K NORMAL/NEOX ropes)"
        )


def _rope_dims(h: Header, arch: str) -> tuple[int | None, str | None]:
    for tmpl in (K.KEY_ROPE_DIMS, "{arch}.attention.key_length"):
        v = h.value(K.key(tmpl, arch))
        if isinstance(v, int):
            return v, K.key(tmpl, arch)
    emb = h.value(K.key("{arch}.embedding_length", arch))
    heads = h.value(K.key("{arch}.attention.head_count", arch))
    if isinstance(heads, ArrayValue):
        vals = [v for v in (heads.values or []) if v]
        heads = max(vals) if vals else None
    if isinstance(emb, int) and isinstance(heads, int) and heads > 0:
        return emb // heads, f"{K.key('{arch}.embedding_length', arch)} / head_count"
    return None, None


def describe_method(meta: Mapping[str, Any]) -> str:
    """The active method in words, e.g.
    ``ntk-mixed, b = 0.625, k = auto (max(1, n_ctx_seq/8192)), log-n on`` or, with dynamic k,
    ``ntk-mixed, b = 0.625, k dynamic: 1 within L, then powers of 2 >= n/L, KV cache
    re-rotated, log-n on``.

    ``meta``: ``method`` (None: no ggufrope keys), ``factor`` (None: auto), ``exponent`` and
    ``exponent_default`` (b not in the file: 0.625, said "(default)"), ``logn``, ``dynamic``
    (what the library runs, :func:`ggufrope.methods.dynamic_effective`) and ``dynamic_ratio``,
    ``n_ctx_orig``, and the file's stock scaling (``stock_scaling_type``,
    ``stock_scaling_factor``): an NTK-family method replaces a stock yarn/linear scaling,
    method none (log-n alone) keeps it.
    """
    m = meta.get("method")
    L = meta.get("n_ctx_orig")
    st = meta.get("stock_scaling_type")
    stock = None
    if st and st != "none":
        f = meta.get("stock_scaling_factor")
        stock = f"stock llama.cpp rope scaling {st!r}" + (f" (factor {f32_repr(f)})" if f is not None else "")
    if m is None:
        if stock:
            return f"no ggufrope method; {stock}"
        return "none (no ggufrope keys: plain RoPE, as stock llama.cpp)"
    k = meta.get("factor")
    kt = f32_repr(k) if k is not None else f"auto (max(1, n_ctx_seq/{L if L else 'L'}))"
    b = meta.get("exponent")
    bt = None if b is None else f32_repr(b) + (" (default)" if meta.get("exponent_default") else "")
    dyn = bool(meta.get("dynamic"))
    s = M.summary(m, None if dyn else kt, bt, bool(meta.get("logn")), dynamic=dyn,
                  dynamic_ratio=meta.get("dynamic_ratio"))
    if stock:
        s += f"; replaces the file's {stock}" if METHODS[m].ntk_family else f"; the file's {stock} stays in effect"
    return s


def _n_ctx_orig(h: Header, arch: str) -> tuple[int | None, str | None]:
    """L and the key it comes from: original_context_length when non-zero, else
    context_length (as llama.cpp's n_ctx_orig_yarn); (None, None) when neither."""
    for tmpl in (K.KEY_ORIG_CTX, K.KEY_CONTEXT_LENGTH):
        x = h.value(K.key(tmpl, arch))
        if isinstance(x, int) and not isinstance(x, bool) and x > 0:
            return x, K.key(tmpl, arch)
    return None, None


def _rope_meta(h: Header) -> dict[str, Any]:
    arch = _architecture(h)
    _check_types(h, arch, ggufrope_keys=True)
    v = lambda tmpl: h.value(K.key(tmpl, arch))  # noqa: E731
    ctx = v(K.KEY_CONTEXT_LENGTH)
    L, L_src = _n_ctx_orig(h, arch)
    dims, dims_src = _rope_dims(h, arch)
    method, factor, exponent = v(K.KEY_METHOD), v(K.KEY_FACTOR), v(K.KEY_EXPONENT)
    dynamic, ratio = v(K.KEY_DYNAMIC), v(K.KEY_DYNAMIC_RATIO)
    logn = v(K.KEY_LOGN)
    where = show(h.path)
    exponent_default = False
    if method is not None:
        try:
            p = M.validate_stored(method, factor, exponent, dynamic, ratio)
        except ValueError as e:
            raise GGUFRopeError(f"{where}: invalid ggufrope metadata: {e}; fix it with ggufrope set or ggufrope reset") from None
        factor, exponent, exponent_default = p.factor, p.exponent, p.exponent_default
        dynamic, ratio = p.dynamic, p.dynamic_ratio
    present = {name: h.value(name) for name in K.ggufrope_keys(arch) if name in h}
    if method is None and (present or False):
        raise GGUFRopeError(
            f"{where}: ggufrope keys without {K.key(K.KEY_METHOD, arch)}; fix it with ggufrope set or ggufrope reset"
        )
    reserved = h.get(KEY_RESERVED)
    meta: dict[str, Any] = {
        "path": h.path,
        "gguf_version": h.version,
        "endian": "little" if h.endian == "<" else "big",
        "file_size": h.file_size,
        "tensor_count": h.tensor_count,
        "kv_count": len(h.kvs),
        "alignment": h.alignment,
        "data_offset": h.data_offset,
        "architecture": arch,
        "has_rope": has_rope(h, arch),
        "context_length": ctx,
        "n_ctx_orig": L,
        "n_ctx_orig_key": L_src,
        "freq_base": v(K.KEY_FREQ_BASE),
        "rope_dims": dims,
        "rope_dims_source": dims_src,
        "stock_scaling_type": v(K.KEY_SCALING_TYPE),
        "stock_scaling_factor": v(K.KEY_SCALING_FACTOR),
        "ggufrope_keys": {k_: (bool(x) if isinstance(x, bool) else x) for k_, x in present.items()},
        "method": method,
        "factor": factor,
        "exponent": exponent,
        "exponent_default": exponent_default,
        "dynamic": bool(dynamic),
        "dynamic_ratio": ratio if dynamic else None,
        "logn": bool(logn) if logn is not None else False,
        "reserved": reserved.value.count if reserved is not None and isinstance(reserved.value, ArrayValue) else None,
    }
    meta["description"] = describe_method(meta)
    return meta


def read_rope_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The rope-relevant metadata of a GGUF file, as a JSON-serialisable dict.

    Keys: ``path``, ``gguf_version``, ``endian``, ``file_size``, ``tensor_count``,
    ``kv_count``, ``alignment``, ``data_offset``, ``architecture``, ``has_rope``,
    ``context_length``, ``n_ctx_orig`` (L: ``{arch}.rope.scaling.original_context_length``
    when non-zero, else ``{arch}.context_length``; None when neither), ``n_ctx_orig_key``,
    ``freq_base``, ``rope_dims`` and ``rope_dims_source``, ``stock_scaling_type`` and
    ``stock_scaling_factor`` (stock llama.cpp's keys, None when absent),
    ``ggufrope_keys`` (full key name -> value, the keys present), ``method`` (None when the
    file has no ggufrope keys), ``factor`` (None: auto, the key absent or 0), ``exponent``
    (b; for ntk-mixed without the key the library's default 0.625, with ``exponent_default``
    True), ``dynamic`` (bool: the library runs dynamic k, from ``{arch}.rope.ntk.dynamic`` or,
    absent, the library's default; see :func:`ggufrope.methods.dynamic_effective`),
    ``dynamic_ratio`` (its ratio r, the default 2 when the key is absent; None when static),
    ``logn`` (bool), ``reserved`` (length of the reserved array, or None) and
    ``description`` (the active method in words, see :func:`describe_method`; it says when
    the method replaces a stock scaling of the file). ``has_rope``: the file has rope keys.

    Raises :class:`GGUFRopeError` for unreadable or invalid files, keys of the wrong type,
    and invalid ggufrope values (checked by :func:`ggufrope.methods.validate_stored`: a method
    not in ``FILE_METHODS``, k < 1 other than 0, b outside (0, 1], dynamic k with method none
    or with a factor other than 0, a ratio r <= 1).
    """
    return _rope_meta(read_header(path))


def _rope_values(method: str, factor: float | None, exponent: float | None, logn: bool,
                 dynamic: bool | None = None, dynamic_ratio: float | None = None
                 ) -> tuple[str, float | None, float | None, bool, bool | None, float | None]:
    """The validated values ``set`` writes (the registry's :func:`ggufrope.methods.validate`,
    stored methods only, rounded to float32): method, k, b (0.625 by default for ntk-mixed),
    log-n, dynamic (None: not written) and its ratio r (None: not written)."""
    try:
        p = M.validate(method, factor, exponent, dynamic=dynamic, dynamic_ratio=dynamic_ratio, stored=True,
                       float32=True)
    except ValueError as e:
        raise GGUFRopeError(str(e)) from None
    return p.method, p.factor, p.exponent, bool(logn), p.dynamic, p.dynamic_ratio


def write_rope_metadata(
    src: str | os.PathLike,
    dst: str | os.PathLike | None,
    *,
    method: str,
    factor: float | None = None,
    exponent: float | None = None,
    logn: bool = False,
    dynamic: bool | None = None,
    dynamic_ratio: float | None = None,
) -> WriteResult:
    """Write the ggufrope keys of ``keys.py`` for the file's architecture (``ggufrope set``).

    ``method``: a name or alias from the method registry; only ``FILE_METHODS`` (``none``,
    ``ntk``, ``ntk-fixed``, ``ntk-mixed``) can be stored — ``linear``/``yarn`` are stock
    llama.cpp's own. ``factor`` k >= 1 is written only when given (absent: dynamic k, the
    library's default, unless ``dynamic`` is False, then the library takes
    k = max(1, n_ctx_seq/L)); ``exponent`` b in (0, 1] only for ntk-mixed (default
    0.625); ``logn`` always; ``dynamic`` (``{arch}.rope.ntk.dynamic``, BOOL) only when given,
    True or False (None: the key is not written and the library's default applies, see
    :func:`ggufrope.methods.dynamic_effective`), and ``dynamic_ratio`` r > 1 only when given
    (with ``dynamic`` True; absent: 2). Dynamic k with method none or with a factor k is
    refused (the registry's :func:`ggufrope.methods.validate`, as the library refuses to load
    it). Every ggufrope key the call does not write is removed, so the
    file holds exactly the new state. Refuses architectures the patched library does not serve
    (asked through ``llama_ggufrope_arch_supported``; also refused when no patched library is
    installed). A stock ``{arch}.rope.scaling.type`` (yarn, linear) of the file is kept; the
    NTK family replaces it at load time, method none keeps it (a note in the result says so).
    Returns a :class:`ggufrope.gguf_writer.WriteResult`; ``dst`` as in :func:`ggufrope.gguf_writer.set_keys`.
    """
    m, k, b, ln, dyn, r = _rope_values(method, factor, exponent, logn, dynamic, dynamic_ratio)

    def build(h: Header) -> tuple[dict[str, tuple[GGUFValueType, Any]], list[str]]:
        arch = _architecture(h)
        _check_types(h, arch, ggufrope_keys=False)  # ggufrope keys are replaced anyway
        _require_served(h, arch)
        values: dict[str, tuple[GGUFValueType, Any]] = {K.key(K.KEY_METHOD, arch): (GGUFValueType.STRING, m)}
        if k is not None:
            values[K.key(K.KEY_FACTOR, arch)] = (GGUFValueType.FLOAT32, k)
        if b is not None:
            values[K.key(K.KEY_EXPONENT, arch)] = (GGUFValueType.FLOAT32, b)
        if dyn is not None:
            values[K.key(K.KEY_DYNAMIC, arch)] = (GGUFValueType.BOOL, dyn)
        if r is not None:
            values[K.key(K.KEY_DYNAMIC_RATIO, arch)] = (GGUFValueType.FLOAT32, r)
        values[K.key(K.KEY_LOGN, arch)] = (GGUFValueType.BOOL, ln)
        L, L_src = _n_ctx_orig(h, arch)
        stype = h.value(K.key(K.KEY_SCALING_TYPE, arch))
        stype = stype if isinstance(stype, str) and stype not in ("", "none") else None
        eff = M.dynamic_effective(m, k, dyn)
        info["description"] = describe_method({
            "method": m, "factor": k, "exponent": b, "logn": ln, "n_ctx_orig": L, "stock_scaling_type": stype,
            "dynamic": eff, "dynamic_ratio": (r if r is not None else M.DEFAULT_DYNAMIC_RATIO) if eff else None,
            "stock_scaling_factor": h.value(K.key(K.KEY_SCALING_FACTOR, arch)),
        })
        notes = []
        if stype is not None:
            what = f"the file also has stock llama.cpp rope scaling {K.key(K.KEY_SCALING_TYPE, arch)} = {stype!r}; "
            if METHODS[m].ntk_family:
                notes.append(what + f"ggufrope's method {m} replaces it when the model loads (not stacked on it; "
                             f"L = {L} from {L_src})")
            else:
                notes.append(what + "method none keeps it" + (" (log-n applies beside it)" if ln else ""))
        if L is None:
            notes.append(f"the file has no {K.key(K.KEY_CONTEXT_LENGTH, arch)}: L is unknown")
        info["notes"] = tuple(notes)
        return values, K.ggufrope_keys(arch)

    info: dict[str, Any] = {}
    r = rewrite(src, dst, build, reserve=True)
    return replace(r, description=info.get("description"), notes=info.get("notes", ()))


def reset_rope_metadata(src: str | os.PathLike, dst: str | os.PathLike | None) -> WriteResult:
    """Remove every ggufrope key, the reserved key included (``ggufrope reset``).

    A file written by ``set`` from a file without ggufrope keys comes back byte-identical.
    """
    return rewrite(src, dst, lambda h: ({}, K.ggufrope_keys(_architecture(h))), reserve=False)
