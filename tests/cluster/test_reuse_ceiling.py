"""The reuse bounds of a trace's placements against naive prefix matching."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cloudd.cluster.lru_replay import BlockLRU, bounded_reuse, pow2_placement, replay_hit_rate, robot_placement
from cloudd.cluster.reuse_ceiling import PromptTrie, hit_rate, main, reuse_bounds

prompts_strategy = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=12)


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(prompts_strategy)
def test_the_trie_finds_the_longest_prefix_any_earlier_prompt_had(prompts):
    trie = PromptTrie()
    for i, ids in enumerate(prompts):
        assert trie.insert(ids) == max((common_prefix(ids, earlier) for earlier in prompts[:i]), default=0)


def test_hit_rate_counts_what_each_replica_holds_less_the_last_token():
    prompts = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9], [1, 2, 9]]
    assert hit_rate(prompts, [0, 0, 0, 0]) == pytest.approx((0 + 3 + 2 + 2) / 14)  # the repeat computes its last token
    assert hit_rate(prompts, [0, 1, 0, 1]) == pytest.approx((0 + 0 + 2 + 2) / 14)


@given(prompts_strategy, st.integers(1, 4))
def test_no_placement_beats_one_replica(prompts, replicas):
    bounds = reuse_bounds(prompts, replicas, seeds=3)
    assert 0 <= bounds.random_placement <= bounds.one_replica + 1e-12 <= 1 + 1e-12  # the mean of equal rates may round up
    assert bounds.router_headroom == pytest.approx(bounds.one_replica - bounds.random_placement)


def test_one_replica_of_many_is_no_spread():
    prompts = [[1, 2, 3], [1, 2, 4], [5, 6]]
    bounds = reuse_bounds(prompts, replicas=1)
    assert bounds.random_placement == bounds.one_replica


def test_the_command_reports_each_limit(tmp_path, capsys, default_model_path):
    trace = tmp_path / "trace.jsonl"
    system = {"role": "system", "content": "You plan for a warehouse robot."}
    rows = [{"id": f"r{i}", "robot": f"amr-{i % 2}", "messages": [system, {"role": "user", "content": f"Task {i}."}]}
            for i in range(4)]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["--trace", str(trace), "--limit", "2,4", "--model", str(default_model_path), "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [runs[n]["requests"] for n in ("2", "4")] == [2, 4]
    assert runs["4"]["one_replica"] > runs["2"]["one_replica"] > 0  # the system prompt, reused
    assert main(["--trace", str(tmp_path / "missing.jsonl")]) == 2


# --- bounded LRU replay (cloudd.cluster.lru_replay) -------------------------------------------

class NaiveLRU:
    """The reference: a list of whole-prefix keys, most recent last."""

    def __init__(self, capacity: int, block_size: int):
        self.capacity, self.block_size, self.keys = capacity, block_size, []

    def serve(self, ids) -> int:
        blocks = [tuple(ids[:end]) for end in range(self.block_size, len(ids) + 1, self.block_size)]
        cached = 0
        while cached < len(blocks) and blocks[cached] in self.keys:
            cached += 1
        for key in reversed(blocks):
            if key in self.keys:
                self.keys.remove(key)
            self.keys.append(key)
        del self.keys[:max(0, len(self.keys) - self.capacity)]
        return min(cached * self.block_size, len(ids) - 1)


@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=10), min_size=1, max_size=20),
       st.integers(1, 6), st.integers(1, 3))
def test_the_block_cache_matches_a_naive_lru_of_prefixes(prompts, capacity, block_size):
    cache, naive = BlockLRU(capacity, block_size), NaiveLRU(capacity, block_size)
    for ids in prompts:
        assert cache.serve(ids) == naive.serve(ids)


def test_a_prefix_outlives_its_continuations():
    cache = BlockLRU(capacity=3, block_size=2)
    cache.serve([1, 2, 3, 4, 5, 6, 9])  # blocks (1,2) (3,4) (5,6), the first most recent
    cache.serve([7, 8, 0])  # evicts (5,6): the oldest, the deepest continuation
    assert cache.serve([1, 2, 3, 4, 5, 6, 9]) == 4


@given(prompts_strategy, st.integers(1, 3))
def test_an_unbounded_pool_of_one_token_blocks_is_the_trie(prompts, replicas):
    """With room for everything and one-token blocks the replay is the unbounded trie's reuse."""
    placement = [i % replicas for i in range(len(prompts))]
    assert replay_hit_rate(prompts, placement, capacity=10_000, block_size=1) == pytest.approx(
        hit_rate(prompts, placement))


def test_robot_affinity_keeps_each_robot_on_one_replica_and_pow2_balances():
    robots = [f"amr-{i % 5}" for i in range(40)]
    placement = robot_placement(robots, 3)
    assert all(len({p for r, p in zip(robots, placement) if r == robot}) == 1 for robot in set(robots))
    assert placement == robot_placement(robots, 3)
    import random
    spread = pow2_placement(300, 2, random.Random(0))
    assert abs(spread.count(0) - spread.count(1)) < 30


def test_with_a_pool_too_small_for_every_history_affinity_beats_random():
    """Two robots whose histories each fill one replica's pool: affinity keeps both cached,
    placement that ignores the robot thrashes both caches."""
    histories = {"a": [1] * 8, "b": [2] * 8}
    robots = ["a", "b"] * 20
    prompts = [histories[r] + [9] for r in robots]
    bounds = bounded_reuse(prompts, robots, replicas=2, pool_frac=0.5, capacity_blocks=2, block_size=4)
    if len(set(robot_placement(["a", "b"], 2))) == 2:
        assert bounds.robot > bounds.random + 0.1
    assert bounds.combined >= bounds.robot - 1e-12


def test_the_command_prints_the_bounded_table(tmp_path, capsys, default_model_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"id": f"r{i}", "robot": f"amr-{i % 3}", "messages": [
        {"role": "system", "content": "You plan for a warehouse robot. " * 8},
        {"role": "user", "content": f"Robot {i % 3} history " * 20 + f"task {i}."}]} for i in range(12)]
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["--trace", str(trace), "--limit", "12", "--pool-frac", "0.2,0.5", "--model",
                 str(default_model_path), "--json"]) == 0
    bounded = json.loads(capsys.readouterr().out)["bounded"]
    assert list(bounded) == ["0.2", "0.5"]
    assert bounded["0.5"]["capacity_blocks"] > bounded["0.2"]["capacity_blocks"]
    for b in bounded.values():
        assert all(0 <= b[placement] <= 1 for placement in ("random", "pow2", "robot", "combined"))
    assert main(["--trace", str(trace), "--pool-frac", "1.5", "--model", str(default_model_path)]) == 2
