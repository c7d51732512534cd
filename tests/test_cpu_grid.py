"""native/cpu-grid.sh: the pending grid cells (native/grid-jobs.txt, as gpu-lent's stage 2 runs
them) on this CPU with --any-build, a row leaving the jobs file when its unit lands. Run here on the
real default model at a short context, no report rewritten (PUBLISH=0); commits only in a temporary
repository."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ggufrope.evaluation import cache as EC

ROOT = Path(__file__).resolve().parents[1]
JOB = "@smollm2 -c 1024 --methods none --logn off --no-ppl --samples 2 --tasks niah_single --trials 0 --no-truncation"


def run_cpu_grid(tmp: Path, cache: Path, jobs_file: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PY=sys.executable, COMMIT="0", PUBLISH="0", POLL="1", GRID_JOBS=JOB, SCORE_FROM="512",
               CACHE=str(cache), JOBS_FILE=str(jobs_file), OUT=str(tmp / "out"))
    return subprocess.run(["bash", str(ROOT / "native" / "cpu-grid.sh")], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)


def test_grid_jobs_file_rows_are_gpu_lent_jobs():
    """Every row of native/grid-jobs.txt (METHOD LOGN TRIALS) is one vt job of `gpu-lent.sh jobs`,
    in the file's order, after the two tune jobs."""
    rows = [ln.split() for ln in (ROOT / "native" / "grid-jobs.txt").read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]
    r = subprocess.run(["bash", str(ROOT / "native" / "gpu-lent.sh"), "jobs"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    jobs = r.stdout.splitlines()
    assert [j.split()[1] for j in jobs[:2]] == ["tune", "tune"]
    assert jobs[2:] == [f"@gemma3 -c 131072 --methods {m} --logn {l} --no-ppl --samples 10 --depths 0,0.25,0.5,0.75,1 "
                        f"--tasks vt --trials {t} --no-truncation" for m, l, t in rows]


def test_cpu_grid_resumes_another_builds_samples_and_drops_the_row(smollm2, tmp_path):
    """A job's unit lands in the cache and its row (and only its row) leaves the jobs file; run
    again with the unit gone and another build's partial file holding sample 0 (its answer
    planted), the unit takes that sample (--any-build) and answers only sample 1, the same answer
    as the first run."""
    cache, jobs_file = tmp_path / "cache", tmp_path / "grid-jobs.txt"
    jobs_file.write_text("# pending\nnone off 0\nyarn off 0\n")
    r = run_cpu_grid(tmp_path, cache, jobs_file)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "'none off 0' leaves" in r.stdout
    assert jobs_file.read_text() == "# pending\nyarn off 0\n"
    (unit_path,) = cache.glob("ruler-none-1024-*.json")
    unit = json.loads(unit_path.read_text())
    first = unit["result"]["rows"]
    assert [row["index"] for row in first] == [0, 1] and "sample_builds" not in unit["result"]

    other = {**unit["build"], "library": "0" * 16}
    store = EC.Cache(cache)
    unit_path.unlink()
    store.put_partial(unit["key"], other, {0: {**first[0], "answer": "planted"}}, 5.0)
    jobs_file.write_text("none off 0\n")
    r = run_cpu_grid(tmp_path, cache, jobs_file)
    assert r.returncode == 0, r.stdout + r.stderr
    again = json.loads(unit_path.read_text())["result"]
    assert again["rows"][0]["answer"] == "planted" and again["rows"][0]["build"] == other
    assert again["rows"][1]["answer"] == first[1]["answer"] and "build" not in again["rows"][1]
    assert again["sample_builds"] == {EC.build_id(other): 1, EC.build_id(unit["build"]): 1}
    assert not store.partial_paths(unit["key"]) and jobs_file.read_text() == ""


def test_cpu_grid_commits_the_unit_with_its_jobs_file(smollm2, tmp_path):
    """With COMMIT=1 (the default) in a repository: when the unit lands, one commit holds it and
    the jobs file without its row, and leaves nothing of them uncommitted; a commit before it
    (a partial file, POLL seconds after a sample) may hold the samples so far."""
    repo = tmp_path / "repo"
    (repo / "native").mkdir(parents=True)
    (repo / "native" / "cpu-grid.sh").write_text((ROOT / "native" / "cpu-grid.sh").read_text())
    (repo / "native" / "grid-jobs.txt").write_text("none off 0\nyarn off 0\n")
    (repo / "notes.txt").write_text("staged, not the script's to commit\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.com"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "native"], check=True)
    subprocess.run([*git, "commit", "-qm", "start"], check=True)
    subprocess.run([*git, "add", "notes.txt"], check=True)
    env = dict(os.environ, PY=sys.executable, PUBLISH="0", POLL="1", GRID_JOBS=JOB, SCORE_FROM="512",
               OUT=str(tmp_path / "out"), GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@example.com",
               GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@example.com")
    for k in ("CACHE", "JOBS_FILE", "COMMIT"):
        env.pop(k, None)
    r = subprocess.run(["bash", str(repo / "native" / "cpu-grid.sh")], env=env, cwd=repo, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    last = subprocess.run([*git, "show", "--name-status", "--format=%s", "HEAD"], capture_output=True, text=True).stdout
    subject, files = last.split("\n", 1)
    assert subject.startswith("results: none niah_single at n_ctx 1024 done: score "), subject
    (unit,) = (repo / "docs" / "results" / "cache").glob("ruler-none-1024-*.json")
    assert f"A\tdocs/results/cache/{unit.name}" in files and "M\tnative/grid-jobs.txt" in files
    assert "notes.txt" not in files
    assert (repo / "native" / "grid-jobs.txt").read_text() == "yarn off 0\n"
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True).stdout
    assert status.splitlines() == ["A  notes.txt"], status
