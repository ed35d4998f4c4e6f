"""How the soak counts a plan: answered once, late past its deadline plus the margin, or lost."""

from __future__ import annotations

from soak.plans import LATE_MARGIN_S, Outcome, PlanAsk
from soak.run import SoakReport, _account


def outcome(answer: str | None, took_s: float | None, deadline_ms: int | None = 1_000) -> Outcome:
    o = Outcome(PlanAsk("amr-001", "go", deadline_ms=deadline_ms), "amr-001/x", sent_at=100.0)
    if took_s is not None:
        o.answered_at, o.answer = 100.0 + took_s, answer
    return o


def test_an_answer_within_the_deadline_and_margin_is_on_time_whatever_it_says():
    for answer in ("plan:cloud", "DeadlineExceeded", "Unavailable", "Rejected"):
        o = outcome(answer, 1.0 + LATE_MARGIN_S - 0.01)
        assert not o.late and not o.lost


def test_an_answer_past_the_margin_is_late_and_none_at_all_is_lost():
    assert outcome("plan:cloud", 1.0 + LATE_MARGIN_S + 0.01).late
    assert outcome(None, None).lost and not outcome(None, None).late
    assert outcome("lost:RuntimeError: boom", 0.1).lost  # not a robot_sdk error: a bug
    assert not outcome("plan:edge", 500.0, deadline_ms=None).late  # no deadline: never late


def test_the_report_sums_outcomes_and_fails_on_any_lost_or_late_plan():
    report = SoakReport()
    _account(report, [outcome("plan:cloud", 0.5), outcome("Unavailable", 0.5)])
    assert (report.requests, report.lost, report.late) == (2, 0, 0) and report.passed
    _account(report, [outcome(None, None)])
    assert report.lost == 1 and not report.passed
