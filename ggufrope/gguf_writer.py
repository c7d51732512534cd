"""The GGUF format, writing: a GGUF file rewritten with keys set or removed and tensors appended or replaced, at disk speed, as a new file or with a header-only write in place.

The source's header is parsed by the streaming reader of :mod:`ggufrope.gguf_reader`
(offsets only, never gguf-py's ``GGUFReader``), and a new file is written (atomically:
:class:`ggufrope.atomic_write.AtomicFile`) as

* the new header: untouched key/value records and the tensor-info records copied
  byte-exactly from the source, new records packed with gguf-py's constants, padded to the
  alignment;
* the data section copied as one block with ``os.copy_file_range`` (fallback
  ``os.sendfile``, then a buffered copy; :func:`ggufrope.atomic_write.copy_data`). Tensor
  offsets are relative to the data section, so the tensor-info records are reused unchanged.

**Tensors appended or replaced** (the stock export, :mod:`ggufrope.stock`): a rewrite may
also append a tensor (a new tensor-info record after the source's, its data after the source's
data section, aligned to ``general.alignment``) or replace one tensor's data (same shape and
type, so every offset stays). The data section is still copied as one block; the few new bytes
are written after it or over it (:class:`TensorWrite`).

**The layout, and the reserved key.** A file written by
:func:`ggufrope.rope_metadata.write_rope_metadata` (``ggufrope set``) has its ggufrope keys
first, right after the 24-byte fixed header, then one extra key, :data:`KEY_RESERVED`
(``ggufrope.reserved``, an array of zero ``UINT8``), then the source's other records in
their order. The reserved array's length is chosen so that the header ends exactly where
the data section starts and that the data section starts at the same offset modulo 4096
(or modulo ``general.alignment`` when larger) as in the source: copy-on-write filesystems
(btrfs, XFS) can then share the data extents (see :func:`ggufrope.atomic_write.copy_data`).
It also keeps at least :data:`MIN_ROOM` bytes of room, so that a
later ``set --in-place`` (new b, new k, log-n toggled, another method) finds a header of
exactly the old length; as the key count (offset 16), the ggufrope keys and the start of
the room all lie in the first 4096 bytes, it rewrites only bytes of that page, with a
single ``pwrite`` (the header-only fast path) and no data copy. Stock llama.cpp ignores
the key (unknown keys are only listed; arrays are not even put in its metadata map).
:func:`ggufrope.rope_metadata.reset_rope_metadata` removes it with the other ggufrope keys
and puts nothing in their place, so ``set`` followed by ``reset`` gives back the original
file byte for byte (provided the original had no ggufrope keys).

**In place.** The source is never modified, except by
the in-place header-only fast path (:func:`_rewrite_header_in_place`), which rewrites only
bytes inside the header (never tensor data) with one ``pwrite`` within one 4096-byte page,
and fsyncs: the kernel checks for a fatal signal between the pages of a write, not inside
one, so SIGKILL leaves the old header or the new one. A change that does not fit one page
is written as a new file.
"""

from __future__ import annotations

import builtins
import math
import os
import struct
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Mapping

from .gguf_constants import (
    GGML_QUANT_SIZES,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)

from .atomic_write import PAGE, AtomicFile, copy_data, copy_range, same_file, sweep_stale_temp_files, umask
from .errors import GGUFRopeError, os_error, show
from .gguf_reader import GGML_MAX_DIMS, SCALAR_FORMATS, Header, TensorInfo, align, parse, stat_source
from .methods import to_float32 as _f32  # the float32 value nearest to x, inf on overflow

__all__ = [
    "KEY_RESERVED",
    "MIN_ROOM",
    "TensorWrite",
    "WriteResult",
    "rewrite",
    "set_keys",
]


#: The padding key (see the module docstring): ARRAY of UINT8 zeros, right after the keys
#: that ``set`` writes, which come first.
KEY_RESERVED = "ggufrope.reserved"
#: Minimum room (bytes of the reserved array) left by a full rewrite, so that any later
#: ``set`` of the ggufrope keys fits into the same header length (all six need 212 bytes plus
#: six times the length of the architecture name: 272 for ``llama``).
MIN_ROOM = 512


