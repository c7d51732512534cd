"""The evaluation's cache key and the two small additions of issue 15, item 4, on tiny models.

a. Within-L perplexity: :func:`ggufrope.evaluation.ppl.summarize_windows` pools the tokens
   predicted from positions p < L (all scored tokens less those beyond L), numbers by hand.
b. A constant attention scale s (``Setting.attn_factor``, llama.cpp's ``yarn_attn_factor``):
   llama.cpp's logits are the torch reference's with every attention logit multiplied by s²;
   a unit key with s != 1 differs, one with s = 1 is the key of before.
c. The library build in the cache: :func:`ggufrope.evaluation.cache.build_info` names the
   llama.cpp libraries, patch, backend, flash attention and n_ubatch; a cached unit whose
   stored build differs is recomputed in compute mode (and overwritten) and read with
   report_only; one with the same build is reused without loading a model.
"""

from __future__ import annotations

import json
import math
import pathlib
import re

import numpy as np
import pytest

from ggufrope.errors import GGUFRopeError
from ggufrope.evaluation import cache as EC, decoder as ED, grid as EG, ppl as EP

L = 64  # n_ctx_train of the tiny models
FP = {"sha256": "ab" * 32, "size": 1234}


# --- a. within-L perplexity ---------------------------------------------------------------------


def test_summarize_windows_within_L_by_hand():
    ws = [
        {"nll": 10.0, "count": 8, "nll_beyond": 6.0, "count_beyond": 3, "seconds": 1.0},
        EP.WindowResult(1, 128, 5.0, 4, 5.0, 4, 0.5),  # every token beyond L
    ]
    s = EP.summarize_windows(ws)
    # all: 15 nats over 12 tokens; beyond: 11 over 7; within: 15 - 11 = 4 nats over 12 - 7 = 5
    assert (s["nll_within"], s["count_within"]) == (4.0, 5)
    assert s["ppl_within"] == pytest.approx(math.exp(0.8), rel=1e-15)
    assert s["ppl"] == pytest.approx(math.exp(1.25), rel=1e-15)
    assert s["ppl_beyond"] == pytest.approx(math.exp(11 / 7), rel=1e-15)
    only_beyond = EP.summarize_windows([ws[1]])
    assert only_beyond["ppl_within"] is None and only_beyond["count_within"] == 0
    only_within = EP.summarize_windows([{"nll": 3.0, "count": 2, "nll_beyond": 0.0, "count_beyond": 0, "seconds": 0}])
    assert only_within["ppl_within"] == only_within["ppl"] == pytest.approx(math.exp(1.5))
    assert only_within["ppl_beyond"] is None


# --- b. attention factor: key, label, checks ------------------------------------------------------


def test_attn_factor_key_and_label():
    old = {"eval_version": 1, "model": FP, "method": "ntk-mixed", "factor": 2.0, "exponent": 0.625, "logn": True,
           "n_ctx": 128, "n_ctx_orig": L}  # the key as written before attn_factor existed
    one = ED.Setting.for_grid("ntk-mixed", None, 0.625, True)
    assert EC.unit_key(one, 128, L, FP) == old
    assert EC.unit_key(ED.Setting("ntk-mixed", None, 0.625, True, attn_factor=1), 128, L, FP) == old
    s = ED.Setting.for_grid("ntk-mixed", None, 0.625, True, attn_factor=1.035)
    key = EC.unit_key(s, 128, L, FP)
    assert key == {**old, "attn_factor": 1.035} and key != old
    cache = EC.Cache.__new__(EC.Cache)
    cache.root = pathlib.Path("cache")
    assert cache.path({**key, "kind": "passkey"}) != cache.path({**old, "kind": "passkey"})
    assert s.label(128, L) == "ntk-mixed (b=0.625) k=2 + log-n attn×1.035"
    assert one.label(128, L) == "ntk-mixed (b=0.625) k=2 + log-n"
    assert s != one and hash(s) != hash(one)


def test_attn_factor_checks():
    for bad in (0, -1.0, float("nan"), float("inf"), "x"):
        with pytest.raises(GGUFRopeError, match="attention factor must be a number > 0"):
            ED.Setting("none", attn_factor=bad)
    with pytest.raises(GGUFRopeError, match="attention factor 1.1 with yarn: .* use 1 with yarn"):
        ED.Setting("yarn", 2.0, attn_factor=1.1)
    assert ED.Setting("yarn", 2.0, attn_factor=1).attn_factor == 1.0


# --- b. attention factor: llama.cpp against the torch reference -------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_models import write_tiny_llama

    extra = {"tokenizer.ggml.add_space_prefix": False}  # texts of the vocabulary's pieces t4..t9
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama.gguf", seed=7, extra_kv=extra)


def _logits(model, setting, toks):
    # F32 KV cache and no flash attention, as tests/test_reference_forward.py compares them
    llm = ED.load_model(model.path, setting, len(toks), n_batch=len(toks), threads=2, flash_attn=False,
                       type_k=0, type_v=0)
    with ED.Decoder(llm) as dec:
        buf = np.empty((len(toks), dec.n_vocab), dtype=np.float64)

        def take(rows, logits):
            buf[rows] = logits

        dec.clear()
        dec.decode(toks, 0, range(len(toks)), take)
    del llm
    return buf


