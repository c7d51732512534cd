"""ggufrope.rope_metadata: reading the rope keys, set and reset of the ggufrope keys, their
validation, the architectures served, stock scaling, the real model."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGUFValueType as VT

from conftest import LLAMA_KVS, assert_rewrite_ok, file_hash, kv, kv_str, kv_u32, raw_gguf, reader_fields, write
from ggufrope import gguf_reader as GR, gguf_writer as GW, rope_metadata as RM
from ggufrope import keys as K
from ggufrope.errors import GGUFRopeError

ROPE_KEYS = K.ggufrope_keys("llama")


# --------------------------------------------------------------------------- reading


def test_read_rope_metadata_plain(small_gguf: Path) -> None:
    m = RM.read_rope_metadata(small_gguf)
    assert m["architecture"] == "llama"
    assert m["n_ctx_orig"] == 8192 and m["n_ctx_orig_key"] == "llama.context_length"
    assert m["freq_base"] == 100000.0
    assert m["rope_dims"] == 16 and m["rope_dims_source"] == "llama.rope.dimension_count"
    assert m["method"] is None and m["ggufrope_keys"] == {} and m["reserved"] is None
    assert m["stock_scaling_type"] is None
    assert m["description"].startswith("none")


def test_n_ctx_orig_prefers_original_context_length(make_gguf) -> None:
    p = make_gguf(orig_ctx=2048, scaling=("yarn", 4.0), context_length=8192)
    m = RM.read_rope_metadata(p)
    assert m["n_ctx_orig"] == 2048
    assert m["n_ctx_orig_key"] == "llama.rope.scaling.original_context_length"
    assert m["stock_scaling_type"] == "yarn" and m["stock_scaling_factor"] == 4.0


def test_rope_dims_inferred_without_dimension_count(make_gguf) -> None:
    p = make_gguf(rope=False)  # llama without rope keys: 64 / 4 heads
    m = RM.read_rope_metadata(p)
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
    m = RM.read_rope_metadata(p)
    assert m["method"] == "ntk-mixed" and m["exponent"] == 0.625 and m["exponent_default"] is True
    assert m["factor"] is None and m["dynamic"] is True
    assert m["description"] == ("ntk-mixed, b = 0.625 (default), k dynamic: 1 within L, then powers of 2 >= n/L, "
                                "KV cache re-rotated, log-n on")
    assert "llama.rope.ntk.exponent" not in m["ggufrope_keys"]
    ps = _with_ggufrope_keys(tmp_path, "s.gguf", method="ntk-mixed", logn=True, dynamic=False)
    ms = RM.read_rope_metadata(ps)
    assert ms["exponent"] == 0.625 and ms["exponent_default"] is True and ms["factor"] is None
    assert ms["dynamic"] is False
    assert ms["description"] == "ntk-mixed, b = 0.625 (default), k = auto (max(1, n_ctx_seq/4096)), log-n on"
    p2 = _with_ggufrope_keys(tmp_path, "m2.gguf", method="ntk-mixed", exponent=0.5, dynamic=False)
    m2 = RM.read_rope_metadata(p2)
    assert m2["exponent"] == 0.5 and m2["exponent_default"] is False
    assert m2["description"].startswith("ntk-mixed, b = 0.5, k = auto")


def test_factor_zero_in_the_file_is_auto(tmp_path) -> None:
    """k = 0 in the file is auto: with dynamic false the static automatic k; without the dynamic
    key the library's default, dynamic k (a factor 0 is no explicit k)."""
    p = _with_ggufrope_keys(tmp_path, "z.gguf", method="ntk", factor=0.0, dynamic=False)
    m = RM.read_rope_metadata(p)
    assert m["factor"] is None and m["ggufrope_keys"]["llama.rope.ntk.factor"] == 0.0
    assert m["dynamic"] is False
    assert m["description"] == "ntk, k = auto (max(1, n_ctx_seq/4096)), log-n off"
    pd = _with_ggufrope_keys(tmp_path, "zd.gguf", method="ntk", factor=0.0)
    md = RM.read_rope_metadata(pd)
    assert md["factor"] is None and md["ggufrope_keys"]["llama.rope.ntk.factor"] == 0.0
    assert md["dynamic"] is True and md["dynamic_ratio"] == 2.0
    assert md["description"] == "ntk, k dynamic: 1 within L, then powers of 2 >= n/L, KV cache re-rotated, log-n off"
    bad = _with_ggufrope_keys(tmp_path, "b.gguf", method="ntk", factor=0.5)
    with pytest.raises(GGUFRopeError, match="factor k must be finite and >= 1"):
        RM.read_rope_metadata(bad)


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
    r = RM.write_rope_metadata(small_gguf, out, method=method, factor=factor, exponent=exponent, logn=logn)
    assert small_gguf.read_bytes() == before
    assert not r.header_only and r.data_bytes > 0
    fields = reader_fields(out)
    orig = reader_fields(small_gguf)
    names = {"method": K.KEY_METHOD, "factor": K.KEY_FACTOR, "exponent": K.KEY_EXPONENT, "logn": K.KEY_LOGN}
    want = {K.key(names[k], "llama"): v for k, v in expect.items()}
    written = {k: v for k, v in fields.items() if k not in orig}
    assert set(written) == set(want) | {GW.KEY_RESERVED}
    for k, v in want.items():
        t, val = written[k]
        assert t == K.KEY_TYPES["{arch}" + k[len("llama") :]]
        assert val == v, k
    assert written[GW.KEY_RESERVED][0] == VT.ARRAY
    # the untouched keys keep their types and values
    assert {k: fields[k] for k in orig} == orig
    # never a key stock llama.cpp reads
    assert "llama.rope.scaling.type" not in fields
    assert_rewrite_ok(small_gguf, out)
    m = RM.read_rope_metadata(out)
    assert m["method"] == expect["method"]
    assert m["factor"] == expect.get("factor") and m["exponent"] == expect.get("exponent")
    assert m["logn"] == logn
    assert r.description == m["description"]


