"""``ggufrope tune``: find the best training-free setting for *this* model at one n_ctx.

Why: the best exponent b and attention temperature depend on the model and the text (seed 000
suggests b = 0.625, Su's Llama-2 code 0.75; llama.cpp's best YaRN run at 4x combined a base
x5.72 with scale 0.75), so a user should not have to guess them.

**Objective.** Perplexity of the tokens predicted from positions >= L (``ppl_beyond``, see
:mod:`ggufrope.evaluation.ppl`) on calibration text: one window of n_ctx tokens per text,
cached per unit like the comparison grid, so an interrupted search resumes. With
``retrieval``, RULER-lite ``niah_single`` (:mod:`ggufrope.evaluation.ruler`) at n_ctx chooses
among the three best by perplexity, the seed default and NTK-aware at twice n_ctx / L (stage 6;
highest score wins, then lowest perplexity; stock YaRN is scored too, for the report):
perplexity beyond L does not rank retrieval (docs/results.md: on SmolLM2 at 2x the three best
by perplexity found 3, 4 and 6 needles of 10, the seed default 7, and NTK-aware at k = 4 with
the search's attention factor 1.035, 16th of 17 by perplexity, all 10).

**Search** (coarse to fine; every setting is a :class:`~ggufrope.evaluation.decoder.Setting`
with k = n_ctx / L unless the k stage changes it):

1. ``b``: NTK-RoPE-mixed with log-n at b in {0.5, 0.625, 0.75, 1} (b = 1 is NTK-RoPE-fixed,
   seed 000 eq. for lambda_i with exponent 1; b = 0.625 + log-n is the seed default);
2. ``b refine``: the midpoints between the best b and its neighbours, and one step below the
   grid (b = 0.375) when the best is its lowest b (the optimum may lie beyond the grid);
3. ``log-n``: the best with log-n switched;
4. ``attention``: a constant attention factor s in {1.035, 1.07} (llama.cpp's
   ``rope.scaling.attn_factor``, which scales cos/sin of Q and K, so the logits by s^2), on
   top of the best, and instead of log-n when the best has it (the temperature may be
   interior: seed 000's log-n is one schedule for it); when the best s is the largest tried,
   up to two steps further (1.105, 1.14: YaRN's own 1 + 0.1 ln k is 1.139 at k = 4) while
   they help, as ``b refine`` steps beyond the b grid; when s = 1.035 does not help the best,
   below 1 instead (0.965, then 0.93 while it helps: a flatter softmax, which log-n's sharpening
   cannot give);
5. ``k``: the best with k x 1.25, and x 1.5 if that helped;
6. ``NTK-aware``: method ntk (seed 001's base change) with the best's log-n and s, at k = n_ctx / L
   and at NTK_AWARE_K_STEP = 2 times that: at k = n_ctx / L its table leaves the pairs that do
   not turn within L beyond the angles seen in training (up to k^(1 - 2i/(d-2)) times, 1.29 at
   Gemma 3's pair 80 at 2x), so its k "has to be set higher than the expected scale" (YaRN paper,
   Peng et al. 2023, section 3.1). On Gemma 3 at 2x, k = 4 found 7 of 10 niah_single needles
   where k = 2 found none, at about YaRN's perplexity (docs/results.md, "Gemma 3 within L with
   k = 4"). After the k stage, so that it refines the NTK-mixed family's best (when NTK-aware
   came first and won, the k stage moved its k instead: Gemma 3 at 2x, 2026-11-29 (d));
7. ``dynamic``: the best with dynamic k (seed 002's consistent dynamic mode).

``quick`` runs stages 1, 3 and the first candidate of 4 only. References, not candidates:
stock llama.cpp's ``yarn`` and ``linear`` at k = n_ctx / L (what a user gets without
ggufrope); the report ranks them with the rest, and says so when one of them scores better than
the choice (then it is scored on the held-out text too: :func:`stock_rival`).

**Held-out check.** The chosen setting, the seed default and YaRN are scored on text the
search did not see (another document, or with ``--text`` a bundled one), and the report says
whether the choice beats both there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import GGUFRopeError
from .decoder import Setting

B_COARSE = (0.5, 0.625, 0.75, 1.0)
ATTN_FACTORS = (1.035, 1.07)
ATTN_STEP, ATTN_EDGE_STEPS = 0.035, 2
K_STEPS = (1.25, 1.5)
NTK_AWARE_K_STEP = 2.0
SEED_DEFAULT_B = 0.625


def candidate(method: str, *, b: float | None = None, logn: bool = False, attn: float = 1.0,
              k: float | None = None, dynamic: bool = False) -> Setting:
    """A setting of the search: ``ntk-mixed`` with b = 1 is written as ``ntk-fixed`` (the same
    table, seed 000); ``k`` None: k = n_ctx / L at evaluation."""
    if method == "ntk-mixed" and b is not None and b >= 1.0:
        method, b = "ntk-fixed", None
    return Setting.for_grid(method, None if dynamic else k, b, logn, dynamic, None, attn)


def max_settings(quick: bool = False) -> int:
    """The most settings :meth:`Search.run` evaluates (references included): the progress bar's
    total per calibration text. Full: 2 references, 4 b, 2 b refine, log-n, 4 attention factors,
    ATTN_EDGE_STEPS beyond them, NTK-aware at two k, one k per K_STEPS, dynamic; quick:
    references, b, log-n and one attention factor."""
    if quick:
        return 2 + len(B_COARSE) + 1 + 1
    return 2 + len(B_COARSE) + 2 + 1 + 2 * len(ATTN_FACTORS) + ATTN_EDGE_STEPS + 2 + len(K_STEPS) + 1


def seed_default() -> Setting:
    """NTK-RoPE-mixed, b = 0.625, with log-n: seed 000's recommendation, ``make demo``'s setting."""
    return candidate("ntk-mixed", b=SEED_DEFAULT_B, logn=True)


def references() -> list[Setting]:
    """Stock llama.cpp's options at k = n_ctx / L: YaRN and linear (PI)."""
    return [candidate("yarn"), candidate("linear")]


