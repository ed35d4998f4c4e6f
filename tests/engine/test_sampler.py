"""Sampler and SamplingParams: greedy is argmax, filters only ever pick allowed tokens, a seed
reproduces a request whatever shares its batch, logprobs are the model's log-softmax."""

from __future__ import annotations

import collections
import math

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampler import TOP_P_CANDIDATES, Sampler
from shared.engine.sampling_params import SamplingParams
from tests.engine.tiny import tiny_model

GREEDY = SamplingParams()
PROBS = [0.5, 0.3, 0.15, 0.05]
HAND_MADE = torch.tensor([PROBS]).log()  # [1, 4]


def random_logits(rows: int, vocab: int = 97, seed: int = 0) -> torch.Tensor:  # [rows, vocab]
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def tokens(picks: list[tuple[int, float]]) -> list[int]:
    return [t for t, _ in picks]


def draw_many(sp: SamplingParams, n: int = 2000) -> collections.Counter:
    """Token counts over ``n`` draws from the hand-made distribution, one request, one seed."""
    sampler = Sampler()
    return collections.Counter(tokens(sampler.sample(HAND_MADE, ["r"], [sp]))[0] for _ in range(n))


# --- greedy ----------------------------------------------------------------------------------------


def test_greedy_is_argmax_of_every_row():
    logits = random_logits(5)
    picks = Sampler().sample(logits, list("abcde"), [GREEDY] * 5)
    assert tokens(picks) == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "sp",
    [SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.0, top_p=1e-6)],
    ids=["top_k=1", "top_p=1e-6"],
)
def test_a_filter_that_keeps_one_token_is_greedy(sp):
    logits = random_logits(6, seed=1)
    sampler = Sampler()
    for _ in range(5):  # whatever the generator state
        assert tokens(sampler.sample(logits, list("abcdef"), [sp] * 6)) == logits.argmax(-1).tolist()


# --- filters -----------------------------------------------------------------------------------


def test_top_p_keeps_the_smallest_set_reaching_p():
    counts = draw_many(SamplingParams(temperature=1.0, top_p=0.7, seed=1))
    assert set(counts) == {0, 1}  # 0.5 < 0.7 needs index 1 too; 0.8 >= 0.7 stops there
    assert counts[0] / 2000 == pytest.approx(0.5 / 0.8, abs=0.05)  # renormalized over the set


def test_top_k_keeps_the_k_most_likely():
    counts = draw_many(SamplingParams(temperature=1.0, top_k=2, seed=2))
    assert set(counts) == {0, 1}
    assert counts[0] / 2000 == pytest.approx(0.5 / 0.8, abs=0.05)


def test_top_k_and_top_p_together_keep_the_intersection():
    counts = draw_many(SamplingParams(temperature=1.0, top_k=3, top_p=0.6, seed=3))
    assert set(counts) == {0, 1}


def test_top_p_beyond_the_sorted_candidates_still_keeps_exactly_the_set_reaching_p():
    """A flat distribution over 3,000 tokens: top-p 0.5 needs 1,500 of them, more than the
    candidates top-p sorts first, so the whole vocabulary is sorted."""
    assert TOP_P_CANDIDATES < 1500
    sampler, sp = Sampler(), SamplingParams(temperature=1.0, top_p=0.5, seed=9)
    logits = torch.zeros(8, 3000)
    drawn = {t for _ in range(500) for t in tokens(sampler.sample(logits, ["r"] * 8, [sp] * 8))}
    assert TOP_P_CANDIDATES < len(drawn) <= 1500


def test_unfiltered_temperature_one_draws_the_model_distribution():
    counts = draw_many(SamplingParams(temperature=1.0, seed=4), n=4000)
    assert set(counts) == {0, 1, 2, 3}
    for token, p in enumerate(PROBS):
        assert counts[token] / 4000 == pytest.approx(p, abs=0.03)


# --- seeds -------------------------------------------------------------------------------------


def test_a_seed_reproduces_the_draws_in_a_fresh_sampler():
    sp = SamplingParams(temperature=1.0, seed=42)
    logits = random_logits(1, seed=5)
    runs = []
    for _ in range(2):
        sampler = Sampler()
        runs.append([tokens(sampler.sample(logits, ["r"], [sp]))[0] for _ in range(20)])
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # actually sampling, not stuck on one token


def test_a_seeded_row_draws_the_same_alone_or_in_any_batch_position():
    sp = SamplingParams(temperature=1.0, seed=7)
    logits = random_logits(3, seed=6)  # row 0 is "r"'s
    alone, crowded = Sampler(), Sampler()
    neighbours = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, seed=8), GREEDY]
    for i in range(20):
        mine = tokens(alone.sample(logits[:1], ["r"], [sp]))[0]
        others = [neighbours[(i + j) % 3] for j in range(2)]  # a changing crowd
        rows = torch.stack([logits[1], logits[0], logits[2]]) if i % 2 else logits
        params = [others[0], sp, others[1]] if i % 2 else [sp, *others]
        ids = ["x", "r", "y"] if i % 2 else ["r", "x", "y"]
        picks = crowded.sample(rows, ids, params)
        assert picks[ids.index("r")][0] == mine


