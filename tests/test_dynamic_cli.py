"""Dynamic k (issue 13) on the Python side: the keys, ``set`` / ``show`` / ``reset``, the refusals,
the load-time choice (kv overrides), the evaluation's cache keys, and, with a library that has
dynamic k, what a context reports.

Expected values are written by hand from the contract:

- ``{arch}.rope.ntk.dynamic`` (BOOL): true runs dynamic k; false static; absent, the library's
  default (``methods.DYNAMIC_DEFAULT``, True): dynamic for an NTK-family method (ntk, ntk-fixed,
  ntk-mixed) whose factor is absent or 0, static for an explicit factor k >= 1 or method none;
- ``{arch}.rope.ntk.dynamic_ratio`` (FLOAT32, r > 1, absent 2): k = 1 while n <= L, then the
  smallest r^e with r^e * L >= n, n = 1 + the largest cached position. For L = 64, r = 2:
  n = 64 -> 1, 65 -> 2, 128 -> 2, 129 -> 4, 200 -> 4; r = 1.5: n = 96 -> 1.5, n = 97 -> 2.25;
- refused (by the library when it loads, by ggufrope up front): dynamic with method none,
  dynamic with a factor other than 0, a ratio <= 1 or not finite.

The tests that need a library exporting ``llama_ggufrope_dynamic`` (the ``dyn_lib`` fixture)
skip on an older library, and only then.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner

from ggufrope.evaluation import cache as EC, decoder as ED, grid as EG, report as ER
from ggufrope import gguf_writer as GW, rope_metadata as RM
from ggufrope import keys as K
from ggufrope import methods as M
from ggufrope import runtime as R
from ggufrope.cli import main
from ggufrope.errors import GGUFRopeError
from ggufrope.gguf_constants import GGUFValueType

ROOT = Path(__file__).resolve().parents[1]
DYN_WORDS = "k dynamic: 1 within L, then powers of 2 >= n/L, KV cache re-rotated"
DYN_WORDS_15 = "k dynamic: 1 within L, then powers of 1.5 >= n/L, KV cache re-rotated"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def fields(path: Path) -> dict:
    r = gguf.GGUFReader(str(path))
    return {k: (f.types[0], f.contents()) for k, f in r.fields.items()
            if not k.startswith("GGUF.") and k != GW.KEY_RESERVED and (".rope.ntk." in k or "logn" in k)}


def sha(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# --------------------------------------------------------------------------- keys and the default


def test_keys_table() -> None:
    assert K.KEY_DYNAMIC == "{arch}.rope.ntk.dynamic"
    assert K.KEY_DYNAMIC_RATIO == "{arch}.rope.ntk.dynamic_ratio"
    assert K.KEY_TYPES[K.KEY_DYNAMIC] == GGUFValueType.BOOL
    assert K.KEY_TYPES[K.KEY_DYNAMIC_RATIO] == GGUFValueType.FLOAT32
    assert set(K.ggufrope_keys("llama")) == {
        "llama.rope.ntk.method", "llama.rope.ntk.factor", "llama.rope.ntk.exponent", "llama.rope.ntk.dynamic",
        "llama.rope.ntk.dynamic_ratio", "llama.attention.logn_scaling",
    }
    for k in ("rope.ntk.dynamic``", "rope.ntk.dynamic_ratio``"):
        assert k in K.__doc__


def test_the_default_is_written_in_one_place() -> None:
    """DYNAMIC_DEFAULT is True (dynamic where it can run when the key is absent), and no other
    module of the package assigns it or spells a default of its own."""
    assert M.DYNAMIC_DEFAULT is True
    assert M.DEFAULT_DYNAMIC_RATIO == 2.0
    hits = []
    for p in sorted((ROOT / "ggufrope").glob("*.py")):
        for line in p.read_text().splitlines():
            if re.match(r"\s*DYNAMIC_DEFAULT\s*[:=]", line):
                hits.append(p.name)
    assert hits == ["methods.py"]
    # the README says what the constant says (a flip must update it)
    readme = " ".join((ROOT / "README.md").read_text().split())
    assert f"`ggufrope.methods.DYNAMIC_DEFAULT` says (currently `{M.DYNAMIC_DEFAULT}`: " \
           f"{'dynamic' if M.DYNAMIC_DEFAULT else 'static'})" in readme


def test_flipping_the_default_is_followed_everywhere(small_gguf, tmp_path, monkeypatch) -> None:
    """With DYNAMIC_DEFAULT True (the default), a file without the key runs dynamic k where it
    can (NTK family, automatic k) and static where it cannot (explicit k, method none); flipped
    to False, the same file is static. show, the registry and the load-time choice all follow
    the one constant."""
    auto = tmp_path / "auto.gguf"
    RM.write_rope_metadata(small_gguf, auto, method="ntk-mixed")
    explicit = tmp_path / "k2.gguf"
    RM.write_rope_metadata(small_gguf, explicit, method="ntk", factor=2.0)
    none = tmp_path / "none.gguf"
    RM.write_rope_metadata(small_gguf, none, method="none", logn=True)
    static = tmp_path / "static.gguf"
    RM.write_rope_metadata(small_gguf, static, method="ntk-mixed", dynamic=False)

    meta = RM.read_rope_metadata(auto)
    assert meta["dynamic"] is True and meta["dynamic_ratio"] == 2.0
    assert meta["description"] == f"ntk-mixed, b = 0.625, {DYN_WORDS}, log-n off"
    assert RM.read_rope_metadata(explicit)["dynamic"] is False
    assert RM.read_rope_metadata(none)["dynamic"] is False
    assert RM.read_rope_metadata(static)["dynamic"] is False  # an explicit false stays false
    assert R.RopeChoice("ntk-mixed").runs_dynamic is True
    assert R.RopeChoice("ntk-mixed", 2.0).runs_dynamic is False
    assert R.RopeChoice("linear").runs_dynamic is False
    kv = R.llama_kwargs(R.RopeChoice("ntk"), "llama", 16384, 8192)["kv_overrides"]
    assert kv["llama.rope.ntk.dynamic"] is True and kv["llama.rope.ntk.factor"] == 0.0
    # the evaluation always passes an explicit choice: static unless --dynamic
    assert ED.Setting("ntk-mixed").dynamic is False and ED.Setting("ntk-mixed").resolved_factor(16384, 8192) == 2.0

    monkeypatch.setattr(M, "DYNAMIC_DEFAULT", False)
    meta = RM.read_rope_metadata(auto)
    assert meta["dynamic"] is False and meta["dynamic_ratio"] is None
    assert meta["description"] == "ntk-mixed, b = 0.625, k = auto (max(1, n_ctx_seq/8192)), log-n off"
    assert RM.read_rope_metadata(explicit)["dynamic"] is False
    assert RM.read_rope_metadata(static)["dynamic"] is False
    assert R.RopeChoice("ntk-mixed").runs_dynamic is False
    assert R.RopeChoice("ntk-mixed", dynamic=True).runs_dynamic is True  # an explicit true stays true
    kv = R.llama_kwargs(R.RopeChoice("ntk"), "llama", 16384, 8192)["kv_overrides"]
    assert kv["llama.rope.ntk.dynamic"] is False and kv["llama.rope.ntk.factor"] == 0.0



# --------------------------------------------------------------------------- set / show / reset


def test_set_show_reset_round_trip(small_gguf, tmp_path) -> None:
    original = sha(small_gguf)
    out = tmp_path / "dyn.gguf"
    r = run("set", small_gguf, "--method", "mixed", "--dynamic", "--logn", "-o", out)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"wrote {out}: ntk-mixed, b = 0.625, {DYN_WORDS}, log-n on\n")
    assert fields(out) == {
        "llama.rope.ntk.method": (gguf.GGUFValueType.STRING, "ntk-mixed"),
        "llama.rope.ntk.exponent": (gguf.GGUFValueType.FLOAT32, 0.625),
        "llama.rope.ntk.dynamic": (gguf.GGUFValueType.BOOL, True),
        "llama.attention.logn_scaling": (gguf.GGUFValueType.BOOL, True),
    }

    r = run("show", out)
    assert r.exit_code == 0
    assert "  llama.rope.ntk.dynamic        true\n" in r.stdout
    assert r.stdout.rstrip().endswith(f"method:        ntk-mixed, b = 0.625, {DYN_WORDS}, log-n on")
    meta = json.loads(run("show", "--json", out).stdout)
    assert meta["dynamic"] is True and meta["dynamic_ratio"] == 2.0 and meta["factor"] is None
    assert meta["ggufrope_keys"] == {"llama.rope.ntk.method": "ntk-mixed", "llama.rope.ntk.exponent": 0.625,
                                     "llama.rope.ntk.dynamic": True, "llama.attention.logn_scaling": True}

    # another ratio, in place: the header only
    r = run("set", out, "-m", "ntk", "--dynamic", "--dynamic-ratio", "1.5", "--no-logn", "--in-place")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"updated {out} in place: ntk, {DYN_WORDS_15}, log-n off\n")
    assert "no tensor data copied" in r.stdout
    meta = json.loads(run("show", "--json", out).stdout)
    assert meta["ggufrope_keys"] == {"llama.rope.ntk.method": "ntk", "llama.rope.ntk.dynamic": True,
                                     "llama.rope.ntk.dynamic_ratio": 1.5, "llama.attention.logn_scaling": False}
    assert meta["dynamic_ratio"] == 1.5 and meta["description"] == f"ntk, {DYN_WORDS_15}, log-n off"
    assert "  llama.rope.ntk.dynamic_ratio  1.5\n" in run("show", out).stdout
    run("set", out, "-m", "ntk", "--dynamic", "--dynamic-ratio", "1.1", "--in-place")  # 1.10000002 as float32
    meta = json.loads(run("show", "--json", out).stdout)
    assert meta["dynamic_ratio"] == 1.1 and meta["ggufrope_keys"]["llama.rope.ntk.dynamic_ratio"] == 1.1

    # --static writes the key false; with it an explicit k is fine
    r = run("set", out, "-m", "ntk", "-k", "2", "--static", "--in-place")
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"updated {out} in place: ntk, k = 2.0, log-n off\n")
    assert json.loads(run("show", "--json", out).stdout)["ggufrope_keys"] == {
        "llama.rope.ntk.method": "ntk", "llama.rope.ntk.factor": 2.0, "llama.rope.ntk.dynamic": False,
        "llama.attention.logn_scaling": False}

    # neither: the key is not written (a dynamic key of an earlier set is removed), and the
    # library's default for ntk without k is dynamic k
    run("set", out, "-m", "ntk", "--dynamic", "--in-place")
    r = run("set", out, "-m", "ntk", "--in-place")
    assert r.exit_code == 0 and r.stdout.startswith(f"updated {out} in place: ntk, {DYN_WORDS}, log-n off\n")
    assert json.loads(run("show", "--json", out).stdout)["ggufrope_keys"] == {
        "llama.rope.ntk.method": "ntk", "llama.attention.logn_scaling": False}
    # --static without k: the key written false, the static automatic k
    r = run("set", out, "-m", "ntk", "--static", "--in-place")
    assert r.exit_code == 0 and r.stdout.startswith(f"updated {out} in place: ntk, k = auto (max(1, n_ctx_seq/8192)), "
                                                    "log-n off\n")
    assert json.loads(run("show", "--json", out).stdout)["ggufrope_keys"] == {
        "llama.rope.ntk.method": "ntk", "llama.rope.ntk.dynamic": False, "llama.attention.logn_scaling": False}

    # reset removes both keys and gives back the original bytes
    run("set", out, "-m", "mixed", "--dynamic", "--dynamic-ratio", "3", "--in-place")
    r = run("reset", out, "--in-place")
    assert r.exit_code == 0, r.output
    for k in ("llama.rope.ntk.dynamic", "llama.rope.ntk.dynamic_ratio"):
        assert k in r.stdout
    assert sha(out) == original


def test_set_without_factor_or_dynamic_is_dynamic_by_default(small_gguf, tmp_path) -> None:
    """The library's default (the key absent): ``set --method mixed`` (no --factor, no
    --dynamic) writes no dynamic key and show says dynamic k; ``--factor 2`` is static k = 2;
    ``--static`` writes the key false and is the static automatic k (L = 8192 here)."""
    out = tmp_path / "mixed.gguf"
    r = run("set", small_gguf, "--method", "mixed", "-o", out)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"wrote {out}: ntk-mixed, b = 0.625, {DYN_WORDS}, log-n off\n")
    assert fields(out) == {
        "llama.rope.ntk.method": (gguf.GGUFValueType.STRING, "ntk-mixed"),
        "llama.rope.ntk.exponent": (gguf.GGUFValueType.FLOAT32, 0.625),
        "llama.attention.logn_scaling": (gguf.GGUFValueType.BOOL, False),
    }
    text = run("show", out).stdout
    assert "llama.rope.ntk.dynamic" not in text
    assert text.rstrip().endswith(f"method:        ntk-mixed, b = 0.625, {DYN_WORDS}, log-n off")
    meta = json.loads(run("show", "--json", out).stdout)
    assert (meta["dynamic"], meta["dynamic_ratio"], meta["factor"]) == (True, 2.0, None)

    k2 = tmp_path / "k2.gguf"
    r = run("set", small_gguf, "--method", "mixed", "--factor", "2", "-o", k2)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"wrote {k2}: ntk-mixed, b = 0.625, k = 2.0, log-n off\n")
    assert "llama.rope.ntk.dynamic" not in run("show", k2).stdout
    meta = json.loads(run("show", "--json", k2).stdout)
    assert (meta["dynamic"], meta["dynamic_ratio"], meta["factor"]) == (False, None, 2.0)

    st = tmp_path / "static.gguf"
    r = run("set", small_gguf, "--method", "mixed", "--static", "-o", st)
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith(f"wrote {st}: ntk-mixed, b = 0.625, k = auto (max(1, n_ctx_seq/8192)), log-n off\n")
    text = run("show", st).stdout
    assert "  llama.rope.ntk.dynamic        false\n" in text
    assert text.rstrip().endswith("method:        ntk-mixed, b = 0.625, k = auto (max(1, n_ctx_seq/8192)), log-n off")
    meta = json.loads(run("show", "--json", st).stdout)
    assert (meta["dynamic"], meta["dynamic_ratio"], meta["factor"]) == (False, None, None)

    # method none (log-n alone) has no dynamic k: static, no key
    nl = tmp_path / "none.gguf"
    assert run("set", small_gguf, "--method", "none", "--logn", "-o", nl).exit_code == 0
    meta = json.loads(run("show", "--json", nl).stdout)
    assert meta["dynamic"] is False and meta["description"] == "none, log-n on"


def test_set_help_names_the_options() -> None:
    r = run("set", "--help")
    assert r.exit_code == 0
    text = " ".join(r.output.split())  # click wraps the help
    for opt in ("--dynamic / --static", "--dynamic-ratio R", "(The library's default: dynamic.)"):
        assert opt in text
    for cmd in ("generate", "chat"):
        out = run(cmd, "--help").output
        assert "--dynamic / --static" in out and "--dynamic-ratio R" in out
    for cmd in ("ppl", "passkey"):
        assert "--dynamic / --static" in run("eval", cmd, "--help").output
    assert "--dynamic TEXT" in run("eval", "compare", "--help").output


REFUSED_SET = [
    (["-m", "mixed", "--dynamic", "--factor", "2"],
     "dynamic k chooses k itself (1 within L, then by its schedule): leave the factor k out (got 2.0)"),
    (["-m", "ntk", "--dynamic", "-k", "0"], "leave the factor k out (got 0.0)"),
    (["-m", "none", "--dynamic"], "dynamic k needs an NTK-family method (ntk, ntk-fixed, ntk-mixed), not 'none'"),
    (["-m", "none", "--dynamic", "--logn"], "not 'none'"),
    (["-m", "ntk", "--factor", "2", "--dynamic-ratio", "1.5"], "the dynamic ratio r applies to dynamic k only"),
    (["-m", "ntk", "--static", "--dynamic-ratio", "1.5"], "the dynamic ratio r applies to dynamic k only"),
    (["-m", "ntk", "--dynamic", "--dynamic-ratio", "1"], "dynamic ratio r must be finite and > 1, got 1.0"),
    (["-m", "ntk", "--dynamic", "--dynamic-ratio", "0.5"], "dynamic ratio r must be finite and > 1"),
    (["-m", "ntk", "--dynamic", "--dynamic-ratio", "nan"], "dynamic ratio r must be finite and > 1"),
    (["-m", "ntk", "--dynamic", "--dynamic-ratio", "inf"], "dynamic ratio r must be finite and > 1"),
    (["-m", "ntk", "--dynamic", "--dynamic-ratio", "1.00000001"], "(1.0 as float32)"),  # > 1 as a double only
    (["-m", "ntk", "--dynamic", "--dynamic-ratio", "1e39"], "as float32"),  # inf as float32
    (["-m", "linear", "--dynamic"], "use llama.cpp's --rope-scaling linear"),
]


@pytest.mark.parametrize("args, msg", REFUSED_SET)
@pytest.mark.parametrize("where", ["-o", "--in-place"])
def test_set_refusals_are_one_line_and_touch_nothing(small_gguf, tmp_path, args, msg, where) -> None:
    before = sha(small_gguf)
    out = tmp_path / "out.gguf"
    dest = ["-o", out] if where == "-o" else ["--in-place"]
    r = run("set", small_gguf, *args, *dest)
    assert r.exit_code == 2 and r.stdout == "", r.output
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("ggufrope: error: ") and msg in r.stderr, r.stderr
    assert sha(small_gguf) == before and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([small_gguf.name])  # no temporary file either


def _with_keys(src: Path, dst: Path, **values) -> Path:
    """``src`` with ggufrope keys written as given (typed by keys.KEY_TYPES), bypassing set's checks."""
    tmpl = {"method": K.KEY_METHOD, "factor": K.KEY_FACTOR, "exponent": K.KEY_EXPONENT, "dynamic": K.KEY_DYNAMIC,
            "ratio": K.KEY_DYNAMIC_RATIO, "logn": K.KEY_LOGN}
    GW.set_keys(src, dst, {K.key(tmpl[k], "llama"): (K.KEY_TYPES[tmpl[k]], v) for k, v in values.items()})
    return dst


