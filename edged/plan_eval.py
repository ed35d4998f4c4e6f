"""``edged plan-eval``: plan quality the way a robot team judges it, on hand-written robot tasks
(``edged/data/plan_tasks.json``: 60 tasks over four scenes, two skill sets).

Each task names a scene, a skill set and what a correct plan must contain: step patterns in
order (a pattern matches a step of that skill whose listed arguments have those values; other
steps may come between). Per run, the share of plans that are

- **valid**: parse and pass the SDK's checks against the declared skills (``PlanChecker``);
- **grounded**: every place, object and person a step names is in the task's scene;
- **requirements met**: valid, and the task's patterns appear in order;

with the mean steps of valid plans, the latency of a complete plan (median, 90th
percentile) and the share answered on the robot (``local_rate``: a result with ``source: edge``;
an answer the SDK refuses counts as not local). Two variants per backend: ``grounded``
(scene-kind arguments are enums of the scene's names, as robot_sdk sends them) and ``free``
(the same arguments as free text: what the grammar allowed before scenes were grounded). Both
prompts list the scene's names, so the difference is the grammar's. In-process on edged's
batch-1 generator (per backend and quantization, any ``--model``), or through a running daemon
(``--endpoint``: edged or cloudd, by robot_sdk). ``edged.plan_tiers`` runs the same tasks on
the robot, by the cloud and through edged's escalation policy (``--tiers``).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edged.config import BackendConfig
from robot_sdk.client import PlanClient
from robot_sdk.errors import InvalidPlan, PlanError
from robot_sdk.prompt import plan_messages, response_format, system_prompt
from robot_sdk.scene import Scene, SceneKind
from robot_sdk.skills import Arg, Skill
from robot_sdk.validate import PlanChecker
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.grammar.response_format import grammar_spec
from shared.engine.sampling_params import SamplingParams
from shared.plan.budget import max_plan_tokens
from shared.plan.check import CheckedPlan

if TYPE_CHECKING:  # NOTE: the model's modules load torch; the CLI imports this module to list its choices
    from edged.generation import Batch1Generator

PLAN_TASKS = Path(__file__).parent / "data" / "plan_tasks.json"
VARIANTS = ("grounded", "free")
MAX_STEPS = 4  # every bundled task needs at most four steps


@dataclasses.dataclass(frozen=True)
class EvalTask:
    id: str
    task: str
    scene: Scene
    skills: tuple[Skill, ...]  # as declared (scene kinds not yet grounded)
    requires: tuple[Mapping[str, Any], ...]  # step patterns, in order


@dataclasses.dataclass(frozen=True)
class Answered:
    """One task's answer, as an answerer got it."""

    text: str
    latency_s: float  # to the complete plan
    local: bool  # answered on the robot (not by the cloud)
    mean_logprob: float | None = None  # the robot's own plan: the model's mean token log-probability


@dataclasses.dataclass(frozen=True)
class Outcome:
    valid: bool
    grounded: bool
    requirements_met: bool
    steps: int
    latency_s: float
    local: bool = True


def load_tasks(path: Path = PLAN_TASKS) -> list[EvalTask]:
    """The tasks of ``path``; ValueError naming a task whose scene, skills or patterns do not
    exist (a pattern's skill, argument or scene name)."""
    data = json.loads(Path(path).read_text())
    scenes = {name: Scene.from_mapping(s) for name, s in data["scenes"].items()}
    skill_sets = {name: tuple(Skill.of(e["name"], e["description"], e.get("args", {}), e.get("repeatable", False))
                              for e in entries) for name, entries in data["skill_sets"].items()}
    tasks = []
    for t in data["tasks"]:
        task = EvalTask(t["id"], t["task"], scenes[t["scene"]], skill_sets[t["skills"]], tuple(t["requires"]))
        _check_patterns(task)
        tasks.append(task)
    return tasks


def _check_patterns(task: EvalTask) -> None:
    skills = {s.name: s for s in grammar_skills(task, "grounded")}  # ValueError: the scene lacks a kind
    for pattern in task.requires:
        skill = skills.get(pattern["skill"])
        if skill is None:
            raise ValueError(f"task {task.id}: unknown skill {pattern['skill']!r}")
        args = {a.name: a for a in skill.args}
        for name, value in pattern.get("args", {}).items():
            if name not in args or not args[name].accepts(value):
                raise ValueError(f"task {task.id}: {pattern['skill']}.{name} = {value!r} is not in its scene or skill")


