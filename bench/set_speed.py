#!/usr/bin/env python3
"""How fast, and in how much memory, `ggufrope set` rewrites a large GGUF (issue 4).

    .venv/bin/python bench/set_speed.py [--size-gb 2] [--dir DIR] [--reps 3]

Writes a GGUF of at least ``--size-gb`` GiB (a llama-shaped model: a 49,152-token
vocabulary and 48,900 merges as in SmolLM2, Q8_0 weights of random bytes; header with
gguf-py's GGUFWriter, data streamed in 16 MiB chunks), then measures, in this one run and
on that same file:

* ``cp SRC DST``, ``cp SRC DST && sync DST`` (cp plus the fsync that ggufrope does;
  gguf_new_metadata.py likewise with and without a final ``sync``), and, as a diagnostic
  only, the library call with ``os.fsync`` stubbed out (what the copy costs without the
  durability that the atomic rename needs),
  ``ggufrope set SRC -m mixed --logn -o DST`` (the CLI, end to end), the library call
  ``write_rope_metadata`` (timed inside its process), and gguf-py's
  ``gguf_new_metadata.py SRC DST --general-description ...``: wall time and peak RSS
  (``ru_maxrss`` of each child, from ``wait4``). Each repetition runs every tool, in a
  rotated order, after ``sync`` and with the source's pages evicted from the page cache
  (``posix_fadvise(DONTNEED)``; ``--cache global`` drops the whole cache as root,
  ``--cache none`` keeps it warm): every copy reads its source from disk. ``cp`` returns
  with the copy still dirty in the page cache; ``ggufrope set`` fsyncs before its rename,
  so ``cp && sync DST`` is the like-for-like baseline; both ratios are printed;
* the in-place re-set (``ggufrope set DST --b 0.5|0.75 --logn --in-place``, alternating
  values so that every run changes bytes), through the CLI and the library, warm cache;
* the same tools on the real model (SmolLM2-135M Q4_1, 98 MB; ``python -m ggufrope.models``)
  for its peak RSS;
* with ``--reflink`` (default: auto, needs root, ``mkfs.btrfs``/``mkfs.xfs`` and loop
  mounts), on loop-mounted btrfs and XFS images: ``cp --reflink=always`` and ``ggufrope
  set``, and whether the data extents of the output are shared with the source
  (``filefrag -v``, ``btrfs filesystem du``), against a control write whose data offset
  is not congruent modulo 4096.

Prints medians and ratios; ``--json FILE`` also writes every measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import benchlib
from benchlib import GIB, MIB, can_drop_caches, median, settle

REPO = benchlib.ROOT
PY = sys.executable
BIN = Path(PY).parent

# ----------------------------------------------------------------------------- writing


def write_big_gguf(path: str, size_bytes: int, seed: int = 0) -> dict:
    """A llama-shaped GGUF of at least ``size_bytes`` bytes; memory stays low (the data
    section is written in 16 MiB chunks of pseudo-random bytes, each chunk distinct)."""
    import gguf
    import numpy as np

    Q = gguf.GGMLQuantizationType
    n_vocab, n_embd, n_ff, n_head, n_head_kv = 49152, 2048, 5632, 32, 8
    n_embd_kv = n_embd * n_head_kv // n_head

    def q8(n: int) -> int:  # Q8_0: blocks of 32 weights in 34 bytes
        return n // 32 * 34

    layer = [
        ("attn_norm.weight", (n_embd,), Q.F32, 4 * n_embd),
        ("attn_q.weight", (n_embd, n_embd), Q.Q8_0, q8(n_embd * n_embd)),
        ("attn_k.weight", (n_embd, n_embd_kv), Q.Q8_0, q8(n_embd * n_embd_kv)),
        ("attn_v.weight", (n_embd, n_embd_kv), Q.Q8_0, q8(n_embd * n_embd_kv)),
        ("attn_output.weight", (n_embd, n_embd), Q.Q8_0, q8(n_embd * n_embd)),
        ("ffn_norm.weight", (n_embd,), Q.F32, 4 * n_embd),
        ("ffn_gate.weight", (n_embd, n_ff), Q.Q8_0, q8(n_embd * n_ff)),
        ("ffn_up.weight", (n_embd, n_ff), Q.Q8_0, q8(n_embd * n_ff)),
        ("ffn_down.weight", (n_ff, n_embd), Q.Q8_0, q8(n_ff * n_embd)),
    ]
    fixed = [
        ("token_embd.weight", (n_embd, n_vocab), Q.Q8_0, q8(n_embd * n_vocab)),
        ("output_norm.weight", (n_embd,), Q.F32, 4 * n_embd),
        ("output.weight", (n_embd, n_vocab), Q.Q8_0, q8(n_embd * n_vocab)),
    ]
    pad = lambda n: n + (-n % 32)  # noqa: E731
    per_layer = sum(pad(t[3]) for t in layer)
    n_layer = max(1, math.ceil((size_bytes - sum(pad(t[3]) for t in fixed)) / per_layer))
    tensors = fixed[:1] + [(f"blk.{i}.{n}", s, q, b) for i in range(n_layer) for n, s, q, b in layer] + fixed[1:]

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("ggufrope benchmark model")
    w.add_context_length(8192)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_vocab_size(n_vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    rng = np.random.default_rng(seed)
    letters = "abcdefghijklmnopqrstuvwxyzĠĊéüñ"
    lens = rng.integers(1, 12, size=n_vocab)
    picks = rng.integers(0, len(letters), size=int(lens.sum()))
    toks, k = [], 0
    for i, n in enumerate(lens):
        toks.append(f"{i}" + "".join(letters[j] for j in picks[k : k + n]))
        k += n
    w.add_token_list(toks)
    w.add_token_types([1] * n_vocab)
    w.add_token_merges([f"{toks[i]} {toks[i + 1]}" for i in range(48900)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    for name, shape, qt, nbytes in tensors:
        # GGUFWriter takes the byte shape for quantised types (uint8 rows of bytes)
        if qt == Q.F32:
            w.add_tensor_info(name, shape[::-1], np.dtype(np.float32), nbytes)
        else:
            w.add_tensor_info(name, (shape[1], nbytes // shape[1]), np.dtype(np.uint8), nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    f = w.fout[0]
    f.write(bytes(-f.tell() % 32))
    data_offset = f.tell()
    total = sum(pad(t[3]) for t in tensors)
    chunk = bytearray(rng.bytes(16 * MIB))
    left, i = total, 0
    while left:
        chunk[:8] = i.to_bytes(8, "little")
        n = min(left, len(chunk))
        f.write(memoryview(chunk)[:n])
        left -= n
        i += 1
    f.flush()
    os.fsync(f.fileno())
    w.close()
    return {"path": path, "size": os.path.getsize(path), "data_offset": data_offset, "n_layer": n_layer,
            "tensors": len(tensors)}


# ----------------------------------------------------------------------------- measuring


def run(cmd: list[str], *, env: dict | None = None, check: bool = True) -> dict:
    """benchlib.run in the measured tree (python -c: TREE first on the path)."""
    return benchlib.run(cmd, env=env, cwd=TREE, check=check)


TREE = REPO  # the ggufrope sources measured (--tree)


def env() -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(TREE) + os.pathsep + e.get("PYTHONPATH", "")
    # compiled bytecode is cached, as in any normal installation (this sandbox sets
    # PYTHONDONTWRITEBYTECODE=1, which recompiles ggufrope's modules on every start: ~50 ms)
    e.pop("PYTHONDONTWRITEBYTECODE", None)
    return e


LIB_SET = r"""
import json, sys, time
t0 = time.perf_counter()
from ggufrope.rope_metadata import write_rope_metadata
t1 = time.perf_counter()
r = write_rope_metadata(sys.argv[1], sys.argv[2], method="ntk-mixed", logn=True)
t2 = time.perf_counter()
print(json.dumps({"import": t1 - t0, "call": t2 - t1, "data_bytes": r.data_bytes}))
"""

LIB_SET_NOFSYNC = r"""
import json, os, sys, time
from ggufrope import rope_metadata as RM
RM.os.fsync = lambda fd: None  # diagnostic only: what the copy costs without the durability
t = time.perf_counter()
r = RM.write_rope_metadata(sys.argv[1], sys.argv[2], method="ntk-mixed", logn=True)
print(json.dumps({"import": 0, "call": time.perf_counter() - t, "data_bytes": r.data_bytes}))
"""

LIB_INPLACE = r"""
import json, sys, time
t0 = time.perf_counter()
from ggufrope.rope_metadata import write_rope_metadata
t1 = time.perf_counter()
calls = []
for i in range(int(sys.argv[2])):
    t = time.perf_counter()
    r = write_rope_metadata(sys.argv[1], None, method="ntk-mixed", exponent=(0.55, 0.7)[i % 2], logn=True)
    calls.append(time.perf_counter() - t)
    assert r.header_only and r.header_bytes > 0, r
