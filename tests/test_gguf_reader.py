"""ggufrope.gguf_reader: the streaming header parser (hostile and truncated headers, UTF-8,
unknown tensor types, path errors, gguf-py's constants, float32 helpers, fuzzing)."""

from __future__ import annotations

import errno
import math
import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as VT
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import LLAMA_KVS, data_hash, kv, kv_str, kv_u32, no_temp_files, pstr, raw_gguf, write, write_test_gguf
from ggufrope import gguf_reader as GR, rope_metadata as RM
from ggufrope.errors import GGUFRopeError


# --------------------------------------------------------------------------- reading


def test_read_header_matches_gguf_reader(small_gguf: Path) -> None:
    h = GR.read_header(small_gguf)
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
    assert isinstance(arr, GR.ArrayValue) and arr.count == 64 and arr.values is None
    assert h.value("test.u8array").values == [1, 2, 3]
    # raw records are byte ranges of the file
    raw = small_gguf.read_bytes()
    for rec in h.kvs:
        assert raw[rec.start : rec.start + 8] == struct.pack("<Q", len(rec.key.encode()))


# --------------------------------------------------------------------------- validation


def test_path_errors(tmp_path, small_gguf) -> None:
    with pytest.raises(GGUFRopeError, match="no such file"):
        RM.read_rope_metadata(tmp_path / "missing.gguf")
    with pytest.raises(GGUFRopeError, match="is a directory"):
        RM.read_rope_metadata(tmp_path)
    with pytest.raises(GGUFRopeError, match="not a regular file"):
        RM.read_rope_metadata("/dev/null")
    with pytest.raises(GGUFRopeError, match="is a directory"):
        RM.write_rope_metadata(small_gguf, tmp_path, method="ntk")
    with pytest.raises(GGUFRopeError, match="does not exist"):
        RM.write_rope_metadata(small_gguf, tmp_path / "no" / "o.gguf", method="ntk")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_permission_errors(small_gguf, tmp_path) -> None:
    os.chmod(small_gguf, 0o000)
    try:
        with pytest.raises(GGUFRopeError, match="Permission denied"):
            RM.read_rope_metadata(small_gguf)
    finally:
        os.chmod(small_gguf, 0o644)
    os.chmod(small_gguf, 0o444)
    with pytest.raises(GGUFRopeError, match="no permission to write"):
        RM.write_rope_metadata(small_gguf, small_gguf, method="ntk")
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o555)
    try:
        with pytest.raises(GGUFRopeError, match="Permission denied"):
            RM.write_rope_metadata(small_gguf, ro / "o.gguf", method="ntk")
    finally:
        os.chmod(ro, 0o755)


def test_permission_error_message(small_gguf, monkeypatch) -> None:
    """The same path as a real EACCES (this suite may run as root, which ignores modes)."""

    def denied(*a, **k):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(GR, "open", denied, raising=False)
    with pytest.raises(GGUFRopeError, match=r"cannot read .*model.gguf: Permission denied"):
        RM.read_rope_metadata(small_gguf)
    monkeypatch.undo()
    monkeypatch.setattr(GR.os, "access", lambda *a, **k: False)
    with pytest.raises(GGUFRopeError, match="no permission to write"):
        RM.write_rope_metadata(small_gguf, small_gguf, method="ntk")


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
        GR.read_header(p)
    assert "\n" not in str(ei.value)
    with pytest.raises(GGUFRopeError):
        RM.write_rope_metadata(p, tmp_path / "o.gguf", method="ntk")
    assert p.read_bytes() == data and not (tmp_path / "o.gguf").exists()


