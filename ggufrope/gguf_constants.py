"""gguf-py's ``gguf/constants.py`` without the rest of the package (numpy, the reader,
the writer): the key types and quantisation sizes ggufrope needs, at a fraction of the
import time. Used by keys.py, gguf_reader.py and gguf_writer.py."""

from __future__ import annotations

import os
import sys
from typing import Any


def _gguf_constants() -> Any:
    """gguf-py's ``gguf/constants.py`` without the rest of the package.

    ``import gguf`` (or ``gguf.constants``, which runs the package's ``__init__`` first)
    also imports numpy, the reader, the writer and the quantisers: about 0.2 s, most of
    the time of an in-place ``ggufrope set``. The constants module needs only ``enum``
    and ``typing``, so it is loaded on its own from the installed package (its compiled
    bytecode is reused). When gguf is already imported, its own module is used."""
    m = sys.modules.get("gguf.constants")
    if m is not None:
        return m
    name = "ggufrope._gguf_constants"
    m = sys.modules.get(name)
    if m is not None:
        return m
    try:
        import importlib.util

        spec = importlib.util.find_spec("gguf")
        if spec is None or not spec.origin:
            raise ImportError("gguf")
        path = os.path.join(os.path.dirname(spec.origin), "constants.py")
        cspec = importlib.util.spec_from_file_location(name, path)
        if cspec is None or cspec.loader is None:
            raise ImportError(path)
        m = importlib.util.module_from_spec(cspec)
        sys.modules[name] = m
        try:
            cspec.loader.exec_module(m)
        except BaseException:
            del sys.modules[name]
            raise
        return m
    except Exception:  # an unusual installation: the ordinary import
        import gguf.constants

        return gguf.constants


_C = _gguf_constants()
GGML_QUANT_SIZES = _C.GGML_QUANT_SIZES
GGUF_DEFAULT_ALIGNMENT = _C.GGUF_DEFAULT_ALIGNMENT
GGUF_MAGIC = _C.GGUF_MAGIC
GGMLQuantizationType = _C.GGMLQuantizationType
GGUFValueType = _C.GGUFValueType

