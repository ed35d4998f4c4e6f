"""cloudd's OpenAI HTTP API in-process (a tiny random model with the default model's tokenizer)
through the official `openai` client: `stream_options.include_usage` as OpenAI sends it, its
400s, and at most one SSE message per engine step."""

from __future__ import annotations

import json
import socket
import stat
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from cloudd.api_keys import ApiKeys, make_key
from cloudd.http_api import ApiContext, HttpLimits
from cloudd.http_api.calls import ends_request
from cloudd.metrics import ServerMetrics
from shared.model.gguf_loader import build_tokenizer, read_gguf
from shared.protocol.messages import Chunk, Generate, Sampling
from shared.transport.client import ClientConfig, FleetClient, RequestInFlight
from tests.cloudd.http_serving import address, post_head, raw_http, serve_api, serve_http, unused_endpoint

openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "You plan tasks for a warehouse robot."},
            {"role": "user", "content": "Bring crate 17 to the dock."}]
PROMPT = "A robot arm picks"
FIXED = {"temperature": 0, "extra_body": {"ignore_eos": True}}  # greedy, exactly max_tokens tokens


@pytest.fixture(scope="module")
def http(default_model_path) -> Iterator[tuple[str, object]]:
    """(base URL, tokenizer) of an HTTP front end on a CloudServer running in a thread."""
    tokenizer = build_tokenizer(read_gguf(default_model_path)[0])
    with serve_http(tokenizer) as served:
        yield served.url, tokenizer


@pytest.fixture
def api(http):
    return openai.OpenAI(base_url=http[0] + "/v1", api_key="unused", max_retries=0)


def raw_events(url: str, path: str, body: dict) -> list[dict]:
    """The JSON ``data:`` events of a stream as sent, up to ``[DONE]`` (which must come)."""
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        data = [line.decode().removeprefix("data: ").strip() for line in resp if line.startswith(b"data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def post_error(url: str, body: dict) -> tuple[int, str]:
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    return info.value.code, json.load(info.value)["error"]["message"]


def test_chat_include_usage_ends_with_one_usage_chunk_with_empty_choices(api, http):
    tokenizer = http[1]
    chunks = list(api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=7, stream=True,
                                              stream_options={"include_usage": True}, **FIXED))
    *text_chunks, last = chunks
    assert last.choices == []
    assert last.usage.completion_tokens == 7
    assert last.usage.prompt_tokens == len(tokenizer.encode_chat(MESSAGES))
    assert last.usage.total_tokens == last.usage.prompt_tokens + 7
    assert text_chunks and all(c.choices and c.usage is None for c in text_chunks)
    whole = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=7, **FIXED)
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == whole.choices[0].message.content


def test_completions_include_usage_counts_the_prompt_and_the_generated_tokens(api, http):
    tokenizer = http[1]
    chunks = list(api.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, stream=True,
                                         stream_options={"include_usage": True}, **FIXED))
    assert [c.choices == [] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        len(tokenizer.encode(PROMPT)), 5, len(tokenizer.encode(PROMPT)) + 5)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES}),
    ("/v1/completions", {"prompt": PROMPT}),
])
def test_usage_is_null_on_every_other_chunk_with_include_usage_and_absent_without(http, path, body):
    body = {**body, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True}
    plain = raw_events(http[0], path, body)
    assert all("usage" not in e and len(e["choices"]) == 1 for e in plain)
    asked = raw_events(http[0], path, {**body, "stream_options": {"include_usage": True}})
    # NOTE: the same text, not the same messages: how a step's replies group depends on timing
    assert _text(asked[:-1]) == _text(plain) and _finish(asked[:-1]) == _finish(plain) == "length"
    assert all(e["usage"] is None for e in asked[:-1])
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] == 6


def _text(events: list[dict]) -> str:
    return "".join(c.get("text") or c.get("delta", {}).get("content") or "" for e in events for c in e["choices"])


def _finish(events: list[dict]) -> str | None:
    return events[-1]["choices"][0]["finish_reason"]


def test_at_most_one_message_per_engine_step_and_the_finish_reason_rides_on_the_last_text(http):
    # One token per step: 8 steps. Before, the end came as a 9th message of its own.
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    events = raw_events(http[0], "/v1/chat/completions", body)
    assert 1 <= len(events) <= 8
    assert [e["choices"][0]["finish_reason"] for e in events] == [None] * (len(events) - 1) + ["length"]
    assert events[-1]["choices"][0]["delta"].get("content")
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:])


def test_the_openai_client_s_stream_options_without_stream_is_a_400(api):
    with pytest.raises(openai.BadRequestError, match="only allowed when stream is true"):
        api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                    stream_options={"include_usage": True})


