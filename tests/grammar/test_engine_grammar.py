"""Structured output through the engine with the default model: plans that always parse and
validate, jump-forward that changes no token, regex and EBNF, constrained and free requests in
one batch, grammar errors at submit, WAITING_FOR_GRAMMAR, and max_tokens running out."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future
from pathlib import Path

import jsonschema
import pytest

from cloudd.trace import load_trace
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.grammar.response_format import FLEET_SKILLS, grammar_spec
from shared.engine.request import FinishReason, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.model.llama import build_model
from shared.plan.schema import plan_schema

TRACE = Path(__file__).with_name("robot_tasks.jsonl")  # the first 100 requests of fleet-256
PLAN = plan_schema(FLEET_SKILLS)
PLAN_FORMAT = {"type": "json_schema", "json_schema": {"name": "fleet-plan", "schema": PLAN}}


@pytest.fixture(scope="module")
def model(default_checkpoint):
    return build_model(default_checkpoint.config, default_checkpoint.weights)


@pytest.fixture(scope="module")
def auto_dtype_model(default_checkpoint):
    """The default model in the dtype the engine picks here (bfloat16 where the CPU computes it
    natively, float32 elsewhere): for the test that decodes a hundred whole plans, whose
    assertions (each plan parses, validates and closes) hold in any dtype."""
    return build_model(default_checkpoint.config, default_checkpoint.weights, dtype=EngineConfig().torch_dtype)


def make_engine(model, checkpoint, **config) -> Engine:
    return Engine(model, checkpoint.tokenizer, EngineConfig(num_blocks=4096, **config))


def robot_tasks(n: int) -> list[list[dict]]:
    """``n`` varied robot tasks: the fleet trace's requests (both robot types, plans, replans)."""
    return [list(r.messages) for r in load_trace(TRACE, n)]


def run_all(engine: Engine, prompts, sampling: SamplingParams, response_format=None) -> list:
    rids = [engine.submit(p, sampling, buffered=False, response_format=response_format) for p in prompts]
    reqs = [engine.get_request(r) for r in rids]
    texts = {r: "" for r in rids}
    while engine.has_unfinished:
        for delta in engine.step():
            texts[delta.request_id] += delta.text
    return [(req, texts[req.request_id]) for req in reqs]


def test_one_hundred_robot_tasks_all_give_plans_that_parse_and_validate(auto_dtype_model, default_checkpoint):
    engine = make_engine(auto_dtype_model, default_checkpoint)
    # NOTE: the schema bounds a plan (8 steps, 32-character strings), 1024 tokens always hold one.
    done = run_all(engine, robot_tasks(100), SamplingParams(max_tokens=1024), PLAN_FORMAT)
    for req, text in done:
        assert req.finish_reason is FinishReason.STOP, text
        jsonschema.validate(json.loads(text), PLAN)
    stats = engine.stats()
    assert stats.forced_tokens > 0 and stats.grammar_compiles == 1  # one compilation served all 100


@pytest.mark.parametrize("sampling", [SamplingParams(max_tokens=60),
                                      SamplingParams(max_tokens=60, temperature=0.8, top_p=0.95, seed=7)])
def test_jump_forward_is_token_identical_to_plain_constrained_decoding(model, default_checkpoint, sampling):
    tasks = robot_tasks(2)
    plain = run_all(make_engine(model, default_checkpoint, jump_forward=False), tasks, sampling, PLAN_FORMAT)
    engine = make_engine(model, default_checkpoint)
    fast = run_all(engine, tasks, sampling, PLAN_FORMAT)
    assert [r.output_token_ids for r, _ in fast] == [r.output_token_ids for r, _ in plain]
    assert [t for _, t in fast] == [t for _, t in plain]
    saved = engine.stats().forced_tokens
    assert saved > 0 and engine.num_steps < sum(r.num_output_tokens for r, _ in fast)