def _b_of(s: Setting) -> float:
    return 1.0 if s.method == "ntk-fixed" else float(s.exponent)


def _with(s: Setting, **kw: Any) -> Setting:
    f = {"method": s.method, "b": s.exponent if s.method == "ntk-mixed" else None, "logn": s.logn,
         "attn": s.attn_factor, "k": s.factor, "dynamic": s.dynamic}
    if s.method == "ntk-fixed":
        f["b"] = 1.0
        f["method"] = "ntk-mixed"
    f.update(kw)
    return candidate(f["method"], b=f["b"], logn=f["logn"], attn=f["attn"], k=f["k"], dynamic=f["dynamic"])


@dataclasses.dataclass
class Trial:
    setting: Setting
    stage: str
    score: float  #: calibration perplexity beyond L (lower is better)
    role: str = "candidate"  #: candidate | reference
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)


class Search:
    """The coarse-to-fine search over one objective ``score(setting) -> float`` (lower is
    better; called once per distinct setting, results memoized). ``k_auto``: n_ctx / L, the k
    the k stage multiplies."""

    def __init__(self, score: Callable[[Setting], float], k_auto: float, *, quick: bool = False,
                 log: Callable[[str], None] | None = None):
        self._score = score
        self.k_auto = float(k_auto)
        self.quick = quick
        self.log = log or (lambda s: None)
        self.trials: list[Trial] = []
        self._seen: dict[Setting, Trial] = {}

    def eval(self, s: Setting, stage: str, role: str = "candidate") -> Trial:
        if s in self._seen:
            return self._seen[s]
        t = Trial(s, stage, float(self._score(s)), role)
        self._seen[s] = t
        self.trials.append(t)
        self.log(f"{stage:>11}: {s.label()}: {t.score:.4f}")
        return t

    def best(self) -> Trial:
        c = [t for t in self.trials if t.role == "candidate"]
        if not c:
            raise GGUFRopeError("tune: no candidate was evaluated")
        return min(c, key=lambda t: t.score)

    def run(self) -> Trial:
        for r in references():
            self.eval(r, "reference", "reference")
        # 1. b, with log-n
        for b in B_COARSE:
            self.eval(candidate("ntk-mixed", b=b, logn=True), "b")
        # 2. refine b between the best and its neighbours
        if not self.quick:
            bb = _b_of(self.best().setting)
            grid = sorted(B_COARSE)
            i = grid.index(bb) if bb in grid else None
            if i is not None:
                for j in (i - 1, i + 1):
                    if 0 <= j < len(grid):
                        mid = round((grid[i] + grid[j]) / 2 * 64) / 64
                        self.eval(candidate("ntk-mixed", b=mid, logn=True), "b refine")
                if i == 0:  # the best is the lowest b tried: one step further down
                    self.eval(candidate("ntk-mixed", b=grid[0] - (grid[1] - grid[0]), logn=True), "b refine")
        # 3. log-n switched on the best
        top = self.best().setting
        self.eval(_with(top, logn=not top.logn), "log-n")
        # 4. a constant attention factor, on top of the best, and instead of log-n
        top = self.best().setting
        first = self.eval(_with(top, attn=ATTN_FACTORS[0]), "attention")
        if not self.quick:
            if first.score < self._seen[top].score:
                self.eval(_with(top, attn=ATTN_FACTORS[1]), "attention")
            else:  # a sharper softmax hurts: the optimum may lie below s = 1 (a flatter one)
                low = top
                for i in range(1, ATTN_EDGE_STEPS + 1):
                    t = self.eval(_with(top, attn=round(1 - i * ATTN_STEP, 4)), "attention")
                    if t.score >= self._seen[low].score:
                        break
                    low = t.setting
            if top.logn:
                for a in ATTN_FACTORS:
                    self.eval(_with(top, logn=False, attn=a), "attention")
            # the best s at the edge of the grid: the optimum may lie beyond it
            edge = ATTN_FACTORS[-1]
            for _ in range(ATTN_EDGE_STEPS):
                top = self.best().setting
                if round(top.attn_factor, 4) != round(edge, 4):
                    break
                edge = round(edge + ATTN_STEP, 4)
                self.eval(_with(top, attn=edge), "attention")
            # 5. k itself, on the best of the stages before
            top = self.best().setting
            if not top.dynamic:
                base = self._seen[top].score
                k0 = top.factor if top.factor is not None else self.k_auto
                for step in K_STEPS:
                    t = self.eval(_with(top, k=round(k0 * step, 4)), "k")
                    if t.score >= base:
                        break
                    base = t.score
            # 6. NTK-aware with the best's log-n and attention, at k = n_ctx / L and above it
            top = self.best().setting
            self.eval(candidate("ntk", logn=top.logn, attn=top.attn_factor), "NTK-aware")
            self.eval(candidate("ntk", logn=top.logn, attn=top.attn_factor,
                                k=round(self.k_auto * NTK_AWARE_K_STEP, 4)), "NTK-aware")
            # 7. dynamic k
            top = self.best().setting
            if not top.dynamic:
                self.eval(_with(top, k=None, dynamic=True), "dynamic")
        return self.best()

    def ranked(self) -> list[Trial]:
        return sorted(self.trials, key=lambda t: t.score)


