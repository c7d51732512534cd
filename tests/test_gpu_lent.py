"""native/gpu-lent.sh and its compiler launcher native/reuse-cuda-objects.sh, the parts that run
here without a GPU.

The launcher (the stock CUDA build for a lent GPU) copies the patched build's object only for a
source that is byte-identical in the two trees and not named in REUSE_EXCEPT; every other compile
runs the command it was given. The compiler here is a stand-in that writes a marker (no nvcc or GPU
is needed to test the choice). gpu-lent.sh: the split of the models over the carry folders and
their join, and stage 2's default grid jobs against the committed units."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from ggufrope.evaluation.decoder import n_ctx_orig_of

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = ROOT / "native" / "reuse-cuda-objects.sh"


def launch(tmp: Path, name: str, stock_text: str, patched_text: str, *, except_: str = "", have_object: bool = True) -> str:
    stock, patched, pbuild, sbuild = (tmp / d for d in ("stock", "patched", "pbuild", "sbuild"))
    for d in (stock, patched, pbuild / "obj", sbuild / "obj"):
        d.mkdir(parents=True, exist_ok=True)
    (stock / name).write_text(stock_text)
    (patched / name).write_text(patched_text)
    if have_object:
        (pbuild / "obj" / f"{name}.o").write_text("object of the patched build")
    compiler = tmp / "fake-nvcc"
    compiler.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done\necho compiled > "$out"\n')
    compiler.chmod(0o755)
    env = dict(os.environ, REUSE_FROM=str(pbuild), REUSE_SRC=str(patched), STOCK_SRC=str(stock), REUSE_EXCEPT=except_)
    r = subprocess.run([str(LAUNCHER), str(compiler), "-x", "cu", "-MD", "-MT", f"obj/{name}.o", "-MF", f"obj/{name}.o.d",
                        "-c", str(stock / name), "-o", f"obj/{name}.o"], cwd=sbuild, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return (sbuild / "obj" / f"{name}.o").read_text().strip()


def test_identical_source_reuses_the_patched_object(tmp_path):
    assert launch(tmp_path, "argmax.cu", "same", "same") == "object of the patched build"
    assert (tmp_path / "sbuild" / "obj" / "argmax.cu.o.d").read_text().startswith("obj/argmax.cu.o:")


def test_changed_source_is_compiled(tmp_path):
    assert launch(tmp_path, "rope.cu", "stock kernel", "patched kernel") == "compiled"


def test_excepted_or_missing_object_is_compiled(tmp_path):
    assert launch(tmp_path, "rope.cu", "same", "same", except_="ggml-cuda.cu rope.cu") == "compiled"
    assert launch(tmp_path / "b", "argsort.cu", "same", "same", have_object=False) == "compiled"


GPU_LENT = ROOT / "native" / "gpu-lent.sh"


def lent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(GPU_LENT), *args], capture_output=True, text=True)


def test_models_split_over_the_carry_folders_and_join_again(tmp_path):
    """pack's split: the models fill the carry folders in order, a/ after what is in it (the payload),
    no folder over the limit; stage 2's join gives back each model byte for byte."""
    carry, dest = tmp_path / "carry", tmp_path / "models"
    (carry / "a").mkdir(parents=True)
    (carry / "a" / "payload.tar.xz").write_bytes(b"p" * 700)
    models = []
    for name, size in (("small.gguf", 2500), ("large.gguf", 5300)):
        m = tmp_path / name
        m.write_bytes(os.urandom(size))
        models.append(m)
    r = lent("split-models", str(carry), "1000", *map(str, models))
    assert r.returncode == 0, r.stderr
    folders = sorted(d.name for d in carry.iterdir())
    # 700 + 7800 bytes at 1000 a folder: nine folders, a to i
    assert folders == list("abcdefghi")
    for d in carry.iterdir():
        assert sum(f.stat().st_size for f in d.iterdir() if f.name.startswith(("model", "payload")) and
                   not f.name.endswith((".name", ".sha256"))) <= 1000, d.name
    assert (carry / "a" / "model0.00").stat().st_size == 300            # what the payload leaves
    # model 0 (2500) in a, b, c, d: 300 + 1000 + 1000 + 200; model 1 (5300) from d on: 800, 4 x 1000, 500
    assert sorted(f.name for f in (carry / "d").iterdir()) == ["model0.03", "model1.00"]
    assert (carry / "d" / "model1.00").stat().st_size == 800 and (carry / "i" / "model1.05").stat().st_size == 500
    r = lent("join-models", str(carry), str(dest))
    assert r.returncode == 0, r.stderr
    for m in models:
        assert (dest / m.name).read_bytes() == m.read_bytes()
    assert "large.gguf assembled from 6 parts" in r.stdout


