"""The per-request work budget (``shared.engine.request_budget``): a request whose own grammar
and detokenizer work in one step passes ``request_step_budget_s`` ends alone, with an error
naming the budget, and the others of its batch go on (issue 48: one request's mask fill and
accept took 2-3 s per step, every robot waiting). Timed by fake timers: nothing here depends on
how fast the machine is."""

from __future__ import annotations

import gc
import itertools
import threading

import pytest

from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.request import FinishReason
from shared.engine.request_budget import CollectorFreeClock, RequestBudget, WorkMeter, own_cpu_time
from shared.engine.sampling_params import SamplingParams
from tests.engine.tiny import tiny_model

THIRTY_LETTERS = {"type": "regex", "regex": "[a-z]{30}"}  # cannot end before max_tokens


def still(*_: object) -> float:
    """A timer that never moves: work charged by it costs nothing."""
    return 0.0


def test_meters_charge_the_time_of_their_work_and_the_budget_names_who_passed_it(monkeypatch):
    monkeypatch.setattr(WorkMeter, "timer", staticmethod(itertools.count(0.0, 0.2).__next__))
    light, heavy = WorkMeter(), WorkMeter()
    with light.timing():  # 0.2 s
        pass
    for _ in range(3):  # 0.6 s
        with heavy.timing():
            pass
    budget = RequestBudget(0.5)
    (overrun,) = budget.over([("amr-001/light", [light]), ("amr-002/heavy", [heavy])])
    assert overrun.work.request_id == "amr-002/heavy" and overrun.work.seconds == pytest.approx(0.6)
    assert "over its budget of 500 ms (request_step_budget_s)" in overrun.detail
    assert budget.heaviest == overrun.work
    assert budget.over([("amr-002/heavy", [heavy])]) == []  # taken: each step starts from 0


def test_a_request_over_its_step_budget_ends_alone_and_the_others_go_on(tokenizer, monkeypatch):
    monkeypatch.setattr(WorkMeter, "timer", staticmethod(still))
    engine = Engine(tiny_model(vocab_size=tokenizer.vocab_size), tokenizer,
                    EngineConfig(block_size=4, num_blocks=64, request_step_budget_s=0.5))
    params = SamplingParams(max_tokens=8)
    heavy = engine.submit("plan a route", params, "amr-001/heavy", response_format=THIRTY_LETTERS)
    light = engine.submit("plan a route", params, "amr-002/light", response_format=THIRTY_LETTERS)
    while engine.get_request(heavy).num_output_tokens == 0:
        engine.step()
    engine.get_request(heavy).grammar.work.timer = itertools.count(0.0, 10.0).__next__  # 10 s a call

    deltas = {d.request_id: d for d in engine.step()}

    ended = deltas[heavy]
    assert ended.finish_reason is FinishReason.ERROR
    assert ended.detail.startswith("request amr-001/heavy used ")
    assert "of grammar and detokenizer work in one step, over its budget of 500 ms" in ended.detail
    assert engine.budget.heaviest.request_id == heavy
    assert not deltas[light].finished
    while engine.has_unfinished:
        engine.step()
    assert [d.finish_reason for d in engine.drain(light)][-1] is FinishReason.LENGTH
    engine.close()


def test_the_heaviest_work_is_taken_once_so_a_step_with_no_work_reports_nothing_again():
    meter = WorkMeter()
    meter.timer = itertools.count(0.0, 7.0).__next__
    with meter.timing():
        pass
    budget = RequestBudget(0.5)
    budget.over([("amr-001/x", [meter])])
    assert budget.take_heaviest().request_id == "amr-001/x"
    assert budget.take_heaviest() is None  # cloudd's health would name it again after each idle turn


def test_a_garbage_collection_inside_a_requests_work_is_not_charged_to_it():
    clock = CollectorFreeClock(base=itertools.count(0.0, 1.0).__next__)  # 1 s a reading
    meter = WorkMeter()
    meter.timer = clock
    with meter.timing():  # reads 0 ... 3: a collection of 1 s (1 -> 2) inside 3 s of work
        clock.on_collect("start", {"generation": 2})
        clock.on_collect("stop", {"generation": 2})
    assert meter.take() == pytest.approx(2.0)
    assert clock.collected() == pytest.approx(1.0)
    elsewhere = threading.Thread(target=lambda: (clock.on_collect("start", {}), clock.on_collect("stop", {})))
    elsewhere.start()
    elsewhere.join()
    assert clock.collected() == pytest.approx(1.0)  # another thread's collection is its own


def test_the_meters_clock_leaves_out_a_real_full_collection():
    """The engine's meters read ``own_cpu_time``: a full collection over a million cycles (a
    tenth of a second or more) set off inside a request's grammar call charges it next to
    nothing (the CI run that ended a plan for 380 ms of "grammar work" was such a collection)."""
    meter = WorkMeter()
    cycles = [[] for _ in range(1_000_000)]
    for c in cycles:
        c.append(c)
    del cycles, c
    before = own_cpu_time.collected()
    with meter.timing():
        gc.collect()
    took = own_cpu_time.collected() - before
    assert took > 0
    assert meter.take() < took / 10
