"""One evaluation unit at a time, through the cache: the unit keys (perplexity of one text,
a passkey trial set, a RULER-lite task) and :class:`UnitRunner`, which reads a unit from the
cache when the same build computed it and otherwise loads the model (once per setting and
n_ctx) and computes it. The comparison grid (:mod:`ggufrope.evaluation.grid`) and ``ggufrope
tune`` (:mod:`ggufrope.evaluation.tune`) both evaluate through it, so their units are shared.

**Truncation baseline** units (``keep_last`` = L): the prompts of a retrieval task built for a
longer ``n_ctx``, cut to their last L tokens and answered by the model without a method at
n_ctx = L (:func:`ggufrope.evaluation.ruler.truncate`); their key is method ``none`` at L
with ``prompt_n_ctx`` = the n_ctx the prompts were built for.

**Resuming.** A retrieval unit keeps each sample (trial) in the cache's partial file as it is
answered (:meth:`ggufrope.evaluation.cache.Cache.put_partial`); computing the unit again with
the same build starts from the samples not yet answered, and its ``wall_s`` counts the earlier
runs' seconds too. With ``any_build`` it also takes the samples that other builds' partial files
hold (another CPU's build of the same patches, a lent GPU's): each such row records the ``build``
that answered it, and the unit's ``sample_builds`` counts the samples per build
(:func:`unit_build_label` names such a unit in a report's count of builds).
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from .cache import Cache, build_id, build_info, model_fingerprint, unit_key
from .decoder import Decoder, Setting, batch_sizes, load_model, n_ctx_orig_of
from .ppl import Text, perplexity, summarize_windows

#: flash attention in the evaluation's models (``runtime.load``'s default, passed explicitly so
#: that the build recorded with each unit is the one it ran with)
FLASH_ATTN = True


@dataclasses.dataclass
class GridStats:
    computed: int = 0
    cached: int = 0
    missing: int = 0  #: units neither cached nor computed (report_only)
    models_loaded: int = 0
    stale: int = 0  #: of the computed units, those cached by another build (recomputed, overwritten)


def unit_bar(total: int, desc: str, *, disable: bool = False, **kw: Any) -> Any:
    """A tqdm bar over units, advanced with :func:`advance`: its rate and ETA are the average over
    the units computed in this run (``smoothing=0``), since a resumed run reads many units from
    the cache in milliseconds before it computes one that takes minutes."""
    from tqdm import tqdm

    return tqdm(total=total, unit="unit", desc=desc, disable=disable, smoothing=0, dynamic_ncols=True, **kw)


def advance(bar: Any, computed: bool, n: int = 1) -> None:
    """Count ``n`` units done on ``bar``; units read from the cache count as done before the bar
    started (tqdm's ``initial``), so they move the bar but not its rate."""
    if not computed and not bar.disable:  # a disabled bar has no ``initial``
        bar.initial += n
    bar.update(n)


def unit_build_label(build: dict[str, Any] | None, result: dict[str, Any]) -> str:
    """The build a report counts a unit under: :func:`ggufrope.evaluation.cache.build_id` of the
    build that stored it, or, for a unit whose samples several builds answered (``sample_builds``,
    resumed with ``any_build``), a line naming each with its count of samples."""
    mixed = result.get("sample_builds") or {}
    if len(mixed) < 2:
        return build_id(build)
    # " + " between builds: a report joins its builds with "; ", and a build's name holds commas
    return "samples of several builds (" + " + ".join(
        f"{b}: {n} sample{'s' if n != 1 else ''}" for b, n in sorted(mixed.items())) + ")"


@dataclasses.dataclass
class Resume:
    """What a unit's ``compute`` is given besides the decoder: ``done``, the samples answered by
    an earlier run of the same build (by sample index; with ``any_build`` also those of other
    builds' partial files, each row with its ``build``), and ``save(index, row)``, to be called
    after each new sample (it rewrites this build's partial file)."""

    done: dict[int, dict[str, Any]]
    save: Callable[[int, dict[str, Any]], None]


class UnitRunner:
    """Evaluates units of ``model`` through ``cache`` (:class:`ggufrope.evaluation.cache.Cache`).

    ``report_only``: compute nothing; a unit not cached is None (counted missing), a cached
    one is used whichever build computed it. Otherwise a unit is reused only when the build it
    records is this one (:func:`ggufrope.evaluation.cache.build_info`), or with ``any_build``
    whichever build computed it (a rebuild of the same patches, another CPU); a stale one is
    recomputed and overwritten; ``any_build`` also resumes a retrieval unit from the samples of
    other builds' partial files (:meth:`ggufrope.evaluation.cache.Cache.other_partials`).
    ``builds`` counts the units used per build (:func:`unit_build_label`). Call
    :meth:`close` (or use ``with``) to free the model."""

    def __init__(self, model: str | os.PathLike, cache: Cache, *, n_batch: int = 512, n_ubatch: int | None = None,
                 gpu_layers: int = 0, threads: int | None = None, verbose: bool = False, progress: bool = True,
                 report_only: bool = False, any_build: bool = False, log: Callable[[str], None] | None = None):
        self.model = model
        self.cache = cache
        self.L = n_ctx_orig_of(model)
        self.fp = model_fingerprint(model, cache.root)
        self.n_batch, self.n_ubatch = n_batch, n_ubatch
        self.gpu_layers, self.threads, self.verbose = gpu_layers, threads, verbose
        self.progress, self.report_only, self.any_build = progress, report_only, any_build
        self.say = log or (lambda s: None)
        self.stats = GridStats()
        self.builds: dict[str, int] = {}
        self.wall_s = 0.0  #: sum of the ``wall_s`` of the units used
        self.last_computed = False  #: whether the last unit asked for was computed (not cached or missing)
        self._tokens: dict[str, list[int]] = {}
        self._loaded: tuple | None = None
        self.dec: Decoder | None = None
        self.llm: Any = None

    # keys

    def ppl_key(self, st: Setting, n_ctx: int, text: Text, score_from: int | None, max_windows: int | None) -> dict:
        return {**unit_key(st, n_ctx, self.L, self.fp), "kind": "ppl", "text": text.name, "text_sha256": text.sha256,
                "score_from": n_ctx // 2 if score_from is None else score_from, "max_windows": max_windows}

    def passkey_key(self, st: Setting, n_ctx: int, trials: int, seed: int, depths: list[float] | None, n_gen: int,
                    prompt_n_ctx: int | None = None) -> dict:
        return {**unit_key(st, n_ctx, self.L, self.fp), "kind": "passkey", "trials": trials, "seed": seed,
                "depths": depths, "n_gen": n_gen,
                **({"prompt_n_ctx": prompt_n_ctx} if prompt_n_ctx is not None else {})}

    def ruler_key(self, st: Setting, n_ctx: int, task: str, samples: int, seed: int,
                  prompt_n_ctx: int | None = None) -> dict:
        from .ruler import N_GEN

        return {**unit_key(st, n_ctx, self.L, self.fp), "kind": "ruler", "task": task, "samples": samples,
                "seed": seed, "n_gen": N_GEN[task], **({"prompt_n_ctx": prompt_n_ctx} if prompt_n_ctx else {})}

    # evaluation

    def _decoder(self, st: Setting, n_ctx: int) -> Decoder:
        if self._loaded != (st, n_ctx):
            self._free()
            self.llm = load_model(self.model, st, n_ctx, n_batch=self.n_batch, n_ubatch=self.n_ubatch,
                                  gpu_layers=self.gpu_layers, threads=self.threads, verbose=self.verbose,
                                  flash_attn=FLASH_ATTN)
            self.dec, self._loaded = Decoder(self.llm), (st, n_ctx)
            self.stats.models_loaded += 1
        assert self.dec is not None
        return self.dec

    def unit(self, st: Setting, n_ctx: int, key: dict, label: str,
             compute: Callable[[Decoder, Resume], dict[str, Any]]) -> dict[str, Any] | None:
        """The result of the unit ``key`` (``st`` at ``n_ctx``): cached, or ``compute(decoder,
        resume)`` on the model loaded with ``st`` at ``n_ctx`` (stored with the build and
        ``wall_s``); ``resume`` (:class:`Resume`) holds the samples of the unit's partial file
        that this build computed, and with ``any_build`` those of other builds' partial files
        that it lacks (each row with its ``build``; the result then has ``sample_builds``)."""
        unit = self.cache.read(key)
        self.last_computed = False
        if unit is None and self.report_only:
            self.stats.missing += 1
            self.say(f"missing  {label}")
            return None
        build = None if self.report_only else build_info(self.gpu_layers, FLASH_ATTN,
                                                         batch_sizes(self.n_batch, self.n_ubatch, n_ctx)[1])
        if unit is not None and not (self.report_only or self.any_build) and unit.get("build") != build:
            self.stats.stale += 1
            self.say(f"stale (another build) {label}: {build_id(unit.get('build'))}")
            unit = None
        if unit is None:
            dec = self._decoder(st, n_ctx)
            done, before = self.cache.read_partial(key, build)
            if done:
                self.say(f"resuming {label}: {len(done)} samples done ({before:.0f} s)")
            if self.any_build:
                for other, theirs, their_s in self.cache.other_partials(key, build):
                    new = {i: {**row, "build": row.get("build", other)} for i, row in theirs.items() if i not in done}
                    if not new:
                        continue
                    # their wall time when every sample is taken, else the taken samples' own seconds
                    before += their_s if len(new) == len(theirs) else sum(r.get("seconds", 0.0) for r in new.values())
                    done = {**done, **new}
                    self.say(f"resuming {label}: {len(new)} samples of another build, {build_id(other)}")
            rows = dict(done)
            t0 = time.perf_counter()

            def save(i: int, row: dict[str, Any]) -> None:
                rows[i] = row
                self.cache.put_partial(key, build, rows, before + time.perf_counter() - t0)

            r = compute(dec, Resume(done, save))
            if st.dynamic:  # the k the last window / trial reached
                from ..runtime import factor_in_use

                r["factor_end"] = factor_in_use(self.llm)
            r["wall_s"] = before + time.perf_counter() - t0
            if any("build" in row for row in r.get("rows", [])):
                counts: dict[str, int] = {}
                for row in r["rows"]:
                    b = build_id(row["build"]) if "build" in row else build_id(build)
                    counts[b] = counts.get(b, 0) + 1
                r["sample_builds"] = counts
            self.cache.put(key, r, build)
            self.stats.computed += 1
            self.last_computed = True
            self.say(f"computed {label}")
        else:
            r, build = unit["result"], unit.get("build")
            self.stats.cached += 1
            self.say(f"cached   {label}")
        b = unit_build_label(build, r)
        self.builds[b] = self.builds.get(b, 0) + 1
        self.wall_s += r.get("wall_s", 0.0)
        return r

    def ppl(self, st: Setting, n_ctx: int, text: Text, *, score_from: int | None = None,
            max_windows: int | None = 1) -> dict[str, Any] | None:
        """Perplexity of ``text`` (:func:`ggufrope.evaluation.ppl.perplexity`): windows and their
        pooled summary (``ppl``, ``ppl_beyond``, ``ppl_within``, ...)."""

        def compute(dec: Decoder, resume: Resume) -> dict[str, Any]:  # one window: nothing to resume
            if text.name not in self._tokens:
                self._tokens[text.name] = dec.tokenize(text.text)
            ws = perplexity(dec, self._tokens[text.name], n_ctx, self.L, score_from=score_from,
                            max_windows=max_windows, progress=self.progress, desc=text.name)
            return {"windows": [dataclasses.asdict(w) for w in ws], **summarize_windows(ws)}

        return self.unit(st, n_ctx, self.ppl_key(st, n_ctx, text, score_from, max_windows),
                         f"{st.label()} @ {n_ctx} {text.name}", compute)

    def passkey(self, st: Setting, n_ctx: int, *, trials: int, seed: int, depths: list[float] | None, n_gen: int,
                truncate_from: int | None = None) -> dict[str, Any] | None:
        """Passkey retrieval (:func:`ggufrope.evaluation.passkey.passkey`); ``truncate_from``: the
        truncation baseline of prompts built for that n_ctx, cut to their last ``n_ctx``."""
        from .passkey import passkey

        key = self.passkey_key(st, n_ctx, trials, seed, depths, n_gen, truncate_from)
        label = f"{st.label()} @ {n_ctx} passkey" + (f" (prompts of {truncate_from}, truncated)" if truncate_from else "")
        return self.unit(st, n_ctx, key, label, lambda dec, resume: passkey(
            dec, truncate_from or n_ctx, trials=trials, seed=seed, depths=depths, n_gen=n_gen,
            progress=self.progress, keep_last=n_ctx if truncate_from else None, done=resume.done,
            on_trial=resume.save))

    def ruler(self, st: Setting, n_ctx: int, task: str, *, samples: int, seed: int,
              truncate_from: int | None = None) -> dict[str, Any] | None:
        """A RULER-lite task (:func:`ggufrope.evaluation.ruler.run_task`); ``truncate_from`` as
        for :meth:`passkey`."""
        from .ruler import run_task

        key = self.ruler_key(st, n_ctx, task, samples, seed, truncate_from)
        label = f"{st.label()} @ {n_ctx} {task}" + (f" (prompts of {truncate_from}, truncated)" if truncate_from else "")
        return self.unit(st, n_ctx, key, label, lambda dec, resume: run_task(
            dec, task, truncate_from or n_ctx, samples=samples, seed=seed,
            keep_last=n_ctx if truncate_from else None, progress=self.progress, done=resume.done,
            on_sample=lambda row: resume.save(row["index"], row)))

    def _free(self) -> None:
        if self.dec is not None:
            self.dec.close()
        self.dec = self.llm = None
        self._loaded = None

    def close(self) -> None:
        self._free()

    def __enter__(self) -> UnitRunner:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