@pytest.mark.parametrize("values, msg", [
    ({"method": "none", "dynamic": True}, "dynamic k needs an NTK-family method (ntk, ntk-fixed, ntk-mixed), not 'none'"),
    ({"method": "ntk-mixed", "factor": 2.0, "dynamic": True},
     "dynamic k chooses k itself (1 within L, then by its schedule): the factor k must be absent or 0 (got 2.0)"),
    ({"method": "ntk", "dynamic": True, "ratio": 1.0}, "dynamic ratio r must be finite and > 1, got 1.0"),
    ({"method": "ntk", "dynamic": True, "ratio": float("nan")}, "dynamic ratio r must be finite and > 1"),
    ({"method": "ntk", "dynamic": False, "ratio": 0.5}, "dynamic ratio r must be finite and > 1, got 0.5"),
    ({"method": "ntk", "ratio": float("-inf")}, "dynamic ratio r must be finite and > 1"),
])
def test_files_the_library_refuses_are_refused_by_show_and_load(small_gguf, tmp_path, values, msg) -> None:
    bad = _with_keys(small_gguf, tmp_path / "bad.gguf", **values)
    before = sha(bad)
    r = CliRunner().invoke(main, ["show", str(bad)])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "invalid ggufrope metadata: " in r.stderr and msg in r.stderr, r.stderr
    with pytest.raises(GGUFRopeError, match=re.escape(msg)):
        R.load(bad)
    assert sha(bad) == before