def test_reset_restores_original_bytes(small_gguf, tmp_path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    RM.write_rope_metadata(small_gguf, a, method="ntk-mixed", factor=4, exponent=0.75, logn=True)
    RM.write_rope_metadata(a, a, method="ntk", logn=False)  # in-place re-set in between
    r = RM.reset_rope_metadata(a, b)
    assert set(r.removed) == {K.key(K.KEY_METHOD, "llama"), K.key(K.KEY_LOGN, "llama"), GW.KEY_RESERVED}
    assert b.read_bytes() == small_gguf.read_bytes()
    assert reader_fields(b) == reader_fields(small_gguf)


def test_reset_of_plain_file_in_place_is_a_no_op(small_gguf) -> None:
    before = small_gguf.read_bytes()
    ino = small_gguf.stat().st_ino
    r = RM.reset_rope_metadata(small_gguf, small_gguf)
    assert r.header_only and r.header_bytes == 0 and r.removed == ()
    assert small_gguf.read_bytes() == before and small_gguf.stat().st_ino == ino


def test_reset_keeps_other_keys(make_gguf, tmp_path) -> None:
    p = make_gguf(extra=lambda w: w.add_string("llama.rope.ntk.method", "ntk"))  # a pre-existing key
    out = tmp_path / "r.gguf"
    RM.reset_rope_metadata(p, out)
    f = reader_fields(out)
    assert "llama.rope.ntk.method" not in f and "test.template" in f
    assert_rewrite_ok(p, out)


def test_reset_removes_wrongly_typed_ggufrope_keys(make_gguf, tmp_path) -> None:
    p = make_gguf(extra=lambda w: w.add_uint32("llama.rope.ntk.method", 3))
    with pytest.raises(GGUFRopeError, match="has type UINT32, expected STRING"):
        RM.read_rope_metadata(p)
    RM.write_rope_metadata(p, tmp_path / "s.gguf", method="ntk")  # set replaces it
    assert RM.read_rope_metadata(tmp_path / "s.gguf")["method"] == "ntk"
    RM.reset_rope_metadata(p, tmp_path / "r.gguf")
    assert RM.read_rope_metadata(tmp_path / "r.gguf")["method"] is None


def test_reset_is_set_to_nothing_and_set_is_idempotent(small_gguf, tmp_path) -> None:
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    RM.write_rope_metadata(small_gguf, a, method="ntk", factor=3)
    RM.write_rope_metadata(a, b, method="ntk", factor=3)
    assert a.read_bytes() == b.read_bytes()  # same mod-4096 placement, same keys


def test_reset_then_set_round_trip_via_show(small_gguf, tmp_path) -> None:
    a = tmp_path / "a.gguf"
    RM.write_rope_metadata(small_gguf, a, method="mixed", exponent=0.625, logn=True, dynamic=False)
    m = RM.read_rope_metadata(a)
    assert m["description"] == "ntk-mixed, b = 0.625, k = auto (max(1, n_ctx_seq/8192)), log-n on"
    RM.reset_rope_metadata(a, a)
    assert RM.read_rope_metadata(a)["method"] is None
    assert a.read_bytes() == small_gguf.read_bytes()


def test_reset_removes_previous_keys_not_written_again(small_gguf, tmp_path) -> None:
    a = tmp_path / "a.gguf"
    RM.write_rope_metadata(small_gguf, a, method="mixed", factor=4.0, exponent=0.5, logn=True)
    RM.write_rope_metadata(a, a, method="ntk")
    f = reader_fields(a)
    assert K.key(K.KEY_FACTOR, "llama") not in f
    assert K.key(K.KEY_EXPONENT, "llama") not in f
    assert f[K.key(K.KEY_METHOD, "llama")] == (VT.STRING, "ntk")
    assert f[K.key(K.KEY_LOGN, "llama")] == (VT.BOOL, False)
    assert sum(k == GW.KEY_RESERVED for k in f) == 1


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
        RM.write_rope_metadata(small_gguf, tmp_path / "o.gguf", **kw)
    assert not (tmp_path / "o.gguf").exists()


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
            RM.write_rope_metadata(src, out, method="ntk")
            assert RM.read_rope_metadata(out)["method"] == "ntk"
        else:
            with pytest.raises(GGUFRopeError) as ei:
                RM.write_rope_metadata(src, out, method="ntk")
            msg = str(ei.value)
            assert f"architecture {arch!r} is not served by the patched llama.cpp" in msg and "\n" not in msg
            assert not out.exists()
    # set follows the library whatever it says (above); and the library is right on the anchors
    wrong = {a: served for a, served in library.items() if served != (a in SERVED)}
    assert not wrong, f"llama_ggufrope_arch_supported disagrees with the model graphs on {wrong}"
    # a file without rope keys of a served architecture is accepted (converters may omit them)
    RM.write_rope_metadata(make_gguf("c.gguf", arch="qwen2", rope=False), tmp_path / "c-o.gguf", method="ntk")
    assert RM.read_rope_metadata(make_gguf("bert.gguf", arch="bert", rope=False))["has_rope"] is False


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
        RM.write_rope_metadata(small_gguf, out, method="ntk")
    monkeypatch.setattr(importlib.util, "find_spec", real)
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path / "empty"))
    with pytest.raises(GGUFRopeError, match="there is no libllama.so in"):
        RM.write_rope_metadata(small_gguf, out, method="ntk")
    assert not out.exists()