def _patch_tensor_type(path: Path, name: str, new_type: int) -> None:
    """Overwrite the ggml type field of tensor ``name``'s info record (walked by hand:
    name string, n_dims u32, n_dims u64 dims, type u32, offset u64)."""
    h = GR.read_header(path)
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
    h = GR.read_header(src)
    t = {t.name: t for t in h.tensors}["blk.0.attn_q.weight"]
    assert t.ggml_type == ggml_type and t.nbytes is None
    out, back = tmp_path / "o.gguf", tmp_path / "back.gguf"
    r = RM.write_rope_metadata(src, out, method="mixed", logn=True)
    assert r.data_bytes == h.file_size - h.data_offset
    ho = GR.read_header(out)
    assert ho.tensors == h.tensors
    assert data_hash(src, h.data_offset) == data_hash(out, ho.data_offset)
    assert RM.read_rope_metadata(out)["method"] == "ntk-mixed"
    RM.write_rope_metadata(out, out, method="ntk", factor=2.0)  # in place, header only
    assert GR.read_header(out).tensors == h.tensors
    RM.reset_rope_metadata(out, back)
    assert back.read_bytes() == src.read_bytes()


def test_every_truncation_of_the_header_is_a_clean_error(make_gguf, tmp_path) -> None:
    src = make_gguf(vocab=3)
    raw = src.read_bytes()
    h = GR.read_header(src)
    p = tmp_path / "cut.gguf"
    end = h.data_offset + max(t.offset + t.nbytes for t in h.tensors)
    p.write_bytes(raw)
    for n in [end - 1, h.data_offset + 1] + list(range(h.header_end - 1, -1, -1)):
        os.truncate(p, n)  # shrinking in place: far cheaper than rewriting the file each time
        with pytest.raises(GGUFRopeError, match="truncated|bad magic"):
            GR.read_header(p)