def test_files_the_library_loads(small_gguf, tmp_path) -> None:
    ok = _with_keys(small_gguf, tmp_path / "ok.gguf", method="ntk-fixed", factor=0.0, dynamic=True, ratio=4.0)
    meta = RM.read_rope_metadata(ok)
    assert (meta["method"], meta["factor"], meta["dynamic"], meta["dynamic_ratio"]) == ("ntk-fixed", None, True, 4.0)
    assert meta["description"] == "ntk-fixed, k dynamic: 1 within L, then powers of 4 >= n/L, KV cache re-rotated, log-n off"
    # a ratio beside static k is checked but has no effect
    st = _with_keys(small_gguf, tmp_path / "st.gguf", method="ntk", factor=2.0, dynamic=False, ratio=3.0)
    meta = RM.read_rope_metadata(st)
    assert (meta["dynamic"], meta["dynamic_ratio"], meta["description"]) == (False, None, "ntk, k = 2.0, log-n off")
    # the wrong type is an error of its own
    GW.set_keys(small_gguf, tmp_path / "u8.gguf", {"llama.rope.ntk.method": "ntk",
                                                  "llama.rope.ntk.dynamic": (GGUFValueType.UINT8, 1)})
    with pytest.raises(GGUFRopeError, match="key 'llama.rope.ntk.dynamic' has type UINT8, expected BOOL"):
        RM.read_rope_metadata(tmp_path / "u8.gguf")


