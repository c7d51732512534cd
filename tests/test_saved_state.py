"""Saved state carries the rope configuration (issue 12, part 7).

Keys are cached after RoPE, so a saved state (``Llama.save_state``, ``llama_state_get_data``,
``LlamaRAMCache`` / ``LlamaDiskCache``, the per-sequence ``llama_state_seq_*``) holds keys
rotated with one table. The automatic k depends on n_ctx (k = n_ctx_seq / L), so restoring into
another context may mix keys of one table with queries of another, silently. Rule: the state
carries the rope configuration (method, k, b, log-n, L); restoring it into a context whose
configuration differs fails (``llama_state_set_data`` returns 0, llama-cpp-python raises
``RuntimeError("Failed to set llama state data")``) with a message in llama.cpp's log that
names both configurations; restoring into the same configuration works and gives the next
token's logits of the context that saved it.

Tiny llama, L = 64; llama.cpp pads n_ctx to a multiple of 256, so the contexts here are 512
(auto k = 8) and 256 (auto k = 4). The static automatic k needs ``{arch}.rope.ntk.dynamic``
false (``mixed()`` sets it): without the key the library runs dynamic k, whose k follows the
cached positions rather than n_ctx (the last tests here).
"""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from test_reference_forward import _overrides, assert_close, rel_err, tokens_for
from tiny_models import assert_dynamic_k_steps_after, write_tiny_llama, write_tiny_qwen2
from torch_reference import forward

L = 64
N_PREFIX = 150


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("state")
    return {"llama": write_tiny_llama(d / "llama.gguf", seed=51), "qwen2": write_tiny_qwen2(d / "qwen2.gguf", seed=52)}


