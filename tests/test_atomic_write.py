"""ggufrope.atomic_write: the data copy (copy_file_range, sendfile, buffered; block-aligned
clones), atomic replacement, temporary files and their sweep, SIGKILL, full and copy-on-write
filesystems."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import assert_rewrite_ok, file_hash, no_temp_files
from ggufrope import atomic_write as AW, gguf_reader as GR, gguf_writer as GW, rope_metadata as RM
from ggufrope.errors import GGUFRopeError


# --------------------------------------------------------------------------- copying


@pytest.mark.parametrize("mode", ["copy_file_range", "sendfile", "buffered"])
def test_copy_mechanisms_agree(small_gguf, tmp_path, monkeypatch, mode) -> None:
    ref, out = tmp_path / "ref.gguf", tmp_path / f"{mode}.gguf"
    RM.write_rope_metadata(small_gguf, ref, method="mixed", logn=True)
    used = []
    for name in ("copy_file_range", "sendfile", "pread"):
        real = getattr(os, name, None)
        if real is not None:
            monkeypatch.setattr(os, name, lambda *a, _r=real, _n=name: used.append(_n) or _r(*a))
    if mode == "copy_file_range" and not hasattr(os, "copy_file_range"):
        pytest.skip("no os.copy_file_range")
    monkeypatch.setattr(AW, "_USE_COPY_FILE_RANGE", mode == "copy_file_range")
    monkeypatch.setattr(AW, "_USE_SENDFILE", mode == "sendfile")
    monkeypatch.setattr(AW, "_CHUNK", 100)  # many buffered steps
    monkeypatch.setattr(GR, "_CHUNK", 100)  # the header reads too, as when one _CHUNK served both
    RM.write_rope_metadata(small_gguf, out, method="mixed", logn=True)
    assert mode.replace("buffered", "pread") in used
    assert out.read_bytes() == ref.read_bytes()


def test_copy_file_range_falls_back_on_exdev(small_gguf, tmp_path, monkeypatch) -> None:
    calls = []

    def cfr(*a):
        calls.append(a)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(AW, "_USE_COPY_FILE_RANGE", True)
    monkeypatch.setattr(os, "copy_file_range", cfr, raising=False)
    out = tmp_path / "out.gguf"
    RM.write_rope_metadata(small_gguf, out, method="ntk")
    assert calls
    assert_rewrite_ok(small_gguf, out)


def one_tensor_gguf(path, data: np.ndarray, context_length: int | None = None):
    """A llama GGUF written by gguf-py with one int8 tensor "big" holding ``data`` (uint8 bytes)."""
    w = gguf.GGUFWriter(str(path), "llama")
    if context_length is not None:
        w.add_context_length(context_length)
    w.add_rope_dimension_count(64)
    w.add_tensor("big", data.view(np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_large_data_section_is_copied_exactly(tmp_path) -> None:
    """A few MB of data in one tensor: the copy loop, not only the header, is exercised."""
    data = np.random.default_rng(1).integers(0, 256, size=(3 << 20) + 17, dtype=np.uint8)

    p = one_tensor_gguf(tmp_path / "big.gguf", data, context_length=4096)
    out = tmp_path / "out.gguf"
    r = RM.write_rope_metadata(p, out, method="ntk", factor=4)
    assert r.data_bytes >= data.size
    assert_rewrite_ok(p, out)


def test_data_section_is_copied_from_block_aligned_offsets(tmp_path, monkeypatch) -> None:
    """btrfs/XFS clone (share) extents only between block-aligned offsets, and silently
    copy otherwise: the data section is copied as a short head up to the source's next 4096
    boundary, then the rest from offsets aligned on both sides."""
    if not hasattr(os, "copy_file_range"):
        pytest.skip("no os.copy_file_range")
    data = np.random.default_rng(2).integers(0, 256, size=(1 << 20) + 5, dtype=np.uint8)
    p = one_tensor_gguf(tmp_path / "big.gguf", data)
    hs = GR.read_header(p)
    assert hs.data_offset % 4096  # the interesting case: an unaligned data section
    calls = []
    real = os.copy_file_range
    monkeypatch.setattr(AW, "_USE_COPY_FILE_RANGE", True)
    monkeypatch.setattr(os, "copy_file_range", lambda s, d, n, so, do: calls.append((n, so, do)) or real(s, d, n, so, do))
    out = tmp_path / "o.gguf"
    r = RM.write_rope_metadata(p, out, method="ntk")
    data_calls = [c for c in calls if c[1] >= hs.data_offset]
    head = -hs.data_offset % 4096
    assert data_calls[0] == (head, hs.data_offset, r.data_offset)
    n, so, do = data_calls[1]
    assert so % 4096 == 0 and do % 4096 == 0 and so == hs.data_offset + head and so + n == p.stat().st_size
    assert_rewrite_ok(p, out)


# --------------------------------------------------------------------------- atomicity


@pytest.mark.parametrize("tmpfile", [True, False])
@pytest.mark.parametrize("where", ["header", "data", "verify"])
def test_failure_mid_write_leaves_nothing(small_gguf, tmp_path, monkeypatch, tmpfile, where) -> None:
    monkeypatch.setattr(AW, "_USE_O_TMPFILE", tmpfile)
    AW._tmpfile_ok.clear()
    dst = tmp_path / "dst.gguf"
    dst.write_bytes(b"old contents")
    src_before = small_gguf.read_bytes()

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "header":
        monkeypatch.setattr(GW, "_write_segments", enospc)
    elif where == "data":
        # the writer's copy_range and the copier's, as when one _copy_range served both
        monkeypatch.setattr(GW, "copy_range", enospc)
        monkeypatch.setattr(AW, "copy_range", enospc)
    else:
        real_parse = GW.parse
        n = {"calls": 0}

        def parse_then_fail(*a):
            n["calls"] += 1
            if n["calls"] == 2:  # the read-back of the written file
                raise KeyboardInterrupt
            return real_parse(*a)

        monkeypatch.setattr(GW, "parse", parse_then_fail)
    exc = KeyboardInterrupt if where == "verify" else GGUFRopeError
    with pytest.raises(exc) as ei:
        RM.write_rope_metadata(small_gguf, dst, method="ntk")
    if exc is GGUFRopeError:
        assert "No space left on device" in str(ei.value) and "\n" not in str(ei.value)
    assert dst.read_bytes() == b"old contents"
    assert small_gguf.read_bytes() == src_before
    assert no_temp_files(tmp_path)
    AW._tmpfile_ok.clear()


def test_no_temp_file_after_success_either_way(small_gguf, tmp_path, monkeypatch) -> None:
    for flag in (True, False):
        monkeypatch.setattr(AW, "_USE_O_TMPFILE", flag)
        AW._tmpfile_ok.clear()
        RM.write_rope_metadata(small_gguf, tmp_path / f"o{flag}.gguf", method="ntk")
        assert no_temp_files(tmp_path)
    assert (tmp_path / "oTrue.gguf").read_bytes() == (tmp_path / "oFalse.gguf").read_bytes()
    AW._tmpfile_ok.clear()


def test_output_mode_follows_source_and_umask(small_gguf, tmp_path) -> None:
    os.chmod(small_gguf, 0o644)
    old = os.umask(0o077)
    try:
        RM.write_rope_metadata(small_gguf, tmp_path / "o.gguf", method="ntk")
    finally:
        os.umask(old)
    assert (tmp_path / "o.gguf").stat().st_mode & 0o777 == 0o600


def _fake_temp(d: Path, dst: str, tag: str = "0123abcd", data: bytes = b"half a model") -> Path:
    t = d / f".{dst}.ggufrope-tmp-{tag}"
    t.write_bytes(data)
    return t


def test_stale_named_temp_files_are_swept_by_the_next_write(small_gguf, tmp_path) -> None:
    """A named temporary file left by a killed write (no live process holds its flock) is
    removed by the next write to the same destination; nothing else is touched."""
    import fcntl

    stale = _fake_temp(tmp_path, "dst.gguf")
    live = _fake_temp(tmp_path, "dst.gguf", "feedbeef")
    other = _fake_temp(tmp_path, "other.gguf")  # another destination's
    odd = [tmp_path / ".dst.gguf.ggufrope-tmp-XYZ", tmp_path / ".dst.gguf.ggufrope-tmp-0123abcd5"]
    for o in odd:
        o.write_bytes(b"x")
    link = tmp_path / ".dst.gguf.ggufrope-tmp-aaaaaaaa"
    link.symlink_to(small_gguf)
    fd = os.open(live, os.O_RDONLY)  # a writer at work holds its lock
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        r = RM.write_rope_metadata(small_gguf, tmp_path / "dst.gguf", method="ntk")
    finally:
        os.close(fd)
    assert not stale.exists()
    assert live.exists() and other.exists() and all(o.exists() for o in odd) and link.is_symlink()
    assert small_gguf.exists() and RM.read_rope_metadata(r.path)["method"] == "ntk"
    # unlocked now (its writer "died"): the next write, here the in-place fast path, sweeps it
    assert RM.write_rope_metadata(tmp_path / "dst.gguf", None, method="mixed").header_only
    assert not live.exists() and other.exists()
    t = _fake_temp(tmp_path, "dst.gguf", "00000000")
    assert AW.sweep_stale_temp_files(tmp_path / "dst.gguf") == [t.name] and not t.exists()


def test_temp_file_is_locked_while_written(small_gguf, tmp_path, monkeypatch) -> None:
    """While a write is in progress its temporary file (named or O_TMPFILE) is flocked, so
    a sweep from another process leaves it alone."""
    import fcntl

    real = GW.copy_data
    for tmpfile in (True, False):
        monkeypatch.setattr(AW, "_USE_O_TMPFILE", tmpfile)
        AW._tmpfile_ok.clear()
        seen = []

        def probe(src_fd, dst_fd, *a, **k):
            fd = os.open(f"/proc/self/fd/{dst_fd}", os.O_RDONLY)  # a new open file: its own lock
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append(AW.sweep_stale_temp_files(tmp_path / "o.gguf"))
            finally:
                os.close(fd)
            return real(src_fd, dst_fd, *a, **k)

        monkeypatch.setattr(GW, "copy_data", probe)
        RM.write_rope_metadata(small_gguf, tmp_path / "o.gguf", method="ntk")
        assert seen == [[]] and no_temp_files(tmp_path)
    AW._tmpfile_ok.clear()


# --------------------------------------------------------------------------- SIGKILL


_KILL_CHILD = r"""
import os, sys, time
from ggufrope import atomic_write as AW, gguf_writer as GW, rope_metadata as RM
AW._USE_O_TMPFILE = sys.argv[4] == "1"
stage = sys.argv[3]
real_copy, real_segments = AW.copy_range, GW._write_segments
def stall(*a):
    print("ready", flush=True)
    time.sleep(60)
