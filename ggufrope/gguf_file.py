"""Reading and rewriting the metadata of GGUF files at disk speed, atomically.

GGUF files are 5-100 GB; changing a few keys must cost neither a tensor-by-tensor
rewrite nor gigabytes of memory. This module therefore never builds gguf-py's
``GGUFReader`` over a file it rewrites. It parses the header with a streaming reader
(:func:`read_header`: magic, version 2 or 3 in either byte order, counts, key/value pairs,
tensor infos, ``general.alignment``), keeping only file offsets for the raw bytes, and
writes a new file as

* the new header: untouched key/value records and the tensor-info records copied
  byte-exactly from the source, new records packed with gguf-py's constants, padded to the
  alignment;
* the data section copied as one block with ``os.copy_file_range`` (fallback
  ``os.sendfile``, then a buffered copy). Tensor offsets are relative to the data section,
  so the tensor-info records are reused unchanged.

**Tensors appended or replaced** (the stock export, :mod:`ggufrope.stock`): a rewrite may
also append a tensor (a new tensor-info record after the source's, its data after the source's
data section, aligned to ``general.alignment``) or replace one tensor's data (same shape and
type, so every offset stays). The data section is still copied as one block; the few new bytes
are written after it or over it (:class:`TensorWrite`).

**The layout, and the reserved key.** A file written by :func:`write_rope_metadata`
(``ggufrope set``) has its ggufrope keys first, right after the 24-byte fixed header, then
one extra key, :data:`KEY_RESERVED` (``ggufrope.reserved``, an array of zero ``UINT8``),
then the source's other records in their order. The reserved array's length is chosen so
that the header ends exactly where the data section starts and that the data section
starts at the same offset modulo 4096 (or modulo ``general.alignment`` when larger) as in
the source: copy-on-write filesystems (btrfs, XFS) can then share the data extents (see
:func:`_copy_data`). It also keeps at least :data:`MIN_ROOM` bytes of room, so that a
later ``set --in-place`` (new b, new k, log-n toggled, another method) finds a header of
exactly the old length; as the key count (offset 16), the ggufrope keys and the start of
the room all lie in the first 4096 bytes, it rewrites only bytes of that page, with a
single ``pwrite`` (the header-only fast path) and no data copy. Stock llama.cpp ignores
the key (unknown keys are only listed; arrays are not even put in its metadata map).
:func:`reset_rope_metadata` removes it with the other ggufrope keys and puts nothing in
their place, so ``set`` followed by ``reset`` gives back the original file byte for byte
(provided the original had no ggufrope keys).

**Atomicity.** A new file is written to an unnamed ``O_TMPFILE`` inode in the destination
directory (falling back to a named ``.NAME.ggufrope-tmp-XXXXXXXX`` file where the
filesystem has no ``O_TMPFILE``), fsynced, linked under a temporary name and renamed over
the destination with ``os.replace``; the directory is fsynced. On any exception the
temporary file is removed; with ``O_TMPFILE`` not even SIGKILL leaves one behind (except
in the microseconds between link and rename). The temporary file is held under an
exclusive ``flock`` until the rename, so the named file that SIGKILL can leave (fallback,
or that window) is recognised as stale and removed by the next write to the same
destination (:func:`sweep_stale_temp_files`). The source is never modified, except by
the in-place header-only fast path, which rewrites only bytes inside the header (never
tensor data) with one ``pwrite`` within one 4096-byte page, and fsyncs: the kernel checks
for a fatal signal between the pages of a write, not inside one, so SIGKILL leaves the
old header or the new one. A change that does not fit one page is written as a new file.

**Errors.** Everything a hostile or broken file can cause is a
:class:`~ggufrope.errors.GGUFRopeError` with a one-line message; counts and lengths are
checked against the bytes left in the file before anything is read or allocated.
"""

from __future__ import annotations

import builtins
import errno
import math
import os
import stat
import struct
import sys
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO, Callable, Iterable, Mapping

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


from .gguf_constants import (  # noqa: E402
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
    _gguf_constants,
)

from . import keys as K  # noqa: E402
from .errors import GGUFRopeError  # noqa: E402
from . import methods as M  # noqa: E402
from .methods import METHODS  # noqa: E402

__all__ = [
    "KEY_RESERVED",
    "MIN_ROOM",
    "SUPPORTED_VERSIONS",
    "ArrayValue",
    "Header",
    "KeyValue",
    "TensorInfo",
    "TensorWrite",
    "WriteResult",
    "has_rope",
    "read_header",
    "read_rope_metadata",
    "describe_method",
    "write_rope_metadata",
    "reset_rope_metadata",
    "set_keys",
    "sweep_stale_temp_files",
]

#: The padding key (see the module docstring): ARRAY of UINT8 zeros, right after the keys
#: that ``set`` writes, which come first.
KEY_RESERVED = "ggufrope.reserved"
#: Minimum room (bytes of the reserved array) left by a full rewrite, so that any later
#: ``set`` of the ggufrope keys fits into the same header length (all six need 212 bytes plus
#: six times the length of the architecture name: 272 for ``llama``).
MIN_ROOM = 512
#: GGUF versions read and written (v1 had 32-bit counts and is not supported).
SUPPORTED_VERSIONS = (2, 3)
#: ``O_TMPFILE`` / data-offset placement granularity (a page; CoW filesystems share extents
#: only between equal offsets modulo their block size).
PAGE = 4096

GGML_MAX_DIMS = 4
_STRING_KEEP_LIMIT = 1 << 20  # decoded string values longer than this are not kept
_ARRAY_KEEP_LIMIT = 1024  # numeric arrays up to this length are kept as Python lists
_CHUNK = 1 << 20

_SCALAR_FORMATS: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
_SHORT_TYPE = {
    GGUFValueType.UINT8: "u8",
    GGUFValueType.INT8: "i8",
    GGUFValueType.UINT16: "u16",
    GGUFValueType.INT16: "i16",
    GGUFValueType.UINT32: "u32",
    GGUFValueType.INT32: "i32",
    GGUFValueType.FLOAT32: "f32",
    GGUFValueType.BOOL: "bool",
    GGUFValueType.STRING: "str",
    GGUFValueType.ARRAY: "arr",
    GGUFValueType.UINT64: "u64",
    GGUFValueType.INT64: "i64",
    GGUFValueType.FLOAT64: "f64",
}
_INT_TYPES = (
    GGUFValueType.UINT8,
    GGUFValueType.INT8,
    GGUFValueType.UINT16,
    GGUFValueType.INT16,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT64,
)

_F32_MAX = float.fromhex("0x1.fffffep+127")  # the largest finite float32


# --------------------------------------------------------------------------- data model


@dataclass(frozen=True)
class ArrayValue:
    """An ARRAY value: element type, length, and the values for short numeric arrays."""

    elem_type: GGUFValueType
    count: int
    values: list | None = None

    def __str__(self) -> str:
        return f"arr[{_SHORT_TYPE[self.elem_type]},{self.count}]"


@dataclass(frozen=True)
class KeyValue:
    """One key/value record; ``start``/``end`` are its byte range in the file."""

    key: str
    vtype: GGUFValueType
    value: Any
    start: int
    end: int


