"""The C drivers of the instruction-count benchmarks (bench/rope_op_callgrind.sh,
bench/decode_callgrind.sh) build against the patched headers and libraries and do what the
benchmark relies on, natively (valgrind itself is not run here):

* bench/decode_callgrind.c applies its kv overrides (the method reaches the library: log-n
  changes the logits beyond L and not below it, the NTK table changes them everywhere) and
  accepts a first position of 8192 on an empty sequence;
* bench/rope_op.c's count mode computes one case and refuses a variant its build lacks.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import compile_c


def _logit0(exe: Path, model: Path, p0: int, *method: str) -> float:
    r = subprocess.run([str(exe), str(model), "32", str(p0), "2", *method], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    m = re.fullmatch(r"ok \S+ n=32 p0=\d+ decodes=2 logit0=(\S+)\n", r.stdout)
    assert m, r.stdout
    return float(m.group(1))


@pytest.mark.real_model
def test_decode_driver_applies_the_method(patched_lib, tmp_path):
    from ggufrope.models import default_model_path

    model = default_model_path()
    exe = compile_c("bench/decode_callgrind.c", tmp_path / "decode_callgrind",
                    libs=("llama", "ggml-base", "ggml", "ggml-cpu"))
    mixed = ("ntk-mixed", "2", "0.625")
    below_on, below_off = _logit0(exe, model, 0, *mixed, "1"), _logit0(exe, model, 0, *mixed, "0")
    beyond_on, beyond_off = _logit0(exe, model, 8192, *mixed, "1"), _logit0(exe, model, 8192, *mixed, "0")
    plain_beyond = _logit0(exe, model, 8192)
    assert below_on == below_off  # log-n is 1 below L
    assert beyond_on != beyond_off  # and active beyond it, from position 8192 on
    assert beyond_off != plain_beyond  # the NTK table reached the rope
    r = subprocess.run([str(exe), str(model), "32", "0", "1", "rope9", "2", "0.625", "0"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and "cannot load" in r.stderr  # an invalid method is refused at load


def test_rope_op_count_mode(patched_lib, tmp_path):
    exe = compile_c("bench/rope_op.c", tmp_path / "rope_op", "-DGGUFROPE")
    r = subprocess.run([str(exe), "1", "64", "512", "2", "3"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "table+logn head_dim=64 n_tokens=512 computed 3 times\n", r.stdout + r.stderr
    r = subprocess.run([str(exe), "1", "64", "1", "3", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "variant 3 not in this build" in r.stderr


# ----------------------------------------------------------------------------- bench/benchlib.py and the Python benches

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _bench_module(name: str):
    """bench/NAME.py imported as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def benchlib():
    return _bench_module("benchlib")


def test_benchlib_statistics_by_hand(benchlib):
    assert benchlib.spread([3.0, 1.0, 2.0]) == "2.0 [1.0-3.0]"
    assert benchlib.spread([10.0, 30.0], ".2f") == "20.00 [10.00-30.00]"
    assert benchlib.paired_ratios([2.0, 3.0, 9.0], [1.0, 2.0, 3.0]) == [2.0, 1.5, 3.0]
    assert math.isnan(benchlib.median([]))
    with pytest.raises(ValueError, match="3 rounds against 2"):
        benchlib.paired_ratios([1.0, 2.0, 3.0], [1.0, 2.0])


