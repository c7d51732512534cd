"""Command-line flags that select a ggufrope method on a plain model file, through llama.cpp's
kv overrides (``ggufrope show --override-kv``).

llama.cpp's tools (``llama-server``, ``llama-cli``, ``llama-perplexity``, ...) take
``--override-kv KEY=TYPE:VALUE`` (TYPE one of ``int``, ``float``, ``bool``, ``str``; the flag may
be repeated); llama-cpp-python's server (``python -m llama_cpp.server``) takes the same strings
after ONE flag, ``--kv_overrides S1 S2 ...`` (argparse ``nargs="*"``: a repeated
``--kv_overrides`` keeps only its last list). The patched library reads the overridden keys as
if the file carried them, so a plain file plus these flags runs the method of a file written by
``ggufrope set``.

Two sources of the overrides:

* :func:`file_overrides`: exactly the ggufrope keys present in a file (written by ``ggufrope
  set``), with their GGUF types from :data:`ggufrope.keys.KEY_TYPES`;
* :func:`choice_overrides`: a method chosen on the command line, resolved like ``ggufrope
  generate --method ...`` (:func:`ggufrope.runtime._resolve`) and turned into overrides by
  :func:`ggufrope.runtime.llama_kwargs`, the one place that builds them (every key it sets,
  so a file's own keys are replaced; ``none`` also switches a stock scaling of the file off,
  ``--rope-scaling none``). ``linear`` and ``yarn`` are stock llama.cpp's own context
  parameters, not metadata: refused here.
"""

from __future__ import annotations

import shlex
from typing import Any, Mapping

from . import keys as K
from .errors import GGUFRopeError
from .gguf_constants import GGUFValueType

#: the forms :func:`flags` prints: llama.cpp's tools, llama-cpp-python's server
FORMATS = ("llama", "python")

_INT_TYPES = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
              GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}


def _tag(key: str, arch: str, value: Any) -> str:
    """The override TYPE of ``key``: from :data:`ggufrope.keys.KEY_TYPES` for a ggufrope key,
    else from the Python type of ``value``."""
    for t, vt in K.KEY_TYPES.items():
        if K.key(t, arch) == key:
            if vt == GGUFValueType.STRING:
                return "str"
            if vt == GGUFValueType.BOOL:
                return "bool"
            if vt in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
                return "float"
            if vt in _INT_TYPES:
                return "int"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    raise GGUFRopeError(f"{key}: a value of type {type(value).__name__} cannot be a kv override")


def override_string(key: str, arch: str, value: Any) -> str:
    """``KEY=TYPE:VALUE`` as llama.cpp parses it (``string_parse_kv_override``): bools
    ``true``/``false``, floats as the shortest decimal of their float32 value (the value the
    library reads back is the file's, bit for bit)."""
    from .gguf_reader import f32_repr

    tag = _tag(key, arch, value)
    if tag == "bool":
        v = "true" if value else "false"
    elif tag == "float":
        v = f32_repr(float(value))
    elif tag == "int":
        v = str(int(value))
    else:
        v = str(value)
        if len(v.encode()) > 127 or any(c in v for c in ",:=\n"):
            raise GGUFRopeError(f"{key}: the string {v!r} cannot be passed as a kv override")
    return f"{key}={tag}:{v}"


def parse_override(s: str) -> tuple[str, Any]:
    """The inverse of :func:`override_string`: ``(key, value)`` with the Python type of TYPE
    (what llama-cpp-python's server passes to ``Llama(kv_overrides=...)``)."""
    key, sep, rest = s.partition("=")
    tag, sep2, v = rest.partition(":")
    if not sep or not sep2:
        raise ValueError(f"not KEY=TYPE:VALUE: {s!r}")
    if tag == "bool":
        if v not in ("true", "false"):
            raise ValueError(f"bool override must be true or false: {s!r}")
        return key, v == "true"
    if tag == "int":
        return key, int(v)
    if tag == "float":
        return key, float(v)
    if tag == "str":
        return key, v
    raise ValueError(f"unknown override type {tag!r} in {s!r}")


