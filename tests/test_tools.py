"""The patched llama.cpp tools that ``make tools`` builds into build/tools/bin.

- each one is there, runs, and carries the patch (the ggufrope log strings are in the binary);
- ``llama-perplexity`` on the real SmolLM2 with a `set` file runs the method from the file and logs
  it (the library's INFO lines need ``-lv 4`` in the tools): with L declared 256 through
  ``--override-kv`` (so a 1024-token chunk is 4·L with auto k = 4, and the run takes seconds) the
  perplexity differs from the same file with the method switched off by another override. (Not
  "better": SmolLM2 was trained to 8192, so plain RoPE is fine at 1024; the quality beyond the real
  L is tests/test_real_model.py's.)
- ``llama-bench`` runs a `set` file.
(``llama-server``: tests/test_servers.py; ``ggml-rpc-server``: tests/test_rpc.py.)
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = ROOT / "build" / "tools" / "bin"
TOOLS = ("llama-server", "llama-cli", "llama-perplexity", "llama-bench", "ggml-rpc-server")


def _tool(name: str) -> Path:
    exe = BIN / name
    assert exe.is_file(), f"{exe} is missing: run make tools"
    return exe


@pytest.mark.parametrize("name", TOOLS)
def test_tool_is_built_from_the_patched_tree(name):
    exe = _tool(name)
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    data = exe.read_bytes()
    # every tool links the patched ggml (log-n rope); those that load models, the patched libllama
    assert b"ggml_rope_set_logn" in data or b"log-n" in data, f"{name} lacks the patched ggml"
    if name != "ggml-rpc-server":
        assert b"ggufrope: rope method" in data, f"{name} lacks the patched libllama"


@pytest.fixture(scope="module")
def smollm2_set(tmp_path_factory):
    from ggufrope.rope_metadata import write_rope_metadata
    from ggufrope.models import default_model_path

    out = tmp_path_factory.mktemp("tools") / "smollm2-mixed-logn.gguf"
    write_rope_metadata(default_model_path(), out, method="ntk-mixed", exponent=0.625, logn=True, dynamic=False)
    return out


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    from ggufrope.corpus import load_text

    path = tmp_path_factory.mktemp("text") / "hamlet.txt"
    path.write_text(load_text("hamlet")[:30_000], encoding="utf-8")
    return path


def _perplexity(model: Path, text: Path, *overrides: str) -> tuple[float, str]:
    args = [str(_tool("llama-perplexity")), "-m", str(model), "-f", str(text), "-c", "1024", "-b", "1024",
            "--chunks", "2", "-t", "2", "-lv", "4", "--override-kv", "llama.context_length=int:256"]
    for o in overrides:
        args += ["--override-kv", o]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", r.stdout + r.stderr)
    assert m, (r.stdout + r.stderr)[-3000:]
    return float(m.group(1)), r.stderr


@pytest.mark.real_model
def test_llama_perplexity_runs_the_method_from_the_file(smollm2_set, text_file):
    ppl, log = _perplexity(smollm2_set, text_file)
    assert "ggufrope: rope method = ntk-mixed, k = 4.0000 (auto: n_ctx_seq / n_ctx_orig), b = 0.6250, log-n = on" in log
    assert "re-adjusting n_ctx_train(256) to it" in log
    plain, plain_log = _perplexity(smollm2_set, text_file, "llama.rope.ntk.method=str:none",
                                   "llama.attention.logn_scaling=bool:false")
    assert "ggufrope: rope method = ntk-mixed" not in plain_log
    print(f"\nllama-perplexity, L declared 256, 2 chunks of 1024: ntk-mixed + log-n {ppl:.4f}, plain RoPE {plain:.4f}")
    assert abs(ppl - plain) > 0.01 * plain


@pytest.mark.real_model
def test_llama_bench_runs_a_set_file(smollm2_set):
    r = subprocess.run([str(_tool("llama-bench")), "-m", str(smollm2_set), "-p", "64", "-n", "4", "-r", "1",
                        "-t", "2", "-o", "json"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)
    assert {row["n_prompt"] for row in rows} >= {64} and all(row["avg_ts"] > 0 for row in rows)
