"""The reuse bounds of a trace's placements against naive prefix matching."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