@pytest.mark.parametrize("extra, message", [
    ({"stream": True, "stream_options": "include_usage"}, "stream_options must be an object, not str"),
    ({"stream": True, "stream_options": [True]}, "stream_options must be an object, not list"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage must be a bool, not str"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "include_usage must be a bool, not int"),
    ({"stream_options": {"include_usage": True}}, "stream_options is only allowed when stream is true"),
    ({"stream": False, "stream_options": {}}, "stream_options is only allowed when stream is true"),
])
def test_bad_stream_options_are_a_400_naming_the_field(http, extra, message):
    status, text = post_error(http[0], {"messages": MESSAGES, "max_tokens": 2, **extra})
    assert status == 400 and message in text


def test_null_stream_options_are_absent_options(api):
    reply = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream_options=None, **FIXED)
    assert reply.usage.completion_tokens == 2
    chunks = list(api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, stream=True,
                                              stream_options={"include_usage": None}, **FIXED))
    assert all(c.choices and c.usage is None for c in chunks)


@pytest.mark.parametrize("tokens, num_tokens, sampling, ends", [
    ((5,), 3, Sampling(max_tokens=3), True),  # max_tokens reached
    ((5, 6), 2, Sampling(max_tokens=3), False),
    ((5, 2), 2, Sampling(max_tokens=3), True),  # end-of-sequence
    ((5, 2), 2, Sampling(max_tokens=3, ignore_eos=True), False),
    ((9,), 1, Sampling(max_tokens=3, stop_token_ids=(9,)), True),
    ((), 1, Sampling(max_tokens=3), False),  # text held back from earlier tokens
])
def test_a_chunk_ends_its_request_by_the_engine_s_stop_rule(tokens, num_tokens, sampling, ends):
    assert ends_request(Chunk("r", 0, tokens, ""), num_tokens, sampling, frozenset({0, 2})) is ends


def test_a_completions_prompt_past_the_context_is_refused_not_left_waiting(http):
    """Found by fuzzing cloudd serve: its token ids were refused as the frame was read, without
    the request id, so the HTTP call waited until its client gave up."""
    words = " hello" * 9_000  # past the test server's max_model_len (2,048), within the body limit
    request = urllib.request.Request(http[0] + "/v1/completions", json.dumps({"prompt": words, "max_tokens": 4}).encode(),
                                     {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    assert info.value.code == 413 and "at most 2048 token ids" in json.load(info.value)["error"]["message"]


@pytest.mark.parametrize("extra", [
    {"max_tokens": 2**64}, {"seed": 2**64}, {"top_k": 2**64}, {"deadline_ms": 2**64},
    {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "maximum": 2**70}}}},
], ids=["max_tokens", "seed", "top_k", "deadline_ms", "huge-int-in-schema"])
def test_an_integer_beyond_the_wire_is_a_400_and_the_api_keeps_serving(api, http, extra):
    """Found in review: one such request killed the shared client's I/O thread, /health turned 503
    and every later completion hung."""
    status, text = post_error(http[0], {"messages": MESSAGES, **extra})
    assert status == 400
    assert next(iter(extra)) in text or "cannot be encoded" in text
    with urllib.request.urlopen(http[0] + "/health", timeout=10) as resp:
        assert json.load(resp)["status"] == "ok"
    reply = api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, **FIXED)
    assert reply.usage.completion_tokens == 2


def test_a_request_id_already_in_flight_is_a_409(http):
    """Found in review: a second request under a live id was handed the first one's call; the two
    handlers then read each other's replies and the first waited for ever. Here the first is kept
    in flight for sure: its daemon never answers (it is the anonymous tenant's id, as the API
    without keys namespaces it)."""
    client = FleetClient(unused_endpoint(), ClientConfig(timeout_s=60, retries=0))
    try:
        with serve_api(ApiContext(client, http[1], ServerMetrics(), "tiny")) as url:
            client.start(Generate(request_id="/http//shared-id", prompt_ids=(1, 2, 3)))
            status, text = post_error(url, {"messages": MESSAGES, "request_id": "shared-id"})
            assert status == 409 and "already in flight" in text and "/http/" not in text
            with pytest.raises(RequestInFlight):
                client.start(Generate(request_id="/http//shared-id", prompt_ids=(1, 2, 3)))
    finally:
        client.close()


@pytest.mark.parametrize("length", ["-1", "abc", "7.0", "1_000"])
def test_a_content_length_that_is_not_a_byte_count_is_a_400(http, length):
    """Found in review: -1 read until close (400 MiB accepted past the 1 MiB limit), and a
    non-numeric length closed the connection with no answer."""
    reply = raw_http(http[0], post_head(length) + b'{"messages": []}')
    assert reply.startswith(b"HTTP/1.1 400") and b"bad Content-Length" in reply