def test_benchlib_run_and_record(benchlib, tmp_path):
    r = benchlib.run([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
                     check=False)
    assert (r["rc"], r["out"], r["err"]) == (3, "out\n", "err\n") and r["wall"] > 0 and r["rss_mb"] > 0
    with pytest.raises(SystemExit, match="failed \\(3\\)"):
        benchlib.run([sys.executable, "-c", "import sys; sys.exit(3)"])
    benchlib.write_record(tmp_path / "a" / "r.json", {"x": 1})
    rec = json.loads((tmp_path / "a" / "r.json").read_text())
    assert rec["x"] == 1 and rec["machine"]["cores"] == os.cpu_count() and rec["machine"]["mem_gb"] > 0
    assert {"filesystem", "device"} <= set(benchlib.machine(tmp_path))


def _bench(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_set_speed_controls_patch_what_the_writer_uses(tmp_path):
    """The reflink demo's two controls (root-only there) run here on a small file: the first
    places the data section off the source's offset modulo 4096, the second keeps it congruent;
    both write the same tensor data."""
    from conftest import write_test_gguf

    from ggufrope.gguf_reader import read_header

    sys.path.insert(0, str(BENCH))
    try:
        import set_speed
    finally:
        sys.path.remove(str(BENCH))
    src = write_test_gguf(tmp_path / "src.gguf")
    hs = read_header(src)
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    for code, congruent in ((set_speed.LIB_UNALIGNED, False), (set_speed.LIB_UNSPLIT, True)):
        dst = tmp_path / "dst.gguf"
        p = subprocess.run([sys.executable, "-c", code, str(src), str(dst)], capture_output=True, text=True, env=env)
        assert p.returncode == 0, p.stderr
        _, off, soff = p.stdout.split()
        assert int(soff) == hs.data_offset and (int(off) % 4096 == int(soff) % 4096) == congruent, (off, soff)
        hd = read_header(dst)
        n = hs.file_size - hs.data_offset
        with open(src, "rb") as a, open(dst, "rb") as b:
            a.seek(hs.data_offset)
            b.seek(hd.data_offset)
            assert a.read(n) == b.read(n)
        dst.unlink()


def test_set_speed_inplace_smoke(tmp_path):
    r = _bench("set_speed.py", "--size-gb", "0.005", "--only", "inplace", "--inplace-reps", "2", "--cache", "none",
               "--dir", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "in-place re-set, CLI end to end: median" in r.stdout and "library call: median" in r.stdout


@pytest.mark.real_model
@pytest.mark.parametrize("persistent", [False, True], ids=["process-per-sample", "persistent"])
def test_runtime_cost_smoke(patched_lib, tmp_path, persistent):
    out = tmp_path / "rc.json"
    r = _bench("runtime_cost.py", "--configs", "none,mixed", "--lengths", "256", "--decode-depth", "0", "--reps", "2",
               "--threads", "1", "--prefill-tokens", "256", "--out", str(out), *(["--persistent"] if persistent else []))
    assert r.returncode == 0, r.stdout + r.stderr
    rec = json.loads(out.read_text())
    assert rec["persistent"] is persistent
    assert [len(v) for v in rec["tok_s"]["prefill@256"].values()] == [2, 2] and rec["machine"]["cores"] >= 1
    assert re.search(r"prefill@256 +mixed/none \d+\.\d{3} \[\d+\.\d{3}-\d+\.\d{3}\]", r.stdout), r.stdout


# ----------------------------------------------------------------------------- bench/niah_near_misses.py

def test_niah_near_misses_by_hand(tmp_path):
    from ggufrope.models import GEMMA3

    near = _bench_module("niah_near_misses")
    # answers from the committed Gemma 3 units, classified by hand
    assert near.classify("2371038", ": 1371038.\nThe special") == "one"  # the leading 2 became 1
    assert near.classify("5211164", " 1111164.\nThe ") == "two"  # 52 became 11
    assert near.classify("5427297", ": 10427297.") == "one"  # 5 became 10: the last six are there
    assert near.classify("5305804", ": 5305804.\nThe") == "found"
    assert near.classify("6521239", ": 123456789.") == "miss"
    assert near.classify("2336143", ": 2336.") == "miss"  # a prefix is not a near miss
    assert near.first_number(": 10427297.\nThe 9", "27297") == "10427297"
    # passkey answers (5-digit keys), from the committed units
    assert near.classify("49755", " 19755. Remember it.") == "one"  # the leading 4 became 1
    assert near.classify("49755", " 1975.") == "miss"  # YaRN's answer: no tail of four
    assert near.classify("49755", " 11755.") == "miss"  # three digits are not a near miss
    assert near.classify("56930", " 56930. Remember it.") == "found"

    unit = lambda task, answers: {"key": {"task": task, "n_ctx": 65536, "model": {"sha256": GEMMA3.sha256}},
                                  "result": {"rows": [{"gold": [g], "answer": a} for g, a in answers]}}
    (tmp_path / "ruler-a.json").write_text(json.dumps(unit("niah_single", [
        ("2371038", ": 1371038."), ("5211164", " 1111164."), ("5305804", ": 5305804."), ("6521239", ": 1.")])))
    (tmp_path / "ruler-b.json").write_text(json.dumps(unit("niah_single", [("5427297", ": 10427297.")])))
    (tmp_path / "ruler-c.json").write_text(json.dumps(unit("vt", [("2371038", ": 1371038.")])))  # not niah
    (tmp_path / "ruler-d.json.partial").write_text("{}")  # unfinished cells are not read
    passkey = {"key": {"kind": "passkey", "n_ctx": 131072, "model": {"sha256": GEMMA3.sha256}},
               "result": {"rows": [{"key": k, "answer": a} for k, a in
                                   [(49755, " 19755. Remember it."), (56930, " 56930."), (77013, " 1.")]]}}
    (tmp_path / "passkey-a.json").write_text(json.dumps(passkey))
    (tmp_path / "passkey-b.json.0123456789ab.partial").write_text("{}")
    r = _bench("niah_near_misses.py", "--cache", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[2:] == ['| niah_single | gemma3 | 65536 | 2 | 5 | 1 | 3 (2 / 1) | "1" ×3 |',
                                         '| passkey | gemma3 | 131072 | 1 | 3 | 1 | 1 (1 / 0) | "1" ×1 |']
    r = _bench("niah_near_misses.py", "--cache", str(tmp_path / "none"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "no cache directory" in r.stderr