print(json.dumps({"import": t1 - t0, "calls": calls}))
"""


def new_metadata_cmd() -> list[str] | None:
    exe = BIN / "gguf-new-metadata"
    if exe.exists():
        return [str(exe)]
    try:
        import gguf

        script = Path(gguf.__file__).parent / "scripts" / "gguf_new_metadata.py"
    except ImportError:
        return None
    return [PY, str(script)] if script.exists() else None


def tools(src: str, dst: str) -> dict[str, list[str]]:
    t = {
        "cp": ["cp", "--", src, dst],
        "cp+fsync": ["sh", "-c", 'cp -- "$0" "$1" && sync -- "$1"', src, dst],
        "ggufrope set (CLI)": [str(BIN / "ggufrope"), "set", src, "-m", "mixed", "--logn", "-o", dst],
        "ggufrope set (library)": [PY, "-c", LIB_SET, src, dst],
        "set, no fsync (diagnostic)": [PY, "-c", LIB_SET_NOFSYNC, src, dst],
    }
    nm = new_metadata_cmd()
    if nm:
        t["gguf_new_metadata.py"] = nm + [src, dst, "--general-description", "ggufrope benchmark", "--force"]
        t["gguf_new_metadata.py+fsync"] = ["sh", "-c", 'd="$1"; shift; "$@" && sync -- "$d"', "sh", dst,
                                           *t["gguf_new_metadata.py"]]
    return t


def measure_tools(src: str, dst: str, reps: int, drop: str, skip: set[str] = frozenset()) -> dict[str, list[dict]]:
    ts = {k: v for k, v in tools(src, dst).items() if k not in skip}
    names = list(ts)
    res: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(reps):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order
            if os.path.exists(dst):
                os.unlink(dst)
            settle(src, drop)
            m = run(ts[name], env=env())
            if name in ("ggufrope set (library)", "set, no fsync (diagnostic)"):
                m["lib"] = json.loads(m["out"].strip().splitlines()[-1])
            res[name].append(m)
            print(f"  rep {r + 1}/{reps}  {name:<24} {m['wall']:8.3f} s  {m['rss_mb']:7.1f} MB", flush=True)
    return res


def check_output(src: str, dst: str) -> dict:
    """The data section of dst is byte-identical to src's (cmp), and gguf-py reads dst."""
    sys.path.insert(0, str(REPO))
    from ggufrope.gguf_reader import read_header

    hs, hd = read_header(src), read_header(dst)
    n = hs.file_size - hs.data_offset
    same = hd.file_size - hd.data_offset == n and hs.tensors == hd.tensors and subprocess.run(
        ["cmp", "-s", "-n", str(n), "-i", f"{hs.data_offset}:{hd.data_offset}", src, dst]).returncode == 0
    code = ("import gguf, sys; r = gguf.GGUFReader(sys.argv[1]); "
            "print(len(r.tensors), r.fields['llama.rope.ntk.method'].contents())")
    p = subprocess.run([PY, "-c", code, dst], capture_output=True, text=True)
    return {"data_identical": same, "gguf_py_reads": p.returncode == 0 and p.stdout.split() == [str(len(hs.tensors)), "ntk-mixed"],
            "src_offset_mod4096": hs.data_offset % 4096, "dst_offset_mod4096": hd.data_offset % 4096}


