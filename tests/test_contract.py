"""The contract between file, library and tool: the keys `ggufrope set` writes are exactly
those README.md lists, the patched llama.cpp reads exactly those, and none of them is a key
stock llama.cpp reads (so an unpatched build loads a file that carries them)."""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

import pytest

from conftest import PATCHED_SRC, PINNED_SDIST, PINNED_VERSION
from ggufrope import keys as K

ROOT = Path(__file__).resolve().parents[1]
PATCHED_ARCH = PATCHED_SRC / "src" / "llama-arch.cpp"
_KV_RE = re.compile(r'\{\s*(LLM_KV_\w+)\s*,\s*"([^"]+)"\s*\}')


def _kv_table(text: str) -> dict[str, str]:
    return dict(_KV_RE.findall(text))


@pytest.fixture(scope="module")
def stock_table() -> dict[str, str]:
    assert PINNED_SDIST.exists(), "the pinned sdist is missing: run make build"
    with tarfile.open(PINNED_SDIST) as tf:
        member = tf.extractfile(f"llama_cpp_python-{PINNED_VERSION}/vendor/llama.cpp/src/llama-arch.cpp")
        return _kv_table(member.read().decode())


def _readme_keys() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Metadata keys", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([^`]+)` \| (?:STRING|FLOAT32|BOOL|ARRAY[^|]*) \|", section, flags=re.M))


def _written_keys(tmp_path, arch: str) -> set[str]:
    from conftest import write_test_gguf

    from ggufrope.gguf_file import read_header, write_rope_metadata

    src = write_test_gguf(tmp_path / "m.gguf", arch)
    before = {kv.key for kv in read_header(src).kvs}
    seen: set[str] = set()
    for kw in (dict(method="ntk-mixed", exponent=0.5, factor=4.0, logn=True), dict(method="ntk"), dict(method="none", logn=True)):
        out = tmp_path / "out.gguf"
        write_rope_metadata(src, out, **kw)
        seen |= {kv.key for kv in read_header(out).kvs} - before
    return seen


def test_written_keys_are_those_readme_lists(tmp_path):
    written = _written_keys(tmp_path, "llama")
    documented = {k.replace("{arch}", "llama") for k in _readme_keys()}
    assert written == documented, f"written {sorted(written)} vs README {sorted(documented)}"
    assert {K.key(t, "llama") for t in K.KEY_TYPES} <= written


def test_stock_llama_cpp_reads_none_of_the_keys(stock_table, tmp_path):
    stock_keys = {pattern % "llama" if "%s" in pattern else pattern for pattern in stock_table.values()}
    assert "llama.rope.scaling.type" in stock_keys  # the table was parsed
    written = _written_keys(tmp_path, "llama")
    assert not written & stock_keys, f"stock llama.cpp reads {sorted(written & stock_keys)}"


def test_patched_library_reads_exactly_the_ggufrope_keys(stock_table):
    assert PATCHED_ARCH.exists(), "the patched tree is missing: run make build"
    patched = _kv_table(PATCHED_ARCH.read_text())
    added = {patched[name] for name in set(patched) - set(stock_table)}
    assert added == {t.replace("{arch}", "%s") for t in K.KEY_TYPES}
