"""Rules of the patched library that are not numerics: the memory-fit probe never reads weights,
the architectures served are one list (the library's), and a ggufrope method never stacks on a
stock rope scaling asked for at the same time.

Each case runs llama.cpp in a subprocess: before the fixes the first one aborted the process
(``GGML_ASSERT`` in ``ggml_backend_tensor_get``), which must not take the test runner with it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np

from tiny_models import assert_refused_to_load, write_tiny_llama


def _run(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout)


def test_memory_fit_probe_reads_no_weights(tmp_path, patched_lib):
    """llama-server and llama-cli measure memory with a no_alloc load (``--fit``, on by default);
    the context is then created without weight data. With a ``rope_freqs`` tensor (every
    Llama-3.x GGUF) and an NTK-family method, the context used to read that tensor and abort at
    ``ggml-backend.cpp:359``. Now the probe creates the context (the table is built, k resolved);
    the composition with ``rope_freqs`` on a real load is checked against the torch reference in
    test_reference_forward.py."""
    rf = np.linspace(1.0, 4.0, 8).astype(np.float32)
    m = write_tiny_llama(tmp_path / "rf.gguf", seed=3, rope_freqs=rf,
                         extra_kv={"{arch}.rope.ntk.method": "ntk-mixed", "{arch}.attention.logn_scaling": True,
                                   "{arch}.rope.ntk.dynamic": False})
    r = _probe(m)
    assert r.returncode == 0, f"the no_alloc probe crashed (rc {r.returncode}): {r.stderr[-2000:]}"
    assert "CTX True" in r.stdout, r.stderr[-2000:]
    assert "FACTOR 4.0" in r.stdout, r.stdout  # static auto k, n_ctx 256 / L 64: the table is still built
    assert "DYNAMIC False" in r.stdout, r.stdout


def test_memory_fit_probe_with_dynamic_k(tmp_path, patched_lib):
    """The same file without the dynamic key (the library's default: dynamic k): the no_alloc
    probe creates the context too, dynamic, with k = 1."""
    rf = np.linspace(1.0, 4.0, 8).astype(np.float32)
    m = write_tiny_llama(tmp_path / "rf.gguf", seed=3, rope_freqs=rf,
                         extra_kv={"{arch}.rope.ntk.method": "ntk-mixed", "{arch}.attention.logn_scaling": True})
    r = _probe(m)
    assert r.returncode == 0, f"the no_alloc probe crashed (rc {r.returncode}): {r.stderr[-2000:]}"
    assert "CTX True" in r.stdout, r.stderr[-2000:]
    assert "FACTOR 1.0" in r.stdout and "DYNAMIC True" in r.stdout, r.stdout


def _probe(m) -> subprocess.CompletedProcess:
    """A no_alloc load of ``m`` and a context at n_ctx 256, as common_fit_params does; prints
    whether the context was created, its k and whether it runs dynamic k."""
    return _run(f"""
        import ctypes
        import llama_cpp as lc
        mp = lc.llama_model_default_params()
        mp.no_alloc = True
        mp.load_mode = lc.LLAMA_LOAD_MODE_NONE  # as common_fit_params (common/fit.cpp) loads it
        model = lc.llama_model_load_from_file({str(m.path).encode()!r}, mp)
        assert model, "model load failed"
        cp = lc.llama_context_default_params()
        cp.n_ctx = 256
        ctx = lc.llama_init_from_model(model, cp)
        print("CTX", bool(ctx))
        if ctx:
            f = lc.llama_cpp._lib.llama_ggufrope_factor
            f.argtypes, f.restype = [ctypes.c_void_p], ctypes.c_float
            print("FACTOR", f(ctx))
            d = lc.llama_cpp._lib.llama_ggufrope_dynamic
            d.argtypes, d.restype = [ctypes.c_void_p], ctypes.c_bool
            print("DYNAMIC", d(ctx))
    """)


def test_served_architectures_are_one_list(patched_lib):
    """``llama_ggufrope_arch_supported`` is the list ``ggufrope set`` uses and the loader
    enforces: NORMAL/NEOX rope on per-layer Q/K, at least one global rope layer."""
    import ctypes

    import llama_cpp

    f = llama_cpp.llama_cpp._lib.llama_ggufrope_arch_supported
    f.argtypes, f.restype = [ctypes.c_char_p], ctypes.c_bool
    served = {a: f(a.encode()) for a in ("llama", "qwen2", "qwen3", "gemma3", "mistral3", "phi3",
                                          "qwen2vl", "deepseek2", "llama4", "bert", "gpt2", "mamba", "no-such-arch")}
    assert served == {"llama": True, "qwen2": True, "qwen3": True, "gemma3": True, "mistral3": True, "phi3": True,
                      "qwen2vl": False, "deepseek2": False, "llama4": False, "bert": False, "gpt2": False,
                      "mamba": False, "no-such-arch": False}, served


def test_method_and_stock_scaling_requested_together_refuse(tmp_path, patched_lib):
    """A ggufrope NTK-family method and an explicit stock scaling type (``--rope-scaling yarn``)
    are not stacked: the context refuses with a message naming both."""
    m = write_tiny_llama(tmp_path / "m.gguf", seed=4, extra_kv={"{arch}.rope.ntk.method": "ntk-mixed"})
    assert_refused_to_load(m.path, "rope method 'ntk-mixed' and a stock rope scaling type (2) were both requested",
                           timeout=300, n_ctx=256, rope_scaling_type=2, rope_freq_scale=0.25)