def measure_inplace(path: str, reps: int, drop: str) -> dict:
    cli = []
    vals = ("0.5", "0.75")
    run([str(BIN / "ggufrope"), "set", path, "-m", "mixed", "--b", "0.625", "--logn", "--in-place"], env=env())  # warm-up
    for i in range(reps):
        m = run([str(BIN / "ggufrope"), "set", path, "-m", "mixed", "--b", vals[i % 2], "--logn", "--in-place"], env=env())
        assert "in place" in m["out"] and "no tensor data copied" in m["out"], m["out"]
        cli.append(m)
    lib = run([PY, "-c", LIB_INPLACE, path, str(reps)], env=env())  # b = 0.55, 0.7, ...
    libd = json.loads(lib["out"].strip().splitlines()[-1])
    floor = [run([PY, "-c", "import ggufrope.cli, ggufrope.rope_metadata"], env=env())["wall"] for _ in range(reps)]
    bare = [run([PY, "-c", "pass"])["wall"] for _ in range(reps)]
    help_ = [run([str(BIN / "ggufrope"), "--help"], env=env())["wall"] for _ in range(reps)]
    cold = None
    if drop != "none":
        settle(path, drop)
        cold = run([str(BIN / "ggufrope"), "set", path, "-m", "mixed", "--b", "0.625", "--logn", "--in-place"], env=env())
    return {
        "cli": [m["wall"] for m in cli], "cli_rss_mb": max(m["rss_mb"] for m in cli),
        "lib_calls": libd["calls"], "lib_import": libd["import"], "lib_rss_mb": lib["rss_mb"],
        "import_floor": floor, "python_bare": bare, "cli_help": help_,
        "cli_cold": cold["wall"] if cold else None,
    }


