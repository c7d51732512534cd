"""ggufrope.gguf_writer: the header layout and reserved key, in-place re-sets, byte orders,
versions and alignments, set_keys."""

from __future__ import annotations

import os
import struct

import gguf
import pytest
from gguf import GGUFValueType as VT

from conftest import assert_rewrite_ok, data_hash, no_temp_files, reader_fields, write
from ggufrope import gguf_reader as GR, gguf_writer as GW, rope_metadata as RM
from ggufrope import keys as K
from ggufrope.errors import GGUFRopeError


# --------------------------------------------------------------------------- layout


def test_set_layout_reserved_key_and_page_offset(small_gguf, tmp_path) -> None:
    out = tmp_path / "out.gguf"
    r = RM.write_rope_metadata(small_gguf, out, method="mixed", logn=True)
    hs, hd = GR.read_header(small_gguf), GR.read_header(out)
    # the keys set, then the room, first; every other record after them, in its order
    keys = [kv.key for kv in hd.kvs]
    assert keys[:4] == [*(K.key(t, "llama") for t in (K.KEY_METHOD, K.KEY_EXPONENT, K.KEY_LOGN)), GW.KEY_RESERVED]
    assert keys[4:] == [kv.key for kv in hs.kvs]
    assert hd.kvs[3].end - hd.kvs[3].value.count < 4096  # count, keys and the room's header: page 0
    assert hd.kvs[3].value.elem_type == VT.UINT8
    assert r.reserved == hd.kvs[3].value.count >= GW.MIN_ROOM
    assert hd.header_end == hd.data_offset == r.data_offset  # no padding: the header fills it
    assert hd.data_offset % 4096 == hs.data_offset % 4096
    assert out.stat().st_size - hd.data_offset == small_gguf.stat().st_size - hs.data_offset
    # untouched records are byte-identical copies
    raw_s, raw_d = small_gguf.read_bytes(), out.read_bytes()
    recs_d = {kv.key: raw_d[kv.start : kv.end] for kv in hd.kvs}
    for kv in hs.kvs:
        assert recs_d[kv.key] == raw_s[kv.start : kv.end]
    assert raw_d[hd.tensor_info_start : hd.tensor_info_end] == raw_s[hs.tensor_info_start : hs.tensor_info_end]


# --------------------------------------------------------------------------- in place


