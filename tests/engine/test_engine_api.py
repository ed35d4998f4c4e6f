"""The in-process Engine API with the tiny random model and token-id prompts (no tokenizer)."""

from __future__ import annotations

import pytest
import torch

from shared.engine.engine import Engine, TokenDelta
from shared.engine.engine_config import EngineConfig
from shared.engine.kv.radix import RadixTree
from shared.engine.request import FinishReason
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import SchedulerConfig
from tests.engine.tiny import dense_logits, greedy_reference, tiny_model

# NOTE: untied, because the tied tiny model's greedy output just repeats the last prompt token.
MODEL = tiny_model(tie_word_embeddings=False)
VOCAB = MODEL.config.vocab_size  # 97
PROMPT = [5, 9, 2, 77, 31, 8, 8, 1, 40]  # 9 tokens: two full blocks and one token
OTHER = [11, 12, 13, 14, 15]


def engine(num_blocks: int = 64, model=MODEL, **scheduler) -> Engine:
    config = EngineConfig(block_size=4, num_blocks=num_blocks, scheduler=SchedulerConfig(**scheduler))
    return Engine(model, None, config)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def tree_blocks(tree: RadixTree) -> set[int]:
    """Blocks in which the radix tree holds at least one slot."""
    blocks, stack = set(), [tree.root]
    while stack:
        node = stack.pop()
        blocks.update(s // tree.block_size for s in node.slots)
        stack.extend(node.children.values())
    return blocks


def assert_everything_released(e: Engine) -> None:
    """No request holds a block: the pool's used blocks are exactly the index's, and evicting
    the whole index empties the pool."""
    assert e.pool.num_used == len(tree_blocks(e.index))
    e.index.evict(10**9)
    assert e.pool.num_used == 0 and e.index.num_cached_tokens == 0
    e.scheduler.kv.check_integrity([])


# --- streaming -----------------------------------------------------------------------------------


def test_stream_yields_one_delta_per_token_matching_the_reference():
    e = engine()
    rid = e.submit(PROMPT, greedy(6))
    deltas = list(e.stream(rid))
    assert [t for d in deltas for t in d.token_ids] == greedy_reference(MODEL, PROMPT, 6)
    assert [len(d.token_ids) for d in deltas] == [1] * 6
    assert [d.finish_reason for d in deltas] == [None] * 5 + [FinishReason.LENGTH]
    assert all(d.request_id == rid and d.text == "" and d.logprobs == [] for d in deltas)
    assert e.get_request(rid) is None and not e.has_unfinished
    with pytest.raises(KeyError):  # fully delivered: the id is forgotten
        next(e.stream(rid))


def test_logprobs_come_one_per_token_when_asked():
    e = engine()
    rid = e.submit(PROMPT, greedy(3, logprobs=True))
    deltas = list(e.stream(rid))
    out = [d.token_ids[0] for d in deltas]
    for i, d in enumerate(deltas):
        expected = torch.log_softmax(dense_logits(MODEL, PROMPT + out[:i])[-1], -1)[out[i]]
        assert d.logprobs == [pytest.approx(expected.item(), abs=1e-4)]


def test_stop_token_ends_the_request_and_is_its_last_token():
    ref = greedy_reference(MODEL, PROMPT, 8)
    k = next(i for i in range(1, 8) if ref[i] not in ref[:i])  # first token not seen before
    e = engine()
    rid = e.submit(PROMPT, greedy(8, stop_token_ids=(ref[k],)))
    deltas = list(e.stream(rid))
    assert [t for d in deltas for t in d.token_ids] == ref[: k + 1]
    assert deltas[-1].finish_reason == FinishReason.STOP


def test_requests_stepped_by_hand_get_their_own_tokens_from_drain():
    e = engine(max_num_batched_tokens=6)  # chunked prefill, interleaved with decodes
    a, b = e.submit(PROMPT, greedy(5)), e.submit(OTHER, greedy(3))
    got = {a: [], b: []}
    for _ in range(4):
        e.step()
    for rid in got:
        got[rid] += e.drain(rid)
    while e.has_unfinished:
        e.step()
    for rid in got:
        got[rid] += e.drain(rid)
        assert e.drain(rid) == []  # drained once
    assert [t for d in got[a] for t in d.token_ids] == greedy_reference(MODEL, PROMPT, 5)
    assert [t for d in got[b] for t in d.token_ids] == greedy_reference(MODEL, OTHER, 3)
    assert got[a][-1].finish_reason == got[b][-1].finish_reason == FinishReason.LENGTH


def test_streaming_one_request_buffers_the_others_deltas():
    e = engine()
    a, b = e.submit(PROMPT, greedy(3)), e.submit(OTHER, greedy(3))
    assert [t for d in e.stream(a) for t in d.token_ids] == greedy_reference(MODEL, PROMPT, 3)
    assert [t for d in e.stream(b) for t in d.token_ids] == greedy_reference(MODEL, OTHER, 3)


# --- abort -------------------------------------------------------------------------------------


def test_abort_mid_stream_ends_it_and_releases_every_block():
    e = engine()
    rid = e.submit(PROMPT, greedy(20))
    stream = e.stream(rid)
    first = [next(stream), next(stream)]
    assert e.abort(rid)
    rest = list(stream)
    assert [d.finish_reason for d in rest] == [FinishReason.ABORT]
    assert rest[0].token_ids == [] and rest[0].finished
    assert [t for d in first for t in d.token_ids] == greedy_reference(MODEL, PROMPT, 2)
    assert not e.abort(rid)  # already finished
    assert e.stats().running == 0 and not e.has_unfinished
    assert_everything_released(e)


def test_abort_mid_prefill_releases_every_block():
    e = engine(max_num_batched_tokens=4)
    rid = e.submit(PROMPT, greedy(5))
    e.step()  # PROMPT[0:4] computed, no token yet
    assert e.get_request(rid).num_computed_tokens == 4
    assert e.abort(rid)
    assert e.drain(rid) == [TokenDelta(rid, [], "", [], FinishReason.ABORT)]
    assert e.index.num_cached_tokens == 4  # what it computed stays reusable
    assert_everything_released(e)


def test_abort_of_a_waiting_request():
    e = engine(max_num_seqs=1)
    a, b = e.submit(PROMPT, greedy(3)), e.submit(OTHER, greedy(3))
    e.step()
    assert e.abort(b)
    assert [d.finish_reason for d in e.drain(b)] == [FinishReason.ABORT]
    assert [t for d in e.stream(a) for t in d.token_ids] == greedy_reference(MODEL, PROMPT, 3)
    assert not e.abort("never-submitted")
    assert_everything_released(e)


# --- bad input ---------------------------------------------------------------------------------


def test_a_request_id_in_use_is_rejected_until_fully_delivered():
    e = engine()
    e.submit(PROMPT, greedy(2), request_id="r1")
    with pytest.raises(ValueError, match="r1"):
        e.submit(OTHER, greedy(2), request_id="r1")
    list(e.stream("r1"))
    e.submit(OTHER, greedy(2), request_id="r1")  # free again once its last delta was taken


@pytest.mark.parametrize("prompt", [[], [1, VOCAB], [-1, 2]], ids=["empty", "too-big-id", "negative-id"])
def test_bad_token_id_prompts_are_rejected(prompt):
    e = engine()
    with pytest.raises(ValueError):
        e.submit(prompt, greedy(2))
    assert not e.has_unfinished


def test_text_without_a_tokenizer_is_rejected():
    with pytest.raises(ValueError, match="tokenizer"):
        engine().submit("hello", greedy(2))


def test_an_over_long_prompt_is_rejected():
    with pytest.raises(ValueError, match="max_model_len"):
        engine(max_model_len=9).submit(PROMPT, greedy(2))


# --- stats ---------------------------------------------------------------------------------------


def test_stats_count_prefix_cache_hits_on_a_repeated_prompt():
    e = engine()
    e.generate([PROMPT], greedy(4))
    s = e.stats()
    assert (s.prompt_tokens, s.cache_hit_tokens) == (9, 0)
    assert s.cached_tokens == 9 + 4 - 1  # prompt and output, less the never-computed last token
    e.generate([PROMPT], greedy(4))
    s = e.stats()
    # NOTE: the last prompt token is always recomputed, so its logits exist.
    assert (s.prompt_tokens, s.cache_hit_tokens) == (18, 8)
    assert s.prefix_hit_rate == pytest.approx(8 / 18)
    assert (s.running, s.waiting, s.preemptions) == (0, 0, 0)
    assert s.blocks_total == 63 and s.blocks_used + s.blocks_free == 63


def test_stats_count_running_and_waiting_requests():
    e = engine(max_num_seqs=1)
    e.submit(PROMPT, greedy(2))
    e.submit(OTHER, greedy(2))
    s = e.stats()
    assert (s.running, s.waiting, s.steps) == (0, 2, 0)
    e.step()
    s = e.stats()
    assert (s.running, s.waiting, s.steps) == (1, 1, 1)
    assert s.blocks_used == 3  # PROMPT's 9 tokens
    while e.has_unfinished:
        e.step()
    s = e.stats()
    assert (s.running, s.waiting, s.steps) == (0, 0, 4)


# --- context limits ------------------------------------------------------------------------------


def test_max_model_len_finishes_with_length():
    e = engine(max_model_len=12)
    rid = e.submit(PROMPT, greedy(20))
    deltas = list(e.stream(rid))
    assert len(deltas) == 3 and deltas[-1].finish_reason == FinishReason.LENGTH


def test_generation_stops_at_the_models_context_length():
    # the scheduler's max_model_len stays at its default, 8192
    e = engine(model=tiny_model(max_position_embeddings=16, tie_word_embeddings=False))
    rid = e.submit(PROMPT, greedy(20))
    deltas = list(e.stream(rid))
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    assert len(PROMPT) + sum(len(d.token_ids) for d in deltas) <= 16


@pytest.mark.parametrize("prompt_len", [20, 4])
def test_a_request_larger_than_the_kv_pool_is_rejected_or_finishes(prompt_len):
    e = engine(num_blocks=4)  # 3 usable blocks: 12 tokens
    prompt = list(range(prompt_len))
    try:
        rid = e.submit(prompt, greedy(20))
    except ValueError:
        assert prompt_len > 12
        return
    for _ in range(50):
        e.step()
    deltas = e.drain(rid)
    assert deltas and deltas[-1].finish_reason == FinishReason.LENGTH
    assert prompt_len + sum(len(d.token_ids) for d in deltas) <= 12


# --- text ----------------------------------------------------------------------------------------


class BracketTokenizer:
    """Fake tokenizer: id 15 reads "[15]"; no special tokens, no eos."""

    eos_token_ids: frozenset[int] = frozenset()

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f"[{i}]" for i in ids)


