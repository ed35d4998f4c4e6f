"""edged's escalation state machine (edged.escalation_state): every edge of the cloud call, the
stale events it ignores, and the verdict of every state."""

from __future__ import annotations

import itertools

import pytest

from edged.escalation_state import CLOUD_EDGES, Cloud, EscalationState, Local, Verdict


@pytest.mark.parametrize(("start", "target"), sorted(CLOUD_EDGES, key=lambda e: (e[0].value, e[1].value)))
def test_each_edge_of_the_cloud_call_moves_it(start, target):
    state = EscalationState(Local.RUNNING, start)
    assert state.cloud_to(target) and state.cloud is target


STALE = [(a, b) for a, b in itertools.product(Cloud, Cloud) if (a, b) not in CLOUD_EDGES]


@pytest.mark.parametrize(("start", "target"), STALE, ids=[f"{a.value}-{b.value}" for a, b in STALE])
def test_an_event_that_no_longer_applies_changes_nothing(start, target):
    """A cloud reply after the call was given up, a second failure, a result after a failure:
    ignored, and the caller learns it (False)."""
    state = EscalationState(Local.DONE, start)
    assert not state.cloud_to(target) and state.cloud is start


def test_the_edges_are_the_documented_ones():
    assert CLOUD_EDGES == {(Cloud.UNASKED, Cloud.WAITING), (Cloud.UNASKED, Cloud.FAILED),
                           (Cloud.WAITING, Cloud.ANSWERED), (Cloud.WAITING, Cloud.FAILED)}
    assert not any(start in (Cloud.ANSWERED, Cloud.FAILED) for start, _ in CLOUD_EDGES)  # both are final


def test_a_local_job_ends_once():
    state = EscalationState(Local.RUNNING)
    state.local_done()
    assert state.local is Local.DONE
    for local in (Local.DONE, Local.NONE):
        with pytest.raises(ValueError):
            EscalationState(local).local_done()


VERDICTS = {
    # the cloud's answer wins whatever the local job is doing
    (Local.NONE, Cloud.ANSWERED): Verdict.CLOUD,
    (Local.RUNNING, Cloud.ANSWERED): Verdict.CLOUD,
    (Local.DONE, Cloud.ANSWERED): Verdict.CLOUD,
    # a cloud call in flight is waited for, even with the local plan ready
    (Local.NONE, Cloud.WAITING): Verdict.WAIT,
    (Local.RUNNING, Cloud.WAITING): Verdict.WAIT,
    (Local.DONE, Cloud.WAITING): Verdict.WAIT,
    # without the cloud, the local job is the answer once it is done
    (Local.RUNNING, Cloud.UNASKED): Verdict.WAIT,
    (Local.DONE, Cloud.UNASKED): Verdict.LOCAL,
    (Local.RUNNING, Cloud.FAILED): Verdict.WAIT,
    (Local.DONE, Cloud.FAILED): Verdict.LOCAL,
    # the prompt fits only the cloud, and the cloud failed
    (Local.NONE, Cloud.FAILED): Verdict.UNAVAILABLE,
}


@pytest.mark.parametrize(("local", "cloud"), sorted(VERDICTS, key=lambda k: (k[0].value, k[1].value)))
def test_the_verdict_of_each_state(local, cloud):
    assert EscalationState(local, cloud).verdict() is VERDICTS[(local, cloud)]


def test_an_escalated_request_whose_cloud_fails_falls_back_to_its_local_plan():
    state = EscalationState(Local.RUNNING)
    assert state.cloud_to(Cloud.WAITING) and state.verdict() is Verdict.WAIT
    state.local_done()
    assert state.verdict() is Verdict.WAIT  # the local plan is ready; the cloud may still answer
    assert state.cloud_to(Cloud.FAILED) and state.verdict() is Verdict.LOCAL
    assert not state.cloud_to(Cloud.ANSWERED) and state.verdict() is Verdict.LOCAL  # too late
