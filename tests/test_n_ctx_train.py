"""The training context the patched library reports once a context runs an NTK-family method.

llama-server caps every slot at ``llama_model_n_ctx_train`` (upstream lifts it only for a custom
YaRN scale, by re-adjusting n_ctx_train when the context is created). patches/0006 does the same
for the ggufrope methods, with the cap defined as:

- fixed k (the file's factor): k * L, so a context larger than k * L is capped there (the positions
  beyond k * L are outside what the table was made for, as for YaRN);
- auto k (static): k = max(1, n_ctx_seq / L), so k * L = n_ctx_seq: no cap;
- dynamic k: the k the schedule reaches for a full context (the smallest r^e with r^e * L >= n_ctx_seq),
  times L: at least n_ctx_seq, so no cap;
- method none (log-n alone) and files without ggufrope keys: L, unchanged.

Tiny random llama, L = 64; n_ctx_seq is n_ctx rounded up to a multiple of 256.
"""

from __future__ import annotations

import pytest

from ggufrope import keys as Kk
from tiny_models import write_tiny_llama

L = 64


def _n_ctx_train(path, n_ctx: int, **kv) -> tuple[int, int]:
    import llama_cpp

    overrides = {Kk.key(getattr(Kk, name), "llama"): v for name, v in kv.items()}
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_threads=1, verbose=False,
                          kv_overrides=overrides or None)
    try:
        return llama_cpp.llama_model_n_ctx_train(llm._model.model), llm.n_ctx()
    finally:
        llm.close()


@pytest.mark.parametrize(
    "kv, n_ctx, expected",
    [
        ({}, 256, L),  # no method
        ({"KEY_METHOD": "none", "KEY_LOGN": True}, 256, L),  # log-n alone
        ({"KEY_METHOD": "ntk-mixed", "KEY_FACTOR": 4.0, "KEY_EXPONENT": 0.625}, 256, 4 * L),
        ({"KEY_METHOD": "ntk-mixed", "KEY_FACTOR": 2.0, "KEY_EXPONENT": 0.625}, 256, 2 * L),  # capped at k L
        ({"KEY_METHOD": "ntk-mixed", "KEY_FACTOR": 1.5, "KEY_EXPONENT": 0.625}, 256, 96),
        ({"KEY_METHOD": "ntk", "KEY_DYNAMIC": False}, 512, 512),  # auto: k = 512 / 64
        ({"KEY_METHOD": "ntk-fixed", "KEY_DYNAMIC": False}, 200, 256),  # n_ctx_seq = 256
        ({"KEY_METHOD": "ntk-mixed"}, 256, 256),  # dynamic (the default), ratio 2: k_max = 4
        ({"KEY_METHOD": "ntk-mixed", "KEY_DYNAMIC_RATIO": 3.0}, 256, 9 * L),  # 3^2 >= 256 / 64
        ({"KEY_METHOD": "ntk", "KEY_DYNAMIC": True}, 768, 1024),  # k_max = 16 >= 12
    ],
    ids=["plain", "logn-only", "fixed-4", "fixed-2-caps", "fixed-1.5", "auto-512", "auto-200", "dynamic",
         "dynamic-ratio-3", "dynamic-768"],
)
def test_reported_training_context(tmp_path, patched_lib, kv, n_ctx, expected):
    m = write_tiny_llama(tmp_path / "m.gguf", seed=2)
    n_ctx_train, n_ctx_got = _n_ctx_train(m.path, n_ctx, **kv)
    assert n_ctx_train == expected, (kv, n_ctx, n_ctx_got)


def test_the_model_file_is_not_rewritten_and_L_stays(tmp_path, patched_lib):
    """The re-adjustment lives in the loaded model only: L (the table's n_ctx_orig) is unchanged, so a
    second context on the same model computes the same k."""
    import llama_cpp

    from ggufrope.gguf_reader import read_header
    from ggufrope.runtime import factor_in_use

    m = write_tiny_llama(tmp_path / "m.gguf", seed=2)
    before = m.path.read_bytes()
    kv = {Kk.key(Kk.KEY_METHOD, "llama"): "ntk-mixed", Kk.key(Kk.KEY_DYNAMIC, "llama"): False}
    llm = llama_cpp.Llama(model_path=str(m.path), n_ctx=512, n_threads=1, verbose=False, kv_overrides=kv)
    try:
        assert llama_cpp.llama_model_n_ctx_train(llm._model.model) == 512
        ctx2 = llama_cpp.llama_init_from_model(llm._model.model, llama_cpp.llama_context_default_params())
        try:
            # n_ctx 0: the (re-adjusted) training context, 512 -> auto k = 512 / L = 8, as for the first
            assert llama_cpp.llama_n_ctx(ctx2) == 512
            assert factor_in_use(ctx2) == pytest.approx(8.0)
            assert factor_in_use(llm) == pytest.approx(8.0)
        finally:
            llama_cpp.llama_free(ctx2)
    finally:
        llm.close()
    assert m.path.read_bytes() == before
    assert read_header(m.path).value("llama.context_length") == L
