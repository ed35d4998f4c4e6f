"""The scheduler in isolation: budgets, ordering, prefix sharing, preemption, caching on finish.

No model: each step a fake "sampler" appends a token that names its request and position, so
requests never share output tokens by accident. Blocks hold 4 tokens throughout.
"""

from __future__ import annotations

import itertools

import pytest

from shared.engine.kv.block_pool import BlockPool
from shared.engine.kv.manager import KVCacheManager
from shared.engine.kv.radix import RadixTree
from shared.engine.policy import FCFS, SchedulingPolicy
from shared.engine.request import FinishReason, Request, RequestStatus
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler, SchedulerConfig
from shared.engine.scheduler_output import SchedulerOutput

BLOCK = 4
_arrivals = itertools.count()


def make_scheduler(num_blocks: int = 64, policy=None, **config) -> Scheduler:
    pool = BlockPool(num_blocks, BLOCK)
    return Scheduler(SchedulerConfig(**config), KVCacheManager(pool, RadixTree(pool)), policy or FCFS())


def request(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    """Arrival order is creation order."""
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), next(_arrivals), 0.0)


def fake_token(request_id: str, position: int) -> int:
    """The token "sampled" at ``position``: unique per request, never a prompt token (< 1000)."""
    return 1000 * (1 + ord(request_id[0])) + position


def step(sched: Scheduler) -> SchedulerOutput:
    """schedule() + update() with fake tokens for every chunk that samples."""
    out = sched.schedule()
    sched.update(out, {c.request_id: [(fake_token(c.request_id, c.end), 0.0)] for c in out.chunks if c.sample})
    return out


def shape(chunks) -> list[tuple[str, int, int]]:
    """(request id, start, number of tokens) per chunk: the readable form of a step."""
    return [(c.request_id, c.start, len(c.token_ids)) for c in chunks]


def check(sched: Scheduler) -> None:
    sched.kv.check_integrity(list(sched.requests.values()))


# --- (a) order within a step --------------------------------------------------------------------


def test_decodes_go_before_prefill_chunks_and_admissions():
    sched = make_scheduler(max_num_batched_tokens=4)
    a = request("A", [1, 2])
    sched.add(a)
    assert shape(step(sched).prefills) == [("A", 0, 2)]  # A samples: it decodes from now on
    b = request("B", list(range(10, 22)))  # 12 tokens
    sched.add(b)
    out = step(sched)
    assert shape(out.decodes) == [("A", 2, 1)]
    assert shape(out.prefills) == [("B", 0, 3)]  # what the decode left of the budget
    c = request("C", [7, 7, 7])
    sched.add(c)
    out = step(sched)
    assert shape(out.decodes) == [("A", 3, 1)]
    assert shape(out.prefills) == [("B", 3, 3)]  # a running prefill outranks an admission
    assert c.status == RequestStatus.WAITING
    check(sched)


class Priority(SchedulingPolicy):
    """Test policy: a priority per request id (smaller first), then arrival."""

    def __init__(self, priorities: dict[str, int]):
        self.priorities = priorities

    def key(self, req: Request, now: float) -> tuple:
        return (self.priorities[req.request_id], req.arrival_seq)


def test_a_decode_goes_first_even_next_to_a_higher_priority_prefill():
    sched = make_scheduler(max_num_batched_tokens=4, policy=Priority({"low": 1, "high": 0}))
    sched.add(request("low", [1, 2]))
    step(sched)
    sched.add(request("high", list(range(10, 22))))
    out = step(sched)
    assert shape(out.decodes) == [("low", 2, 1)]
    assert shape(out.prefills) == [("high", 0, 3)]
    out = step(sched)
    assert shape(out.decodes) == [("low", 3, 1)]  # a prefill chunk never starves a decode
    assert shape(out.prefills) == [("high", 3, 3)]


# --- (b) chunked prefill -------------------------------------------------------------------------