# ----------------------------------------------------------------------------- reflink


def _shared_bytes(path: str) -> tuple[int, int]:
    """(bytes in extents flagged shared, bytes in all extents) from filefrag -v."""
    out = subprocess.run(["filefrag", "-v", path], capture_output=True, text=True).stdout
    m = re.search(r"blocks of (\d+) bytes", out)
    bs = int(m.group(1)) if m else 4096
    shared = total = 0
    for line in out.splitlines():
        m = re.match(r"\s*\d+:\s+\d+\.\.\s*\d+:\s+\d+\.\.\s*\d+:\s+(\d+):.*", line)
        if m:
            n = int(m.group(1)) * bs
            total += n
            if "shared" in line:
                shared += n
    return shared, total


def _btrfs_du(path: str) -> str | None:
    p = subprocess.run(["btrfs", "filesystem", "du", "-s", "--raw", path], capture_output=True, text=True)
    return p.stdout.strip().splitlines()[-1] if p.returncode == 0 else None


LIB_UNALIGNED = r"""
import sys, time
from ggufrope import gguf_writer as GW, rope_metadata as RM
assert hasattr(GW, "PAGE")
GW.PAGE = 32  # control: place the data section by the GGUF alignment only, not modulo 4096
t = time.perf_counter()
r = RM.write_rope_metadata(sys.argv[1], sys.argv[2], method="ntk-mixed", logn=True)
print(time.perf_counter() - t, r.data_offset, r.source_data_offset)
"""


LIB_UNSPLIT = r"""
import sys, time
from ggufrope import atomic_write as AW, gguf_writer as GW, rope_metadata as RM
# control: congruent offsets, but the data copied in one call from its unaligned start
assert hasattr(GW, "copy_data") and hasattr(AW, "copy_range")
GW.copy_data = lambda s, d, so, do, n, b=4096: AW.copy_range(s, d, so, do, n)
t = time.perf_counter()
r = RM.write_rope_metadata(sys.argv[1], sys.argv[2], method="ntk-mixed", logn=True)
print(time.perf_counter() - t, r.data_offset, r.source_data_offset)
"""


