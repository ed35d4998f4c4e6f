"""The default ``max_tokens`` of a skills plan (``max_plan_tokens(skills, max_steps)``) holds the
longest complete ``max_steps``-step plan under both fleet tokenizers: the robot's SmolLM2-135M
and the cloud's Qwen2.5-Coder-1.5B (its own vocabulary; skipped where its GGUF is not cached).

The bound counts bytes, one token each at worst: the longest plan's text is exactly the bound
minus the end-of-text token, the plan grammar takes it, no token the grammar can emit is empty,
and every bundled skill set's longest plans, spelled to tokenize as badly as a few fillers can,
tokenize well inside it.
"""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import xgrammar as xgr

from robot_sdk.prompt import response_format
from robot_sdk.ros.skill_sets import load_skill_sets, skills_of
from robot_sdk.scene import Scene
from robot_sdk.skills import Arg, Skill, as_skills
from shared.config import model_cache_dir
from shared.engine.grammar.compiler import GrammarCompiler
from shared.engine.grammar.response_format import grammar_spec
from shared.model.checkpoint import load_tokenizer
from shared.model.fetch import MODELS
from shared.plan.budget import max_plan_tokens, steps_that_fit
from shared.plan.schema import MAX_STRING_CHARS

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 8  # PlanClient's and the node's default
FREE_TEXT = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 .,;:!?'()/_-"
# 32 characters each: one letter, then the pattern's alphabet in runs a BPE merges badly
FILLERS = ("x" * MAX_STRING_CHARS, "Q;9(z!4_k/0'J)v.8,w:7?b-6 y5g3h2",
           *("q" + "".join(random.Random(seed).choices(FREE_TEXT, k=MAX_STRING_CHARS - 1)) for seed in range(8)))
NUMBERS = ("-10000.000000", "-9999.999999", "-1234.567891", "-8086.420135")
CONFIDENCES = ("0.999999", "0.123457")
TASKS = json.loads((ROOT / "edged/data/plan_tasks.json").read_text())


# --- the skill sets -------------------------------------------------------------------------------


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _scene(fields: dict) -> Scene:
    return Scene(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})


def bundled_skill_sets() -> dict[str, tuple[Skill, ...]]:
    """Every bundled skill set, grounded in each scene it is used with: the node's built-ins,
    plan-eval's task sets in their tasks' scenes, and the examples' skills in their scenes."""
    sets = {}
    for set_id, skills in load_skill_sets().items():
        for scene_id in TASKS["scenes"] if set_id == "warehouse" else ("",):
            scene = _scene(TASKS["scenes"][scene_id]) if scene_id else None
            sets[f"ros:{set_id}{'@' + scene_id if scene_id else ''}"] = tuple(s.grounded(scene) for s in skills)
    for set_id, scene_id in sorted({(t["skills"], t["scene"]) for t in TASKS["tasks"]}):
        scene = _scene(TASKS["scenes"][scene_id])
        sets[f"plan_tasks:{set_id}@{scene_id}"] = tuple(
            s.grounded(scene) for s in skills_of(TASKS["skill_sets"][set_id], set_id))
    for name, skills_attr in (("pick_and_place", "SKILLS"), ("fleet_demo", "SKILLS"), ("two_robots", "AMR_SKILLS"),
                              ("two_robots", "ARM_SKILLS")):
        module = _example(name)
        scene = getattr(module, "SCENE", None)
        sets[f"examples:{name}.{skills_attr}"] = tuple(s.grounded(scene) for s in as_skills(getattr(module, skills_attr)))
    return sets


SETS = bundled_skill_sets()


# --- the longest plans ----------------------------------------------------------------------------


def value_texts(arg: Arg) -> tuple[str, ...]:
    """Every way the grammar can write ``arg`` at its longest (and a few long spellings)."""
    if isinstance(arg.kind, tuple):
        return tuple(json.dumps(v, ensure_ascii=False) for v in arg.kind)
    if arg.kind == "string":
        return tuple(json.dumps(f) for f in FILLERS)
    if arg.kind == "number":
        return NUMBERS
    if arg.kind == "integer":
        return ("-10000",)
    return ("false",)


def step_text(skill: Skill, values: Sequence[str]) -> str:
    args = ", ".join(f"{json.dumps(a.name)}: {v}" for a, v in zip(skill.args, values, strict=True))
    return f'{{"skill": {json.dumps(skill.name)}, "args": {{{args}}}}}'


def plan_text(steps: Sequence[str], confidence: str) -> str:
    """A plan as the grammar writes it: compact JSON, ", " and ": " separators."""
    return f'{{"steps": [{", ".join(steps)}], "done": false, "confidence": {confidence}}}'