def _rel_err(a, b):
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("method,k,logn", [("none", 1.0, False), ("ntk-mixed", 4.0, True)])
def test_attn_factor_scales_attention_logits_by_its_square(patched_lib, tiny, method, k, logn):
    from torch_reference import forward

    s = 1.3
    toks = np.random.default_rng(0).integers(4, tiny.n_vocab, size=4 * L).tolist()
    st = ED.Setting(method, k if method != "none" else None, logn=logn, attn_factor=s)
    got = _logits(tiny, st, toks)
    ref = forward(tiny, toks, method=method, k=k, logn_ctx=L if logn else 0, attn_logit_scale=s * s)
    plain = forward(tiny, toks, method=method, k=k, logn_ctx=L if logn else 0)
    err, moved = _rel_err(got, ref).max(), _rel_err(plain, ref).max()
    print(f"\n{st.label()}: max rel err {err:.2e} against the reference with logits x s^2; s = 1 is {moved:.2e} away")
    assert err <= 1e-3 and moved > 1e-2
    assert _rel_err(_logits(tiny, ED.Setting(method, k if method != "none" else None, logn=logn), toks),
                    plain).max() <= 1e-3


# --- c. the build in the cache -------------------------------------------------------------------------


def test_build_info_fields(patched_lib):
    from ggufrope import runtime

    b = EC.build_info(0, True, 128)
    assert set(b) == {"library", "ggufrope_patch", "backend", "flash_attn", "n_ubatch"}
    assert re.fullmatch(r"[0-9a-f]{16}", b["library"]) and b["library"] == EC.library_hash()
    assert b["ggufrope_patch"] == runtime.library_version() == patched_lib
    assert b["backend"] == "CPU" and b["flash_attn"] is True and b["n_ubatch"] == 128
    assert EC.build_info(0, False, 128) != b and EC.build_info(0, False, 128)["flash_attn"] is False
    assert EC.build_info(0, True, 64) != b and EC.build_info(0, True, 64)["n_ubatch"] == 64
    assert EC.build_info(0, True, 128) == b
    assert EC.build_id(b) == f"llama.cpp {b['library']} (patch {patched_lib}), CPU, flash-attn on, n_ubatch 128"
    assert EC.build_id(None) == "unrecorded"
    assert ED.batch_sizes(512, None, 128) == (128, 128) and ED.batch_sizes(512, 64, 4096) == (512, 64)


def _text() -> EP.Text:
    return EP.Text("pieces", "".join(f"t{4 + i % 6}" for i in range(300)))


def _grid(model, out, **kw):
    args = dict(n_ctxs=[128], methods=["none"], logn_modes=[False], texts=[_text()], max_windows=1, trials=0,
                out_dir=out, progress=False, threads=2)
    return EG.run_compare(model.path, **{**args, **kw})


def test_stale_build_is_recomputed_and_same_build_reused(patched_lib, tiny, tmp_path):
    out = tmp_path / "out"
    res, st = _grid(tiny, out)
    assert (st.computed, st.cached, st.models_loaded, st.stale) == (1, 0, 1, 0)
    (unit,) = sorted((out / "cache").glob("ppl-*.json"))
    obj = json.loads(unit.read_text())
    build = EC.build_info(0, True, 128)
    assert obj["build"] == build and "build" not in obj["key"]
    assert res["builds"] == {EC.build_id(build): 1}
    assert f"Units computed by: {EC.build_id(build)} (1 unit)." in (out / "results.md").read_text()
    cell = res["cells"][0]
    assert cell["ppl_within"] is None and cell["scored_tokens_within"] == 0  # n_ctx 128 = 2L: all scored beyond L
    assert cell["scored_tokens_beyond"] == cell["scored_tokens"] == 63

    # the same build: reused, no model loaded, the file untouched
    mtime = unit.stat().st_mtime_ns
    res2, st = _grid(tiny, out)
    assert (st.computed, st.cached, st.models_loaded, st.stale) == (0, 1, 0, 0)
    assert unit.stat().st_mtime_ns == mtime and res2["cells"] == res["cells"]

    # another build (another library, here a forged hash): report_only reads it ...
    other = {**build, "library": "0" * 16}
    unit.write_text(json.dumps({**obj, "build": other}))
    log: list[str] = []
    res3, st = _grid(tiny, out, report_only=True, log=log.append)
    assert (st.computed, st.cached, st.models_loaded, st.stale) == (0, 1, 0, 0)
    assert res3["cells"] == res["cells"] and res3["builds"] == {EC.build_id(other): 1}
    assert f"Units computed by: {EC.build_id(other)} (1 unit)." in (out / "results.md").read_text()
    assert json.loads(unit.read_text())["build"] == other  # report_only writes no unit

    # ... compute mode recomputes it (stale), overwrites it with this build, same numbers
    log.clear()
    res4, st = _grid(tiny, out, log=log.append)
    assert (st.computed, st.cached, st.models_loaded, st.stale) == (1, 0, 1, 1)
    assert any(line.startswith("stale (another build) none @ 128") for line in log), log
    assert json.loads(unit.read_text())["build"] == build
    assert res4["cells"] == res["cells"] and res4["units"]["stale"] == 1

    # a unit without a build (cached before builds were recorded): "unrecorded", stale when computing
    unit.write_text(json.dumps({k: v for k, v in obj.items() if k != "build"}))
    res5, st = _grid(tiny, out, report_only=True)
    assert st.cached == 1 and res5["builds"] == {"unrecorded": 1}
    _, st = _grid(tiny, out)
    assert (st.computed, st.stale) == (1, 1)

    # another n_ubatch is another build: the unit of n_ubatch 128 is stale for n_ubatch 64
    _, st = _grid(tiny, out, n_ubatch=64)
    assert (st.computed, st.stale) == (1, 1)
    assert json.loads(unit.read_text())["build"]["n_ubatch"] == 64