def stock_rival(trials: Sequence[Trial], chosen: Trial) -> Trial | None:
    """The best stock reference (yarn, linear) when it scores better than ``chosen`` on the
    calibration text, else None: then stock llama.cpp already does better than any setting the
    search offers, and the report and the held-out check say so."""
    refs = [t for t in trials if t.role == "reference"]
    best = min(refs, key=lambda t: t.score, default=None)
    return best if best is not None and best.score < chosen.score else None


def ntk_aware_raised(t: Trial) -> bool:
    """Whether ``t`` is stage 6's NTK-aware candidate at NTK_AWARE_K_STEP times n_ctx / L (its
    other candidate leaves k at n_ctx / L, ``factor`` None)."""
    return t.stage == "NTK-aware" and t.setting.factor is not None


def choose_with_retrieval(trials: Sequence[Trial], retrieval: Callable[[Setting], float], top: int = 3) -> Trial:
    """Among the ``top`` candidates by perplexity, the seed default and NTK-aware at
    NTK_AWARE_K_STEP x n_ctx / L (each when the search measured it: the one setting of the
    search whose reason is retrieval, see stage 6, however it ranks by perplexity), the highest
    retrieval score (percent), then the lowest perplexity; stores the score in
    ``trial.extra["niah_single"]``. Stock YaRN (a reference, when the search measured it) is
    scored too, never chosen: the report compares the choice with it (:func:`retrieval_rival`).
    Raises GGUFRopeError when no candidate was evaluated."""
    cands = sorted((t for t in trials if t.role == "candidate"), key=lambda t: t.score)
    c = cands[:top] + [t for t in cands[top:] if t.setting == seed_default() or ntk_aware_raised(t)]
    if not c:
        raise GGUFRopeError("tune: no candidate was evaluated")
    yarn = [t for t in trials if t.role == "reference" and t.setting == candidate("yarn")]
    for t in c + yarn:
        t.extra["niah_single"] = float(retrieval(t.setting))
    return max(c, key=lambda t: (t.extra["niah_single"], -t.score))


