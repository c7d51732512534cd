"""ggufrope/override_kv.py, ``ggufrope show --override-kv``: the llama.cpp flags that select a
file's method on a plain copy.

The printed line is parsed back (``shlex``, then llama.cpp's KEY=TYPE:VALUE) and a PLAIN tiny
model (L = 64) loaded with those overrides in the patched library must run the same rope as the
file written by ``ggufrope set``: the same k and dynamic mode read back from the library, and
bit-identical logits at position 199 (beyond L: dynamic k = 4, log-n on), while the plain file
without them differs. The python form goes through llama-cpp-python's own server code
(its argparse for ``--kv_overrides`` and ``LlamaProxy.load_llama_from_model_settings``).
The servers themselves, on the real model: tests/test_servers.py.
"""

from __future__ import annotations

import ctypes
import shlex
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from ggufrope import rope_metadata as RM
from ggufrope.cli import main
from ggufrope.override_kv import parse_override
from tiny_models import write_tiny_llama

N = 200  # positions 0..199 with L = 64: dynamic k = 4 at the end, log-n active


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def show_line(*args: str) -> str:
    r = run("show", "--override-kv", *args)
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert len(lines) == 1, r.output  # one line
    return lines[0]


def llama_flags(line: str) -> dict:
    """``--override-kv S`` pairs (llama.cpp's form) -> {key: value}; nothing else on the line."""
    a = shlex.split(line)
    assert len(a) % 2 == 0 and a[0::2] == ["--override-kv"] * (len(a) // 2), line
    return dict(parse_override(s) for s in a[1::2])


def python_args(line: str) -> list[str]:
    """The argv that ``python -m llama_cpp.server`` gets: one ``--kv_overrides`` and its strings."""
    a = shlex.split(line)
    assert a[0] == "--kv_overrides" and "--kv_overrides" not in a[1:] and all(not s.startswith("-") for s in a[1:]), line
    return a


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("okv") / "plain.gguf", seed=71).path


def _set(plain: Path, tmp_path: Path, *opts: str, name: str = "set.gguf") -> Path:
    out = tmp_path / name
    r = run("set", plain, *opts, "-o", out)
    assert r.exit_code == 0, r.output
    return out


def rope_of(path: Path, kv: dict | None = None, llm=None):
    """(k in use, dynamic, last logits) after evaluating N tokens; ``llm`` an already loaded model."""
    import llama_cpp

    lib = llama_cpp.llama_cpp._lib
    lib.llama_ggufrope_factor.restype, lib.llama_ggufrope_factor.argtypes = ctypes.c_float, [ctypes.c_void_p]
    lib.llama_ggufrope_dynamic.restype, lib.llama_ggufrope_dynamic.argtypes = ctypes.c_bool, [ctypes.c_void_p]
    if llm is None:
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2,
                              n_threads_batch=2, type_k=0, type_v=0, verbose=False, kv_overrides=kv)
    try:
        toks = [4 + (i * 37) % 92 for i in range(N)]
        llm.eval(toks)
        ctx = llm._ctx.ctx
        last = llama_cpp.llama_get_logits_ith(ctx, -1)  # the last token's logits (logits_all or not)
        logits = np.ctypeslib.as_array(last, shape=(llm.n_vocab(),)).copy()
        return float(lib.llama_ggufrope_factor(ctx)), bool(lib.llama_ggufrope_dynamic(ctx)), logits
    finally:
        llm.close()


def assert_same_rope(a, b) -> None:
    assert a[0] == b[0] and a[1] == b[1]
    assert np.array_equal(a[2], b[2])


SETS = [
    ("--method", "mixed", "--b", "0.625", "--logn"),
    ("--method", "ntk", "-k", "2"),
    ("--method", "ntk-fixed", "--static", "--logn"),
    ("--method", "ntk-mixed", "--b", "0.5", "--dynamic", "--dynamic-ratio", "3"),
]


@pytest.mark.parametrize("opts", SETS, ids=lambda o: " ".join(o[1:]))
def test_file_keys_on_a_plain_copy_run_the_same_rope(patched_lib, plain: Path, tmp_path: Path, opts) -> None:
    out = _set(plain, tmp_path, *opts)
    line = show_line(out)
    kv = llama_flags(line)
    assert kv == RM.read_rope_metadata(out)["ggufrope_keys"]  # exactly the file's ggufrope keys
    assert list(kv) == list(RM.read_rope_metadata(out)["ggufrope_keys"])
    ref = rope_of(out)
    assert_same_rope(rope_of(plain, kv), ref)
    k_plain, dyn_plain, logits_plain = rope_of(plain)
    assert k_plain == 0.0 and not dyn_plain  # the plain file alone: no NTK table
    assert np.abs(logits_plain - ref[2]).max() > 1e-3