def reflink_demo(workdir: Path, size_mb: int) -> dict:
    out: dict = {}
    if os.geteuid() != 0:
        return {"skipped": "needs root for loop mounts"}
    for fs, mkfs in (("btrfs", ["mkfs.btrfs", "-q", "-f"]), ("xfs", ["mkfs.xfs", "-q", "-f"])):
        if not shutil.which(mkfs[0]):
            out[fs] = {"skipped": f"{mkfs[0]} not installed (apt-get install {'btrfs-progs' if fs == 'btrfs' else 'xfsprogs'})"}
            continue
        img, mnt = workdir / f"{fs}.img", workdir / f"{fs}.mnt"
        mnt.mkdir(exist_ok=True)
        with open(img, "wb") as f:
            f.truncate(4 * size_mb * MIB + 512 * MIB)
        r: dict = {}
        try:
            subprocess.run(mkfs + [str(img)], check=True, capture_output=True)
            p = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
            if p.returncode != 0:
                out[fs] = {"skipped": f"mount -o loop refused: {p.stderr.strip()}"}
                continue
            try:
                src, cpr, dst, ctl = (str(mnt / n) for n in ("src.gguf", "cp-reflink.gguf", "set.gguf", "unaligned.gguf"))
                info = run([PY, str(Path(__file__).resolve()), "--write-only", src, str(size_mb / 1024)], env=env())
                r["source"] = json.loads(info["out"].strip().splitlines()[-1])
                settle(None, "none")
                used0 = shutil.disk_usage(str(mnt)).used
                m = run(["cp", "--reflink=always", src, cpr], check=False)
                r["cp --reflink=always"] = {"wall": m["wall"], "rc": m["rc"], "shared": _shared_bytes(cpr)}
                m = run([str(BIN / "ggufrope"), "set", src, "-m", "mixed", "--logn", "-o", dst], env=env())
                settle(None, "none")
                r["ggufrope set"] = {"wall": m["wall"], "shared": _shared_bytes(dst), "check": check_output(src, dst)}
                if fs == "btrfs":
                    r["btrfs du (total, exclusive, set shared)"] = _btrfs_du(dst)
                used1 = shutil.disk_usage(str(mnt)).used
                m = run([PY, "-c", LIB_UNALIGNED, src, ctl], env=env())
                t, off, soff = m["out"].split()
                settle(None, "none")
                r["control (data offset not congruent mod 4096)"] = {
                    "wall": float(t), "offset_mod4096": (int(soff) % 4096, int(off) % 4096), "shared": _shared_bytes(ctl)}
                used2 = shutil.disk_usage(str(mnt)).used
                os.unlink(ctl)
                m = run([PY, "-c", LIB_UNSPLIT, src, ctl], env=env())
                t, off, soff = m["out"].split()
                settle(None, "none")
                r["control (congruent, copied from the unaligned start in one call)"] = {
                    "wall": float(t), "offset_mod4096": (int(soff) % 4096, int(off) % 4096), "shared": _shared_bytes(ctl)}
                os.unlink(ctl)
                r["space used by cp --reflink + ggufrope set (MB)"] = round((used1 - used0) / MIB, 1)
                r["space used by the control (MB)"] = round((used2 - used1) / MIB, 1)
                m = run([str(BIN / "ggufrope"), "set", dst, "-m", "mixed", "--b", "0.5", "--logn", "--in-place"], env=env())
                r["in-place re-set"] = {"wall": m["wall"], "shared_after": _shared_bytes(dst)}
            finally:
                subprocess.run(["umount", str(mnt)], check=False)
        except subprocess.CalledProcessError as e:
            r = {"skipped": f"{' '.join(e.cmd)} failed: {(e.stderr or b'').decode(errors='replace').strip()[:300]}"}
        finally:
            img.unlink(missing_ok=True)
            try:
                mnt.rmdir()
            except OSError:
                pass
        out[fs] = r
    return out


# ----------------------------------------------------------------------------- report


def machine(d: Path) -> dict:
    return {**benchlib.machine(d),
            "cp": subprocess.run(["cp", "--version"], capture_output=True, text=True).stdout.splitlines()[0]}


