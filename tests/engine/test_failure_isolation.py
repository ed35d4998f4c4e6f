"""A failure serving one request ends that request alone (finish reason ``error``); the others
get exactly the tokens they would have got, and every block comes back."""

from __future__ import annotations

from collections import defaultdict

import pytest

from shared.engine.engine import Engine
from shared.engine.request import FinishReason
from shared.engine.sampling_params import SamplingParams
from tests.engine.test_engine_api import MODEL, OTHER, PROMPT, assert_everything_released, engine
from tests.engine.tiny import greedy_reference

THIRD = [3, 1, 4, 1, 5, 9, 2, 6]


def greedy(max_tokens: int) -> SamplingParams:
    """The greedy tokens through the sampler (a filter that keeps one token): an all-greedy step
    never calls it (``kernels.greedy_head``)."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0, top_k=1)


def plain_greedy(max_tokens: int) -> SamplingParams:
    """Greedy: an all-greedy step takes the runner's ``execute_greedy``."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def run_all(e: Engine, prompts: dict[str, list[int]], max_tokens: int = 5,
            sampling=greedy) -> dict[str, tuple[list[int], FinishReason]]:
    """Submit ``prompts`` (unbuffered, ``sampling(max_tokens)``), step until nothing is left:
    every request's tokens and how it ended (those submitted before too)."""
    for rid, prompt in prompts.items():
        e.submit(prompt, sampling(max_tokens), request_id=rid, buffered=False)
    tokens: dict[str, list[int]] = defaultdict(list)
    ends: dict[str, FinishReason] = {}
    while e.has_unfinished:
        for delta in e.step():
            tokens[delta.request_id] += delta.token_ids
            if delta.finished:
                ends[delta.request_id] = delta.finish_reason
    return {rid: (tokens[rid], end) for rid, end in ends.items()}


def test_a_request_whose_sampling_raises_ends_alone_with_error(monkeypatch):
    e = engine()
    sample = e.sampler.sample

    def faulty(logits, request_ids, params):
        if "bad" in request_ids:
            raise RuntimeError("this request's sampling is broken")
        return sample(logits, request_ids, params)

    monkeypatch.setattr(e.sampler, "sample", faulty)
    out = run_all(e, {"a": PROMPT, "bad": OTHER, "c": THIRD})
    assert out["bad"] == ([], FinishReason.ERROR)
    assert out["a"] == (greedy_reference(MODEL, PROMPT, 5), FinishReason.LENGTH)
    assert out["c"] == (greedy_reference(MODEL, THIRD, 5), FinishReason.LENGTH)
    assert_everything_released(e)


def test_a_request_failing_mid_generation_keeps_what_it_had_and_frees_its_blocks(monkeypatch):
    e = engine()
    sample, calls = e.sampler.sample, {"n": 0}

    def fails_on_third_token(logits, request_ids, params):
        if "bad" in request_ids:
            calls["n"] += 1
            if calls["n"] >= 3:
                raise ValueError("broken after two tokens")
        return sample(logits, request_ids, params)

    monkeypatch.setattr(e.sampler, "sample", fails_on_third_token)
    out = run_all(e, {"bad": OTHER, "a": PROMPT})
    assert out["bad"] == (greedy_reference(MODEL, OTHER, 2), FinishReason.ERROR)
    assert out["a"] == (greedy_reference(MODEL, PROMPT, 5), FinishReason.LENGTH)
    assert_everything_released(e)


def test_a_failing_detokenizer_ends_its_request_alone():
    class Broken:
        stopped = False

        def push(self, tokens):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken on purpose")

    e = engine()
    e.submit(OTHER, greedy(5), request_id="bad", buffered=False)
    e.delivery.detokenizers["bad"] = Broken()  # NOTE: the tiny model has no tokenizer; this one fails on first use
    out = run_all(e, {"a": PROMPT})
    assert out["a"] == (greedy_reference(MODEL, PROMPT, 5), FinishReason.LENGTH)
    assert out["bad"][1] is FinishReason.ERROR
    assert_everything_released(e)


@pytest.mark.parametrize("method, sampling", [("execute", greedy), ("execute_greedy", plain_greedy)])
def test_a_failed_forward_pass_ends_its_step_and_the_engine_serves_on(monkeypatch, method, sampling):
    e = engine()
    run, failures = getattr(e.runner, method), {"left": 1}

    def fails_once(out):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("out of memory")
        return run(out)

    monkeypatch.setattr(e.runner, method, fails_once)
    out = run_all(e, {"a": PROMPT, "b": OTHER}, sampling=sampling)
    assert {rid: end for rid, (_, end) in out.items()} == {"a": FinishReason.ERROR, "b": FinishReason.ERROR}
    again = run_all(e, {"again": PROMPT}, sampling=sampling)
    assert again == {"again": (greedy_reference(MODEL, PROMPT, 5), FinishReason.LENGTH)}
    assert_everything_released(e)


@pytest.mark.parametrize("bad_first", [True, False])
def test_a_failure_in_the_scheduler_itself_still_raises(monkeypatch, bad_first):
    """Only a request's own work is isolated: a broken scheduler is not hidden."""
    e = engine()
    e.submit(PROMPT, greedy(3), buffered=False)

    def broken():
        raise AssertionError("scheduler invariant broken")

    monkeypatch.setattr(e.scheduler, "schedule" if bad_first else "update", lambda *a: broken())
    with pytest.raises(AssertionError):
        e.step()