def judge(task: EvalTask, text: str, latency_s: float, local: bool = True) -> Outcome:
    """One answer against its task (see the module docstring)."""
    try:
        plan = PlanChecker(task.skills, MAX_STEPS).parse(text)
    except InvalidPlan:
        return Outcome(False, False, False, 0, latency_s, local)
    return Outcome(True, _grounded(task, text), _meets(task.requires, plan), len(plan.steps), latency_s, local)


def _grounded(task: EvalTask, text: str) -> bool:
    """A valid plan is grounded when it also passes the checks of the skills grounded in the
    task's scene (each scene-kind argument one of the scene's names)."""
    try:
        PlanChecker(grammar_skills(task, "grounded"), MAX_STEPS).parse(text)
    except InvalidPlan:
        return False
    return True


def _meets(patterns: Sequence[Mapping[str, Any]], plan: CheckedPlan) -> bool:
    """Whether the patterns match steps of the plan in order (a subsequence)."""
    steps = iter(plan.steps)
    return all(any(step.skill == p["skill"] and all(step.args.get(k) == v for k, v in p.get("args", {}).items())
                   for step in steps) for p in patterns)


def free_text(skill: Skill) -> Skill:
    """``skill`` with its scene-kind arguments as free text (no grounding)."""
    return dataclasses.replace(skill, args=tuple(Arg(a.name, "string") if isinstance(a.kind, SceneKind) else a
                                                 for a in skill.args))


def summarize(outcomes: Sequence[Outcome]) -> dict[str, float]:
    n = len(outcomes)
    valid = [o for o in outcomes if o.valid]
    latencies = sorted(o.latency_s for o in outcomes)
    return {
        "tasks": n,
        "valid_rate": len(valid) / n,
        "grounded_rate": sum(o.grounded for o in outcomes) / n,
        "requirements_met_rate": sum(o.requirements_met for o in outcomes) / n,
        "mean_steps": statistics.fmean(o.steps for o in valid) if valid else 0.0,
        "latency_p50_s": statistics.median(latencies),
        "latency_p90_s": latencies[min(n - 1, int(0.9 * n))],
        "local_rate": sum(o.local for o in outcomes) / n,
    }


# An answerer: (task, variant) -> its answer.
Answer = Callable[[EvalTask, str], Answered]


def grammar_skills(task: EvalTask, variant: str) -> tuple[Skill, ...]:
    """The skills the grammar gets: grounded in the task's scene, or with free-text names."""
    return tuple(s.grounded(task.scene) if variant == "grounded" else free_text(s) for s in task.skills)


def run_variants(tasks: Sequence[EvalTask], answer: Answer, variants: Sequence[str],
                 record: Callable[[str, EvalTask, Answered, Outcome], None] | None = None,
                 ) -> dict[str, dict[str, float]]:
    """Every task through ``answer`` once per variant; the summary per variant. ``record``, when
    given, sees each (variant, task, answer, outcome) as it is judged."""
    summaries = {}
    for variant in variants:
        outcomes = []
        for task in tasks:
            answered = answer(task, variant)
            outcomes.append(judge(task, answered.text, answered.latency_s, answered.local))
            if record is not None:
                record(variant, task, answered, outcomes[-1])
        summaries[variant] = summarize(outcomes)
    return summaries


def task_messages(task: EvalTask) -> tuple[dict[str, str], ...]:
    """``task``'s plan request as the local answerer sends it: the system prompt of its skills as
    declared (no instructions), its scene, its task."""
    return plan_messages(task.task, task.scene, system_prompt(task.skills, None, MAX_STEPS))


def local_answerer(generator: Batch1Generator) -> Answer:
    """Answers on edged's batch-1 generator, greedy, with as many tokens as the plan can take.
    Both variants get the same prompt (the skills as declared): only the grammar differs."""
    from edged.generation import LocalJob

    tok = generator.tokenizer

    def answer(task: EvalTask, variant: str) -> Answered:
        skills = grammar_skills(task, variant)
        messages = list(task_messages(task))
        job = LocalJob(task.id, tok.encode_chat(messages), SamplingParams(max_tokens=max_plan_tokens(skills, MAX_STEPS)),
                       IncrementalDetokenizer(tok), spec=grammar_spec(response_format(skills, None, MAX_STEPS)))
        started = time.perf_counter()
        generator.run(job, lambda tokens, text: None)
        return Answered(job.text, time.perf_counter() - started, True, job.mean_logprob)

    return answer