def test_chunked_prefill_fills_the_budget_exactly():
    sched = make_scheduler(max_num_batched_tokens=5)
    sched.add(request("A", list(range(12))))
    chunks = [step(sched).prefills for _ in range(3)]
    assert [shape(c) for c in chunks] == [[("A", 0, 5)], [("A", 5, 5)], [("A", 10, 2)]]
    assert [c[0].sample for c in chunks] == [False, False, True]  # only the last one samples
    assert [c[0].token_ids for c in chunks] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    out = step(sched)
    assert shape(out.decodes) == [("A", 12, 1)] and not out.prefills
    check(sched)


def test_every_step_stays_within_the_token_budget():
    sched = make_scheduler(max_num_batched_tokens=5)
    for rid, n in zip("ABCD", [7, 3, 9, 1]):
        sched.add(request(rid, list(range(100 * len(rid) + n, 100 * len(rid) + 2 * n)), max_tokens=3))
    while sched.has_unfinished:
        out = step(sched)
        assert 0 < out.num_tokens <= 5
    check(sched)


# --- (c) never compute the same prefix twice -----------------------------------------------------


@pytest.mark.parametrize("budget", [5, 8, 64])
def test_requests_sharing_an_uncached_prefix_wait_for_the_first_to_compute_it(budget):
    shared = list(range(100, 120))  # 20 tokens nobody has cached
    prompts = {rid: shared + [tail] * 4 for rid, tail in zip("ABC", [1, 2, 3])}
    sched = make_scheduler(max_num_batched_tokens=budget, in_batch_prefix_min_tokens=1)
    reqs = {rid: request(rid, p, max_tokens=2) for rid, p in prompts.items()}
    for r in reqs.values():
        sched.add(r)

    out = step(sched)
    assert [c.request_id for c in out.prefills] == ["A"]  # B and C defer to A
    computed = out.num_tokens
    while sched.has_unfinished:
        out = step(sched)
        # NOTE: a 1-token prompt tail is scheduled as a decode, so count prompt positions.
        computed += sum(max(0, min(c.end, 24) - c.start) for c in out.chunks)
        assert all(c.start >= 20 for c in out.chunks if c.request_id != "A")

    assert computed == 20 + 3 * 4  # every unique prompt token exactly once
    assert reqs["A"].num_cached_tokens == 0
    assert reqs["B"].num_cached_tokens == reqs["C"].num_cached_tokens == 20
    check(sched)


def test_below_the_threshold_a_short_shared_prefix_is_not_waited_for():
    """The default threshold (32 tokens) admits at once when only 20 shared tokens are at stake."""
    shared = list(range(100, 120))
    sched = make_scheduler(max_num_batched_tokens=64)
    for rid, tail in zip("AB", [1, 2]):
        sched.add(request(rid, shared + [tail] * 4))
    assert [c.request_id for c in step(sched).prefills] == ["A", "B"]


# --- (d) preemption by recompute -----------------------------------------------------------------


def test_preemption_requeues_the_latest_arrival_which_later_reuses_its_cached_prefix():
    # 4 usable blocks. A and B take 2 each after one decode; A's token at position 8 needs a 5th.
    sched = make_scheduler(num_blocks=5, max_num_batched_tokens=8)
    a, b = request("A", [1, 2, 3, 4], max_tokens=6), request("B", [5, 6, 7, 8], max_tokens=10)
    sched.add(a)
    sched.add(b)
    for _ in range(5):  # prompts, then decodes at positions 4..7
        out = step(sched)
        assert not out.preempted
    out = step(sched)
    assert out.preempted == ["B"]  # B arrived last: B yields
    assert shape(out.decodes) == [("A", 8, 1)] and not out.prefills
    assert b.status == RequestStatus.WAITING and b in sched.waiting
    assert (b.num_computed_tokens, b.block_table, b.num_preemptions) == (0, [], 1)
    assert sched.num_preemptions == 1
    assert b.output_token_ids == [fake_token("B", p) for p in range(4, 9)]  # kept, recomputed later
    assert a.is_finished  # its 6th token

    out = step(sched)
    # B's prompt block survived in the cache (only its output block was evicted for A)
    assert b.num_cached_tokens == 4
    assert shape(out.prefills) == [("B", 4, 5)]  # recompute output tokens at 4..8 only
    while sched.has_unfinished:
        step(sched)
    assert b.finish_reason == FinishReason.LENGTH and b.num_output_tokens == 10
    check(sched)