def longest_step(skill: Skill, count) -> str:
    """The step of ``skill`` whose text ``count`` (bytes, or a tokenizer's tokens) finds longest:
    each argument's longest value, then the arguments together."""
    values = [max(value_texts(a), key=count) for a in skill.args]
    return step_text(skill, values)


def longest_plan(skills: Sequence[Skill], steps: int, count) -> str:
    """``steps`` copies of the longest step of ``skills`` by ``count`` (the repeat guard would
    forbid identical neighbours, which only makes real plans shorter)."""
    step = max((longest_step(s, count) for s in skills), key=count)
    return plan_text([step] * steps, max(CONFIDENCES, key=count))


def utf8_bytes(text: str) -> int:
    return len(text.encode())


# --- tokenizers -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(default_model_path):
    return load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def qwen():
    path = model_cache_dir() / MODELS["qwen2.5-coder-1.5b"].filename
    if not path.is_file():
        pytest.skip(f"the cloud model's GGUF is not cached at {path}")
    return load_tokenizer(path)


@pytest.fixture(params=["smollm2", "qwen"])
def tokenizer(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def compiler(smollm2):
    compiler = GrammarCompiler(smollm2, compile_threads=2)
    yield compiler
    compiler.close()


# --- the bound --------------------------------------------------------------------------------------


def test_the_byte_longest_plan_is_the_bound_less_the_end_token_and_the_grammar_takes_it(compiler):
    for name, skills in SETS.items():
        text = longest_plan(skills, MAX_STEPS, utf8_bytes)
        assert utf8_bytes(text) + 1 == max_plan_tokens(skills, MAX_STEPS), name
    skills = SETS["ros:warehouse@warehouse_a"]
    text = longest_plan(skills, MAX_STEPS, utf8_bytes)
    matcher = xgr.GrammarMatcher(compiler.compile(grammar_spec(response_format(skills, None, MAX_STEPS))))
    assert matcher.accept_string(text) and matcher.accept_token(compiler.tokenizer_info.stop_token_ids[0])


@pytest.mark.parametrize("model", ["smollm2", "qwen"])
def test_no_token_the_plan_grammar_allows_is_empty(request, model):
    """A token is at least a byte inside the grammar: the empty ones (special tokens, ids past
    the vocabulary) are never allowed, at every position of a warehouse plan."""
    tokenizer = request.getfixturevalue(model)
    compiler = GrammarCompiler(tokenizer, compile_threads=2)
    try:
        info = compiler.tokenizer_info
        stop = set(info.stop_token_ids)  # the end-of-text token: counted apart
        empty = torch.tensor([i for i, token in enumerate(info.decoded_vocab) if not token and i not in stop])
        assert len(empty) > 0  # the special tokens
        skills = SETS["ros:warehouse@warehouse_a"]
        text = plan_text([step_text(skills[0], ['"charging dock 2"']),
                          step_text(skills[3], ['"Aisle 4 is blocked."'])], "0.5")
        matcher = xgr.GrammarMatcher(compiler.compile(grammar_spec(response_format(skills, None, 2))))
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)  # [1, ceil(vocab / 32)] int32, bit i: id i allowed
        for char in text:
            matcher.fill_next_token_bitmask(bitmask)
            assert not ((bitmask[0, empty // 32] >> (empty % 32)) & 1).any()
            assert matcher.accept_string(char)
    finally:
        compiler.close()


def test_every_bundled_sets_longest_plans_fit_the_default_budget(tokenizer):
    for name, skills in SETS.items():
        budget = max_plan_tokens(skills, MAX_STEPS)
        tokens = lambda text: len(tokenizer.encode(text))  # noqa: E731
        for count in (utf8_bytes, tokens):
            assert tokens(longest_plan(skills, MAX_STEPS, count)) + 1 <= budget, name


def test_the_five_step_warehouse_task_is_not_cut_by_the_default_budget(tokenizer):
    """The independent rclpy client's task: 384 tokens held four warehouse steps. The default
    holds all eight the grammar allows, each as long as it can be."""
    skills = SETS["ros:warehouse@warehouse_a"]
    default = max_plan_tokens(skills, MAX_STEPS)
    assert steps_that_fit(skills, MAX_STEPS, 384) == 4
    assert steps_that_fit(skills, MAX_STEPS, default) == MAX_STEPS
    goto, lift, lower, report = skills
    five = plan_text([step_text(goto, ['"waypoint 17"']), step_text(lift, ['"tote 12"']),
                      step_text(goto, ['"packing station"']), step_text(lower, ['"tote 12"']),
                      step_text(report, ['"Tote 12 is at packing station."'])], "0.9")
    longest = longest_plan(skills, MAX_STEPS, lambda text: len(tokenizer.encode(text)))
    assert len(tokenizer.encode(five)) + 1 < len(tokenizer.encode(longest)) + 1 <= default
