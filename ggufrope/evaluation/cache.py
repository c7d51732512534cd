"""The cache of computed units: one JSON file per unit of the comparison grid.

A unit is one (model, setting, n_ctx) with one document (perplexity) or one passkey trial set.
Its key (:func:`unit_key`, completed by :func:`ggufrope.evaluation.grid.run_compare`) names the
protocol version, the model's sha256 and size, method, k, b, dynamic k, log-n, n_ctx, L and the
text or trial set; the file is named by the sha256 of that key and holds the key (checked when
read) and the result, so an interrupted grid resumes where it stopped.

**The build.** A unit is reused only when it was computed by the same library build
(:func:`build_info`): the llama.cpp shared libraries loaded (a hash of their bytes), the
ggufrope patch version, the backend (CPU or CUDA), flash attention and n_ubatch, so a change
to the C code never reuses stale units. The build is stored in the unit's file beside the key,
not in the key: the file name stays the hash of the key alone, so the units cached before
builds were recorded (none stored) keep their files. A unit computed by another build (or by
an unrecorded one) is stale: :func:`ggufrope.evaluation.grid.run_compare` recomputes and
overwrites it, except with ``report_only``, which reads any build and counts the units per
build (:func:`build_id`) in the report.

**Partial units.** A retrieval unit (a passkey trial set, a RULER-lite task) takes minutes to
hours beyond L on a CPU; its samples done so far are kept beside it in
``<unit file>.<build>.partial`` (:meth:`Cache.partial_path`, :meth:`Cache.read_partial`,
:meth:`Cache.put_partial`), written after each sample, so a run that is stopped resumes at the
next sample instead of the first. A run resumes its own build's samples, and each build has its
own partial file, so a run on a lent GPU and one on this CPU keep each other's samples. Only with
``any_build`` (``--any-build``, which already reuses whole units of other builds) does a run also
take the samples of other builds' partial files (:meth:`Cache.other_partials`); each such row
then carries the ``build`` that answered it, and the stored unit counts its samples per build
(``sample_builds``), so a unit that mixes builds says so. Every partial file of a unit is removed
when the unit is stored.
Their names do not end in ``.json``: they are not units. A partial file of the earlier, one-per-unit
name ``<unit file>.partial`` (same content) is still resumed by its own build while the unit has
no per-build file of that build, and removed with the others.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import pathlib
from typing import Any

from ..errors import GGUFRopeError
from .decoder import Setting

#: bump when a change to the evaluation changes what a cached result means
EVAL_VERSION = 1


def atomic_json(path: pathlib.Path, obj: Any) -> None:
    from ..models import atomic_open

    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.write("\n")


def model_fingerprint(model: str | os.PathLike, cache_dir: pathlib.Path) -> dict[str, Any]:
    """sha256 and size of ``model``; the sha256 is remembered in ``cache_dir`` under (real path,
    size, mtime), so a file is hashed once until it changes."""
    p = os.path.realpath(os.fspath(model))
    try:
        st = os.stat(p)
    except OSError as e:
        raise GGUFRopeError(f"{os.fspath(model)}: {e.strerror}") from None
    memo_path = cache_dir / "model-sha256.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    mk = f"{p}|{st.st_size}|{st.st_mtime_ns}"
    sha = memo.get(mk)
    if sha is None:
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        sha = h.hexdigest()
        memo[mk] = sha
        atomic_json(memo_path, memo)
    return {"sha256": sha, "size": st.st_size, "name": os.path.basename(p)}


def _load_partial(path: pathlib.Path, key: dict[str, Any]
                  ) -> tuple[dict[str, Any] | None, dict[int, dict[str, Any]], float] | None:
    """A partial file's ``(build, rows by sample index, wall_s)``; None when it cannot be read or
    holds another key than ``key``."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if obj.get("key") != json.loads(json.dumps(key)):
        return None
    return obj.get("build"), {int(i): row for i, row in obj["rows"].items()}, float(obj.get("wall_s", 0.0))