def text_engine() -> Engine:
    return Engine(MODEL, BracketTokenizer(), EngineConfig(block_size=4, num_blocks=64))


def test_text_deltas_concatenate_to_the_decoded_output():
    e = text_engine()
    deltas = list(e.stream(e.submit(PROMPT, greedy(4))))
    assert "".join(d.text for d in deltas) == BracketTokenizer().decode(greedy_reference(MODEL, PROMPT, 4))


def test_a_stop_string_finishes_with_stop_and_is_cut_from_the_text():
    ref = greedy_reference(MODEL, PROMPT, 8)  # [15, 9, 11, 20, ...]
    e = text_engine()
    stop = f"][{ref[2]}]["  # spans three tokens: complete only once ref[3] is decoded
    deltas = list(e.stream(e.submit(PROMPT, greedy(8, stop=(stop,)))))
    assert "".join(d.text for d in deltas) == f"[{ref[0]}][{ref[1]}"
    assert [t for d in deltas for t in d.token_ids] == ref[:4]
    assert deltas[-1].finish_reason == FinishReason.STOP
    assert_everything_released(e)


def test_a_stop_token_is_not_in_the_text():
    ref = greedy_reference(MODEL, PROMPT, 8)
    e = text_engine()
    deltas = list(e.stream(e.submit(PROMPT, greedy(8, stop_token_ids=(ref[1],)))))
    assert [t for d in deltas for t in d.token_ids] == ref[:2]
    assert "".join(d.text for d in deltas) == f"[{ref[0]}]"


