"""ggufrope.gguf_file: streaming header parser, metadata rewrite, atomicity, validation."""

from __future__ import annotations

import errno
import hashlib
import math
import os
import shutil
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as VT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import write_test_gguf
from ggufrope import gguf_file as G
from ggufrope import keys as K
from ggufrope.errors import GGUFRopeError

ROPE_KEYS = K.ggufrope_keys("llama")


# --------------------------------------------------------------------------- helpers


def data_hash(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return hashlib.sha256(f.read()).hexdigest()


def reader_fields(path: Path) -> dict[str, tuple[int, object]]:
    """key -> (GGUF type, value) as gguf-py's reader sees them (arrays: element count)."""
    r = gguf.GGUFReader(str(path))
    out = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        t = f.types[0]
        out[name] = (t, len(f.data) if t == VT.ARRAY else f.contents())
    return out


def assert_same_tensors(a: Path, b: Path) -> None:
    ra, rb = gguf.GGUFReader(str(a)), gguf.GGUFReader(str(b))
    assert [t.name for t in ra.tensors] == [t.name for t in rb.tensors]
    for ta, tb in zip(ra.tensors, rb.tensors):
        assert ta.tensor_type == tb.tensor_type
        assert ta.shape.tolist() == tb.shape.tolist()
        assert ta.data.tobytes() == tb.data.tobytes(), ta.name


def assert_rewrite_ok(src: Path, dst: Path) -> None:
    """dst has the same tensors, byte for byte, and the same data section as src."""
    hs, hd = G.read_header(src), G.read_header(dst)
    assert hs.tensors == hd.tensors
    assert data_hash(src, hs.data_offset) == data_hash(dst, hd.data_offset)
    assert hd.data_offset % hd.alignment == 0
    assert_same_tensors(src, dst)


def no_temp_files(d: Path) -> bool:
    return not [p for p in os.listdir(d) if "ggufrope-tmp" in p or "ggufrope-probe" in p]


def pstr(s: bytes | str, e: str = "<") -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack(e + "Q", len(b)) + b


def kv(key: bytes | str, vtype: int, payload: bytes) -> bytes:
    return pstr(key) + struct.pack("<I", vtype) + payload


def kv_str(key: str, value: bytes | str) -> bytes:
    return kv(key, VT.STRING, pstr(value))


def kv_u32(key: str, v: int) -> bytes:
    return kv(key, VT.UINT32, struct.pack("<I", v))


def raw_gguf(kvs: list[bytes], *, version: int = 3, n_kv: int | None = None, n_tensors: int = 0, tail: bytes = b"") -> bytes:
    """A hand-packed header (for cases GGUFWriter refuses to write)."""
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, len(kvs) if n_kv is None else n_kv)
    return head + b"".join(kvs) + tail


LLAMA_KVS = [kv_str("general.architecture", "llama"), kv_u32("llama.context_length", 4096)]


def write(tmp_path: Path, data: bytes, name: str = "x.gguf") -> Path:
    p = tmp_path / name
    p.write_bytes(data)
    return p


# --------------------------------------------------------------------------- reading


def test_read_header_matches_gguf_reader(small_gguf: Path) -> None:
    h = G.read_header(small_gguf)
    r = gguf.GGUFReader(str(small_gguf))
    assert h.version == 3 and h.endian == "<"
    assert h.data_offset == r.data_offset
    assert h.alignment == 32
    assert [kv.key for kv in h.kvs] == [k for k in r.fields if not k.startswith("GGUF.")]
    assert [t.name for t in h.tensors] == [t.name for t in r.tensors]
    for t, rt in zip(h.tensors, r.tensors):
        assert t.offset == rt.data_offset - r.data_offset
        assert t.nbytes == rt.n_bytes
        assert t.shape == tuple(int(x) for x in rt.shape)
    assert h.value("general.architecture") == "llama"
    assert h.value("llama.context_length") == 8192
    assert h.value("test.u64") == 2**40 + 3
    arr = h.value("tokenizer.ggml.tokens")
    assert isinstance(arr, G.ArrayValue) and arr.count == 64 and arr.values is None
    assert h.value("test.u8array").values == [1, 2, 3]
    # raw records are byte ranges of the file
    raw = small_gguf.read_bytes()
    for rec in h.kvs:
        assert raw[rec.start : rec.start + 8] == struct.pack("<Q", len(rec.key.encode()))


def test_read_rope_metadata_plain(small_gguf: Path) -> None:
    m = G.read_rope_metadata(small_gguf)
    assert m["architecture"] == "llama"
    assert m["n_ctx_orig"] == 8192 and m["n_ctx_orig_key"] == "llama.context_length"
    assert m["freq_base"] == 100000.0
    assert m["rope_dims"] == 16 and m["rope_dims_source"] == "llama.rope.dimension_count"
    assert m["method"] is None and m["ggufrope_keys"] == {} and m["reserved"] is None
    assert m["stock_scaling_type"] is None
    assert m["description"].startswith("none")


def test_n_ctx_orig_prefers_original_context_length(make_gguf) -> None:
    p = make_gguf(orig_ctx=2048, scaling=("yarn", 4.0), context_length=8192)
    m = G.read_rope_metadata(p)
    assert m["n_ctx_orig"] == 2048
    assert m["n_ctx_orig_key"] == "llama.rope.scaling.original_context_length"
    assert m["stock_scaling_type"] == "yarn" and m["stock_scaling_factor"] == 4.0


def test_rope_dims_inferred_without_dimension_count(make_gguf) -> None:
    p = make_gguf(rope=False)  # llama without rope keys: 64 / 4 heads
    m = G.read_rope_metadata(p)
    assert m["rope_dims"] == 16 and "head_count" in m["rope_dims_source"]
    assert m["freq_base"] is None and m["has_rope"] is False  # has_rope: the file has rope keys


def _with_ggufrope_keys(tmp_path: Path, name: str, **values) -> Path:
    """A llama file whose ggufrope keys are written raw (as another tool might), not by set."""
    parts = [kv_str("general.architecture", "llama"), kv_u32("llama.context_length", 4096)]
    for k, v in values.items():
        key = {"method": K.KEY_METHOD, "factor": K.KEY_FACTOR, "exponent": K.KEY_EXPONENT, "logn": K.KEY_LOGN,
               "dynamic": K.KEY_DYNAMIC}[k]
        key = K.key(key, "llama")
        if k == "method":
            parts.append(kv_str(key, v))
        elif k in ("logn", "dynamic"):
            parts.append(kv(key, VT.BOOL, struct.pack("<?", v)))
        else:
            parts.append(kv(key, VT.FLOAT32, struct.pack("<f", v)))
    data = raw_gguf(parts)
    return write(tmp_path, data + bytes(-len(data) % 32), name)


def test_ntk_mixed_without_exponent_reads_the_default(tmp_path) -> None:
    """The library loads an ntk-mixed file without the exponent key with b = 0.625: read and
    described as such, no TypeError. (No factor and no dynamic key: the library's default,
    dynamic k; with dynamic false, the static automatic k.)"""
    p = _with_ggufrope_keys(tmp_path, "m.gguf", method="ntk-mixed", logn=True)
    m = G.read_rope_metadata(p)
    assert m["method"] == "ntk-mixed" and m["exponent"] == 0.625 and m["exponent_default"] is True
    assert m["factor"] is None and m["dynamic"] is True
    assert m["description"] == ("ntk-mixed, b = 0.625 (default), k dynamic: 1 within L, then powers of 2 >= n/L, "
                                "KV cache re-rotated, log-n on")
    assert "llama.rope.ntk.exponent" not in m["ggufrope_keys"]
    ps = _with_ggufrope_keys(tmp_path, "s.gguf", method="ntk-mixed", logn=True, dynamic=False)
    ms = G.read_rope_metadata(ps)
    assert ms["exponent"] == 0.625 and ms["exponent_default"] is True and ms["factor"] is None
    assert ms["dynamic"] is False
    assert ms["description"] == "ntk-mixed, b = 0.625 (default), k = auto (max(1, n_ctx_seq/4096)), log-n on"
    p2 = _with_ggufrope_keys(tmp_path, "m2.gguf", method="ntk-mixed", exponent=0.5, dynamic=False)
    m2 = G.read_rope_metadata(p2)
    assert m2["exponent"] == 0.5 and m2["exponent_default"] is False
    assert m2["description"].startswith("ntk-mixed, b = 0.5, k = auto")


def test_factor_zero_in_the_file_is_auto(tmp_path) -> None:
    """k = 0 in the file is auto: with dynamic false the static automatic k; without the dynamic
    key the library's default, dynamic k (a factor 0 is no explicit k)."""
    p = _with_ggufrope_keys(tmp_path, "z.gguf", method="ntk", factor=0.0, dynamic=False)
    m = G.read_rope_metadata(p)
    assert m["factor"] is None and m["ggufrope_keys"]["llama.rope.ntk.factor"] == 0.0
    assert m["dynamic"] is False
    assert m["description"] == "ntk, k = auto (max(1, n_ctx_seq/4096)), log-n off"
    pd = _with_ggufrope_keys(tmp_path, "zd.gguf", method="ntk", factor=0.0)
    md = G.read_rope_metadata(pd)
    assert md["factor"] is None and md["ggufrope_keys"]["llama.rope.ntk.factor"] == 0.0
    assert md["dynamic"] is True and md["dynamic_ratio"] == 2.0
    assert md["description"] == "ntk, k dynamic: 1 within L, then powers of 2 >= n/L, KV cache re-rotated, log-n off"
    bad = _with_ggufrope_keys(tmp_path, "b.gguf", method="ntk", factor=0.5)
    with pytest.raises(GGUFRopeError, match="factor k must be finite and >= 1"):
        G.read_rope_metadata(bad)