def test_an_oversize_body_is_a_413_and_its_bytes_are_not_read_as_a_next_request(http):
    """Found in review: the oversize body was left unread and parsed as the next request."""
    hidden = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"  # would be answered if the body were parsed
    reply = raw_http(http[0], post_head(str(2 << 20), connection="keep-alive") + hidden)
    assert reply.startswith(b"HTTP/1.1 413")
    assert reply.count(b"HTTP/1.1 ") == 1


def test_json_nested_too_deeply_is_a_400(http):
    body = b"[" * 100_000 + b"]" * 100_000
    reply = raw_http(http[0], post_head(str(len(body))) + body)
    assert reply.startswith(b"HTTP/1.1 400") and b"nested too deeply" in reply


class _StartsRecorded(FleetClient):
    """A client whose ``started`` is set once a request has been started on it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.started = threading.Event()

    def start(self, request, notify=None):
        call = super().start(request, notify)
        self.started.set()
        return call


def test_requests_in_progress_are_capped_and_a_half_sent_request_is_dropped_after_the_timeout(http):
    """A slot is a generation request in progress (its head, key and body read), not a
    connection: past the cap a request is a 503 with Retry-After, and a connection whose body
    never comes is answered 408 and closed once the timeout has passed."""
    client = _StartsRecorded(unused_endpoint(), ClientConfig(timeout_s=60, retries=0))  # requests stay in flight
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2}).encode()
    limits = HttpLimits(timeout_s=0.5, max_requests=1)
    try:
        with serve_api(ApiContext(client, http[1], ServerMetrics(), "t"), limits) as url:
            with socket.create_connection(address(url), timeout=30) as first:
                first.sendall(post_head(str(len(body))) + body)  # in progress for ever
                assert client.started.wait(timeout=60)
                second = raw_http(url, post_head(str(len(body))) + body)
                assert second.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in second.lower()
            with socket.create_connection(address(url), timeout=30) as half:
                half.sendall(post_head("100") + b'{"messages"')  # and never the rest
                assert half.recv(65536).startswith(b"HTTP/1.1 408")
    finally:
        client.close()


def test_a_robot_over_its_quota_gets_a_429_with_retry_after(http):
    with serve_http(http[1], robot_requests_per_s=0.01, robot_burst=1) as served:
        url = served.url
        body = {"messages": MESSAGES, "max_tokens": 2, "robot_id": "amr-5", "temperature": 0}
        request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            assert resp.status == 200
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 429 and int(refused.value.headers["Retry-After"]) >= 1
        assert "quota" in json.load(refused.value)["error"]["message"]


def test_with_api_keys_only_key_holders_get_in_and_are_served_as_their_key(http, tmp_path):
    keys = tmp_path / "api-keys"
    token = make_key(keys, "dock-station")
    assert token not in keys.read_text() and stat.S_IMODE(keys.stat().st_mode) == 0o600  # hashed at rest
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2, "robot_id": "someone-else", "request_id": "k-1"})
    with serve_http(http[1], api_keys=ApiKeys(keys)) as served:
        url = served.url
        for headers in ({}, {"Authorization": "Bearer not-a-key"}, {"Authorization": f"Basic {token}"}):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", body.encode(),
                                                              {"Content-Type": "application/json", **headers}))
            assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"] == "Bearer"
        authorized = {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}
        with urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", body.encode(), authorized)):
            pass
        (row,) = [r for r in served.server.snapshot()["recent"] if r["request_id"] == "/http/dock-station/k-1"]
        assert row["robot_id"] == "dock-station"
        with urllib.request.urlopen(url + "/health") as resp:  # probes stay open on loopback
            assert resp.status == 200


def test_an_api_key_file_with_a_bad_line_is_refused_naming_it(tmp_path):
    keys = tmp_path / "api-keys"
    keys.write_text("# fleet keys\nops:" + "a" * 64 + "\nbroken line\n")
    with pytest.raises(ValueError, match=":3:"):
        ApiKeys(keys)


def test_cloudd_api_key_prints_a_token_once_and_keeps_its_hash(tmp_path, capsys):
    from cloudd.__main__ import main

    keys = tmp_path / "api-keys"
    assert main(["api-key", "ops", "--file", str(keys)]) == 0
    token = capsys.readouterr().out.strip().splitlines()[-1]
    assert ApiKeys(keys).name_of(token) == "ops" and token not in keys.read_text()