def endpoint_answerer(client: PlanClient) -> Answer:
    """Answers from a running daemon (edged or cloudd) through robot_sdk, as a robot sends them:
    grounded, the declared skills with the scene; free, the skills with free-text names. An
    answer the SDK refuses counts as invalid (and not local)."""

    def answer(task: EvalTask, variant: str) -> Answered:
        skills = task.skills if variant == "grounded" else tuple(free_text(s) for s in task.skills)
        started = time.perf_counter()
        try:
            plan = client.plan(task.task, scene=task.scene, skills=list(skills), max_steps=MAX_STEPS,
                               max_tokens=max_plan_tokens(grammar_skills(task, variant), MAX_STEPS))
        except PlanError:
            return Answered("", time.perf_counter() - started, False)
        return Answered(plan.text, time.perf_counter() - started, plan.source == "edge")

    return answer


def run_plan_eval(model: Path, backends: Sequence[str], quants: Sequence[str], variants: Sequence[str] = VARIANTS,
                  tasks_path: Path | None = None, limit: int | None = None, endpoint: str | None = None,
                  threads: int | None = None, log: Callable[[str], None] | None = print) -> dict:
    """The report: ``{"tasks": n, "runs": {"<backend>-<quant>[-free]": summary, ...}}``.
    ``threads``: the robot model's (default: edged's, ``BackendConfig.threads``)."""
    threads = threads or BackendConfig().threads
    tasks = load_tasks(tasks_path or PLAN_TASKS)[:limit]
    runs: dict[str, dict] = {}
    for name, answer in _answerers(model, backends, quants, endpoint, threads):
        runs.update(named_runs(name, run_variants(tasks, answer, variants), log))
    return {"tasks": len(tasks), "runs": runs}


def named_runs(name: str, summaries: Mapping[str, dict[str, float]],
               log: Callable[[str], None] | None) -> dict[str, dict[str, float]]:
    """``run_variants``' summaries under their report names, ``<name>`` for grounded and
    ``<name>-<variant>`` otherwise, each logged as a row (``log`` None: not logged)."""
    runs = {name if variant == "grounded" else f"{name}-{variant}": summary for variant, summary in summaries.items()}
    if log:
        for run, summary in runs.items():
            log(format_row(run, summary))
    return runs


def _answerers(model: Path, backends: Sequence[str], quants: Sequence[str], endpoint: str | None,
               threads: int) -> Iterator[tuple[str, Answer]]:
    if endpoint is not None:
        with PlanClient(endpoint, robot_id="plan-eval", timeout_s=120) as client:
            yield endpoint, endpoint_answerer(client)
        return
    for name, generator in local_generators(model, [(kind, quant) for kind in backends for quant in quants], threads):
        yield name, local_answerer(generator)


def local_generators(model: Path, specs: Sequence[tuple[str, str]],
                     threads: int) -> Iterator[tuple[str, Batch1Generator]]:
    """``("<backend>-<quant>", generator)`` for each (backend, quantization) of ``specs``, each
    built when the previous one is done with (one model load, one grammar compiler)."""
    from edged.backends.factory import make_backend
    from edged.generation import Batch1Generator
    from shared.engine.grammar.compiler import GrammarCompiler
    from shared.model.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(model)
    compiler = GrammarCompiler(checkpoint.tokenizer, checkpoint.config.vocab_size)  # the logits' width
    for kind, quant in specs:
        backend = make_backend(kind, quant, checkpoint, model, 2048, threads)
        yield f"{kind}-{quant}", Batch1Generator(backend, checkpoint.tokenizer, compiler)


def format_row(name: str, r: Mapping[str, float]) -> str:
    return (f"{name:<22} {r['tasks']:>5} {r['valid_rate']:>7.0%} {r['grounded_rate']:>9.0%} "
            f"{r['requirements_met_rate']:>9.1%} {r['mean_steps']:>6.2f} {r['latency_p50_s']:>8.2f} "
            f"{r['latency_p90_s']:>8.2f} {r['local_rate']:>7.0%}")


HEADER = (f"{'run':<22} {'tasks':>5} {'valid':>7} {'grounded':>9} {'meets':>9} {'steps':>6} {'p50 s':>8} "
          f"{'p90 s':>8} {'local':>7}")