# --------------------------------------------------------------------------- set


@pytest.mark.parametrize(
    "method, factor, exponent, logn, expect",
    [
        ("none", None, None, False, {"method": "none", "logn": False}),
        ("none", None, None, True, {"method": "none", "logn": True}),
        ("ntk", None, None, False, {"method": "ntk", "logn": False}),
        ("ntk-aware", 4.0, None, True, {"method": "ntk", "factor": 4.0, "logn": True}),
        ("fixed", 2.5, None, False, {"method": "ntk-fixed", "factor": 2.5, "logn": False}),
        ("mixed", None, None, True, {"method": "ntk-mixed", "exponent": 0.625, "logn": True}),
        ("NTK-Mixed", 8.0, 0.5, False, {"method": "ntk-mixed", "factor": 8.0, "exponent": 0.5, "logn": False}),
        ("ntk-mixed", 1.0, 1.0, True, {"method": "ntk-mixed", "factor": 1.0, "exponent": 1.0, "logn": True}),
    ],
)
def test_set_writes_exactly_the_keys(small_gguf, tmp_path, method, factor, exponent, logn, expect) -> None:
    out = tmp_path / "out.gguf"
    before = small_gguf.read_bytes()
    r = G.write_rope_metadata(small_gguf, out, method=method, factor=factor, exponent=exponent, logn=logn)
    assert small_gguf.read_bytes() == before
    assert not r.header_only and r.data_bytes > 0
    fields = reader_fields(out)
    orig = reader_fields(small_gguf)
    names = {"method": K.KEY_METHOD, "factor": K.KEY_FACTOR, "exponent": K.KEY_EXPONENT, "logn": K.KEY_LOGN}
    want = {K.key(names[k], "llama"): v for k, v in expect.items()}
    written = {k: v for k, v in fields.items() if k not in orig}
    assert set(written) == set(want) | {G.KEY_RESERVED}
    for k, v in want.items():
        t, val = written[k]
        assert t == K.KEY_TYPES["{arch}" + k[len("llama") :]]
        assert val == v, k
    assert written[G.KEY_RESERVED][0] == VT.ARRAY
    # the untouched keys keep their types and values
    assert {k: fields[k] for k in orig} == orig
    # never a key stock llama.cpp reads
    assert "llama.rope.scaling.type" not in fields
    assert_rewrite_ok(small_gguf, out)
    m = G.read_rope_metadata(out)
    assert m["method"] == expect["method"]
    assert m["factor"] == expect.get("factor") and m["exponent"] == expect.get("exponent")
    assert m["logn"] == logn
    assert r.description == m["description"]


def test_set_layout_reserved_key_and_page_offset(small_gguf, tmp_path) -> None:
    out = tmp_path / "out.gguf"
    r = G.write_rope_metadata(small_gguf, out, method="mixed", logn=True)
    hs, hd = G.read_header(small_gguf), G.read_header(out)
    # the keys set, then the room, first; every other record after them, in its order
    keys = [kv.key for kv in hd.kvs]
    assert keys[:4] == [*(K.key(t, "llama") for t in (K.KEY_METHOD, K.KEY_EXPONENT, K.KEY_LOGN)), G.KEY_RESERVED]
    assert keys[4:] == [kv.key for kv in hs.kvs]
    assert hd.kvs[3].end - hd.kvs[3].value.count < 4096  # count, keys and the room's header: page 0
    assert hd.kvs[3].value.elem_type == VT.UINT8
    assert r.reserved == hd.kvs[3].value.count >= G.MIN_ROOM
    assert hd.header_end == hd.data_offset == r.data_offset  # no padding: the header fills it
    assert hd.data_offset % 4096 == hs.data_offset % 4096
    assert out.stat().st_size - hd.data_offset == small_gguf.stat().st_size - hs.data_offset
    # untouched records are byte-identical copies
    raw_s, raw_d = small_gguf.read_bytes(), out.read_bytes()
    recs_d = {kv.key: raw_d[kv.start : kv.end] for kv in hd.kvs}
    for kv in hs.kvs:
        assert recs_d[kv.key] == raw_s[kv.start : kv.end]
    assert raw_d[hd.tensor_info_start : hd.tensor_info_end] == raw_s[hs.tensor_info_start : hs.tensor_info_end]


