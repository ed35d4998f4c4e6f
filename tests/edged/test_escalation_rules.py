"""The escalation rules and the circuit breaker, without processes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from edged.circuit import BreakerState, CircuitBreaker
from edged.escalation import EscalationConfig, EscalationPolicy, EscalationReason, mentioned, task_text, unnamed
from edged.generation import LocalJob
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.grammar.response_format import fleet_plan_format, grammar_spec
from shared.engine.request import FinishReason
from shared.engine.sampling_params import SamplingParams
from shared.plan.answer import StructuredAnswer, plan_is_valid
from shared.plan.answer import spec_schema as _schema
from shared.protocol.messages import ChatMessage, Escalation, Generate, Sampling

CLOUD = EscalationConfig(cloud_endpoint="tcp://127.0.0.1:1", escalate_tags=("multi-floor",), min_mean_logprob=-1.0)
PLAN = grammar_spec(fleet_plan_format())
VALID = '{"steps": [{"skill": "goto", "args": {"waypoint": "dock 2", "speed": 0.5}}], "done": true, "confidence": 0.9}'


def msg(**kw) -> Generate:
    return Generate("r", prompt_ids=(1, 2, 3), sampling=Sampling(max_tokens=kw.pop("max_tokens", 32)), **kw)


def after(policy: EscalationPolicy, request: Generate, job: LocalJob, spec) -> EscalationReason | None:
    """The policy's verdict on ``job``, its text parsed under ``spec`` as edged's server parses it."""
    return policy.after(request, job, StructuredAnswer.parse(job.text, spec) if spec is not None else None)


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
    assert after(policy, msg(), finished("not json", [-5.0]), PLAN) is None


def test_rules_after_a_local_answer():
    policy = EscalationPolicy(CLOUD, local_context=1000)
    assert after(policy, msg(), finished(VALID, [-0.1, -0.5]), PLAN) is None
    assert after(policy, msg(), finished(VALID[:40], [-0.1], FinishReason.LENGTH), PLAN) is EscalationReason.INVALID_PLAN
    assert after(policy, msg(), finished(VALID, [-0.5, -2.0]), PLAN) is EscalationReason.LOW_CONFIDENCE
    assert after(policy, msg(), finished("free text", [-0.5]), None) is None
    assert after(policy, msg(escalation=Escalation.LOCAL), finished("x", [-9.0]), PLAN) is None
    assert after(policy, msg(), finished("", [-9.0], FinishReason.ABORT), PLAN) is None


# a robot's plan request over a grounded scene, as robot_sdk sends it (the grammar's literals:
# the skill names, the scene's names, the grasp options)
SKILLS = grammar_spec({"type": "skills", "max_steps": 4, "skills": [
    {"name": "goto", "description": "drive", "args": {"place": ["charging dock 2", "waypoint 17", "packing station"]}},
    {"name": "lift", "description": "lift", "args": {"load": ["tote 12", "tote 7"]}},
    {"name": "dock", "description": "charge", "args": {"station": ["charging dock 2"]}},
    {"name": "pick", "description": "grasp", "args": {"object": ["tote 12", "tote 7"], "grasp": ["normal", "gentle"]}},
    {"name": "report", "description": "say", "args": {"message": "string"}}]})


def plan(*steps: tuple[str, dict]) -> str:
    return json.dumps({"steps": [{"skill": s, "args": a} for s, a in steps], "done": True, "confidence": 0.9})


def asked(task: str, scene: str = "Tote 12 is on waypoint 17; tote 7 at the packing station.") -> Generate:
    return Generate("r", messages=(ChatMessage("system", "You plan."), ChatMessage("user", f"Scene: {scene}"),
                                   ChatMessage("user", f"Task: {task}")), sampling=Sampling(max_tokens=64))


@pytest.mark.parametrize("task, answer, left_out", [
    ("Bring tote 12 to the packing station.", plan(("lift", {"load": "tote 12"})), {"packing station"}),
    ("Bring tote 12 to the packing station.",
     plan(("lift", {"load": "tote 12"}), ("goto", {"place": "packing station"})), set()),
    # the skill a task names is a literal too; "dock" inside "charging dock 2" is not a mention
    ("Go back to charging dock 2 and dock there.", plan(("goto", {"place": "charging dock 2"})), {"dock"}),
    ("Return to charging dock 2.", plan(("goto", {"place": "charging dock 2"})), set()),
    # a free-text value may name it; any case
    ("Report that TOTE 7 is damaged.", plan(("report", {"message": "tote 7 is damaged"})), set()),
    ("Report that tote 7 is damaged.", plan(("report", {"message": "a tote is damaged"})), {"tote 7"}),
    # an enum option the task asks for
    ("Pick tote 7 with a gentle grasp.", plan(("pick", {"object": "tote 7", "grasp": "normal"})), {"gentle"}),
    ("Drive somewhere.", plan(("goto", {"place": "waypoint 17"})), set()),
])
def test_off_task_names_what_the_task_mentions_and_the_plan_leaves_out(task, answer, left_out):
    assert unnamed(task, answer, SKILLS) == left_out


def test_mentions_are_whole_words_and_the_longest_name_wins():
    names = frozenset({"dock", "charging dock 2", "tote 1", "tote 12"})
    assert mentioned("Go to charging dock 2.", names) == {"charging dock 2"}
    assert mentioned("Dock at charging dock 2, then lift tote 12.", names) == {"dock", "charging dock 2", "tote 12"}
    assert mentioned("Lift tote 1 and tote 12.", names) == {"tote 1", "tote 12"}
    assert mentioned("Undock.", names) == frozenset()


def test_the_task_is_the_last_user_message_after_its_task_label():
    assert task_text(asked("Lift tote 7.")) == " Lift tote 7."
    one = Generate("r", messages=(ChatMessage("user", "Scene: at waypoint 17.\nTask: lift tote 7."),),
                   sampling=Sampling(max_tokens=8))
    assert task_text(one) == " lift tote 7."
    bare = Generate("r", messages=(ChatMessage("user", "lift tote 7"),), sampling=Sampling(max_tokens=8))
    assert task_text(bare) == "lift tote 7"


def test_the_off_task_rule_escalates_a_confident_plan_that_leaves_out_a_task_name():
    policy = EscalationPolicy(CLOUD, local_context=1000)
    wrong = finished(plan(("lift", {"load": "tote 12"})), [-0.2])
    right = finished(plan(("lift", {"load": "tote 12"}), ("goto", {"place": "packing station"})), [-0.2])
    task = asked("Bring tote 12 to the packing station.")
    assert after(policy, task, wrong, SKILLS) is EscalationReason.OFF_TASK
    assert after(policy, task, right, SKILLS) is None
    # the scene message names waypoint 17: only the task counts
    assert after(policy, asked("Lift tote 12."), right, SKILLS) is None
    # an unsure plan reports the rule before it; no messages, no free text, or the rule off: not checked
    assert after(policy, task, finished(wrong.text, [-3.0]), SKILLS) is EscalationReason.LOW_CONFIDENCE
    assert after(policy, msg(), wrong, SKILLS) is None
    assert after(policy, task, finished("Bring it.", [-0.2]), None) is None
    off = EscalationPolicy(replace(CLOUD, check_task_names=False), local_context=1000)
    assert after(off, task, wrong, SKILLS) is None


def test_a_specs_schema_is_parsed_and_checked_once_for_all_its_answers():
    _schema.cache_clear()
    wrong, right = plan(("lift", {"load": "tote 12"})), plan(("goto", {"place": "packing station"}))
    for _ in range(3):
        assert plan_is_valid(right, SKILLS) and not plan_is_valid(right.replace("goto", "fly"), SKILLS)
        assert unnamed("Bring tote 12 to the packing station.", wrong, SKILLS) == {"packing station"}
    assert (_schema.cache_info().misses, _schema.cache_info().hits) == (1, 8)


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


@pytest.mark.parametrize("config, kw, races", [
    (replace(CLOUD, race=True), {"response_format": fleet_plan_format()}, True),
    (replace(CLOUD, race=True), {}, False),  # plain text: no rule judges it, the robot answers it
    (replace(CLOUD, race=True), {"response_format": fleet_plan_format(), "escalation": Escalation.LOCAL}, False),
    (replace(CLOUD, race=True), {"response_format": fleet_plan_format(), "escalation": Escalation.CLOUD}, False),
    (CLOUD, {"response_format": fleet_plan_format()}, False),  # race off
    (EscalationConfig(race=True), {"response_format": fleet_plan_format()}, False),  # no cloud
])
def test_a_plan_races_the_cloud_only_where_it_may_escalate_and_racing_is_on(config, kw, races):
    assert EscalationPolicy(config, local_context=100).races(msg(**kw)) is races


def test_the_shipped_robot_config_races_its_plans():
    from pathlib import Path

    from edged.config import EdgeConfig

    assert EdgeConfig.load(Path(__file__).parents[2] / "configs" / "edged.toml").escalation.race