def test_the_exact_line_for_mixed_logn(patched_lib, plain: Path, tmp_path: Path) -> None:
    out = _set(plain, tmp_path, "--method", "mixed", "--b", "0.625", "--logn")
    assert show_line(out) == ("--override-kv llama.rope.ntk.method=str:ntk-mixed "
                              "--override-kv llama.rope.ntk.exponent=float:0.625 "
                              "--override-kv llama.attention.logn_scaling=bool:true")
    assert show_line("--override-kv-format", "python", out) == (
        "--kv_overrides llama.rope.ntk.method=str:ntk-mixed llama.rope.ntk.exponent=float:0.625 "
        "llama.attention.logn_scaling=bool:true")


def test_method_on_the_command_line(patched_lib, plain: Path, tmp_path: Path) -> None:
    """``show --override-kv PLAIN --method mixed --b 0.625 --logn`` (the overrides of
    runtime.llama_kwargs, every key explicit) runs what ``set`` with the same options writes."""
    out = _set(plain, tmp_path, "--method", "mixed", "--b", "0.625", "--logn")
    kv = llama_flags(show_line(plain, "--method", "mixed", "--b", "0.625", "--logn"))
    assert kv == {"llama.rope.ntk.method": "ntk-mixed", "llama.rope.ntk.factor": 0.0, "llama.rope.ntk.exponent": 0.625,
                  "llama.rope.ntk.dynamic": True, "llama.rope.ntk.dynamic_ratio": 2.0,
                  "llama.attention.logn_scaling": True}
    assert_same_rope(rope_of(plain, kv), rope_of(out))
    # on a file that has keys of its own, a chosen method replaces every one of them
    other = _set(plain, tmp_path, "--method", "ntk", "-k", "3", name="other.gguf")
    kv2 = llama_flags(show_line(other, "--method", "mixed", "--b", "0.625", "--logn"))
    assert_same_rope(rope_of(other, kv2), rope_of(out))
    # --logn alone keeps the file's method
    kv3 = llama_flags(show_line(other, "--logn"))
    assert kv3["llama.rope.ntk.method"] == "ntk" and kv3["llama.rope.ntk.factor"] == 3.0
    assert kv3["llama.attention.logn_scaling"] is True


def test_python_form_through_llama_cpp_servers_own_code(patched_lib, plain: Path, tmp_path: Path) -> None:
    """The python form, parsed by llama_cpp.server's argparse (from its pydantic Settings) and
    loaded by its LlamaProxy, runs the set file's rope."""
    import argparse

    from llama_cpp.server.cli import add_args_from_model, parse_model_from_args
    from llama_cpp.server.model import LlamaProxy
    from llama_cpp.server.settings import ModelSettings

    out = _set(plain, tmp_path, "--method", "mixed", "--b", "0.625", "--logn")
    line = show_line("--override-kv-format", "python", out)
    parser = argparse.ArgumentParser()
    add_args_from_model(parser, ModelSettings)

    def load(model: Path, *more: str):
        argv = ["--model", str(model), "--n_ctx", "256", "--n_batch", "64", "--n_ubatch", "64", "--n_threads", "2",
                "--n_threads_batch", "2", "--type_k", "0", "--type_v", "0", "--verbose", "false", *more]
        settings = parse_model_from_args(ModelSettings, parser.parse_args(argv))
        return settings, LlamaProxy.load_llama_from_model_settings(settings)

    settings, llm = load(plain, *python_args(line))
    assert settings.kv_overrides == shlex.split(line)[1:]
    assert_same_rope(rope_of(plain, llm=llm), rope_of(out, llm=load(out)[1]))  # the server's settings for both
    # why one flag: argparse (nargs="*") keeps only the last of repeated --kv_overrides
    twice = parser.parse_args(["--kv_overrides", "a=int:1", "--kv_overrides", "b=int:2"])
    assert twice.kv_overrides == ["b=int:2"]


def test_none_with_logn_switches_stock_scaling_off(patched_lib, plain: Path) -> None:
    assert shlex.split(show_line(plain, "-m", "none", "--logn"))[-2:] == ["--rope-scaling", "none"]
    assert shlex.split(show_line("--override-kv-format", "python", plain, "-m", "none", "--logn"))[-2:] == [
        "--rope_scaling_type", "0"]


@pytest.mark.parametrize("args,msg", [
    (("show", "--override-kv", "{plain}"), "has no ggufrope keys"),
    (("show", "--override-kv", "{plain}", "-m", "yarn"), "stock llama.cpp's own"),
    (("show", "{plain}", "-m", "mixed"), "choose the method for --override-kv"),
    (("show", "--override-kv", "--json", "{set}"), "choose one"),
    (("show", "--override-kv", "{plain}", "-m", "ntk", "--b", "0.5"), "b"),
])
def test_refusals(patched_lib, plain: Path, tmp_path: Path, args, msg) -> None:
    out = _set(plain, tmp_path, "--method", "ntk")
    r = run(*(a.format(plain=plain, set=out) for a in args))
    assert r.exit_code == 2, r.output
    assert r.output.startswith("ggufrope: error: ") and msg in r.output


def test_help_mentions_the_forms() -> None:
    r = run("show", "--help")
    assert r.exit_code == 0
    for s in ("--override-kv", "--override-kv-format", "llama|python", "--kv_overrides"):
        assert s in r.output
