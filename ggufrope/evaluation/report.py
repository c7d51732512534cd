"""The reports of a comparison grid: the markdown table (seed 000's Table 1 shape) and the plot."""

from __future__ import annotations

import os
from typing import Any

from ..methods import dynamic_words

#: names of the seed's Table 1 (seed 000) for the rows of the markdown table
SEED_NAMES = {
    "none": "Baseline",
    "linear": "PI-RoPE (linear)",
    "yarn": "YaRN",
    "ntk": "NTK-RoPE (ntk, NTK-aware)",
    "ntk-fixed": "NTK-RoPE-fixed",
    "ntk-mixed": "NTK-RoPE-mixed",
}


def _row_name(method: str, logn: bool, exponent: float | None, dynamic: bool = False, attn_factor: float = 1.0,
              factor: float | None = None) -> str:
    """A row's name: the seed's name of the method, b (ntk-mixed), ``k=`` when the grid gave a
    factor k (-k) to a static row (else k = n_ctx/L, named in the notes), dyn, log n, attn×s."""
    name = SEED_NAMES.get(method, method)
    if method == "ntk-mixed" and exponent is not None:
        name += f" (b={exponent:g})"
    if factor is not None and method != "none" and not dynamic:
        name += f" k={factor:g}"
    return (name + (" dyn" if dynamic else "") + (" + log n" if logn else "")
            + (f" attn×{attn_factor:g}" if attn_factor != 1.0 else ""))


def markdown_table(res: dict[str, Any]) -> str:
    """Seed 000's Table 1 shape: rows = methods without and with log-n (static k, then dynamic
    k where the grid has it), columns = contexts, cells = perplexity beyond L / passkey
    accuracy. A grid with neither (no texts, --trials 0 and no cell with a perplexity: retrieval
    only) gets one line saying so instead of a table of dashes, then the same notes (k, builds,
    command)."""
    L = res["model"]["n_ctx_orig"]
    g = res["grid"]
    if not g["texts"] and not g["trials"] and all(c.get("ppl") is None for c in res["cells"]):
        notes = ["No perplexity or passkey table: this grid scored no text (--no-ppl) and ran no passkey "
                 "trials (--trials 0); its RULER-lite table follows."]
        notes += _grid_notes(res)
        return "\n".join(notes) + "\n"
    ctxs = g["n_ctx"]
    by = {(c["method"], c["logn"], c.get("dynamic", False), c["n_ctx"]): c for c in res["cells"]}
    head = ["method"] + [f"{c} ({c / L:.3g}×L)" for c in ctxs]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(ctxs)) + "|"]
    any_paren = False
    rows = [(m, ln, dyn) for m in g["methods"] for dyn in g.get("dynamic", [False]) for ln in g["logn"]
            if (m, ln, dyn, ctxs[0]) in by]
    for m, ln, dyn in rows:
        cells = []
        for c in ctxs:
            cell = by[(m, ln, dyn, c)]
            if cell["ppl_beyond"] is not None:
                p = f"{cell['ppl_beyond']:.3f}"
            elif cell["ppl"] is not None:
                p = f"({cell['ppl']:.3f})"
                any_paren = True
            else:
                p = "–"
            a = "–" if cell["passkey_accuracy"] is None else f"{100 * cell['passkey_accuracy']:.0f}%"
            cells.append(f"{p} / {a}")
        lines.append(f"| {_name(res, m, ln, dyn)} | "
                     + " | ".join(cells) + " |")
    notes = [
        "",
        f"Cells: perplexity of the tokens predicted from positions ≥ L = {L} (lower is better) / "
        + (f"passkey retrieval accuracy over {g['trials']} trials (higher is better; – = not run)."
           if g["trials"] else "– (no passkey trials in this grid: --trials 0)."),
    ]
    if any_paren:
        notes.append("A perplexity in parentheses is over all scored tokens: at that context no scored token is beyond L.")
    texts = ", ".join(t["name"] for t in g["texts"]) or "none"
    sf = "n_ctx/2" if g["score_from"] is None else str(g["score_from"])
    notes += _grid_notes(res, f"Texts: {texts}; windows per text: {g['max_windows'] or 'all'}; scored from "
                         f"position {sf} of each window (llama-perplexity's protocol).")
    return "\n".join(lines + notes) + "\n"


