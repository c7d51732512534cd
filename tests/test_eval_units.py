"""ggufrope/evaluation/units.py: the progress bar over units (the unit runner itself is exercised
through the cache and the grid in test_eval_cache.py and test_eval_grid.py).

A resumed `tune` or `eval compare` reads its cached units in milliseconds, then computes units of
minutes: the bar's rate and ETA must count only the computed ones. Checked with tqdm's own
formatter on a fixed clock, numbers by hand.
"""

from __future__ import annotations

import io

from tqdm import tqdm

from ggufrope.evaluation import units as EU


def _frozen(bar, now: float) -> str:
    bar.start_t, bar._time = 0.0, (lambda: now)
    return tqdm.format_meter(**bar.format_dict)


def test_cached_units_move_the_bar_but_not_its_rate():
    bar = EU.unit_bar(11, "tune", file=io.StringIO())
    for _ in range(7):  # a resumed run: seven units from the cache
        EU.advance(bar, computed=False)
    EU.advance(bar, computed=True)  # then one computed unit, 512 s after the start
    line = _frozen(bar, 512.0)
    # 8/11 done; rate = 1 computed unit / 512 s; ETA = 3 units x 512 s = 1536 s = 25:36
    # (counted over all 8 units it would be 64 s a unit and 03:12)
    assert "8/11" in line and "512.00s/unit" in line and "<25:36" in line, line
    bar.close()


def test_without_cached_units_the_rate_is_the_plain_average():
    bar = EU.unit_bar(10, "compare", file=io.StringIO())
    EU.advance(bar, computed=True, n=2)
    EU.advance(bar, computed=True, n=2)
    line = _frozen(bar, 128.0)
    # 4 units in 128 s: 32 s a unit, 6 left: 192 s
    assert "4/10" in line and "32.00s/unit" in line and "<03:12" in line, line
    bar.close()


def test_a_cached_retrieval_unit_counts_its_samples():
    bar = EU.unit_bar(30, "tune", file=io.StringIO())
    EU.advance(bar, computed=False, n=10)
    assert bar.n == 10 and bar.initial == 10
    EU.advance(bar, computed=True, n=10)
    assert bar.n == 20 and bar.initial == 10
    bar.close()


def test_a_disabled_bar_takes_cached_units():
    bar = EU.unit_bar(3, "quiet", disable=True)
    EU.advance(bar, computed=False)
    EU.advance(bar, computed=True)
    bar.close()