def test_unbuffered_requests_leave_nothing_behind_when_driven_by_step():
    e = engine()
    rids = [e.submit(PROMPT, greedy(3), buffered=False) for _ in range(2)]
    finished = []
    while e.has_unfinished:
        finished += [d.request_id for d in e.step() if d.finished]
    assert sorted(finished) == sorted(rids)
    assert not e.delivery.pending and not e.delivery.live and not e.delivery.detokenizers
    with pytest.raises(KeyError):
        e.stream(rids[0])  # raises at the call, not at the first next()


# --- warm-up -------------------------------------------------------------------------------------


def test_warm_up_changes_no_request_cache_counter_or_kv():
    e = engine(max_num_batched_tokens=37)
    before = e.stats()
    assert e.warm_up() > 0
    assert e.stats() == before and e.index.num_cached_tokens == 0 and e.pool.num_used == 0
    assert all(not cache[0].any() for layer in e.runner.kv_caches for cache in layer)  # the null block is zeros
    warmed = e.generate([PROMPT, OTHER], greedy(6))
    assert [r.output_token_ids for r in warmed] == [greedy_reference(MODEL, p, 6) for p in (PROMPT, OTHER)]


@pytest.mark.parametrize("k", [1, 4, 9])
def test_a_resumed_request_continues_after_its_resumed_tokens(k):
    eng = engine()
    expected = greedy_reference(MODEL, PROMPT, 12)
    rid = eng.submit(PROMPT, greedy(12), resume_token_ids=expected[:k])
    deltas = list(eng.stream(rid))
    assert [t for d in deltas for t in d.token_ids] == expected[k:]
    assert deltas[-1].finish_reason == FinishReason.LENGTH
    eng.scheduler.kv.check_integrity([])


def test_a_resumed_request_whose_tokens_already_end_it_finishes_without_computing():
    eng = engine()
    rid = eng.submit(PROMPT, greedy(3), resume_token_ids=[1, 2, 3])
    assert list(eng.stream(rid)) == [TokenDelta(rid, [], "", [], FinishReason.LENGTH)]
    stopped = eng.submit(PROMPT, greedy(8, stop_token_ids=(7,)), resume_token_ids=[1, 7])
    assert list(eng.stream(stopped))[-1].finish_reason == FinishReason.STOP
    assert eng.num_steps == 0


def test_resumed_tokens_outside_the_vocabulary_are_rejected():
    with pytest.raises(ValueError, match="token ids"):
        engine().submit(PROMPT, greedy(4), resume_token_ids=[VOCAB])
