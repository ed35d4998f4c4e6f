"""The step-cost model behind deadline admission: a fixed cost per step plus a cost per token,
fitted to the steps observed."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.engine.service_rate import ServiceRate


@given(per_step=st.floats(0, 0.1), per_token=st.floats(0, 0.01),
       sizes=st.lists(st.integers(1, 2048), min_size=2, max_size=60).filter(lambda s: len(set(s)) > 1))
def test_noise_free_steps_give_back_both_costs(per_step, per_token, sizes):
    rate = ServiceRate()
    for n in sizes:
        rate.observe(n, per_step + per_token * n)
    assert rate.seconds_per_step == pytest.approx(per_step, rel=1e-6, abs=1e-9)
    assert rate.seconds_per_token == pytest.approx(per_token, rel=1e-6, abs=1e-9)


def test_decode_steps_do_not_price_a_prompt_at_their_rate():
    # one request decoding (30 ms steps of one token), now and then a 512-token prefill chunk
    rate = ServiceRate()
    for i in range(200):
        n = 512 if i % 20 == 0 else 1
        rate.observe(n, 0.03 + 0.002 * n)
    truth = 2 * 0.03 + 600 * 0.002  # 600 tokens in two steps of at most 512
    assert rate.seconds_for(600, tokens_per_step=512) == pytest.approx(truth, rel=1e-6)
    assert 600 * 0.032 > 15 * truth  # what pricing it at the decode steps' seconds per token gave


def test_too_little_spread_charges_the_time_per_token():
    rate = ServiceRate()
    assert rate.seconds_for(100, 512) == 0.0  # nothing measured: nothing is rejected on a guess
    rate.observe(100, 1.0)
    assert (rate.seconds_per_step, rate.seconds_per_token) == (0.0, pytest.approx(0.01))
    rate.observe(100, 3.0)  # the same size again: still no second point to fit a line
    assert rate.seconds_per_step == 0.0 and 0.01 < rate.seconds_per_token < 0.03


def test_steps_not_slower_when_bigger_are_all_fixed_cost():
    rate = ServiceRate()
    for n, t in [(1, 0.2), (400, 0.1), (1, 0.2), (400, 0.1)]:
        rate.observe(n, t)
    assert rate.seconds_per_token == 0.0 and 0.1 < rate.seconds_per_step < 0.2


def test_running_decodes_ride_in_every_step():
    rate = ServiceRate()
    rate.observe(1, 0.03 + 0.002)
    rate.observe(512, 0.03 + 0.002 * 512)
    # 8 decodes take 8 of each step's 512 tokens: 1000 prompt tokens need two steps
    assert rate.seconds_for(1000, 512, riders=8) == pytest.approx(2 * (0.03 + 8 * 0.002) + 1000 * 0.002)


@pytest.mark.parametrize("smoothing", [0.0, 1.5])
def test_smoothing_must_be_a_weight(smoothing):
    with pytest.raises(ValueError, match="smoothing"):
        ServiceRate(smoothing)