def test_stock_scaling_is_replaced_by_dynamic_k_too(make_gguf, tmp_path) -> None:
    src = make_gguf("yarn.gguf", orig_ctx=4096, scaling=("yarn", 4.0))
    out = tmp_path / "o.gguf"
    r = run("set", src, "-m", "ntk", "--dynamic", "-o", out)
    assert r.exit_code == 0, r.output
    assert RM.read_rope_metadata(out)["description"] == \
        f"ntk, {DYN_WORDS}, log-n off; replaces the file's stock llama.cpp rope scaling 'yarn' (factor 4.0)"


# --------------------------------------------------------------------------- load-time choice


class _Captured(Exception):
    pass


@pytest.fixture
def captured(monkeypatch):
    """llama_cpp.Llama replaced by a recorder that stops the load; the library treated as one
    with dynamic k, so that the kv overrides built for it can be seen on any build."""
    import llama_cpp

    seen: dict = {}

    def fake(**kw):
        seen.clear()
        seen.update(kw)
        raise _Captured

    monkeypatch.setattr(llama_cpp, "Llama", fake)
    monkeypatch.setattr(R, "has_dynamic", lambda: True)
    monkeypatch.setattr(R, "is_patched", lambda: True)

    def load(path, **kw):
        with pytest.raises(_Captured):
            R.load(path, **kw)
        return seen

    return load


def test_load_dynamic_builds_the_overrides(small_gguf, tmp_path, captured) -> None:
    kv = captured(small_gguf, method="mixed", dynamic=True, logn=True, n_ctx=16384)["kv_overrides"]
    assert kv == {"llama.rope.ntk.method": "ntk-mixed", "llama.attention.logn_scaling": True,
                  "llama.rope.ntk.dynamic": True, "llama.rope.ntk.factor": 0.0, "llama.rope.ntk.exponent": 0.625,
                  "llama.rope.ntk.dynamic_ratio": 2.0}
    kv = captured(small_gguf, method="ntk-fixed", dynamic=True, dynamic_ratio=1.5)["kv_overrides"]
    assert kv == {"llama.rope.ntk.method": "ntk-fixed", "llama.attention.logn_scaling": False,
                  "llama.rope.ntk.dynamic": True, "llama.rope.ntk.factor": 0.0, "llama.rope.ntk.exponent": 0.625,
                  "llama.rope.ntk.dynamic_ratio": 1.5}
    # static, chosen at load time: the dynamic key is overridden too (false), k as given
    kv = captured(small_gguf, method="ntk", factor=2.0)["kv_overrides"]
    assert kv == {"llama.rope.ntk.method": "ntk", "llama.attention.logn_scaling": False,
                  "llama.rope.ntk.dynamic": False, "llama.rope.ntk.factor": 2.0, "llama.rope.ntk.exponent": 0.625}
    kv = captured(small_gguf, method="none", logn=True, dynamic=False)["kv_overrides"]
    assert kv == {"llama.rope.ntk.method": "none", "llama.attention.logn_scaling": True, "llama.rope.ntk.dynamic": False}


