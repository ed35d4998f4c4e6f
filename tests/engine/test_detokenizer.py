"""Incremental detokenization: deltas are final text only, and stop strings cut the text.

The fake decoder is byte-level like a real BPE vocabulary: each id is a byte string and decoding
replaces an incomplete UTF-8 sequence with U+FFFD, so "é" split over two ids reads "\ufffd"
until its second half arrives. Every case runs on both of the detokenizer's paths: decode calls
(``ByteDecoder``) and the vocabulary's bytes (``TableDecoder``, which has ``token_bytes``).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shared.engine.detokenizer import IncrementalDetokenizer

VOCAB: dict[int, bytes] = {
    0: b"Hello",
    1: b" ",
    2: b"world",
    3: b"\xc3",  # first half of "é"
    4: b"\xa9",  # second half of "é"
    5: b"!",
    6: b"#",
    7: b"##",
    8: b"a",
    9: b"b",
    10: b"ab",
    11: b"\n",
    12: b"\xc3\xa9",  # "é" whole
    13: b"ba#",
}
HELLO, SPACE, WORLD, E1, E2, BANG, HASH, HASH2, A, B, AB, NL, E, BAH = range(14)


class ByteDecoder:
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace")


class TableDecoder(ByteDecoder):
    token_bytes = tuple(VOCAB[i] for i in range(len(VOCAB)))


both_paths = pytest.mark.parametrize("decoder", [ByteDecoder(), TableDecoder()], ids=["decode-calls", "token-bytes"])


def push_each(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    """One push per token, as the engine does; the deltas in order."""
    return [detok.push([i]) for i in ids]


@both_paths
def test_deltas_concatenate_to_the_full_text(decoder):
    ids = [HELLO, SPACE, WORLD, BANG]
    detok = IncrementalDetokenizer(decoder)
    assert push_each(detok, ids) == ["Hello", " ", "world", "!"]
    assert detok.flush() == ""
    assert detok.text == "Hello world!" and not detok.stopped


@both_paths
def test_a_split_character_is_released_only_when_complete(decoder):
    detok = IncrementalDetokenizer(decoder)
    assert push_each(detok, [A, E1, E2, B]) == ["a", "", "é", "b"]


@both_paths
def test_an_incomplete_character_at_the_end_is_flushed_as_is(decoder):
    detok = IncrementalDetokenizer(decoder)
    assert push_each(detok, [A, E1]) == ["a", ""]
    assert detok.flush() == "\ufffd"


@both_paths
def test_a_stop_string_cuts_the_text_before_it(decoder):
    detok = IncrementalDetokenizer(decoder, stop=["world"])
    assert push_each(detok, [HELLO, SPACE, WORLD]) == ["Hello", " ", ""]
    assert detok.stopped and detok.text == "Hello "
    assert detok.push([BANG]) == "" and detok.flush() == ""  # nothing after the stop


@both_paths
def test_a_stop_string_spanning_tokens_holds_back_its_start(decoder):
    detok = IncrementalDetokenizer(decoder, stop=["lo w"])
    # "lo" and "lo " could begin the stop string, so they are held back
    assert push_each(detok, [HELLO, SPACE, WORLD]) == ["Hel", "", ""]
    assert detok.stopped and detok.text == "Hel"


@both_paths
def test_held_back_text_is_released_when_it_turns_out_not_to_be_a_stop(decoder):
    detok = IncrementalDetokenizer(decoder, stop=["##!"])
    assert push_each(detok, [A, HASH, HASH, B]) == ["a", "", "", "##b"]
    assert not detok.stopped


@both_paths
def test_flush_releases_a_held_back_tail(decoder):
    detok = IncrementalDetokenizer(decoder, stop=["##"])
    assert push_each(detok, [A, HASH]) == ["a", ""]
    assert detok.flush() == "#"
    assert detok.flush() == ""


@both_paths
def test_the_earliest_of_several_stop_strings_wins(decoder):
    detok = IncrementalDetokenizer(decoder, stop=["b", "a#"])
    assert detok.push([A, BAH]) == "a"  # "aba#": "b" at 1 comes before "a#" at 2
    assert detok.stopped and detok.text == "a"


@both_paths
def test_a_stop_string_ending_in_a_split_character(decoder):
    detok = IncrementalDetokenizer(decoder, stop=["aé"])
    assert push_each(detok, [B, A, E1, E2, BANG]) == ["b", "", "", "", ""]
    assert detok.stopped and detok.text == "b"


@both_paths
def test_a_stop_string_right_after_the_start_yields_no_text(decoder):
    detok = IncrementalDetokenizer(decoder, stop=["Hello"])
    assert push_each(detok, [HELLO, WORLD]) == ["", ""]
    assert detok.text == "" and detok.stopped


# --- property: streaming equals decoding the whole and cutting once -------------------------


def reference(ids: Sequence[int], stop: Sequence[str]) -> str:
    text = ByteDecoder().decode(ids)
    hits = [i for s in stop if (i := text.find(s)) != -1]
    return text[: min(hits)] if hits else text


@both_paths
@settings(max_examples=300, deadline=None)
@given(
    ids=st.lists(st.sampled_from(sorted(VOCAB)), max_size=20),
    stop=st.lists(st.text(alphabet="ab#é! \n", min_size=1, max_size=4), max_size=3),
    pushes=st.lists(st.integers(1, 3), min_size=20, max_size=20),
)
@example(ids=[BANG, E1], stop=["!"], pushes=[2] + [1] * 19)  # a stop string before a split character
def test_streamed_deltas_plus_flush_equal_the_cut_full_text(ids, stop, pushes, decoder):
    detok = IncrementalDetokenizer(decoder, stop)
    expected = reference(ids, stop)
    streamed, i = "", 0
    for n in pushes:  # pushes of 1..3 tokens
        if i >= len(ids):
            break
        streamed += detok.push(ids[i : i + n])
        i += n
        assert expected.startswith(streamed)  # nothing released is ever taken back
    streamed += detok.flush()
    assert streamed == expected
    assert detok.stopped == any(s in ByteDecoder().decode(ids) for s in stop)


class CountingDecoder(ByteDecoder):
    """Records how many ids each decode call reads."""

    def __init__(self) -> None:
        self.lengths: list[int] = []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(ids))
        return super().decode(ids, skip_special_tokens)


def test_each_push_decodes_only_the_new_ids_and_their_context():
    decoder = CountingDecoder()
    detok = IncrementalDetokenizer(decoder)
    ids = [HELLO, SPACE, WORLD, BANG] * 50 + [E1, E2]
    text = "".join(detok.push([i]) for i in ids) + detok.flush()
    assert text == ByteDecoder().decode(ids)
    assert max(decoder.lengths) <= 3  # the previous push's id, the new one (and a split character's half)


# --- the default model's vocabulary: its bytes spell what its decode spells --------------------


@pytest.fixture(scope="module")
def tokenizer(default_checkpoint):
    return default_checkpoint.tokenizer


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_the_default_vocabulary_streams_what_decode_reads(tokenizer, data):
    table = tokenizer.token_bytes
    assert table is not None  # a byte-level BPE vocabulary: the fast path is the one its requests take
    single_bytes = [i for i, b in enumerate(table) if len(b) == 1 and b[0] >= 0x80]  # halves of characters
    beyond = st.integers(tokenizer.vocab_size, tokenizer.vocab_size + 63)  # a model's padding rows: decode skips them
    ids = data.draw(st.lists(st.one_of(st.integers(0, tokenizer.vocab_size - 1), st.sampled_from(single_bytes),
                                       beyond), max_size=24))
    whole = tokenizer.decode(ids)
    assert b"".join(table[i] for i in ids if i < len(table)).decode("utf-8", errors="replace") == whole
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push([i]) for i in ids) + detok.flush() == whole