def _grid_notes(res: dict[str, Any], texts_line: str | None = None) -> list[str]:
    """The notes under :func:`markdown_table`: factor k per context, the attention factor, dynamic
    k, ``texts_line`` (the documents scored) where given, the builds and the command."""
    g = res["grid"]
    notes = []
    ks = sorted({(c["n_ctx"], c["factor"]) for c in res["cells"] if c["factor"] is not None})
    if ks:
        notes.append("Factor k per context: " + ", ".join(f"{c}: k = {k:g}" for c, k in sorted(set(ks))) + ".")
    if g.get("attn_factor", 1.0) != 1.0:
        notes.append(f"attn×{g['attn_factor']:g}: a constant attention scale s on every method row (llama.cpp's "
                     "yarn_attn_factor: cos/sin of Q and K times s, logits times s²).")
    if any(c.get("dynamic") for c in res["cells"]):
        notes.append(f"dyn: {dynamic_words()} (llama.cpp chooses k as each window fills; no fixed k).")
    if texts_line:
        notes.append(texts_line)
    if res.get("builds"):
        notes.append(builds_note(res["builds"]))
    if res.get("command"):
        notes.append(f"Command: `{res['command']}`")
    return notes


def relative_ppl(res: dict[str, Any]) -> tuple[str, list[tuple[str, list[float | None]]]]:
    """For a grid of one context: each row's perplexity beyond L per document (the grid's texts,
    in order) divided by the reference row's on the same document: YaRN (static, no log n) where
    the grid has it run on every document, else the lowest row on each document. Returns
    (reference name, [(row name, [ratio or None where not run, per document])]), the rows that
    have at least one document run, in report order (the truncation baseline has no perplexity)."""
    texts = [t["name"] for t in res["grid"]["texts"]]
    c0 = res["grid"]["n_ctx"][0]
    by = {(c["method"], c["logn"], c.get("dynamic", False)): c for c in res["cells"] if c["n_ctx"] == c0}

    def beyond(key: tuple, t: str) -> float | None:
        d = (by.get(key) or {}).get("ppl_by_text", {}).get(t) or {}
        return d.get("ppl_beyond")

    rows = [r for r in _rows(res) if r[0] != "truncate"]
    ref_key = ("yarn", False, False)
    if all(beyond(ref_key, t) is not None for t in texts):
        ref_name, ref = "YaRN", [beyond(ref_key, t) for t in texts]
    else:
        ref_name = "the lowest row on each document"
        ref = [min((v for r in rows if (v := beyond(r, t)) is not None), default=None) for t in texts]
    out = []
    for r in rows:
        vals = [beyond(r, t) for t in texts]
        if any(v is not None for v in vals):
            out.append((_name(res, *r), [None if v is None or b is None else v / b for v, b in zip(vals, ref)]))
    return ref_name, out


def _plot_rows(res: dict[str, Any], path: str | os.PathLike) -> None:
    """One context: per row, perplexity beyond L in % against the reference on each document
    (:func:`relative_ppl`; rows far off are clipped at the axis and labelled) and, where the
    grid has retrieval, the retrieval scores."""
    import matplotlib.pyplot as plt

    fig = _rows_figure(res)
    if fig is None:
        return _plot_lines(res, path)
    fig.savefig(path)
    plt.close(fig)


