"""ggufrope/evaluation/cache.py on tiny models: the library build in the cache (issue 15, item 4).

:func:`ggufrope.evaluation.cache.build_info` names the llama.cpp libraries, patch, backend,
flash attention and n_ubatch; a cached unit whose stored build differs is recomputed in compute
mode (and overwritten) and read with report_only; one with the same build is reused without
loading a model.
"""

from __future__ import annotations

import json
import re

import pytest

from ggufrope.evaluation import cache as EC, decoder as ED, grid as EG, ppl as EP


# --- the build in the cache -------------------------------------------------------------------------


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


def test_backend_is_cpu_with_layers_offloaded_to_a_cpu_only_build(patched_lib):
    """``-ngl -1`` on a library without a GPU backend computes on the CPU: the build says so,
    although ``llama_supports_gpu_offload`` is true there (llama-cpp-python builds the RPC
    backend, which counts as offload)."""
    import glob
    import os

    import llama_cpp
    import llama_cpp.llama_cpp as lc

    from ggufrope import runtime

    libdir = os.path.dirname(os.path.realpath(lc._lib._name))
    gpu_libs = [p for p in glob.glob(os.path.join(libdir, "libggml-*.so*"))
                if re.search(r"libggml-(cuda|hip|vulkan|metal|sycl|musa|opencl)", p)]
    if gpu_libs:
        pytest.skip(f"a GPU build ({os.path.basename(gpu_libs[0])}): the case of this test does not arise")
    assert not runtime.has_gpu() and EC.build_info(-1, True, 128)["backend"] == "CPU"
    if glob.glob(os.path.join(libdir, "libggml-rpc.so*")):
        assert llama_cpp.llama_supports_gpu_offload()  # why has_gpu exists


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

    # ... any_build uses it in compute mode too: nothing computed, no model loaded, the unit kept ...
    res3b, st = _grid(tiny, out, any_build=True)
    assert (st.computed, st.cached, st.models_loaded, st.stale) == (0, 1, 0, 0)
    assert res3b["cells"] == res["cells"] and res3b["builds"] == {EC.build_id(other): 1}
    assert json.loads(unit.read_text())["build"] == other

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
