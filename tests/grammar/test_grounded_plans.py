"""The plan grammar's help to a small model: a scene's names as the only values of a grounded
argument, bounded printable free text, and a per-scene grammar compiled once through the cache."""

from __future__ import annotations

import json
import time

import pytest
import xgrammar as xgr

from robot_sdk.prompt import response_format
from robot_sdk.scene import Place, Scene
from robot_sdk.skills import Skill, skill
from shared.engine.grammar.response_format import grammar_spec
from shared.plan.budget import max_plan_tokens, steps_that_fit


@skill
def goto(waypoint: Place) -> None:
    """drive to a named waypoint"""


@skill
def report(message: str) -> None:
    """send a status message"""


SCENE = Scene(places=("waypoint 17", "packing station", "charging dock 2"))


def accepts(compiler, spec, text: str) -> bool:
    """Whether the compiled grammar takes ``text`` as a whole, complete answer."""
    matcher = xgr.GrammarMatcher(compiler.compile(spec))
    return matcher.accept_string(text) and matcher.accept_token(compiler.tokenizer_info.stop_token_ids[0])


def plan_text(steps: list[dict]) -> str:
    """A plan as the grammar writes it (json.dumps's separators: ", " and ": ")."""
    return json.dumps({"steps": steps, "done": True, "confidence": 0.5})


def spec_for(scene: Scene, skills=(goto, report)):
    return grammar_spec(response_format(tuple(Skill.from_callable(s).grounded(scene) for s in skills), None, 8))


def test_a_grounded_argument_takes_only_the_scenes_names(compiler):
    spec = spec_for(SCENE)
    assert accepts(compiler, spec, plan_text([{"skill": "goto", "args": {"waypoint": "packing station"}}]))
    assert not accepts(compiler, spec, plan_text([{"skill": "goto", "args": {"waypoint": "waypoint 18"}}]))
    assert not accepts(compiler, spec, plan_text([{"skill": "goto", "args": {"waypoint": "2018-01-01T00:00:00Z"}}]))


def test_free_text_is_bounded_printable_text(compiler):
    spec = spec_for(SCENE)
    assert accepts(compiler, spec, plan_text([{"skill": "report", "args": {"message": "Tote 12 delivered."}}]))
    for bad in (")[1],", "", " leading space", "x" * 33, 'say "hi"', "a{b}", "2.2.2.2.2"):
        assert not accepts(compiler, spec, plan_text([{"skill": "report", "args": {"message": bad}}])), bad


def test_an_unchanged_scene_compiles_nothing_and_a_50_name_scene_compiles_quickly(compiler):
    big = Scene(places=tuple(f"waypoint {i}" for i in range(50)))
    before = compiler.stats.compiles
    started = time.perf_counter()
    compiler.compile(spec_for(big))
    first_s = time.perf_counter() - started
    compiler.compile(spec_for(Scene(places=tuple(f"waypoint {i}" for i in range(50)))))  # the same scene again
    assert compiler.stats.compiles == before + 1
    print(f"50-name scene: grammar compiled in {first_s * 1000:.0f} ms")


@skill
def drive(waypoint: Place, speed: float, note: str, slow: bool) -> None:
    """drive somewhere"""


def test_the_plan_token_bound_holds_the_longest_plan_the_grammar_accepts(compiler, tokenizer):
    """Every value at its longest (the longest name, 32 characters of text, a number with five
    digits and six decimals), three steps: the grammar takes it, and its tokens, even one per
    byte, fit ``max_plan_tokens``."""
    skills = [Skill.from_callable(drive).grounded(SCENE), Skill.from_callable(report).grounded(SCENE)]
    spec = grammar_spec(response_format(tuple(skills), None, 3))
    step = {"skill": "drive", "args": {"waypoint": "packing station", "speed": "SPEED", "note": "x" * 32,
                                       "slow": False}}
    text = plan_text([step] * 3).replace('"SPEED"', "-9999.999999").replace('"confidence": 0.5',
                                                                            '"confidence": 0.999999')
    text = text.replace('"done": true', '"done": false')
    assert accepts(compiler, spec, text)
    assert not accepts(compiler, spec, text.replace("-9999.999999", "-9999.9999999"))  # the grammar's precision
    assert len(text.encode()) + 1 <= max_plan_tokens(skills, 3)
    assert len(tokenizer.encode(text)) + 1 <= max_plan_tokens(skills, 3)


def test_steps_that_fit_lowers_the_grammars_step_bound_or_refuses():
    skills = [Skill.from_callable(report)]
    assert steps_that_fit(skills, 8, max_plan_tokens(skills, 8)) == 8
    assert steps_that_fit(skills, 8, max_plan_tokens(skills, 3)) == 3
    with pytest.raises(ValueError, match="max_tokens=20 cannot hold a complete plan"):
        steps_that_fit(skills, 8, 20)