def _rows_figure(res: dict[str, Any]):
    """The figure of :func:`_plot_rows` (None when the grid has nothing to draw as rows). A cell
    not run yet is marked "<column>: not run" in its slot, so that an empty slot does not read as
    a zero (the truncation baseline, which has no perplexity, gets no mark there)."""
    import matplotlib.pyplot as plt
    import numpy as np

    g = res["grid"]
    texts = [t["name"] for t in g["texts"]]
    ref_name, rel = relative_ppl(res)
    if ref_name != "YaRN" and len(rel) < 2:
        rel = []  # one row against itself says nothing
    tasks = _retrieval_tasks(g)
    by = {(c["method"], c["logn"], c.get("dynamic", False)): c for c in res["cells"]}
    scores = [(r, _retrieval_scores(by.get(r) or {}, tasks)) for r in _rows(res)]
    ret = [(_name(res, *r), vals) for r, vals in scores if any(v is not None for v in vals)]
    # perplexity as % against the reference; the axis shows the close rows, a far one is clipped
    # at the edge and labelled with its value
    pct = [(n, [None if v is None else 100 * (v - 1) for v in vs]) for n, vs in rel]
    panels = [(p, cols) for p, cols in ((pct, texts), (ret, tasks)) if p]
    if not panels:
        return None
    names = list(dict.fromkeys([n for p, _ in panels for n, _ in p]))
    no_ppl = _name(res, "truncate", False, False)  # the baseline has no perplexity: not "not run"
    y = np.arange(len(names))
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 1.5, 0.32 * len(names) + 1.6), dpi=100,
                             sharey=True, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    near = [abs(v) for _, vs in pct for v in vs if v is not None and abs(v) < 50]
    lim = max(5.0, 1.15 * max(near, default=5.0))
    for ax, (panel, cols) in zip(axes[0], panels):
        vals = dict(panel)
        h = 0.8 / len(cols)
        for j, col in enumerate(cols):
            pts = [(yy - 0.4 + h * (j + 0.5), vals[n][j]) for yy, n in zip(y, names)
                   if n in vals and vals[n][j] is not None]
            shown = [max(-lim, min(lim, x)) for _, x in pts] if panel is pct else [x for _, x in pts]
            ax.barh([yy for yy, _ in pts], shown, height=h, color=colors[j % len(colors)], label=col)
            for (yy, x), xs in zip(pts, shown):
                if panel is not pct:
                    ax.text(xs + 1, yy, f"{x:.0f}", va="center", fontsize=6)
                elif x != xs:
                    ax.text(xs - 0.02 * lim if x > 0 else xs + 0.02 * lim, yy, f"{x:+.0f} %", va="center",
                            ha="right" if x > 0 else "left", fontsize=6, color="white")
            x_mark = -0.98 * lim if panel is pct else 1.0
            for yy, n in zip(y, names):
                if (vals[n][j] if n in vals else None) is None and not (panel is pct and n == no_ppl):
                    ax.text(x_mark, yy - 0.4 + h * (j + 0.5), f"{col}: not run", va="center", ha="left", fontsize=5,
                            color="gray")
        if panel is pct:
            ax.set_xlim(-lim, lim)
            ax.axvline(0.0, color="gray", linewidth=0.8)
            ax.set_xlabel(f"perplexity beyond L, % against {ref_name} (lower is better)")
        else:
            ax.set_xlim(0, 108)
            ax.set_xlabel("retrieval score, % (higher is better)")
        ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=len(cols), frameon=False)
        ax.grid(axis="x", linewidth=0.3)
    axes[0][0].set_yticks(y, names, fontsize=7)
    axes[0][0].invert_yaxis()
    fig.suptitle(f"{res['model']['name']} (L = {res['model']['n_ctx_orig']}), n_ctx {g['n_ctx'][0]}", fontsize=9)
    fig.tight_layout()
    return fig


def plot(res: dict[str, Any], path: str | os.PathLike) -> None:
    """The PNG of a grid (Agg backend, small). Several contexts: perplexity (beyond L, else over all
    scored tokens) against context, one line per method, dashed with log-n. One context with
    several documents or retrieval: per row, bars of perplexity beyond L in % against YaRN on each
    document (:func:`relative_ppl`) beside the retrieval scores."""
    import matplotlib

    matplotlib.use("Agg")
    g = res["grid"]
    if len(g["n_ctx"]) == 1 and (len(g["texts"]) > 1 or g.get("ruler_tasks")):
        return _plot_rows(res, path)
    return _plot_lines(res, path)


