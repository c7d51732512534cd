"""The C drivers of the instruction-count benchmarks (bench/rope_op_callgrind.sh,
bench/decode_callgrind.sh) build against the patched headers and libraries and do what the
benchmark relies on, natively (valgrind itself is not run here):

* bench/decode_callgrind.c applies its kv overrides (the method reaches the library: log-n
  changes the logits beyond L and not below it, the NTK table changes them everywhere) and
  accepts a first position of 8192 on an empty sequence;
* bench/rope_op.c's count mode computes one case and refuses a variant its build lacks.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from conftest import compile_c


def _logit0(exe: Path, model: Path, p0: int, *method: str) -> float:
    r = subprocess.run([str(exe), str(model), "32", str(p0), "2", *method], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.fullmatch(r"ok \S+ n=32 p0=\d+ decodes=2 logit0=(\S+)\n", r.stdout)
    assert m, r.stdout
    return float(m.group(1))


@pytest.mark.real_model
def test_decode_driver_applies_the_method(patched_lib, tmp_path):
    from ggufrope.models import default_model_path

    model = default_model_path()
    exe = compile_c("bench/decode_callgrind.c", tmp_path / "decode_callgrind",
                    libs=("llama", "ggml-base", "ggml", "ggml-cpu"))
    mixed = ("ntk-mixed", "2", "0.625")
    below_on, below_off = _logit0(exe, model, 0, *mixed, "1"), _logit0(exe, model, 0, *mixed, "0")
    beyond_on, beyond_off = _logit0(exe, model, 8192, *mixed, "1"), _logit0(exe, model, 8192, *mixed, "0")
    plain_beyond = _logit0(exe, model, 8192)
    assert below_on == below_off  # log-n is 1 below L
    assert beyond_on != beyond_off  # and active beyond it, from position 8192 on
    assert beyond_off != plain_beyond  # the NTK table reached the rope
    r = subprocess.run([str(exe), str(model), "32", "0", "1", "rope9", "2", "0.625", "0"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and "cannot load" in r.stderr  # an invalid method is refused at load


def test_rope_op_count_mode(patched_lib, tmp_path):
    exe = compile_c("bench/rope_op.c", tmp_path / "rope_op", "-DGGUFROPE")
    r = subprocess.run([str(exe), "1", "64", "512", "2", "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "table+logn head_dim=64 n_tokens=512 computed 3 times\n", r.stdout + r.stderr
    r = subprocess.run([str(exe), "1", "64", "1", "3", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "variant 3 not in this build" in r.stderr
