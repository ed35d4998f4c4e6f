"""n-gram drafts (edged.speculation) against a naive scan, and the history's bound."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from edged.speculation import DraftWindow, NgramDrafter, NgramIndex, SpeculationConfig, recent_outputs, remember


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


@pytest.mark.parametrize("bad", [{"max_draft": 0}, {"max_ngram": 0}, {"min_ngram": 0}, {"min_ngram": 5},
                                 {"history_tokens": -1}])
def test_bad_config_is_refused(bad):
    with pytest.raises(ValueError, match="speculation"):
        SpeculationConfig(**bad)


def test_the_draft_window_follows_what_drafts_earn():
    window = DraftWindow(12)
    assert window.size == 12
    window.verified(sent=12, confirmed=3)  # refused after three: the next forward risks four
    assert window.size == 4
    window.verified(sent=4, confirmed=4)  # all confirmed: twice as many
    assert window.size == 8
    window.verified(sent=8, confirmed=8)
    assert window.size == 12  # never past the limit
    window.verified(sent=12, confirmed=0)
    assert window.size == 1  # a refused first draft still lets one through
    window.verified(sent=0, confirmed=0)  # a forward without drafts says nothing
    assert window.size == 1


@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 12)), max_size=30))
def test_the_draft_window_stays_between_one_and_its_limit(forwards):
    window = DraftWindow(12)
    for sent, confirmed in forwards:
        sent = min(sent, window.size)
        window.verified(sent, min(confirmed, sent))
        assert 1 <= window.size <= 12
