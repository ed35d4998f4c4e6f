"""The step profile: every step's phases are timed, and the model's FLOPs are counted exactly."""

from __future__ import annotations

import torch

from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_profile import PHASES, StepProfile, matmul_peak_flops, timed_phase
from tests.engine.tiny import tiny_model

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]  # no shared prefix: every token is computed
MAX_TOKENS = 4


def test_profile_times_every_step_and_counts_the_model_flops():
    model = tiny_model()
    engine = Engine(model, None, EngineConfig(block_size=4, num_blocks=64))
    profile = engine.enable_profile()
    engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert profile.steps == engine.num_steps > 0
    assert set(profile.seconds) == set(PHASES) and all(s >= 0 for s in profile.seconds.values())
    assert profile.seconds["attention"] > 0 and profile.seconds["model"] > 0

    cfg = model.config
    lengths = [len(p) + MAX_TOKENS - 1 for p in PROMPTS]  # the last output token is never computed
    dense = 2 * sum(p.numel() for n, p in model.layers.named_parameters() if n.endswith("proj.weight"))
    contexts = sum(n * (n + 1) // 2 for n in lengths)  # the token at position p sees p + 1
    expected = (dense * sum(lengths) + 4 * cfg.num_heads * cfg.head_dim * contexts
                + 2 * cfg.hidden_size * cfg.vocab_size * MAX_TOKENS * len(PROMPTS))
    assert profile.computed_tokens == sum(lengths)
    assert profile.flops == expected


class Phased:
    def __init__(self):
        self.profile: StepProfile | None = None

    @timed_phase("update")
    def work(self, x, plus=0):
        return x + plus


def test_timed_phase_counts_a_call_only_while_profiling():
    obj = Phased()
    assert obj.work(2, plus=1) == 3  # not profiling: the call alone
    obj.profile = StepProfile()
    assert obj.work(2, plus=1) == 3
    assert obj.profile.seconds["update"] > 0
    assert all(s == 0 for name, s in obj.profile.seconds.items() if name != "update")


def test_report_gives_shares_host_time_and_the_peak_fraction():
    profile = StepProfile(steps=2, flops=4e9)
    profile.seconds.update(model=1.0, attention=0.5, schedule=0.25, sampling=0.25)
    report = profile.report(peak_flops=8e9)
    assert report["ms_per_step"]["model"] == 500.0
    assert report["host_ms_per_step"] == 250.0  # schedule + sampling, per step
    assert abs(sum(report["share"].values()) - 1.0) < 1e-9
    assert report["achieved_gflop_s"] == 2.0 and report["peak_frac"] == 0.25


def test_matmul_peak_is_a_positive_rate():
    assert matmul_peak_flops(torch.float32, n=64, reps=2) > 0