def test_load_dynamic_with_the_files_method(small_gguf, tmp_path, captured) -> None:
    # --dynamic alone: the file's method and b stay, its k gives way to dynamic k
    k2 = tmp_path / "k2.gguf"
    RM.write_rope_metadata(small_gguf, k2, method="ntk-mixed", factor=2.0, exponent=0.5, logn=True)
    kv = captured(k2, dynamic=True)["kv_overrides"]
    assert kv == {"llama.rope.ntk.method": "ntk-mixed", "llama.attention.logn_scaling": True,
                  "llama.rope.ntk.dynamic": True, "llama.rope.ntk.factor": 0.0, "llama.rope.ntk.exponent": 0.5,
                  "llama.rope.ntk.dynamic_ratio": 2.0}
    # a dynamic file: its ratio goes with it when only log-n is chosen
    d = tmp_path / "d.gguf"
    RM.write_rope_metadata(small_gguf, d, method="ntk", dynamic=True, dynamic_ratio=3.0)
    kv = captured(d, logn=True)["kv_overrides"]
    assert kv == {"llama.rope.ntk.method": "ntk", "llama.attention.logn_scaling": True,
                  "llama.rope.ntk.dynamic": True, "llama.rope.ntk.factor": 0.0, "llama.rope.ntk.exponent": 0.625,
                  "llama.rope.ntk.dynamic_ratio": 3.0}
    # --static alone on it: static auto k
    kv = captured(d, dynamic=False)["kv_overrides"]
    assert kv == {"llama.rope.ntk.method": "ntk", "llama.attention.logn_scaling": False,
                  "llama.rope.ntk.dynamic": False, "llama.rope.ntk.factor": 0.0, "llama.rope.ntk.exponent": 0.625}
    # --dynamic-ratio alone on it: still dynamic, the new ratio
    assert captured(d, dynamic_ratio=1.5)["kv_overrides"]["llama.rope.ntk.dynamic_ratio"] == 1.5
    # a method chosen at load time replaces the file's dynamic k
    kv = captured(d, method="ntk", factor=4.0)["kv_overrides"]
    assert kv["llama.rope.ntk.dynamic"] is False and kv["llama.rope.ntk.factor"] == 4.0
    # nothing chosen: the file decides, no overrides
    assert "kv_overrides" not in captured(d)


@pytest.mark.parametrize("kw, msg", [
    ({"method": "none", "dynamic": True}, "dynamic k needs an NTK-family method (ntk, ntk-fixed, ntk-mixed), not 'none'"),
    ({"method": "linear", "dynamic": True}, "not 'linear'"),
    ({"method": "ntk", "factor": 2.0, "dynamic": True}, "leave the factor k out (got 2.0)"),
    ({"method": "ntk", "factor": 2.0, "dynamic_ratio": 1.5}, "the dynamic ratio r applies to dynamic k only"),
    ({"method": "ntk", "dynamic": True, "dynamic_ratio": 1.0}, "dynamic ratio r must be finite and > 1"),
    ({"dynamic": True}, "not 'none'"),  # the file's method is none (no keys)
    ({"dynamic_ratio": 2.0}, "the dynamic ratio r applies to dynamic k only"),  # the file is static
    ({"method": "mixed", "dynamic": 1}, "dynamic must be true, false or left out, got 1"),
])
def test_load_refusals(small_gguf, captured, kw, msg) -> None:
    with pytest.raises(GGUFRopeError, match=re.escape(msg)) as ei:
        R.load(small_gguf, **kw)
    assert "\n" not in str(ei.value)


def test_an_older_library_is_refused_for_dynamic_k(small_gguf, tmp_path, monkeypatch) -> None:
    """A patch without llama_ggufrope_dynamic would ignore the key and run a static k: load
    refuses dynamic k there (chosen at load time or from the file), before loading anything."""
    import llama_cpp

    monkeypatch.setattr(R, "has_dynamic", lambda: False)
    monkeypatch.setattr(llama_cpp, "Llama", lambda **kw: pytest.fail("must not load"))
    d = tmp_path / "d.gguf"
    RM.write_rope_metadata(small_gguf, d, method="ntk", dynamic=True)
    for path, kw in ((small_gguf, {"method": "ntk", "dynamic": True}), (d, {}), (d, {"logn": True})):
        with pytest.raises(GGUFRopeError, match="needs dynamic k, which the loaded llama.cpp lacks "
                                                r"\(no llama_ggufrope_dynamic"):
            R.load(path, **kw)


def test_dynamic_in_use_needs_the_symbol(monkeypatch) -> None:
    class Lib:  # a library without the function
        pass

    monkeypatch.setattr(R, "_lib", lambda: Lib())
    with pytest.raises(GGUFRopeError, match="needs llama_ggufrope_dynamic, which the loaded llama.cpp lacks"):
        R.dynamic_in_use(None)
    assert R.has_dynamic() is False


def test_generate_refusals_are_one_line(small_gguf) -> None:
    for args, msg in ((["-m", "ntk", "-k", "2", "--dynamic"], "leave the factor k out"),
                      (["-m", "none", "--dynamic"], "not 'none'"),
                      (["--dynamic"], "not 'none'")):
        r = CliRunner().invoke(main, ["generate", str(small_gguf), "-p", "x", "-n", "1", "-c", "64", *args])
        assert r.exit_code == 2 and r.stdout == "", r.output
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("ggufrope: error: ") and msg in r.stderr


def test_in_use_line_words() -> None:
    info = R.RopeInUse("ntk-mixed", 4.0, False, 0.625, True, True, "from the file", 256, 256, 64, None, None, "0.1.0",
                       True, 2.0)
    assert info.line() == (f"rope: ntk-mixed, b = 0.625 (default), {DYN_WORDS} (k now 4, L 64), log-n on "
                           "(from the file); llama.cpp patched 0.1.0")


# --------------------------------------------------------------------------- evaluation


FP = {"sha256": "ab" * 32, "size": 1234}


