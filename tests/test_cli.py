"""The ``ggufrope`` command line: set / show / reset through click, and once for real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import gguf
import pytest
from click.testing import CliRunner

from ggufrope import gguf_file as G
from ggufrope.cli import main
from ggufrope.errors import GGUFRopeError


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def fields(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and k != G.KEY_RESERVED}


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
    out = tmp_path / "long.gguf"
    r = run("set", small_gguf, "--method", "mixed", "--b", "0.625", "--logn", "-o", out)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"wrote {out}: ntk-mixed, b = 0.625, k = auto (max(1, n_ctx/8192)), log-n on")

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
    assert text.rstrip().endswith("method:        ntk-mixed, b = 0.625, k = auto (max(1, n_ctx/8192)), log-n on")

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
        (["set", "{bert}", "-m", "ntk", "-o", "{out}"], "architecture 'bert' has no RoPE"),
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
        "{bert}": make_gguf("bert.gguf", arch="bert", rope=False),
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

    from test_gguf_file import LLAMA_KVS, VT, kv, kv_str, kv_u32, pstr, raw_gguf

    def put(name: str, data: bytes) -> Path:
        p = tmp_path / name
        p.write_bytes(data)
        return p

    def pad(b: bytes) -> bytes:
        return b + bytes(-len(b) % 32)

    good = small_gguf.read_bytes()
    h = G.read_header(small_gguf)
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
