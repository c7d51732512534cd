"""The GGUF format, reading: a streaming parser of GGUF headers that keeps file offsets, not bytes.

GGUF files are 5-100 GB; changing a few keys must cost neither a tensor-by-tensor
rewrite nor gigabytes of memory. ggufrope therefore never builds gguf-py's
``GGUFReader`` over a file it rewrites. It parses the header with a streaming reader
(:func:`read_header`: magic, version 2 or 3 in either byte order, counts, key/value pairs,
tensor infos, ``general.alignment``), keeping only file offsets for the raw bytes (the
byte range of each :class:`KeyValue`, the tensor-info records' range in :class:`Header`),
from which the writer (:mod:`ggufrope.gguf_writer`) copies the untouched records
byte-exactly. This module also holds the format's tables (value types, their struct
formats) and :func:`f32_repr`, the shortest decimal of a float32.

**Errors.** Everything a hostile or broken file can cause is a
:class:`~ggufrope.errors.GGUFRopeError` with a one-line message; counts and lengths are
checked against the bytes left in the file before anything is read or allocated.
"""

from __future__ import annotations

import builtins
import math
import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from .gguf_constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

from .errors import GGUFRopeError, os_error, show
from . import methods as M

__all__ = [
    "GGML_MAX_DIMS",
    "SCALAR_FORMATS",
    "SUPPORTED_VERSIONS",
    "ArrayValue",
    "Header",
    "KeyValue",
    "TensorInfo",
    "align",
    "f32_repr",
    "parse",
    "read_header",
    "stat_source",
]


#: GGUF versions read and written (v1 had 32-bit counts and is not supported).
SUPPORTED_VERSIONS = (2, 3)

GGML_MAX_DIMS = 4
_STRING_KEEP_LIMIT = 1 << 20  # decoded string values longer than this are not kept
_ARRAY_KEEP_LIMIT = 1024  # numeric arrays up to this length are kept as Python lists
_CHUNK = 1 << 20  # the read buffer's refill size

SCALAR_FORMATS: dict[GGUFValueType, str] = {
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


# --------------------------------------------------------------------------- helpers


def align(x: int, a: int) -> int:
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
        return GGUFRopeError(f"{show(self.path)}: {msg}")

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


def parse(f: BinaryIO, path: str, st: os.stat_result) -> Header:
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

    data_offset = align(ti_end, alignment)
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


def _value_type(s: _Stream, what: str, owner: str) -> GGUFValueType:
    """A uint32 GGUF value type; an unknown one is an error naming ``owner`` and ``what``."""
    raw = s.unpack("I", f"{what} of {owner.split(' ', 1)[1]}")
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise s.error(f"{owner} has unknown {what} {raw}") from None


def _parse_value(s: _Stream, key: str) -> tuple[Any, GGUFValueType]:
    vtype = _value_type(s, "value type", f"key {key!r}")
    if vtype == GGUFValueType.STRING:
        return s.string(f"value of {key!r}"), vtype
    if vtype != GGUFValueType.ARRAY:
        return s.unpack(SCALAR_FORMATS[vtype], f"value of {key!r}"), vtype
    etype = _value_type(s, "element type", f"array {key!r}")
    if etype == GGUFValueType.ARRAY:
        raise s.error(f"array {key!r} holds arrays (nested arrays are not supported by llama.cpp)")
    count = s.unpack("Q", f"length of array {key!r}")
    if etype == GGUFValueType.STRING:
        if count * 8 > s.remaining():
            raise s.error(f"truncated GGUF header or corrupt length: array {key!r} has {count} strings, beyond the end of the file")
        s.skip_strings(count, f"array {key!r}")
        return ArrayValue(etype, count), vtype
    st = s.st(SCALAR_FORMATS[etype])
    nbytes = count * st.size
    if nbytes > s.remaining():
        raise s.error(f"truncated GGUF header or corrupt length: array {key!r} has {count} elements, beyond the end of the file")
    if count <= _ARRAY_KEEP_LIMIT:
        raw = s.take(nbytes, f"array {key!r}")
        values = [v for (v,) in st.iter_unpack(raw)]
        return ArrayValue(etype, count, values), vtype
    s.skip(nbytes, f"array {key!r}")
    return ArrayValue(etype, count), vtype


def stat_source(path: Any) -> tuple[str, os.stat_result]:
    p = os.fspath(path)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise GGUFRopeError(f"no such file: {show(p)}") from None
    except OSError as e:
        raise os_error(e, "cannot access", p) from None
    if stat.S_ISDIR(st.st_mode):
        raise GGUFRopeError(f"{show(p)} is a directory, not a GGUF file")
    if not stat.S_ISREG(st.st_mode):
        raise GGUFRopeError(f"{show(p)} is not a regular file")
    return p, st


def read_header(path: str | os.PathLike) -> Header:
    """Parse the header of the GGUF file at ``path`` (streaming; nothing but the header
    is read, and no more than about 1 MiB is held at a time besides small values).

    Raises :class:`GGUFRopeError` for every problem with the path or the file.
    """
    p, _ = stat_source(path)
    try:
        with open(p, "rb", buffering=0) as f:
            return parse(f, p, os.fstat(f.fileno()))
    except GGUFRopeError:
        raise
    except OSError as e:
        raise os_error(e, "cannot read", p) from None