def test_eval_settings_and_labels() -> None:
    st = ED.Setting.for_grid("ntk-mixed", 3.0, 0.625, True, True)
    assert st.dynamic is True and st.factor is None and st.resolved_factor(16384, 8192) is None
    assert st.label() == "ntk-mixed (b=0.625) dyn + log-n" and st.label(16384, 8192) == "ntk-mixed (b=0.625) dyn + log-n"
    assert ED.Setting("ntk", dynamic=True).label(200, 64) == "ntk dyn"
    assert ED.Setting("ntk").label(200, 64) == "ntk k=3.125"
    assert ED.Setting("ntk", logn=True).dynamic is False
    for bad, msg in ((("none", None, None, False, True), "not 'none'"),
                     (("ntk", 2.0, None, False, True), "leave the factor k out")):
        with pytest.raises(GGUFRopeError, match=msg):
            ED.Setting(*bad)
    assert EG.grid_configs([16384], ["none", "ntk"], [False, True], [False, True]) == [
        (16384, "none", False, False), (16384, "none", True, False),
        (16384, "ntk", False, False), (16384, "ntk", True, False),
        (16384, "ntk", False, True), (16384, "ntk", True, True),
    ]
    assert EG.grid_configs([16384], ["none", "yarn"], [False], [True]) == []


def test_eval_unit_keys_of_static_and_dynamic_differ() -> None:
    static = EC.unit_key(ED.Setting.for_grid("ntk-mixed", None, 0.625, False), 16384, 8192, FP)
    assert static == {"eval_version": 1, "model": FP, "method": "ntk-mixed", "factor": 2.0, "exponent": 0.625,
                      "logn": False, "n_ctx": 16384, "n_ctx_orig": 8192}
    dyn = EC.unit_key(ED.Setting.for_grid("ntk-mixed", None, 0.625, False, True), 16384, 8192, FP)
    assert dyn == {"eval_version": 1, "model": FP, "method": "ntk-mixed", "factor": None, "exponent": 0.625,
                   "logn": False, "n_ctx": 16384, "n_ctx_orig": 8192, "dynamic": True, "dynamic_ratio": 2.0}
    cache = EC.Cache.__new__(EC.Cache)
    cache.root = Path("/c")
    ps = {cache.path({**k, "kind": "ppl"}).name for k in (static, dyn)}
    assert len(ps) == 2
    assert any(p.startswith("ppl-ntk-mixed-16384-") for p in ps) and any(p.startswith("ppl-ntk-mixed-dyn-16384-") for p in ps)
    ln = EC.unit_key(ED.Setting.for_grid("ntk", None, None, True, True), 16384, 8192, FP)
    assert cache.path({**ln, "kind": "passkey"}).name.startswith("passkey-ntk-dyn-logn-16384-")


def test_the_published_cached_units_keep_their_keys() -> None:
    """Every unit cached in docs/results/cache gets the same key and file name from today's code:
    the static results computed before dynamic k are still found (no dynamic field in their key),
    and the dynamic units (file names -dyn) carry dynamic true and the ratio 2."""
    files = sorted(p for p in (ROOT / "docs" / "results" / "cache").glob("*.json") if p.name != "model-sha256.json")
    assert files
    cache = EC.Cache.__new__(EC.Cache)
    cache.root = files[0].parent
    for p in files:
        key = json.loads(p.read_text())["key"]
        dyn = "-dyn-" in p.name or "-dyn." in p.name
        if dyn:
            assert (key["dynamic"], key["dynamic_ratio"], key["factor"]) == (True, 2.0, None), p.name
        else:
            assert "dynamic" not in key and "dynamic_ratio" not in key, p.name
        # the unit's own k (auto k is stored resolved, so passing it back gives the same key)
        st = ED.Setting.for_grid(key["method"], key["factor"], key["exponent"] or M.DEFAULT_EXPONENT, key["logn"],
                                 **({"dynamic": True} if dyn else {}))
        base = EC.unit_key(st, key["n_ctx"], key["n_ctx_orig"], key["model"])
        assert base == {k: key[k] for k in base}, p.name
        assert cache.path(key) == p


def test_markdown_table_rows_for_dynamic_cells() -> None:
    def cell(m, ln, dyn, ppl):
        c = {"n_ctx": 128, "method": m, "logn": ln, "label": m, "factor": None if dyn or m == "none" else 2.0,
             "ppl": ppl, "ppl_beyond": ppl, "passkey_accuracy": None}
        return {**c, "dynamic": True} if dyn else c

    res = {"model": {"n_ctx_orig": 64, "name": "t"}, "command": None,
           "grid": {"n_ctx": [128], "methods": ["none", "ntk-mixed"], "logn": [False], "dynamic": [False, True],
                    "exponent": 0.625, "trials": 0, "texts": [], "max_windows": 1, "score_from": None},
           "cells": [cell("none", False, False, 9.0), cell("ntk-mixed", False, False, 5.0),
                     cell("ntk-mixed", False, True, 4.0)]}
    md = ER.markdown_table(res)
    rows = [x for x in md.splitlines() if x.startswith("| ")]
    assert rows[1:] == ["| Baseline | 9.000 / – |", "| NTK-RoPE-mixed (b=0.625) | 5.000 / – |",
                        "| NTK-RoPE-mixed (b=0.625) dyn | 4.000 / – |"]
    assert f"dyn: {DYN_WORDS}" in md and "Factor k per context: 128: k = 2." in md


# --------------------------------------------------------------------------- with a library that has dynamic k

L_TINY = 64


@pytest.fixture(scope="module")
def dyn_lib(patched_lib):
    """The patched library with dynamic k; fails when the loaded one lacks
    llama_ggufrope_dynamic (a stale build of a patch older than dynamic k)."""
    from ggufrope import runtime

    runtime.require_dynamic("dyn_lib")
    return patched_lib


def _tiny(tmp_path, name: str, **kv):
    from tiny_models import write_tiny_llama

    extra = {f"{{arch}}.{k}": v for k, v in kv.items()}
    extra["tokenizer.ggml.add_space_prefix"] = False  # prompts of the vocabulary's pieces t4..t9
    return write_tiny_llama(tmp_path / name, seed=21, extra_kv=extra)