if stage == "header":
    GW._write_segments = lambda *a: stall()
elif stage == "data":  # the header is written, the data copy starts
    def segments_then_stall(*a):
        n = real_segments(*a)
        AW.copy_range = lambda *a: stall()
        return n
    GW._write_segments = segments_then_stall
else:  # after the data, before the rename
    AW.AtomicFile.commit = lambda self: (os.fsync(self.fd), stall())
RM.write_rope_metadata(sys.argv[1], sys.argv[2], method="mixed", logn=True)
"""


@pytest.mark.parametrize("stage", ["header", "data", "commit"])
def test_sigkill_leaves_destination_intact_and_no_temp_file(small_gguf, tmp_path, stage) -> None:
    """SIGKILL at several points of a write: the destination keeps its old bytes; with
    O_TMPFILE (where the filesystem has it) no temporary file is left either."""
    import signal
    import subprocess
    import sys

    dst = tmp_path / "dst.gguf"
    dst.write_bytes(b"old")
    tmpfile = AW._tmpfile_works(str(tmp_path))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.Popen(
        [sys.executable, "-c", _KILL_CHILD, str(small_gguf), str(dst), stage, "1" if tmpfile else "0"],
        stdout=subprocess.PIPE, env=env, text=True,
    )
    try:
        assert p.stdout.readline().strip() == "ready"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert dst.read_bytes() == b"old"
    leftovers = [f for f in os.listdir(tmp_path) if "ggufrope-tmp" in f]
    if tmpfile:
        assert leftovers == []
    else:  # a named temporary file cannot be cleaned up after SIGKILL
        assert len(leftovers) <= 1


# --------------------------------------------------------------------------- SIGKILL, for real


_KILL_WRITER = r"""
import sys
from ggufrope import atomic_write as AW, rope_metadata as RM
AW._USE_O_TMPFILE = sys.argv[3] == "1"
RM.write_rope_metadata(sys.argv[1], None if sys.argv[2] == "-" else sys.argv[2], method="mixed", logn=True)
"""


def gguf_with_data(path: Path, nbytes: int, seed: int = 0) -> Path:
    """A llama GGUF whose data section is one tensor of ``nbytes`` random bytes (data
    section not 4096-aligned, as in most real files)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(4096)
    w.add_rope_dimension_count(64)
    w.add_name("x" * (seed % 7))
    w.add_tensor("t", np.random.default_rng(seed).integers(-128, 128, size=nbytes, dtype=np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def large_gguf(tmp_path_factory):
    """96 MiB of tensor data, its hash, and the hash and size of its `set` output: large
    enough that a kill lands inside the data copy (~0.1 s here)."""
    d = tmp_path_factory.mktemp("large")
    src = gguf_with_data(d / "large.gguf", 96 << 20, seed=5)
    ref = d / "ref.gguf"
    RM.write_rope_metadata(src, ref, method="mixed", logn=True)
    info = {"src": src, "old": file_hash(src), "new": file_hash(ref), "size": ref.stat().st_size}
    ref.unlink()
    return info


def _kill_during_copy(src: Path, dst: Path | None, d: Path, frac: float, tmpfile: bool, final: int) -> int:
    """Start a real write of ``src`` (to ``dst``, or in place), watch its temporary file
    through /proc/PID/fd, SIGKILL it once that file holds ``frac`` of its final size
    (``frac`` 1: once complete, i.e. during fsync, verify or rename). Returns the size the
    temporary file had when the signal was sent (-1: the write ended first)."""
    import signal
    import subprocess
    import sys
    import time

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.Popen([sys.executable, "-c", _KILL_WRITER, str(src), str(dst) if dst else "-", "1" if tmpfile else "0"], env=env)
    seen = -1
    try:
        deadline = time.monotonic() + 60
        while p.poll() is None and time.monotonic() < deadline:
            for fd in os.listdir(f"/proc/{p.pid}/fd") if os.path.isdir(f"/proc/{p.pid}/fd") else []:
                try:
                    target = os.readlink(f"/proc/{p.pid}/fd/{fd}")
                    if not target.startswith(str(d) + "/") or not ("ggufrope-tmp" in target or "(deleted)" in target):
                        continue
                    size = os.stat(f"/proc/{p.pid}/fd/{fd}").st_size
                except OSError:
                    continue
                if size >= frac * final:
                    os.kill(p.pid, signal.SIGKILL)
                    seen = size
                    break
            if seen >= 0:
                break
            time.sleep(0.0002)
    finally:
        if p.poll() is None and seen < 0:
            p.kill()
        p.wait(timeout=60)
    if seen >= 0:
        assert p.returncode == -signal.SIGKILL
    return seen


def _kill_where_asked(src: Path, dst: Path | None, d: Path, frac: float, tmpfile: bool, final: int, reset,
                      tries: int = 6) -> int:
    """``_kill_during_copy`` until the kill lands where ``frac`` asks: for ``frac`` < 1 inside the
    data copy (0 < seen < final), for ``frac`` 1 anywhere once the file is complete (seen >= 0).
    The write can win the race: the kernel's copy_file_range can outrun the poll between two
    looks at the file (the last 5 % of 96 MiB is about a millisecond), and then the kill comes
    after the copy, or after the whole write. ``reset()`` restores the destination before
    another try. Returns the size seen; AssertionError after ``tries`` misses."""
    seen = -1
    for attempt in range(tries):
        seen = _kill_during_copy(src, dst, d, frac, tmpfile, final)
        if (0 < seen < final) if frac < 1 else seen >= 0:
            return seen
        reset()  # the write won the race: run it again
    raise AssertionError(f"the kill never landed where asked (frac {frac}) in {tries} tries (last size seen {seen} of {final})")


@pytest.mark.parametrize("frac", [0.05, 0.5, 0.95, 1.0])
def test_sigkill_during_a_large_write(large_gguf, tmp_path, frac) -> None:
    """A real write of ~96 MiB killed with SIGKILL at several points of the data copy (and
    once the temporary file is complete): the destination keeps its old bytes (or, for the
    last point, has the complete new ones), verified by hash; O_TMPFILE leaves nothing."""
    if not AW._tmpfile_works(str(tmp_path)):
        pytest.skip("no O_TMPFILE here (the named fallback is tested below)")
    dst = tmp_path / "dst.gguf"
    dst.write_bytes(b"old contents")
    old = file_hash(dst)
    seen = _kill_where_asked(large_gguf["src"], dst, tmp_path, frac, True, large_gguf["size"],
                             lambda: dst.write_bytes(b"old contents"), tries=6 if frac < 1 else 3)
    if frac < 1:
        assert 0 < seen < large_gguf["size"]  # the kill landed inside the data copy
        assert file_hash(dst) == old
    else:
        assert file_hash(dst) in (old, large_gguf["new"])
    assert no_temp_files(tmp_path) and os.listdir(tmp_path) == ["dst.gguf"]
    assert file_hash(large_gguf["src"]) == large_gguf["old"]


def test_sigkill_during_a_large_in_place_rewrite(large_gguf, tmp_path) -> None:
    """In place (the first set: a full rewrite), killed mid-copy: the file is the old one."""
    if not AW._tmpfile_works(str(tmp_path)):
        pytest.skip("no O_TMPFILE here")
    src = tmp_path / "m.gguf"
    shutil.copyfile(large_gguf["src"], src)
    seen = _kill_where_asked(src, None, tmp_path, 0.5, True, large_gguf["size"], lambda: shutil.copyfile(large_gguf["src"], src))
    assert 0 < seen < large_gguf["size"]
    assert file_hash(src) == large_gguf["old"]
    assert os.listdir(tmp_path) == ["m.gguf"]


def test_sigkill_with_named_temp_file_then_next_write_sweeps_it(large_gguf, tmp_path) -> None:
    """The fallback for filesystems without O_TMPFILE: SIGKILL leaves its named temporary
    file (nothing can remove it then), the destination is intact, and the next write to the
    same destination removes the leftover."""
    dst = tmp_path / "dst.gguf"
    dst.write_bytes(b"old contents")
    def reset() -> None:
        for f in os.listdir(tmp_path):
            if "ggufrope-tmp" in f:
                os.unlink(tmp_path / f)
        dst.write_bytes(b"old contents")

    seen = _kill_where_asked(large_gguf["src"], dst, tmp_path, 0.5, False, large_gguf["size"], reset)
    assert 0 < seen < large_gguf["size"]
    assert dst.read_bytes() == b"old contents"
    left = [f for f in os.listdir(tmp_path) if "ggufrope-tmp" in f]
    assert len(left) == 1 and left[0].startswith(".dst.gguf.ggufrope-tmp-")
    RM.write_rope_metadata(large_gguf["src"], dst, method="mixed", logn=True)
    assert os.listdir(tmp_path) == ["dst.gguf"]
    assert file_hash(dst) == large_gguf["new"]


# --------------------------------------------------------------------------- real filesystems


def _mount(args: list[str], where: Path) -> str | None:
    """Mount (root only); None on success, else why not."""
    import subprocess

    if os.geteuid() != 0:
        return "mounting needs root"
    p = subprocess.run(["mount", *args, str(where)], capture_output=True, text=True)
    return None if p.returncode == 0 else f"mount {' '.join(args)} refused: {p.stderr.strip()}"


def _umount(where: Path) -> None:
    import subprocess

    subprocess.run(["umount", str(where)], capture_output=True)
    if os.path.ismount(where):
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs (root and mount(2) needed; otherwise the simulated ENOSPC of
    test_failure_mid_write_leaves_nothing stands in)."""
    d = tmp_path / "fs"
    d.mkdir()
    why = _mount(["-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs"], d)
    if why:
        pytest.skip(f"{why}; the simulated ENOSPC test covers this")
    try:
        yield d
    finally:
        _umount(d)


def _free(d: Path) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


@pytest.mark.parametrize("tmpfile", [True, False])
def test_full_filesystem_during_a_write(small_fs, tmp_path, monkeypatch, tmpfile) -> None:
    """12 MiB of data into an 8 MiB filesystem: a clean one-line error, the old destination
    and the source intact, no temporary file, the space given back."""
    monkeypatch.setattr(AW, "_USE_O_TMPFILE", tmpfile)
    AW._tmpfile_ok.clear()
    src = gguf_with_data(tmp_path / "src.gguf", 12 << 20)
    before = file_hash(src)
    dst = small_fs / "dst.gguf"
    dst.write_bytes(b"old contents")
    free = _free(small_fs)
    with pytest.raises(GGUFRopeError) as ei:
        RM.write_rope_metadata(src, dst, method="mixed", logn=True)
    msg = str(ei.value)
    assert "\n" not in msg and msg == f"cannot write {dst}: No space left on device"
    assert dst.read_bytes() == b"old contents" and file_hash(src) == before
    assert os.listdir(small_fs) == ["dst.gguf"]
    assert _free(small_fs) == free
    AW._tmpfile_ok.clear()


def test_full_filesystem_during_an_in_place_rewrite(small_fs) -> None:
    """The first in-place set of a 5 MiB file on an 8 MiB filesystem needs a second copy:
    the CLI says so in one line with exit status 2 and the file is untouched."""
    from click.testing import CliRunner

    from ggufrope.cli import main

    src = gguf_with_data(small_fs / "m.gguf", 5 << 20)
    before = file_hash(src)
    free = _free(small_fs)
    r = CliRunner().invoke(main, ["set", str(src), "-m", "mixed", "--logn", "--in-place"])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr == f"ggufrope: error: cannot write {src}: No space left on device\n"
    assert file_hash(src) == before and os.listdir(small_fs) == ["m.gguf"] and _free(small_fs) == free


@pytest.mark.parametrize("fs", ["btrfs", "xfs"])
def test_copy_on_write_filesystem_shares_the_data_extents(tmp_path, fs) -> None:
    """On a loop-mounted btrfs or XFS image, `set` shares the data extents of the source
    (filefrag: all but the first, partial block are flagged shared), and an in-place re-set
    keeps them shared; a write placed without the mod-4096 rule shares nothing."""
    import re
    import subprocess

    mkfs = {"btrfs": "mkfs.btrfs", "xfs": "mkfs.xfs"}[fs]
    if not shutil.which(mkfs) or not shutil.which("filefrag"):
        pytest.skip(f"{mkfs} or filefrag not installed")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with open(img, "wb") as f:
        f.truncate(320 << 20)
    subprocess.run([mkfs, "-q", "-f", str(img)], check=True, capture_output=True)
    why = _mount(["-o", "loop", str(img)], mnt)
    if why:
        pytest.skip(why)
    try:
        def shared(p: Path) -> tuple[int, int]:
            out = subprocess.run(["filefrag", "-v", str(p)], capture_output=True, text=True, check=True).stdout
            bs = int(re.search(r"blocks of (\d+) bytes", out).group(1))
            ext = [ln for ln in out.splitlines() if re.match(r"\s*\d+:\s+\d+\.\.", ln)]
            total = sum(int(ln.split(":")[3].strip()) for ln in ext) * bs
            return sum(int(ln.split(":")[3].strip()) for ln in ext if "shared" in ln) * bs, total

        src = gguf_with_data(mnt / "src.gguf", 8 << 20)
        os.sync()
        hs = GR.read_header(src)
        assert hs.data_offset % 4096
        out = mnt / "out.gguf"
        RM.write_rope_metadata(src, out, method="mixed", logn=True)
        os.sync()
        data = src.stat().st_size - hs.data_offset
        n, total = shared(out)
        assert n >= data - 4096 and n >= total - 2 * 4096 - GR.read_header(out).data_offset
        assert_rewrite_ok(src, out)
        assert RM.write_rope_metadata(out, None, method="ntk", factor=2.0).header_only
        os.sync()
        assert shared(out)[0] == n
        ctl = mnt / "ctl.gguf"
        old_page = GW.PAGE
        try:
            GW.PAGE = 32  # placement by the GGUF alignment only
            r = RM.write_rope_metadata(src, ctl, method="mixed", logn=True)
        finally:
            GW.PAGE = old_page
        os.sync()
        assert r.data_offset % 4096 != hs.data_offset % 4096 and shared(ctl)[0] == 0
    finally:
        _umount(mnt)
