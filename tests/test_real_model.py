"""End to end on the real model: SmolLM2-135M-Instruct Q4_1 (L = 8192), `ggufrope set`
ntk-mixed + log-n, greedy generation at n_ctx 16384 from more than 10,000 tokens of real
text, once through the CLI and once through the Python API: it runs on the CPU, the patched
library logs the method, and the output is non-empty and the same both times."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real_model

N_CTX = 16384
N_PREDICT = 24


@pytest.fixture(scope="module")
def smollm2():
    from ggufrope.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def mixed_logn(tmp_path_factory, smollm2):
    from ggufrope.gguf_file import read_rope_metadata, write_rope_metadata

    out = tmp_path_factory.mktemp("real") / "smollm2-mixed-logn.gguf"
    write_rope_metadata(smollm2, out, method="ntk-mixed", exponent=0.625, logn=True)
    meta = read_rope_metadata(out)
    assert (meta["method"], meta["exponent"], meta["logn"], meta["factor"]) == ("ntk-mixed", 0.625, True, None)
    assert meta["n_ctx_orig"] == 8192
    return out


@pytest.fixture(scope="module")
def long_text(tmp_path_factory):
    from ggufrope.corpus import demo_text

    path = tmp_path_factory.mktemp("text") / "long.txt"
    path.write_text(demo_text(), encoding="utf-8")
    return path


def test_generate_long_prompt_cli_and_api_agree(patched_lib, mixed_logn, long_text):
    r = subprocess.run(
        [sys.executable, "-m", "ggufrope", "generate", str(mixed_logn), "--n-ctx", str(N_CTX), "-f", str(long_text),
         "-n", str(N_PREDICT), "--verbose"],
        capture_output=True, text=True, timeout=1800,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # the patched library names the active method when the context is created
    assert re.search(r"ggufrope: rope method = ntk-mixed, k = 2\.0000 \(auto[^)]*\), b = 0\.6250, log-n = on \(n_ctx_orig = 8192\)",
                     r.stderr), r.stderr[-3000:]
    n_prompt = int(re.search(r"\[ggufrope\] prompt (\d+) tokens", r.stderr).group(1))
    assert 10_000 < n_prompt <= N_CTX - N_PREDICT
    out_cli = r.stdout.strip()
    assert out_cli, "empty generation"

    from ggufrope.generate import generate
    from ggufrope.runtime import load

    llm = load(mixed_logn, n_ctx=N_CTX)
    out_api = "".join(generate(llm, long_text.read_text(encoding="utf-8"), n_predict=N_PREDICT)).strip()
    assert out_api == out_cli  # greedy decoding is deterministic