def _toks(n: int) -> list[int]:
    return [4 + i % 6 for i in range(n)]  # t4 .. t9


def _load(path, **kw):
    return R.load(path, n_ctx=256, n_threads=2, n_threads_batch=2, n_batch=256, n_ubatch=256, **kw)


def test_dynamic_context_reports_k_as_the_cache_fills(dyn_lib, tmp_path) -> None:
    """L = 64, r = 2: k = 1 after creation and for n <= 64, 2 for n in 65..128, 4 for 129..256;
    describe() reads the k of now."""
    m = _tiny(tmp_path, "t.gguf")
    llm = _load(m.path, method="mixed", dynamic=True)
    info = llm.ggufrope
    assert info.dynamic is True and info.dynamic_ratio == 2.0 and info.factor == 1.0 and not info.auto
    assert R.dynamic_in_use(llm) is True and R.factor_in_use(llm) == 1.0
    lib = R.library_version()
    assert R.describe(llm) == (f"rope: ntk-mixed, b = 0.625 (default), {DYN_WORDS} (k now 1, L 64), log-n off "
                               f"(chosen at load time); llama.cpp patched {lib}")
    for n_total, k in ((64, 1.0), (65, 2.0), (128, 2.0), (129, 4.0), (200, 4.0)):
        llm.eval(_toks(n_total - llm.n_tokens))
        assert llm.n_tokens == n_total
        assert R.factor_in_use(llm) == k, n_total
    assert "(k now 4, L 64)" in R.describe(llm)
    assert llm.ggufrope.factor == 1.0  # the record of creation is not rewritten
    del llm


def test_static_contexts_say_static(dyn_lib, tmp_path) -> None:
    m = _tiny(tmp_path, "t.gguf")
    for kw in ({}, {"method": "ntk", "factor": 2.0}, {"method": "mixed", "dynamic": False},
               {"method": "none", "logn": True}, {"method": "yarn"}):
        llm = _load(m.path, **kw)
        assert R.dynamic_in_use(llm) is False and llm.ggufrope.dynamic is False, kw
        del llm
    llm = _load(m.path, method="mixed", dynamic=False)  # static automatic k: 256 / 64
    assert llm.ggufrope.factor == 4.0 and llm.ggufrope.auto
    del llm


def test_a_method_without_k_chosen_at_load_time_is_dynamic_by_default(dyn_lib, tmp_path) -> None:
    """runtime.load(method=...) of the NTK family without a factor and without dynamic=: the
    library's default, dynamic k (L = 64: k = 1 after creation and at n = 64, 2 at n = 65)."""
    m = _tiny(tmp_path, "t.gguf")
    for method in ("ntk", "ntk-fixed", "mixed"):
        llm = _load(m.path, method=method)
        info = llm.ggufrope
        assert R.dynamic_in_use(llm) is True and info.dynamic is True and info.dynamic_ratio == 2.0, method
        assert info.factor == 1.0 and not info.auto and R.factor_in_use(llm) == 1.0
        assert info.source == "chosen at load time"
        llm.eval(_toks(64))
        assert R.factor_in_use(llm) == 1.0
        llm.eval(_toks(1))
        assert R.factor_in_use(llm) == 2.0
        del llm


def test_a_set_file_without_k_loads_dynamic_by_default(dyn_lib, tmp_path) -> None:
    """``set --method mixed`` (no --factor, no --dynamic) on the tiny model (L = 64), loaded by
    runtime.load with nothing chosen: dynamic k, k = 1, then 2 beyond 64 positions;
    ``--factor 2``: static k = 2; ``--static``: static automatic k = 256 / 64 = 4."""
    m = _tiny(tmp_path, "t.gguf")
    lib = R.library_version()
    out = tmp_path / "mixed.gguf"
    assert run("set", m.path, "--method", "mixed", "-o", out).exit_code == 0
    llm = _load(out)
    info = llm.ggufrope
    assert info.dynamic is True and info.dynamic_ratio == 2.0 and info.source == "from the file"
    assert R.dynamic_in_use(llm) is True and R.factor_in_use(llm) == 1.0 and info.factor == 1.0
    assert R.describe(llm) == (f"rope: ntk-mixed, b = 0.625, {DYN_WORDS} (k now 1, L 64), log-n off "
                               f"(from the file); llama.cpp patched {lib}")
    llm.eval(_toks(65))
    assert R.factor_in_use(llm) == 2.0
    del llm

    k2 = tmp_path / "k2.gguf"
    assert run("set", m.path, "--method", "mixed", "--factor", "2", "-o", k2).exit_code == 0
    llm = _load(k2)
    assert R.dynamic_in_use(llm) is False and llm.ggufrope.dynamic is False
    assert llm.ggufrope.factor == 2.0 and not llm.ggufrope.auto
    del llm

    st = tmp_path / "static.gguf"
    assert run("set", m.path, "--method", "mixed", "--static", "-o", st).exit_code == 0
    llm = _load(st)
    assert R.dynamic_in_use(llm) is False and llm.ggufrope.dynamic is False
    assert llm.ggufrope.factor == 4.0 and llm.ggufrope.auto
    assert R.describe(llm) == ("rope: ntk-mixed, b = 0.625, k = 4 (auto, resolved by llama.cpp at "
                               f"n_ctx_seq 256, L 64), log-n off (from the file); llama.cpp patched {lib}")
    del llm


def test_an_older_library_is_refused_for_a_file_dynamic_by_default(small_gguf, tmp_path, monkeypatch) -> None:
    """A file with an NTK-family method and no k runs dynamic k by default: a library without
    dynamic k (which would run the static automatic k) is refused for it; with --static or an
    explicit k it is not asked for dynamic k."""
    import llama_cpp

    monkeypatch.setattr(R, "has_dynamic", lambda: False)
    monkeypatch.setattr(llama_cpp, "Llama", lambda **kw: pytest.fail("must not load"))
    d = tmp_path / "d.gguf"
    RM.write_rope_metadata(small_gguf, d, method="ntk")
    for path, kw in ((d, {}), (d, {"logn": True}), (small_gguf, {"method": "ntk"})):
        with pytest.raises(GGUFRopeError, match="needs dynamic k, which the loaded llama.cpp lacks"):
            R.load(path, **kw)


