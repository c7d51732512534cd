"""A small ctypes harness that calls the patched ggml rope op directly on the CPU.

It loads the ggml libraries installed with llama-cpp-python (the patched build from
``make build``), builds a one-op graph ``ggml_rope_ext`` (+ ``ggml_rope_set_logn``) and computes
it with ``ggml_graph_compute_with_ctx``. Shapes follow ggml: the input is
``[head_dim, n_heads, n_tokens]``, i.e. a C-order NumPy array ``(n_tokens, n_heads, head_dim)``.
"""

from __future__ import annotations

import ctypes
import pathlib

import numpy as np

GGML_TYPE_F32 = 0
GGML_TYPE_F16 = 1
GGML_TYPE_I32 = 26
GGML_ROPE_TYPE_NORMAL = 0
GGML_ROPE_TYPE_NEOX = 2
MODES = {"normal": GGML_ROPE_TYPE_NORMAL, "neox": GGML_ROPE_TYPE_NEOX}


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _lib_dir() -> pathlib.Path:
    import llama_cpp

    return pathlib.Path(llama_cpp.__file__).parent / "lib"


class GGML:
    """The ggml functions the rope tests need, bound with their C signatures."""

    def __init__(self) -> None:
        import llama_cpp.llama_cpp  # noqa: F401  (loads libggml* with the right search path)

        d = _lib_dir()
        self.base = ctypes.CDLL(str(d / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
        self.cpu = ctypes.CDLL(str(d / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
        b, c = self.base, self.cpu
        P = ctypes.c_void_p
        b.ggml_init.argtypes, b.ggml_init.restype = [_InitParams], P
        b.ggml_free.argtypes, b.ggml_free.restype = [P], None
        b.ggml_new_tensor_1d.argtypes, b.ggml_new_tensor_1d.restype = [P, ctypes.c_int, ctypes.c_int64], P
        b.ggml_new_tensor_3d.argtypes = [P, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        b.ggml_new_tensor_3d.restype = P
        f = ctypes.c_float
        b.ggml_rope_ext.argtypes = [P, P, P, P, ctypes.c_int, ctypes.c_int, ctypes.c_int, f, f, f, f, f, f]
        b.ggml_rope_ext.restype = P
        self.has_logn = hasattr(b, "ggml_rope_set_logn")
        if self.has_logn:
            b.ggml_rope_set_logn.argtypes, b.ggml_rope_set_logn.restype = [P, ctypes.c_int], P
        b.ggml_new_graph.argtypes, b.ggml_new_graph.restype = [P], P
        b.ggml_build_forward_expand.argtypes, b.ggml_build_forward_expand.restype = [P, P], None
        b.ggml_get_data.argtypes, b.ggml_get_data.restype = [P], P
        c.ggml_graph_compute_with_ctx.argtypes, c.ggml_graph_compute_with_ctx.restype = [P, P, ctypes.c_int], ctypes.c_int
        if hasattr(c, "ggml_cpu_init"):
            c.ggml_cpu_init.argtypes, c.ggml_cpu_init.restype = [], None
            c.ggml_cpu_init()

    def _set(self, t: int, arr: np.ndarray) -> None:
        ctypes.memmove(self.base.ggml_get_data(t), np.ascontiguousarray(arr).ctypes.data, arr.nbytes)

    def rope(
        self,
        x: np.ndarray,
        pos: np.ndarray,
        *,
        n_dims: int,
        mode: str,
        freq_base: float,
        freq_factors: np.ndarray | None = None,
        n_ctx_logn: int = 0,
        dtype: str = "f32",
        n_threads: int = 2,
    ) -> np.ndarray:
        """Run ``ggml_rope_ext`` on ``x`` (n_tokens, n_heads, head_dim) at integer ``pos``.

        ``freq_factors`` (float32, n_dims/2) is the op's src2; ``n_ctx_logn`` > 0 calls
        ``ggml_rope_set_logn``. ``dtype`` "f32" or "f16" is the type of input and output.
        Returns the output as float64 (n_tokens, n_heads, head_dim).
        """
        n_tokens, n_heads, head_dim = x.shape
        np_t, g_t = (np.float32, GGML_TYPE_F32) if dtype == "f32" else (np.float16, GGML_TYPE_F16)
        mem = 2 * x.size * 4 + pos.size * 4 + 4 * head_dim + 1024 * 1024
        ctx = self.base.ggml_init(_InitParams(mem, None, False))
        if not ctx:
            raise MemoryError("ggml_init failed")
        try:
            a = self.base.ggml_new_tensor_3d(ctx, g_t, head_dim, n_heads, n_tokens)
            self._set(a, x.astype(np_t))
            p = self.base.ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n_tokens)
            self._set(p, pos.astype(np.int32))
            c = None
            if freq_factors is not None:
                c = self.base.ggml_new_tensor_1d(ctx, GGML_TYPE_F32, len(freq_factors))
                self._set(c, np.asarray(freq_factors, dtype=np.float32))
            r = self.base.ggml_rope_ext(ctx, a, p, c, n_dims, MODES[mode], 0, freq_base, 1.0, 0.0, 1.0, 0.0, 0.0)
            if n_ctx_logn:
                if not self.has_logn:
                    raise RuntimeError("ggml_rope_set_logn is not exported: unpatched ggml")
                self.base.ggml_rope_set_logn(r, n_ctx_logn)
            g = self.base.ggml_new_graph(ctx)
            self.base.ggml_build_forward_expand(g, r)
            rc = self.cpu.ggml_graph_compute_with_ctx(ctx, g, n_threads)
            if rc != 0:
                raise RuntimeError(f"ggml_graph_compute_with_ctx failed: {rc}")
            out = np.empty(x.shape, dtype=np_t)
            ctypes.memmove(out.ctypes.data, self.base.ggml_get_data(r), out.nbytes)
            return out.astype(np.float64)
        finally:
            self.base.ggml_free(ctx)