def make(m, n_ctx: int, kv: dict | None, verbose: bool = False):
    """A context on ``m``. ``verbose=True`` where llama.cpp's error log must be seen: llama-cpp-python
    0.3.36's log callback maps ggml's current level numbers with the old table, so with
    ``verbose=False`` it prints WARN lines but drops ERROR ones."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(m.path), n_ctx=n_ctx, n_batch=64, n_ubatch=64, logits_all=True,
                          type_k=0, type_v=0, n_threads=2, verbose=verbose, kv_overrides=kv)
    assert llm.n_ctx() == n_ctx, "n_ctx is padded to a multiple of 256: use 256 or 512"
    return llm


def mixed(arch: str, *, b: float | None = None, logn: bool = False, k: float | None = None,
          dynamic: bool | None = False) -> dict:
    """ntk-mixed by kv overrides; no factor: the static automatic k (dynamic false; ``dynamic``
    None leaves the key out, the library's default: dynamic k)."""
    return _overrides(arch, "ntk-mixed", k, b, logn, dynamic=dynamic)


def saved(m, n_ctx: int, kv: dict, toks: list[int]):
    """Evaluate ``toks[:-1]`` at ``n_ctx``, save the state, then the last token: (state, its logits)."""
    llm = make(m, n_ctx, kv)
    try:
        llm.eval(toks[:-1])
        state = llm.save_state()
        llm.eval(toks[-1:])
        return state, np.array(llm.scores[len(toks) - 1], dtype=np.float64)
    finally:
        llm.close()


def check_refusal_message(err: str, saved_cfg: list[str], this_cfg: list[str]) -> None:
    """llama.cpp's log (a verbose context's stderr) has a ggufrope line about the state that
    names both configurations."""
    lines = [ln for ln in err.splitlines() if "ggufrope" in ln and "state" in ln]
    assert lines, f"no ggufrope message about the state in llama.cpp's log:\n{err[-3000:]}"
    text = " ".join(lines)
    for pat in saved_cfg + this_cfg:
        assert re.search(pat, text), f"{pat!r} not in {text!r}"


# ----------------------------------------------------------------------------- same configuration: restored


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("logn", [False, True], ids=["no-logn", "logn"])
def test_state_restores_into_same_configuration(models, arch, logn):
    m = models[arch]
    toks = tokens_for(m, N_PREFIX + 1, seed=8)
    kv = mixed(arch, logn=logn)
    state, want = saved(m, 512, kv, toks)
    # the saving context computed the method: ntk-mixed at auto k = 512 / 64 = 8
    ref = forward(m, toks, method="ntk-mixed", k=8.0, logn_ctx=L if logn else 0)[-1]
    assert_close(want[None], ref[None], f"{arch} k = 8 next-token logits vs reference")

    llm = make(m, 512, kv)
    try:
        llm.load_state(state)
        llm.eval(toks[-1:])
        got = np.array(llm.scores[N_PREFIX], dtype=np.float64)
    finally:
        llm.close()
    assert_close(got[None], want[None], f"{arch} restored state, same configuration", tol=1e-6)
    # the restored cache is what made it: the last token alone gives other logits
    alone = make(m, 512, kv)
    try:
        alone.eval(toks[-1:])
        assert rel_err(np.array(alone.scores[0])[None], want[None]).max() > 1e-2
    finally:
        alone.close()


# ----------------------------------------------------------------------------- another configuration: refused

# (name, saving (n_ctx, overrides), restoring (n_ctx, overrides), patterns naming the saved and
# the restoring configuration in llama.cpp's message)
REFUSALS = {
    "auto-k": ((512, dict()), (256, dict()), [r"k\s*=\s*8(\.0+)?\b"], [r"k\s*=\s*4(\.0+)?\b"]),
    "method": ((256, dict(method="none")), (256, dict()), [r"\bnone\b"], [r"ntk-mixed"]),
    "exponent": ((256, dict(b=0.75)), (256, dict(b=0.5)), [r"0\.75\b"], [r"0\.5\b"]),
    "logn": ((256, dict(logn=True)), (256, dict(logn=False)), [r"log-?n\W+on\b"], [r"log-?n\W+off\b"]),
}


def _kv(arch: str, spec: dict) -> dict:
    spec = dict(spec)
    if spec.pop("method", "ntk-mixed") == "none":
        return _overrides(arch, "none", None, None, spec.get("logn", False))
    return mixed(arch, **spec)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_state_refused_into_other_configuration(models, capfd, case):
    (n_save, spec_save), (n_load, spec_load), pat_saved, pat_this = REFUSALS[case]
    m = models["llama"]
    toks = tokens_for(m, N_PREFIX + 1, seed=9)
    state, _ = saved(m, n_save, _kv("llama", spec_save), toks)
    llm = make(m, n_load, _kv("llama", spec_load), verbose=True)
    try:
        capfd.readouterr()
        with pytest.raises(RuntimeError, match="Failed to set llama state data"):
            llm.load_state(state)
        check_refusal_message(capfd.readouterr().err, pat_saved, pat_this)
        # the context still works after the refusal: a fresh evaluation gives its own method
        llm.reset()
        llm.eval(toks)
        got = np.array(llm.scores[: len(toks)], dtype=np.float64)
    finally:
        llm.close()
    fresh = make(m, n_load, _kv("llama", spec_load))
    try:
        fresh.eval(toks)
        assert_close(got, np.array(fresh.scores[: len(toks)], dtype=np.float64), f"{case}: context usable after refusal", tol=1e-6)
    finally:
        fresh.close()


def test_seq_state_refused_into_other_auto_k(models, capfd):
    """``llama_state_seq_get_data`` / ``llama_state_seq_set_data`` (one sequence): 0 = refused."""
    import llama_cpp

    m = models["llama"]
    toks = tokens_for(m, N_PREFIX, seed=10)
    src = make(m, 512, mixed("llama"))
    try:
        src.eval(toks)
        ctx = src._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        n = llama_cpp.llama_state_seq_get_data(ctx, buf, size, 0)
        assert 0 < n <= size
    finally:
        src.close()
    same = make(m, 512, mixed("llama"))
    other = make(m, 256, mixed("llama"), verbose=True)
    try:
        assert llama_cpp.llama_state_seq_set_data(same._ctx.ctx, buf, n, 0) == n
        capfd.readouterr()
        assert llama_cpp.llama_state_seq_set_data(other._ctx.ctx, buf, n, 0) == 0
        check_refusal_message(capfd.readouterr().err, [r"k\s*=\s*8(\.0+)?\b"], [r"k\s*=\s*4(\.0+)?\b"])
    finally:
        same.close()
        other.close()


# ----------------------------------------------------------------------------- the caches


@pytest.fixture(params=["ram", "disk"])
def cache(request, tmp_path):
    import llama_cpp

    if request.param == "ram":
        return llama_cpp.LlamaRAMCache()
    return llama_cpp.LlamaDiskCache(cache_dir=str(tmp_path / "cache"))


def test_cache_restores_same_configuration(models, cache):
    m = models["qwen2"]
    toks = tokens_for(m, N_PREFIX + 1, seed=11)
    state, want = saved(m, 512, mixed("qwen2", logn=True), toks)
    cache[toks[:-1]] = state
    llm = make(m, 512, mixed("qwen2", logn=True))
    try:
        llm.load_state(cache[toks[:-1]])
        llm.eval(toks[-1:])
        got = np.array(llm.scores[N_PREFIX], dtype=np.float64)
    finally:
        llm.close()
    assert_close(got[None], want[None], "cache round trip, same configuration", tol=1e-6)


def test_cache_refused_in_completion(models, cache, capfd):
    """The served path: ``create_completion`` with a shared cache. A context at n_ctx 512
    (k = 8) fills the cache; one at n_ctx 256 (k = 4) finds the prefix there and must refuse
    it instead of decoding on keys rotated with the other table."""
    m = models["qwen2"]
    toks = tokens_for(m, 100, seed=12)
    a = make(m, 512, mixed("qwen2"))
    try:
        a.set_cache(cache)
        a.create_completion(toks, max_tokens=2, temperature=0.0)
    finally:
        a.close()
    b = make(m, 256, mixed("qwen2"), verbose=True)
    try:
        b.set_cache(cache)
        capfd.readouterr()
        with pytest.raises(RuntimeError, match="Failed to set llama state data"):
            b.create_completion(toks, max_tokens=2, temperature=0.0)
        check_refusal_message(capfd.readouterr().err, [r"k\s*=\s*8(\.0+)?\b"], [r"k\s*=\s*4(\.0+)?\b"])
    finally:
        b.close()


# ----------------------------------------------------------------------------- without the dynamic key: dynamic k


def test_no_dynamic_key_runs_dynamic_k(models):
    """``mixed()`` without ``{arch}.rope.ntk.dynamic``: dynamic k (the library's default), k = 1
    right after creation and at n = 64, 2 at n = 65, whatever n_ctx."""
    m = models["llama"]
    toks = tokens_for(m, L + 1, seed=13)
    for n_ctx in (256, 512):
        llm = make(m, n_ctx, mixed("llama", dynamic=None))
        try:
            assert_dynamic_k_steps_after(llm, toks, L)
        finally:
            llm.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dynamic_state_restores_across_n_ctx(models, arch):
    """Dynamic k depends on the cached positions, not on n_ctx: a state of 150 positions saved at
    n_ctx 512 (k = 4: 128 < 150 <= 256) is restored into a context at n_ctx 256 (k = 4 for the
    same 150 positions), and the next token's logits are those of the saving context. (The
    static automatic k refuses this: test_state_refused_into_other_configuration, auto-k.)"""
    from ggufrope import runtime

    m = models[arch]
    toks = tokens_for(m, N_PREFIX + 1, seed=14)
    kv = mixed(arch, dynamic=None)
    src = make(m, 512, kv)
    try:
        src.eval(toks[:-1])
        assert runtime.factor_in_use(src) == 4.0
        state = src.save_state()
        src.eval(toks[-1:])
        want = np.array(src.scores[N_PREFIX], dtype=np.float64)
    finally:
        src.close()
    llm = make(m, 256, kv)
    try:
        assert runtime.factor_in_use(llm) == 1.0
        llm.load_state(state)
        assert runtime.factor_in_use(llm) == 4.0
        llm.eval(toks[-1:])
        got = np.array(llm.scores[N_PREFIX], dtype=np.float64)
    finally:
        llm.close()
    assert_close(got[None], want[None], f"{arch} dynamic state, n_ctx 512 -> 256", tol=1e-6)