def test_a_seeded_request_generates_the_same_tokens_alone_or_next_to_others():
    model = tiny_model(tie_word_embeddings=False)
    sp = SamplingParams(max_tokens=8, temperature=1.0, seed=123, ignore_eos=True)
    prompt = [3, 14, 15, 92, 65]

    alone = Engine(model, None, EngineConfig(block_size=4, num_blocks=64))
    (req,) = alone.generate([prompt], sp)
    assert len(set(req.output_token_ids)) > 1  # actually sampling

    crowded = Engine(model, None, EngineConfig(block_size=4, num_blocks=64))
    crowded.submit([7, 7, 7, 7, 7, 7], SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True))
    rid = crowded.submit(prompt, sp)
    crowded.submit([1, 2], SamplingParams(max_tokens=3, temperature=0.8, seed=9, ignore_eos=True))
    streamed = [t for d in crowded.stream(rid) for t in d.token_ids]
    assert streamed == req.output_token_ids


# --- logprobs ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sp",
    [SamplingParams(logprobs=True), SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=True)],
    ids=["greedy", "sampled"],
)
def test_logprob_is_the_log_softmax_of_the_raw_logits_at_the_chosen_token(sp):
    logits = random_logits(4, seed=9)
    picks = Sampler().sample(logits, list("abcd"), [sp] * 4)
    expected = torch.log_softmax(logits, -1)  # before temperature and filters
    for row, (token, logprob) in enumerate(picks):
        assert logprob == pytest.approx(expected[row, token].item(), abs=1e-5)
        assert logprob <= 0


def test_logprobs_are_per_row():
    logits = random_logits(2, seed=10)
    picks = Sampler().sample(logits, ["a", "b"], [GREEDY, SamplingParams(logprobs=True)])
    assert picks[1][1] == pytest.approx(torch.log_softmax(logits[1], -1).max().item(), abs=1e-5)
    assert math.isfinite(picks[0][1])


# --- SamplingParams validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 100.5}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop": ("",)}, "stop"),
        ({"stop": (3,)}, "stop"),
    ],
)
def test_invalid_sampling_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_defaults_are_greedy_and_unfiltered():
    sp = SamplingParams()
    assert sp.greedy and sp.top_k == 0 and sp.top_p == 1.0 and sp.stop == () and sp.seed is None
    assert not SamplingParams(temperature=0.5).greedy


def test_a_temperature_too_small_to_invert_samples_greedily():
    """1 / 1e-45 overflows float32: such a row would turn its scores into NaN, so it is greedy."""
    sp = SamplingParams(temperature=1e-45)
    assert sp.greedy
    logits = random_logits(3, seed=12).bfloat16()
    picks = Sampler().sample(logits, list("abc"), [sp, SamplingParams(temperature=1e-5), sp])
    assert tokens(picks) == logits.float().argmax(-1).tolist()


def test_stop_lists_are_normalized_to_tuples():
    sp = SamplingParams(stop=["a", "bc"], stop_token_ids=[3, 4])
    assert sp.stop == ("a", "bc") and sp.stop_token_ids == (3, 4)
    hash(sp)  # frozen and hashable


def test_a_bare_string_stop_is_one_stop_string_or_rejected():
    try:
        sp = SamplingParams(stop="\n\n")
    except ValueError as e:
        assert "stop" in str(e)
    else:
        assert sp.stop == ("\n\n",)


def test_bf16_logits_sample_as_their_float32_values_do():
    """The engine hands the sampler the model's bf16 logits: every row reads as its float32 copy."""
    logits = random_logits(6, seed=11).bfloat16()
    params = [GREEDY, SamplingParams(temperature=0.8, top_k=5, seed=1), SamplingParams(temperature=1.0, top_p=0.9,
              seed=2, logprobs=True)] * 2
    ids = list("abcdef")
    assert Sampler().sample(logits, ids, params) == Sampler().sample(logits.float(), ids, params)


def test_greedy_takes_the_first_of_tied_maxima_in_any_dtype():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0]])
    for dtype in (torch.float32, torch.bfloat16):
        assert tokens(Sampler().sample(logits.to(dtype), ["a", "b"], [GREEDY] * 2)) == [1, 0]


def test_a_top_p_that_is_zero_as_a_float32_is_refused():
    """Found in review: 1e-300 passed the (0, 1] check and was 0 in the sampler's float32, so no
    token was kept (token 0, an empty result, no detail)."""
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=1e-300)
    assert SamplingParams(temperature=1.0, top_p=1e-30).top_p == 1e-30  # tiny but representable
