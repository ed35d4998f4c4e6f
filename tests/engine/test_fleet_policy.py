"""FleetPolicy through the real engine with the tiny model and a fake clock: priority classes
that preempt, deadlines (reject and stop), per-robot fairness, ageing, cache-aware order."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shared.engine.engine import DeadlineUnmeetable, Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.policy import FleetPolicy, FleetPolicyConfig
from shared.engine.request import FinishReason, Request
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import SchedulerConfig
from shared.protocol.messages import Priority
from tests.engine.tiny import tiny_model

MODEL = tiny_model(tie_word_embeddings=False)


class FakeClock:
    """Time moves only when a test says so (``tick`` per engine step by default)."""

    def __init__(self, tick: float = 0.0):
        self.now = 0.0
        self.tick = tick

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def fleet_engine(clock: FakeClock, num_blocks: int = 256, policy: FleetPolicyConfig = FleetPolicyConfig(),
                 **scheduler) -> Engine:
    config = EngineConfig(block_size=4, num_blocks=num_blocks, scheduler=SchedulerConfig(**scheduler))
    return Engine(MODEL, None, config, policy=FleetPolicy(policy), clock=clock)


def run(eng: Engine, clock: FakeClock, seconds_per_step: float = 0.1, max_steps: int = 10_000) -> list:
    """Step until idle; the clock moves ``seconds_per_step`` per step. Returns every delta."""
    deltas = []
    for _ in range(max_steps):
        if not eng.has_unfinished:
            return deltas
        clock.advance(seconds_per_step)
        deltas.extend(eng.step())
    raise AssertionError("the engine did not go idle")


def tokens(n: int, seed: int) -> list[int]:
    """A prompt of ``n`` token ids; different seeds share no prefix (with near certainty)."""
    rng = random.Random(seed)
    return [rng.randrange(1, 91) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def request(eng: Engine, rid: str) -> Request:
    return eng.scheduler.requests[rid]


# --- priority classes -----------------------------------------------------------------------


def test_under_overload_safety_starts_before_every_lower_request_and_preempts():
    clock = FakeClock()
    eng = fleet_engine(clock, max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(12):
        eng.submit(tokens(12, i), greedy(20), f"plan-{i}", buffered=False, priority=Priority.PLAN)
    for _ in range(3):
        clock.advance(0.1)
        eng.step()
    assert len(eng.scheduler.running) == 4  # every seat taken by plan requests
    for i in range(2):
        eng.submit(tokens(12, 100 + i), greedy(5), f"safety-{i}", buffered=False, priority=Priority.SAFETY)
    eng.submit(tokens(12, 200), greedy(5), "background", buffered=False, priority=Priority.BACKGROUND)
    clock.advance(0.1)
    deltas = eng.step()
    running = {r.request_id for r in eng.scheduler.running}
    assert {"safety-0", "safety-1"} <= running  # admitted at once, seats taken from plans
    preempted = [r for r in eng.scheduler.waiting if r.num_preemptions > 0]
    assert len(preempted) == 2 and all(r.priority is Priority.PLAN for r in preempted)

    first_token = {d.request_id: clock.now for d in deltas}
    for d in run(eng, clock):
        first_token.setdefault(d.request_id, clock.now)
    safety_done = max(first_token[f"safety-{i}"] for i in range(2))
    # no waiting lower-class request got its first token before the last safety one started
    waited = [rid for rid in first_token if rid.startswith("plan-") and int(rid[5:]) >= 4] + ["background"]
    assert all(first_token[rid] > safety_done for rid in waited)
    # the preempted plans resumed and finished with all their tokens
    assert eng.stats().preemptions == 2


def test_preempted_requests_resume_from_their_cached_prefix():
    clock = FakeClock()
    eng = fleet_engine(clock, max_num_seqs=1, max_num_batched_tokens=64)
    eng.submit(tokens(20, 1), greedy(30), "plan", priority=Priority.PLAN)
    for _ in range(5):
        clock.advance(0.1)
        eng.step()
    eng.submit(tokens(8, 2), greedy(3), "urgent", priority=Priority.SAFETY)
    clock.advance(0.1)
    eng.step()
    plan = request(eng, "plan")
    assert plan.num_preemptions == 1 and eng.scheduler.running[0].request_id == "urgent"
    run(eng, clock)
    assert plan.num_cached_tokens >= 20  # prompt and computed output came back from the cache
    assert plan.num_output_tokens == 30


def test_without_preempting_classes_safety_only_goes_first_in_the_queue():
    clock = FakeClock()
    eng = fleet_engine(clock, policy=FleetPolicyConfig(preempting_classes=()), max_num_seqs=2,
                       max_num_batched_tokens=64)
    for i in range(2):
        eng.submit(tokens(8, i), greedy(10), f"plan-{i}", buffered=False)
    clock.advance(0.1)
    eng.step()
    eng.submit(tokens(8, 9), greedy(3), "plan-late", buffered=False)
    eng.submit(tokens(8, 10), greedy(3), "safety", buffered=False, priority=Priority.SAFETY)
    clock.advance(0.1)
    eng.step()
    assert eng.stats().preemptions == 0
    order = [d.request_id for d in run(eng, clock) if d.request_id in ("safety", "plan-late")]
    assert order[0] == "safety"


# --- deadlines ---------------------------------------------------------------------------------


def test_a_deadline_that_cannot_be_met_is_rejected_at_submit_and_nothing_is_queued():
    clock = FakeClock()
    eng = fleet_engine(clock)
    eng.scheduler.rate.observe(num_tokens=100, seconds=1.0)  # 10 ms per token, measured
    for i in range(5):  # 200 tokens of a higher class queued
        eng.submit(tokens(40, i), greedy(4), f"ahead-{i}", buffered=False, priority=Priority.INTERACTIVE)
    with pytest.raises(DeadlineUnmeetable, match="deadline in 500 ms"):
        eng.submit(tokens(40, 9), greedy(4), "hopeless", deadline_s=0.5)  # needs ~2.4 s
    assert "hopeless" not in eng.scheduler.requests
    eng.submit(tokens(40, 9), greedy(4), "urgent", deadline_s=0.5, priority=Priority.SAFETY)  # ~0.4 s


def test_a_decode_in_the_background_does_not_make_a_short_prompt_look_slow():
    # every step costs 0.1 s whatever its size, as on a CPU at a small batch: a request
    # decoding in the background must not make a 40-token prompt look like 40 decode steps
    clock = FakeClock()
    eng = fleet_engine(clock)
    for name in ("execute", "execute_greedy"):  # a step runs one of them (greedy_head for all-greedy steps)
        run = getattr(eng.runner, name)

        def timed(out, run=run):
            clock.advance(0.1)
            return run(out)

        setattr(eng.runner, name, timed)
    eng.submit(tokens(40, 1), greedy(50), "background", buffered=False)
    for _ in range(10):  # its prefill, then steps of one decode token
        eng.step()
    assert eng.scheduler.rate.seconds_per_step == pytest.approx(0.1)
    assert eng.scheduler.first_token_eta(Request("probe", tokens(40, 2), greedy(4), 0, clock())) == pytest.approx(0.1)
    eng.submit(tokens(40, 2), greedy(4), "urgent", deadline_s=0.5, priority=Priority.SAFETY)  # one step away


def test_a_running_request_is_stopped_at_its_deadline_with_what_it_has():
    clock = FakeClock()
    eng = fleet_engine(clock)
    rid = eng.submit(tokens(8, 1), greedy(100), "slow", deadline_s=1.0)
    deltas = run(eng, clock, seconds_per_step=0.1)
    assert deltas[-1].finish_reason is FinishReason.DEADLINE
    produced = sum(len(d.token_ids) for d in deltas)
    assert 5 <= produced < 100
    assert eng.stats().deadline_misses == 1 and eng.stats().running == 0
    assert rid not in eng.scheduler.requests


def test_earliest_deadline_first_inside_a_class():
    clock = FakeClock()
    eng = fleet_engine(clock, max_num_seqs=1)
    eng.submit(tokens(8, 1), greedy(2), "none", buffered=False)
    eng.submit(tokens(8, 2), greedy(2), "late", buffered=False, deadline_s=50.0)
    eng.submit(tokens(8, 3), greedy(2), "soon", buffered=False, deadline_s=20.0)
    starts = [d.request_id for d in run(eng, clock)]
    assert list(dict.fromkeys(starts)) == ["soon", "late", "none"]


# --- fairness and ageing ----------------------------------------------------------------------


def test_a_flooding_robot_gets_no_more_than_an_equal_share():
    clock = FakeClock()
    eng = fleet_engine(clock, max_num_seqs=2, max_num_batched_tokens=32)
    robots = {"flooder": 60, "r1": 15, "r2": 15, "r3": 15}
    seeds = iter(range(1000))
    for robot, n in robots.items():  # the flood arrives first
        for i in range(n):
            eng.submit(tokens(10, next(seeds)), greedy(8), f"{robot}/{i}", buffered=False, robot_id=robot)
    served: Counter[str] = Counter()
    # measure while every robot still has work waiting (a robot without work cannot get its share)
    while all(any(r.robot_id == robot for r in eng.scheduler.waiting) for robot in robots):
        clock.advance(0.1)
        for d in eng.step():
            served[d.request_id.split("/")[0]] += len(d.token_ids)
    total = sum(served.values())
    assert total > 300
    for robot in robots:
        assert abs(served[robot] / total - 0.25) <= 0.25 * 0.2, served


def test_a_robot_returning_after_idling_banks_no_credit():
    clock = FakeClock()
    eng = fleet_engine(clock, max_num_seqs=1)
    policy: FleetPolicy = eng.scheduler.policy
    for i in range(4):
        eng.submit(tokens(8, i), greedy(4), f"busy-{i}", buffered=False, robot_id="busy")
    run(eng, clock)
    eng.submit(tokens(8, 9), greedy(4), "busy-again", buffered=False, robot_id="busy")
    eng.submit(tokens(8, 10), greedy(4), "newcomer", buffered=False, robot_id="new")
    assert policy.served("new") == policy.served("busy") > 0  # lifted to the active minimum


def test_no_request_waits_past_the_ageing_bound():
    clock = FakeClock()
    ageing, step_time = 3.0, 0.1
    eng = fleet_engine(clock, policy=FleetPolicyConfig(ageing_s=ageing), max_num_seqs=1,
                       max_num_batched_tokens=32)
    eng.submit(tokens(8, 0), greedy(4), "background", buffered=False, priority=Priority.BACKGROUND)
    first_token = {}
    for i in range(60):  # a steady stream of higher-class work keeps the only seat busy
        if i % 2 == 0:
            eng.submit(tokens(8, i + 1), greedy(4), f"interactive-{i}", buffered=False,
                       priority=Priority.INTERACTIVE)
        clock.advance(step_time)
        for d in eng.step():
            first_token.setdefault(d.request_id, clock.now)
    # it arrived at 0; once aged it goes next, after at most the run of the request holding the seat
    assert ageing <= first_token["background"] <= ageing + 5 * step_time


def test_cache_aware_order_prefers_the_longest_prefix_match_among_equals():
    clock = FakeClock()
    eng = fleet_engine(clock, max_num_seqs=1)
    shared = tokens(40, 3)  # above cache_aware_min_tokens
    eng.submit(shared + [1, 2], greedy(1), "warm-up", buffered=False, robot_id="a")
    run(eng, clock)
    eng.submit(tokens(42, 4), greedy(1), "cold", buffered=False, robot_id="b")
    eng.submit(shared + [5, 6], greedy(1), "warm", buffered=False, robot_id="c")
    order = [d.request_id for d in run(eng, clock)]
    assert order == ["warm", "cold"]  # arrived later, but its prefix is cached


def test_cache_aware_ordering_matches_only_the_head_of_a_long_queue():
    policy = FleetPolicy(FleetPolicyConfig(cache_aware_window=32))
    waiting = [Request(f"r{i}", [1 + i % 90, 2], greedy(1), i, 0.0, robot_id=f"robot-{i % 100}")
               for i in range(5000)]
    for req in waiting:
        policy.on_add(req)
    calls = []
    ordered = policy.order(waiting, now=0.0, prefix_len=lambda r: calls.append(r) or 0)
    assert len(calls) <= 32 and len(ordered) == 5000 and set(ordered) == set(waiting)


def test_a_step_that_admits_a_safety_request_runs_nothing_of_lower_classes():
    clock = FakeClock()
    eng = fleet_engine(clock, max_num_batched_tokens=16)
    eng.submit(tokens(4, 3), greedy(30), "decoding", buffered=False)
    eng.submit(tokens(60, 1), greedy(4), "plan", buffered=False)  # a prompt of four chunks
    for _ in range(2):
        clock.advance(0.1)
        eng.step()
    plan, decoding = request(eng, "plan"), request(eng, "decoding")
    computed, decoded = plan.num_computed_tokens, decoding.num_output_tokens
    assert decoded > 0
    eng.submit(tokens(8, 2), greedy(4), "safety", buffered=False, priority=Priority.SAFETY)
    clock.advance(0.1)
    assert [d.request_id for d in eng.step()] == ["safety"]  # its first token, in a step of its own
    assert plan.num_computed_tokens == computed and decoding.num_output_tokens == decoded
    clock.advance(0.1)
    eng.step()
    assert plan.num_computed_tokens > computed  # the plan's prefill goes on next step
