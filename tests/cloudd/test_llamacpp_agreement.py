"""The llama.cpp agreement check without llama.cpp: the comparison on tiny made-up log-probs, the
reading of a ``/completion`` reply, and our teacher-forced rows against a cache-free forward.
(The check against the real llama-server is in test_llamacpp_agreement_real.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from cloudd.llamacpp_agreement.agreement import TopTwo, compare
from cloudd.llamacpp_agreement.peer import parse_completion
from cloudd.llamacpp_agreement.prompts import named_prompts
from cloudd.llamacpp_agreement.report import as_json, format_table, summary
from cloudd.teacher_forcing import teacher_forced_logprobs
from tests.engine.tiny import dense_logits, tiny_model


def rows(*tops: tuple[int, float, int, float]) -> torch.Tensor:
    """Log-prob rows over a vocabulary of 8: per row (top-1, its log-prob, top-2, its log-prob),
    every other token at log(0.001)."""
    out = torch.full((len(tops), 8), math.log(0.001))
    for r, (a, la, b, lb) in enumerate(tops):
        out[r, a], out[r, b] = la, lb
    return out


def top(a: int, la: float, b: int, lb: float) -> TopTwo:
    return TopTwo((a, b), (la, lb))


def test_identical_continuations_agree_everywhere():
    ours = [3, 4, 5]
    r = compare("p", "float32", ours, rows((3, -0.1, 1, -3.0), (4, -0.2, 1, -2.0), (5, -0.1, 2, -4.0)), ours,
                [top(3, -0.1, 1, -3.0)] * 3, [top(3, -0.1, 1, -3.0), top(4, -0.2, 1, -2), top(5, -0.1, 2, -4)])
    assert (r.greedy_match, r.divergence, r.top1_agree, r.disagreements, r.top1_rate) == (3, None, 3, (), 1.0)


def test_a_divergence_faces_their_greedy_choice_with_both_margins():
    ours, theirs = [3, 4, 5], [3, 6, 7]
    # position 1: ours 4 at -0.6, their 6 at -0.8 (0.2 below); llama.cpp: 6 over 4 by 0.1
    our_rows = rows((3, -0.1, 1, -3.0), (4, -0.6, 6, -0.8), (5, -0.1, 2, -4.0))
    their_greedy = [top(3, -0.1, 1, -3.0), top(6, -0.65, 4, -0.75), top(7, -0.1, 5, -3.0)]
    forced = [top(3, -0.1, 1, -3.0), top(6, -0.65, 4, -0.75), top(5, -0.1, 2, -4.0)]
    r = compare("p", "bfloat16", ours, our_rows, theirs, their_greedy, forced)
    assert r.greedy_match == 1
    d = r.divergence
    assert (d.position, d.ours.ids, d.theirs.ids) == (1, (4, 6), (6, 4))
    assert d.ours.margin == pytest.approx(0.2) and d.theirs.margin == pytest.approx(0.1)
    assert d.ours_gap == pytest.approx(0.2) and d.near_tie() and not d.near_tie(0.05)
    assert r.top1_agree == 2 and [x.position for x in r.disagreements] == [1]


def test_a_wide_disagreement_is_no_near_tie_and_ours_gap_reads_our_row_for_their_token():
    ours = [3]
    r = compare("p", "float32", ours, rows((3, -0.01, 1, -5.0)), ours, [top(3, -0.1, 1, -3.0)],
                [top(2, -0.01, 3, -6.0)])
    (d,) = r.disagreements
    assert d.ours_gap == pytest.approx(-0.01 - math.log(0.001)) and not d.near_tie()
    assert r.greedy_match == 1 and r.top1_agree == 0


def test_lengths_must_match():
    with pytest.raises(ValueError, match="differ in length"):
        compare("p", "float32", [3, 4], rows((3, -0.1, 1, -3.0)), [3, 4], [top(3, 0, 1, -1)] * 2,
                [top(3, 0, 1, -1)] * 2)


def test_the_report_counts_per_dtype():
    ours = [3, 4]
    same = compare("a", "float32", ours, rows((3, -0.1, 1, -3.0), (4, -0.1, 1, -3.0)), ours,
                   [top(3, -0.1, 1, -3.0)] * 2, [top(3, -0.1, 1, -3.0), top(4, -0.1, 1, -3.0)])
    split = compare("b", "float32", ours, rows((3, -0.1, 1, -3.0), (4, -0.6, 6, -0.8)), [3, 6],
                    [top(3, -0.1, 1, -3.0), top(6, -0.65, 4, -0.75)], [top(3, -0.1, 1, -3.0), top(6, -0.65, 4, -0.75)])
    s = summary([same, split])["float32"]
    assert (s["prompts"], s["greedy_identical"], s["greedy_match_mean"], s["top1_agree"], s["positions"]) == (
        2, 1, 0.75, 3, 4)
    assert (s["disagreements"], s["disagreements_near_tie"], s["divergences_near_tie"]) == (1, 1, 1)
    table = format_table([same, split], str)
    assert "greedy diverges: at 1: ours '4' > '6' by 0.200" in table and "near-tie" in table
    assert as_json("m", [same, split], str)["prompts"][1]["divergence"]["theirs"]["texts"] == ["6", "4"]


def test_a_completion_reply_gives_tokens_and_top_two():
    reply = {"tokens": [11, 12], "completion_probabilities": [
        {"id": 11, "logprob": -0.1, "top_logprobs": [{"id": 11, "logprob": -0.1}, {"id": 9, "logprob": -2.5}]},
        {"id": 12, "logprob": -0.3, "top_logprobs": [{"id": 12, "logprob": -0.3}, {"id": 11, "logprob": -1.5}]}]}
    ids, tops = parse_completion(reply, 2)
    assert ids == [11, 12] and tops == [top(11, -0.1, 9, -2.5), top(12, -0.3, 11, -1.5)]
    with pytest.raises(RuntimeError, match="1 tokens and 2 probability rows for 2"):
        parse_completion({**reply, "tokens": [11]}, 2)
    with pytest.raises(RuntimeError, match="no top-2"):
        parse_completion({"tokens": [11], "completion_probabilities": [{"id": 11, "top_logprobs": []}]}, 1)


def test_teacher_forced_rows_are_the_cache_free_forward_from_the_prompts_last_token_on():
    model = tiny_model()
    prompt, continuation = [5, 9, 2, 7], [11, 3, 8]
    got = teacher_forced_logprobs(model, prompt, continuation)
    want = torch.log_softmax(dense_logits(model, prompt + continuation[:-1]).float(), dim=-1)[len(prompt) - 1:]
    assert got.shape == (3, model.config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="need a prompt and a continuation"):
        teacher_forced_logprobs(model, prompt, [])


def test_the_prompts_are_the_demos_and_plan_evals_first_tasks():
    prompts = named_prompts(["demo", "plan-eval"], 3)
    assert [p.name for p in prompts][:2] == ["demo/tote", "demo/safety"] and len(prompts) == 5
    assert prompts[0].messages[-1] == {"role": "user", "content": "Task: bring tote 12 from waypoint 17 to shelf A3."}
    assert all(p.name.startswith("plan-eval/") for p in prompts[2:])
    with pytest.raises(ValueError, match="unknown set 'trace'"):
        named_prompts(["trace"], 1)