def test_huge_string_value_is_validated_in_chunks(tmp_path) -> None:
    big = ("é" * ((GR._STRING_KEEP_LIMIT // 2) + 10)).encode()
    data = raw_gguf(LLAMA_KVS + [kv_str("big", big)])
    data += bytes(-len(data) % 32)
    p = write(tmp_path, data)
    h = GR.read_header(p)
    assert h.value("big") is None  # validated, not kept
    bad = write(tmp_path, data.replace(b"\xc3\xa9\xc3\xa9", b"\xc3\xa9\xc3(", 1), "bad.gguf")
    with pytest.raises(GGUFRopeError, match="not valid UTF-8"):
        GR.read_header(bad)


@pytest.mark.parametrize("chunk", [1 << 20, 97])
def test_string_arrays_are_validated_in_runs(tmp_path, monkeypatch, chunk) -> None:
    """The fast path of skip_strings (runs of strings with ASCII length prefixes, one
    decode per run) accepts exactly what string-by-string decoding accepts, and names the
    first bad string, with long strings (>= 128 bytes: non-ASCII prefixes) and strings
    crossing the read buffer (a tiny chunk) in between."""
    monkeypatch.setattr(GR, "_CHUNK", chunk)
    strings = [b"a", "é✓".encode(), b"x" * 200, b"", "ţ".encode() * 70, b"tok"] * 20  # 140 bytes of ţ
    body = struct.pack("<IQ", VT.STRING, len(strings)) + b"".join(pstr(x) for x in strings)
    good = raw_gguf(LLAMA_KVS + [kv("arr", VT.ARRAY, body)])
    GR.read_header(write(tmp_path, good, "good.gguf"))
    for j, bad_bytes in [(0, b"\xff"), (1, b"\xc3"), (2, b"x" * 199 + b"\xe2"), (41, b"\xed\xa0\x80"), (119, b"ok\xc0\xaf")]:
        bad = list(strings)
        bad[j] = bad_bytes
        body = struct.pack("<IQ", VT.STRING, len(bad)) + b"".join(pstr(x) for x in bad)
        p = write(tmp_path, raw_gguf(LLAMA_KVS + [kv("arr", VT.ARRAY, body)]), f"bad{j}.gguf")
        with pytest.raises(GGUFRopeError, match=rf"array 'arr'\[{j}\] is not valid UTF-8"):
            GR.read_header(p)
    # a string cut short by a lead byte completed by the next length prefix (0xA9 = 169):
    # valid as a whole run, invalid string by string; it must be refused
    tricky = [b"ab\xc3", b"y" * 169]
    body = struct.pack("<IQ", VT.STRING, 2) + b"".join(pstr(x) for x in tricky)
    p = write(tmp_path, raw_gguf(LLAMA_KVS + [kv("arr", VT.ARRAY, body)]), "tricky.gguf")
    with pytest.raises(GGUFRopeError, match=r"array 'arr'\[0\] is not valid UTF-8"):
        GR.read_header(p)


def test_gguf_constants_are_gguf_pys() -> None:
    """The GGUF modules take gguf-py's constants module without importing the package (numpy):
    the same values, and interchangeable with gguf's own enums."""
    assert GR.GGUF_MAGIC == gguf.GGUF_MAGIC and GR.GGUF_DEFAULT_ALIGNMENT == gguf.GGUF_DEFAULT_ALIGNMENT
    assert {t.name: int(t) for t in GR.GGUFValueType} == {t.name: int(t) for t in gguf.GGUFValueType}
    assert {int(k): v for k, v in GR.GGML_QUANT_SIZES.items()} == {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}
    assert GR.GGUFValueType.STRING == gguf.GGUFValueType.STRING
    assert {gguf.GGUFValueType.BOOL: 1}[GR.GGUFValueType.BOOL] == 1


def test_gguf_constants_load_without_the_package(tmp_path) -> None:
    import subprocess
    import sys

    code = (
        "import sys; from ggufrope.gguf_constants import _gguf_constants; "
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
        s = GR.f32_repr(float(v))
        if np.isnan(v):
            assert s == "nan"
            continue
        assert np.float32(float(s)) == v  # round-trips
        assert float(s) == float(str(v))  # numpy's shortest digits
    assert GR.f32_repr(2.7) == "2.7" and GR.f32_repr(100000.0) == "100000.0" and GR.f32_repr(0.625) == "0.625"
    with np.errstate(over="ignore"):
        for x in (1e39, -1e39, 3.4028235e38, 3.40282357e38, 3.4028236e38, float("inf"), 2.7, 1e-46, 7e-46, 1.5e-45):
            assert GR._f32(x) == float(np.float32(x)), x
    assert math.isnan(GR._f32(float("nan")))


# --------------------------------------------------------------------------- fuzzing


_FUZZ: dict[str, bytes] = {}


def _fuzz_bases(tmp: Path) -> dict[str, bytes]:
    if not _FUZZ:
        plain = write_test_gguf(tmp / "plain.gguf", vocab=12)
        done = tmp / "set.gguf"
        RM.write_rope_metadata(plain, done, method="mixed", factor=4.0, logn=True)
        be = write_test_gguf(tmp / "be.gguf", vocab=5, endian=gguf.GGUFEndian.BIG)
        for name, p in (("plain", plain), ("set", done), ("be", be)):
            h = GR.read_header(p)
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
        lambda: RM.read_rope_metadata(src),
        lambda: RM.write_rope_metadata(src, out, method=method, logn=True),
        lambda: RM.reset_rope_metadata(src, out),
    ):
        try:
            op()
        except GGUFRopeError as e:
            assert "\n" not in str(e)
        else:
            if out.exists():  # whatever was written reads back, with the same data section
                hs, ho = GR.read_header(src), GR.read_header(out)
                assert hs.tensors == ho.tensors
                assert data_hash(src, hs.data_offset) == data_hash(out, ho.data_offset)
        assert src.read_bytes() == data
        assert no_temp_files(d)
    # in place: either a clean error and the file untouched, or a file that reads back
    try:
        RM.write_rope_metadata(src, src, method=method)
    except GGUFRopeError:
        assert src.read_bytes() == data
    else:
        GR.read_header(src)
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
    monkeypatch.setattr(GR.os, "fsync", lambda fd: None)


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
        RM.read_rope_metadata(p)
    except GGUFRopeError:
        pass
    assert p.read_bytes() == data
