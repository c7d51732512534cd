"""A file that carries stock rope scaling (issue 12, part 4).

Qwen2.5/3 long-context GGUFs carry ``{arch}.rope.scaling.type`` = yarn with a factor and
``{arch}.rope.scaling.original_context_length``. Rule: an NTK-family ggufrope method REPLACES
the stock scaling (it never stacks on it), with L = ``original_context_length``; method
``none`` (with or without log-n) keeps the stock scaling.

The tiny files here say what such a long-context file says: ``context_length`` 256 (the
extended length), ``original_context_length`` 64 = L, factor 4; llama.cpp runs them at
n_ctx 256. The reference for a replaced scaling is the torch reference with the ggufrope
method alone (its frequencies from the seeds, log-n with L = 64); an automatic k must be
n_ctx / original_context_length = 4, not n_ctx / context_length = 1.
"""

from __future__ import annotations

import numpy as np
import pytest

from test_reference_forward import (
    N_CTX,
    _overrides,
    assert_close,
    rel_err,
    require_patched,
    run_llama_cpp,
    tokens_for,
)
from tiny_models import assert_dynamic_k_steps_after, write_tiny_llama, write_tiny_qwen2
from torch_reference import forward

L = 64  # original_context_length
N_CTX_TRAIN = 256  # context_length of the extended file
FACTOR = 4.0
B = 0.625
TOL = 1e-3
WRITERS = {"llama": write_tiny_llama, "qwen2": write_tiny_qwen2}


def scaling_kv(kind: str | None) -> dict:
    if kind is None:
        return {}
    return {
        "{arch}.rope.scaling.type": kind,
        "{arch}.rope.scaling.factor": FACTOR,
        "{arch}.rope.scaling.original_context_length": L,  # UINT32, as convert_hf_to_gguf writes it
    }


def write(tmp_path, arch: str, kind: str | None, seed: int = 41):
    return WRITERS[arch](tmp_path / f"{arch}-{kind}.gguf", seed=seed, n_ctx_train=N_CTX_TRAIN, extra_kv=scaling_kv(kind))


