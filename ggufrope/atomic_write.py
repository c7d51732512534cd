"""Writing a file safely: a new file appears at its destination complete or not at all, and large ranges are copied by the kernel (nothing here is GGUF-specific).

**Copying.** :func:`copy_range` copies a range of one file into another with
``os.copy_file_range`` (fallback ``os.sendfile``, then a buffered copy);
:func:`copy_data` copies a file's tail (a GGUF data section) so that copy-on-write
filesystems (btrfs, XFS) can share its extents: from offsets congruent modulo
:data:`PAGE` (or the alignment when larger), which the GGUF writer's placement rule
(:func:`ggufrope.gguf_writer._plan`) provides.

**Atomicity.** A new file (:class:`AtomicFile`) is written to an unnamed ``O_TMPFILE``
inode in the destination directory (falling back to a named
``.NAME.ggufrope-tmp-XXXXXXXX`` file where the filesystem has no ``O_TMPFILE``), fsynced,
linked under a temporary name and renamed over the destination with ``os.replace``; the
directory is fsynced. On any exception the temporary file is removed; with ``O_TMPFILE``
not even SIGKILL leaves one behind (except in the microseconds between link and rename).
The temporary file is held under an exclusive ``flock`` until the rename, so the named
file that SIGKILL can leave (fallback, or that window) is recognised as stale and removed
by the next write to the same destination (:func:`sweep_stale_temp_files`).

**Errors.** A failing system call is a :class:`~ggufrope.errors.GGUFRopeError` with a
one-line message (:func:`ggufrope.errors.os_error`).
"""

from __future__ import annotations

import errno
import os
import stat

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


from .errors import GGUFRopeError, os_error, show  # noqa: E402

__all__ = [
    "PAGE",
    "AtomicFile",
    "copy_data",
    "copy_range",
    "same_file",
    "sweep_stale_temp_files",
    "umask",
]


#: ``O_TMPFILE`` / data-offset placement granularity (a page; CoW filesystems share extents
#: only between equal offsets modulo their block size).
PAGE = 4096

_CHUNK = 1 << 20  # the step of the buffered copy


_CFR_FALLBACK = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF, errno.EPERM}
#: switches for tests: which copy mechanisms may be used
_USE_COPY_FILE_RANGE = hasattr(os, "copy_file_range")
_USE_SENDFILE = hasattr(os, "sendfile")


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, count: int) -> None:
    """Copy ``count`` bytes at ``src_off`` to ``dst_off``: copy_file_range (reflinks on
    CoW filesystems), else sendfile, else a 1 MiB buffered copy."""
    use_cfr, use_sf = _USE_COPY_FILE_RANGE, _USE_SENDFILE
    while count > 0:
        step = min(count, 1 << 30)
        if use_cfr:
            try:
                n = os.copy_file_range(src_fd, dst_fd, step, src_off, dst_off)
            except OSError as e:
                if e.errno in _CFR_FALLBACK:
                    use_cfr = False
                    continue
                raise
            if n == 0:  # unsupported source (procfs-like) or the file shrank: let the others decide
                use_cfr = False
                continue
        elif use_sf:
            try:
                os.lseek(dst_fd, dst_off, os.SEEK_SET)
                n = os.sendfile(dst_fd, src_fd, src_off, step)
            except OSError as e:
                if e.errno in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    use_sf = False
                    continue
                raise
            if n == 0:
                raise GGUFRopeError("the source file shrank while it was being copied")
        else:
            data = os.pread(src_fd, min(step, _CHUNK), src_off)
            if not data:
                raise GGUFRopeError("the source file shrank while it was being copied")
            view = memoryview(data)
            n = 0
            while n < len(data):
                n += os.pwrite(dst_fd, view[n:], dst_off + n)
        src_off += n
        dst_off += n
        count -= n