def test_in_place_first_set_is_atomic_full_rewrite(small_gguf) -> None:
    before_hash = data_hash(small_gguf, GR.read_header(small_gguf).data_offset)
    os.chmod(small_gguf, 0o640)
    ino = small_gguf.stat().st_ino
    r = RM.write_rope_metadata(small_gguf, small_gguf, method="ntk", factor=2.0)
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
    RM.write_rope_metadata(src, a, method="mixed", logn=True)
    h0 = GR.read_header(a)
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
            r = RM.write_rope_metadata(a, None, method=method, factor=k, exponent=b, logn=ln)
        assert r.header_only and r.data_bytes == 0
        off, n = writes[-1]
        assert n == r.header_bytes and 0 < n < 512 and 16 <= off and off + n <= 4096  # one write, in page 0
        assert a.stat().st_ino == ino and a.stat().st_size == size
        h = GR.read_header(a)
        assert h.data_offset == h0.data_offset and h.tensors == h0.tensors
        m = RM.read_rope_metadata(a)
        assert (m["factor"], m["exponent"], m["logn"]) == (k, b if method == "mixed" else None, ln)
        # a fresh -o write of the same state has the same keys and values
        fresh = tmp_path / "fresh.gguf"
        RM.write_rope_metadata(src, fresh, method=method, factor=k, exponent=b, logn=ln)
        fa, ff = reader_fields(a), reader_fields(fresh)
        assert fa.keys() == ff.keys()
        assert {k_: v for k_, v in fa.items() if k_ != GW.KEY_RESERVED} == {
            k_: v for k_, v in ff.items() if k_ != GW.KEY_RESERVED
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
    RM.write_rope_metadata(p, p, method="ntk")  # room and front keys
    h = GR.read_header(p)
    assert h.get("test.template").start > 4096
    ino = p.stat().st_ino
    r = GW.set_keys(p, None, {"test.template": "{{ x }}"})
    assert not r.header_only and p.stat().st_ino != ino
    assert reader_fields(p)["test.template"] == (VT.STRING, "{{ x }}")
    h2 = GR.read_header(p)
    assert h2.data_offset == h.data_offset and h2.tensors == h.tensors
    assert [kv.key for kv in h2.kvs][:2] == ["test.template", GW.KEY_RESERVED]
    assert no_temp_files(p.parent)


def test_files_of_the_earlier_layout_are_moved_to_the_new_one(small_gguf, tmp_path) -> None:
    """A file whose ggufrope keys and room sit last (ggufrope before this layout) is
    rewritten whole once by an in-place re-set, then re-set in place."""
    a = tmp_path / "a.gguf"
    RM.write_rope_metadata(small_gguf, a, method="mixed", logn=True)
    h = GR.read_header(a)
    raw = a.read_bytes()
    # move the front records (3 keys + room) behind the others, as the earlier layout had it
    front, rest = raw[24 : h.kvs[4].start], raw[h.kvs[4].start : h.tensor_info_start]
    old = raw[:24] + rest + front + raw[h.tensor_info_start :]
    a.write_bytes(old)
    assert GR.read_header(a).kvs[-1].key == GW.KEY_RESERVED
    r = RM.write_rope_metadata(a, None, method="mixed", exponent=0.5, logn=True)
    assert not r.header_only and GR.read_header(a).kvs[3].key == GW.KEY_RESERVED
    assert RM.write_rope_metadata(a, None, method="mixed", exponent=0.75, logn=True).header_only
    assert_rewrite_ok(small_gguf, a)


def test_in_place_through_symlink_replaces_target(small_gguf, tmp_path) -> None:
    link = tmp_path / "link.gguf"
    link.symlink_to(small_gguf)
    RM.write_rope_metadata(link, link, method="ntk")
    assert link.is_symlink()
    assert RM.read_rope_metadata(small_gguf)["method"] == "ntk"


def test_in_place_fast_path_refuses_changed_file(small_gguf, tmp_path, monkeypatch) -> None:
    a = tmp_path / "a.gguf"
    RM.write_rope_metadata(small_gguf, a, method="ntk")
    real = GW._rewrite_header_in_place

    def touch_then(path, fd, h, plan):
        os.utime(path, ns=(1, 1))
        return real(path, fd, h, plan)

    monkeypatch.setattr(GW, "_rewrite_header_in_place", touch_then)
    before = a.read_bytes()
    with pytest.raises(GGUFRopeError, match="changed while"):
        RM.write_rope_metadata(a, a, method="mixed")
    assert a.read_bytes() == before


# --------------------------------------------------------------------------- formats


def test_big_endian_file(make_gguf, tmp_path) -> None:
    p = make_gguf(endian=gguf.GGUFEndian.BIG)
    out = tmp_path / "out.gguf"
    RM.write_rope_metadata(p, out, method="mixed", factor=2.0, logn=True)
    h = GR.read_header(out)
    assert h.endian == ">"
    r = gguf.GGUFReader(str(out))
    assert r.endianess == gguf.GGUFEndian.BIG
    assert r.fields["llama.rope.ntk.method"].contents() == "ntk-mixed"
    assert r.fields["llama.rope.ntk.factor"].contents() == 2.0
    assert r.fields["llama.rope.ntk.exponent"].contents() == 0.625
    assert r.fields["llama.attention.logn_scaling"].contents() is True
    assert_rewrite_ok(p, out)
    RM.reset_rope_metadata(out, out)
    assert out.read_bytes() == p.read_bytes()


def test_version_2_is_kept(small_gguf, tmp_path) -> None:
    raw = bytearray(small_gguf.read_bytes())
    raw[4:8] = struct.pack("<I", 2)
    v2 = write(tmp_path, bytes(raw), "v2.gguf")
    out = tmp_path / "out.gguf"
    RM.write_rope_metadata(v2, out, method="ntk")
    assert out.read_bytes()[4:8] == struct.pack("<I", 2)
    assert GR.read_header(out).version == 2
    assert_rewrite_ok(v2, out)


@pytest.mark.parametrize("alignment", [8, 64, 8192])
def test_custom_alignment(make_gguf, tmp_path, alignment) -> None:
    p = make_gguf(alignment=alignment)
    out = tmp_path / "out.gguf"
    r = RM.write_rope_metadata(p, out, method="ntk-fixed", logn=True)
    h = GR.read_header(out)
    assert h.alignment == alignment and r.data_offset % alignment == 0
    assert r.data_offset % max(4096, alignment) == GR.read_header(p).data_offset % max(4096, alignment)
    assert_rewrite_ok(p, out)


def test_file_without_tensors(make_gguf, tmp_path) -> None:
    p = make_gguf(tensors=False)
    out = tmp_path / "out.gguf"
    RM.write_rope_metadata(p, out, method="ntk")
    assert RM.read_rope_metadata(out)["method"] == "ntk"
    RM.reset_rope_metadata(out, out)
    assert reader_fields(out) == reader_fields(p)


def test_trailing_bytes_after_last_tensor_are_kept(small_gguf, tmp_path) -> None:
    p = write(tmp_path, small_gguf.read_bytes() + b"trailer", "t.gguf")
    out = tmp_path / "out.gguf"
    RM.write_rope_metadata(p, out, method="ntk")
    assert out.read_bytes().endswith(b"trailer")
    assert_rewrite_ok(p, out)


# --------------------------------------------------------------------------- set_keys


def test_set_keys_generic(small_gguf, tmp_path) -> None:
    out = tmp_path / "o.gguf"
    GW.set_keys(
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
    h0, h1 = GR.read_header(small_gguf), GR.read_header(out)
    front = ["test.template", "x.int", "x.float", "x.bool", "x.i64", GW.KEY_RESERVED]
    keys0 = [kv.key for kv in h0.kvs if kv.key not in ("test.flag", "test.template")]
    assert [kv.key for kv in h1.kvs] == front + keys0  # the keys set first, the others in order
    assert_rewrite_ok(small_gguf, out)
    GW.set_keys(small_gguf, out, {"test.template": "new"}, reserve=False)  # without room: in its place
    assert [kv.key for kv in GR.read_header(out).kvs] == [kv.key for kv in h0.kvs]


@pytest.mark.parametrize("key", ["general.alignment", "general.architecture", GW.KEY_RESERVED])
def test_set_keys_protected(small_gguf, tmp_path, key) -> None:
    with pytest.raises(GGUFRopeError, match="cannot be set or removed"):
        GW.set_keys(small_gguf, tmp_path / "o.gguf", {key: 1})
    with pytest.raises(GGUFRopeError, match="cannot be set or removed"):
        GW.set_keys(small_gguf, tmp_path / "o.gguf", {}, [key])


def test_set_keys_bad_values(small_gguf, tmp_path) -> None:
    for value in [(VT.UINT8, 300), (VT.ARRAY, [1]), object(), (VT.STRING, 3)]:
        with pytest.raises(GGUFRopeError):
            GW.set_keys(small_gguf, tmp_path / "o.gguf", {"x": value})
    assert not (tmp_path / "o.gguf").exists()