class Cache:
    """One JSON file per unit, named by the sha256 of its key; the key is stored in the file and
    checked when read."""

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: dict[str, Any]) -> pathlib.Path:
        h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
        dyn = "-dyn" if key.get("dynamic") else ""
        return self.root / f"{key['kind']}-{key['method']}{dyn}{'-logn' if key['logn'] else ''}-{key['n_ctx']}-{h}.json"

    def read(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The unit's file, ``{"key", "result"}`` and ``"build"`` when one was recorded, or None
        when there is none (or it holds another key)."""
        try:
            obj = json.loads(self.path(key).read_text())
        except (OSError, ValueError):
            return None
        return obj if obj.get("key") == json.loads(json.dumps(key)) else None

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        """The unit's result, whichever build computed it (None when not cached)."""
        obj = self.read(key)
        return None if obj is None else obj["result"]

    def put(self, key: dict[str, Any], result: dict[str, Any], build: dict[str, Any] | None = None) -> None:
        """Store ``result`` under ``key``, with the ``build`` that computed it (:func:`build_info`),
        and remove the unit's partial files (every build's)."""
        atomic_json(self.path(key), {"key": key, "result": result, **({"build": build} if build is not None else {})})
        for p in self.partial_paths(key):
            p.unlink(missing_ok=True)

    def partial_path(self, key: dict[str, Any], build: dict[str, Any] | None) -> pathlib.Path:
        """``<unit file>.<build>.partial``: the partial file of the unit ``key`` computed by
        ``build`` (:func:`build_info`), ``<build>`` the first 12 hex digits of the sha256 of its
        JSON."""
        p = self.path(key)
        b = hashlib.sha256(json.dumps(build, sort_keys=True).encode()).hexdigest()[:12]
        return p.with_name(f"{p.name}.{b}.partial")

    def legacy_partial_path(self, key: dict[str, Any]) -> pathlib.Path:
        """``<unit file>.partial``: the one partial file a unit had before each build had its own
        (any build's; :meth:`read_partial` checks the build recorded in it)."""
        p = self.path(key)
        return p.with_name(p.name + ".partial")

    def partial_paths(self, key: dict[str, Any]) -> list[pathlib.Path]:
        """The partial files of the unit ``key``, of every build, sorted by name, and its legacy
        one (:meth:`legacy_partial_path`) when there is one."""
        p = self.path(key)
        legacy = self.legacy_partial_path(key)
        return sorted([*p.parent.glob(glob.escape(p.name) + ".*.partial"), *([legacy] if legacy.exists() else [])])

    def read_partial(self, key: dict[str, Any], build: dict[str, Any] | None) -> tuple[dict[int, dict[str, Any]], float]:
        """The samples of the unit ``key`` that ``build`` computed before it was stopped, by sample
        index, and the seconds they took (``wall_s``); ``({}, 0.0)`` when there is no partial file,
        or it holds another key or another build. Without a file of ``build``'s own name, the
        legacy file (:meth:`legacy_partial_path`) is read under the same checks."""
        path = self.partial_path(key, build)
        if not path.exists():
            path = self.legacy_partial_path(key)
        got = _load_partial(path, key)
        if got is None or got[0] != build:
            return {}, 0.0
        return got[1], got[2]

    def other_partials(self, key: dict[str, Any], build: dict[str, Any] | None
                       ) -> list[tuple[dict[str, Any] | None, dict[int, dict[str, Any]], float]]:
        """The partial files of the unit ``key`` that builds other than ``build`` wrote, as
        ``(their build, rows by sample index, wall_s)``, the one with the most samples first (ties:
        by file name); files that hold another key, or that cannot be read, are left out."""
        out = [got for got in (_load_partial(path, key) for path in self.partial_paths(key))
               if got is not None and got[0] != build]
        return sorted(out, key=lambda t: -len(t[1]))

    def put_partial(self, key: dict[str, Any], build: dict[str, Any] | None, rows: dict[int, dict[str, Any]],
                    wall_s: float) -> None:
        """Keep the samples computed so far of the unit ``key`` (by index), atomically."""
        atomic_json(self.partial_path(key, build), {"key": key, "build": build, "wall_s": wall_s,
                                                    "rows": {str(i): r for i, r in sorted(rows.items())}})


_library_hash: str | None = None


def library_hash() -> str:
    """The first 16 hex digits of the sha256 over the llama.cpp shared libraries that
    llama-cpp-python loaded: libllama (``llama_cpp.llama_cpp._lib._name``) and every other
    ``lib*.so*`` beside it (libggml*), by real path, each once, in sorted order. Computed once
    per process."""
    global _library_hash
    if _library_hash is None:
        import llama_cpp.llama_cpp as lc

        name = os.path.realpath(lc._lib._name)
        paths = {name} | {os.path.realpath(p) for p in glob.glob(os.path.join(os.path.dirname(name), "lib*.so*"))}
        h = hashlib.sha256()
        for p in sorted(paths):
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    h.update(chunk)
        _library_hash = h.hexdigest()[:16]
    return _library_hash


def build_info(gpu_layers: int, flash_attn: bool, n_ubatch: int) -> dict[str, Any]:
    """The library build a unit is computed with: ``library`` (:func:`library_hash`),
    ``ggufrope_patch`` (:func:`ggufrope.runtime.library_version`, None for a stock library),
    ``backend`` (``"CUDA"`` when layers are offloaded and the library has a GPU device,
    :func:`ggufrope.runtime.has_gpu`, else ``"CPU"``),
    ``flash_attn`` and ``n_ubatch`` as the model is loaded with them
    (:func:`ggufrope.evaluation.decoder.batch_sizes`)."""
    from ..runtime import has_gpu, library_version

    gpu = gpu_layers != 0 and has_gpu()
    return {"library": library_hash(), "ggufrope_patch": library_version(), "backend": "CUDA" if gpu else "CPU",
            "flash_attn": bool(flash_attn), "n_ubatch": int(n_ubatch)}


def build_id(build: dict[str, Any] | None) -> str:
    """One line naming a build (:func:`build_info`), ``"unrecorded"`` for None."""
    if build is None:
        return "unrecorded"
    patch = build.get("ggufrope_patch")
    return (f"llama.cpp {build.get('library')} (patch {patch or 'none: stock'}), {build.get('backend')}, "
            f"flash-attn {'on' if build.get('flash_attn') else 'off'}, n_ubatch {build.get('n_ubatch')}")



def unit_key(setting: Setting, n_ctx: int, n_ctx_orig: int, fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The part of a cached unit's key that names the model and the setting at ``n_ctx``
    (the kind of unit, its text or trial set are added by :func:`run_compare`): protocol
    version, model sha256 and size, method, the k applied (None: none, or dynamic k), b
    (ntk-mixed), log-n, n_ctx and L, and with dynamic k ``dynamic`` and ``dynamic_ratio``
    (:meth:`Setting.key_fields`; a static key has neither)."""
    return {
        "eval_version": EVAL_VERSION, "model": {"sha256": fingerprint["sha256"], "size": fingerprint["size"]},
        "method": setting.method, "factor": setting.resolved_factor(n_ctx, n_ctx_orig),
        "exponent": setting.exponent if setting.method == "ntk-mixed" else None, "logn": setting.logn,
        "n_ctx": n_ctx, "n_ctx_orig": n_ctx_orig, **setting.key_fields(),
    }
