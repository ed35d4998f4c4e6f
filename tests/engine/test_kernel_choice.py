"""Choosing each CPU operation's implementation (``shared.engine.kernel_choice``): the
``[engine] kernels`` spec, the choice from timings (fake ones here: no test depends on this
machine's speed), forced and cached choices, and the cache file."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.engine_config import EngineConfig
from shared.engine.kernel_choice import (BUCKET_ROWS, FLEET_ROWS_PER_REQUEST, OPERATIONS, ChoiceCache, KernelPlan,
                                         KernelSpec, cpu_signature, fastest, plan_kernels, request_ms,
                                         resolve_kernels)


def test_the_spec_is_a_backend_then_operations_it_forces():
    assert KernelSpec.parse("auto") == KernelSpec("auto", {})
    assert KernelSpec.parse("torch, dense=packed") == KernelSpec("torch", {"dense": "packed"})
    assert KernelSpec.parse("dense=linear,prefill_attention=gemm") == KernelSpec(
        "auto", {"dense": "linear", "prefill_attention": "gemm"})
    assert resolve_kernels("dense=packed", "cpu") == "torch"
    assert resolve_kernels("auto,prefill_attention=rows", "cuda:0") == "triton"


@pytest.mark.parametrize("text, problem", [
    ("vulkan", "must start with one of"),
    ("auto,attention=rows", "expected operation=implementation"),
    ("auto,dense", "expected operation=implementation"),
    ("auto,dense=amx", "dense is one of"),
    ("dense=packed,dense=linear", "names dense twice"),
    ("triton,dense=packed", "not triton's"),
])
def test_a_bad_spec_names_its_problem_in_the_config_and_on_the_command_line(text, problem):
    with pytest.raises(ValueError, match=problem):
        KernelSpec.parse(text)
    with pytest.raises(ValueError, match=problem):
        EngineConfig(kernels=text)


def test_the_fastest_is_the_least_time_for_a_fleet_requests_rows_and_ties_go_to_the_first_listed():
    # stop 52's 135M timings on a Xeon with AMX: the raw sum picks linear (9.16 vs 10.26 ms), but a
    # fleet request runs its 32-row decode bucket 2.5 times and its 512-row prefill bucket 0.16
    # times, so packed, which ran the engine 10-13 % faster, wins
    timings = {"decode": {"linear": 2.56, "packed": 2.24}, "prefill": {"linear": 6.60, "packed": 8.02}}
    assert fastest("dense", timings) == "packed"
    assert request_ms(timings) == pytest.approx({"linear": 2.5 * 2.56 + 6.60 * 80 / 512,
                                                 "packed": 2.5 * 2.24 + 8.02 * 80 / 512})
    # one choice for all buckets: packed's decode win does not outweigh a prefill loss 16x its size
    assert fastest("dense", {"decode": {"linear": 10, "packed": 7}, "prefill": {"linear": 90, "packed": 150}}) == "linear"
    assert fastest("dense", {"b": {"packed": 5.0, "linear": 5.0}}) == "linear"
    with pytest.raises(ValueError, match="no dense implementation was timed in every"):
        fastest("dense", {"a": {"linear": 1}, "b": {"packed": 1}})


@settings(max_examples=50, deadline=None)
@given(st.dictionaries(st.sampled_from(["decode", "prefill", "long"]),
                       st.fixed_dictionaries({c: st.floats(0.01, 1e3) for c in OPERATIONS["prefill_attention"]}),
                       min_size=1))
def test_no_candidate_beats_the_chosen_one_for_a_fleet_request(buckets):
    chosen = fastest("prefill_attention", buckets)
    weight = {b: FLEET_ROWS_PER_REQUEST[b] / BUCKET_ROWS[b] if b in BUCKET_ROWS else 1.0 for b in buckets}
    total = {c: sum(weight[b] * t[c] for b, t in buckets.items()) for c in OPERATIONS["prefill_attention"]}
    assert all(total[chosen] <= t for t in total.values())


class FakeTimer:
    def __init__(self, timings):
        self.timings, self.calls = timings, []

    def __call__(self, op, candidates):
        self.calls.append(op)
        return self.timings[op]


TIMINGS = {"dense": {"decode": {"linear": 3.0, "packed": 2.0}},
           "prefill_attention": {"prefill": {"rows": 4.0, "gemm": 9.0}}}
BOTH = {"dense": ("linear", "packed"), "prefill_attention": ("rows", "gemm")}


def test_a_plan_measures_what_is_neither_forced_nor_alone_nor_cached():
    timer = FakeTimer(TIMINGS)
    plan = plan_kernels(BOTH, {}, timer)
    assert plan.chosen == {"dense": "packed", "prefill_attention": "rows"} and timer.calls == ["dense", "prefill_attention"]
    assert plan.how == {"dense": "measured", "prefill_attention": "measured"}
    assert plan.describe() == ("dense=packed (measured: 5.00 vs 7.50 ms a request) "
                               "prefill_attention=rows (measured: 0.62 vs 1.41 ms a request)")

    timer = FakeTimer(TIMINGS)
    plan = plan_kernels({"dense": ("linear",), "prefill_attention": ("rows", "gemm")}, {"prefill_attention": "gemm"},
                        timer)
    assert plan.chosen == {"dense": "linear", "prefill_attention": "gemm"} and timer.calls == []
    assert plan.how == {"dense": "only", "prefill_attention": "forced"}

    cached_timings = {"decode": {"linear": 1.0, "packed": 2.0}}  # this machine, earlier: linear was faster
    cached = KernelPlan({"dense": "linear"}, {"dense": "measured"}, {"dense": cached_timings})
    timer = FakeTimer(TIMINGS)
    plan = plan_kernels(BOTH, {}, timer, cached)
    assert plan.chosen["dense"] == "linear" and plan.how["dense"] == "cached" and timer.calls == ["prefill_attention"]
    # a choice cached under an earlier rule: today's rule decides from the cached timings, untimed
    stale = KernelPlan({"dense": "packed"}, {"dense": "measured"}, {"dense": cached_timings})
    plan = plan_kernels({"dense": ("linear", "packed")}, {}, FakeTimer({}), stale)
    assert plan.chosen["dense"] == "linear" and plan.how["dense"] == "cached"
    # a build with another candidate (or a machine without one) measures again
    cached = KernelPlan({"decode_attention": "rows"}, {"decode_attention": "measured"},
                        {"decode_attention": {"decode": {"rows": 1.0, "cascade": 3.0}}})
    timer = FakeTimer({"decode_attention": {"decode": {"rows": 1.0, "tiles": 0.5, "cascade": 3.0}}})
    plan = plan_kernels({"decode_attention": ("rows", "tiles", "cascade")}, {}, timer, cached)
    assert plan.chosen["decode_attention"] == "tiles" and plan.how["decode_attention"] == "measured"
    assert timer.calls == ["decode_attention"]


def test_an_implementation_that_changes_the_numbers_is_taken_only_where_forced():
    timer = FakeTimer({"dense": {"decode": {"linear": 3.0, "packed": 2.0}}})
    plan = plan_kernels({"dense": ("linear", "packed", "int8")}, {}, timer)
    assert plan.chosen == {"dense": "packed"} and set(plan.timings_ms["dense"]["decode"]) == {"linear", "packed"}
    assert plan_kernels({"dense": ("linear", "int8")}, {}, FakeTimer({})).how == {"dense": "only"}  # linear alone
    plan = plan_kernels({"dense": ("linear", "packed", "int8")}, {"dense": "int8"}, FakeTimer({}))
    assert plan.chosen == {"dense": "int8"} and plan.how == {"dense": "forced"}
    # projections already in int8 (an earlier engine's): nothing else is left to run
    assert plan_kernels({"dense": ("int8",)}, {}, FakeTimer({})).chosen == {"dense": "int8"}


def test_forcing_what_this_machine_lacks_is_refused_with_what_it_has():
    with pytest.raises(ValueError, match=r"dense=packed, which this machine or model lacks.*\['linear'\]"):
        plan_kernels({"dense": ("linear",)}, {"dense": "packed"}, FakeTimer(TIMINGS))


def test_the_cache_keeps_measured_choices_per_key_and_survives_a_bad_file(tmp_path):
    path = tmp_path / "sub" / "kernel-choice.json"
    cache = ChoiceCache(path)
    assert cache.get("cpu|model") is None
    plan = KernelPlan({"dense": "packed", "prefill_attention": "gemm"}, {"dense": "measured", "prefill_attention": "forced"},
                      {"dense": TIMINGS["dense"]})
    cache.put("cpu|model", plan)
    again = cache.get("cpu|model")
    assert again.chosen == {"dense": "packed"} and again.how == {"dense": "measured"}  # forced ones are not choices
    assert again.timings_ms == {"dense": TIMINGS["dense"]}
    cache.put("cpu|other", KernelPlan({"dense": "linear"}, {"dense": "only"}))  # nothing measured: nothing stored
    assert set(json.loads(path.read_text())) == {"cpu|model"}
    # a later plan that measured another operation adds it; one where dense had one candidate keeps dense
    cache.put("cpu|model", KernelPlan({"dense": "packed", "head": "linear"}, {"dense": "only", "head": "measured"}))
    assert cache.get("cpu|model").chosen == {"dense": "packed", "head": "linear"}
    path.write_text("{not json")
    assert cache.get("cpu|model") is None
    cache.put("cpu|model", plan)  # rewritten whole
    assert cache.get("cpu|model").chosen == {"dense": "packed"}
    path.write_text(json.dumps({"cpu|model": {"chosen": 3}}))
    assert cache.get("cpu|model") is None


def test_the_cpu_signature_names_the_model_the_kernel_flags_and_the_torch_build(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
                    "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8\n")
    signature = cpu_signature(info)
    assert signature.startswith("Intel(R) Xeon(R) Processor|avx2,avx512f,avx512_bf16,amx_bf16,amx_int8|")
    assert "torch " in signature
    other = tmp_path / "cpuinfo-epyc"  # NOTE: a new path: a file's reading is cached, as /proc/cpuinfo's
    other.write_text("model name\t: AMD EPYC\nflags\t\t: avx2 avx512f avx512_bf16\n")
    assert cpu_signature(other) != signature