def test_set_refuses_with_a_stock_library(small_gguf, tmp_path) -> None:
    """For real, in a child process whose libllama is the unpatched build in build/stock-lib
    (make stock; make test builds it first)."""
    import subprocess
    import sys

    build = Path(__file__).resolve().parents[1] / "build"
    stock = next((d for d in (build / "stock-lib", build / "cmake-stock" / "bin") if (d / "libllama.so").exists()), None)
    if stock is None:
        pytest.fail("no unpatched build in build/stock-lib: make stock (make test builds it)")
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

    code = ("import sys; from ggufrope import rope_metadata as RM; "
            f"RM.write_rope_metadata({str(small_gguf)!r}, {str(tmp_path / 'o.gguf')!r}, method='ntk'); "
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
    r = RM.write_rope_metadata(p, out, method="ntk", dynamic=False)
    assert r.notes == ("the file also has stock llama.cpp rope scaling llama.rope.scaling.type = 'linear'; "
                       "ggufrope's method ntk replaces it when the model loads (not stacked on it; "
                       "L = 8192 from llama.context_length)",)
    f = reader_fields(out)
    assert f["llama.rope.scaling.type"] == (VT.STRING, "linear")
    m = RM.read_rope_metadata(out)
    assert m["description"] == ("ntk, k = auto (max(1, n_ctx_seq/8192)), log-n off; "
                                "replaces the file's stock llama.cpp rope scaling 'linear' (factor 2.0)")
    assert r.description == m["description"]

    y = make_gguf("y.gguf", scaling=("yarn", 4.0), orig_ctx=2048)
    r = RM.write_rope_metadata(y, out, method="mixed", factor=3.0)
    assert len(r.notes) == 1 and "ggufrope's method ntk-mixed replaces it" in r.notes[0]
    assert "L = 2048 from llama.rope.scaling.original_context_length" in r.notes[0]
    assert RM.read_rope_metadata(out)["description"].endswith("replaces the file's stock llama.cpp rope scaling 'yarn' (factor 4.0)")
    r = RM.write_rope_metadata(y, out, method="none", logn=True)
    assert r.notes == ("the file also has stock llama.cpp rope scaling llama.rope.scaling.type = 'yarn'; "
                       "method none keeps it (log-n applies beside it)",)
    assert RM.read_rope_metadata(out)["description"] == (
        "none, log-n on; the file's stock llama.cpp rope scaling 'yarn' (factor 4.0) stays in effect")


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
        RM.read_rope_metadata(p)
    if where == "both":
        with pytest.raises(GGUFRopeError, match=msg):
            RM.write_rope_metadata(p, tmp_path / "o.gguf", method="ntk")
    else:  # set replaces ggufrope keys whatever they hold
        RM.write_rope_metadata(p, tmp_path / "o.gguf", method="ntk")
        assert RM.read_rope_metadata(tmp_path / "o.gguf")["method"] == "ntk"
    assert p.read_bytes() == data


# --------------------------------------------------------------------------- the real model


def same_data(a: Path, b: Path) -> bool:
    """Same tensor infos and data sections, byte for byte (chunked; no GGUFReader)."""
    ha, hb = GR.read_header(a), GR.read_header(b)
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
    h = GR.read_header(path)
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
    r = RM.write_rope_metadata(src, out, method="ntk-mixed", logn=True)
    assert not r.header_only and r.data_offset % 4096 == GR.read_header(src).data_offset % 4096
    assert same_data(src, out)
    gguf_py_reads(out, {"llama.rope.ntk.method": "ntk-mixed", "llama.rope.ntk.exponent": 0.625,
                        "llama.attention.logn_scaling": True})
    logits, meta = run_model(out)
    assert meta == {"llama.rope.ntk.method": "ntk-mixed", "llama.rope.ntk.exponent": "0.625000",
                    "llama.attention.logn_scaling": "true"}
    assert np.array_equal(logits, base)  # dynamic k = 1 while p < L: plain RoPE exactly

    r = RM.write_rope_metadata(out, None, method="ntk-mixed", factor=4.0, exponent=0.5, logn=True)
    assert r.header_only and r.data_bytes == 0
    assert same_data(src, out)
    gguf_py_reads(out, {"llama.rope.ntk.method": "ntk-mixed", "llama.rope.ntk.factor": 4.0,
                        "llama.rope.ntk.exponent": 0.5, "llama.attention.logn_scaling": True})
    logits, meta = run_model(out)
    assert meta["llama.rope.ntk.factor"] == "4.000000" and meta["llama.rope.ntk.exponent"] == "0.500000"
    assert np.abs(logits - base).max() > 1e-2  # the library applies the edited keys

    RM.reset_rope_metadata(out, None)
    assert file_hash(out) == file_hash(src)  # so gguf-py reads it as it reads the original
    logits, meta = run_model(out)
    assert meta == {} and np.array_equal(logits, base)
