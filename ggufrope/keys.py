"""GGUF metadata keys written by ``ggufrope set`` and read by the patched llama.cpp.

The contract between the file, the patched library and this tool. Every key lives in
the ``{arch}.rope.`` / ``{arch}.attention.`` namespaces, has the exact GGUF type the
patched loader reads, and is ignored by stock llama.cpp (it only lists unknown keys), so
an unpatched build still loads a file that carries them.

=====================================  =======  ==========================================
key                                    type     meaning
=====================================  =======  ==========================================
``{arch}.rope.ntk.method``             STRING   ``none``, ``ntk``, ``ntk-fixed``, ``ntk-mixed``
``{arch}.rope.ntk.factor``             FLOAT32  factor k >= 1; absent or 0: auto, dynamic
                                                k unless ``.dynamic`` is false, then
                                                k = max(1, n_ctx_seq / L) (the library)
``{arch}.rope.ntk.exponent``           FLOAT32  exponent b in (0, 1] of ``ntk-mixed``;
                                                absent: 0.625
``{arch}.rope.ntk.dynamic``            BOOL     dynamic k: 1 while the KV cache holds
                                                positions < L, then the smallest r^e
                                                with r^e * L >= n (n = 1 + the largest
                                                cached position), cached keys
                                                re-rotated; NTK family only, factor
                                                absent or 0; absent: the library's
                                                default, ``methods.DYNAMIC_DEFAULT``
                                                (True: dynamic wherever it can run)
``{arch}.rope.ntk.dynamic_ratio``      FLOAT32  ratio r > 1 of the dynamic schedule;
                                                absent: 2 (k = 1, 2, 4, 8, ...)
``{arch}.attention.logn_scaling``      BOOL     log-n query scaling beyond L
=====================================  =======  ==========================================

L (``n_ctx_orig``) is ``{arch}.rope.scaling.original_context_length`` when present, else
``{arch}.context_length``: the same value llama.cpp uses for YaRN. n_ctx_seq is the context
of one sequence (n_ctx rounded up to a multiple of 256, divided by n_seq_max). An NTK-family
method replaces a stock ``{arch}.rope.scaling.type`` (yarn, linear) of the file; method
``none`` keeps it. Dynamic k and log-n are switches beside the method and combine. The values are checked by :mod:`ggufrope.methods` (``validate_stored``).
"""

from __future__ import annotations

from .gguf_constants import GGUFValueType

KEY_METHOD = "{arch}.rope.ntk.method"
KEY_FACTOR = "{arch}.rope.ntk.factor"
KEY_EXPONENT = "{arch}.rope.ntk.exponent"
KEY_DYNAMIC = "{arch}.rope.ntk.dynamic"
KEY_DYNAMIC_RATIO = "{arch}.rope.ntk.dynamic_ratio"
KEY_LOGN = "{arch}.attention.logn_scaling"

#: key template -> GGUF value type, in the order they are written.
KEY_TYPES: dict[str, GGUFValueType] = {
    KEY_METHOD: GGUFValueType.STRING,
    KEY_FACTOR: GGUFValueType.FLOAT32,
    KEY_EXPONENT: GGUFValueType.FLOAT32,
    KEY_DYNAMIC: GGUFValueType.BOOL,
    KEY_DYNAMIC_RATIO: GGUFValueType.FLOAT32,
    KEY_LOGN: GGUFValueType.BOOL,
}

# keys stock llama.cpp reads that ggufrope only reads (never writes)
KEY_CONTEXT_LENGTH = "{arch}.context_length"
KEY_ORIG_CTX = "{arch}.rope.scaling.original_context_length"
KEY_FREQ_BASE = "{arch}.rope.freq_base"
KEY_ROPE_DIMS = "{arch}.rope.dimension_count"
KEY_SCALING_TYPE = "{arch}.rope.scaling.type"
KEY_SCALING_FACTOR = "{arch}.rope.scaling.factor"


def key(template: str, arch: str) -> str:
    """Expand a key template for architecture ``arch`` (e.g. ``"llama"``)."""
    return template.format(arch=arch)


def ggufrope_keys(arch: str) -> list[str]:
    """The full names of every key ggufrope may write, for ``arch``."""
    return [key(t, arch) for t in KEY_TYPES]
