"""The patched library on tiny random models: equivalences, refusals, log-n, K-shift.

- the NTK table as a ``rope_freqs.weight`` tensor (method none) and as metadata give
  bit-identical logits;
- an architecture whose ropes the patch cannot serve (qwen2vl, multi-section rope), and invalid
  values, refuse to load with a message, through the API and the CLI, and the process survives;
- log-n alone leaves every logit at positions < L bit-identical and changes those beyond L;
- the K-shift re-ropes cached keys with the same table: removing a prefix and shifting the rest
  gives the logits of a fresh context.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ggufrope import keys as Kk
from test_reference_forward import K, L, N_CTX, assert_close, run_llama_cpp, tokens_for
from tiny_models import assert_refused_to_load, write_tiny_llama, write_tiny_qwen2, write_tiny_qwen2vl
from torch_reference import forward


def _kv(arch: str, method: str = "ntk-mixed", factor: float | None = K, b: float = 0.625, logn: bool = False) -> dict:
    kv = {Kk.key(Kk.KEY_METHOD, arch): method, Kk.key(Kk.KEY_LOGN, arch): logn}
    if factor is not None:
        kv[Kk.key(Kk.KEY_FACTOR, arch)] = factor
    if method == "ntk-mixed":
        kv[Kk.key(Kk.KEY_EXPONENT, arch)] = b
    return kv


def test_table_as_rope_freqs_tensor_equals_metadata(tmp_path, patched_lib):
    from ggufrope.runtime import library_freq_factors

    probe = write_tiny_llama(tmp_path / "probe.gguf", seed=5)
    table = library_freq_factors("ntk-mixed", probe.n_rot, K, 0.625)  # the library's own table
    as_tensor = write_tiny_llama(tmp_path / "tensor.gguf", seed=5, rope_freqs=table,
                                 extra_kv=_kv("llama", method="none", factor=None))
    as_keys = write_tiny_llama(tmp_path / "keys.gguf", seed=5, extra_kv=_kv("llama"))
    toks = tokens_for(as_keys)
    a, b = run_llama_cpp(as_tensor, toks), run_llama_cpp(as_keys, toks)
    assert np.array_equal(a, b)
    # and the table does something: plain RoPE differs beyond L
    plain = run_llama_cpp(probe, toks)
    assert np.abs(plain[L:] - a[L:]).max() > 1e-2


@pytest.mark.parametrize("writer", [write_tiny_llama, write_tiny_qwen2], ids=["llama", "qwen2"])
def test_logn_alone(tmp_path, patched_lib, writer):
    m = writer(tmp_path / "m.gguf", seed=7)
    arch = "llama" if writer is write_tiny_llama else "qwen2"
    toks = tokens_for(m)
    plain = run_llama_cpp(m, toks)
    logn = run_llama_cpp(m, toks, kv_overrides=_kv(arch, method="none", factor=None, logn=True))
    assert np.array_equal(plain[:L], logn[:L])  # s(p) = 1 exactly below L
    diff = np.abs(plain[L:] - logn[L:]).max(axis=1)
    assert (diff[1:] > 1e-4).all(), diff  # p = L: s = ln(L+1)/ln L, barely above 1
    assert_close(logn, forward(m, toks, logn_ctx=L), f"{arch} log-n vs torch")


def test_unserved_architecture_refuses_with_message(tmp_path, patched_lib):
    from ggufrope.errors import GGUFRopeError
    from ggufrope.runtime import load

    m = write_tiny_qwen2vl(tmp_path / "vl.gguf", seed=3)
    with pytest.raises(GGUFRopeError, match="refused to load"):
        load(m.path, method="ntk-mixed", n_ctx=N_CTX)
    r = subprocess.run([sys.executable, "-m", "ggufrope", "generate", str(m.path), "-p", "hi", "-n", "1",
                        "--method", "ntk-mixed", "--n-ctx", str(N_CTX), "--verbose"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    assert "is not supported for architecture 'qwen2vl'" in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("ggufrope: error:")
    assert "Traceback" not in r.stderr
    # the same file without a method loads and runs plain RoPE
    toks = tokens_for(m, 16)
    assert_close(run_llama_cpp(m, toks), forward(m, toks), "qwen2vl plain")


@pytest.mark.parametrize("kv,message", [
    ({"method": "ntk-bogus"}, "invalid qwen2.rope.ntk.method: 'ntk-bogus'"),
    ({"factor": float("nan")}, "invalid qwen2.rope.ntk.factor: nan"),
    ({"factor": 0.5}, "invalid qwen2.rope.ntk.factor: 0.5"),
    ({"b": 0.0}, "invalid qwen2.rope.ntk.exponent: 0"),
    ({"b": 1.5}, "invalid qwen2.rope.ntk.exponent: 1.5"),
], ids=["method", "nan", "k<1", "b=0", "b>1"])
def test_invalid_values_refuse_to_load(tmp_path, patched_lib, kv, message):
    """Invalid values written into the file (bypassing `ggufrope set`'s own checks) make the
    patched library refuse the model with a message; the process does not abort."""
    args = {"method": "ntk-mixed", "factor": 2.0, "b": 0.625} | kv
    m = write_tiny_qwen2(tmp_path / "bad.gguf", seed=2, extra_kv=_kv("qwen2", args["method"], args["factor"], args["b"]))
    assert_refused_to_load(m.path, message)


@pytest.mark.parametrize("logn", [False, True])
def test_k_shift_uses_the_table(tmp_path, patched_lib, logn):
    """Evaluate prefix + body, remove the prefix and shift the body back to position 0: the
    K-shift re-ropes the cached keys. The next token's logits must equal those of a fresh
    context that saw only the body. One layer, so the body's keys and values do not depend on
    the prefix (with more layers they carry it through attention). Re-roping with plain RoPE
    instead of the table would leave pair i off by 120 * theta_i * (1 - 1/ff_i) radians (about
    28 rad for the first pair here)."""
    import llama_cpp

    m = write_tiny_llama(tmp_path / "m.gguf", seed=11, n_layer=1)
    toks = tokens_for(m, 200, seed=4)
    prefix, body, nxt = toks[:120], toks[120:199], toks[199]
    kv = _kv("llama", logn=logn)

    def make():
        return llama_cpp.Llama(model_path=str(m.path), n_ctx=N_CTX, logits_all=True, type_k=0, type_v=0,
                               n_threads=2, verbose=False, kv_overrides=kv)

    fresh = make()
    fresh.eval(body + [nxt])
    want = np.array(fresh.scores[len(body)], dtype=np.float64)
    fresh.close()

    llm = make()
    llm.eval(prefix + body)
    n_pre = len(prefix)
    assert llm._ctx.kv_cache_seq_rm(0, 0, n_pre)
    llm._ctx.kv_cache_seq_shift(0, n_pre, -1, -n_pre)
    llm.n_tokens = len(body)
    llm.input_ids[: len(body)] = body
    llm.eval([nxt])
    got = np.array(llm.scores[len(body)], dtype=np.float64)
    llm.close()
    assert_close(got[None], want[None], f"K-shift ntk-mixed{' + logn' if logn else ''}", tol=1e-4)


def test_k_shift_of_a_quantized_cache_with_head_size_32(tmp_path, patched_lib):
    """Upstream's K-shift of a quantized K cache multiplied by the Hadamard rotation, which exists
    only for head sizes that are multiples of 64: head size 32 with a Q8_0 cache crashed
    (SIGSEGV building the K-shift graph; patches/0005). Same check as above, Q8_0 K cache, in a
    subprocess so that a crash fails the test instead of the run."""
    m = write_tiny_llama(tmp_path / "m.gguf", seed=12, n_layer=1, n_embd=128, n_head=4, n_head_kv=2)
    toks = tokens_for(m, 200, seed=5)
    code = f"""
import json, sys, numpy as np, llama_cpp
toks = {toks!r}
prefix, body, nxt = toks[:120], toks[120:199], toks[199]
def make():
    return llama_cpp.Llama(model_path={str(m.path)!r}, n_ctx=256, logits_all=True, type_k=8, type_v=1, flash_attn=True,
                           n_threads=2, verbose=False, kv_overrides={_kv("llama")!r})
fresh = make(); fresh.eval(body + [nxt]); want = list(fresh.scores[len(body)]); fresh.close()
llm = make(); llm.eval(prefix + body)
assert llm._ctx.kv_cache_seq_rm(0, 0, 120)
llm._ctx.kv_cache_seq_shift(0, 120, -1, -120)
llm.n_tokens = len(body); llm.input_ids[: len(body)] = body
llm.eval([nxt]); got = list(llm.scores[len(body)]); llm.close()
print(json.dumps({{"want": [float(x) for x in want], "got": [float(x) for x in got]}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert_close(np.array([out["got"]]), np.array([out["want"]]), "K-shift, Q8_0 K cache, head size 32", tol=3e-2)
