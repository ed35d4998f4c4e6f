"""No step twice in a row (shared.engine.grammar.repeat_guard): a writer that tries to repeat
its step cannot, unless the skill is repeatable; the default model's looping plan stops looping."""

from __future__ import annotations

import json

import numpy as np
import xgrammar as xgr

from shared.engine.grammar.matcher import GrammarState
from shared.engine.grammar.repeat_guard import _split_steps
from shared.engine.grammar.response_format import grammar_spec

GOTO = {"name": "goto", "description": "drive", "args": {"waypoint": ["waypoint 1", "waypoint 17", "dock"]}}
UNDOCK = {"name": "undock", "description": "leave the dock", "args": {}}
WAIT = {"name": "wait", "description": "pause", "args": {"seconds": ["1", "5"]}, "repeatable": True}


def allowed(state: GrammarState, vocab_size: int) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    state.fill(bitmask, 0)
    state.restrict(bitmask, 0)
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return set(np.flatnonzero(bits).tolist())


def write(compiler, skills: list[dict], target: str, max_steps: int = 3) -> str:
    """What a writer set on ``target`` gets through the grammar: the longest allowed token that
    follows the target at each point; once off it, the smallest allowed token."""
    spec = grammar_spec({"type": "skills", "skills": skills, "max_steps": max_steps})
    state = GrammarState(compiler.compile(spec), compiler.repeat_guard(spec))
    tokens = state.guard.tokens
    written, goal = b"", target.encode()
    for _ in range(400):
        options = allowed(state, compiler.vocab_size)
        rest = goal[len(written):] if goal.startswith(written) else b""
        follow = [t for k in range(len(rest), 0, -1) for t in tokens.by_bytes.get(rest[:k], ()) if t in options]
        token = follow[0] if follow else min(options)
        assert state.accept(token)
        if state.finished:
            return written.decode()
        written += tokens.vocab[token]
    raise AssertionError(f"no end: {written!r}")


def steps_of(text: str) -> list[dict]:
    return json.loads(text)["steps"]


def test_a_writer_set_on_repeating_a_step_writes_a_different_one(compiler):
    step = {"skill": "goto", "args": {"waypoint": "waypoint 17"}}
    target = json.dumps({"steps": [step] * 3, "done": True, "confidence": 0.5})
    steps = steps_of(write(compiler, [GOTO, UNDOCK], target))
    assert steps[0] == step and all(a != b for a, b in zip(steps, steps[1:]))


def test_a_value_that_prefixes_another_is_not_banned_for_the_other(compiler):
    """After "waypoint 1" the repeat is banned at its closing quote; "waypoint 17" stays open."""
    first, second = ({"skill": "goto", "args": {"waypoint": w}} for w in ("waypoint 1", "waypoint 17"))
    target = json.dumps({"steps": [first, second], "done": True, "confidence": 0.5})
    assert steps_of(write(compiler, [GOTO, UNDOCK], target))[:2] == [first, second]


def test_a_step_without_arguments_is_not_repeated_either(compiler):
    target = json.dumps({"steps": [{"skill": "undock", "args": {}}] * 2, "done": True, "confidence": 0.5})
    steps = steps_of(write(compiler, [GOTO, UNDOCK], target))
    assert steps[0] == {"skill": "undock", "args": {}} and steps[1] != steps[0]


def test_a_repeatable_skill_may_repeat(compiler):
    step = {"skill": "wait", "args": {"seconds": "5"}}
    target = json.dumps({"steps": [step] * 3, "done": True, "confidence": 0.5})
    assert steps_of(write(compiler, [GOTO, WAIT], target)) == [step] * 3


def test_when_only_the_repeat_is_possible_the_grammar_still_ends(compiler):
    """One skill, one value: banning the repeat would leave nothing; the writer may repeat."""
    only = {"name": "goto", "description": "drive", "args": {"waypoint": ["dock"]}}
    step = {"skill": "goto", "args": {"waypoint": "dock"}}
    target = json.dumps({"steps": [step] * 2, "done": True, "confidence": 0.5})
    assert steps_of(write(compiler, [only], target)) == [step] * 2


def test_split_steps_reads_strings_with_escapes_and_braces():
    text = b'{"steps": [{"skill": "say", "args": {"m": "a \\"}{\\" b"}}, {"skill": "s'
    assert _split_steps(text) == [b'{"skill": "say", "args": {"m": "a \\"}{\\" b"}}', b'{"skill": "s']
    assert _split_steps(b'{"steps": [{"skill": "x", "args": {}}], "done"') is None
    assert _split_steps(b'{"ste') is None


def test_the_default_models_looping_plans_stop_looping(default_checkpoint):
    """The demo's tasks: greedy, the default model wrote the same step three times; now no step
    follows an identical one and every place and object is the scene's."""
    from robot_sdk.prompt import plan_messages, response_format, system_prompt
    from robot_sdk.scene import Scene
    from robot_sdk.skills import Skill
    from shared.engine.engine import Engine
    from shared.engine.engine_config import EngineConfig
    from shared.engine.sampling_params import SamplingParams
    from shared.model.llama import build_model

    scene = Scene(places=("charging dock 2", "waypoint 17", "aisle 4", "shelf A3"), objects=("tote 12", "shelf A3"))
    skills = (Skill.of("goto", "drive to a named waypoint", {"waypoint": "place"}),
              Skill.of("lift", "lift the shelf or tote under the robot", {"load": "object"}),
              Skill.of("lower", "lower the carried shelf or tote", {"load": "object"}))
    grounded = tuple(s.grounded(scene) for s in skills)
    system = system_prompt(skills, None, 3)
    engine = Engine(build_model(default_checkpoint.config, default_checkpoint.weights), default_checkpoint.tokenizer,
                    EngineConfig(num_blocks=1024))
    tasks = ["bring tote 12 from waypoint 17 to shelf A3.", "a person is in aisle 4: stop and report.",
             "bring tote 12 to the second floor."]
    texts = {engine.submit(list(plan_messages(t, scene, system)), SamplingParams(max_tokens=400), buffered=False,
                           response_format=response_format(grounded, None, 3)): "" for t in tasks}
    while engine.has_unfinished:
        for delta in engine.step():
            texts[delta.request_id] += delta.text
    for text in texts.values():
        steps = json.loads(text)["steps"]
        assert all(a != b for a, b in zip(steps, steps[1:])), text
        for step in steps:
            value = next(iter(step["args"].values()))
            assert value in (scene.places if step["skill"] == "goto" else scene.objects)