def retrieval_rival(trials: Sequence[Trial], chosen: Trial) -> Trial | None:
    """Stock YaRN when its niah_single score (see :func:`choose_with_retrieval`) is higher than
    ``chosen``'s, else None."""
    y = next((t for t in trials if t.role == "reference" and "niah_single" in t.extra), None)
    c = chosen.extra.get("niah_single")
    return y if y is not None and c is not None and y.extra["niah_single"] > c else None


def pct(a: float, b: float) -> str:
    """``a`` relative to ``b`` in percent, signed (``-2.1 %`` = 2.1 % lower); a difference below
    0.05 % gets two decimals (``-0.01 %``, never ``-0.0 %``), none at all is ``0.0 %``."""
    x = 100.0 * (a / b - 1.0)
    if x == 0.0:
        return "0.0 %"
    return f"{x:+.2f} %" if abs(x) < 0.05 else f"{x:+.1f} %"


def markdown(trials: Sequence[Trial], chosen: Trial, *, n_ctx: int, L: int, texts: Sequence[str],
             held_out: dict[str, dict[str, float]] | None = None, held_texts: Sequence[str] = (),
             label: Callable[[Setting], str] | None = None, samples: int | None = None,
             builds: dict[str, int] | None = None) -> str:
    """The ranked table: rank, setting, stage, calibration perplexity beyond L, relative to the
    seed default and to YaRN (negative: better), niah_single where measured (``samples``: its
    sample count, for the note under the table); then the held-out check; then, when the units
    come from more than one library build (``builds``: units per :func:`ggufrope.evaluation.cache.build_id`),
    the report's line counting them (:func:`ggufrope.evaluation.report.builds_note`)."""
    lab = label or Setting.label
    by = {t.setting: t for t in trials}
    sd, yarn = by.get(seed_default()), by.get(candidate("yarn"))
    rows = sorted(trials, key=lambda t: t.score)
    has_r = any("niah_single" in t.extra for t in rows)
    has_w = any(t.extra.get("ppl_within") is not None for t in rows)
    head = ["#", "setting", "stage", f"ppl beyond L ({', '.join(texts)})", "vs seed default", "vs YaRN"]
    head += ["ppl within L"] if has_w else []
    head += ["niah_single"] if has_r else []
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(["---:", "---", "---"] + ["---:"] * (len(head) - 3)) + "|"]
    for i, t in enumerate(rows, 1):
        name = lab(t.setting) + (" (stock)" if t.role == "reference" else "")
        if t is chosen:
            name = f"**{name}** (chosen)"
        if sd is not None and t.setting == sd.setting:
            name += " (seed default)"
        cells = [str(i), name, t.stage, f"{t.score:.4f}", pct(t.score, sd.score) if sd else "–",
                 pct(t.score, yarn.score) if yarn else "–"]
        if has_w:
            w = t.extra.get("ppl_within")
            cells.append("–" if w is None else f"{w:.4f}")
        if has_r:
            cells.append(f"{t.extra['niah_single']:.0f} %" if "niah_single" in t.extra else "–")
        out.append("| " + " | ".join(cells) + " |")
    out.append("")
    out.append(f"n_ctx {n_ctx}, L {L}, k = n_ctx / L = {n_ctx / L:g} unless the row says k; perplexity of "
               "the tokens predicted from positions >= L (the objective), one window per text"
               + ("; within L: the tokens predicted from the scored positions < L (not used by the search)."
                  if has_w else "."))
    if has_r:
        n = "" if samples is None else f" over {samples} samples (seed 0)"
        out.append("")
        pool = "three best candidates by perplexity" + (
            f", the seed default and NTK-aware at k = {NTK_AWARE_K_STEP:g}·n_ctx/L"
            if any(map(ntk_aware_raised, trials)) else " and the seed default")
        out.append(f"niah_single: RULER-lite at n_ctx {n_ctx}{n}, percent of gold values found, run on the {pool} "
                   "(the best score is chosen, a tie goes to the lower perplexity), and on stock YaRN for comparison.")
        best = min((t for t in trials if t.role == "candidate"), key=lambda t: t.score)
        if best is not chosen:
            out.append(f"Retrieval changed the choice: the best by perplexity alone is {lab(best.setting)} "
                       f"({best.score:.4f}, niah_single {best.extra['niah_single']:.0f} %).")
    else:
        out.append("")
        out.append("Ranked by perplexity only, which does not rank retrieval (docs/results.md): add --retrieval "
                   "when the long context is for retrieval.")
    r_rival = retrieval_rival(trials, chosen)
    if r_rival is not None:
        out.append(f"Stock llama.cpp's {lab(r_rival.setting)} finds more needles than the choice "
                   f"({r_rival.extra['niah_single']:.0f} % against {chosen.extra['niah_single']:.0f} %): for retrieval "
                   "on this model at this n_ctx, llama.cpp's own --rope-scaling yarn does better.")
    rival = stock_rival(trials, chosen)
    if rival is not None:
        name = lab(rival.setting)
        out.append("")
        out.append(f"Stock llama.cpp's {name} scores better than the choice on the calibration text "
                   f"({rival.score:.4f} against {chosen.score:.4f}, {pct(rival.score, chosen.score)}): "
                   f"on this model at this n_ctx, llama.cpp's own --rope-scaling {rival.setting.method} "
                   "does better than the NTK-family settings searched.")
    if held_out:
        out.append("")
        out.append(f"Held-out check ({', '.join(held_texts)}, not used by the search):")
        out.append("")
        out.append("| setting | ppl beyond L | vs seed default | vs YaRN |")
        out.append("|---|---:|---:|---:|")
        h_sd, h_y = held_out.get("seed default"), held_out.get("yarn")
        for name, v in held_out.items():
            out.append(f"| {name} | {v['ppl_beyond']:.4f} | "
                       f"{pct(v['ppl_beyond'], h_sd['ppl_beyond']) if h_sd else '–'} | "
                       f"{pct(v['ppl_beyond'], h_y['ppl_beyond']) if h_y else '–'} |")
        ch = held_out.get("chosen")
        if ch and h_sd and h_y:
            beats = ch["ppl_beyond"] < h_sd["ppl_beyond"] and ch["ppl_beyond"] < h_y["ppl_beyond"]
            out.append("")
            out.append("The chosen setting " + ("beats" if beats else "does NOT beat") +
                       " both the seed default and YaRN on the held-out text.")
    if builds and len(builds) > 1:
        from .report import builds_note

        out.append("")
        out.append(builds_note(builds))
    return "\n".join(out) + "\n"


