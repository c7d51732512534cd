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

from ggufrope.evaluation import cache as EC, decoder as ED, grid as EG, ppl as EP, units as EU


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


# --- a retrieval unit stopped part-way resumes at its next sample ------------------------------------


def test_each_build_keeps_its_own_partial_file(tmp_path):
    """Two builds (a lent GPU's, this CPU's) stopped in the same unit keep their samples in two
    files, ``<unit file>.<12 hex>.partial``, each read back only by its build; storing the unit
    removes both, and nothing else in the cache."""
    cache = EC.Cache(tmp_path)
    key = {"kind": "ruler", "method": "linear", "logn": False, "n_ctx": 131072, "task": "niah_single"}
    cpu = {"library": "a" * 16, "ggufrope_patch": "1", "backend": "CPU", "flash_attn": True, "n_ubatch": 512}
    gpu = {**cpu, "library": "b" * 16, "backend": "CUDA"}
    cache.put_partial(key, cpu, {0: {"answer": "cpu 0"}, 1: {"answer": "cpu 1"}}, 60.0)
    cache.put_partial(key, gpu, {0: {"answer": "gpu 0"}}, 2.5)
    cache.put_partial(key, cpu, {0: {"answer": "cpu 0"}, 1: {"answer": "cpu 1"}, 2: {"answer": "cpu 2"}}, 90.0)
    paths = cache.partial_paths(key)
    unit = cache.path(key).name
    assert len(paths) == 2 and all(re.fullmatch(re.escape(unit) + r"\.[0-9a-f]{12}\.partial", p.name) for p in paths)
    assert cache.partial_path(key, cpu) != cache.partial_path(key, gpu) and set(paths) == {
        cache.partial_path(key, cpu), cache.partial_path(key, gpu)}
    assert cache.read_partial(key, cpu) == ({0: {"answer": "cpu 0"}, 1: {"answer": "cpu 1"}, 2: {"answer": "cpu 2"}}, 90.0)
    assert cache.read_partial(key, gpu) == ({0: {"answer": "gpu 0"}}, 2.5)
    assert cache.read_partial(key, {**cpu, "n_ubatch": 256}) == ({}, 0.0)
    other = {**key, "method": "yarn"}  # another unit's partial file stays
    cache.put_partial(other, cpu, {0: {"answer": "x"}}, 1.0)
    cache.put(key, {"rows": []}, gpu)
    assert not cache.partial_paths(key) and cache.partial_paths(other) == [cache.partial_path(other, cpu)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([unit, cache.partial_path(other, cpu).name])


def test_other_partials_lists_other_builds_files_most_samples_first(tmp_path):
    """:meth:`Cache.other_partials`: every other build's partial file of the unit (not this
    build's, not another unit's, not an unreadable one), the one with the most samples first."""
    cache = EC.Cache(tmp_path)
    key = {"kind": "ruler", "method": "ntk", "logn": False, "n_ctx": 131072, "task": "vt"}
    cpu = {"library": "a" * 16, "backend": "CPU"}
    amx = {"library": "b" * 16, "backend": "CPU"}
    gpu = {"library": "c" * 16, "backend": "CUDA"}
    cache.put_partial(key, cpu, {0: {"answer": "own"}}, 1.0)
    cache.put_partial(key, amx, {1: {"answer": "amx 1"}}, 30.0)
    cache.put_partial(key, gpu, {1: {"answer": "gpu 1"}, 5: {"answer": "gpu 5"}}, 2.0)
    cache.put_partial({**key, "method": "yarn"}, amx, {7: {"answer": "other unit"}}, 3.0)
    cache.partial_path(key, {"library": "broken"}).write_text("{not json")
    assert cache.other_partials(key, cpu) == [(gpu, {1: {"answer": "gpu 1"}, 5: {"answer": "gpu 5"}}, 2.0),
                                              (amx, {1: {"answer": "amx 1"}}, 30.0)]
    theirs = cache.other_partials(key, gpu)  # a tie in samples: both, in file-name order
    assert len(theirs) == 2 and {b["library"] for b, _, _ in theirs} == {"a" * 16, "b" * 16}
    assert cache.other_partials({**key, "method": "linear"}, cpu) == []


def test_unit_build_label_names_each_build_of_a_mixed_unit():
    """A unit answered by one build is counted under that build; one whose samples several builds
    answered (``sample_builds``) under one label naming each with its count, joined by " + " (a
    report joins its builds with "; ", and a build's name holds commas)."""
    a = {"library": "a" * 16, "ggufrope_patch": "0.1.0", "backend": "CPU", "flash_attn": True, "n_ubatch": 512}
    b = {**a, "library": "b" * 16}
    assert EU.unit_build_label(a, {"score": 0.0}) == EC.build_id(a)
    assert EU.unit_build_label(a, {"sample_builds": {EC.build_id(a): 10}}) == EC.build_id(a)
    label = EU.unit_build_label(a, {"sample_builds": {EC.build_id(b): 9, EC.build_id(a): 1}})
    assert label == ("samples of several builds (llama.cpp aaaaaaaaaaaaaaaa (patch 0.1.0), CPU, flash-attn on, "
                     "n_ubatch 512: 1 sample + llama.cpp bbbbbbbbbbbbbbbb (patch 0.1.0), CPU, flash-attn on, "
                     "n_ubatch 512: 9 samples)")


def test_legacy_partial_file_is_resumed_by_its_build_and_removed_with_the_unit(tmp_path):
    """A ``<unit file>.partial`` of the one-file-per-unit layout (before b0dd2c3; same content)
    is read by the build recorded in it until that build has a file of its own name, never by
    another build, and removed when the unit is stored."""
    cache = EC.Cache(tmp_path)
    key = {"kind": "passkey", "method": "linear", "logn": True, "n_ctx": 131072}
    cpu = {"library": "a" * 16, "ggufrope_patch": "1", "backend": "CPU", "flash_attn": True, "n_ubatch": 512}
    gpu = {**cpu, "library": "b" * 16, "backend": "CUDA"}
    legacy = tmp_path / (cache.path(key).name + ".partial")  # the old name, written as the old code did
    legacy.write_text(json.dumps({"key": key, "build": cpu, "wall_s": 1038.5,
                                  "rows": {"0": {"answer": " 56930."}, "1": {"answer": " the pass key."}}}))
    assert cache.partial_paths(key) == [legacy]
    assert cache.read_partial(key, cpu) == ({0: {"answer": " 56930."}, 1: {"answer": " the pass key."}}, 1038.5)
    assert cache.read_partial(key, gpu) == ({}, 0.0)  # another build never takes its samples
    cache.put_partial(key, cpu, {0: {"answer": " 56930."}, 1: {"answer": " the pass key."}, 2: {"answer": " 1."}}, 2000.0)
    assert cache.read_partial(key, cpu)[1] == 2000.0  # its own file now, not the legacy one
    assert legacy.exists() and len(cache.partial_paths(key)) == 2
    cache.put(key, {"rows": []}, cpu)
    assert sorted(p.name for p in tmp_path.iterdir()) == [cache.path(key).name]


class _Stop(Exception):
    pass


class _StoppingCache(EC.Cache):
    """A cache that stops the run (as a kill would) right after the unit's partial file holds
    ``after`` samples."""

    def __init__(self, root, after: int):
        super().__init__(root)
        self.after = after

    def put_partial(self, key, build, rows, wall_s):
        super().put_partial(key, build, rows, wall_s)
        if self.after is not None and len(rows) == self.after:
            raise _Stop


@pytest.mark.real_model
@pytest.mark.parametrize("kind", ["niah_single", "passkey"])
def test_a_stopped_retrieval_unit_resumes_at_its_next_sample(patched_lib, smollm2, tmp_path, kind):
    """A retrieval unit keeps each answered sample in ``<unit>.partial``; run again with the same
    build it answers only the samples not kept (a kept row planted with another answer stays in
    the unit: it was not answered again), its answers are those of an uninterrupted run, and the
    partial file is gone once the unit is stored. A partial file of another build is ignored."""
    import os

    st, n_ctx, n = ED.Setting("none"), 1024, 4
    threads = os.cpu_count() or 1

    runners = []

    def run(cache, log=None, any_build=False):
        with EU.UnitRunner(smollm2, cache, threads=threads, progress=False, log=log, any_build=any_build) as ur:
            runners.append(ur)
            if kind == "passkey":
                key = ur.passkey_key(st, n_ctx, n, 0, [0.0, 0.25, 0.5, 0.75, 1.0], ED.DEFAULT_N_GEN)
                r = ur.passkey(st, n_ctx, trials=n, seed=0, depths=[0.0, 0.25, 0.5, 0.75, 1.0], n_gen=ED.DEFAULT_N_GEN)
            else:
                key = ur.ruler_key(st, n_ctx, kind, n, 0)
                r = ur.ruler(st, n_ctx, kind, samples=n, seed=0)
            return r, ur.stats, key

    full, stats, key = run(EC.Cache(tmp_path / "a"))
    assert stats.computed == 1 and not EC.Cache(tmp_path / "a").partial_paths(key)
    answers = [r["answer"] for r in full["rows"]]

    cache = EC.Cache(tmp_path / "b")
    with pytest.raises(_Stop):
        run(_StoppingCache(tmp_path / "b", after=2))
    assert not cache.path(key).exists()
    build = EC.build_info(0, EU.FLASH_ATTN, ED.batch_sizes(512, None, n_ctx)[1])
    kept, wall = cache.read_partial(key, build)
    assert len(kept) == 2 and wall > 0
    planted = min(kept)
    kept[planted] = {**kept[planted], "answer": "planted"}
    cache.put_partial(key, build, kept, wall)
    assert cache.read_partial(key, {**build, "library": "0" * 16}) == ({}, 0.0)  # another build's: none

    log: list[str] = []
    res, stats, _ = run(cache, log.append)
    assert stats.computed == 1 and any(line.startswith("resuming ") and "2 samples done" in line for line in log), log
    got = [r["answer"] for r in res["rows"]]
    assert got[planted] == "planted"
    assert [a for i, a in enumerate(got) if i != planted] == [a for i, a in enumerate(answers) if i != planted]
    assert [res["rows"][i]["seconds"] for i in sorted(kept)] == [kept[i]["seconds"] for i in sorted(kept)]
    assert res["wall_s"] > wall
    assert cache.path(key).exists() and not cache.partial_paths(key)

    # a partial file of another build: every sample answered again, and its file kept while
    # this build's samples are saved beside it (gone with both once the unit is stored)
    cache_c = _StoppingCache(tmp_path / "c", after=1)
    other = {**build, "library": "0" * 16}
    cache_c.put_partial(key, other, kept, wall)
    with pytest.raises(_Stop):
        run(cache_c)
    assert len(cache_c.partial_paths(key)) == 2 and cache_c.read_partial(key, other) == (kept, wall)
    cache_c.after = None
    res_c, _, _ = run(cache_c)
    assert [r["answer"] for r in res_c["rows"]] == answers and not cache_c.partial_paths(key)
    assert "sample_builds" not in res_c and all("build" not in r for r in res_c["rows"])

    # with any_build the samples of another build's partial file are taken (not answered again)
    # where this build's own file lacks them: each taken row names the build that answered it,
    # the unit counts its samples per build, and the runner counts it as a unit of several builds
    cache_d = EC.Cache(tmp_path / "d")
    a, b = 0, n - 1
    cache_d.put_partial(key, build, {a: {**full["rows"][a], "answer": "own"}}, 10.0)
    cache_d.put_partial(key, other, {a: {**full["rows"][a], "answer": "theirs a"},
                                     b: {**full["rows"][b], "answer": "theirs b"}}, 20.0)
    log = []
    res_d, stats, _ = run(cache_d, log.append, any_build=True)
    got = dict(enumerate(res_d["rows"]))  # rows in sample order, for both kinds
    assert got[a]["answer"] == "own" and "build" not in got[a]
    assert got[b]["answer"] == "theirs b" and got[b]["build"] == other
    assert [got[i]["answer"] for i in range(n) if i not in (a, b)] == [answers[i] for i in range(n) if i not in (a, b)]
    assert all("build" not in got[i] for i in range(n) if i != b)
    assert res_d["sample_builds"] == {EC.build_id(build): n - 1, EC.build_id(other): 1}
    assert res_d["wall_s"] > 10.0 + full["rows"][b]["seconds"]  # one of their two samples: its own seconds
    assert any("1 samples of another build" in line for line in log), log
    assert stats.computed == 1 and not cache_d.partial_paths(key)
    assert list(runners[-1].builds) == [EU.unit_build_label(build, res_d)]
    assert EU.unit_build_label(build, res_d).startswith("samples of several builds (")
    assert EU.unit_build_label(build, res_c) == EC.build_id(build)
