"""The wire codec: every message round-trips; every bad input is a ProtocolError with a code."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.protocol.codec import MAX_MESSAGE_BYTES, ProtocolError, decode, encode
from shared.protocol.messages import (
    MAX_MESSAGES,
    MAX_PROMPT_IDS,
    MAX_STOP_CHARS,
    MAX_STOPS,
    MAX_TAGS,
    PROTOCOL_VERSION,
    Cancel,
    ChatMessage,
    Chunk,
    Error,
    ErrorCode,
    Escalation,
    Generate,
    Health,
    Priority,
    Result,
    Sampling,
    Source,
    Stats,
    Usage,
)

text = st.text(max_size=20)
ids = st.lists(st.integers(0, 2**31 - 1), max_size=8).map(tuple)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**31), 2**31) | st.floats(allow_nan=False) | text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=8,
)
json_maps = st.dictionaries(text, json_values, max_size=4)
samplings = st.builds(
    Sampling, max_tokens=st.integers(1, 4096), temperature=st.floats(0, 2), top_p=st.floats(0.01, 1),
    top_k=st.integers(0, 100), seed=st.none() | st.integers(0, 2**31), stop=st.lists(text, max_size=3).map(tuple),
    stop_token_ids=ids, logprobs=st.booleans(),
)
generates = st.builds(
    Generate,
    request_id=text.filter(bool),
    messages=st.lists(st.builds(ChatMessage, role=st.sampled_from(["system", "user", "assistant"]), content=text),
                      min_size=1, max_size=3).map(tuple),
    sampling=samplings,
    response_format=st.none() | json_maps,
    priority=st.sampled_from(Priority),
    deadline_ms=st.none() | st.integers(1, 10**6),
    robot_id=text,
    escalation=st.sampled_from(Escalation),
    stream=st.booleans(),
)
messages = st.one_of(
    generates,
    st.builds(Generate, request_id=text.filter(bool), prompt_ids=ids.filter(bool)),
    st.builds(Cancel, request_id=text),
    st.builds(Stats, values=st.none() | json_maps),
    st.builds(Health, status=st.none() | text),
    st.builds(Chunk, request_id=text, seq=st.integers(0, 10**6), token_ids=ids, text=text,
              source=st.sampled_from(Source)),
    st.builds(Result, request_id=text, text=text, finish_reason=st.sampled_from(["stop", "length"]),
              usage=st.builds(Usage, prompt_tokens=st.integers(0, 10**5), completion_tokens=st.integers(0, 10**5)),
              source=st.sampled_from(Source), plan=st.none() | json_maps, degraded=st.booleans(),
              timings=st.dictionaries(text, st.floats(0, 100), max_size=3)),
    st.builds(Error, code=st.sampled_from(ErrorCode), message=text, request_id=st.none() | text),
)


@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_message_round_trips(msg):
    assert decode(encode(msg)) == msg


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_garbage_bytes_are_a_protocol_error(data):
    try:
        decode(data)
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode)


@settings(max_examples=500, deadline=None)
@given(kind=st.sampled_from(["generate", "cancel", "stats", "health", "chunk", "result", "error", "nope"]),
       fields=st.dictionaries(st.sampled_from(["request_id", "messages", "prompt_ids", "sampling", "seq",
                                               "token_ids", "text", "code", "message", "priority", "usage",
                                               "values", "status", "deadline_ms", "stream", "extra"]),
                              json_values, max_size=5))
def test_random_maps_decode_or_fail_with_a_code(kind, fields):
    data = msgpack.packb({"v": PROTOCOL_VERSION, "type": kind, **fields})
    try:
        decode(data)
    except ProtocolError as e:
        assert isinstance(e.code, ErrorCode) and e.message


def raw(**fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields})


@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        (b"\xc1", ErrorCode.BAD_MESSAGE, "msgpack"),
        (msgpack.packb([1, 2]), ErrorCode.BAD_MESSAGE, "map"),
        (msgpack.packb({"v": 99, "type": "health"}), ErrorCode.BAD_VERSION, "version 99"),
        (msgpack.packb({"type": "health"}), ErrorCode.BAD_VERSION, "version None"),
        (raw(type="teleport"), ErrorCode.UNKNOWN_TYPE, "teleport"),
        (raw(type="cancel"), ErrorCode.BAD_MESSAGE, "missing field 'request_id'"),
        (raw(type="cancel", request_id=7), ErrorCode.BAD_MESSAGE, "cancel.request_id: expected str"),
        (raw(type="cancel", request_id="a", colour="red"), ErrorCode.BAD_MESSAGE, "unknown field 'colour'"),
        (raw(type="chunk", request_id="a", seq=True, token_ids=[], text=""), ErrorCode.BAD_MESSAGE, "expected int, got bool"),
        (raw(type="generate", request_id="a", prompt_ids=[1], priority="urgent"), ErrorCode.BAD_MESSAGE, "generate.priority"),
        (raw(type="generate", request_id="a", prompt_ids=[1, "x"]), ErrorCode.BAD_MESSAGE, "generate.prompt_ids[1]"),
        (raw(type="generate", request_id="a", prompt_ids=[1], sampling={"top_k": "3"}), ErrorCode.BAD_MESSAGE,
         "generate.sampling.top_k"),
        (raw(type="generate", request_id="a"), ErrorCode.BAD_MESSAGE, "exactly one of messages and prompt_ids"),
    ],
)
def test_bad_input_names_its_problem(data, code, words):
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert info.value.code == code
    assert words in info.value.message


def test_the_request_id_survives_into_the_error_when_readable():
    with pytest.raises(ProtocolError) as info:
        decode(raw(type="generate", request_id="robot-7/42", prompt_ids="not a list"))
    assert info.value.request_id == "robot-7/42"


def test_oversize_messages_are_refused_before_parsing():
    big = encode(Generate(request_id="a", messages=(ChatMessage("user", "x" * (MAX_MESSAGE_BYTES + 1)),)))
    assert len(big) > MAX_MESSAGE_BYTES
    with pytest.raises(ProtocolError) as info:
        decode(big)
    assert info.value.code == ErrorCode.TOO_LARGE


@pytest.mark.parametrize("field, items", [
    ("messages", [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)),
    ("prompt_ids", [1] * (MAX_PROMPT_IDS + 1)),
    ("tags", ["t"] * (MAX_TAGS + 1)),
])
def test_long_lists_are_refused_by_their_count_before_their_items_are_read(field, items):
    wire = {"v": PROTOCOL_VERSION, "type": "generate", "request_id": "a", field: items}
    if field != "messages":
        wire["messages"] = [{"role": "user", "content": "hi"}]
    with pytest.raises(ProtocolError) as info:
        decode(msgpack.packb(wire))
    assert info.value.code == ErrorCode.BAD_MESSAGE and f"at most {len(items) - 1} items" in info.value.message
    with pytest.raises(ValueError, match="at most"):  # and a sender cannot build one either
        Sampling(stop=("s",) * (MAX_STOPS + 1))


def test_a_list_past_the_daemons_bound_is_refused_with_the_request_id_the_caller_waits_on():
    """Found by fuzzing cloudd serve: the refusal came without an id, so a client (and the HTTP
    front behind it) waited for an answer that never came."""
    for field in ("prompt_ids", "resume_token_ids"):
        wire = {"v": PROTOCOL_VERSION, "type": "generate", field: [1] * 9_000, "request_id": "robot-7/42"}
        with pytest.raises(ProtocolError) as info:
            decode(msgpack.packb(wire), max_ids=8_192)
        assert info.value.code == ErrorCode.TOO_LARGE and info.value.request_id == "robot-7/42"
    garbage = msgpack.packb({"v": PROTOCOL_VERSION, "prompt_ids": [1] * 9_000})[:-3]  # no id, and cut short
    with pytest.raises(ProtocolError) as info:
        decode(garbage, max_ids=8_192)
    assert info.value.code in (ErrorCode.TOO_LARGE, ErrorCode.BAD_MESSAGE) and info.value.request_id is None


def test_lists_of_plain_items_still_refuse_a_wrong_item_type():
    wire = {"v": PROTOCOL_VERSION, "type": "generate", "request_id": "a", "prompt_ids": [1, 2, True]}
    with pytest.raises(ProtocolError, match=r"prompt_ids\[2\]: expected int, got bool"):
        decode(msgpack.packb(wire))


def test_priority_rank_is_the_one_sort_key():
    assert sorted(Priority, key=lambda p: p.rank) == [
        Priority.SAFETY, Priority.INTERACTIVE, Priority.PLAN, Priority.BACKGROUND
    ]


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: Sampling(max_tokens=2**64), "max_tokens"),
        (lambda: Sampling(max_tokens=0), "max_tokens"),
        (lambda: Sampling(top_k=2**31), "top_k"),
        (lambda: Sampling(seed=2**63), "seed"),
        (lambda: Sampling(seed=-1), "seed"),
        (lambda: Sampling(stop_token_ids=(2**40,)), "stop_token_ids"),
        (lambda: Generate(request_id="a", prompt_ids=(1,), deadline_ms=2**64), "deadline_ms"),
        (lambda: Generate(request_id="a", prompt_ids=(1,), resume_from=2**31), "resume_from"),
        (lambda: Generate(request_id="a", prompt_ids=(1, 2**31)), "prompt_ids"),
    ],
)
def test_integers_beyond_the_wire_range_are_refused_naming_the_field(build, field):
    """Found in review: max_tokens (or seed, top_k, deadline_ms) of 2^64 passed the HTTP edge,
    msgpack could not encode it, and the exception killed the shared client's I/O thread."""
    with pytest.raises(ValueError, match=field):
        build()