def file_overrides(meta: Mapping[str, Any]) -> dict[str, Any]:
    """The ggufrope keys present in the file whose metadata is ``meta``
    (:func:`ggufrope.rope_metadata.read_rope_metadata`), key -> value, in the file's order.
    Raises :class:`GGUFRopeError` when it has none (plain RoPE: nothing to pass)."""
    kv = dict(meta["ggufrope_keys"])
    if not kv:
        raise GGUFRopeError(f"{meta['path']} has no ggufrope keys (plain RoPE), so there is nothing to pass; "
                            "show a file written by `ggufrope set`, or choose the method: "
                            "--override-kv --method METHOD [--b B] [-k K] [--logn]")
    return kv


def choice_overrides(meta: Mapping[str, Any], method: str | None, factor: float | None, exponent: float | None,
                     logn: bool | None, dynamic: bool | None = None,
                     dynamic_ratio: float | None = None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The overrides of a method chosen as ``ggufrope generate`` chooses it at load time, on the
    file of ``meta``: ``(kv_overrides, context_params)`` from :func:`ggufrope.runtime.llama_kwargs`
    (``context_params``: ``rope_scaling_type`` 0 for ``none``, or empty), or None when nothing
    is chosen (the file's own keys decide). Raises :class:`GGUFRopeError` for an invalid choice
    and for ``linear``/``yarn`` (stock llama.cpp's own flags, not metadata)."""
    from .runtime import _resolve, llama_kwargs

    choice = _resolve(dict(meta), method, factor, exponent, logn, dynamic, dynamic_ratio)
    if choice is None:
        return None
    if choice.method in ("linear", "yarn"):
        raise GGUFRopeError(f"{choice.method} is stock llama.cpp's own, set by its context flags, not by metadata: "
                            f"llama-server --rope-scaling {choice.method} --rope-scale K (python -m llama_cpp.server: "
                            f"--rope_scaling_type {1 if choice.method == 'linear' else 2} --rope_freq_scale 1/K)")
    L = meta["n_ctx_orig"] or 0
    params = llama_kwargs(choice, meta["architecture"], L, L, keep_stock_scaling=method is None)
    kv = params.pop("kv_overrides")
    order = [K.key(t, meta["architecture"]) for t in K.KEY_TYPES]  # the order `set` writes them in
    return dict(sorted(kv.items(), key=lambda item: order.index(item[0]))), params


def flags(kv: Mapping[str, Any], arch: str, form: str = "llama", context: Mapping[str, Any] | None = None) -> list[str]:
    """The command-line arguments that pass ``kv`` (key -> value): ``form`` ``"llama"``
    (llama.cpp's tools: ``--override-kv S`` per key, and ``--rope-scaling none`` for
    ``context`` ``rope_scaling_type`` 0) or ``"python"`` (``python -m llama_cpp.server``:
    ``--kv_overrides S1 S2 ...``, and ``--rope_scaling_type 0``)."""
    if form not in FORMATS:
        raise GGUFRopeError(f"unknown override format {form!r}: one of {', '.join(FORMATS)}")
    strings = [override_string(k, arch, v) for k, v in kv.items()]
    context = dict(context or {})
    rst = context.pop("rope_scaling_type", None)
    if context:
        raise GGUFRopeError(f"no flags for the context parameters {sorted(context)}")  # pragma: no cover
    if form == "llama":
        out = [a for s in strings for a in ("--override-kv", s)]
        if rst is not None:
            out += ["--rope-scaling", {0: "none", 1: "linear", 2: "yarn"}[rst]]
    else:
        out = ["--kv_overrides", *strings] if strings else []
        if rst is not None:
            out += ["--rope_scaling_type", str(rst)]
    return out


def command_line(args: list[str]) -> str:
    """``args`` as one shell-quoted line."""
    return shlex.join(args)
