"""n-gram drafts (edged.speculation) against a naive scan, the history's bound, and the forced
texts' spellings learned from the model's own output."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edged.speculation import (Confirmations, ForwardCosts, NgramDrafter, NgramIndex, SpeculationConfig, SpellingWatch,
                               Spellings, draft_length, recent_outputs, remember)


def naive_follow(tokens: list[int], suffix: list[int], limit: int) -> list[int]:
    """What followed the latest occurrence of ``suffix`` ending before the last token."""
    n = len(suffix)
    for end in range(len(tokens) - 2, n - 2, -1):
        if tokens[end - n + 1:end + 1] == suffix:
            return tokens[end + 1:end + 1 + limit]
    return []


tokens_st = st.lists(st.integers(0, 5), max_size=60)  # a small alphabet: many repeats


@given(tokens_st, st.lists(st.integers(0, 5), min_size=1, max_size=3), st.integers(1, 6))
def test_follow_matches_a_naive_scan(tokens, suffix, limit):
    index = NgramIndex(3, tokens)
    assert index.follow(suffix, limit) == naive_follow(tokens, suffix, limit)


@given(st.lists(tokens_st, min_size=1, max_size=5), st.lists(st.integers(0, 5), min_size=1, max_size=3))
def test_follow_after_growing_matches_one_built_at_once(pieces, suffix):
    grown = NgramIndex(3)
    for piece in pieces:
        grown.extend(piece)
        grown.follow(suffix, 4)  # indexes part of the sequence before it grows again
    whole = [t for piece in pieces for t in piece]
    assert grown.follow(suffix, 4) == NgramIndex(3, whole).follow(suffix, 4)


@given(tokens_st, tokens_st, st.lists(st.integers(0, 5), max_size=3), st.integers(1, 6), st.integers(1, 3))
def test_draft_prefers_the_longest_match_then_the_context(context, history, after, limit, min_ngram):
    config = SpeculationConfig(max_ngram=3, min_ngram=min_ngram)
    drafter = NgramDrafter(config, context, NgramIndex(3, history))
    tail = (context[-3:] + after)
    expected = []
    for n in range(min(3, len(tail)), min_ngram - 1, -1):
        suffix = tail[-n:]
        expected = naive_follow(context, suffix, limit) or naive_follow(history, suffix, limit)
        if expected:
            break
    assert drafter.draft(limit, after) == expected


def test_a_plan_s_names_are_drafted_from_the_prompt():
    prompt = [7, 1, 2, 3, 4, 5, 9]  # "... shelf A3 tote 12 ..."
    drafter = NgramDrafter(SpeculationConfig(), prompt, recent_outputs(SpeculationConfig()))
    drafter.accept([8, 1, 2])
    assert drafter.draft(3) == [3, 4, 5]


def test_history_keeps_the_newest_tokens():
    config = SpeculationConfig(history_tokens=5)
    history = remember(recent_outputs(config), [1, 2, 3, 4], config)
    history = remember(history, [5, 6, 7], config)
    assert history.tokens == [3, 4, 5, 6, 7]
    assert history.follow([5], 2) == [6, 7]
    none = SpeculationConfig(history_tokens=0)
    assert remember(recent_outputs(none), [1, 2, 3], none).tokens == []  # no history at all


PIECES = {1: '{"', 2: "grasp", 3: "g", 4: "rasp", 5: '": "', 6: "gentle", 7: '"}', 8: "gr"}


def decode(tokens) -> str:
    return "".join(PIECES[t] for t in tokens)


def test_a_forced_text_is_learned_as_the_model_spelled_it():
    spellings = Spellings()
    watch = SpellingWatch(spellings, decode)
    output = [1]
    watch.expect(1, 'grasp": "')  # the grammar forces it after the first token
    watch.expect(1, 'grasp": "')  # asked again (a refused draft): one entry
    for token in (3, 4):
        output.append(token)
        watch.observe(output)
        assert spellings.get('grasp": "') is None  # not covered yet
    output += [5, 6]
    watch.observe(output)
    assert spellings.get('grasp": "') == [3, 4, 5]  # the fewest tokens that cover it, not the tokenizer's [2, 5]
    watch.expect(5, '"}')
    watch.observe(output + [8])  # its tokens spell something else (cannot happen under the grammar): dropped
    watch.observe(output + [8, 7])
    assert spellings.get('"}') is None and len(spellings) == 1


def test_a_spelling_is_not_cut_inside_a_character():
    """Byte-level tokens can split a character: the first half alone decodes to U+FFFD."""
    halves = {(1,): "\ufffd", (1, 2): "é", (1, 2, 3): "ét"}
    spellings = Spellings()
    watch = SpellingWatch(spellings, lambda tokens: halves[tuple(tokens)])
    watch.expect(0, "é")
    watch.observe([1])
    assert len(spellings) == 0  # still waiting, not dropped
    watch.observe([1, 2, 3])
    assert spellings.get("é") == [1, 2]


@pytest.mark.parametrize("bad", [{"max_draft": 0}, {"max_draft": 16}, {"max_ngram": 0}, {"min_ngram": 0}, {"min_ngram": 5},
                                 {"history_tokens": -1}])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError, match="speculation"):
        SpeculationConfig(**bad)



def costs_of(seconds: dict[int, float]) -> ForwardCosts:
    costs = ForwardCosts()
    for tokens, value in seconds.items():
        costs.record(tokens, value)
    return costs


ORT_LIKE = {1: 24.0, 2: 44.0, 4: 42.0, 8: 62.0, 13: 76.0}  # ms: ONNX Runtime's int4 graph, measured
TORCH_LIKE = {1: 14.0, 2: 17.0, 4: 25.0, 8: 38.0, 13: 63.0}  # ms: edged's torch int4, measured


def test_forward_costs_are_averaged_and_read_between_measurements():
    costs = ForwardCosts()
    assert costs.of(3) is None
    costs.record(2, 10.0)
    costs.record(2, 20.0)  # an exponential average: the newest weighs SMOOTHING
    assert costs.of(2) == pytest.approx(10.0 + ForwardCosts.SMOOTHING * 10.0)
    costs.record(6, 33.0)
    assert costs.of(4) == pytest.approx((costs.of(2) + 33.0) / 2)  # linear between
    assert costs.of(1) == costs.of(2) and costs.of(13) == 33.0  # flat beyond


def test_draft_length_pays_for_the_rows_it_adds():
    # unmeasured: every draft goes (and gets measured)
    assert draft_length(12, 0.1, ForwardCosts()) == 12
    # ONNX Runtime: a second token costs as much as four more; poor drafts are not worth it,
    # good ones are worth many
    assert draft_length(12, 0.3, costs_of(ORT_LIKE)) == 0
    assert draft_length(12, 0.95, costs_of(ORT_LIKE)) == 12
    # the torch backend: a row costs little, so even middling drafts go, a few at a time
    assert 1 <= draft_length(12, 0.6, costs_of(TORCH_LIKE)) <= 3
    assert draft_length(2, 0.95, costs_of(TORCH_LIKE)) == 2  # never more than there are


@given(available=st.integers(0, 12), p=st.floats(0, 0.999), costs=st.sampled_from([ORT_LIKE, TORCH_LIKE]))
def test_draft_length_is_the_best_expected_rate(available, p, costs):
    table = costs_of(costs)
    chosen = draft_length(available, p, table)

    def rate(length: int) -> float:
        return sum(p**i for i in range(length + 1)) / table.of(length + 1)

    assert 0 <= chosen <= available
    assert all(rate(chosen) >= rate(length) - 1e-12 for length in range(available + 1))


def test_confirmations_follow_recent_forwards_and_recover_after_refusals():
    confirmations = Confirmations()
    assert confirmations.p == 0.5
    confirmations.verified(sent=12, confirmed=12)  # a repeated step: all confirmed
    high = confirmations.p
    assert high > 0.9
    confirmations.verified(sent=0, confirmed=0)  # no draft found: nothing learned
    assert confirmations.p == high
    for _ in range(6):
        confirmations.verified(sent=3, confirmed=0)  # free text: refused at once
    low = confirmations.p
    assert low < 0.2
    confirmations.verified(sent=0, confirmed=0)  # drafts declined: back towards 0.5, to try again
    assert low < confirmations.p < 0.5