def copy_data(src_fd: int, dst_fd: int, src_off: int, dst_off: int, count: int, block: int = PAGE) -> None:
    """Copy the data section so that copy-on-write filesystems can share its extents.

    A clone (``copy_file_range`` on btrfs and XFS, which the kernel turns into a
    ``remap_file_range``) needs block-aligned start offsets on both sides; given unaligned
    ones, the kernel silently falls back to copying every byte. The data section rarely
    starts on a block boundary, but the placement rule (see
    :func:`ggufrope.gguf_writer._plan`) keeps ``dst_off`` congruent to ``src_off`` modulo
    ``block``: so the bytes up to the source's next block boundary are copied first (less
    than a block), and the rest starts aligned on both sides and can be cloned whole (its
    end is the end of the file)."""
    if count > _CHUNK and hasattr(os, "posix_fadvise"):
        try:  # as cp does: a larger readahead window for a cold source
            os.posix_fadvise(src_fd, src_off, count, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass
    head = min(count, -src_off % block)
    if head and (dst_off - src_off) % block == 0:
        copy_range(src_fd, dst_fd, src_off, dst_off, head)
        src_off, dst_off, count = src_off + head, dst_off + head, count - head
    copy_range(src_fd, dst_fd, src_off, dst_off, count)


#: switch for tests: may unnamed O_TMPFILE files be used
_USE_O_TMPFILE = hasattr(os, "O_TMPFILE")
_tmpfile_ok: dict[int, bool] = {}


def _link_fd(fd: int, name: str) -> None:
    """Give the unnamed (O_TMPFILE) file ``fd`` the name ``name`` (linkat with
    AT_SYMLINK_FOLLOW on /proc/self/fd/N, as open(2) documents)."""
    proc = os.open("/proc/self/fd", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.link(str(fd), name, src_dir_fd=proc, follow_symlinks=True)
    finally:
        os.close(proc)


def _tmpfile_works(d: str) -> bool:
    """Whether directory ``d``'s filesystem supports O_TMPFILE files that can be linked
    (probed once per device with an empty file)."""
    if not _USE_O_TMPFILE or not os.path.isdir("/proc/self/fd"):
        return False
    try:
        dev = os.stat(d).st_dev
    except OSError:
        return False
    ok = _tmpfile_ok.get(dev)
    if ok is None:
        ok = False
        try:
            fd = os.open(d, os.O_RDWR | os.O_TMPFILE | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError:
            fd = -1
        if fd >= 0:
            name = os.path.join(d, f".ggufrope-probe-{os.urandom(6).hex()}")
            try:
                _link_fd(fd, name)
                os.unlink(name)
                ok = True
            except OSError:
                pass
            finally:
                os.close(fd)
        _tmpfile_ok[dev] = ok
    return ok


_TMP_MARK = ".ggufrope-tmp-"


def _tmp_name(d: str, dst: str) -> str:
    return os.path.join(d, f".{os.path.basename(dst)}{_TMP_MARK}{os.urandom(4).hex()}")


def _lock(fd: int) -> bool | None:
    """Take an exclusive flock on ``fd`` without waiting: True when taken, False when
    another open file holds one, None when the filesystem has no locks."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:
        return None
    return True


def sweep_stale_temp_files(dst: str | os.PathLike) -> list[str]:
    """Remove the temporary files that earlier writes to ``dst`` left in its directory
    when they were killed (SIGKILL, power loss) where no cleanup can run: the named
    ``.DST.ggufrope-tmp-XXXXXXXX`` files of the fallback for filesystems without
    ``O_TMPFILE``, or an ``O_TMPFILE`` file killed between its link and its rename.

    A writer holds an exclusive ``flock`` on its temporary file from creation to rename,
    and the kernel drops it when the writer dies; so a file that can be locked belongs to
    no live writer, and is removed. Regular files only, matched by exact name; files whose
    lock cannot be taken (a live writer, a filesystem without locks) are left alone.
    Returns the names removed. Called before every write to ``dst``."""
    dst = os.fsdecode(os.fspath(dst))
    d = os.path.dirname(os.path.abspath(dst)) or "."
    prefix = f".{os.path.basename(dst)}{_TMP_MARK}"
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(d) if n.startswith(prefix)]
    except OSError:
        return removed
    for n in names:
        tail = n[len(prefix) :]
        if len(tail) != 8 or any(c not in "0123456789abcdef" for c in tail):
            continue
        path = os.path.join(d, n)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not _lock(fd):
                continue
            st2 = os.lstat(path)  # still the file that was locked?
            if (st2.st_dev, st2.st_ino) == (st.st_dev, st.st_ino):
                os.unlink(path)
                removed.append(n)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


class AtomicFile:
    """A new file that appears at ``dst`` complete or not at all. It is held under an
    exclusive flock until it is renamed (see :func:`sweep_stale_temp_files`)."""

    def __init__(self, dst: str, mode: int):
        self.dst = dst
        self.dir = os.path.dirname(os.path.abspath(dst)) or "."
        self.name: str | None = None  # named temporary file, if any
        self.fd = -1
        sweep_stale_temp_files(dst)
        flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
        if _tmpfile_works(self.dir):
            try:
                self.fd = os.open(self.dir, flags | os.O_TMPFILE, mode & 0o777)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                    raise os_error(e, "cannot create a file in", self.dir) from None
            else:
                _lock(self.fd)
        if self.fd < 0:
            for _ in range(100):
                name = _tmp_name(self.dir, dst)
                try:
                    fd = os.open(name, flags | os.O_CREAT | os.O_EXCL, mode & 0o777)
                except FileExistsError:
                    continue
                except OSError as e:
                    raise os_error(e, "cannot create a file in", self.dir) from None
                # a sweep by another process may have locked and removed it before we
                # could lock it: then take another name
                if _lock(fd) is False or not _names(name, fd):
                    os.close(fd)
                    continue
                self.fd, self.name = fd, name
                break
            else:  # pragma: no cover
                raise GGUFRopeError(f"cannot create a temporary file in {show(self.dir)}")

    def commit(self) -> None:
        os.fsync(self.fd)
        if self.name is None:
            for _ in range(100):
                name = _tmp_name(self.dir, self.dst)
                try:
                    _link_fd(self.fd, name)
                except FileExistsError:
                    continue
                self.name = name
                break
            else:  # pragma: no cover
                raise GGUFRopeError(f"cannot create a temporary file in {show(self.dir)}")
        os.replace(self.name, self.dst)
        self.name = None
        os.close(self.fd)
        self.fd = -1
        _fsync_dir(self.dir)

    def abort(self) -> None:
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        if self.name is not None:
            try:
                os.unlink(self.name)
            except OSError:
                pass
            self.name = None


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` is (still) the name of the open file ``fd``."""
    try:
        a, b = os.lstat(path), os.fstat(fd)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _fsync_dir(d: str) -> None:
    try:
        fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m