def summarize(label: str, size: int, res: dict[str, list[dict]]) -> dict:
    rows = {}
    print(f"\n{label}: {size / GIB:.2f} GiB ({size} bytes), medians of {len(next(iter(res.values())))} runs")
    print(f"  {'tool':<28} {'time s':>8} {'MB/s':>8} {'peak RSS MB':>12}")
    for name, ms in res.items():
        t = median([m["wall"] for m in ms])
        rss = max(m["rss_mb"] for m in ms)
        rows[name] = {"time": t, "times": [m["wall"] for m in ms], "rss_mb": rss, "rss_all": [m["rss_mb"] for m in ms],
                      "mb_s": size / MIB / t}
        extra = ""
        if "lib" in ms[0]:
            c = median([m["lib"]["call"] for m in ms])
            rows[name]["call"] = c
            extra = f"   (call alone {c:.3f} s)"
        print(f"  {name:<28} {t:8.3f} {size / MIB / t:8.0f} {rss:12.1f}{extra}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="size of the large GGUF in GiB (default 2)")
    ap.add_argument("--dir", default=str(REPO / "build" / "bench"), help="working directory (default build/bench)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each copy (default 3)")
    ap.add_argument("--inplace-reps", type=int, default=9, help="repetitions of the in-place re-set (default 9)")
    ap.add_argument("--model", default="auto", help="real model for the RSS figure ('auto': the default SmolLM2; 'none')")
    ap.add_argument("--cache", choices=("file", "global", "none"), default="file",
                    help="before every run: evict the source file's pages (file, default), drop the whole page "
                    "cache (global: root only), or keep it warm (none)")
    ap.add_argument("--reflink", choices=("auto", "yes", "no"), default="auto",
                    help="loop-mounted btrfs/XFS extent-sharing demo (auto: when root)")
    ap.add_argument("--reflink-size-mb", type=int, default=512)
    ap.add_argument("--skip", action="append", default=[], help="a tool to leave out (repeatable)")
    ap.add_argument("--keep", action="store_true", help="keep the large files")
    ap.add_argument("--json", default=None, help="write all measurements to this file")
    ap.add_argument("--only", choices=("all", "inplace"), default="all", help="inplace: only the in-place re-set")
    ap.add_argument("--tree", default=str(REPO), help="measure the ggufrope package found in this directory "
                    "(put first on PYTHONPATH; default: this checkout)")
    ap.add_argument("--write-only", nargs=2, metavar=("PATH", "GIB"), help=argparse.SUPPRESS)
    a = ap.parse_args()

    global TREE
    TREE = Path(a.tree).resolve()
    if a.write_only:
        print(json.dumps(write_big_gguf(a.write_only[0], int(float(a.write_only[1]) * GIB))))
        return

    d = Path(a.dir).resolve()
    d.mkdir(parents=True, exist_ok=True)
    run([PY, "-c", "import ggufrope.cli, ggufrope.rope_metadata"], env=env())  # writes the bytecode caches
    drop = a.cache
    if drop == "global" and not can_drop_caches():
        print("cannot write /proc/sys/vm/drop_caches: evicting the source file's pages instead")
        drop = "file"
    info = machine(d)
    report: dict = {"machine": info, "cache": drop, "reps": a.reps}
    print(f"machine: {info['cores']} cores ({info['cpu']}), {info['mem_gb']} GiB RAM, kernel {info['kernel']}, "
          f"{info['filesystem']} on {info['device']} (rotational={info['rotational']}), Python {info['python']}, {info['cp']}")
    print(f"ggufrope measured: {TREE}/ggufrope")
    print(f"peak RSS: {'GNU time %M' if benchlib.GNU_TIME else 'wait4 ru_maxrss (an overestimate: install GNU time)'}")
    print("page cache before every run: sync, then " + {
        "file": "the source file's pages evicted (posix_fadvise DONTNEED): every copy reads it from disk",
        "global": "the whole page cache dropped (echo 3 > /proc/sys/vm/drop_caches)",
        "none": "nothing evicted (warm cache)"}[drop])

    src, dst = str(d / "big.gguf"), str(d / "big-out.gguf")
    print(f"\nwriting {src} ({a.size_gb} GiB) ...", flush=True)
    w = run([PY, str(Path(__file__).resolve()), "--write-only", src, str(a.size_gb)], env=env())
    winfo = json.loads(w["out"].strip().splitlines()[-1])
    report["big_file"] = {**winfo, "write_time": w["wall"], "writer_rss_mb": w["rss_mb"]}
    print(f"  {winfo['size']} bytes, {winfo['tensors']} tensors, data at offset {winfo['data_offset']} "
          f"(mod 4096 = {winfo['data_offset'] % 4096}); written in {w['wall']:.1f} s, writer peak RSS {w['rss_mb']:.0f} MB")
    size = winfo["size"]

    if a.only == "inplace":
        run([str(BIN / "ggufrope"), "set", src, "-m", "mixed", "--logn", "-o", dst], env=env())
        ip = measure_inplace(dst, a.inplace_reps, drop)
        print(f"in-place re-set, CLI end to end: median {median(ip['cli']):.3f} s (min {min(ip['cli']):.3f}), peak RSS "
              f"{ip['cli_rss_mb']:.1f} MB; library call: median {median(ip['lib_calls']):.4f} s; "
              f"python -c pass {median(ip['python_bare']):.3f} s; CLI after evicting the file {ip['cli_cold'] or float('nan'):.3f} s")
        for p in (src, dst):
            if not a.keep and os.path.exists(p):
                os.unlink(p)
        return

    print("\nfull rewrites of the large file:", flush=True)
    res = measure_tools(src, dst, a.reps, drop, set(a.skip))
    rows = summarize("large file", size, res)
    report["big"] = rows
    # the output of the last ggufrope run: data identical, gguf-py reads it
    run([str(BIN / "ggufrope"), "set", src, "-m", "mixed", "--logn", "-o", dst], env=env())
    report["big_check"] = check_output(src, dst)
    print(f"  output check: {report['big_check']}")

    print("\nin-place re-set of the large file (warm cache):", flush=True)
    ip = measure_inplace(dst, a.inplace_reps, drop)
    report["inplace"] = ip

    small = None
    if a.model != "none":
        mpath = a.model
        if mpath == "auto":
            mpath = subprocess.run([PY, "-m", "ggufrope.models"], capture_output=True, text=True, env=env()).stdout.strip()
        if mpath and os.path.exists(mpath):
            print(f"\nreal model {mpath}:", flush=True)
            sres = measure_tools(mpath, str(d / "model-out.gguf"), a.reps, drop, set(a.skip))
            small = summarize("real model", os.path.getsize(mpath), sres)
            report["model"] = {"path": mpath, **small}
            os.unlink(d / "model-out.gguf")

    refl = None
    if a.reflink == "yes" or (a.reflink == "auto" and os.geteuid() == 0):
        print(f"\nreflink demo on loop-mounted btrfs and XFS ({a.reflink_size_mb} MiB file):", flush=True)
        refl = reflink_demo(d, a.reflink_size_mb)
        report["reflink"] = refl
    cpr = run(["cp", "--reflink=always", src, str(d / "reflink-probe.gguf")], check=False)
    report["cp_reflink_here"] = {"rc": cpr["rc"], "err": cpr["err"].strip()}
    if os.path.exists(d / "reflink-probe.gguf"):
        os.unlink(d / "reflink-probe.gguf")

    # ------------------------------------------------------------------ the table
    g = rows
    set_t, cp_t, cpf_t = g["ggufrope set (CLI)"]["time"], g["cp"]["time"], g["cp+fsync"]["time"]
    lib_t = g["ggufrope set (library)"]["time"]
    nm_t = g.get("gguf_new_metadata.py", {}).get("time")
    print("\n" + "=" * 78)
    print(f"RESULTS ({info['cores']} cores, {info['filesystem']} on {info['device']}, "
          f"source {'cold' if drop != 'none' else 'warm'} before each run; medians)")
    print("=" * 78)
    lines = [
        ("set throughput / cp throughput (CLI)", cp_t / set_t, ">= 0.8"),
        ("set throughput / cp throughput (library call)", cp_t / g["ggufrope set (library)"]["call"], ">= 0.8"),
        ("set throughput / (cp + fsync) throughput (CLI)", cpf_t / set_t, ">= 0.8"),
        ("set throughput / (cp + fsync) throughput (library call)", cpf_t / g["ggufrope set (library)"]["call"], ">= 0.8"),
    ]
    if nm_t:
        lines.append(("gguf_new_metadata.py time / set time (CLI)", nm_t / set_t, ">= 3"))
        lines.append(("gguf_new_metadata.py time / set time (library)", nm_t / lib_t, ""))
        if "gguf_new_metadata.py+fsync" in g:
            lines.append(("(gguf_new_metadata.py + fsync) / set time (CLI)", g["gguf_new_metadata.py+fsync"]["time"] / set_t, ""))
    if "set, no fsync (diagnostic)" in g:
        nf = g["set, no fsync (diagnostic)"]["call"]
        lines.append(("diagnostic: set library call without its fsync / cp", cp_t / nf, ""))
        if nm_t:
            lines.append(("diagnostic: gguf_new_metadata.py / set without its fsync", nm_t / nf, ""))
    for what, v, acc in lines:
        ok = "" if not acc else ("  PASS" if v >= float(acc.split()[-1]) else "  FAIL")
        print(f"  {what:<58} {v:8.2f}   {acc}{ok}")
    print(f"  {'peak RSS, ggufrope set CLI, large file':<50} {g['ggufrope set (CLI)']['rss_mb']:8.1f} MB   <= 150"
          f"{'  PASS' if g['ggufrope set (CLI)']['rss_mb'] <= 150 else '  FAIL'}")
    print(f"  {'peak RSS, ggufrope set library, large file':<50} {g['ggufrope set (library)']['rss_mb']:8.1f} MB")
    if small:
        print(f"  {'peak RSS, ggufrope set CLI, real model':<50} {small['ggufrope set (CLI)']['rss_mb']:8.1f} MB   <= 150"
              f"{'  PASS' if small['ggufrope set (CLI)']['rss_mb'] <= 150 else '  FAIL'}")
    for name in ("cp", "cp+fsync", "gguf_new_metadata.py"):
        if name in g:
            extra = f" (real model: {small[name]['rss_mb']:.1f} MB)" if small and name in small else ""
            print(f"  {'peak RSS, ' + name + ', large file':<50} {g[name]['rss_mb']:8.1f} MB{extra}")
    ipc, ipl = median(ip["cli"]), median(ip["lib_calls"])
    print(f"  {'in-place re-set, CLI end to end':<50} {ipc:8.3f} s    < 0.2{'  PASS' if ipc < 0.2 else '  FAIL'}")
    print(f"  {'in-place re-set, library call':<50} {ipl:8.3f} s    < 0.2{'  PASS' if ipl < 0.2 else '  FAIL'}")
    print(f"  {'  (python -c pass / import ggufrope.cli+rope_metadata / ggufrope --help)':<50} "
          f"{median(ip['python_bare']):.3f} / {median(ip['import_floor']):.3f} / {median(ip['cli_help']):.3f} s")
    if ip["cli_cold"] is not None:
        print(f"  {'in-place re-set, CLI, file evicted from the cache':<50} {ip['cli_cold']:8.3f} s")
    print(f"  {'output: data byte-identical / gguf-py reads it':<50} {report['big_check']['data_identical']} / "
          f"{report['big_check']['gguf_py_reads']}")
    print(f"  {'data offset mod 4096, source / output':<50} {report['big_check']['src_offset_mod4096']} / "
          f"{report['big_check']['dst_offset_mod4096']}")
    c = report["cp_reflink_here"]
    print(f"  cp --reflink=always on {info['filesystem']}: "
          f"{'works' if c['rc'] == 0 else 'refused: ' + (c['err'].splitlines() or ['?'])[-1]}")
    if refl:
        for fs, r in refl.items():
            if "skipped" in r:
                print(f"  {fs}: not shown: {r['skipped']}")
                continue
            sh = r["ggufrope set"]["shared"]
            ctl = r["control (data offset not congruent mod 4096)"]
            cpr_ = r["cp --reflink=always"]
            ctl2 = r["control (congruent, copied from the unaligned start in one call)"]
            print(f"  {fs}: cp --reflink=always {cpr_['wall']:.3f} s, shares {cpr_['shared'][0] / MIB:.1f} of {cpr_['shared'][1] / MIB:.1f} MiB")
            print(f"     ggufrope set {r['ggufrope set']['wall']:.3f} s, shares {sh[0] / MIB:.1f} of {sh[1] / MIB:.1f} MiB "
                  f"(data offset mod 4096: {r['ggufrope set']['check']['src_offset_mod4096']} -> "
                  f"{r['ggufrope set']['check']['dst_offset_mod4096']}; data identical: {r['ggufrope set']['check']['data_identical']})")
            print(f"     control, offset not congruent mod 4096 {ctl['offset_mod4096']}: {ctl['wall']:.3f} s, "
                  f"shares {ctl['shared'][0] / MIB:.1f} MiB")
            print(f"     control, congruent but one copy call from the unaligned start: {ctl2['wall']:.3f} s, "
                  f"shares {ctl2['shared'][0] / MIB:.1f} MiB")
            print(f"     in-place re-set of the set output: {r['in-place re-set']['wall']:.3f} s, "
                  f"still shares {r['in-place re-set']['shared_after'][0] / MIB:.1f} MiB")
            if "btrfs du (total, exclusive, set shared)" in r:
                print(f"     btrfs filesystem du of the set output: {r['btrfs du (total, exclusive, set shared)']}")
            print(f"     space used by cp --reflink + set: {r['space used by cp --reflink + ggufrope set (MB)']} MB; "
                  f"by the control: {r['space used by the control (MB)']} MB")
    if a.json:
        benchlib.write_record(a.json, report)
        print(f"\nall measurements: {a.json}")
    if not a.keep:
        for p in (src, dst):
            if os.path.exists(p):
                os.unlink(p)


if __name__ == "__main__":
    main()