def test_reset_restores_original_bytes(small_gguf, tmp_path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    G.write_rope_metadata(small_gguf, a, method="ntk-mixed", factor=4, exponent=0.75, logn=True)
    G.write_rope_metadata(a, a, method="ntk", logn=False)  # in-place re-set in between
    r = G.reset_rope_metadata(a, b)
    assert set(r.removed) == {K.key(K.KEY_METHOD, "llama"), K.key(K.KEY_LOGN, "llama"), G.KEY_RESERVED}
    assert b.read_bytes() == small_gguf.read_bytes()
    assert reader_fields(b) == reader_fields(small_gguf)


def test_reset_of_plain_file_in_place_is_a_no_op(small_gguf) -> None:
    before = small_gguf.read_bytes()
    ino = small_gguf.stat().st_ino
    r = G.reset_rope_metadata(small_gguf, small_gguf)
    assert r.header_only and r.header_bytes == 0 and r.removed == ()
    assert small_gguf.read_bytes() == before and small_gguf.stat().st_ino == ino


def test_reset_keeps_other_keys(make_gguf, tmp_path) -> None:
    p = make_gguf(extra=lambda w: w.add_string("llama.rope.ntk.method", "ntk"))  # a pre-existing key
    out = tmp_path / "r.gguf"
    G.reset_rope_metadata(p, out)
    f = reader_fields(out)
    assert "llama.rope.ntk.method" not in f and "test.template" in f
    assert_rewrite_ok(p, out)


def test_reset_removes_wrongly_typed_ggufrope_keys(make_gguf, tmp_path) -> None:
    p = make_gguf(extra=lambda w: w.add_uint32("llama.rope.ntk.method", 3))
    with pytest.raises(GGUFRopeError, match="has type UINT32, expected STRING"):
        G.read_rope_metadata(p)
    G.write_rope_metadata(p, tmp_path / "s.gguf", method="ntk")  # set replaces it
    assert G.read_rope_metadata(tmp_path / "s.gguf")["method"] == "ntk"
    G.reset_rope_metadata(p, tmp_path / "r.gguf")
    assert G.read_rope_metadata(tmp_path / "r.gguf")["method"] is None


def test_reset_is_set_to_nothing_and_set_is_idempotent(small_gguf, tmp_path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    G.write_rope_metadata(small_gguf, a, method="ntk", factor=3)
    G.write_rope_metadata(a, b, method="ntk", factor=3)
    assert a.read_bytes() == b.read_bytes()  # same mod-4096 placement, same keys


def test_reset_then_set_round_trip_via_show(small_gguf, tmp_path) -> None:
    a = tmp_path / "a.gguf"
    G.write_rope_metadata(small_gguf, a, method="mixed", exponent=0.625, logn=True, dynamic=False)
    m = G.read_rope_metadata(a)
    assert m["description"] == "ntk-mixed, b = 0.625, k = auto (max(1, n_ctx_seq/8192)), log-n on"
    G.reset_rope_metadata(a, a)
    assert G.read_rope_metadata(a)["method"] is None
    assert a.read_bytes() == small_gguf.read_bytes()


def test_reset_removes_previous_keys_not_written_again(small_gguf, tmp_path) -> None:
    a = tmp_path / "a.gguf"
    G.write_rope_metadata(small_gguf, a, method="mixed", factor=4.0, exponent=0.5, logn=True)
    G.write_rope_metadata(a, a, method="ntk")
    f = reader_fields(a)
    assert K.key(K.KEY_FACTOR, "llama") not in f
    assert K.key(K.KEY_EXPONENT, "llama") not in f
    assert f[K.key(K.KEY_METHOD, "llama")] == (VT.STRING, "ntk")
    assert f[K.key(K.KEY_LOGN, "llama")] == (VT.BOOL, False)
    assert sum(k == G.KEY_RESERVED for k in f) == 1


# --------------------------------------------------------------------------- in place


def test_in_place_first_set_is_atomic_full_rewrite(small_gguf) -> None:
    before_hash = data_hash(small_gguf, G.read_header(small_gguf).data_offset)
    os.chmod(small_gguf, 0o640)
    ino = small_gguf.stat().st_ino
    r = G.write_rope_metadata(small_gguf, small_gguf, method="ntk", factor=2.0)
    assert not r.header_only  # no room in the original header
    assert small_gguf.stat().st_ino != ino  # replaced by rename
    assert small_gguf.stat().st_mode & 0o777 == 0o640
    assert data_hash(small_gguf, r.data_offset) == before_hash
    assert no_temp_files(small_gguf.parent)


def test_in_place_re_set_rewrites_only_header_bytes(make_gguf, tmp_path, monkeypatch) -> None:
    """Every re-set (b, k, log-n, method; keys added and removed, so the key count at
    offset 16 changes too) is one write inside the first page; the data never move."""
    src = make_gguf(vocab=3000)  # a header of several pages
    a = tmp_path / "a.gguf"
    G.write_rope_metadata(src, a, method="mixed", logn=True)
    h0 = G.read_header(a)
    assert h0.data_offset > 3 * 4096
    raw0 = a.read_bytes()
    ino, size = a.stat().st_ino, a.stat().st_size
    writes = []
    real_pwrite = os.pwrite
    for method, k, b, ln in [
        ("mixed", None, 0.75, True),
        ("mixed", 16.0, 0.5, False),
        ("ntk-fixed", 4.0, None, True),
        ("none", None, None, False),
        ("ntk", None, None, True),
        ("mixed", 1.5, 0.625, True),
    ]:
        with monkeypatch.context() as mp:
            mp.setattr(os, "pwrite", lambda fd, data, off: writes.append((off, len(data))) or real_pwrite(fd, data, off))
            r = G.write_rope_metadata(a, None, method=method, factor=k, exponent=b, logn=ln)
        assert r.header_only and r.data_bytes == 0
        off, n = writes[-1]
        assert n == r.header_bytes and 0 < n < 512 and 16 <= off and off + n <= 4096  # one write, in page 0
        assert a.stat().st_ino == ino and a.stat().st_size == size
        h = G.read_header(a)
        assert h.data_offset == h0.data_offset and h.tensors == h0.tensors
        m = G.read_rope_metadata(a)
        assert (m["factor"], m["exponent"], m["logn"]) == (k, b if method == "mixed" else None, ln)
        # a fresh -o write of the same state has the same keys and values
        fresh = tmp_path / "fresh.gguf"
        G.write_rope_metadata(src, fresh, method=method, factor=k, exponent=b, logn=ln)
        fa, ff = reader_fields(a), reader_fields(fresh)
        assert fa.keys() == ff.keys()
        assert {k_: v for k_, v in fa.items() if k_ != G.KEY_RESERVED} == {
            k_: v for k_, v in ff.items() if k_ != G.KEY_RESERVED
        }
    assert len(writes) == 6
    raw1 = a.read_bytes()
    assert raw1[4096:] == raw0[4096:]  # nothing beyond the first page was written
    assert_rewrite_ok(src, a)


def test_in_place_change_beyond_one_page_writes_a_new_file(make_gguf) -> None:
    """A change that does not fit in one page (here a key set in place that sat far into
    the header: set moves the keys it writes to the front) is not written in place, where
    SIGKILL could tear it, but as an atomic replacement."""
    p = make_gguf(vocab=3000)
    G.write_rope_metadata(p, p, method="ntk")  # room and front keys
    h = G.read_header(p)
    assert h.get("test.template").start > 4096
    ino = p.stat().st_ino
    r = G.set_keys(p, None, {"test.template": "{{ x }}"})
    assert not r.header_only and p.stat().st_ino != ino
    assert reader_fields(p)["test.template"] == (VT.STRING, "{{ x }}")
    h2 = G.read_header(p)
    assert h2.data_offset == h.data_offset and h2.tensors == h.tensors
    assert [kv.key for kv in h2.kvs][:2] == ["test.template", G.KEY_RESERVED]
    assert no_temp_files(p.parent)


def test_files_of_the_earlier_layout_are_moved_to_the_new_one(small_gguf, tmp_path) -> None:
    """A file whose ggufrope keys and room sit last (ggufrope before this layout) is
    rewritten whole once by an in-place re-set, then re-set in place."""
    a = tmp_path / "a.gguf"
    G.write_rope_metadata(small_gguf, a, method="mixed", logn=True)
    h = G.read_header(a)
    raw = a.read_bytes()
    # move the front records (3 keys + room) behind the others, as the earlier layout had it
    front, rest = raw[24 : h.kvs[4].start], raw[h.kvs[4].start : h.tensor_info_start]
    old = raw[:24] + rest + front + raw[h.tensor_info_start :]
    a.write_bytes(old)
    assert G.read_header(a).kvs[-1].key == G.KEY_RESERVED
    r = G.write_rope_metadata(a, None, method="mixed", exponent=0.5, logn=True)
    assert not r.header_only and G.read_header(a).kvs[3].key == G.KEY_RESERVED
    assert G.write_rope_metadata(a, None, method="mixed", exponent=0.75, logn=True).header_only
    assert_rewrite_ok(small_gguf, a)


def test_in_place_through_symlink_replaces_target(small_gguf, tmp_path) -> None:
    link = tmp_path / "link.gguf"
    link.symlink_to(small_gguf)
    G.write_rope_metadata(link, link, method="ntk")
    assert link.is_symlink()
    assert G.read_rope_metadata(small_gguf)["method"] == "ntk"


def test_in_place_fast_path_refuses_changed_file(small_gguf, tmp_path, monkeypatch) -> None:
    a = tmp_path / "a.gguf"
    G.write_rope_metadata(small_gguf, a, method="ntk")
    real = G._rewrite_header_in_place

    def touch_then(path, fd, h, plan):
        os.utime(path, ns=(1, 1))
        return real(path, fd, h, plan)

    monkeypatch.setattr(G, "_rewrite_header_in_place", touch_then)
    before = a.read_bytes()
    with pytest.raises(GGUFRopeError, match="changed while"):
        G.write_rope_metadata(a, a, method="mixed")
    assert a.read_bytes() == before


# --------------------------------------------------------------------------- formats


def test_big_endian_file(make_gguf, tmp_path) -> None:
    p = make_gguf(endian=gguf.GGUFEndian.BIG)
    out = tmp_path / "out.gguf"
    G.write_rope_metadata(p, out, method="mixed", factor=2.0, logn=True)
    h = G.read_header(out)
    assert h.endian == ">"
    r = gguf.GGUFReader(str(out))
    assert r.endianess == gguf.GGUFEndian.BIG
    assert r.fields["llama.rope.ntk.method"].contents() == "ntk-mixed"
    assert r.fields["llama.rope.ntk.factor"].contents() == 2.0
    assert r.fields["llama.rope.ntk.exponent"].contents() == 0.625
    assert r.fields["llama.attention.logn_scaling"].contents() is True
    assert_rewrite_ok(p, out)
    G.reset_rope_metadata(out, out)
    assert out.read_bytes() == p.read_bytes()


def test_version_2_is_kept(small_gguf, tmp_path) -> None:
    raw = bytearray(small_gguf.read_bytes())
    raw[4:8] = struct.pack("<I", 2)
    v2 = write(tmp_path, bytes(raw), "v2.gguf")
    out = tmp_path / "out.gguf"
    G.write_rope_metadata(v2, out, method="ntk")
    assert out.read_bytes()[4:8] == struct.pack("<I", 2)
    assert G.read_header(out).version == 2
    assert_rewrite_ok(v2, out)


@pytest.mark.parametrize("alignment", [8, 64, 8192])
def test_custom_alignment(make_gguf, tmp_path, alignment) -> None:
    p = make_gguf(alignment=alignment)
    out = tmp_path / "out.gguf"
    r = G.write_rope_metadata(p, out, method="ntk-fixed", logn=True)
    h = G.read_header(out)
    assert h.alignment == alignment and r.data_offset % alignment == 0
    assert r.data_offset % max(4096, alignment) == G.read_header(p).data_offset % max(4096, alignment)
    assert_rewrite_ok(p, out)


def test_file_without_tensors(make_gguf, tmp_path) -> None:
    p = make_gguf(tensors=False)
    out = tmp_path / "out.gguf"
    G.write_rope_metadata(p, out, method="ntk")
    assert G.read_rope_metadata(out)["method"] == "ntk"
    G.reset_rope_metadata(out, out)
    assert reader_fields(out) == reader_fields(p)


def test_trailing_bytes_after_last_tensor_are_kept(small_gguf, tmp_path) -> None:
    p = write(tmp_path, small_gguf.read_bytes() + b"trailer", "t.gguf")
    out = tmp_path / "out.gguf"
    G.write_rope_metadata(p, out, method="ntk")
    assert out.read_bytes().endswith(b"trailer")
    assert_rewrite_ok(p, out)


# --------------------------------------------------------------------------- copying


@pytest.mark.parametrize("mode", ["copy_file_range", "sendfile", "buffered"])
def test_copy_mechanisms_agree(small_gguf, tmp_path, monkeypatch, mode) -> None:
    ref, out = tmp_path / "ref.gguf", tmp_path / f"{mode}.gguf"
    G.write_rope_metadata(small_gguf, ref, method="mixed", logn=True)
    used = []
    for name in ("copy_file_range", "sendfile", "pread"):
        real = getattr(os, name, None)
        if real is not None:
            monkeypatch.setattr(os, name, lambda *a, _r=real, _n=name: used.append(_n) or _r(*a))
    if mode == "copy_file_range" and not hasattr(os, "copy_file_range"):
        pytest.skip("no os.copy_file_range")
    monkeypatch.setattr(G, "_USE_COPY_FILE_RANGE", mode == "copy_file_range")
    monkeypatch.setattr(G, "_USE_SENDFILE", mode == "sendfile")
    monkeypatch.setattr(G, "_CHUNK", 100)  # many buffered steps
    G.write_rope_metadata(small_gguf, out, method="mixed", logn=True)
    assert mode.replace("buffered", "pread") in used
    assert out.read_bytes() == ref.read_bytes()


def test_copy_file_range_falls_back_on_exdev(small_gguf, tmp_path, monkeypatch) -> None:
    calls = []

    def cfr(*a):
        calls.append(a)
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(G, "_USE_COPY_FILE_RANGE", True)
    monkeypatch.setattr(os, "copy_file_range", cfr, raising=False)
    out = tmp_path / "out.gguf"
    G.write_rope_metadata(small_gguf, out, method="ntk")
    assert calls
    assert_rewrite_ok(small_gguf, out)


def test_large_data_section_is_copied_exactly(tmp_path) -> None:
    """A few MB of data in one tensor: the copy loop, not only the header, is exercised."""
    data = np.random.default_rng(1).integers(0, 256, size=(3 << 20) + 17, dtype=np.uint8)

    p = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_context_length(4096)
    w.add_rope_dimension_count(64)
    w.add_tensor("big", data.view(np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "out.gguf"
    r = G.write_rope_metadata(p, out, method="ntk", factor=4)
    assert r.data_bytes >= data.size
    assert_rewrite_ok(p, out)


def test_data_section_is_copied_from_block_aligned_offsets(tmp_path, monkeypatch) -> None:
    """btrfs/XFS clone (share) extents only between block-aligned offsets, and silently
    copy otherwise: the data section is copied as a short head up to the source's next 4096
    boundary, then the rest from offsets aligned on both sides."""
    if not hasattr(os, "copy_file_range"):
        pytest.skip("no os.copy_file_range")
    data = np.random.default_rng(2).integers(0, 256, size=(1 << 20) + 5, dtype=np.uint8)
    p = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_rope_dimension_count(64)
    w.add_tensor("big", data.view(np.int8))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hs = G.read_header(p)
    assert hs.data_offset % 4096  # the interesting case: an unaligned data section
    calls = []
    real = os.copy_file_range
    monkeypatch.setattr(G, "_USE_COPY_FILE_RANGE", True)
    monkeypatch.setattr(os, "copy_file_range", lambda s, d, n, so, do: calls.append((n, so, do)) or real(s, d, n, so, do))
    out = tmp_path / "o.gguf"
    r = G.write_rope_metadata(p, out, method="ntk")
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
    monkeypatch.setattr(G, "_USE_O_TMPFILE", tmpfile)
    G._tmpfile_ok.clear()
    dst = tmp_path / "dst.gguf"
    dst.write_bytes(b"old contents")
    src_before = small_gguf.read_bytes()

    def enospc(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "header":
        monkeypatch.setattr(G, "_write_segments", enospc)
    elif where == "data":
        monkeypatch.setattr(G, "_copy_range", enospc)
    else:
        real_parse = G._parse
        n = {"calls": 0}

        def parse_then_fail(*a):
            n["calls"] += 1
            if n["calls"] == 2:  # the read-back of the written file
                raise KeyboardInterrupt
            return real_parse(*a)

        monkeypatch.setattr(G, "_parse", parse_then_fail)
    exc = KeyboardInterrupt if where == "verify" else GGUFRopeError
    with pytest.raises(exc) as ei:
        G.write_rope_metadata(small_gguf, dst, method="ntk")
    if exc is GGUFRopeError:
        assert "No space left on device" in str(ei.value) and "\n" not in str(ei.value)
    assert dst.read_bytes() == b"old contents"
    assert small_gguf.read_bytes() == src_before
    assert no_temp_files(tmp_path)
    G._tmpfile_ok.clear()


def test_no_temp_file_after_success_either_way(small_gguf, tmp_path, monkeypatch) -> None:
    for flag in (True, False):
        monkeypatch.setattr(G, "_USE_O_TMPFILE", flag)
        G._tmpfile_ok.clear()
        G.write_rope_metadata(small_gguf, tmp_path / f"o{flag}.gguf", method="ntk")
        assert no_temp_files(tmp_path)
    assert (tmp_path / "oTrue.gguf").read_bytes() == (tmp_path / "oFalse.gguf").read_bytes()
    G._tmpfile_ok.clear()


def test_output_mode_follows_source_and_umask(small_gguf, tmp_path) -> None:
    os.chmod(small_gguf, 0o644)
    old = os.umask(0o077)
    try:
        G.write_rope_metadata(small_gguf, tmp_path / "o.gguf", method="ntk")
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
        r = G.write_rope_metadata(small_gguf, tmp_path / "dst.gguf", method="ntk")
    finally:
        os.close(fd)
    assert not stale.exists()
    assert live.exists() and other.exists() and all(o.exists() for o in odd) and link.is_symlink()
    assert small_gguf.exists() and G.read_rope_metadata(r.path)["method"] == "ntk"
    # unlocked now (its writer "died"): the next write, here the in-place fast path, sweeps it
    assert G.write_rope_metadata(tmp_path / "dst.gguf", None, method="mixed").header_only
    assert not live.exists() and other.exists()
    t = _fake_temp(tmp_path, "dst.gguf", "00000000")
    assert G.sweep_stale_temp_files(tmp_path / "dst.gguf") == [t.name] and not t.exists()


def test_temp_file_is_locked_while_written(small_gguf, tmp_path, monkeypatch) -> None:
    """While a write is in progress its temporary file (named or O_TMPFILE) is flocked, so
    a sweep from another process leaves it alone."""
    import fcntl

    real = G._copy_data
    for tmpfile in (True, False):
        monkeypatch.setattr(G, "_USE_O_TMPFILE", tmpfile)
        G._tmpfile_ok.clear()
        seen = []

        def probe(src_fd, dst_fd, *a, **k):
            fd = os.open(f"/proc/self/fd/{dst_fd}", os.O_RDONLY)  # a new open file: its own lock
            try:
                with pytest.raises(BlockingIOError):
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                seen.append(G.sweep_stale_temp_files(tmp_path / "o.gguf"))
            finally:
                os.close(fd)
            return real(src_fd, dst_fd, *a, **k)

        monkeypatch.setattr(G, "_copy_data", probe)
        G.write_rope_metadata(small_gguf, tmp_path / "o.gguf", method="ntk")
        assert seen == [[]] and no_temp_files(tmp_path)
    G._tmpfile_ok.clear()


# --------------------------------------------------------------------------- set_keys


def test_set_keys_generic(small_gguf, tmp_path) -> None:
    out = tmp_path / "o.gguf"
    G.set_keys(
        small_gguf,
        out,
        {"test.template": "new", "x.int": 7, "x.float": 1.5, "x.bool": False, "x.i64": (VT.INT64, -5)},
        ["test.flag", "not.there"],
    )
    f = reader_fields(out)
    assert f["test.template"] == (VT.STRING, "new")
    assert f["x.int"] == (VT.UINT32, 7) and f["x.float"] == (VT.FLOAT32, 1.5)
    assert f["x.bool"] == (VT.BOOL, False) and f["x.i64"] == (VT.INT64, -5)
    assert "test.flag" not in f
    h0, h1 = G.read_header(small_gguf), G.read_header(out)
    front = ["test.template", "x.int", "x.float", "x.bool", "x.i64", G.KEY_RESERVED]
    keys0 = [kv.key for kv in h0.kvs if kv.key not in ("test.flag", "test.template")]
    assert [kv.key for kv in h1.kvs] == front + keys0  # the keys set first, the others in order
    assert_rewrite_ok(small_gguf, out)
    G.set_keys(small_gguf, out, {"test.template": "new"}, reserve=False)  # without room: in its place
    assert [kv.key for kv in G.read_header(out).kvs] == [kv.key for kv in h0.kvs]


@pytest.mark.parametrize("key", ["general.alignment", "general.architecture", G.KEY_RESERVED])
def test_set_keys_protected(small_gguf, tmp_path, key) -> None:
    with pytest.raises(GGUFRopeError, match="cannot be set or removed"):
        G.set_keys(small_gguf, tmp_path / "o.gguf", {key: 1})
    with pytest.raises(GGUFRopeError, match="cannot be set or removed"):
        G.set_keys(small_gguf, tmp_path / "o.gguf", {}, [key])


def test_set_keys_bad_values(small_gguf, tmp_path) -> None:
    for value in [(VT.UINT8, 300), (VT.ARRAY, [1]), object(), (VT.STRING, 3)]:
        with pytest.raises(GGUFRopeError):
            G.set_keys(small_gguf, tmp_path / "o.gguf", {"x": value})
    assert not (tmp_path / "o.gguf").exists()


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(method="linear"), "--rope-scaling linear"),
        (dict(method="yarn"), "--rope-scaling yarn"),
        (dict(method="pi"), "--rope-scaling linear"),
        (dict(method="bogus"), "unknown method 'bogus'"),
        (dict(method="ntk", factor=0.5), "factor k must be finite and >= 1"),
        (dict(method="ntk", factor=float("nan")), "factor k"),
        (dict(method="ntk", factor=float("inf")), "factor k"),
        (dict(method="ntk", factor=1e39), "factor k"),  # inf in float32
        (dict(method="ntk", factor="x"), "factor k must be a number"),
        (dict(method="mixed", exponent=True), "exponent b must be a number"),
        (dict(method="mixed", exponent=0.0), "exponent b must be in"),
        (dict(method="mixed", exponent=1.01), "exponent b must be in"),
        (dict(method="mixed", exponent=-0.5), "exponent b must be in"),
        (dict(method="mixed", exponent=float("nan")), "exponent b must be in"),
        (dict(method="mixed", exponent=1e-50), "exponent b must be in"),  # 0 in float32
        (dict(method="ntk", exponent=0.5), "applies to ntk-mixed only"),
        (dict(method="none", factor=2.0), "no effect with method 'none'"),
    ],
)
def test_set_parameter_errors(small_gguf, tmp_path, kw, msg) -> None:
    with pytest.raises(GGUFRopeError, match=msg.replace("(", r"\(").replace("[", r"\[")):
        G.write_rope_metadata(small_gguf, tmp_path / "o.gguf", **kw)
    assert not (tmp_path / "o.gguf").exists()


def test_path_errors(tmp_path, small_gguf) -> None:
    with pytest.raises(GGUFRopeError, match="no such file"):
        G.read_rope_metadata(tmp_path / "missing.gguf")
    with pytest.raises(GGUFRopeError, match="is a directory"):
        G.read_rope_metadata(tmp_path)
    with pytest.raises(GGUFRopeError, match="not a regular file"):
        G.read_rope_metadata("/dev/null")
    with pytest.raises(GGUFRopeError, match="is a directory"):
        G.write_rope_metadata(small_gguf, tmp_path, method="ntk")
    with pytest.raises(GGUFRopeError, match="does not exist"):
        G.write_rope_metadata(small_gguf, tmp_path / "no" / "o.gguf", method="ntk")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_permission_errors(small_gguf, tmp_path) -> None:
    os.chmod(small_gguf, 0o000)
    try:
        with pytest.raises(GGUFRopeError, match="Permission denied"):
            G.read_rope_metadata(small_gguf)
    finally:
        os.chmod(small_gguf, 0o644)
    os.chmod(small_gguf, 0o444)
    with pytest.raises(GGUFRopeError, match="no permission to write"):
        G.write_rope_metadata(small_gguf, small_gguf, method="ntk")
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        with pytest.raises(GGUFRopeError, match="Permission denied"):
            G.write_rope_metadata(small_gguf, ro / "o.gguf", method="ntk")
    finally:
        os.chmod(ro, 0o755)


def test_permission_error_message(small_gguf, monkeypatch) -> None:
    """The same path as a real EACCES (this suite may run as root, which ignores modes)."""

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(G, "open", denied, raising=False)
    with pytest.raises(GGUFRopeError, match=r"cannot read .*model.gguf: Permission denied"):
        G.read_rope_metadata(small_gguf)
    monkeypatch.undo()
    monkeypatch.setattr(G.os, "access", lambda *a, **k: False)
    with pytest.raises(GGUFRopeError, match="no permission to write"):
        G.write_rope_metadata(small_gguf, small_gguf, method="ntk")


# Anchors known from the model side, not from ggufrope: llama and qwen2 are loaded with every
# method by the tiny-model tests (NORMAL and NEOX rope), gemma3 is the second real model family;
# qwen2vl ropes with M-RoPE (test_patched_model: it refuses to load a method); deepseek2 (MLA)
# and llama4 (chunked attention) rope other tensors than per-layer Q/K; gpt2 has no rope. bert:
# llama.cpp's rope-type table says NEOX (for nomic-bert), but plain BERT's graph
# (src/models/bert.cpp) has no rope at all (absolute position embeddings), so the library
# refuses a method for it when the context is created ("0 of 0 rope ops"): set must refuse it.
SERVED = ["llama", "qwen2", "qwen3", "gemma3", "mistral3"]
NOT_SERVED = ["bert", "qwen2vl", "deepseek2", "llama4", "gpt2", "no-such-arch", "llama\nx"]


def test_set_accepts_exactly_the_architectures_the_library_serves(make_gguf, tmp_path, patched_lib) -> None:
    """One list for set and the library: what set accepts is what
    llama_ggufrope_arch_supported says, asked here through llama_cpp's own handle."""
    import ctypes

    import llama_cpp

    f = llama_cpp.llama_cpp._lib.llama_ggufrope_arch_supported
    f.argtypes, f.restype = [ctypes.c_char_p], ctypes.c_bool
    library = {}
    for i, arch in enumerate(SERVED + NOT_SERVED):
        src = make_gguf(f"a{i}.gguf", arch=arch, rope=arch != "bert")
        out = tmp_path / f"o{i}.gguf"
        served = library[arch] = bool(f(arch.encode()))
        if served:
            G.write_rope_metadata(src, out, method="ntk")
            assert G.read_rope_metadata(out)["method"] == "ntk"
        else:
            with pytest.raises(GGUFRopeError) as ei:
                G.write_rope_metadata(src, out, method="ntk")
            msg = str(ei.value)
            assert f"architecture {arch!r} is not served by the patched llama.cpp" in msg and "\n" not in msg
            assert not out.exists()
    # set follows the library whatever it says (above); and the library is right on the anchors
    wrong = {a: served for a, served in library.items() if served != (a in SERVED)}
    assert not wrong, f"llama_ggufrope_arch_supported disagrees with the model graphs on {wrong}"
    # a file without rope keys of a served architecture is accepted (converters may omit them)
    G.write_rope_metadata(make_gguf("c.gguf", arch="qwen2", rope=False), tmp_path / "c-o.gguf", method="ntk")
    assert G.read_rope_metadata(make_gguf("bert.gguf", arch="bert", rope=False))["has_rope"] is False


def test_set_without_a_patched_library_refuses(small_gguf, tmp_path, monkeypatch) -> None:
    """No llama-cpp-python, a directory without libllama, a stock library: a clear message."""
    import importlib.util
    import sys

    from ggufrope import runtime

    out = tmp_path / "o.gguf"
    monkeypatch.setattr(runtime, "_light", None)
    monkeypatch.delitem(sys.modules, "llama_cpp.llama_cpp", raising=False)
    monkeypatch.delenv("LLAMA_CPP_LIB_PATH", raising=False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(GGUFRopeError, match="needs the patched llama.cpp library, and llama-cpp-python is not installed"):
        G.write_rope_metadata(small_gguf, out, method="ntk")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path / "empty"))
    with pytest.raises(GGUFRopeError, match="there is no libllama.so in"):
        G.write_rope_metadata(small_gguf, out, method="ntk")
    assert not out.exists()


def test_set_refuses_with_a_stock_library(small_gguf, tmp_path) -> None:
    """For real, in a child process whose libllama is the unpatched build (bench/build-stock.sh),
    when this machine has one."""
    import subprocess
    import sys

    build = Path(__file__).resolve().parents[1] / "build"
    stock = next((d for d in (build / "stock-lib", build / "cmake-stock" / "bin") if (d / "libllama.so").exists()), None)
    if stock is None:
        pytest.skip("no unpatched build in build/stock-lib (bench/build-stock.sh)")
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(stock), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run([sys.executable, "-m", "ggufrope", "set", str(small_gguf), "-m", "ntk", "-o", str(tmp_path / "o.gguf")],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "the installed llama-cpp-python library is stock" in p.stderr


def test_set_asks_the_library_without_importing_llama_cpp(small_gguf, tmp_path) -> None:
    """The architecture check opens libllama with ctypes; the llama_cpp package (about half a
    second to import) stays out of `ggufrope set`."""
    import subprocess
    import sys

    code = ("import sys; from ggufrope import gguf_file as G; "
            f"G.write_rope_metadata({str(small_gguf)!r}, {str(tmp_path / 'o.gguf')!r}, method='ntk'); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'llama_cpp'))")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_stock_scaling_is_noted_not_touched(make_gguf, tmp_path) -> None:
    """The library's rule: an NTK-family method replaces a stock yarn/linear scaling of the
    file (L = original_context_length), method none (log-n alone) keeps it. set says so and
    leaves the stock keys in the file; show's method line says so."""
    p = make_gguf(scaling=("linear", 2.0))
    out = tmp_path / "o.gguf"
    r = G.write_rope_metadata(p, out, method="ntk", dynamic=False)
    assert r.notes == ("the file also has stock llama.cpp rope scaling llama.rope.scaling.type = 'linear'; "
                       "ggufrope's method ntk replaces it when the model loads (not stacked on it; "
                       "L = 8192 from llama.context_length)",)
    f = reader_fields(out)
    assert f["llama.rope.scaling.type"] == (VT.STRING, "linear")
    m = G.read_rope_metadata(out)
    assert m["description"] == ("ntk, k = auto (max(1, n_ctx_seq/8192)), log-n off; "
                                "replaces the file's stock llama.cpp rope scaling 'linear' (factor 2.0)")
    assert r.description == m["description"]

    y = make_gguf("y.gguf", scaling=("yarn", 4.0), orig_ctx=2048)
    r = G.write_rope_metadata(y, out, method="mixed", factor=3.0)
    assert len(r.notes) == 1 and "ggufrope's method ntk-mixed replaces it" in r.notes[0]
    assert "L = 2048 from llama.rope.scaling.original_context_length" in r.notes[0]
    assert G.read_rope_metadata(out)["description"].endswith("replaces the file's stock llama.cpp rope scaling 'yarn' (factor 4.0)")
    r = G.write_rope_metadata(y, out, method="none", logn=True)
    assert r.notes == ("the file also has stock llama.cpp rope scaling llama.rope.scaling.type = 'yarn'; "
                       "method none keeps it (log-n applies beside it)",)
    assert G.read_rope_metadata(out)["description"] == (
        "none, log-n on; the file's stock llama.cpp rope scaling 'yarn' (factor 4.0) stays in effect")


@pytest.mark.parametrize(
    "data, msg",
    [
        (b"", "bad magic"),
        (b"GGU", "bad magic"),
        (b"GGML" + b"\0" * 40, "bad magic"),
        (b"GGUF", "truncated GGUF header"),
        (b"GGUF" + struct.pack("<I", 1) + b"\0" * 16, "unsupported GGUF version 1"),
        (b"GGUF" + struct.pack("<I", 4) + b"\0" * 16, "unsupported GGUF version 4"),
        (b"GGUF" + struct.pack("<IQ", 3, 0), "truncated GGUF header"),
        (raw_gguf([], n_kv=2**62), "corrupt counts"),
        (raw_gguf([], n_tensors=2**40), "corrupt counts"),
        (raw_gguf([struct.pack("<Q", 2**60) + bytes(16)], n_kv=1), "beyond the end of the file"),
        (raw_gguf([kv("k", VT.STRING, struct.pack("<Q", 2**63))]), "beyond the end of the file"),
        (raw_gguf([kv("k", VT.ARRAY, struct.pack("<IQ", VT.UINT64, 2**61))]), "beyond the end of the file"),
        (raw_gguf([kv("k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2**61))]), "beyond the end of the file"),
        (raw_gguf([kv("k", VT.ARRAY, struct.pack("<IQ", VT.ARRAY, 1))]), "nested arrays"),
        (raw_gguf([kv("k", VT.ARRAY, struct.pack("<IQ", 99, 1))]), "unknown element type 99"),
        (raw_gguf([kv("k", 77, b"\0" * 8)]), "unknown value type 77"),
        (raw_gguf([kv(b"\xff\xfe", VT.UINT32, b"\0" * 4)]), "not valid UTF-8"),
        (raw_gguf([kv_str("k", b"ok\xc3")]), "not valid UTF-8"),
        (raw_gguf([kv("k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 2) + pstr("a") + pstr(b"\xe2\x82"))]), r"array 'k'\[1\] is not valid UTF-8"),
        (raw_gguf([kv_u32("k", 1), kv_u32("k", 2)]), "duplicate key 'k'"),
        (raw_gguf([kv("general.alignment", VT.UINT64, struct.pack("<Q", 32))]), "expected UINT32"),
        (raw_gguf([kv_u32("general.alignment", 48)]), "not a power of two"),
        (raw_gguf([kv_u32("general.alignment", 0)]), "not a power of two"),
        (raw_gguf(LLAMA_KVS, n_tensors=1, tail=pstr("t") + struct.pack("<IQIQ", 1, 4, 0, 0)), "truncated tensor data"),
        (raw_gguf(LLAMA_KVS, n_tensors=1, tail=pstr("t") + struct.pack("<I", 5) + b"\0" * 52), "5 dimensions"),
        (raw_gguf(LLAMA_KVS, n_tensors=1, tail=pstr("t") + struct.pack("<IQIQ", 1, 4, 0, 3)), "not a multiple of the alignment"),
        (raw_gguf(LLAMA_KVS, n_tensors=1, tail=pstr("t") + struct.pack("<IQIQ", 1, 33, 8, 0)), "not a multiple of its block size 32"),
        (raw_gguf(LLAMA_KVS, n_tensors=2, tail=(pstr("t") + struct.pack("<IQIQ", 1, 1, 0, 0)) * 2), "duplicate tensor name"),
    ],
)
def test_hostile_headers(tmp_path, data, msg) -> None:
    p = write(tmp_path, data)
    with pytest.raises(GGUFRopeError, match=msg) as ei:
        G.read_header(p)
    assert "\n" not in str(ei.value)
    with pytest.raises(GGUFRopeError):
        G.write_rope_metadata(p, tmp_path / "o.gguf", method="ntk")
    assert p.read_bytes() == data and not (tmp_path / "o.gguf").exists()


@pytest.mark.parametrize(
    "kvs, msg, where",
    [
        ([kv_u32("general.architecture", 1)], "'general.architecture' has type UINT32", "both"),
        ([kv_u32("general.name", 1)], "no general.architecture", "both"),
        ([kv_str("general.architecture", "")], "general.architecture is empty", "both"),
        (LLAMA_KVS[:1] + [kv("llama.context_length", VT.FLOAT32, struct.pack("<f", 1))], "expected UINT32", "both"),
        (LLAMA_KVS + [kv("llama.rope.freq_base", VT.FLOAT64, struct.pack("<d", 1))], "expected FLOAT32", "both"),
        (LLAMA_KVS + [kv_u32("llama.rope.scaling.type", 1)], "expected STRING", "both"),
        (LLAMA_KVS + [kv_u32("llama.rope.ntk.factor", 2)], "'llama.rope.ntk.factor' has type UINT32", "show"),
        (LLAMA_KVS + [kv_str("llama.rope.ntk.method", "yarn")], "is not one of", "show"),
        (LLAMA_KVS + [kv_str("llama.rope.ntk.method", "ntk"), kv("llama.rope.ntk.factor", VT.FLOAT32, struct.pack("<f", 0.5))], "factor k must be", "show"),
        (LLAMA_KVS + [kv_str("llama.rope.ntk.method", "ntk-mixed"), kv("llama.rope.ntk.exponent", VT.FLOAT32, struct.pack("<f", 2))], "exponent b must be", "show"),
        (LLAMA_KVS + [kv("llama.attention.logn_scaling", VT.BOOL, b"\1")], "without llama.rope.ntk.method", "show"),
    ],
)
def test_wrong_types_and_values_of_known_keys(tmp_path, kvs, msg, where) -> None:
    data = raw_gguf(kvs)
    data += bytes(-len(data) % 32)
    p = write(tmp_path, data)
    with pytest.raises(GGUFRopeError, match=msg):
        G.read_rope_metadata(p)
    if where == "both":
        with pytest.raises(GGUFRopeError, match=msg):
            G.write_rope_metadata(p, tmp_path / "o.gguf", method="ntk")
    else:  # set replaces ggufrope keys whatever they hold
        G.write_rope_metadata(p, tmp_path / "o.gguf", method="ntk")
        assert G.read_rope_metadata(tmp_path / "o.gguf")["method"] == "ntk"
    assert p.read_bytes() == data


def _patch_tensor_type(path: Path, name: str, new_type: int) -> None:
    """Overwrite the ggml type field of tensor ``name``'s info record (walked by hand:
    name string, n_dims u32, n_dims u64 dims, type u32, offset u64)."""
    h = G.read_header(path)
    raw = bytearray(path.read_bytes())
    pos = h.tensor_info_start
    for t in h.tensors:
        (n,) = struct.unpack_from("<Q", raw, pos)
        assert raw[pos + 8 : pos + 8 + n].decode() == t.name
        pos += 8 + n
        (nd,) = struct.unpack_from("<I", raw, pos)
        pos += 4 + 8 * nd
        if t.name == name:
            struct.pack_into("<I", raw, pos, new_type)
            path.write_bytes(bytes(raw))
            return
        pos += 4 + 8
    raise AssertionError(name)


@pytest.mark.parametrize("ggml_type", [42, 999])
def test_tensor_types_unknown_to_gguf_py_pass_through(make_gguf, tmp_path, ggml_type) -> None:
    """42 is Q2_0, which the pinned ggml loads and the installed gguf-py does not list: a header
    rewrite reuses offsets and needs no type sizes, so set and reset keep such a tensor, its type
    field and its bytes."""
    with pytest.raises(ValueError):
        gguf.GGMLQuantizationType(ggml_type)  # the premise: gguf-py does not know it
    src = make_gguf()
    _patch_tensor_type(src, "blk.0.attn_q.weight", ggml_type)
    h = G.read_header(src)
    t = {t.name: t for t in h.tensors}["blk.0.attn_q.weight"]
    assert t.ggml_type == ggml_type and t.nbytes is None
    out, back = tmp_path / "o.gguf", tmp_path / "back.gguf"
    r = G.write_rope_metadata(src, out, method="mixed", logn=True)
    assert r.data_bytes == h.file_size - h.data_offset
    ho = G.read_header(out)
    assert ho.tensors == h.tensors
    assert data_hash(src, h.data_offset) == data_hash(out, ho.data_offset)
    assert G.read_rope_metadata(out)["method"] == "ntk-mixed"
    G.write_rope_metadata(out, out, method="ntk", factor=2.0)  # in place, header only
    assert G.read_header(out).tensors == h.tensors
    G.reset_rope_metadata(out, back)
    assert back.read_bytes() == src.read_bytes()


def test_every_truncation_of_the_header_is_a_clean_error(make_gguf, tmp_path) -> None:
    src = make_gguf(vocab=3)
    raw = src.read_bytes()
    h = G.read_header(src)
    p = tmp_path / "cut.gguf"
    end = h.data_offset + max(t.offset + t.nbytes for t in h.tensors)
    p.write_bytes(raw)
    for n in [end - 1, h.data_offset + 1] + list(range(h.header_end - 1, -1, -1)):
        os.truncate(p, n)  # shrinking in place: far cheaper than rewriting the file each time
        with pytest.raises(GGUFRopeError, match="truncated|bad magic"):
            G.read_header(p)


def test_huge_string_value_is_validated_in_chunks(tmp_path) -> None:
    big = ("é" * ((G._STRING_KEEP_LIMIT // 2) + 10)).encode()
    data = raw_gguf(LLAMA_KVS + [kv_str("big", big)])
    data += bytes(-len(data) % 32)
    p = write(tmp_path, data)
    h = G.read_header(p)
    assert h.value("big") is None  # validated, not kept
    bad = write(tmp_path, data.replace(b"\xc3\xa9\xc3\xa9", b"\xc3\xa9\xc3(", 1), "bad.gguf")
    with pytest.raises(GGUFRopeError, match="not valid UTF-8"):
        G.read_header(bad)


@pytest.mark.parametrize("chunk", [1 << 20, 97])
def test_string_arrays_are_validated_in_runs(tmp_path, monkeypatch, chunk) -> None:
    """The fast path of skip_strings (runs of strings with ASCII length prefixes, one
    decode per run) accepts exactly what string-by-string decoding accepts, and names the
    first bad string, with long strings (>= 128 bytes: non-ASCII prefixes) and strings
    crossing the read buffer (a tiny chunk) in between."""
    monkeypatch.setattr(G, "_CHUNK", chunk)
    strings = [b"a", "é✓".encode(), b"x" * 200, b"", "ţ".encode() * 70, b"tok"] * 20  # 140 bytes of ţ
    body = struct.pack("<IQ", VT.STRING, len(strings)) + b"".join(pstr(x) for x in strings)
    good = raw_gguf(LLAMA_KVS + [kv("arr", VT.ARRAY, body)])
    G.read_header(write(tmp_path, good, "good.gguf"))
    for j, bad_bytes in [(0, b"\xff"), (1, b"\xc3"), (2, b"x" * 199 + b"\xe2"), (41, b"\xed\xa0\x80"), (119, b"ok\xc0\xaf")]:
        bad = list(strings)
        bad[j] = bad_bytes
        body = struct.pack("<IQ", VT.STRING, len(bad)) + b"".join(pstr(x) for x in bad)
        p = write(tmp_path, raw_gguf(LLAMA_KVS + [kv("arr", VT.ARRAY, body)]), f"bad{j}.gguf")
        with pytest.raises(GGUFRopeError, match=rf"array 'arr'\[{j}\] is not valid UTF-8"):
            G.read_header(p)
    # a string cut short by a lead byte completed by the next length prefix (0xA9 = 169):
    # valid as a whole run, invalid string by string; it must be refused
    tricky = [b"ab\xc3", b"y" * 169]
    body = struct.pack("<IQ", VT.STRING, 2) + b"".join(pstr(x) for x in tricky)
    p = write(tmp_path, raw_gguf(LLAMA_KVS + [kv("arr", VT.ARRAY, body)]), "tricky.gguf")
    with pytest.raises(GGUFRopeError, match=r"array 'arr'\[0\] is not valid UTF-8"):
        G.read_header(p)


def test_gguf_constants_are_gguf_pys() -> None:
    """gguf_file takes gguf-py's constants module without importing the package (numpy):
    the same values, and interchangeable with gguf's own enums."""
    assert G.GGUF_MAGIC == gguf.GGUF_MAGIC and G.GGUF_DEFAULT_ALIGNMENT == gguf.GGUF_DEFAULT_ALIGNMENT
    assert {t.name: int(t) for t in G.GGUFValueType} == {t.name: int(t) for t in gguf.GGUFValueType}
    assert {int(k): v for k, v in G.GGML_QUANT_SIZES.items()} == {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
    assert G.GGUFValueType.STRING == gguf.GGUFValueType.STRING
    assert {gguf.GGUFValueType.BOOL: 1}[G.GGUFValueType.BOOL] == 1


def test_gguf_constants_load_without_the_package(tmp_path) -> None:
    import subprocess
    import sys

    code = (
        "import sys; from ggufrope.gguf_file import _gguf_constants; "
        "sys.modules.pop('gguf.constants', None); sys.modules.pop('ggufrope._gguf_constants', None); "
        "gone = {m for m in sys.modules if m == 'numpy' or m.startswith('gguf')}; "
        "[sys.modules.pop(m) for m in gone]; "
        "c = _gguf_constants(); print(c.__name__, 'numpy' in sys.modules, 'gguf' in sys.modules, int(c.GGUFValueType.ARRAY))"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["ggufrope._gguf_constants", "False", "False", "9"]


def test_float32_helpers_agree_with_numpy() -> None:
    vals = np.random.default_rng(3).integers(0, 2**32, size=20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    for v in list(vals) + [np.float32(x) for x in (0.625, 2.7, 1e-4, 1e16, 100000.0, -0.0, 3.4028235e38, 1e-45)]:
        s = G.f32_repr(float(v))
        if np.isnan(v):
            assert s == "nan"
            continue
        assert np.float32(float(s)) == v  # round-trips
        assert float(s) == float(str(v))  # numpy's shortest digits
    assert G.f32_repr(2.7) == "2.7" and G.f32_repr(100000.0) == "100000.0" and G.f32_repr(0.625) == "0.625"
    with np.errstate(over="ignore"):
        for x in (1e39, -1e39, 3.4028235e38, 3.40282357e38, 3.4028236e38, float("inf"), 2.7, 1e-46, 7e-46, 1.5e-45):
            assert G._f32(x) == float(np.float32(x)), x
    assert math.isnan(G._f32(float("nan")))


# --------------------------------------------------------------------------- fuzzing

_FUZZ: dict[str, bytes] = {}


def _fuzz_bases(tmp: Path) -> dict[str, bytes]:
    if not _FUZZ:
        plain = write_test_gguf(tmp / "plain.gguf", vocab=12)
        done = tmp / "set.gguf"
        G.write_rope_metadata(plain, done, method="mixed", factor=4.0, logn=True)
        be = write_test_gguf(tmp / "be.gguf", vocab=5, endian=gguf.GGUFEndian.BIG)
        for name, p in (("plain", plain), ("set", done), ("be", be)):
            h = G.read_header(p)
            raw = p.read_bytes()
            # keep the header and the first 64 bytes of data: mutations land in the header
            _FUZZ[name] = raw[: h.data_offset] + raw[h.data_offset : h.data_offset + 64]
            _FUZZ[name + "-full"] = raw
    return _FUZZ


@st.composite
def mutated_header(draw):
    name = draw(st.sampled_from(["plain", "set", "be", "plain-full", "set-full"]))
    base = bytearray(_FUZZ[name])
    n = len(base)
    # bias towards the fixed header and the first key/values, where counts and lengths live
    pos = st.one_of(st.integers(0, min(n - 1, 64)), st.integers(0, n - 1))
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "byte", "word", "cut", "insert", "delete"]))
        if not base:
            break
        i = draw(pos) % len(base)
        if kind == "flip":
            base[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte":
            base[i] = draw(st.integers(0, 255))
        elif kind == "word":
            word = draw(st.sampled_from([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, 255, 4096]))
            base[i : i + 8] = struct.pack("<Q", word)
        elif kind == "cut":
            del base[i:]
        elif kind == "insert":
            base[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            del base[i : i + draw(st.integers(1, 16))]
    return bytes(base)


def _fuzz_one(d: Path, data: bytes, method: str) -> None:
    src = d / "src.gguf"
    src.write_bytes(data)
    out = d / "out.gguf"
    if out.exists():
        out.unlink()
    for op in (
        lambda: G.read_rope_metadata(src),
        lambda: G.write_rope_metadata(src, out, method=method, logn=True),
        lambda: G.reset_rope_metadata(src, out),
    ):
        try:
            op()
        except GGUFRopeError as e:
            assert "\n" not in str(e)
        else:
            if out.exists():  # whatever was written reads back, with the same data section
                hs, ho = G.read_header(src), G.read_header(out)
                assert hs.tensors == ho.tensors
                assert data_hash(src, hs.data_offset) == data_hash(out, ho.data_offset)
        assert src.read_bytes() == data
        assert no_temp_files(d)
    # in place: either a clean error and the file untouched, or a file that reads back
    try:
        G.write_rope_metadata(src, src, method=method)
    except GGUFRopeError:
        assert src.read_bytes() == data
    else:
        G.read_header(src)
    assert no_temp_files(d)


def _fuzz_test(tmp_path_factory, n: int):
    d = tmp_path_factory.mktemp("fuzz")
    _fuzz_bases(d)

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=mutated_header(), method=st.sampled_from(["ntk", "mixed", "none"]))
    def run(data, method):
        _fuzz_one(d, data, method)

    run()


@pytest.fixture
def fast_fsync(monkeypatch):
    """fsync is a no-op during fuzzing (its semantics are not what is tested there)."""
    monkeypatch.setattr(G.os, "fsync", lambda fd: None)


def test_fuzz_mutated_headers(tmp_path_factory, fast_fsync) -> None:
    _fuzz_test(tmp_path_factory, 300)


@pytest.mark.slow
def test_fuzz_mutated_headers_10000(tmp_path_factory, fast_fsync) -> None:
    _fuzz_test(tmp_path_factory, 10_000)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    version=st.sampled_from([2, 3, 0x03000000]),
    counts=st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    body=st.binary(max_size=256),
)
def test_fuzz_random_bytes_after_header(tmp_path_factory, version, counts, body) -> None:
    d = tmp_path_factory.getbasetemp() / "rnd"
    d.mkdir(exist_ok=True)
    data = b"GGUF" + struct.pack("<IQQ", version, *counts) + body
    p = d / "r.gguf"
    p.write_bytes(data)
    try:
        G.read_rope_metadata(p)
    except GGUFRopeError:
        pass
    assert p.read_bytes() == data


# --------------------------------------------------------------------------- SIGKILL

_KILL_CHILD = r"""
import os, sys, time
from ggufrope import gguf_file as G
G._USE_O_TMPFILE = sys.argv[4] == "1"
stage = sys.argv[3]
real_copy, real_segments = G._copy_range, G._write_segments
def stall(*a):
    print("ready", flush=True)
    time.sleep(60)
if stage == "header":
    G._write_segments = lambda *a: stall()
elif stage == "data":  # the header is written, the data copy starts
    def segments_then_stall(*a):
        n = real_segments(*a)
        G._copy_range = lambda *a: stall()
        return n
    G._write_segments = segments_then_stall
else:  # after the data, before the rename
    G._AtomicFile.commit = lambda self: (os.fsync(self.fd), stall())
G.write_rope_metadata(sys.argv[1], sys.argv[2], method="mixed", logn=True)
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
    tmpfile = G._tmpfile_works(str(tmp_path))
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
from ggufrope import gguf_file as G
G._USE_O_TMPFILE = sys.argv[3] == "1"
G.write_rope_metadata(sys.argv[1], None if sys.argv[2] == "-" else sys.argv[2], method="mixed", logn=True)
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


def file_hash(p: Path) -> str:
    with open(p, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@pytest.fixture(scope="module")
def large_gguf(tmp_path_factory):
    """96 MiB of tensor data, its hash, and the hash and size of its `set` output: large
    enough that a kill lands inside the data copy (~0.1 s here)."""
    d = tmp_path_factory.mktemp("large")
    src = gguf_with_data(d / "large.gguf", 96 << 20, seed=5)
    ref = d / "ref.gguf"
    G.write_rope_metadata(src, ref, method="mixed", logn=True)
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


@pytest.mark.parametrize("frac", [0.05, 0.5, 0.95, 1.0])
def test_sigkill_during_a_large_write(large_gguf, tmp_path, frac) -> None:
    """A real write of ~96 MiB killed with SIGKILL at several points of the data copy (and
    once the temporary file is complete): the destination keeps its old bytes (or, for the
    last point, has the complete new ones), verified by hash; O_TMPFILE leaves nothing."""
    if not G._tmpfile_works(str(tmp_path)):
        pytest.skip("no O_TMPFILE here (the named fallback is tested below)")
    dst = tmp_path / "dst.gguf"
    dst.write_bytes(b"old contents")
    old = file_hash(dst)
    for attempt in range(3):
        seen = _kill_during_copy(large_gguf["src"], dst, tmp_path, frac, True, large_gguf["size"])
        if seen >= 0:
            break
        dst.write_bytes(b"old contents")  # the write won the race: run it again
    assert seen >= 0, "the write always finished before the kill"
    if frac < 1:
        assert 0 < seen < large_gguf["size"]  # the kill landed inside the data copy
        assert file_hash(dst) == old
    else:
        assert file_hash(dst) in (old, large_gguf["new"])
    assert no_temp_files(tmp_path) and os.listdir(tmp_path) == ["dst.gguf"]
    assert file_hash(large_gguf["src"]) == large_gguf["old"]


def test_sigkill_during_a_large_in_place_rewrite(large_gguf, tmp_path) -> None:
    """In place (the first set: a full rewrite), killed mid-copy: the file is the old one."""
    if not G._tmpfile_works(str(tmp_path)):
        pytest.skip("no O_TMPFILE here")
    src = tmp_path / "m.gguf"
    shutil.copyfile(large_gguf["src"], src)
    seen = _kill_during_copy(src, None, tmp_path, 0.5, True, large_gguf["size"])
    assert 0 < seen < large_gguf["size"]
    assert file_hash(src) == large_gguf["old"]
    assert os.listdir(tmp_path) == ["m.gguf"]


def test_sigkill_with_named_temp_file_then_next_write_sweeps_it(large_gguf, tmp_path) -> None:
    """The fallback for filesystems without O_TMPFILE: SIGKILL leaves its named temporary
    file (nothing can remove it then), the destination is intact, and the next write to the
    same destination removes the leftover."""
    dst = tmp_path / "dst.gguf"
    dst.write_bytes(b"old contents")
    seen = _kill_during_copy(large_gguf["src"], dst, tmp_path, 0.5, False, large_gguf["size"])
    assert 0 < seen < large_gguf["size"]
    assert dst.read_bytes() == b"old contents"
    left = [f for f in os.listdir(tmp_path) if "ggufrope-tmp" in f]
    assert len(left) == 1 and left[0].startswith(".dst.gguf.ggufrope-tmp-")
    G.write_rope_metadata(large_gguf["src"], dst, method="mixed", logn=True)
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
    monkeypatch.setattr(G, "_USE_O_TMPFILE", tmpfile)
    G._tmpfile_ok.clear()
    src = gguf_with_data(tmp_path / "src.gguf", 12 << 20)
    before = file_hash(src)
    dst = small_fs / "dst.gguf"
    dst.write_bytes(b"old contents")
    free = _free(small_fs)
    with pytest.raises(GGUFRopeError) as ei:
        G.write_rope_metadata(src, dst, method="mixed", logn=True)
    msg = str(ei.value)
    assert "\n" not in msg and msg == f"cannot write {dst}: No space left on device"
    assert dst.read_bytes() == b"old contents" and file_hash(src) == before
    assert os.listdir(small_fs) == ["dst.gguf"]
    assert _free(small_fs) == free
    G._tmpfile_ok.clear()


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
        hs = G.read_header(src)
        assert hs.data_offset % 4096
        out = mnt / "out.gguf"
        G.write_rope_metadata(src, out, method="mixed", logn=True)
        os.sync()
        data = src.stat().st_size - hs.data_offset
        n, total = shared(out)
        assert n >= data - 4096 and n >= total - 2 * 4096 - G.read_header(out).data_offset
        assert_rewrite_ok(src, out)
        assert G.write_rope_metadata(out, None, method="ntk", factor=2.0).header_only
        os.sync()
        assert shared(out)[0] == n
        ctl = mnt / "ctl.gguf"
        old_page = G.PAGE
        try:
            G.PAGE = 32  # placement by the GGUF alignment only
            r = G.write_rope_metadata(src, ctl, method="mixed", logn=True)
        finally:
            G.PAGE = old_page
        os.sync()
        assert r.data_offset % 4096 != hs.data_offset % 4096 and shared(ctl)[0] == 0
    finally:
        _umount(mnt)


# --------------------------------------------------------------------------- the real model


def same_data(a: Path, b: Path) -> bool:
    """Same tensor infos and data sections, byte for byte (chunked; no GGUFReader)."""
    ha, hb = G.read_header(a), G.read_header(b)
    if ha.tensors != hb.tensors or ha.file_size - ha.data_offset != hb.file_size - hb.data_offset:
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        fa.seek(ha.data_offset)
        fb.seek(hb.data_offset)
        while True:
            x, y = fa.read(8 << 20), fb.read(8 << 20)
            if x != y:
                return False
            if not x:
                return True


def gguf_py_reads(path: Path, want: dict) -> None:
    """gguf-py's reader opens ``path`` and sees our tensors and the ``want`` fields."""
    r = gguf.GGUFReader(str(path))
    h = G.read_header(path)
    assert r.data_offset == h.data_offset
    assert [(t.name, int(t.tensor_type), t.data_offset - r.data_offset, t.n_bytes) for t in r.tensors] == [
        (t.name, t.ggml_type, t.offset, t.nbytes) for t in h.tensors
    ]
    got = {k: r.fields[k].contents() for k in r.fields if ".ntk." in k or "logn" in k}
    assert got == want


@pytest.mark.real_model
def test_every_rewrite_of_the_real_model_loads_in_the_patched_library(patched_lib, tmp_path) -> None:
    """SmolLM2-135M (98 MB): after `set` (-o), after an in-place re-set (header only) and
    after `reset`, the tensor data are byte-identical, gguf-py reads the file, and the
    patched library loads it and reads the keys: with k = 1 (no factor and no dynamic key:
    dynamic k, 1 while p < L; the static auto k at n_ctx 64 would be 1 too) the
    logits equal the original's bit for bit, with k = 4 they differ, after reset they are
    the original's again (and the file is the original, byte for byte)."""
    import llama_cpp

    from ggufrope.models import default_model_path

    src = default_model_path()

    def run_model(path: Path) -> tuple[np.ndarray, dict]:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_batch=64, n_threads=1, n_threads_batch=1,
                              logits_all=True, verbose=False)
        try:
            toks = llm.tokenize(b"The quick brown fox jumps over the lazy dog.", add_bos=True)
            llm.eval(toks)
            return np.array(llm.scores[: len(toks)]), {k: v for k, v in llm.metadata.items() if ".ntk." in k or "logn" in k}
        finally:
            llm.close()

    base, meta = run_model(src)
    assert meta == {}
    out = tmp_path / "smollm2.gguf"
    r = G.write_rope_metadata(src, out, method="ntk-mixed", logn=True)
    assert not r.header_only and r.data_offset % 4096 == G.read_header(src).data_offset % 4096
    assert same_data(src, out)
    gguf_py_reads(out, {"llama.rope.ntk.method": "ntk-mixed", "llama.rope.ntk.exponent": 0.625,
                        "llama.attention.logn_scaling": True})
    logits, meta = run_model(out)
    assert meta == {"llama.rope.ntk.method": "ntk-mixed", "llama.rope.ntk.exponent": "0.625000",
                    "llama.attention.logn_scaling": "true"}
    assert np.array_equal(logits, base)  # dynamic k = 1 while p < L: plain RoPE exactly

    r = G.write_rope_metadata(out, None, method="ntk-mixed", factor=4.0, exponent=0.5, logn=True)
    assert r.header_only and r.data_bytes == 0
    assert same_data(src, out)
    gguf_py_reads(out, {"llama.rope.ntk.method": "ntk-mixed", "llama.rope.ntk.factor": 4.0,
                        "llama.rope.ntk.exponent": 0.5, "llama.attention.logn_scaling": True})
    logits, meta = run_model(out)
    assert meta["llama.rope.ntk.factor"] == "4.000000" and meta["llama.rope.ntk.exponent"] == "0.500000"
    assert np.abs(logits - base).max() > 1e-2  # the library applies the edited keys

    G.reset_rope_metadata(out, None)
    assert file_hash(out) == file_hash(src)  # so gguf-py reads it as it reads the original
    logits, meta = run_model(out)
    assert meta == {} and np.array_equal(logits, base)
