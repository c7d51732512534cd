"""What the bench scripts share: paths, the default model's real text as tokens, medians with
their spread and paired ratios, a child process timed with its peak RSS, page-cache control,
the machine's facts, and the JSON record.

Every script in bench/ runs as ``.venv/bin/python bench/NAME.py`` (this folder is then first on
``sys.path``, so ``import benchlib`` finds this file).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUT_DIR = ROOT / "build" / "bench"  # default folder of the JSON records
GIB = 1 << 30
MIB = 1 << 20


# ----------------------------------------------------------------------------- statistics


def median(xs: list[float]) -> float:
    """The median; NaN for an empty list."""
    return statistics.median(xs) if xs else float("nan")


def spread(xs: list[float], fmt: str = ".1f") -> str:
    """``median [min-max]`` of ``xs``, each number in ``fmt``."""
    return f"{median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def paired_ratios(a: list[float], b: list[float]) -> list[float]:
    """Per-round ratios a[i] / b[i]: rounds ran the configurations back to back, so a ratio
    cancels drift slower than a round; its median and spread say how stable it is."""
    if len(a) != len(b):
        raise ValueError(f"paired_ratios: {len(a)} rounds against {len(b)}")
    return [x / y for x, y in zip(a, b)]


# ----------------------------------------------------------------------------- model and text


def real_tokens(llm: Any, n: int | None = None) -> list[int]:
    """The first bundled long document (ggufrope.corpus) tokenized by ``llm`` with BOS; its
    first ``n`` tokens when given (an error names the shortfall)."""
    from ggufrope.corpus import documents, load_text

    tokens = llm.tokenize(load_text(documents()[0].name).encode(), add_bos=True)
    if n is not None:
        if len(tokens) < n:
            raise SystemExit(f"bench: the text has {len(tokens)} tokens, need {n}")
        tokens = tokens[:n]
    return tokens


# ----------------------------------------------------------------------------- processes and the page cache


GNU_TIME = "/usr/bin/time" if os.path.exists("/usr/bin/time") else None


def run(cmd: list[str], *, env: dict | None = None, cwd: str | os.PathLike | None = None, check: bool = True) -> dict:
    """Run ``cmd``; wall time (s), peak RSS (MB), exit status, output.

    Peak RSS comes from GNU time's %M (``apt-get install time``) when present. The
    fallback, ``ru_maxrss`` from ``wait4``, is inflated: Python starts children with vfork,
    and at exec the kernel records the high-water RSS of the memory the child shared with
    this process, so every child reports at least this process's peak."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, tempfile.NamedTemporaryFile("r") as tf:
        full = [GNU_TIME, "-f", "%M", "-o", tf.name, *cmd] if GNU_TIME else cmd
        t0 = time.perf_counter()
        p = subprocess.Popen(full, stdout=out, stderr=err, env=env, cwd=None if cwd is None else str(cwd))
        _, status, ru = os.wait4(p.pid, 0)
        wall = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        o, e = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        rss_kb = ru.ru_maxrss
        if GNU_TIME:
            lines = [ln for ln in tf.read().splitlines() if ln.strip().isdigit()]
            rss_kb = int(lines[-1]) if lines else float("nan")
    if check and p.returncode != 0:
        raise SystemExit(f"bench: {' '.join(cmd)} failed ({p.returncode}):\n{e[-2000:]}")
    return {"wall": wall, "rss_mb": rss_kb / 1024, "rc": p.returncode, "out": o, "err": e}


def can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def evict(path: str) -> None:
    """Drop ``path``'s clean pages from the page cache (posix_fadvise DONTNEED): the next
    reader gets them from the disk. Unlike a global drop, the tools' own binaries and
    Python modules stay cached, and other users of the machine are not disturbed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def settle(src: str | None, how: str) -> None:
    """Flush dirty pages (so that one run's writeback does not slow the next), then make
    the source cold: ``how`` is "file" (evict the source's pages), "global" (echo 3 >
    /proc/sys/vm/drop_caches) or "none"."""
    os.sync()
    if how == "global":
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    elif how == "file" and src is not None:
        evict(src)


# ----------------------------------------------------------------------------- the record


def machine(d: str | os.PathLike | None = None) -> dict:
    """Cores, CPU model, memory, kernel, Python; with ``d``, also the filesystem and device
    that hold it and whether that device is rotational."""
    cpu = ""
    try:
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "")
    except OSError:
        pass
    info = {"cores": os.cpu_count(), "cpu": cpu, "kernel": platform.release(), "python": platform.python_version(),
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB, 1)}
    if d is not None:
        df = subprocess.run(["df", "-T", str(d)], capture_output=True, text=True).stdout.splitlines()[-1].split()
        dev = os.path.basename(df[0])
        base = re.sub(r"\d+$", "", dev) if not dev.startswith("nvme") else re.sub(r"p\d+$", "", dev)
        rot = Path(f"/sys/block/{base}/queue/rotational")
        info.update({"filesystem": df[1], "device": df[0],
                     "rotational": rot.read_text().strip() if rot.exists() else "?"})
    return info


def write_record(path: str | os.PathLike, report: dict) -> None:
    """Write ``report`` (with the machine's facts added as ``machine`` unless present) as JSON."""
    report.setdefault("machine", machine())
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")  # renamed into place: a run killed mid-write leaves the last record
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, p)