def test_a_wire_integer_out_of_range_is_a_bad_message():
    with pytest.raises(ProtocolError) as info:
        decode(raw(type="generate", request_id="a", prompt_ids=[1], sampling={"max_tokens": 2**63}))
    assert info.value.code == ErrorCode.BAD_MESSAGE and "max_tokens" in info.value.message


def test_a_value_msgpack_cannot_carry_is_a_value_error_from_encode():
    with pytest.raises(ValueError, match="cannot be encoded"):
        encode(Generate(request_id="a", prompt_ids=(1,), response_format={"type": "json_object", "x": 2**70}))


@pytest.mark.parametrize(("build", "field"), [
    (lambda: Generate(request_id="r" * 257, prompt_ids=(1,)), "request_id"),
    (lambda: Cancel(request_id="r" * 257), "request_id"),
    (lambda: Generate(request_id="a", prompt_ids=(1,), robot_id="x" * 500_000), "robot_id"),
    (lambda: Generate(request_id="a", prompt_ids=(1,), tags=("t",) * 17), "tags"),
    (lambda: Generate(request_id="a", prompt_ids=(1,), tags=("t" * 65,)), "tags"),
])
def test_client_strings_a_daemon_keeps_are_bounded(build, field):
    """Found in review: a 500 KB robot_id grew /metrics to 28.5 MB, and tags were kept whole."""
    with pytest.raises(ValueError, match=field):
        build()


def test_stop_strings_are_bounded_in_total_length():
    """Found in review: 64 stops of 15,000 characters cost 358 ms a detokenizer step, for every
    robot on the server."""
    wire = {"v": PROTOCOL_VERSION, "type": "generate", "request_id": "a", "messages": [{"role": "user", "content": "hi"}],
            "sampling": {"stop": ["x" * (MAX_STOP_CHARS // 2), "y" * (MAX_STOP_CHARS // 2 + 1)]}}
    with pytest.raises(ProtocolError, match="at most 4096 characters"):
        decode(msgpack.packb(wire))
    assert Sampling(stop=("x" * (MAX_STOP_CHARS // 2),) * 2).stop[0] == "x" * (MAX_STOP_CHARS // 2)