def setting_dict(s: Setting) -> dict[str, Any]:
    """The fields of a setting, JSON-serialisable."""
    return {"method": s.method, "factor": s.factor, "exponent": s.exponent, "logn": s.logn, "dynamic": s.dynamic,
            "attn_factor": s.attn_factor}


def write(model: str, out: str, s: Setting, n_ctx: int) -> str:
    """Apply ``s`` as tuned at ``n_ctx`` to a copy of ``model`` at ``out`` (atomic; ``model`` is
    not touched): ``ggufrope set``'s keys (:func:`ggufrope.rope_metadata.write_rope_metadata`; a
    static setting with its k, a dynamic one without), and an attention factor != 1 as
    llama.cpp's own ``{arch}.rope.scaling.attn_factor`` (hparams.rope_attn_factor, which
    multiplies the context's attention factor in every llama.cpp engine). Returns one line
    saying what was written. Raises GGUFRopeError for a stock method (yarn, linear), which
    ``set`` does not store."""
    from ..gguf_writer import set_keys
    from ..rope_metadata import read_rope_metadata, write_rope_metadata
    from .decoder import n_ctx_orig_of

    if s.method in ("yarn", "linear"):
        raise GGUFRopeError(f"tune --write: {s.method} is stock llama.cpp's own: pass --rope-scaling to llama.cpp")
    L = n_ctx_orig_of(model)
    k = None if s.dynamic else s.resolved_factor(n_ctx, L)
    res = write_rope_metadata(model, out, method=s.method, factor=k, exponent=s.exponent,
                              logn=s.logn, dynamic=True if s.dynamic else None)
    line = res.description or s.label(n_ctx, L)
    if s.attn_factor != 1.0:
        arch = read_rope_metadata(out)["architecture"]
        set_keys(out, None, {f"{arch}.rope.scaling.attn_factor": float(s.attn_factor)})
        line += f"; {arch}.rope.scaling.attn_factor = {s.attn_factor:g}"
    return line