@dataclass(frozen=True)
class TensorWrite:
    """A tensor that a rewrite (:func:`rewrite`, through its ``build`` callback) appends or
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
    fmt = SCALAR_FORMATS[vtype]
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
    end = align(base, h.alignment)
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
    end = align(data_len, h.alignment)
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
                raise GGUFRopeError(f"{show(h.path)}: tensor {w.name!r} has shape {old.shape} and ggml type "
                                    f"{old.ggml_type}; its new data must have the same (got {shape}, {int(w.ggml_type)})")
            replaced.append((w, old.offset))
            continue
        appended.append((w, end))
        infos += _pack_string(e, w.name) + struct.pack(e + "I", len(shape)) + struct.pack(e + f"{len(shape)}Q", *shape)
        infos += struct.pack(e + "IQ", int(w.ggml_type), end)
        tensors.append(TensorInfo(w.name, shape, int(w.ggml_type), end, nbytes))
        end = align(end + nbytes, h.alignment)
    return appended, replaced, bytes(infos), tensors, (end if appended else data_len)


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
            copy_range(src_fd, dst_fd, seg[0], pos, seg[1] - seg[0])
            pos += seg[1] - seg[0]
    return pos - at


def rewrite(
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
    The source's data section is still copied as one block
    (:func:`ggufrope.atomic_write.copy_data`); the new data is then written over it or after
    it. A rewrite with tensors never takes the header-only path."""
    src_p, st = stat_source(src)
    in_place = dst is None or same_file(src_p, os.fspath(dst))
    if in_place:
        dst_p = os.path.realpath(src_p)  # replace the file, not a symlink to it
        if not os.access(src_p, os.W_OK):
            raise GGUFRopeError(f"no permission to write {show(src_p)}")
    else:
        dst_p = os.fsdecode(os.fspath(dst))
        if os.path.isdir(dst_p):
            raise GGUFRopeError(f"output {show(dst_p)} is a directory")
        d = os.path.dirname(os.path.abspath(dst_p))
        if not os.path.isdir(d):
            raise GGUFRopeError(f"output directory {show(d)} does not exist")
    try:
        src_fd = os.open(src_p, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise os_error(e, "cannot open", src_p) from None
    try:
        with open(src_fd, "rb", buffering=0, closefd=False) as f:
            st = os.fstat(src_fd)
            h = parse(f, src_p, st)
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
        mode = (st.st_mode & 0o7777) if in_place else (st.st_mode & 0o777 & ~umask())
        out = AtomicFile(dst_p, mode)
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
            copy_data(src_fd, out.fd, h.data_offset, plan.header_len, data, max(PAGE, h.alignment))
            for w, off in replaced + appended:  # over the copy, or after it (the gap reads as zeros)
                _write_segments(src_fd, out.fd, [w.data], plan.header_len + off)
            os.ftruncate(out.fd, plan.header_len + data_len)
            # check what was written before it replaces anything
            with open(out.fd, "rb", buffering=0, closefd=False) as g:
                g.seek(0)
                h2 = parse(g, dst_p, os.fstat(out.fd))
            if h2.data_offset != plan.header_len or h2.tensors != tensors:
                raise GGUFRopeError(f"internal error: the header written for {show(dst_p)} does not read back")
            out.commit()
        except BaseException as e:
            out.abort()
            if isinstance(e, OSError):
                raise os_error(e, "cannot write", dst_p) from None
            raise
        return WriteResult(dst_p, False, plan.header_len, h.data_offset, plan.header_len, data, plan.reserved, removed,
                           tensors_appended=tuple(w.name for w, _ in appended),
                           tensors_replaced=tuple(w.name for w, _ in replaced))
    except OSError as e:
        raise os_error(e, "cannot read", src_p) from None
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
                raise GGUFRopeError(f"{show(path)} changed while ggufrope was reading it")
            buf += b[max(0, lo - pos) : min(n, hi - pos)]
        pos += n
    # trim bytes equal to the old ones at both ends (the reserved zeros mostly are)
    old = os.pread(src_fd, len(buf), lo)
    if len(old) != len(buf):
        raise GGUFRopeError(f"{show(path)} changed while ggufrope was reading it")
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
        raise os_error(e, "cannot open for writing", path) from None
    try:
        st = os.fstat(fd)
        old = h.stat
        if old is not None and (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns) != (
            old.st_ino,
            old.st_dev,
            old.st_size,
            old.st_mtime_ns,
        ):
            raise GGUFRopeError(f"{show(path)} changed while ggufrope was reading it")
        if os.pwrite(fd, bytes(buf), lo) != len(buf):
            raise GGUFRopeError(f"short write to {show(path)}")
        os.fsync(fd)
    except OSError as e:
        raise os_error(e, "cannot write", path) from None
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
    return rewrite(src, dst, lambda h: (s, rm), reserve=reserve)
