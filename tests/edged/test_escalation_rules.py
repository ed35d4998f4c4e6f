"""The escalation rules and the circuit breaker, without processes."""

from __future__ import annotations

import pytest

from edged.circuit import BreakerState, CircuitBreaker
from edged.escalation import EscalationConfig, EscalationPolicy, EscalationReason, plan_is_valid
from edged.generation import LocalJob
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.grammar.response_format import fleet_plan_format, grammar_spec
from shared.engine.request import FinishReason
from shared.engine.sampling_params import SamplingParams
from shared.protocol.messages import Escalation, Generate, Sampling

CLOUD = EscalationConfig(cloud_endpoint="tcp://127.0.0.1:1", escalate_tags=("multi-floor",), min_mean_logprob=-1.0)
PLAN = grammar_spec(fleet_plan_format())
VALID = '{"steps": [{"skill": "goto", "args": {"waypoint": "dock 2", "speed": 0.5}}], "done": true, "confidence": 0.9}'


def msg(**kw) -> Generate:
    return Generate("r", prompt_ids=(1, 2, 3), sampling=Sampling(max_tokens=kw.pop("max_tokens", 32)), **kw)


def finished(text: str, logprobs: list[float], reason=FinishReason.STOP) -> LocalJob:
    job = LocalJob("r", [1], SamplingParams(), IncrementalDetokenizer(None), generated=[7] * len(logprobs))
    job.text, job.raw_logprob_sum, job.finish_reason = text, sum(logprobs), reason
    return job


@pytest.mark.parametrize("kw, prompt, wait, expected", [
    ({}, 10, 0.5, None),
    ({"escalation": Escalation.CLOUD}, 10, 0.5, EscalationReason.REQUESTED),
    ({}, 1000, 0.5, EscalationReason.CONTEXT),
    ({"tags": ("multi-floor",)}, 10, 0.5, EscalationReason.TAGS),
    ({"tags": ("pick",)}, 10, 0.5, None),
    ({"deadline_ms": 400}, 10, 0.5, EscalationReason.LOCAL_QUEUE),
    ({"deadline_ms": 600}, 10, 0.5, None),
    ({"escalation": Escalation.LOCAL, "tags": ("multi-floor",), "deadline_ms": 1}, 10, 9.0, None),
    # a prompt with no room left for a token: no local run, whatever was asked (forced local is
    # then refused); one that fits with its output cut short may still be forced
    ({"escalation": Escalation.LOCAL}, 1000, 0.5, EscalationReason.CONTEXT),
    ({"escalation": Escalation.CLOUD}, 1000, 0.5, EscalationReason.CONTEXT),
    ({"escalation": Escalation.LOCAL, "max_tokens": 900}, 500, 0.5, None),
    ({"escalation": Escalation.CLOUD, "max_tokens": 900}, 500, 0.5, EscalationReason.REQUESTED),
])
def test_rules_before_running_locally(kw, prompt, wait, expected):
    assert EscalationPolicy(CLOUD, local_context=1000).before(msg(**kw), prompt, wait) is expected


def test_without_a_cloud_only_the_context_rule_fires():
    policy = EscalationPolicy(EscalationConfig(), local_context=100)
    assert policy.before(msg(tags=("multi-floor",), deadline_ms=1), 10, 5.0) is None
    assert policy.before(msg(), 90, None) is EscalationReason.CONTEXT
    assert policy.after(msg(), finished("not json", [-5.0]), PLAN) is None


def test_rules_after_a_local_answer():
    policy = EscalationPolicy(CLOUD, local_context=1000)
    assert policy.after(msg(), finished(VALID, [-0.1, -0.5]), PLAN) is None
    assert policy.after(msg(), finished(VALID[:40], [-0.1], FinishReason.LENGTH), PLAN) is EscalationReason.INVALID_PLAN
    assert policy.after(msg(), finished(VALID, [-0.5, -2.0]), PLAN) is EscalationReason.LOW_CONFIDENCE
    assert policy.after(msg(), finished("free text", [-0.5]), None) is None
    assert policy.after(msg(escalation=Escalation.LOCAL), finished("x", [-9.0]), PLAN) is None
    assert policy.after(msg(), finished("", [-9.0], FinishReason.ABORT), PLAN) is None


def test_plan_validity_follows_the_schema():
    assert plan_is_valid(VALID, PLAN)
    assert not plan_is_valid(VALID.replace('"goto"', '"fly"'), PLAN)
    assert not plan_is_valid(VALID[:-1], PLAN)
    assert plan_is_valid("anything", grammar_spec({"type": "regex", "regex": "a+"}))


def test_the_breaker_opens_after_failures_and_lets_one_trial_through_after_the_cooldown():
    now = [0.0]
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=5.0, clock=lambda: now[0])
    breaker.record_failure()
    assert breaker.allow() and breaker.state is BreakerState.CLOSED
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    now[0] = 5.0
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow() and not breaker.allow()  # one trial at a time
    breaker.record_failure()  # the trial failed: open again
    assert breaker.state is BreakerState.OPEN
    now[0] = 10.0
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow() and breaker.opened_count == 2


def test_bad_escalation_config_is_refused():
    with pytest.raises(ValueError):
        EscalationConfig(server_public_key="a.key")
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
