"""The log-n guard in ggml_backend_dev_supports_op, on the CPU: a backend other than CPU and
CUDA declines a rope with log-n set (so the scheduler runs it on the CPU instead of computing
plain RoPE), and accepts plain rope. native/test_supports_op.c registers fake "Metal" and "CUDA"
devices whose own supports_op accepts everything, compiled against the patched headers and the
installed patched libggml."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "build" / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"


def test_other_backends_decline_logn_rope(patched_lib, tmp_path):
    import llama_cpp

    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "no C compiler"
    lib = Path(llama_cpp.__file__).parent / "lib"
    exe = tmp_path / "test_supports_op"
    subprocess.run([cc, "-O1", "-Wall", "-Werror", f"-I{SRC / 'ggml' / 'include'}", f"-I{SRC / 'ggml' / 'src'}",
                    str(ROOT / "native" / "test_supports_op.c"), f"-L{lib}", "-lggml-base", "-lggml", "-lggml-cpu",
                    f"-Wl,-rpath,{lib}", "-o", str(exe)], check=True, capture_output=True, text=True)
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "Metal, NORMAL rope, log-n                        declined (expected declined)" in lines
    assert "Metal, NEOX rope, plain                          supported (expected supported)" in lines
    assert lines[-1] == "OK"