def test_a_dynamic_file_with_ratio(dyn_lib, tmp_path) -> None:
    """set --dynamic --dynamic-ratio 1.5 on the tiny model: loaded as the file says, k = 1.5
    at n = 96, 2.25 at n = 97 (L = 64)."""
    m = _tiny(tmp_path, "t.gguf")
    out = tmp_path / "d.gguf"
    assert run("set", m.path, "-m", "ntk", "--dynamic", "--dynamic-ratio", "1.5", "-o", out).exit_code == 0
    llm = _load(out)
    assert llm.ggufrope.dynamic and llm.ggufrope.dynamic_ratio == 1.5 and llm.ggufrope.source == "from the file"
    llm.eval(_toks(96))
    assert R.factor_in_use(llm) == 1.5
    llm.eval(_toks(1))
    assert R.factor_in_use(llm) == 2.25
    del llm
    llm = _load(out, dynamic=False)  # --static alone
    assert not R.dynamic_in_use(llm) and llm.ggufrope.factor == 4.0 and llm.ggufrope.auto  # 256 / 64
    assert llm.ggufrope.source == "from the file, dynamic k chosen at load time"
    del llm


def test_eval_load_model_dynamic(dyn_lib, tmp_path) -> None:
    m = _tiny(tmp_path, "t.gguf")
    llm = ED.load_model(m.path, ED.Setting("ntk-mixed", dynamic=True, logn=True), 200, threads=2)
    assert llm.ggufrope.dynamic and llm.ggufrope.factor == 1.0 and R.dynamic_in_use(llm)
    del llm
    llm = ED.load_model(m.path, ED.Setting("ntk-mixed"), 200, threads=2)  # static: k = 200 / 64 passed
    assert not llm.ggufrope.dynamic and llm.ggufrope.factor == 3.125
    del llm


def test_generate_prints_the_k_reached(dyn_lib, tmp_path) -> None:
    """A 100-token prompt (t4..t9, no BOS in the tiny vocabulary): k = 1 when loaded, 2 after
    (n = 100 or 101 <= 128)."""
    m = _tiny(tmp_path, "t.gguf")
    prompt = "".join(f"t{4 + i % 6}" for i in range(100))
    r = CliRunner().invoke(main, ["generate", str(m.path), "-p", prompt, "-n", "1", "-c", "256", "-t", "2",
                                  "-m", "ntk", "--dynamic"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = [x for x in r.stderr.splitlines() if x.startswith(("[ggufrope] rope:", "[ggufrope] after generation:"))]
    lib = R.library_version()
    assert lines == [
        f"[ggufrope] rope: ntk, {DYN_WORDS} (k now 1, L 64), log-n off (chosen at load time); llama.cpp patched {lib}",
        (f"[ggufrope] after generation: rope: ntk, {DYN_WORDS} (k now 2, L 64), log-n off (chosen at load time); "
         f"llama.cpp patched {lib}"),
    ]


def test_generate_without_k_or_dynamic_runs_dynamic_by_default(dyn_lib, tmp_path) -> None:
    """``generate -m ntk`` with neither --factor nor --dynamic: the library's default, dynamic k
    (the same 100-token prompt: k = 1 when loaded, 2 after); with --static, k = 256 / 64 = 4."""
    m = _tiny(tmp_path, "t.gguf")
    prompt = "".join(f"t{4 + i % 6}" for i in range(100))
    lib = R.library_version()
    base = ["generate", str(m.path), "-p", prompt, "-n", "1", "-c", "256", "-t", "2", "-m", "ntk"]
    r = CliRunner().invoke(main, base, catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = [x for x in r.stderr.splitlines() if x.startswith(("[ggufrope] rope:", "[ggufrope] after generation:"))]
    assert lines == [
        f"[ggufrope] rope: ntk, {DYN_WORDS} (k now 1, L 64), log-n off (chosen at load time); llama.cpp patched {lib}",
        (f"[ggufrope] after generation: rope: ntk, {DYN_WORDS} (k now 2, L 64), log-n off (chosen at load time); "
         f"llama.cpp patched {lib}"),
    ]
    r = CliRunner().invoke(main, [*base, "--static"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    lines = [x for x in r.stderr.splitlines() if x.startswith("[ggufrope] rope:")]
    assert lines == [f"[ggufrope] rope: ntk, k = 4 (auto, resolved by llama.cpp at n_ctx_seq 256, L 64), log-n off "
                     f"(chosen at load time); llama.cpp patched {lib}"]


def test_library_refuses_what_python_refuses(dyn_lib, tmp_path) -> None:
    """The same combinations, put past ggufrope straight into llama.cpp as kv overrides: it
    refuses to load each (the contract both sides implement)."""
    import llama_cpp

    m = _tiny(tmp_path, "t.gguf")
    for kv in ({"llama.rope.ntk.method": "none", "llama.rope.ntk.dynamic": True},
               {"llama.rope.ntk.method": "ntk", "llama.rope.ntk.factor": 2.0, "llama.rope.ntk.dynamic": True},
               {"llama.rope.ntk.method": "ntk", "llama.rope.ntk.dynamic": True, "llama.rope.ntk.dynamic_ratio": 1.0},
               {"llama.rope.ntk.method": "ntk", "llama.rope.ntk.dynamic": True,
                "llama.rope.ntk.dynamic_ratio": math.nan}):
        with pytest.raises(ValueError):
            llama_cpp.Llama(model_path=str(m.path), n_ctx=256, verbose=False, kv_overrides=kv)


def test_a_ratio_alone_goes_with_the_default_dynamic_k() -> None:
    """Without --dynamic, a method with automatic k runs dynamic k by default, so a ratio alone is
    accepted (and kept); with a factor k the choice is static and the ratio refused."""
    p = M.validate("ntk", dynamic_ratio=1.5)
    assert (p.dynamic, p.dynamic_ratio) == (None, 1.5)
    with pytest.raises(ValueError, match="applies to dynamic k only"):
        M.validate("ntk", 2.0, dynamic_ratio=1.5)