def _plot_lines(res: dict[str, Any], path: str | os.PathLike) -> None:
    import matplotlib.pyplot as plt

    L = res["model"]["n_ctx_orig"]
    g = res["grid"]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, m in enumerate(g["methods"]):
        for dyn in g.get("dynamic", [False]):
            for ln in g["logn"]:
                xs, ys = [], []
                for c in res["cells"]:
                    if c["method"] == m and c["logn"] == ln and c.get("dynamic", False) == dyn:
                        y = c["ppl_beyond"] if c["ppl_beyond"] is not None else c["ppl"]
                        if y is not None:
                            xs.append(c["n_ctx"])
                            ys.append(y)
                if xs:
                    ax.plot(xs, ys, marker="s" if dyn else "o", linestyle=(":" if dyn else "--") if ln else
                            ("-." if dyn else "-"), color=colors[i % len(colors)],
                            label=m + (" dyn" if dyn else "") + (" + log n" if ln else ""))
    ax.axvline(L, color="gray", linewidth=0.8, linestyle=":", label=f"L = {L}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context n_ctx (tokens)")
    ax.set_ylabel("perplexity beyond L (else all scored)")
    ax.set_title(f"{res['model']['name']} (L = {L})", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _rows(res: dict[str, Any]) -> list[tuple[str, bool, bool]]:
    g = res["grid"]
    keys = {(c["method"], c["logn"], c.get("dynamic", False)) for c in res["cells"]}
    rows = [(m, ln, dyn) for m in g["methods"] for dyn in g.get("dynamic", [False]) for ln in g["logn"]
            if (m, ln, dyn) in keys]
    return rows + ([("truncate", False, False)] if ("truncate", False, False) in keys else [])


def _name(res: dict[str, Any], m: str, ln: bool, dyn: bool) -> str:
    if m == "truncate":
        return f"Truncation baseline (last L = {res['model']['n_ctx_orig']} tokens, none)"
    g = res["grid"]
    return _row_name(m, ln, g["exponent"] if m == "ntk-mixed" else None, dyn, g.get("attn_factor", 1.0), g.get("factor"))


def _ppl_by_text(res: dict[str, Any]) -> list[tuple[str, list[dict[str, Any] | None]]]:
    """Per row of the per-document table (the truncation row left out): its name and, per
    context x document, the cell's ``ppl_by_text`` entry (None: not run)."""
    g = res["grid"]
    texts = [t["name"] for t in g["texts"]]
    by = {(c["method"], c["logn"], c.get("dynamic", False), c["n_ctx"]): c for c in res["cells"]}
    return [(_name(res, m, ln, dyn), [((by.get((m, ln, dyn, c)) or {}).get("ppl_by_text") or {}).get(t) or None
                                      for c in g["n_ctx"] for t in texts])
            for m, ln, dyn in _rows(res) if m != "truncate"]


def ppl_windows(res: dict[str, Any]) -> tuple[int, int]:
    """(windows with a result, windows) of :func:`ppl_by_text_table`: one window per row x
    context x document."""
    cells = [d for _, row in _ppl_by_text(res) for d in row]
    return sum(d is not None for d in cells), len(cells)


def ppl_by_text_table(res: dict[str, Any]) -> str:
    """Rows = methods, columns = context x document; cells = perplexity beyond L / within L
    (tokens predicted from positions < L, when the grid scores any: ``--score-from`` < L)."""
    g = res["grid"]
    texts = [t["name"] for t in g["texts"]]
    ctxs = g["n_ctx"]
    L = res["model"]["n_ctx_orig"]
    head = ["method"] + [f"{t} @ {c} ({c / L:.3g}×L)" for c in ctxs for t in texts]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for name, row in _ppl_by_text(res):
        cells = ["–" if d is None else " / ".join(["–" if v is None else f"{v:.3f}"
                                                   for v in (d.get("ppl_beyond"), d.get("ppl_within"))])
                 for d in row]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", f"Cells: perplexity beyond L (tokens predicted from positions ≥ {L}) / within L "
                              f"(positions {g['score_from'] if g['score_from'] is not None else 'n_ctx/2'} … {L - 1}; "
                              "– where none is scored), one window per document."]) + "\n"


