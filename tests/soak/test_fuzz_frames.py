"""The fuzz frame source: reproducible, every family, and every targeted input refused or served
by the codec without any other exception."""

from __future__ import annotations

import msgpack
import pytest

from shared.protocol.codec import MAX_MESSAGE_BYTES, ProtocolError, decode
from shared.protocol.messages import Generate
from shared.transport.router import MAX_FRAME_BYTES
from soak.fuzz_frames import DEEP_FRAME, OVERSIZED_EVERY, FrameSource, _pack, _targeted_mutations


def test_the_same_seed_gives_the_same_frames():
    a, b = FrameSource(7, "bot", "bot"), FrameSource(7, "bot", "bot")
    assert [a.next().parts for _ in range(300)] == [b.next().parts for _ in range(300)]


def test_every_family_appears_and_only_oversized_frames_pass_the_message_limit():
    source = FrameSource(1, "bot", "bot")
    families = set()
    for _ in range(OVERSIZED_EVERY * 10):
        frame = source.next()
        families.add(frame.family)
        size = sum(map(len, frame.parts))
        if frame.family == "oversized":
            assert size > MAX_MESSAGE_BYTES
        else:
            assert size <= MAX_MESSAGE_BYTES
    assert families == {"random", "mutated", "targeted", "multipart", "oversized"}
    assert source.count == OVERSIZED_EVERY * 10  # the last one went past the transport's frame limit
    assert len(FrameSource(1, "b").base("generate")) and MAX_FRAME_BYTES > MAX_MESSAGE_BYTES


TARGETED = _targeted_mutations()


@pytest.mark.parametrize("attack", TARGETED, ids=[f"targeted-{i}" for i in range(len(TARGETED))])
def test_a_targeted_input_is_refused_or_is_a_valid_one_token_request_of_the_sender(attack):
    source = FrameSource(0, "bot", "bot")
    msg = source.base("generate")
    attack(msg)
    try:
        decoded = decode(_pack(msg))
    except ProtocolError:
        return
    assert isinstance(decoded, Generate) and decoded.request_id.startswith("bot/")


def test_a_deeply_nested_frame_is_refused_by_the_codec():
    with pytest.raises(ProtocolError):
        decode(DEEP_FRAME)


def test_a_mutated_generate_differs_from_the_valid_base_in_one_place():
    source = FrameSource(3, "bot", "bot")
    for _ in range(200):
        frame = source._mutated()
        try:
            msg = msgpack.unpackb(frame[0], strict_map_key=False)
        except ValueError:
            continue  # deep nesting past the unpacker's stack: the codec refuses it too
        if isinstance(msg, dict) and msg.get("type") == "generate" and "request_id" in msg \
                and isinstance(msg["request_id"], str):
            assert msg["request_id"].startswith("bot/")
