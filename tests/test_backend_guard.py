"""The log-n guard in ggml_backend_dev_supports_op, on the CPU: a backend other than CPU and
CUDA declines a rope with log-n set (so the scheduler runs it on the CPU instead of computing
plain RoPE), and accepts plain rope. native/test_supports_op.c registers fake "Metal" and "CUDA"
devices whose own supports_op accepts everything, compiled against the patched headers and the
installed patched libggml."""

from __future__ import annotations

import subprocess

from conftest import PATCHED_SRC, compile_c


def test_other_backends_decline_logn_rope(patched_lib, tmp_path):
    exe = compile_c("native/test_supports_op.c", tmp_path / "test_supports_op", f"-I{PATCHED_SRC / 'ggml' / 'src'}")
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert "Metal, NORMAL rope, log-n                        declined (expected declined)" in lines
    assert "Metal, NEOX rope, plain                          supported (expected supported)" in lines
    assert lines[-1] == "OK"