@pytest.mark.parametrize("response_format, pattern", [
    ({"type": "regex", "regex": r"(goto|dock|scan) (aisle|station) [1-9][0-9]?"},
     r"(goto|dock|scan) (aisle|station) [1-9][0-9]?"),
    ({"type": "ebnf", "ebnf": 'root ::= "move(" num ", " num ")"\nnum ::= "-"? [0-9] [0-9]?'},
     r"move\(-?[0-9][0-9]?, -?[0-9][0-9]?\)"),
])
def test_regex_and_ebnf_outputs_match(model, default_checkpoint, response_format, pattern):
    engine = make_engine(model, default_checkpoint)
    done = run_all(engine, robot_tasks(3), SamplingParams(max_tokens=40), response_format)
    for req, text in done:
        assert req.finish_reason is FinishReason.STOP and re.fullmatch(pattern, text), text


def test_free_requests_in_a_constrained_batch_are_unchanged(model, default_checkpoint):
    tasks = robot_tasks(3)
    sampling = SamplingParams(max_tokens=24)
    alone = run_all(make_engine(model, default_checkpoint), tasks[:2], sampling)
    engine = make_engine(model, default_checkpoint)
    free = [engine.submit(t, sampling, buffered=False) for t in tasks[:2]]
    constrained = engine.submit(tasks[2], SamplingParams(max_tokens=40), buffered=False, response_format=PLAN_FORMAT)
    reqs = [engine.get_request(r) for r in [*free, constrained]]
    while engine.has_unfinished:
        engine.step()
    assert [r.output_token_ids for r in reqs[:2]] == [r.output_token_ids for r, _ in alone]
    assert default_checkpoint.tokenizer.decode(reqs[2].output_token_ids).startswith('{"steps": [{"skill": "')


@pytest.mark.parametrize("response_format, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}, "frobnicate"),
    ({"type": "regex", "regex": "(unclosed"}, "regex"),
    ({"type": "ebnf", "ebnf": "root ::= missing_rule"}, "missing_rule"),
    ({"type": "skills", "skills": []}, "skills"),
    ({"type": "yaml"}, "yaml"),
    # found by fuzzing cloudd serve: jump-forward built the endless forced text until the daemon was OOM-killed
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {"a": {"$ref": "#"}},
                                                        "required": ["a"]}}}, "can never finish"),
    ({"type": "ebnf", "ebnf": 'root ::= "(" root ")"'}, "'root' can never finish"),
])
def test_a_bad_grammar_is_a_clear_error_at_submit(model, default_checkpoint, response_format, words):
    engine = make_engine(model, default_checkpoint)
    with pytest.raises(ValueError, match=words):
        engine.submit("plan", SamplingParams(max_tokens=8), response_format=response_format)
    assert not engine.has_unfinished


def test_a_request_waits_for_its_grammar_while_others_run(model, default_checkpoint):
    engine = make_engine(model, default_checkpoint)
    compiled = engine.grammar_compiler.compile(grammar_spec(PLAN_FORMAT))
    slow: Future = Future()
    engine.grammar_compiler.compile_async = lambda spec: slow  # the compile worker is "busy"
    waiting = engine.submit(robot_tasks(1)[0], SamplingParams(max_tokens=30), response_format=PLAN_FORMAT)
    free = engine.submit("Say hi.", SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert engine.get_request(waiting).status is RequestStatus.WAITING_FOR_GRAMMAR
    assert engine.get_request(free) is None  # finished meanwhile: the loop never blocked
    slow.set_result(compiled)
    text = "".join(d.text for d in engine.stream(waiting))
    assert text.startswith('{"steps": [{"skill": "')  # constrained from its first token


def test_a_plan_cut_by_max_tokens_ends_with_length(model, default_checkpoint):
    engine = make_engine(model, default_checkpoint)
    (req, text), = run_all(engine, robot_tasks(1), SamplingParams(max_tokens=10), PLAN_FORMAT)
    assert req.finish_reason is FinishReason.LENGTH and not req.grammar.finished
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
