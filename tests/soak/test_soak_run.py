"""A short soak end to end: real cloudd and edged on loopback with CURVE, both fuzzed, one fault
with plans in flight, every plan accounted for (the hostile phase, minutes of windows, is
``python -m soak --only hostile``'s). (``make soak`` runs the full one; this checks the
harness and the daemons' answers, not speed: no timing is asserted.)"""

from __future__ import annotations

from soak.run import SoakSettings, run_soak


def test_a_short_soak_loses_nothing_and_runs_nothing_twice():
    report = run_soak(SoakSettings(frames=2_000, http_requests=30, faults=("link_drop",), phases=("fuzz", "faults")),
                      log=lambda line: None)
    assert report.crashes == 0, report.details["crash_logs"]
    assert report.lost == 0 and report.duplicated == 0
    assert report.requests == 4 and set(report.faults) == {"link_drop"}
    for name in ("cloudd", "edged"):
        fuzz = report.fuzz[name]
        assert fuzz["frames"] == 2_000 and fuzz["answered"] + fuzz["dropped"] == 2_000
        assert fuzz["undecodable_replies"] == 0 and fuzz["health"]["failures"] == 0
        assert fuzz["health"]["probes"] > 0  # the prober process reported back
    assert report.fuzz["http"]["server_errors"] == 0 and report.fuzz["http"]["answered_after_idle"]
    for fault in report.faults.values():
        assert fault["kv_check"] == "ok" and fault["prefix_exact"], fault
