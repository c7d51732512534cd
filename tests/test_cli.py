"""The ``ggufrope`` command line: set / show / reset through click, and once for real."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import click
import gguf
import numpy as np
import pytest
from click.testing import CliRunner

from ggufrope import gguf_reader as GR, gguf_writer as GW
from ggufrope.cli import main
from ggufrope.errors import GGUFRopeError


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def fields(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k != GW.KEY_RESERVED}


def test_help_texts() -> None:
    r = run("--help")
    assert r.exit_code == 0
    for cmd in ("set", "show", "reset"):
        assert cmd in r.output
    r = run("set", "--help")
    assert r.exit_code == 0
    for opt in ("--method", "--b", "--factor", "--logn / --no-logn", "--output", "--in-place", "0.625"):
        assert opt in r.output
    assert "ntk-mixed" in r.output and "--rope-scaling" in r.output
    assert run("show", "-h").exit_code == 0 and "--json" in run("show", "-h").output
    assert run("reset", "--help").exit_code == 0
    assert run("--version").exit_code == 0


def test_set_show_reset_round_trip(small_gguf: Path, tmp_path: Path) -> None:
    """--static: the static automatic k (without it, the library's default is dynamic k:
    test_dynamic_cli.py)."""
    out = tmp_path / "long.gguf"
    r = run("set", small_gguf, "--method", "mixed", "--b", "0.625", "--logn", "--static", "-o", out)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"wrote {out}: ntk-mixed, b = 0.625, k = auto (max(1, n_ctx_seq/8192)), log-n on")

    r = run("show", out)
    assert r.exit_code == 0
    text = r.stdout
    assert "architecture:  llama" in text
    assert "n_ctx_orig L:  8192  (llama.context_length)" in text
    assert "freq_base:     100000.0" in text
    assert "rope dims:     16  (llama.rope.dimension_count)" in text
    assert "stock scaling: none" in text
    assert "llama.rope.ntk.method         'ntk-mixed'" in text
    assert "llama.rope.ntk.exponent       0.625" in text
    assert "llama.attention.logn_scaling  true" in text
    assert "llama.rope.ntk.dynamic        false" in text
    assert text.rstrip().endswith("method:        ntk-mixed, b = 0.625, k = auto (max(1, n_ctx_seq/8192)), log-n on")

    r = run("set", out, "-m", "ntk", "-k", "2.7", "--no-logn", "--in-place")
    assert r.exit_code == 0
    assert r.stdout.startswith(f"updated {out} in place: ntk, k = 2.7, log-n off")
    assert "no tensor data copied" in r.stdout

    meta = json.loads(run("show", "--json", out).stdout)
    assert meta["method"] == "ntk" and meta["factor"] == 2.7 and meta["logn"] is False
    assert meta["ggufrope_keys"] == {
        "llama.rope.ntk.method": "ntk",
        "llama.rope.ntk.factor": 2.7,
        "llama.attention.logn_scaling": False,
    }
    assert meta["description"] == "ntk, k = 2.7, log-n off"
    assert meta["n_ctx_orig"] == 8192 and meta["rope_dims"] == 16 and meta["architecture"] == "llama"

    r = run("reset", out, "--in-place")
    assert r.exit_code == 0
    assert "removed llama.rope.ntk.method, llama.rope.ntk.factor, llama.attention.logn_scaling" in r.stdout
    assert out.read_bytes() == small_gguf.read_bytes()
    assert "method:        none" in run("show", out).stdout
    assert "no ggufrope keys to remove" in run("reset", out, "--in-place").stdout


def test_show_plain_and_stock_scaling(make_gguf) -> None:
    p = make_gguf(scaling=("yarn", 4.0), orig_ctx=2048)
    r = run("show", p)
    assert "n_ctx_orig L:  2048  (llama.rope.scaling.original_context_length)" in r.stdout
    assert "stock scaling: yarn, factor 4.0" in r.stdout
    assert "ggufrope keys: none" in r.stdout
    assert "stock llama.cpp rope scaling 'yarn' (factor 4.0)" in r.stdout
    meta = json.loads(run("show", p, "--json").stdout)
    assert meta["stock_scaling_type"] == "yarn" and meta["stock_scaling_factor"] == 4.0


def test_set_note_goes_to_stderr(make_gguf, tmp_path) -> None:
    p = make_gguf(scaling=("linear", 2.0))
    r = run("set", p, "-m", "ntk", "-o", tmp_path / "o.gguf")
    assert r.exit_code == 0
    assert r.stderr.startswith("ggufrope: note: the file also has stock llama.cpp rope scaling")
    assert "ggufrope: note" not in r.stdout


def test_set_and_show_say_the_method_replaces_a_stock_scaling(make_gguf, tmp_path) -> None:
    """The library's rule (an NTK-family method replaces the file's stock yarn/linear scaling,
    log-n alone keeps it), in set's note and in show's method line; never "on top of it"."""
    p = make_gguf(scaling=("yarn", 4.0), orig_ctx=2048)
    out = tmp_path / "o.gguf"
    r = run("set", p, "-m", "mixed", "--static", "-o", out)
    assert r.exit_code == 0, r.output
    notes = r.stderr.splitlines()
    assert notes[0] == ("ggufrope: note: the file also has stock llama.cpp rope scaling llama.rope.scaling.type = 'yarn'; "
                        "ggufrope's method ntk-mixed replaces it when the model loads (not stacked on it; L = 2048 from "
                        "llama.rope.scaling.original_context_length)")
    assert len(notes) == 2 and notes[1].startswith("ggufrope: note: stock engines")  # tests/test_stock_export.py
    assert "on top" not in r.output
    text = run("show", out).stdout
    assert "stock scaling: yarn, factor 4.0" in text
    assert text.rstrip().splitlines()[-1] == (
        "method:        ntk-mixed, b = 0.625, k = auto (max(1, n_ctx_seq/2048)), log-n off; "
        "replaces the file's stock llama.cpp rope scaling 'yarn' (factor 4.0)")
    assert json.loads(run("show", "--json", out).stdout)["description"].endswith("replaces the file's stock llama.cpp "
                                                                                 "rope scaling 'yarn' (factor 4.0)")
    # without --static: dynamic k (the library's default), replacing the stock scaling just the same
    dyn = tmp_path / "dyn.gguf"
    assert run("set", p, "-m", "mixed", "-o", dyn).exit_code == 0
    assert run("show", dyn).stdout.rstrip().splitlines()[-1] == (
        "method:        ntk-mixed, b = 0.625, k dynamic: 1 within L, then powers of 2 >= n/L, KV cache re-rotated, "
        "log-n off; replaces the file's stock llama.cpp rope scaling 'yarn' (factor 4.0)")
    r = run("set", out, "-m", "none", "--logn", "--in-place")
    assert r.exit_code == 0 and "method none keeps it (log-n applies beside it)" in r.stderr
    assert run("show", out).stdout.rstrip().endswith(
        "method:        none, log-n on; the file's stock llama.cpp rope scaling 'yarn' (factor 4.0) stays in effect")


def test_show_ntk_mixed_file_without_exponent(tmp_path) -> None:
    """A valid file (the library loads it with b = 0.625) that ggufrope did not write: show
    reports the default b, as text and as JSON; no traceback."""
    from tiny_models import write_tiny_llama

    m = write_tiny_llama(tmp_path / "m.gguf", seed=3, extra_kv={"{arch}.rope.ntk.method": "ntk-mixed"})
    r = run("show", m.path)
    assert r.exit_code == 0, r.output
    assert "  llama.rope.ntk.method  'ntk-mixed'\n" in r.stdout and "llama.rope.ntk.exponent" not in r.stdout
    # no factor and no dynamic key: the library's default, dynamic k
    assert r.stdout.rstrip().splitlines()[-1] == ("method:        ntk-mixed, b = 0.625 (default), k dynamic: 1 within L, "
                                                  "then powers of 2 >= n/L, KV cache re-rotated, log-n off")
    meta = json.loads(run("show", "--json", m.path).stdout)
    assert meta["exponent"] == 0.625 and meta["exponent_default"] is True and meta["factor"] is None
    assert meta["dynamic"] is True
    assert meta["ggufrope_keys"] == {"llama.rope.ntk.method": "ntk-mixed"}
    # with dynamic false: the static automatic k
    st = write_tiny_llama(tmp_path / "st.gguf", seed=3, extra_kv={"{arch}.rope.ntk.method": "ntk-mixed",
                                                                  "{arch}.rope.ntk.dynamic": False})
    r = run("show", st.path)
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip().splitlines()[-1] == "method:        ntk-mixed, b = 0.625 (default), k = auto (max(1, n_ctx_seq/64)), log-n off"
    meta = json.loads(run("show", "--json", st.path).stdout)
    assert meta["exponent"] == 0.625 and meta["exponent_default"] is True and meta["factor"] is None
    assert meta["dynamic"] is False
    assert meta["ggufrope_keys"] == {"llama.rope.ntk.method": "ntk-mixed", "llama.rope.ntk.dynamic": False}


def test_each_method_through_the_cli(small_gguf, tmp_path) -> None:
    for args, want in [
        (["-m", "none"], {"llama.rope.ntk.method": "none", "llama.attention.logn_scaling": False}),
        (["-m", "none", "--logn"], {"llama.rope.ntk.method": "none", "llama.attention.logn_scaling": True}),
        (["-m", "ntk-aware", "--factor", "4"], {"llama.rope.ntk.method": "ntk", "llama.rope.ntk.factor": 4.0, "llama.attention.logn_scaling": False}),
        (["--method", "fixed"], {"llama.rope.ntk.method": "ntk-fixed", "llama.attention.logn_scaling": False}),
        (["--method=ntk-mixed", "--exponent", "0.5", "-k", "16", "--logn"], {"llama.rope.ntk.method": "ntk-mixed", "llama.rope.ntk.factor": 16.0, "llama.rope.ntk.exponent": 0.5, "llama.attention.logn_scaling": True}),
    ]:
        out = tmp_path / "o.gguf"
        r = run("set", small_gguf, *args, "-o", out)
        assert r.exit_code == 0, r.output
        got = {k: v for k, v in fields(out).items() if k not in fields(small_gguf)}
        assert got == want, args


@pytest.mark.parametrize(
    "args, msg",
    [
        (["set", "{missing}", "-m", "ntk", "-o", "{out}"], "no such file"),
        (["set", "{dir}", "-m", "ntk", "-o", "{out}"], "is a directory"),
        (["show", "{notgguf}"], "not a GGUF file (bad magic)"),
        (["set", "{model}", "-m", "linear", "-o", "{out}"], "use llama.cpp's --rope-scaling linear"),
        (["set", "{model}", "-m", "yarn", "-o", "{out}"], "use llama.cpp's --rope-scaling yarn"),
        (["set", "{model}", "-m", "nope", "-o", "{out}"], "unknown method 'nope'"),
        (["set", "{model}", "-m", "mixed", "--b", "0", "-o", "{out}"], "exponent b must be in (0, 1]"),
        (["set", "{model}", "-m", "mixed", "--b", "1.5", "-o", "{out}"], "exponent b must be in (0, 1]"),
        (["set", "{model}", "-m", "mixed", "--b", "nan", "-o", "{out}"], "exponent b must be in (0, 1]"),
        (["set", "{model}", "-m", "ntk", "-k", "0.9", "-o", "{out}"], "factor k must be finite and >= 1"),
        (["set", "{model}", "-m", "ntk", "-k", "inf", "-o", "{out}"], "factor k must be finite and >= 1"),
        (["set", "{model}", "-m", "ntk", "--b", "0.5", "-o", "{out}"], "applies to ntk-mixed only"),
        (["set", "{model}", "-m", "ntk"], "give -o OUT to write a new file, or --in-place"),
        (["set", "{model}", "-m", "ntk", "-o", "{out}", "--in-place"], "not both"),
        (["set", "{model}", "-m", "ntk", "-o", "{model}"], "is the input file; use --in-place"),
        (["reset", "{model}"], "give -o OUT"),
        (["reset", "{model}", "-o", "{model}"], "is the input file"),
        (["set", "{gpt2}", "-m", "ntk", "-o", "{out}"], "architecture 'gpt2' is not served by the patched llama.cpp"),
        (["set", "{vl}", "-m", "none", "--logn", "-o", "{out}"], "architecture 'qwen2vl' is not served"),
        (["set", "{model}", "-m", "ntk", "-o", "{dir}"], "is a directory"),
    ],
)
def test_errors_are_one_line_exit_2(small_gguf, make_gguf, tmp_path, args, msg) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "junk.bin").write_bytes(b"not a gguf at all")
    subst = {
        "{missing}": tmp_path / "missing.gguf",
        "{dir}": tmp_path / "d",
        "{notgguf}": tmp_path / "junk.bin",
        "{model}": small_gguf,
        "{out}": tmp_path / "out.gguf",
        "{gpt2}": make_gguf("gpt2.gguf", arch="gpt2", rope=False),
        "{vl}": make_gguf("vl.gguf", arch="qwen2vl"),
    }
    before = small_gguf.read_bytes()
    r = run(*[subst.get(a, a) for a in args])
    assert r.exit_code == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ggufrope: error: ")
    assert msg in lines[0]
    assert "Traceback" not in r.output
    assert small_gguf.read_bytes() == before
    assert not (tmp_path / "out.gguf").exists()


def test_usage_errors_follow_click(small_gguf) -> None:
    r = run("set", small_gguf, "-o", "x.gguf")
    assert r.exit_code == 2 and "Missing option '-m' / '--method'" in r.stderr
    r = run("set", small_gguf, "-m", "ntk", "-k", "abc", "--in-place")
    assert r.exit_code == 2 and "'abc' is not a valid float" in r.stderr
    assert run("frobnicate").exit_code == 2


def test_commands_added_later_get_the_same_error_handling() -> None:
    @click.command("boom")
    def boom() -> None:
        raise GGUFRopeError("it went\nwrong")

    main.add_command(boom)
    try:
        r = run("boom")
    finally:
        main.commands.pop("boom")
    assert r.exit_code == 2 and r.stderr == "ggufrope: error: it went wrong\n"


def test_real_process(small_gguf, tmp_path) -> None:
    """Once for real: ``python -m ggufrope`` and the installed entry point."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = tmp_path / "o.gguf"
    p = subprocess.run(
        [sys.executable, "-m", "ggufrope", "set", str(small_gguf), "--method", "mixed", "--logn", "-o", str(out)],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "ntk-mixed, b = 0.625" in p.stdout
    p = subprocess.run(
        [sys.executable, "-m", "ggufrope.cli", "show", "--json", str(out)], capture_output=True, text=True, env=env, timeout=60
    )
    assert p.returncode == 0 and json.loads(p.stdout)["method"] == "ntk-mixed"
    p = subprocess.run(
        [sys.executable, "-m", "ggufrope", "show", str(tmp_path / "nope.gguf")], capture_output=True, text=True, env=env, timeout=60
    )
    assert p.returncode == 2 and p.stderr.startswith("ggufrope: error: no such file") and "Traceback" not in p.stderr
    exe = Path(sys.executable).parent / "ggufrope"
    if exe.exists():
        p = subprocess.run([str(exe), "reset", str(out), "--in-place"], capture_output=True, text=True, env=env, timeout=60)
        assert p.returncode == 0, p.stderr
        assert out.read_bytes() == small_gguf.read_bytes()


# --------------------------------------------------------------------------- bad files, through the CLI


def _bad_files(tmp_path: Path, small_gguf: Path) -> dict[str, tuple[Path, str]]:
    """One file per validation error of issue 4, with the message the CLI must give."""
    import struct

    from conftest import LLAMA_KVS, VT, kv, kv_str, kv_u32, pstr, raw_gguf

    def put(name: str, data: bytes) -> Path:
        p = tmp_path / name
        p.write_bytes(data)
        return p

    def pad(b: bytes) -> bytes:
        return b + bytes(-len(b) % 32)

    good = small_gguf.read_bytes()
    h = GR.read_header(small_gguf)
    end = h.data_offset + max(t.offset + t.nbytes for t in h.tensors)
    v4 = bytearray(good)
    v4[4:8] = struct.pack("<I", 4)
    return {
        "not GGUF": (put("junk.gguf", b"PK\x03\x04 a zip file"), "not a GGUF file (bad magic)"),
        "unsupported version": (put("v4.gguf", bytes(v4)), "unsupported GGUF version 4"),
        "truncated header": (put("cut.gguf", good[: h.tensor_info_start + 5]), "truncated GGUF header"),
        "truncated data": (put("cutdata.gguf", good[: end - 1]), "truncated tensor data"),
        "counts beyond the file size": (put("counts.gguf", raw_gguf([], n_kv=2**40)), "corrupt counts"),
        "string length beyond the file": (put("len.gguf", raw_gguf([kv("k", VT.STRING, struct.pack("<Q", 2**62))])),
                                          "beyond the end of the file"),
        "wrong value type": (put("type.gguf", pad(raw_gguf([kv_str("general.architecture", "llama"),
                                                            kv("llama.context_length", VT.FLOAT32, struct.pack("<f", 1))]))),
                             "key 'llama.context_length' has type FLOAT32, expected UINT32"),
        "unknown value type": (put("vt.gguf", raw_gguf([kv("k", 77, bytes(8))])), "unknown value type 77"),
        "invalid UTF-8 key": (put("utf8k.gguf", raw_gguf([kv(b"\xff\xfe", VT.UINT32, bytes(4))])), "not valid UTF-8"),
        "invalid UTF-8 value": (put("utf8v.gguf", raw_gguf([kv_str("general.architecture", b"lla\xc3")])), "not valid UTF-8"),
        "invalid UTF-8 in a token": (put("utf8t.gguf", raw_gguf(LLAMA_KVS + [kv("tokenizer.ggml.tokens", VT.ARRAY,
                                                                              struct.pack("<IQ", VT.STRING, 2) + pstr("a") + pstr(b"\x80"))])),
                                     "array 'tokenizer.ggml.tokens'[1] is not valid UTF-8"),
        "duplicate key": (put("dup.gguf", raw_gguf([kv_u32("k", 1), kv_u32("k", 2)])), "duplicate key 'k'"),
    }


_BAD = ["not GGUF", "unsupported version", "truncated header", "truncated data", "counts beyond the file size",
        "string length beyond the file", "wrong value type", "unknown value type", "invalid UTF-8 key",
        "invalid UTF-8 value", "invalid UTF-8 in a token", "duplicate key"]


# reset only removes ggufrope keys: a wrongly typed key of another kind is not its business
@pytest.mark.parametrize("cmd, case", [(c, b) for c in ("show", "set", "set-in-place", "reset") for b in _BAD
                                       if (c, b) != ("reset", "wrong value type")])
def test_bad_files_are_one_line_exit_2(small_gguf, tmp_path, case, cmd) -> None:
    path, msg = _bad_files(tmp_path, small_gguf)[case]
    before = path.read_bytes()
    out = tmp_path / "out.gguf"
    args = {"show": ["show", path], "set": ["set", path, "-m", "mixed", "--logn", "-o", out],
            "set-in-place": ["set", path, "-m", "ntk", "--in-place"], "reset": ["reset", path, "-o", out]}[cmd]
    r = run(*args)
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith(f"ggufrope: error: {path}: ")
    assert msg in r.stderr
    assert path.read_bytes() == before and not out.exists()
    assert not [f for f in os.listdir(tmp_path) if "ggufrope-tmp" in f]


def _unprivileged() -> list[str] | None:
    """A prefix that runs a command without the power to ignore file permissions: nothing
    for a normal user; for root, setpriv dropping CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH."""
    import shutil

    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv"):
        return ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    return None


def test_no_permission_is_one_line_exit_2(small_gguf, tmp_path) -> None:
    """For real (as root: without the capabilities that bypass file modes): an unreadable
    model, an in-place rewrite of a read-only model, an output directory without write
    permission."""
    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("root without setpriv: file permissions cannot be enforced")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    unreadable = tmp_path / "secret.gguf"
    unreadable.write_bytes(small_gguf.read_bytes())
    os.chmod(unreadable, 0o000)
    readonly = tmp_path / "ro.gguf"
    readonly.write_bytes(small_gguf.read_bytes())
    os.chmod(readonly, 0o444)
    rodir = tmp_path / "rodir"
    rodir.mkdir()
    os.chmod(rodir, 0o555)
    try:
        for args, msg in [
            (["show", unreadable], f"cannot read {unreadable}: Permission denied"),
            (["set", unreadable, "-m", "ntk", "-o", tmp_path / "o.gguf"], f"cannot open {unreadable}: Permission denied"),
            (["set", readonly, "-m", "ntk", "--in-place"], f"no permission to write {readonly}"),
            (["reset", readonly, "--in-place"], f"no permission to write {readonly}"),
            (["set", small_gguf, "-m", "ntk", "-o", rodir / "o.gguf"], f"cannot create a file in {rodir}: Permission denied"),
        ]:
            p = subprocess.run(prefix + [sys.executable, "-m", "ggufrope", *map(str, args)],
                               capture_output=True, text=True, env=env, timeout=60)
            assert p.returncode == 2 and p.stdout == "", (args, p.stderr)
            assert p.stderr == f"ggufrope: error: {msg}\n", args
    finally:
        os.chmod(unreadable, 0o644)
        os.chmod(rodir, 0o755)
    assert readonly.read_bytes() == small_gguf.read_bytes() and os.listdir(rodir) == []


# --------------------------------------------------------------------------- loading: the k in use
#
# Tiny random models (tests/tiny_models.py): L = n_ctx_train = 64. The patched library pads
# n_ctx up to a multiple of 256 and resolves the automatic k from n_ctx_seq = padded n_ctx /
# n_seq_max: at n_ctx 200 that is 256 / 64 = 4, where n_ctx / L would be 3.125.

TINY_L = 64
N_CTX = 200  # not a multiple of 256
K_LIB = 256 / TINY_L  # 4.0: what the library resolves at N_CTX
K_NAIVE = N_CTX / TINY_L  # 3.125: what Python computed before


def _tiny(tmp_path, name: str, seed: int = 11, **kv):
    from tiny_models import write_tiny_llama

    extra = {f"{{arch}}.{k}": v for k, v in kv.items()}
    # no space prefix: a prompt of the vocabulary's pieces ("t5t6t7") tokenizes without the
    # byte fallback the tiny vocabulary lacks (llama.cpp aborts on a missing byte token)
    extra["tokenizer.ggml.add_space_prefix"] = False
    return write_tiny_llama(tmp_path / name, seed=seed, extra_kv=extra)


PROMPT = "t5t6t7t8"  # pieces of the tiny vocabulary


def _require_factor_symbol() -> None:
    import llama_cpp

    assert hasattr(llama_cpp.llama_cpp._lib, "llama_ggufrope_factor"), \
        "the installed patched llama.cpp lacks llama_ggufrope_factor: rebuild it (make build)"


def _logits(path, tokens, **load_kw) -> tuple[np.ndarray, object]:
    from ggufrope import runtime

    llm = runtime.load(path, n_ctx=N_CTX, logits_all=True, n_threads=2, n_threads_batch=2, flash_attn=False,
                       type_k=0, type_v=0, **load_kw)
    llm.eval(tokens)
    out = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    info = llm.ggufrope
    del llm
    return out, info


def _tokens(n: int = 190, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(4, 96, size=n)]


def test_auto_k_printed_is_the_librarys(tmp_path, patched_lib) -> None:
    """n_ctx 200, L 64, static k (dynamic false in the file and at load time): the k that load
    reports and generate prints is the library's 4, and it is the k of the table applied (same
    logits as an explicit k = 4, not as 3.125)."""
    from ggufrope import runtime

    _require_factor_symbol()
    m = _tiny(tmp_path, "auto.gguf", **{"rope.ntk.method": "ntk-mixed", "attention.logn_scaling": True,
                                        "rope.ntk.dynamic": False})
    toks = _tokens()
    auto, info = _logits(m.path, toks)
    assert info.factor == K_LIB and info.auto and info.n_ctx_seq == 256
    assert info.method == "ntk-mixed" and info.exponent == 0.625 and info.exponent_default and info.logn
    explicit, info4 = _logits(m.path, toks, method="ntk-mixed", factor=K_LIB, logn=True)
    assert info4.factor == K_LIB and not info4.auto
    naive, _ = _logits(m.path, toks, method="ntk-mixed", factor=K_NAIVE, logn=True)
    assert np.array_equal(auto, explicit)
    assert np.abs(auto - naive).max() > 1e-3
    # chosen at load time with k left out (and static): auto as well, resolved by the library
    chosen, info_c = _logits(m.path, toks, method="ntk-mixed", logn=True, dynamic=False)
    assert info_c.factor == K_LIB and info_c.auto and np.array_equal(chosen, auto)

    r = CliRunner().invoke(main, ["generate", str(m.path), "-p", PROMPT, "-n", "1", "-c", str(N_CTX), "-t", "2"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    line = [x for x in r.stderr.splitlines() if x.startswith("[ggufrope] rope:")]
    assert line == [f"[ggufrope] rope: ntk-mixed, b = 0.625 (default), k = 4 (auto, resolved by llama.cpp at "
                    f"n_ctx_seq 256, L 64), log-n on (from the file); llama.cpp patched {runtime.library_version()}"]
    assert "3.125" not in r.stderr


def test_auto_k_without_the_dynamic_key_is_dynamic(tmp_path, patched_lib) -> None:
    """The same file without ``{arch}.rope.ntk.dynamic`` (ntk-mixed, no factor): the library's
    default is dynamic k, not the static 4: k = 1 after creation and at 64 positions, 2 at 65
    (L 64); so is the same choice made at load time without a k and without dynamic=."""
    from ggufrope import runtime

    _require_factor_symbol()
    m = _tiny(tmp_path, "auto.gguf", **{"rope.ntk.method": "ntk-mixed", "attention.logn_scaling": True})
    for kw in ({}, {"method": "ntk-mixed", "logn": True}):
        llm = runtime.load(m.path, n_ctx=N_CTX, n_threads=2, n_threads_batch=2, **kw)
        info = llm.ggufrope
        assert runtime.dynamic_in_use(llm) is True and info.dynamic is True, kw
        assert info.factor == 1.0 and not info.auto and runtime.factor_in_use(llm) == 1.0
        llm.eval(_tokens(64))
        assert runtime.factor_in_use(llm) == 1.0
        llm.eval(_tokens(1, seed=1))
        assert runtime.factor_in_use(llm) == 2.0
        del llm

    r = CliRunner().invoke(main, ["generate", str(m.path), "-p", PROMPT, "-n", "1", "-c", str(N_CTX), "-t", "2"],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    line = [x for x in r.stderr.splitlines() if x.startswith("[ggufrope] rope:")]
    assert line == ["[ggufrope] rope: ntk-mixed, b = 0.625 (default), k dynamic: 1 within L, then powers of 2 >= n/L, "
                    f"KV cache re-rotated (k now 1, L 64), log-n on (from the file); llama.cpp patched "
                    f"{runtime.library_version()}"]


def test_logn_on_the_command_line_keeps_the_files_k_and_table(tmp_path, patched_lib) -> None:
    """--logn given alone keeps the file's method, k (auto stays the library's static auto, the
    file saying dynamic false) and b: the same logits as a file that says log-n itself."""
    _require_factor_symbol()
    plain = _tiny(tmp_path, "plain.gguf", **{"rope.ntk.method": "ntk-mixed", "rope.ntk.exponent": 0.5,
                                             "rope.ntk.dynamic": False})
    with_logn = _tiny(tmp_path, "logn.gguf", **{"rope.ntk.method": "ntk-mixed", "rope.ntk.exponent": 0.5,
                                                "attention.logn_scaling": True, "rope.ntk.dynamic": False})
    toks = _tokens(seed=1)
    a, ia = _logits(plain.path, toks, logn=True)
    b, ib = _logits(with_logn.path, toks)
    assert ia.factor == ib.factor == K_LIB and ia.exponent == ib.exponent == 0.5
    assert ia.logn and ib.logn
    assert np.array_equal(a, b)
    off, _ = _logits(plain.path, toks)
    assert np.abs(a[TINY_L + 1:] - off[TINY_L + 1:]).max() > 1e-4  # log-n did reach the library

    r = CliRunner().invoke(main, ["generate", str(plain.path), "-p", PROMPT, "-n", "1", "-c", str(N_CTX), "--logn",
                                  "-t", "2"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    assert "[ggufrope] rope: ntk-mixed, b = 0.5, k = 4 (auto, resolved by llama.cpp at n_ctx_seq 256, L 64), " \
           "log-n on (from the file, log-n chosen at load time)" in r.stderr


def test_logn_on_the_command_line_keeps_the_files_dynamic_default(tmp_path, patched_lib) -> None:
    """The same files without the dynamic key (the library's default: dynamic k): --logn given
    alone keeps dynamic k (k = 1 at creation), the same logits as the file that says log-n itself."""
    _require_factor_symbol()
    plain = _tiny(tmp_path, "plain.gguf", **{"rope.ntk.method": "ntk-mixed", "rope.ntk.exponent": 0.5})
    with_logn = _tiny(tmp_path, "logn.gguf", **{"rope.ntk.method": "ntk-mixed", "rope.ntk.exponent": 0.5,
                                                "attention.logn_scaling": True})
    toks = _tokens(seed=1)
    a, ia = _logits(plain.path, toks, logn=True)
    b, ib = _logits(with_logn.path, toks)
    assert ia.dynamic and ib.dynamic and ia.factor == ib.factor == 1.0 and ia.exponent == ib.exponent == 0.5
    assert ia.logn and ib.logn
    assert np.array_equal(a, b)


def test_auto_k_with_two_sequences(tmp_path, patched_lib) -> None:
    """Low-level context with n_seq_max = 2 at n_ctx 512: each sequence sees 256 tokens, so the
    library's static automatic k (dynamic false) is 256 / 64 = 4 (8 with one sequence); without
    the dynamic key both contexts run dynamic k, k = 1 when created."""
    import llama_cpp

    from ggufrope import runtime

    _require_factor_symbol()
    m = _tiny(tmp_path, "seq.gguf", **{"rope.ntk.method": "ntk", "rope.ntk.dynamic": False})
    model = llama_cpp.llama_model_load_from_file(str(m.path).encode(), llama_cpp.llama_model_default_params())
    assert model
    try:
        for n_seq, want in [(2, 4.0), (1, 8.0)]:
            cp = llama_cpp.llama_context_default_params()
            cp.n_ctx, cp.n_seq_max = 512, n_seq
            ctx = llama_cpp.llama_init_from_model(model, cp)
            assert ctx
            try:
                assert llama_cpp.llama_n_ctx_seq(ctx) == 512 // n_seq
                assert runtime.factor_in_use(ctx) == want
                assert runtime.dynamic_in_use(ctx) is False
            finally:
                llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)
    d = _tiny(tmp_path, "seq-dyn.gguf", **{"rope.ntk.method": "ntk"})
    model = llama_cpp.llama_model_load_from_file(str(d.path).encode(), llama_cpp.llama_model_default_params())
    assert model
    try:
        for n_seq in (2, 1):
            cp = llama_cpp.llama_context_default_params()
            cp.n_ctx, cp.n_seq_max = 512, n_seq
            ctx = llama_cpp.llama_init_from_model(model, cp)
            assert ctx
            try:
                assert runtime.dynamic_in_use(ctx) is True and runtime.factor_in_use(ctx) == 1.0
            finally:
                llama_cpp.llama_free(ctx)
    finally:
        llama_cpp.llama_model_free(model)


def test_k_of_stock_methods_is_what_was_passed(tmp_path, patched_lib) -> None:
    """linear/yarn: Python chooses k (max(1, n_ctx / L) = 3.125 here) and passes
    rope_freq_scale = 1/k; what is printed is that k; a none/log-n context applies no
    NTK-family table (k None)."""
    from ggufrope import runtime

    _require_factor_symbol()
    m = _tiny(tmp_path, "s.gguf")
    for method in ("linear", "yarn"):
        llm = runtime.load(m.path, method=method, n_ctx=N_CTX, n_threads=2)
        assert llm.ggufrope.factor == K_NAIVE
        assert math.isclose(1.0 / llm.context_params.rope_freq_scale, K_NAIVE, rel_tol=1e-6)
        assert f"{method}, k = 3.125 (auto: n_ctx 200 / L 64)" in runtime.describe(llm)
        assert runtime.factor_in_use(llm) is None  # not an NTK-family table
        del llm
    llm = runtime.load(m.path, method="none", logn=True, n_ctx=N_CTX, n_threads=2)
    assert llm.ggufrope.factor is None and runtime.factor_in_use(llm) is None
    assert runtime.describe(llm).startswith("rope: none, log-n on (chosen at load time)")


def test_ntk_mixed_file_without_exponent_loads_and_describes(tmp_path, patched_lib) -> None:
    """The file the library accepts with b = 0.625: runtime.load and describe work (no
    TypeError), and the default b said is the library's (same logits as b = 0.625 written)."""
    from ggufrope import runtime

    _require_factor_symbol()
    bare = _tiny(tmp_path, "bare.gguf", **{"rope.ntk.method": "ntk-mixed", "rope.ntk.factor": 2.0})
    full = _tiny(tmp_path, "full.gguf", **{"rope.ntk.method": "ntk-mixed", "rope.ntk.factor": 2.0,
                                           "rope.ntk.exponent": 0.625})
    toks = _tokens(seed=2)
    a, ia = _logits(bare.path, toks)
    b, _ = _logits(full.path, toks)
    assert np.array_equal(a, b)
    assert ia.exponent == 0.625 and ia.exponent_default and ia.factor == 2.0 and not ia.auto
    llm = runtime.load(bare.path, n_ctx=N_CTX, n_threads=2)
    assert runtime.describe(llm).startswith("rope: ntk-mixed, b = 0.625 (default), k = 2, log-n off (from the file)")
    r = CliRunner().invoke(main, ["generate", str(bare.path), "-p", PROMPT, "-n", "1", "-c", str(N_CTX), "-t", "2"],
                           catch_exceptions=False)
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output


def test_describe_says_what_became_of_a_stock_scaling(tmp_path, patched_lib) -> None:
    """A file with stock yarn: its NTK-family method replaces it; --method none switches it off;
    the file's own method none (log-n alone) keeps it, with --logn given or not."""
    from gguf import GGUFValueType as GVT

    from ggufrope import runtime

    _require_factor_symbol()
    stock = {"rope.scaling.type": "yarn", "rope.scaling.factor": 2.0,
             "rope.scaling.original_context_length": (32, GVT.UINT32)}
    m = _tiny(tmp_path, "y.gguf", **stock, **{"rope.ntk.method": "ntk", "rope.ntk.dynamic": False})
    llm = runtime.load(m.path, n_ctx=N_CTX, n_threads=2)
    assert llm.ggufrope.factor == 256 / 32  # L = original_context_length
    assert "; replaces the file's stock yarn scaling;" in runtime.describe(llm)
    del llm
    # without the dynamic key: dynamic k (the default) with L = original_context_length = 32
    d = _tiny(tmp_path, "yd.gguf", **stock, **{"rope.ntk.method": "ntk"})
    llm = runtime.load(d.path, n_ctx=N_CTX, n_threads=2)
    assert llm.ggufrope.dynamic and llm.ggufrope.factor == 1.0
    assert "(k now 1, L 32), log-n off (from the file); replaces the file's stock yarn scaling;" in runtime.describe(llm)
    llm.eval(_tokens(33))
    assert runtime.factor_in_use(llm) == 2.0
    del llm
    n = _tiny(tmp_path, "n.gguf", **stock, **{"rope.ntk.method": "none"})
    for kw, want in [({}, "stays in effect"), ({"logn": True}, "stays in effect"),
                     ({"method": "none"}, "is switched off"), ({"method": "ntk"}, "replaces the file's stock yarn")]:
        llm = runtime.load(n.path, n_ctx=N_CTX, n_threads=2, **kw)
        assert want in runtime.describe(llm), (kw, runtime.describe(llm))
        del llm


@pytest.mark.parametrize("args, msg", [
    (["-k", "2"], "give the method too"),
    (["--b", "0.5"], "give the method too"),
    (["-m", "none", "-k", "2"], "a factor k has no effect with method 'none'"),
    (["-m", "ntk", "--b", "0.5"], "the exponent b applies to ntk-mixed only, not to 'ntk'"),
    (["-m", "mixed", "--b", "1.5"], "exponent b must be in (0, 1]"),
    (["-m", "ntk", "-k", "0"], "factor k must be finite and >= 1"),
])
def test_generate_bad_choices_are_one_line_exit_2(tmp_path, args, msg) -> None:
    m = _tiny(tmp_path, "g.gguf")
    r = CliRunner().invoke(main, ["generate", str(m.path), "-p", PROMPT, "-n", "1", "-c", "64", *args])
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ggufrope: error: ") and msg in r.stderr