def test_join_refuses_a_model_with_a_part_missing(tmp_path):
    carry, dest = tmp_path / "carry", tmp_path / "models"
    m = tmp_path / "m.gguf"
    m.write_bytes(os.urandom(2500))
    assert lent("split-models", str(carry), "1000", str(m)).returncode == 0
    (carry / "b" / "model0.01").unlink()
    r = lent("join-models", str(carry), str(dest))
    assert r.returncode == 1
    assert "sha256 mismatch" in r.stderr and not (dest / "m.gguf").exists()


def test_default_grid_jobs_name_only_cells_not_run(request, tmp_path):
    """Stage 2's default grid jobs (``gpu-lent.sh jobs``) name only cells with no unit in
    docs/results/cache: the lent GPU is another build, so a cell done on this machine's CPU would
    be computed again there, minutes of device time for nothing. --report-only counts the units
    of every build and computes none; a tune job's stops at the first window not cached."""
    r = lent("jobs")
    assert r.returncode == 0, r.stderr
    jobs = r.stdout.splitlines()
    assert jobs
    for job in jobs:
        name, args = (job.split(" ", 1) if job.startswith("@") else ("@smollm2", job))
        model = str(request.getfixturevalue(name[1:]))
        if args.startswith("tune "):
            out = subprocess.run(
                [sys.executable, "-m", "ggufrope", "tune", model, "--cache", str(ROOT / "docs" / "results" / "cache"),
                 *shlex.split(args[len("tune "):]), "--report-only", "-q", "--out", str(tmp_path / "tune")],
                capture_output=True, text=True, cwd=ROOT)
            assert out.returncode == 2 and "is not cached" in out.stderr, f"{job}: {out.stderr[-500:]}"
            continue
        score_from = str(n_ctx_orig_of(model) // 2)  # L/2, as gpu-lent's E()
        out = subprocess.run(
            [sys.executable, "-m", "ggufrope", "eval", "compare", model, "--cache", str(ROOT / "docs" / "results" / "cache"),
             "--score-from", score_from, *shlex.split(args), "--report-only", "--out", str(tmp_path / "out")],
            capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("units: ")]
        m = re.match(r"units: 0 computed, (\d+) from the cache, (\d+) not run", line)
        assert m, line
        assert (int(m[1]), int(m[2]) > 0) == (0, True), f"{job}: {line}"


def test_import_keeps_committed_units_apart_and_takes_partial_files_of_units_not_there(tmp_path):
    """import: a new unit joins docs/results/cache, a recomputed committed one goes to
    docs/results/gpu/units; a partial file (a unit the deadline stopped) joins the cache unless
    its unit is there, so the next run of that build resumes it, beside another build's partial
    file of the unit; a unit that arrives removes its partial files (every build's: an earlier
    call's import brought one); a unit already there byte for byte (an earlier call's archive
    brought it: each call's archive holds all the machine's units) is left alone."""
    import tarfile

    repo = tmp_path / "repo"
    (repo / "native").mkdir(parents=True)
    script = repo / "native" / "gpu-lent.sh"
    script.write_bytes(GPU_LENT.read_bytes())
    cache = repo / "docs" / "results" / "cache"
    cache.mkdir(parents=True)
    (cache / "ruler-yarn-65536-old.json").write_text("committed")
    (cache / "ruler-ntk-131072-done.json").write_text("committed")
    (cache / "ruler-none-65536-new.json.0123456789ab.partial").write_text("an earlier call's samples")
    (cache / "ruler-none-65536-new.json.cccccccccccc.partial").write_text("this CPU's samples")
    (cache / "ruler-linear-131072-cut.json.cccccccccccc.partial").write_text("this CPU's samples")
    (cache / "ruler-yarn-131072-earlier-call.json").write_text("computed in the first call")
    src = tmp_path / "units"
    src.mkdir()
    files = {"ruler-none-65536-new.json": "new", "ruler-yarn-65536-old.json": "recomputed",
             "ruler-linear-131072-cut.json.0123456789ab.partial": "samples so far",
             "ruler-ntk-131072-done.json.0123456789ab.partial": "stale samples",
             "ruler-yarn-131072-earlier-call.json": "computed in the first call"}
    for name, text in files.items():
        (src / name).write_text(text)
    tgz = tmp_path / "units.tar.gz"
    with tarfile.open(tgz, "w:gz") as t:
        for name in files:
            t.add(src / name, arcname=f"./{name}")
    r = subprocess.run(["bash", str(script), "import", str(tgz)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "1 new units in docs/results/cache, 1 recomputations" in r.stderr and "1 partial units, 1 already here" in r.stderr
    assert not (repo / "docs" / "results" / "gpu" / "units" / "ruler-yarn-131072-earlier-call.json").exists()
    assert (cache / "ruler-none-65536-new.json").read_text() == "new"
    assert (cache / "ruler-yarn-65536-old.json").read_text() == "committed"
    assert (repo / "docs" / "results" / "gpu" / "units" / "ruler-yarn-65536-old.json").read_text() == "recomputed"
    assert (cache / "ruler-linear-131072-cut.json.0123456789ab.partial").read_text() == "samples so far"
    assert (cache / "ruler-linear-131072-cut.json.cccccccccccc.partial").read_text() == "this CPU's samples"
    assert not list(cache.glob("ruler-ntk-131072-done.json.*"))
    assert not list(cache.glob("ruler-none-65536-new.json.*"))  # its unit arrived: both builds' partial files go


def test_run_jobs_runs_at_most_par_at_once_and_none_past_the_deadline(tmp_path):
    """Stage 2's scheduler (``gpu-lent.sh run-jobs PAR T0 DEADLINE CMD...``, GRID_PARALLEL): every job
    runs, in order, never more than PAR at once, each one's exit status reported; with 15 s or less
    left none starts; a PAR that is not a positive integer is refused."""
    log = tmp_path / "log"
    # each job notes how many jobs were running when it started (a file per running job)
    job = 'touch {d}/run.{i}; ls {d} | grep -c "^run\\." >> {log}; sleep 1; rm {d}/run.{i}; echo done {i}'
    cmds = [job.format(d=tmp_path, i=i, log=log) for i in range(5)] + ["exit 3"]
    r = lent("run-jobs", "2", "0", "600", *cmds)
    assert r.returncode == 0, r.stderr
    running = [int(x) for x in log.read_text().split()]
    assert len(running) == 5 and max(running) == 2, running
    assert sorted(re.findall(r"^done (\d)$", r.stdout, re.M)) == list("01234")
    assert r.stdout.count("exit 0 at") == 5 and "grid job 6: exit 3 at" in r.stdout
    # the deadline 16 s after a start 2 s ago leaves 14 s: nothing starts
    r = lent("run-jobs", "1", "-2", "16", f"touch {tmp_path}/started")
    assert "no time left for job 1" in r.stdout and not (tmp_path / "started").exists()
    r = lent("run-jobs", "0", "0", "600", "true")
    assert r.returncode == 2 and "GRID_PARALLEL must be a positive integer" in r.stderr
