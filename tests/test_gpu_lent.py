"""native/reuse-cuda-objects.sh, the compiler launcher of the stock CUDA build for a lent GPU
(native/gpu-lent.sh): it copies the patched build's object only for a source that is byte-identical
in the two trees and not named in REUSE_EXCEPT; every other compile runs the command it was given.
The compiler here is a stand-in that writes a marker (no nvcc or GPU is needed to test the choice)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "native" / "reuse-cuda-objects.sh"


def launch(tmp: Path, name: str, stock_text: str, patched_text: str, *, except_: str = "", have_object: bool = True) -> str:
    stock, patched, pbuild, sbuild = (tmp / d for d in ("stock", "patched", "pbuild", "sbuild"))
    for d in (stock, patched, pbuild / "obj", sbuild / "obj"):
        d.mkdir(parents=True, exist_ok=True)
    (stock / name).write_text(stock_text)
    (patched / name).write_text(patched_text)
    if have_object:
        (pbuild / "obj" / f"{name}.o").write_text("object of the patched build")
    compiler = tmp / "fake-nvcc"
    compiler.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\necho compiled > "$out"\n')
    compiler.chmod(0o755)
    env = dict(os.environ, REUSE_FROM=str(pbuild), REUSE_SRC=str(patched), STOCK_SRC=str(stock), REUSE_EXCEPT=except_)
    r = subprocess.run([str(LAUNCHER), str(compiler), "-x", "cu", "-MD", "-MT", f"obj/{name}.o", "-MF", f"obj/{name}.o.d",
                        "-c", str(stock / name), "-o", f"obj/{name}.o"], cwd=sbuild, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return (sbuild / "obj" / f"{name}.o").read_text().strip()


def test_identical_source_reuses_the_patched_object(tmp_path):
    assert launch(tmp_path, "argmax.cu", "same", "same") == "object of the patched build"
    assert (tmp_path / "sbuild" / "obj" / "argmax.cu.o.d").read_text().startswith("obj/argmax.cu.o:")


def test_changed_source_is_compiled(tmp_path):
    assert launch(tmp_path, "rope.cu", "stock kernel", "patched kernel") == "compiled"


def test_excepted_or_missing_object_is_compiled(tmp_path):
    assert launch(tmp_path, "rope.cu", "same", "same", except_="ggml-cuda.cu rope.cu") == "compiled"
    assert launch(tmp_path / "b", "argsort.cu", "same", "same", have_object=False) == "compiled"
