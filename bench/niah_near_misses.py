#!/usr/bin/env python3
"""Near misses in the committed niah_single units: answers that score 0 under RULER's
``string_match_all`` but hold the needle's last five digits, so the model found the needle
and got its first digit or two wrong (": 1371038." for 2371038).

    .venv/bin/python bench/niah_near_misses.py [--cache docs/results/cache]

Reads every finished ``ruler-*.json`` unit of task niah_single in the cache (``.partial``
files are not read; computes nothing) and prints, per model and n_ctx, a markdown table: the
cells, their answers, how many found the 7-digit needle (RULER's score), and how many were
near misses, split by how many leading digits they got wrong (one: the last six digits are
there; two: only the last five), and the first digit of each near-miss number. Model names
come from :data:`ggufrope.models.MODELS` by the unit's GGUF sha256.
"""

from __future__ import annotations

import argparse
import collections
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def classify(gold: str, answer: str) -> str:
    """``"found"`` when RULER's string match finds ``gold`` in ``answer``
    (:func:`ggufrope.evaluation.ruler.score`), ``"one"`` when only its
    first digit is missing (its last six characters are there), ``"two"`` when its last five
    are and its last six are not, else ``"miss"``. ``gold`` is a 7-digit needle; shorter golds
    are ``"found"`` or ``"miss"`` only."""
    from ggufrope.evaluation.ruler import score

    if score(answer, [gold]) == 1.0:
        return "found"
    if len(gold) == 7 and gold[1:] in answer:
        return "one"
    if len(gold) == 7 and gold[2:] in answer:
        return "two"
    return "miss"


def first_number(answer: str, tail: str) -> str:
    """The run of digits in ``answer`` that holds ``tail`` (e.g. "1371038" for tail "71038")."""
    for m in re.finditer(r"\d+", answer):
        if tail in m.group():
            return m.group()
    return ""


def count(cache: pathlib.Path) -> dict[tuple[str, int], dict]:
    """(model name, n_ctx) -> {"cells", "answers", "found", "one", "two", "lead": Counter} over the
    finished niah_single units in ``cache``."""
    from ggufrope.models import MODELS

    names = {m.sha256: m.name for m in MODELS.values()}
    out: dict[tuple[str, int], dict] = {}
    for f in sorted(cache.glob("ruler-*.json")):
        unit = json.loads(f.read_text())
        key = unit["key"]
        if key.get("task") != "niah_single":
            continue
        name = names.get(key["model"]["sha256"], key["model"]["sha256"][:12])
        c = out.setdefault((name, key["n_ctx"]), {"cells": 0, "answers": 0, "found": 0, "one": 0, "two": 0,
                                                  "lead": collections.Counter()})
        c["cells"] += 1
        for row in unit["result"]["rows"]:
            (gold,) = row["gold"]  # niah_single has one needle
            kind = classify(gold, row["answer"])
            c["answers"] += 1
            if kind in ("found", "one", "two"):
                c[kind] += 1
            if kind in ("one", "two"):
                c["lead"][first_number(row["answer"], gold[2:])[:1]] += 1
    return out


def table(counts: dict[tuple[str, int], dict]) -> str:
    lines = ["| model | n_ctx | cells | answers | found | near misses (first digit wrong / first two) "
             "| first digit of the near misses |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for (name, n_ctx), c in sorted(counts.items()):
        lead = ", ".join(f'"{d}" ×{n}' for d, n in sorted(c["lead"].items())) or "–"
        lines.append(f"| {name} | {n_ctx} | {c['cells']} | {c['answers']} | {c['found']} "
                     f"| {c['one'] + c['two']} ({c['one']} / {c['two']}) | {lead} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=pathlib.Path, default=ROOT / "docs/results/cache")
    a = ap.parse_args(argv)
    if not a.cache.is_dir():
        print(f"niah_near_misses: error: no cache directory {a.cache}", file=sys.stderr)
        return 2
    print(table(count(a.cache)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