def test_scaling_keys_written(tmp_path):
    from gguf import GGUFReader, GGUFValueType

    m = write(tmp_path, "qwen2", "yarn")
    f = GGUFReader(m.path).fields
    assert f["qwen2.rope.scaling.type"].contents() == "yarn"
    assert f["qwen2.rope.scaling.factor"].contents() == FACTOR
    assert f["qwen2.rope.scaling.original_context_length"].types == [GGUFValueType.UINT32]
    assert f["qwen2.rope.scaling.original_context_length"].contents() == L
    assert f["qwen2.context_length"].contents() == N_CTX_TRAIN


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_stock_scaling_in_file_is_applied(tmp_path, arch):
    """Stock llama.cpp behaviour the rule starts from (any build): the file's linear scaling is
    applied (it equals the reference's PI with k = 4), and its yarn changes the logits."""
    bare = write(tmp_path, arch, None)
    toks = tokens_for(bare)
    plain = forward(bare, toks)
    lin = write(tmp_path, arch, "linear")
    assert_close(run_llama_cpp(lin, toks), forward(lin, toks, method="linear", k=FACTOR), f"{arch} linear in file")
    yarn = write(tmp_path, arch, "yarn")
    assert rel_err(run_llama_cpp(yarn, toks), plain).max() > 10 * TOL


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kind", ["yarn", "linear"])
@pytest.mark.parametrize("logn", [True, False], ids=["logn", "no-logn"])
def test_ntk_method_replaces_stock_scaling(tmp_path, arch, kind, logn):
    """yarn/linear in the file + ntk-mixed (k = 4) by kv overrides == the reference with
    ntk-mixed alone (log-n with L = original_context_length = 64). Stacked on the stock
    scaling (today's library) it is off by 0.54 .. 0.65 (max rel err)."""
    require_patched()
    m = write(tmp_path, arch, kind)
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, n_ctx=N_CTX, kv_overrides=_overrides(arch, "ntk-mixed", FACTOR, B, logn))
    want = forward(m, toks, method="ntk-mixed", k=FACTOR, b=B, logn_ctx=L if logn else 0)
    # power: the table stacked on PI (ntk-mixed at positions p/k) is far from it
    stacked = forward(m, toks, positions=np.arange(len(toks)) / FACTOR, method="ntk-mixed", k=FACTOR, b=B)
    assert rel_err(stacked, forward(m, toks, method="ntk-mixed", k=FACTOR, b=B)).max() > 10 * TOL
    assert_close(got, want, f"{arch} {kind} in file + ntk-mixed{' + logn' if logn else ''}")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ntk_method_replaces_stock_scaling_auto_k(tmp_path, arch):
    """No factor key, dynamic false: k = n_ctx / original_context_length = 256 / 64 = 4 (L is the
    original context, not the file's extended context_length, which would give k = 1)."""
    require_patched()
    m = write(tmp_path, arch, "yarn")
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, n_ctx=N_CTX, kv_overrides=_overrides(arch, "ntk-mixed", None, None, True, dynamic=False))
    want = forward(m, toks, method="ntk-mixed", k=N_CTX / L, b=B, logn_ctx=L)
    assert rel_err(want, forward(m, toks, logn_ctx=L)).max() > 10 * TOL  # k = 1 would be plain RoPE
    assert_close(got, want, f"{arch} yarn in file + ntk-mixed auto k + logn")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ntk_method_replaces_stock_scaling_dynamic_by_default(tmp_path, arch):
    """The same overrides without the dynamic key: dynamic k (the library's default), with L the
    original context 64 (not context_length 256): k = 1 right after creation and at n = 64, k = 2
    at n = 65 (with L = 256 it would still be 1)."""
    require_patched()
    import llama_cpp

    from ggufrope import runtime

    runtime.require_dynamic("this test")  # GGUFRopeError on a stale build without dynamic k
    m = write(tmp_path, arch, "yarn")
    toks = tokens_for(m, L + 1)
    llm = llama_cpp.Llama(model_path=str(m.path), n_ctx=N_CTX, n_batch=L, n_ubatch=L, type_k=0, type_v=0,
                          flash_attn=False, n_threads=2, n_threads_batch=2, verbose=False,
                          kv_overrides=_overrides(arch, "ntk-mixed", None, None, True))
    try:
        assert_dynamic_k_steps_after(llm, toks, L)
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_ntk_method_from_file_keys_replaces_stock_scaling(tmp_path, arch):
    """The same when the ggufrope keys are in the file (``ggufrope set`` on a YaRN GGUF)."""
    require_patched()
    kv = scaling_kv("yarn") | _overrides(arch, "ntk-mixed", FACTOR, B, True)
    m = WRITERS[arch](tmp_path / "set.gguf", seed=41, n_ctx_train=N_CTX_TRAIN, extra_kv=kv)
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, n_ctx=N_CTX)
    assert_close(got, forward(m, toks, method="ntk-mixed", k=FACTOR, b=B, logn_ctx=L), f"{arch} yarn + ntk-mixed keys in file")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_linear_in_file_kept_with_logn_only(tmp_path, arch):
    """Method none + log-n keeps the file's linear scaling: the reference's PI (k = 4) with
    log-n at L = 64."""
    require_patched()
    m = write(tmp_path, arch, "linear")
    toks = tokens_for(m)
    got = run_llama_cpp(m, toks, n_ctx=N_CTX, kv_overrides=_overrides(arch, "none", None, None, True))
    assert_close(got, forward(m, toks, method="linear", k=FACTOR, logn_ctx=L), f"{arch} linear in file + none + logn")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_yarn_in_file_kept_with_logn_only(tmp_path, arch):
    """Method none + log-n keeps the file's YaRN. YaRN is not in the torch reference, so:
    (1) it equals stock YaRN chosen at load time (``rope_scaling_type`` yarn, freq_scale 1/4,
    yarn_orig_ctx 64) on the same weights in a file without scaling keys, with the same log-n;
    (2) below L it is bit-identical to the yarn file run without any ggufrope key (s(p) = 1);
    (3) beyond L log-n changes it; (4) it is far from plain RoPE + log-n (YaRN was not dropped)."""
    require_patched()
    m = write(tmp_path, arch, "yarn")
    bare = write(tmp_path, arch, None)
    toks = tokens_for(m)
    kv = _overrides(arch, "none", None, None, True)
    got = run_llama_cpp(m, toks, n_ctx=N_CTX, kv_overrides=kv)
    at_load = run_llama_cpp(bare, toks, n_ctx=N_CTX, kv_overrides=kv, rope_scaling_type=2,
                            rope_freq_scale=1.0 / FACTOR, yarn_orig_ctx=L)
    assert_close(got, at_load, f"{arch} yarn in file + logn vs yarn at load + logn")
    stock = run_llama_cpp(m, toks, n_ctx=N_CTX)
    assert np.array_equal(got[:L], stock[:L])
    assert rel_err(got[L:], stock[L:]).max() > 10 * TOL
    assert rel_err(got, forward(m, toks, logn_ctx=L)).max() > 10 * TOL
