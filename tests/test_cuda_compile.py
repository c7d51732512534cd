"""The CUDA sources carry the change and compile: the patched ggml-cuda/rope.cu (log-n in the
rope_norm / rope_neox kernels) and ggml-cuda.cu (the RMS_NORM+MUL+ROPE fusion declines log-n),
compiled with nvcc for sm_90 by native/cuda-compile.sh. No GPU is needed; running the kernels
is issue 6 (native/gpu-check.sh on a GPU machine)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import PATCHED_SRC

ROOT = Path(__file__).resolve().parents[1]
CUDA_DIR = PATCHED_SRC / "ggml" / "src" / "ggml-cuda"


def test_cuda_sources_carry_the_change(patched_lib):
    rope = (CUDA_DIR / "rope.cu").read_text()
    assert rope.count("const float          log_n_ctx_logn,") == 4  # 2 kernels + 2 launchers
    assert len(re.findall(r"attn_factor\*logn", rope)) == 2  # folded into rope_yarn's mscale
    fusion = (CUDA_DIR / "ggml-cuda.cu").read_text()
    assert "ggml_rope_set_logn is not supported in the fused kernel" in fusion


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed on this machine")
def test_patched_cuda_sources_compile(patched_lib):
    r = subprocess.run([str(ROOT / "native" / "cuda-compile.sh")], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "cuda-compile: rope.cu OK" in r.stdout and "cuda-compile: ggml-cuda.cu OK" in r.stdout