def test_a_request_preempts_itself_when_nobody_else_is_idle():
    # 2 usable blocks: A alone outgrows the pool at position 8.
    sched = make_scheduler(num_blocks=3, max_num_batched_tokens=8)
    a = request("A", [1, 2, 3, 4, 5, 6, 7], max_tokens=5)
    sched.add(a)
    step(sched)  # prompt 0..7
    step(sched)  # decode at 7
    out = step(sched)  # decode at 8 needs a 3rd block
    assert out.preempted == ["A"] and out.is_empty
    assert a.status == RequestStatus.WAITING and a.num_preemptions == 1
    check(sched)


def test_the_victim_is_the_max_key_even_when_that_is_the_request_asking_for_room():
    # 3 usable blocks. `low` (priority 1) decodes; `high` (priority 0) prefills in chunks.
    sched = make_scheduler(num_blocks=4, max_num_batched_tokens=4, policy=Priority({"low": 1, "high": 0}))
    low = request("low", [1, 2, 3, 4, 5, 6, 7], max_tokens=8)
    sched.add(low)
    step(sched)  # low 0..4
    high = request("high", list(range(10, 26)))
    sched.add(high)
    assert shape(step(sched).prefills) == [("low", 4, 3), ("high", 0, 1)]
    assert shape(step(sched).prefills) == [("high", 1, 3)]  # the pool is now full
    out = step(sched)  # low's decode at position 8 needs a 4th block
    assert out.preempted == ["low"]  # the largest key yields, as FCFS's latest arrival does
    assert high.status == RequestStatus.RUNNING


# --- (e) finishing caches prompt and output ------------------------------------------------------


def test_a_finished_request_leaves_prompt_and_computed_output_in_the_tree():
    sched = make_scheduler()
    a = request("A", [1, 2, 3, 4, 5], max_tokens=3)
    sched.add(a)
    while sched.has_unfinished:
        step(sched)
    assert a.finish_reason == FinishReason.LENGTH and a.block_table == []
    # NOTE: the last sampled token was never fed to the model, so it has no KV to cache.
    follow_up = a.all_token_ids + [9, 9]
    assert sched.kv.index.match(follow_up).num_tokens == 5 + 3 - 1
    b = request("B", follow_up)
    sched.add(b)
    step(sched)
    assert b.num_cached_tokens == 7
    check(sched)


# --- (f) seats -----------------------------------------------------------------------------------


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [request(rid, [i, i + 1], max_tokens=2) for i, rid in enumerate("ABC")]
    for r in reqs:
        sched.add(r)
    out = step(sched)
    assert [c.request_id for c in out.prefills] == ["A", "B"]
    assert len(sched.running) == 2 and len(sched.waiting) == 1
    out = step(sched)  # A and B finish (2nd token) in this step's update
    assert [c.request_id for c in out.decodes] == ["A", "B"] and not out.prefills
    out = step(sched)
    assert [c.request_id for c in out.prefills] == ["C"]
    while sched.has_unfinished:
        assert len(sched.running) <= 2
        step(sched)
    check(sched)


def test_an_over_long_prompt_is_rejected_on_add():
    sched = make_scheduler(max_model_len=8)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(request("A", list(range(8))))
    with pytest.raises(ValueError, match="already in use"):
        sched.add(request("B", [1]))
        sched.add(request("B", [2]))