def _retrieval_tasks(g: dict[str, Any]) -> list[str]:
    """The retrieval columns of grid ``g``: passkey (when it has trials), then its RULER-lite tasks."""
    return (["passkey"] if g.get("trials") else []) + list(g.get("ruler_tasks", []))


def _retrieval_scores(cell: dict[str, Any], tasks: list[str]) -> list[float | None]:
    """A cell's score in percent per task (passkey: accuracy; RULER-lite: string_match_all), None
    where not run."""
    out: list[float | None] = []
    for t in tasks:
        if t == "passkey":
            a = cell.get("passkey_accuracy")
            out.append(None if a is None else 100 * a)
        else:
            out.append(((cell.get("ruler") or {}).get(t) or {}).get("score"))
    return out


def retrieval_table(res: dict[str, Any]) -> str:
    """Rows = methods and the truncation baseline, columns = context x task (passkey, RULER-lite
    tasks); cells = score in percent (RULER's string_match_all; passkey: accuracy)."""
    g = res["grid"]
    tasks = _retrieval_tasks(g)
    ctxs = g["n_ctx"]
    L = res["model"]["n_ctx_orig"]
    by = {(c["method"], c["logn"], c.get("dynamic", False), c["n_ctx"]): c for c in res["cells"]}
    head = ["method"] + [f"{t} @ {c}" for c in ctxs for t in tasks]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    controls = []
    rows = _rows(res)
    for m, ln, dyn in rows:
        cells = []
        for c in ctxs:
            cell = by.get((m, ln, dyn, c)) or {}
            cells += ["–" if v is None else f"{v:.0f}" for v in _retrieval_scores(cell, tasks)]
            controls += [r["control"] for t in tasks if (r := (cell.get("ruler") or {}).get(t)) is not None]
        lines.append(f"| {_name(res, m, ln, dyn)} | " + " | ".join(cells) + " |")
    n = g.get("samples") if g.get("ruler_tasks") else None
    what = ([f"passkey accuracy over {g['trials']} trials"] if g.get("trials") else []) + (
        [f"RULER-lite string_match_all over {n} samples a cell"] if n else [])
    notes = ["", "Cells: retrieval score in percent (higher is better; – = not run): " + "; ".join(what) + "."]
    if controls:
        notes.append(f"Shuffled control (each answer graded against another sample's gold): at most "
                     f"{max(controls):.0f} % in any cell.")
    if ("truncate", False, False) in rows:  # no row within L, nor with --no-truncation and none cached
        notes.append(f"Truncation baseline: the same prompts cut to their last L = {L} tokens, no method, n_ctx = L.")
    return "\n".join(lines + notes) + "\n"


def builds_note(builds: dict[str, int]) -> str:
    """One line naming the library builds that computed the units and how many each
    (``builds``: units per :func:`ggufrope.evaluation.cache.build_id`)."""
    names = {"unrecorded": "a build not recorded (units cached before builds were)"}
    return "Units computed by: " + "; ".join(
        f"{names.get(b, b)} ({n} unit{'s' if n != 1 else ''})" for b, n in sorted(builds.items())) + "."


def report_markdown(res: dict[str, Any]) -> str:
    """``results.md``: :func:`markdown_table`, then, where the grid has them, the perplexity by
    document (several texts, or within-L tokens scored) and the retrieval table (RULER-lite tasks
    or truncation-baseline rows)."""
    g = res["grid"]
    parts = [markdown_table(res)]
    within = g.get("score_from") is not None and g["score_from"] < res["model"]["n_ctx_orig"]
    if len(g["texts"]) > 1 or (g["texts"] and within):
        parts.append(ppl_by_text_table(res))
    if g.get("ruler_tasks") or any(c["method"] == "truncate" for c in res["cells"]):
        parts.append(retrieval_table(res))
    return "\n".join(parts)