@dataclass(frozen=True)
class TensorInfo:
    """One tensor-info record (``shape`` in ggml order, ne[0] first; ``offset`` relative
    to the data section; ``nbytes`` None for a ggml type that the installed gguf-py does not
    list: a header rewrite reuses the offsets and needs no type sizes, so such a tensor passes
    through unchecked)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int
    nbytes: int | None


@dataclass(frozen=True)
class TensorWrite:
    """A tensor that a rewrite (:func:`_rewrite`, through its ``build`` callback) appends or
    whose data it replaces. ``name`` absent from the source: a new tensor-info record after the
    source's ones and its data at the end of the data section, aligned to
    ``general.alignment``. ``name`` present: that tensor's data bytes are replaced in the copy
    (``shape`` and ``ggml_type`` must be the source tensor's; its record is kept). ``shape`` in
    ggml order (ne[0] first); ``data`` the raw bytes, in the file's byte order, of exactly the
    tensor's size (a type gguf-py knows)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    data: bytes


@dataclass
class Header:
    """A parsed GGUF header. Raw records stay in the file; only their offsets are kept."""

    path: str
    file_size: int
    endian: str  # "<" little, ">" big
    version: int
    tensor_count: int
    kvs: list[KeyValue]
    tensor_info_start: int
    tensor_info_end: int
    alignment: int
    data_offset: int
    tensors: list[TensorInfo] = field(repr=False)
    stat: os.stat_result | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._index = {kv.key: i for i, kv in enumerate(self.kvs)}

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def get(self, key: str) -> KeyValue | None:
        i = self._index.get(key)
        return None if i is None else self.kvs[i]

    def value(self, key: str, default: Any = None) -> Any:
        kv = self.get(key)
        return default if kv is None else kv.value

    @property
    def architecture(self) -> str | None:
        v = self.value("general.architecture")
        return v if isinstance(v, str) else None

    @property
    def header_end(self) -> int:
        return self.tensor_info_end


@dataclass(frozen=True)
class WriteResult:
    """What a rewrite did."""

    path: str
    header_only: bool  #: True: in-place fast path, only header bytes were rewritten
    data_offset: int  #: data section offset in the written file
    source_data_offset: int
    header_bytes: int  #: bytes of header written (fast path: the rewritten span only)
    data_bytes: int  #: bytes of data section copied (0 on the fast path)
    reserved: int | None  #: length of the reserved array, None when the file has none
    removed: tuple[str, ...] = ()  #: keys of the source not in the result (reserved key included)
    description: str | None = None  #: ``write_rope_metadata``: the method written, in words
    notes: tuple[str, ...] = ()  #: remarks for the user (e.g. stock rope scaling also present)
    tensors_appended: tuple[str, ...] = ()  #: names of the tensors appended (:class:`TensorWrite`)
    tensors_replaced: tuple[str, ...] = ()  #: names of the tensors whose data was replaced


# --------------------------------------------------------------------------- helpers


def _show(path: Any) -> str:
    """A path for a one-line message (non-printable names are quoted)."""
    s = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    return s if s.isprintable() else repr(s)


def _align(x: int, a: int) -> int:
    return x + (-x % a)


def _type_name(t: int) -> str:
    try:
        return GGUFValueType(t).name
    except ValueError:
        return str(t)


_f32 = M.to_float32  # the float32 value nearest to x, inf on overflow


def f32_repr(x: float) -> str:
    """Shortest decimal that round-trips through float32 (``2.7`` rather than 2.70000004;
    the digits of numpy's ``str(np.float32(x))``), in Python's ``repr`` notation
    (``100000.0``, ``1e+20``; numpy 2 switches to exponents from 1e6 on)."""
    x = _f32(x)
    if not math.isfinite(x) or x == 0:
        return repr(x)
    for digits in range(1, 10):  # 9 significant digits always round-trip a float32
        s = f"{x:.{digits - 1}e}"
        if _f32(float(s)) == x:
            # the double nearest s has s as its shortest repr
            return repr(float(s))
    return repr(x)  # pragma: no cover


def _os_error(e: OSError, what: str, path: Any) -> GGUFRopeError:
    reason = e.strerror or str(e)
    return GGUFRopeError(f"{what} {_show(path)}: {reason}")


# --------------------------------------------------------------------------- reading


class _Stream:
    """Sequential reader over a file with a bounded buffer and size-checked reads."""

    def __init__(self, f: BinaryIO, size: int, path: str):
        self.f = f
        self.size = size
        self.path = path
        self.buf = b""
        self.pos = 0  # position in buf
        self.base = 0  # file offset of buf[0]
        self.endian = "<"
        self._structs: dict[str, struct.Struct] = {}

    def st(self, fmt: str) -> struct.Struct:
        s = self._structs.get(fmt)
        if s is None:
            s = self._structs[fmt] = struct.Struct(self.endian + fmt)
        return s

    def tell(self) -> int:
        return self.base + self.pos

    def remaining(self) -> int:
        return self.size - self.tell()

    def error(self, msg: str) -> GGUFRopeError:
        return GGUFRopeError(f"{_show(self.path)}: {msg}")

    def truncated(self, what: str, n: int) -> GGUFRopeError:
        return self.error(
            f"truncated GGUF header: {what} at offset {self.tell()} needs {n} bytes, "
            f"the file has {max(0, self.remaining())} left"
        )

    def need(self, n: int, what: str) -> None:
        if n > self.remaining():
            raise self.truncated(what, n)
        avail = len(self.buf) - self.pos
        if avail >= n:
            return
        keep = self.buf[self.pos :]
        self.base += self.pos
        self.pos = 0
        more = self.f.read(max(n - avail, _CHUNK))
        self.buf = keep + more
        if len(self.buf) < n:  # the file shrank under us
            raise self.truncated(what, n)

    def unpack(self, fmt: str, what: str) -> Any:
        s = self.st(fmt)
        self.need(s.size, what)
        (v,) = s.unpack_from(self.buf, self.pos)
        self.pos += s.size
        return v

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        b = self.buf[self.pos : self.pos + n]
        self.pos += n
        return b

    def skip(self, n: int, what: str) -> None:
        if n > self.remaining():
            raise self.truncated(what, n)
        if len(self.buf) - self.pos >= n:
            self.pos += n
            return
        self.base = self.tell() + n
        self.pos = 0
        self.buf = b""
        self.f.seek(self.base)

    def string(self, what: str, keep: bool = True) -> str | None:
        n = self.unpack("Q", f"length of {what}")
        if n > self.remaining():
            raise self.error(
                f"truncated GGUF header or corrupt length: {what} has length {n}, "
                f"beyond the end of the file ({self.remaining()} bytes left)"
            )
        if n <= _STRING_KEEP_LIMIT:
            raw = self.take(n, what)
            try:
                s = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise self.error(f"{what} is not valid UTF-8 (byte {e.start})") from None
            return s if keep else None
        import codecs

        dec = codecs.getincrementaldecoder("utf-8")()
        left = n
        try:
            while left:
                k = min(left, _CHUNK)
                dec.decode(self.take(k, what))
                left -= k
            dec.decode(b"", final=True)
        except UnicodeDecodeError:
            raise self.error(f"{what} is not valid UTF-8") from None
        return None

    def skip_strings(self, count: int, what: str) -> None:
        """Validate ``count`` strings (length-prefixed UTF-8) without keeping them.

        Runs of strings that lie whole in the buffer and whose length prefixes are all
        ASCII bytes (< 0x80 each: lengths below 128, most of a vocabulary) are walked by
        their lengths and validated in one decode of the whole run: such a run is valid
        UTF-8 exactly when each string is, since an ASCII byte is always a character
        boundary. Other strings, and the strings of a run that does not decode (for the
        message), are checked one by one."""
        unpack = self.st("Q").unpack_from
        i = 0
        while i < count:
            buf, pos = self.buf, self.pos
            blen = len(buf)
            start, first = pos, i
            for i in range(first, count):  # the hot loop of a header: keep it lean
                try:
                    (n,) = unpack(buf, pos)
                except struct.error:  # the length prefix crosses the buffer's end
                    break
                end = pos + 8 + n
                if end > blen or n & 0x8080808080808080:
                    break
                pos = end
            else:
                i = count
            if pos > start:
                run = buf[start:pos]
                if not (run.isascii() or _utf8_ok(run)):
                    p = start
                    for j in range(first, i):
                        (n,) = unpack(buf, p)
                        if not _utf8_ok(buf[p + 8 : p + 8 + n]):
                            raise self.error(f"{what}[{j}] is not valid UTF-8")
                        p += 8 + n
                self.pos = pos
            if i < count:  # a long string, or one that crosses the buffer's end
                self.string(f"{what}[{i}]", keep=False)
                i += 1


def _utf8_ok(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _parse(f: BinaryIO, path: str, st: os.stat_result) -> Header:
    s = _Stream(f, st.st_size, path)
    magic = s.take(4, "magic") if st.st_size >= 4 else None
    if magic is None or struct.unpack("<I", magic)[0] != GGUF_MAGIC:
        raise s.error("not a GGUF file (bad magic)")
    s.need(4, "version")
    (version,) = struct.unpack_from("<I", s.buf, s.pos)
    if version & 0xFFFF == 0 and version != 0:  # written big-endian (as gguf-py detects it)
        s.endian = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    s.pos += 4
    if version not in SUPPORTED_VERSIONS:
        hint = " (GGUF v1 had 32-bit counts; convert it with a current llama.cpp)" if version == 1 else ""
        raise s.error(f"unsupported GGUF version {version}{hint}; ggufrope reads versions 2 and 3")
    tensor_count = s.unpack("Q", "tensor count")
    kv_count = s.unpack("Q", "key/value count")
    # every key/value takes at least 13 bytes, every tensor info 24: refuse counts the
    # file cannot hold before looping over them
    if kv_count * 13 + tensor_count * 24 > s.remaining():
        raise s.error(
            f"truncated GGUF header or corrupt counts: {kv_count} key/values and {tensor_count} tensors "
            f"cannot fit in the {s.remaining()} bytes left"
        )

    kvs: list[KeyValue] = []
    seen: set[str] = builtins.set()
    alignment = GGUF_DEFAULT_ALIGNMENT
    for i in range(kv_count):
        start = s.tell()
        key = s.string(f"key #{i}")
        assert key is not None
        if key in seen:
            raise s.error(f"duplicate key {key!r}")
        seen.add(key)
        value, vtype = _parse_value(s, key)
        kvs.append(KeyValue(key, vtype, value, start, s.tell()))
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise s.error(f"key 'general.alignment' has type {vtype.name}, expected UINT32")
            if value == 0 or value & (value - 1):
                raise s.error(f"general.alignment = {value} is not a power of two")
            alignment = value

    ti_start = s.tell()
    tensors: list[TensorInfo] = []
    names: set[str] = builtins.set()
    for i in range(tensor_count):
        name = s.string(f"name of tensor #{i}")
        assert name is not None
        if name in names:
            raise s.error(f"duplicate tensor name {name!r}")
        names.add(name)
        n_dims = s.unpack("I", f"dimension count of tensor {name!r}")
        if n_dims > GGML_MAX_DIMS:
            raise s.error(f"tensor {name!r} has {n_dims} dimensions (at most {GGML_MAX_DIMS})")
        shape = tuple(s.unpack("Q", f"shape of tensor {name!r}") for _ in range(n_dims))
        gtype = s.unpack("I", f"type of tensor {name!r}")
        offset = s.unpack("Q", f"offset of tensor {name!r}")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(gtype)]
        except (ValueError, KeyError):  # newer than gguf-py (e.g. 42, Q2_0): sizes unknown
            block = type_size = None
        ne = 1
        for d in shape:
            if d >= 1 << 63:
                raise s.error(f"tensor {name!r} has a dimension beyond int64")
            ne *= d
        nbytes = None
        if block is not None:
            if shape and shape[0] % block:
                raise s.error(f"tensor {name!r}: ne[0] = {shape[0]} is not a multiple of its block size {block}")
            nbytes = ne // block * type_size
        if offset % alignment:
            raise s.error(f"tensor {name!r} has offset {offset}, not a multiple of the alignment {alignment}")
        tensors.append(TensorInfo(name, shape, gtype, offset, nbytes))
    ti_end = s.tell()

    data_offset = _align(ti_end, alignment)
    data_size = st.st_size - data_offset
    # tensors of a type unknown to gguf-py: at least their start must lie in the file
    need = max((t.offset + (t.nbytes or 0) for t in tensors), default=0)
    if tensors and need > data_size:
        raise s.error(
            f"truncated tensor data: the tensors need {need} bytes after offset {data_offset}, "
            f"the file has {max(0, data_size)}"
        )
    return Header(
        path=path,
        file_size=st.st_size,
        endian=s.endian,
        version=version,
        tensor_count=tensor_count,
        kvs=kvs,
        tensor_info_start=ti_start,
        tensor_info_end=ti_end,
        alignment=alignment,
        data_offset=data_offset,
        tensors=tensors,
        stat=st,
    )


def _parse_value(s: _Stream, key: str) -> tuple[Any, GGUFValueType]:
    raw_t = s.unpack("I", f"value type of {key!r}")
    try:
        vtype = GGUFValueType(raw_t)
    except ValueError:
        raise s.error(f"key {key!r} has unknown value type {raw_t}") from None
    if vtype == GGUFValueType.STRING:
        return s.string(f"value of {key!r}"), vtype
    if vtype != GGUFValueType.ARRAY:
        return s.unpack(_SCALAR_FORMATS[vtype], f"value of {key!r}"), vtype
    raw_e = s.unpack("I", f"element type of {key!r}")
    try:
        etype = GGUFValueType(raw_e)
    except ValueError:
        raise s.error(f"array {key!r} has unknown element type {raw_e}") from None
    if etype == GGUFValueType.ARRAY:
        raise s.error(f"array {key!r} holds arrays (nested arrays are not supported by llama.cpp)")
    count = s.unpack("Q", f"length of array {key!r}")
    if etype == GGUFValueType.STRING:
        if count * 8 > s.remaining():
            raise s.error(f"truncated GGUF header or corrupt length: array {key!r} has {count} strings, beyond the end of the file")
        s.skip_strings(count, f"array {key!r}")
        return ArrayValue(etype, count), vtype
    st = s.st(_SCALAR_FORMATS[etype])
    nbytes = count * st.size
    if nbytes > s.remaining():
        raise s.error(f"truncated GGUF header or corrupt length: array {key!r} has {count} elements, beyond the end of the file")
    if count <= _ARRAY_KEEP_LIMIT:
        raw = s.take(nbytes, f"array {key!r}")
        values = [v for (v,) in st.iter_unpack(raw)]
        return ArrayValue(etype, count, values), vtype
    s.skip(nbytes, f"array {key!r}")
    return ArrayValue(etype, count), vtype


def _stat_source(path: Any) -> tuple[str, os.stat_result]:
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise GGUFRopeError(f"no such file: {_show(p)}") from None
    except OSError as e:
        raise _os_error(e, "cannot access", p) from None
    if stat.S_ISDIR(st.st_mode):
        raise GGUFRopeError(f"{_show(p)} is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):
        raise GGUFRopeError(f"{_show(p)} is not a regular file")
    return p, st


def read_header(path: str | os.PathLike) -> Header:
    """Parse the header of the GGUF file at ``path`` (streaming; nothing but the header
    is read, and no more than about 1 MiB is held at a time besides small values).

    Raises :class:`GGUFRopeError` for every problem with the path or the file.
    """
    p, _ = _stat_source(path)
    try:
        with open(p, "rb", buffering=0) as f:
            return _parse(f, p, os.fstat(f.fileno()))
    except GGUFRopeError:
        raise
    except OSError as e:
        raise _os_error(e, "cannot read", p) from None


# --------------------------------------------------------------------------- rope metadata

#: Types of the keys ggufrope reads, as llama.cpp's loader requires them
#: (``{arch}.attention.head_count`` may also be a per-layer array).
_READ_TYPES: dict[str, tuple[GGUFValueType, ...]] = {
    K.KEY_CONTEXT_LENGTH: (GGUFValueType.UINT32,),
    K.KEY_ORIG_CTX: (GGUFValueType.UINT32,),
    K.KEY_FREQ_BASE: (GGUFValueType.FLOAT32,),
    K.KEY_ROPE_DIMS: (GGUFValueType.UINT32,),
    K.KEY_SCALING_TYPE: (GGUFValueType.STRING,),
    K.KEY_SCALING_FACTOR: (GGUFValueType.FLOAT32,),
    "{arch}.attention.key_length": (GGUFValueType.UINT32,),
    "{arch}.embedding_length": (GGUFValueType.UINT32,),
    "{arch}.attention.head_count": (GGUFValueType.UINT32, GGUFValueType.ARRAY),
}


def _check_types(h: Header, arch: str, *, ggufrope_keys: bool) -> None:
    table = dict(_READ_TYPES)
    if ggufrope_keys:
        table.update({t: (vt,) for t, vt in K.KEY_TYPES.items()})
    for tmpl, types in table.items():
        name = K.key(tmpl, arch)
        kv = h.get(name)
        if kv is not None and kv.vtype not in types:
            want = " or ".join(t.name for t in types)
            raise GGUFRopeError(f"{_show(h.path)}: key {name!r} has type {kv.vtype.name}, expected {want}")


def _architecture(h: Header) -> str:
    kv = h.get("general.architecture")
    if kv is None:
        raise GGUFRopeError(f"{_show(h.path)}: no general.architecture key")
    if kv.vtype != GGUFValueType.STRING:
        raise GGUFRopeError(f"{_show(h.path)}: key 'general.architecture' has type {kv.vtype.name}, expected STRING")
    if not kv.value:
        raise GGUFRopeError(f"{_show(h.path)}: general.architecture is empty")
    return kv.value


def has_rope(h: Header, arch: str) -> bool:
    """Whether the file has rope keys (``{arch}.rope.freq_base`` or
    ``{arch}.rope.dimension_count``), as ``show`` reports it. Not the rule of ``set``: converters
    may omit both for architectures that use RoPE, so ``set`` asks the patched library which
    architectures it serves (:func:`_require_served`)."""
    return K.key(K.KEY_FREQ_BASE, arch) in h or K.key(K.KEY_ROPE_DIMS, arch) in h


def _require_served(h: Header, arch: str) -> None:
    """Refuse ``arch`` unless the patched library applies a method to it
    (``llama_ggufrope_arch_supported``, :func:`ggufrope.runtime.arch_supported`): the one list
    of served architectures, the same that makes the library refuse to load a method for the
    others. Raises :class:`GGUFRopeError` also when no patched library is installed."""
    from .runtime import arch_supported

    if not arch_supported(arch, "ggufrope set"):
        raise GGUFRopeError(
            f"{_show(h.path)}: architecture {arch!r} is not served by the patched llama.cpp (it would refuse "
            "to load a method for it: no RoPE, or ropes other than the per-layer Q/K NORMAL/NEOX ropes)"
        )


def _rope_dims(h: Header, arch: str) -> tuple[int | None, str | None]:
    for tmpl in (K.KEY_ROPE_DIMS, "{arch}.attention.key_length"):
        v = h.value(K.key(tmpl, arch))
        if isinstance(v, int):
            return v, K.key(tmpl, arch)
    emb = h.value(K.key("{arch}.embedding_length", arch))
    heads = h.value(K.key("{arch}.attention.head_count", arch))
    if isinstance(heads, ArrayValue):
        vals = [v for v in (heads.values or []) if v]
        heads = max(vals) if vals else None
    if isinstance(emb, int) and isinstance(heads, int) and heads > 0:
        return emb // heads, f"{K.key('{arch}.embedding_length', arch)} / head_count"
    return None, None


def describe_method(meta: Mapping[str, Any]) -> str:
    """The active method in words, e.g.
    ``ntk-mixed, b = 0.625, k = auto (max(1, n_ctx_seq/8192)), log-n on`` or, with dynamic k,
    ``ntk-mixed, b = 0.625, k dynamic: 1 within L, then powers of 2 >= n/L, KV cache
    re-rotated, log-n on``.

    ``meta``: ``method`` (None: no ggufrope keys), ``factor`` (None: auto), ``exponent`` and
    ``exponent_default`` (b not in the file: 0.625, said "(default)"), ``logn``, ``dynamic``
    (what the library runs, :func:`ggufrope.methods.dynamic_effective`) and ``dynamic_ratio``,
    ``n_ctx_orig``, and the file's stock scaling (``stock_scaling_type``,
    ``stock_scaling_factor``): an NTK-family method replaces a stock yarn/linear scaling,
    method none (log-n alone) keeps it.
    """
    m = meta.get("method")
    L = meta.get("n_ctx_orig")
    st = meta.get("stock_scaling_type")
    stock = None
    if st and st != "none":
        f = meta.get("stock_scaling_factor")
        stock = f"stock llama.cpp rope scaling {st!r}" + (f" (factor {f32_repr(f)})" if f is not None else "")
    if m is None:
        if stock:
            return f"no ggufrope method; {stock}"
        return "none (no ggufrope keys: plain RoPE, as stock llama.cpp)"
    k = meta.get("factor")
    kt = f32_repr(k) if k is not None else f"auto (max(1, n_ctx_seq/{L if L else 'L'}))"
    b = meta.get("exponent")
    bt = None if b is None else f32_repr(b) + (" (default)" if meta.get("exponent_default") else "")
    dyn = bool(meta.get("dynamic"))
    s = M.summary(m, None if dyn else kt, bt, bool(meta.get("logn")), dynamic=dyn,
                  dynamic_ratio=meta.get("dynamic_ratio"))
    if stock:
        s += f"; replaces the file's {stock}" if METHODS[m].ntk_family else f"; the file's {stock} stays in effect"
    return s


def _n_ctx_orig(h: Header, arch: str) -> tuple[int | None, str | None]:
    """L and the key it comes from: original_context_length when non-zero, else
    context_length (as llama.cpp's n_ctx_orig_yarn); (None, None) when neither."""
    for tmpl in (K.KEY_ORIG_CTX, K.KEY_CONTEXT_LENGTH):
        x = h.value(K.key(tmpl, arch))
        if isinstance(x, int) and not isinstance(x, bool) and x > 0:
            return x, K.key(tmpl, arch)
    return None, None


def _rope_meta(h: Header) -> dict[str, Any]:
    arch = _architecture(h)
    _check_types(h, arch, ggufrope_keys=True)
    v = lambda tmpl: h.value(K.key(tmpl, arch))  # noqa: E731
    ctx = v(K.KEY_CONTEXT_LENGTH)
    L, L_src = _n_ctx_orig(h, arch)
    dims, dims_src = _rope_dims(h, arch)
    method, factor, exponent = v(K.KEY_METHOD), v(K.KEY_FACTOR), v(K.KEY_EXPONENT)
    dynamic, ratio = v(K.KEY_DYNAMIC), v(K.KEY_DYNAMIC_RATIO)
    logn = v(K.KEY_LOGN)
    where = _show(h.path)
    exponent_default = False
    if method is not None:
        try:
            p = M.validate_stored(method, factor, exponent, dynamic, ratio)
        except ValueError as e:
            raise GGUFRopeError(f"{where}: invalid ggufrope metadata: {e}; fix it with ggufrope set or ggufrope reset") from None
        factor, exponent, exponent_default = p.factor, p.exponent, p.exponent_default
        dynamic, ratio = p.dynamic, p.dynamic_ratio
    present = {name: h.value(name) for name in K.ggufrope_keys(arch) if name in h}
    if method is None and (present or False):
        raise GGUFRopeError(
            f"{where}: ggufrope keys without {K.key(K.KEY_METHOD, arch)}; fix it with ggufrope set or ggufrope reset"
        )
    reserved = h.get(KEY_RESERVED)
    meta: dict[str, Any] = {
        "path": h.path,
        "gguf_version": h.version,
        "endian": "little" if h.endian == "<" else "big",
        "file_size": h.file_size,
        "tensor_count": h.tensor_count,
        "kv_count": len(h.kvs),
        "alignment": h.alignment,
        "data_offset": h.data_offset,
        "architecture": arch,
        "has_rope": has_rope(h, arch),
        "context_length": ctx,
        "n_ctx_orig": L,
        "n_ctx_orig_key": L_src,
        "freq_base": v(K.KEY_FREQ_BASE),
        "rope_dims": dims,
        "rope_dims_source": dims_src,
        "stock_scaling_type": v(K.KEY_SCALING_TYPE),
        "stock_scaling_factor": v(K.KEY_SCALING_FACTOR),
        "ggufrope_keys": {k_: (bool(x) if isinstance(x, bool) else x) for k_, x in present.items()},
        "method": method,
        "factor": factor,
        "exponent": exponent,
        "exponent_default": exponent_default,
        "dynamic": bool(dynamic),
        "dynamic_ratio": ratio if dynamic else None,
        "logn": bool(logn) if logn is not None else False,
        "reserved": reserved.value.count if reserved is not None and isinstance(reserved.value, ArrayValue) else None,
    }
    meta["description"] = describe_method(meta)
    return meta


def read_rope_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The rope-relevant metadata of a GGUF file, as a JSON-serialisable dict.

    Keys: ``path``, ``gguf_version``, ``endian``, ``file_size``, ``tensor_count``,
    ``kv_count``, ``alignment``, ``data_offset``, ``architecture``, ``has_rope``,
    ``context_length``, ``n_ctx_orig`` (L: ``{arch}.rope.scaling.original_context_length``
    when non-zero, else ``{arch}.context_length``; None when neither), ``n_ctx_orig_key``,
    ``freq_base``, ``rope_dims`` and ``rope_dims_source``, ``stock_scaling_type`` and
    ``stock_scaling_factor`` (stock llama.cpp's keys, None when absent),
    ``ggufrope_keys`` (full key name -> value, the keys present), ``method`` (None when the
    file has no ggufrope keys), ``factor`` (None: auto, the key absent or 0), ``exponent``
    (b; for ntk-mixed without the key the library's default 0.625, with ``exponent_default``
    True), ``dynamic`` (bool: the library runs dynamic k, from ``{arch}.rope.ntk.dynamic`` or,
    absent, the library's default; see :func:`ggufrope.methods.dynamic_effective`),
    ``dynamic_ratio`` (its ratio r, the default 2 when the key is absent; None when static),
    ``logn`` (bool), ``reserved`` (length of the reserved array, or None) and
    ``description`` (the active method in words, see :func:`describe_method`; it says when
    the method replaces a stock scaling of the file). ``has_rope``: the file has rope keys.

    Raises :class:`GGUFRopeError` for unreadable or invalid files, keys of the wrong type,
    and invalid ggufrope values (checked by :func:`ggufrope.methods.validate_stored`: a method
    not in ``FILE_METHODS``, k < 1 other than 0, b outside (0, 1], dynamic k with method none
    or with a factor other than 0, a ratio r <= 1).
    """
    return _rope_meta(read_header(path))


def _rope_values(method: str, factor: float | None, exponent: float | None, logn: bool,
                 dynamic: bool | None = None, dynamic_ratio: float | None = None
                 ) -> tuple[str, float | None, float | None, bool, bool | None, float | None]:
    """The validated values ``set`` writes (the registry's :func:`ggufrope.methods.validate`,
    stored methods only, rounded to float32): method, k, b (0.625 by default for ntk-mixed),
    log-n, dynamic (None: not written) and its ratio r (None: not written)."""
    try:
        p = M.validate(method, factor, exponent, dynamic=dynamic, dynamic_ratio=dynamic_ratio, stored=True,
                       float32=True)
    except ValueError as e:
        raise GGUFRopeError(str(e)) from None
    return p.method, p.factor, p.exponent, bool(logn), p.dynamic, p.dynamic_ratio


# --------------------------------------------------------------------------- writing


def _pack_string(endian: str, s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack(endian + "Q", len(b)) + b


def _infer_type(value: Any) -> GGUFValueType:
    if isinstance(value, bool):
        return GGUFValueType.BOOL
    if isinstance(value, str):
        return GGUFValueType.STRING
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    if isinstance(value, int):
        return GGUFValueType.UINT32 if 0 <= value < 1 << 32 else GGUFValueType.INT64
    raise GGUFRopeError(f"cannot store a value of type {type(value).__name__} (give (GGUFValueType, value))")


def _pack_kv(endian: str, key: str, vtype: GGUFValueType, value: Any) -> bytes:
    """One key/value record packed with gguf-py's type codes (scalars and strings)."""
    vtype = GGUFValueType(vtype)
    head = _pack_string(endian, key) + struct.pack(endian + "I", vtype)
    if vtype == GGUFValueType.STRING:
        if not isinstance(value, str):
            raise GGUFRopeError(f"value of {key!r} must be a string")
        return head + _pack_string(endian, value)
    if vtype == GGUFValueType.ARRAY:
        raise GGUFRopeError(f"set_keys cannot write arrays ({key!r})")
    fmt = _SCALAR_FORMATS[vtype]
    if vtype == GGUFValueType.FLOAT32:
        value = _f32(value)
    try:
        return head + struct.pack(endian + fmt, value)
    except (struct.error, TypeError) as e:
        raise GGUFRopeError(f"value {value!r} does not fit {vtype.name} for {key!r}: {e}") from None


def _reserved_overhead(endian: str) -> int:
    return len(_pack_string(endian, KEY_RESERVED)) + 4 + 4 + 8


def _pack_reserved(endian: str, n: int) -> bytes:
    return (
        _pack_string(endian, KEY_RESERVED)
        + struct.pack(endian + "IIQ", GGUFValueType.ARRAY, GGUFValueType.UINT8, n)
        + bytes(n)
    )


# A header segment: bytes to write, or (start, end) range to copy from the source.
_Segment = "bytes | tuple[int, int]"


def _seg_len(seg: Any) -> int:
    return len(seg) if isinstance(seg, (bytes, bytearray)) else seg[1] - seg[0]


@dataclass
class _Plan:
    segments: list  # header segments, in order
    header_len: int  # == data offset of the new file
    reserved: int | None


def _plan(h: Header, set_: Mapping[str, tuple[GGUFValueType, Any]], remove: Iterable[str], *, reserve: bool, keep_offset: bool,
          extra_infos: bytes = b"", n_new: int = 0) -> _Plan:
    """The segments of the new header.

    ``extra_infos``: the packed tensor-info records of ``n_new`` appended tensors
    (:func:`_tensor_plan`), written after the source's records; the tensor count includes them.

    With ``reserve`` (``set``): the fixed header, the keys set (in ``set_``'s order), the
    reserved key, then every other record of the source in its order, then the tensor
    infos; the reserved array's length makes the header end where the data section starts.
    The keys set and the room sit at the front, in the first page, next to the key count
    at offset 16: an in-place re-set changes bytes of that page only (see
    :func:`_rewrite_header_in_place`). Without ``reserve`` (``reset``): records keep their
    places (a key set replaces its record, new keys are appended), padded to the alignment.
    """
    e = h.endian
    drop = builtins.set(remove) | {KEY_RESERVED}
    ti = (h.tensor_info_start, h.tensor_info_end)
    if reserve:
        front = [_pack_kv(e, name, vt, val) for name, (vt, val) in set_.items()]
        rest = [(kv.start, kv.end) for kv in h.kvs if kv.key not in drop and kv.key not in set_]
        fixed = struct.pack("<I", GGUF_MAGIC) + struct.pack(e + "IQQ", h.version, h.tensor_count + n_new, len(front) + 1 + len(rest))
        base = len(fixed) + sum(map(len, front)) + sum(_seg_len(r) for r in rest) + _seg_len(ti) + len(extra_infos)
        over = _reserved_overhead(e)
        if keep_offset and base + over <= h.data_offset:
            end = h.data_offset
        else:
            mod = max(PAGE, h.alignment)
            want = base + over + MIN_ROOM
            end = want + (h.data_offset - want) % mod
        n = end - base - over
        return _Plan([fixed, *front, _pack_reserved(e, n), *rest, ti, *([extra_infos] if extra_infos else [])], end, n)
    records: list[Any] = []
    done: set[str] = builtins.set()
    for kv in h.kvs:
        if kv.key in drop:
            continue
        if kv.key in set_:
            vt, val = set_[kv.key]
            records.append(_pack_kv(e, kv.key, vt, val))
            done.add(kv.key)
        else:
            records.append((kv.start, kv.end))
    records += [_pack_kv(e, name, vt, val) for name, (vt, val) in set_.items() if name not in done]
    fixed = struct.pack("<I", GGUF_MAGIC) + struct.pack(e + "IQQ", h.version, h.tensor_count + n_new, len(records))
    base = len(fixed) + sum(_seg_len(r) for r in records) + _seg_len(ti) + len(extra_infos)
    end = _align(base, h.alignment)
    return _Plan([fixed, *records, ti, *([extra_infos] if extra_infos else []), bytes(end - base)], end, None)


def _tensor_plan(h: Header, writes: Iterable[TensorWrite]
                 ) -> tuple[list[tuple[TensorWrite, int]], list[tuple[TensorWrite, int]], bytes, list[TensorInfo], int]:
    """Where the tensors of ``writes`` go: ``(appended, replaced, infos, tensors, data_len)``.

    ``appended``/``replaced``: (tensor, offset relative to the data section); appended tensors
    start at the end of the source's data section (``file_size - data_offset``) rounded up to
    the alignment, one after the other, each aligned; ``infos`` their packed tensor-info records
    (the file's byte order); ``tensors`` the tensor infos the new file must read back with;
    ``data_len`` the length of its data section (the source's when nothing is appended, else up
    to the aligned end of the last appended tensor). Each write is checked: a known ggml type,
    1..4 dimensions, data of exactly the tensor's size, and for a replacement the source
    tensor's shape and type."""
    e = h.endian
    by_name = {t.name: t for t in h.tensors}
    appended: list[tuple[TensorWrite, int]] = []
    replaced: list[tuple[TensorWrite, int]] = []
    infos = bytearray()
    tensors = list(h.tensors)
    data_len = max(0, h.file_size - h.data_offset)
    end = _align(data_len, h.alignment)
    seen: set[str] = builtins.set()
    for w in writes:
        if not isinstance(w.name, str) or not w.name or w.name in seen:
            raise GGUFRopeError(f"internal error: invalid or repeated tensor name {w.name!r}")
        seen.add(w.name)
        shape = tuple(int(d) for d in w.shape)
        if not 1 <= len(shape) <= GGML_MAX_DIMS or any(d < 1 for d in shape):
            raise GGUFRopeError(f"cannot write tensor {w.name!r}: shape {shape}")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(w.ggml_type)]
        except (ValueError, KeyError):
            raise GGUFRopeError(f"cannot write tensor {w.name!r}: unknown ggml type {w.ggml_type}") from None
        if shape[0] % block:
            raise GGUFRopeError(f"cannot write tensor {w.name!r}: ne[0] = {shape[0]} is not a multiple of {block}")
        nbytes = math.prod(shape) // block * type_size
        if len(w.data) != nbytes:
            raise GGUFRopeError(f"internal error: tensor {w.name!r} needs {nbytes} bytes of data, got {len(w.data)}")
        old = by_name.get(w.name)
        if old is not None:
            if old.shape != shape or old.ggml_type != int(w.ggml_type):
                raise GGUFRopeError(f"{_show(h.path)}: tensor {w.name!r} has shape {old.shape} and ggml type "
                                    f"{old.ggml_type}; its new data must have the same (got {shape}, {int(w.ggml_type)})")
            replaced.append((w, old.offset))
            continue
        appended.append((w, end))
        infos += _pack_string(e, w.name) + struct.pack(e + "I", len(shape)) + struct.pack(e + f"{len(shape)}Q", *shape)
        infos += struct.pack(e + "IQ", int(w.ggml_type), end)
        tensors.append(TensorInfo(w.name, shape, int(w.ggml_type), end, nbytes))
        end = _align(end + nbytes, h.alignment)
    return appended, replaced, bytes(infos), tensors, (end if appended else data_len)


_CFR_FALLBACK = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF, errno.EPERM}
#: switches for tests: which copy mechanisms may be used
_USE_COPY_FILE_RANGE = hasattr(os, "copy_file_range")
_USE_SENDFILE = hasattr(os, "sendfile")


def _copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, count: int) -> None:
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


def _copy_data(src_fd: int, dst_fd: int, src_off: int, dst_off: int, count: int, block: int = PAGE) -> None:
    """Copy the data section so that copy-on-write filesystems can share its extents.

    A clone (``copy_file_range`` on btrfs and XFS, which the kernel turns into a
    ``remap_file_range``) needs block-aligned start offsets on both sides; given unaligned
    ones, the kernel silently falls back to copying every byte. The data section rarely
    starts on a block boundary, but the placement rule (see :func:`_plan`) keeps
    ``dst_off`` congruent to ``src_off`` modulo ``block``: so the bytes up to the source's
    next block boundary are copied first (less than a block), and the rest starts aligned
    on both sides and can be cloned whole (its end is the end of the file)."""
    if count > _CHUNK and hasattr(os, "posix_fadvise"):
        try:  # as cp does: a larger readahead window for a cold source
            os.posix_fadvise(src_fd, src_off, count, os.POSIX_FADV_SEQUENTIAL)
        except OSError:
            pass
    head = min(count, -src_off % block)
    if head and (dst_off - src_off) % block == 0:
        _copy_range(src_fd, dst_fd, src_off, dst_off, head)
        src_off, dst_off, count = src_off + head, dst_off + head, count - head
    _copy_range(src_fd, dst_fd, src_off, dst_off, count)


def _write_segments(src_fd: int, dst_fd: int, segments: list, at: int = 0) -> int:
    pos = at
    for seg in segments:
        if isinstance(seg, (bytes, bytearray)):
            view = memoryview(seg)
            done = 0
            while done < len(seg):
                done += os.pwrite(dst_fd, view[done:], pos + done)
            pos += len(seg)
        else:
            _copy_range(src_fd, dst_fd, seg[0], pos, seg[1] - seg[0])
            pos += seg[1] - seg[0]
    return pos - at


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


class _AtomicFile:
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
                    raise _os_error(e, "cannot create a file in", self.dir) from None
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
                    raise _os_error(e, "cannot create a file in", self.dir) from None
                # a sweep by another process may have locked and removed it before we
                # could lock it: then take another name
                if _lock(fd) is False or not _names(name, fd):
                    os.close(fd)
                    continue
                self.fd, self.name = fd, name
                break
            else:  # pragma: no cover
                raise GGUFRopeError(f"cannot create a temporary file in {_show(self.dir)}")

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
                raise GGUFRopeError(f"cannot create a temporary file in {_show(self.dir)}")
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


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _umask() -> int:
    m = os.umask(0o022)
    os.umask(m)
    return m


def _rewrite(
    src: str | os.PathLike,
    dst: str | os.PathLike | None,
    build: Callable[[Header], tuple[Mapping[str, tuple[GGUFValueType, Any]], Iterable[str]]],
    *,
    reserve: bool,
) -> WriteResult:
    """Rewrite ``src`` into ``dst`` (None or the same file: in place) with the keys that
    ``build(header)`` returns as ``(set, remove)``, or ``(set, remove, tensors)`` where
    ``tensors`` lists :class:`TensorWrite`: tensors appended (a new record after the source's
    tensor infos, data after the source's data section) or whose data is replaced in the copy.
    The source's data section is still copied as one block (:func:`_copy_data`); the new data is
    then written over it or after it. A rewrite with tensors never takes the header-only path."""
    src_p, st = _stat_source(src)
    in_place = dst is None or _same_file(src_p, os.fspath(dst))
    if in_place:
        dst_p = os.path.realpath(src_p)  # replace the file, not a symlink to it
        if not os.access(src_p, os.W_OK):
            raise GGUFRopeError(f"no permission to write {_show(src_p)}")
    else:
        dst_p = os.fsdecode(os.fspath(dst))
        if os.path.isdir(dst_p):
            raise GGUFRopeError(f"output {_show(dst_p)} is a directory")
        d = os.path.dirname(os.path.abspath(dst_p))
        if not os.path.isdir(d):
            raise GGUFRopeError(f"output directory {_show(d)} does not exist")
    try:
        src_fd = os.open(src_p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _os_error(e, "cannot open", src_p) from None
    try:
        with open(src_fd, "rb", buffering=0, closefd=False) as f:
            st = os.fstat(src_fd)
            h = _parse(f, src_p, st)
        built = build(h)
        set_, remove = built[0], list(built[1])
        writes = list(built[2]) if len(built) > 2 else []
        appended, replaced, infos, tensors, data_len = _tensor_plan(h, writes)
        plan = _plan(h, set_, remove, reserve=reserve, keep_offset=in_place, extra_infos=infos, n_new=len(appended))
        gone = builtins.set(remove) | {KEY_RESERVED}
        removed = tuple(kv.key for kv in h.kvs if kv.key in gone and kv.key not in set_ and not (reserve and kv.key == KEY_RESERVED))
        if in_place and not writes and plan.header_len == h.data_offset:
            sweep_stale_temp_files(dst_p)
            fast = _rewrite_header_in_place(src_p, src_fd, h, plan)
            if fast is not None:
                return replace(fast, removed=removed)
        mode = (st.st_mode & 0o7777) if in_place else (st.st_mode & 0o777 & ~_umask())
        out = _AtomicFile(dst_p, mode)
        try:
            if in_place:  # the replacement keeps the file's owner and mode where allowed
                for fn, args in ((os.fchown, (st.st_uid, st.st_gid)), (os.fchmod, (st.st_mode & 0o7777,))):
                    try:
                        fn(out.fd, *args)
                    except OSError:
                        pass
            n = _write_segments(src_fd, out.fd, plan.segments)
            assert n == plan.header_len
            data = h.file_size - h.data_offset if h.data_offset <= h.file_size else 0
            _copy_data(src_fd, out.fd, h.data_offset, plan.header_len, data, max(PAGE, h.alignment))
            for w, off in replaced + appended:  # over the copy, or after it (the gap reads as zeros)
                _write_segments(src_fd, out.fd, [w.data], plan.header_len + off)
            os.ftruncate(out.fd, plan.header_len + data_len)
            # check what was written before it replaces anything
            with open(out.fd, "rb", buffering=0, closefd=False) as g:
                g.seek(0)
                h2 = _parse(g, dst_p, os.fstat(out.fd))
            if h2.data_offset != plan.header_len or h2.tensors != tensors:
                raise GGUFRopeError(f"internal error: the header written for {_show(dst_p)} does not read back")
            out.commit()
        except BaseException as e:
            out.abort()
            if isinstance(e, OSError):
                raise _os_error(e, "cannot write", dst_p) from None
            raise
        return WriteResult(dst_p, False, plan.header_len, h.data_offset, plan.header_len, data, plan.reserved, removed,
                           tensors_appended=tuple(w.name for w, _ in appended),
                           tensors_replaced=tuple(w.name for w, _ in replaced))
    except OSError as e:
        raise _os_error(e, "cannot read", src_p) from None
    finally:
        os.close(src_fd)


def _diff_span(a: bytes, b: bytes) -> tuple[int, int] | None:
    """``(first, last + 1)`` of the bytes where ``a`` and ``b`` (same length) differ, or
    None when equal; blocks are compared as slices, bytes one by one only inside the first
    and last differing block."""
    n = len(a)
    if a == b:
        return None
    step = 4096
    lo = 0
    while a[lo : lo + step] == b[lo : lo + step]:
        lo += step
    while a[lo] == b[lo]:
        lo += 1
    hi = n
    while a[max(lo, hi - step) : hi] == b[max(lo, hi - step) : hi]:
        hi = max(lo, hi - step)
    while a[hi - 1] == b[hi - 1]:
        hi -= 1
    return lo, hi


def _rewrite_header_in_place(path: str, src_fd: int, h: Header, plan: _Plan) -> WriteResult | None:
    """The fast path: the new header has exactly the old length; write the bytes that
    differ (one span) with one pwrite, then fsync. Tensor data is never touched.

    Only when that span lies within one 4096-byte page (returns None otherwise): the
    kernel copies a write into the page cache page by page and a fatal signal can stop it
    between pages, so only a one-page write is whole-or-nothing under SIGKILL (and a
    single block for the disk). With the layout of :func:`_plan` a re-set of the ggufrope
    keys changes bytes of the first page only, the key count included."""
    # The span to rewrite: everything but the leading segments copied from their own place.
    pos = 0
    lo = None
    hi = 0
    for seg in plan.segments:
        n = _seg_len(seg)
        unchanged = not isinstance(seg, (bytes, bytearray)) and seg[0] == pos
        if isinstance(seg, (bytes, bytearray)) and os.pread(src_fd, n, pos) == seg:
            unchanged = True
        if not unchanged:
            lo = pos if lo is None else lo
            hi = pos + n
        pos += n
    assert pos == h.data_offset
    if lo is None:
        return WriteResult(path, True, h.data_offset, h.data_offset, 0, 0, plan.reserved)
    buf = bytearray()
    pos = 0
    for seg in plan.segments:
        n = _seg_len(seg)
        if pos + n > lo and pos < hi:
            b = seg if isinstance(seg, (bytes, bytearray)) else os.pread(src_fd, n, seg[0])
            if len(b) != n:
                raise GGUFRopeError(f"{_show(path)} changed while ggufrope was reading it")
            buf += b[max(0, lo - pos) : min(n, hi - pos)]
        pos += n
    # trim bytes equal to the old ones at both ends (the reserved zeros mostly are)
    old = os.pread(src_fd, len(buf), lo)
    if len(old) != len(buf):
        raise GGUFRopeError(f"{_show(path)} changed while ggufrope was reading it")
    span = _diff_span(bytes(buf), old)
    if span is None:
        return WriteResult(path, True, h.data_offset, h.data_offset, 0, 0, plan.reserved)
    a, z = span
    buf, lo = buf[a:z], lo + a
    if lo // PAGE != (lo + len(buf) - 1) // PAGE:
        return None  # not within one page: the caller writes a new file instead
    try:
        fd = os.open(path, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _os_error(e, "cannot open for writing", path) from None
    try:
        st = os.fstat(fd)
        old = h.stat
        if old is not None and (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns) != (
            old.st_ino,
            old.st_dev,
            old.st_size,
            old.st_mtime_ns,
        ):
            raise GGUFRopeError(f"{_show(path)} changed while ggufrope was reading it")
        if os.pwrite(fd, bytes(buf), lo) != len(buf):
            raise GGUFRopeError(f"short write to {_show(path)}")
        os.fsync(fd)
    except OSError as e:
        raise _os_error(e, "cannot write", path) from None
    finally:
        os.close(fd)
    return WriteResult(path, True, h.data_offset, h.data_offset, len(buf), 0, plan.reserved)


def _normalise_set(set_: Mapping[str, Any] | None) -> dict[str, tuple[GGUFValueType, Any]]:
    out: dict[str, tuple[GGUFValueType, Any]] = {}
    for name, v in (set_ or {}).items():
        if not isinstance(name, str) or not name:
            raise GGUFRopeError(f"invalid key name {name!r}")
        if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], (GGUFValueType, int)) and not isinstance(v[0], bool):
            try:
                vt = GGUFValueType(v[0])
            except ValueError:
                raise GGUFRopeError(f"unknown value type {v[0]!r} for {name!r}") from None
            out[name] = (vt, v[1])
        else:
            out[name] = (_infer_type(v), v)
    return out


_PROTECTED = ("general.alignment", "general.architecture", KEY_RESERVED)


def set_keys(
    src: str | os.PathLike,
    dst: str | os.PathLike | None,
    set: Mapping[str, Any] | None = None,  # noqa: A002  (the name the API promises)
    remove: Iterable[str] = (),
    *,
    reserve: bool = True,
) -> WriteResult:
    """Write a copy of ``src`` to ``dst`` with keys set and removed; tensor data untouched.

    ``set`` maps key -> value or ``(GGUFValueType, value)`` (scalars and strings; a bare
    ``str``/``bool``/``float``/``int`` is stored as STRING/BOOL/FLOAT32/UINT32, INT64 when
    outside uint32). ``remove`` lists keys to drop (absent keys are ignored).
    ``general.alignment``, ``general.architecture`` and :data:`KEY_RESERVED` cannot be set or
    removed. With ``reserve`` (default) the keys set come first, then the reserved key, then
    the other records in their order (see the module docstring); without it any reserved
    key is removed, a key set keeps its position and new keys are appended.

    ``dst`` None, or the same file as ``src``: in place — header-only rewrite when the new
    header has the old length and the change lies within one 4096-byte page, else an
    atomic replacement of the whole file.
    """
    s = _normalise_set(set)
    rm = list(remove)
    for name in list(s) + rm:
        if name in _PROTECTED:
            raise GGUFRopeError(f"key {name!r} cannot be set or removed")
    return _rewrite(src, dst, lambda h: (s, rm), reserve=reserve)


def write_rope_metadata(
    src: str | os.PathLike,
    dst: str | os.PathLike | None,
    *,
    method: str,
    factor: float | None = None,
    exponent: float | None = None,
    logn: bool = False,
    dynamic: bool | None = None,
    dynamic_ratio: float | None = None,
) -> WriteResult:
    """Write the ggufrope keys of ``keys.py`` for the file's architecture (``ggufrope set``).

    ``method``: a name or alias from the method registry; only ``FILE_METHODS`` (``none``,
    ``ntk``, ``ntk-fixed``, ``ntk-mixed``) can be stored — ``linear``/``yarn`` are stock
    llama.cpp's own. ``factor`` k >= 1 is written only when given (absent: dynamic k, the
    library's default, unless ``dynamic`` is False, then the library takes
    k = max(1, n_ctx_seq/L)); ``exponent`` b in (0, 1] only for ntk-mixed (default
    0.625); ``logn`` always; ``dynamic`` (``{arch}.rope.ntk.dynamic``, BOOL) only when given,
    True or False (None: the key is not written and the library's default applies, see
    :func:`ggufrope.methods.dynamic_effective`), and ``dynamic_ratio`` r > 1 only when given
    (with ``dynamic`` True; absent: 2). Dynamic k with method none or with a factor k is
    refused (the registry's :func:`ggufrope.methods.validate`, as the library refuses to load
    it). Every ggufrope key the call does not write is removed, so the
    file holds exactly the new state. Refuses architectures the patched library does not serve
    (asked through ``llama_ggufrope_arch_supported``; also refused when no patched library is
    installed). A stock ``{arch}.rope.scaling.type`` (yarn, linear) of the file is kept; the
    NTK family replaces it at load time, method none keeps it (a note in the result says so).
    Returns a :class:`WriteResult`; ``dst`` as in :func:`set_keys`.
    """
    m, k, b, ln, dyn, r = _rope_values(method, factor, exponent, logn, dynamic, dynamic_ratio)

    def build(h: Header) -> tuple[dict[str, tuple[GGUFValueType, Any]], list[str]]:
        arch = _architecture(h)
        _check_types(h, arch, ggufrope_keys=False)  # ggufrope keys are replaced anyway
        _require_served(h, arch)
        values: dict[str, tuple[GGUFValueType, Any]] = {K.key(K.KEY_METHOD, arch): (GGUFValueType.STRING, m)}
        if k is not None:
            values[K.key(K.KEY_FACTOR, arch)] = (GGUFValueType.FLOAT32, k)
        if b is not None:
            values[K.key(K.KEY_EXPONENT, arch)] = (GGUFValueType.FLOAT32, b)
        if dyn is not None:
            values[K.key(K.KEY_DYNAMIC, arch)] = (GGUFValueType.BOOL, dyn)
        if r is not None:
            values[K.key(K.KEY_DYNAMIC_RATIO, arch)] = (GGUFValueType.FLOAT32, r)
        values[K.key(K.KEY_LOGN, arch)] = (GGUFValueType.BOOL, ln)
        L, L_src = _n_ctx_orig(h, arch)
        stype = h.value(K.key(K.KEY_SCALING_TYPE, arch))
        stype = stype if isinstance(stype, str) and stype not in ("", "none") else None
        eff = M.dynamic_effective(m, k, dyn)
        info["description"] = describe_method({
            "method": m, "factor": k, "exponent": b, "logn": ln, "n_ctx_orig": L, "stock_scaling_type": stype,
            "dynamic": eff, "dynamic_ratio": (r if r is not None else M.DEFAULT_DYNAMIC_RATIO) if eff else None,
            "stock_scaling_factor": h.value(K.key(K.KEY_SCALING_FACTOR, arch)),
        })
        notes = []
        if stype is not None:
            what = f"the file also has stock llama.cpp rope scaling {K.key(K.KEY_SCALING_TYPE, arch)} = {stype!r}; "
            if METHODS[m].ntk_family:
                notes.append(what + f"ggufrope's method {m} replaces it when the model loads (not stacked on it; "
                             f"L = {L} from {L_src})")
            else:
                notes.append(what + "method none keeps it" + (" (log-n applies beside it)" if ln else ""))
        if L is None:
            notes.append(f"the file has no {K.key(K.KEY_CONTEXT_LENGTH, arch)}: L is unknown")
        info["notes"] = tuple(notes)
        return values, K.ggufrope_keys(arch)

    info: dict[str, Any] = {}
    r = _rewrite(src, dst, build, reserve=True)
    return replace(r, description=info.get("description"), notes=info.get("notes", ()))


def reset_rope_metadata(src: str | os.PathLike, dst: str | os.PathLike | None) -> WriteResult:
    """Remove every ggufrope key, the reserved key included (``ggufrope reset``).

    A file written by ``set`` from a file without ggufrope keys comes back byte-identical.
    """
    return _rewrite(src, dst, lambda h: ({}, K.ggufrope_keys(_architecture(h))), reserve=False)
