"""cloudd's HTTP API at the request level (issue 48 items 7 and 8): a lone surrogate is a 400,
unsupported OpenAI fields are a 400 naming each, a client that leaves cancels its request, and
each tenant's request ids live in a namespace of its own."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from cloudd.api_keys import ApiKeys, make_key
from cloudd.http_api.response_body import protocol_error_response
from shared.protocol.messages import Error, ErrorCode, Generate, Sampling
from tests.cloudd.http_serving import Served, address, post_head, serve_http, wait_until

MESSAGES = [{"role": "user", "content": "Bring crate 17 to the dock."}]
LONG = {"messages": MESSAGES, "max_tokens": 1_500, "temperature": 0, "ignore_eos": True}
SETTLE_S = 120.0  # the most a test waits for something that must happen (no timing is asserted)


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    return {"path": str(path), "dock": make_key(path, "dock"), "yard": make_key(path, "yard")}


@pytest.fixture(scope="module")
def http(tokenizer, keys) -> Iterator[Served]:
    with serve_http(tokenizer, api_keys=ApiKeys(keys["path"])) as served:
        yield served


def post(url: str, body: dict | bytes, token: str, path: str = "/v1/chat/completions") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data, {"Content-Type": "application/json",
                                                        "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=SETTLE_S) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_a_lone_surrogate_in_a_completions_prompt_is_a_400_with_a_json_error(http, keys):
    """Found in review: the connection was dropped with no status."""
    status, body = post(http.url, b'{"prompt": "pick \\ud800 up", "max_tokens": 2}', keys["dock"], "/v1/completions")
    assert status == 400 and "surrogate" in body["error"]["message"]


def test_unsupported_openai_fields_are_a_400_naming_each(http, keys):
    """Found in review: logit_bias, best_of and tools were silently ignored."""
    body = {"messages": MESSAGES, "max_tokens": 2, "logit_bias": {"50256": -100}, "best_of": 3,
            "tools": [{"type": "function", "function": {"name": "lift"}}], "presence_penalty": 0.5}
    status, answer = post(http.url, body, keys["dock"])
    assert status == 400
    assert "best_of, logit_bias, presence_penalty, tools" in answer["error"]["message"]


def test_unsupported_fields_at_their_not_used_values_are_served(http, keys):
    body = {"messages": MESSAGES, "max_tokens": 2, "logit_bias": {}, "n": 1, "tools": [], "logprobs": False,
            "tool_choice": None, "temperature": 0}
    status, answer = post(http.url, body, keys["dock"])
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1


def _live(http: Served, client_id: str) -> bool:
    return any(r["request_id"].endswith(client_id) for r in http.server.snapshot()["running"])


def _ended(http: Served, client_id: str) -> list[dict]:
    return [r for r in http.server.snapshot()["recent"] if r["request_id"].endswith(client_id)]




def test_a_non_stream_request_whose_client_leaves_is_cancelled(http, keys):
    """Found in review: a non-stream request kept running after its client left."""
    body = json.dumps({**LONG, "request_id": "walks-away"}).encode()
    head = post_head(str(len(body))).replace(b"\r\n\r\n", f"\r\nAuthorization: Bearer {keys['dock']}\r\n\r\n".encode())
    conn = socket.create_connection(address(http.url), timeout=30)
    conn.sendall(head + body)
    wait_until(lambda: _live(http, "walks-away"), SETTLE_S)
    assert _live(http, "walks-away")
    conn.close()
    wait_until(lambda: _ended(http, "walks-away"), SETTLE_S)
    (row,) = _ended(http, "walks-away")
    assert row["finish_reason"] == "abort" and row["output_tokens"] < LONG["max_tokens"]


def test_a_tenant_cannot_take_a_robot_s_request_id(http, keys):
    """Found in review: an HTTP tenant could send a robot's id (amr-001/...) and squat it, or get
    the robot's kept result."""
    robot_id = "amr-001/plan-7"
    robot = http.client.generate(Generate(request_id=robot_id, prompt_ids=(1, 2, 3),
                                          sampling=Sampling(max_tokens=5, ignore_eos=True)), timeout_s=SETTLE_S)
    status, answer = post(http.url, {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True,
                                     "request_id": robot_id}, keys["dock"])
    assert status == 200 and answer["id"] == robot_id  # its own id, and its own run
    assert answer["usage"]["completion_tokens"] == 3 != robot.usage.completion_tokens
    ids = {r["request_id"] for r in http.server.snapshot()["recent"] if r["request_id"].endswith(robot_id)}
    assert ids == {robot_id, f"/http/dock/{robot_id}"}


def test_two_tenants_may_use_one_id_and_the_409_is_only_about_a_tenant_s_own(http, keys):
    """Found in review: the 409 told a tenant that another's id was live."""
    body = {**LONG, "stream": True, "request_id": "shared-7"}
    held = urllib.request.Request(http.url + "/v1/chat/completions", json.dumps(body).encode(),
                                  {"Content-Type": "application/json", "Authorization": f"Bearer {keys['dock']}"})
    with urllib.request.urlopen(held, timeout=SETTLE_S) as stream:
        assert stream.readline().startswith(b"data: ")  # dock's shared-7 is in flight
        status, answer = post(http.url, {"messages": MESSAGES, "max_tokens": 2, "request_id": "shared-7"},
                              keys["yard"])
        assert status == 200 and answer["id"] == "shared-7"
        status, answer = post(http.url, {"messages": MESSAGES, "max_tokens": 2, "request_id": "shared-7"},
                              keys["dock"])
        assert status == 409
        message = answer["error"]["message"]
        assert "'shared-7'" in message and "/http/" not in message and "yard" not in message


def test_a_priority_the_key_is_not_granted_is_a_403_showing_the_client_s_own_id():
    error = Error(ErrorCode.FORBIDDEN, "priority 'safety' is not granted to robot 'dock' (/http/dock/r-1)",
                  "/http/dock/r-1")
    response = protocol_error_response(error, "/http/dock/r-1", "r-1")
    assert response.status_code == 403
    assert json.loads(response.body)["error"] == {"message": "priority 'safety' is not granted to robot 'dock' (r-1)",
                                                  "type": "forbidden", "code": "forbidden"}
