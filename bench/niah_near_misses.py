#!/usr/bin/env python3
"""Near misses in the committed niah_single and passkey units: answers that score 0 (RULER's
``string_match_all``; the passkey's "key in answer", the same test for one gold) but hold the
needle's or key's tail, so the model found it and got its first digit or two wrong
(": 1371038." for the needle 2371038, " 19755." for the key 49755).

    .venv/bin/python bench/niah_near_misses.py [--cache docs/results/cache]

Reads every finished ``ruler-*.json`` unit of task niah_single and every ``passkey-*.json``
unit in the cache (``.partial`` files are not read; computes nothing) and prints, per task,
model and n_ctx, a markdown table: the cells, their answers, how many found the needle (the
7-digit value) or the 5-digit key, and how many were near misses, split by how many leading
digits they got wrong (one: all but the first digit are there; two: all but the first two,
counted for 7-digit needles only, so that at least five digits match), and the first digit of
each near-miss number. Model names come from :data:`ggufrope.models.MODELS` by the unit's GGUF
sha256.
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
    first digit is missing (all its characters but the first are there), ``"two"`` when only
    its first two are (7-digit golds only: five digits must match), else ``"miss"``. ``gold`` is
    a 7-digit needle or a 5-digit passkey; golds shorter than 5 are ``"found"`` or ``"miss"``
    only."""
    from ggufrope.evaluation.ruler import score

    if score(answer, [gold]) == 1.0:
        return "found"
    if len(gold) >= 5 and gold[1:] in answer:
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


def _golds(unit: dict) -> tuple[str, list[tuple[str, str]]] | None:
    """(task, [(gold, answer)]) of a niah_single or passkey unit (by its key's ``kind`` and
    ``task``), None for any other."""
    if unit["key"].get("kind") == "passkey":
        return "passkey", [(str(row["key"]), row["answer"]) for row in unit["result"]["rows"]]
    if unit["key"].get("task") != "niah_single":
        return None
    return "niah_single", [(row["gold"][0], row["answer"]) for row in unit["result"]["rows"]]  # one needle


def count(cache: pathlib.Path) -> dict[tuple[str, str, int], dict]:
    """(task, model name, n_ctx) -> {"cells", "answers", "found", "one", "two", "lead": Counter}
    over the finished niah_single and passkey units in ``cache``."""
    from ggufrope.models import MODELS

    names = {m.sha256: m.name for m in MODELS.values()}
    out: dict[tuple[str, str, int], dict] = {}
    for f in sorted([*cache.glob("ruler-*.json"), *cache.glob("passkey-*.json")]):
        unit = json.loads(f.read_text())
        got = _golds(unit)
        if got is None:
            continue
        task, rows = got
        key = unit["key"]
        name = names.get(key["model"]["sha256"], key["model"]["sha256"][:12])
        c = out.setdefault((task, name, key["n_ctx"]), {"cells": 0, "answers": 0, "found": 0, "one": 0,
                                                        "two": 0, "lead": collections.Counter()})
        c["cells"] += 1
        for gold, answer in rows:
            kind = classify(gold, answer)
            c["answers"] += 1
            if kind in ("found", "one", "two"):
                c[kind] += 1
            if kind in ("one", "two"):
                c["lead"][first_number(answer, gold[1:] if kind == "one" else gold[2:])[:1]] += 1
    return out


def table(counts: dict[tuple[str, str, int], dict]) -> str:
    lines = ["| task | model | n_ctx | cells | answers | found | near misses (first digit wrong / first two) "
             "| first digit of the near misses |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for (task, name, n_ctx), c in sorted(counts.items(), key=lambda kv: (kv[0][0] != "niah_single", kv[0])):
        lead = ", ".join(f'"{d}" ×{n}' for d, n in sorted(c["lead"].items())) or "–"
        lines.append(f"| {task} | {name} | {n_ctx} | {c['cells']} | {c['answers']} | {c['found']} "
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
