"""The hostile phase's statistics and bar on made-up gaps (no daemons, no timing)."""

from __future__ import annotations

import pytest

from soak.hostile_bar import GAP_RATIO, KindResult, percentile, verdict_lines
from soak.run import SoakReport

BASELINE = tuple([0.1] * 99 + [0.5])  # p99 by nearest rank: the 99th of 100 = 0.1


def test_p99_is_the_nearest_rank_and_none_without_values():
    assert percentile(BASELINE, 0.99) == 0.1
    assert percentile([0.1] * 98 + [0.5, 0.6], 0.99) == 0.5
    assert percentile([3.0], 0.99) == 3.0
    assert percentile([], 0.99) is None
    with pytest.raises(ValueError):
        percentile([1.0], 1.5)


def test_a_victim_within_twice_its_baseline_passes_and_past_it_fails():
    assert KindResult("k", victim_gaps=tuple([0.1 * GAP_RATIO] * 100), baseline_gaps=BASELINE).passed
    slow = KindResult("k", victim_gaps=tuple([0.1] * 95 + [4.0] * 5), baseline_gaps=BASELINE)
    assert slow.victim_gap_p99_s == 4.0 and slow.ratio == pytest.approx(40.0) and not slow.passed


def test_crashes_lost_or_refused_fail_a_kind_whatever_its_gaps():
    for bad in ({"crashes": 1}, {"lost": 1}, {"refused": 1}):
        assert not KindResult("k", victim_gaps=BASELINE, baseline_gaps=BASELINE, **bad).passed


def test_no_gaps_measured_fails_rather_than_passing_empty():
    assert not KindResult("k", victim_gaps=(), baseline_gaps=BASELINE).passed
    assert not KindResult("k", victim_gaps=BASELINE, baseline_gaps=()).passed


def test_the_json_entry_carries_both_p99s_and_the_verdict_lines_say_pass_or_fail():
    ok = KindResult("ebnf_ambiguous", victim_gaps=BASELINE, baseline_gaps=BASELINE)
    bad = KindResult("frame_flood", victim_gaps=(9.0,), baseline_gaps=BASELINE)
    entry = ok.as_dict()
    assert entry["victim_gap_p99_s"] == 0.1 and entry["baseline_gap_p99_s"] == 0.1 and entry["passed"]
    lines = verdict_lines([ok, bad])
    assert lines[0].startswith("hostile ebnf_ambiguous: PASS") and lines[1].startswith("hostile frame_flood: FAIL")
    assert lines[-1] == "hostile overall: FAIL"
    assert verdict_lines([ok])[-1] == "hostile overall: PASS"


def test_a_failed_hostile_kind_fails_the_whole_soak():
    report = SoakReport()
    report.hostile["ebnf_ambiguous"] = KindResult("ebnf_ambiguous", BASELINE, BASELINE).as_dict()
    assert report.passed
    report.hostile["frame_flood"] = KindResult("frame_flood", (9.0,), BASELINE).as_dict()
    assert not report.passed and report.as_dict()["hostile"]["frame_flood"]["passed"] is False
