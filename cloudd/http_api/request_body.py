"""OpenAI request bodies -> protocol ``Generate`` messages.

Served fields: ``model`` (any: cloudd serves one model), ``messages`` (chat: roles system, user
and assistant; content a string or a list of text parts, since the model reads nothing else) or
``prompt`` (completions: a non-empty string, tokenized here), ``max_tokens`` /
``max_completion_tokens``, ``temperature`` (default 1, as OpenAI's), ``top_p``, ``seed``,
``stop``, ``stream``, ``stream_options``, ``response_format``, ``user``, and a robot team's
extras: ``priority``, ``deadline_ms``, ``robot_id``, ``request_id`` (the idempotency key; default
a fresh id), ``top_k`` and ``ignore_eos`` (as vLLM accepts them). Each is checked for its type
(``stream`` and ``ignore_eos`` are JSON booleans: the string "false" is refused, not read as
true) and range: a bad value is a 400 naming the field.

Every other field is a 400 that names it (all of them at once, sorted), except the OpenAI fields
in ``NOT_USED`` while they hold a value that means "not used" (``"logprobs": false``, ``"n": 1``,
``"tools": []``, ``"logit_bias": {}``, a null of any of them, ...), which clients send by
default. So a client never gets text made without a setting it asked for (token penalties, tool
calls, logprobs: the engine has none of them over HTTP).
"""

from __future__ import annotations

import json
import sys
import uuid
from typing import Any

from shared.model.tokenizer import Tokenizer
from shared.protocol.messages import ChatMessage, Generate, Priority, Sampling

SERVED = frozenset({"model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
                    "stream_options", "response_format", "user", "priority", "deadline_ms", "robot_id", "request_id",
                    "top_k", "ignore_eos"})
# OpenAI fields cloudd does not serve, and the values that mean they are not used
NOT_USED: dict[str, tuple[Any, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0),
    "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "parallel_tool_calls": (None, True, False), "echo": (None, False), "suffix": (None, ""), "store": (None, False),
    "service_tier": (None, "auto", "default"),
}


class BadRequest(ValueError):
    """The HTTP body is not a request we can serve; the message says why."""


def decode_json(raw: bytes) -> Any:
    """The body's JSON; BadRequest if it is not JSON, is nested too deeply, or holds a lone
    UTF-16 surrogate (``"\\ud800"``: no valid text, and no tokenizer or encoder takes it)."""
    try:
        body = json.loads(raw or b"null")
        json.dumps(body, ensure_ascii=False).encode()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not JSON: {e}") from None
    except UnicodeEncodeError:
        raise BadRequest("body holds a lone UTF-16 surrogate (\\ud800-\\udfff): text must be valid Unicode") from None
    except RecursionError:
        raise BadRequest("body is nested too deeply") from None
    except ValueError:  # an integer of more digits than Python converts
        raise BadRequest(f"body holds an integer of more than {sys.get_int_max_str_digits():,} digits") from None
    return body


def generate_from_body(body: Any, chat: bool, tokenizer: Tokenizer | None) -> Generate:
    """The protocol request for an OpenAI chat or completions body, its ``request_id`` the
    client's own (the caller namespaces it); BadRequest names a bad or unsupported field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    _refuse_unsupported(body, chat)
    if chat:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise BadRequest("messages must be a non-empty list")
        messages = tuple(_chat_message(i, m) for i, m in enumerate(raw))
        prompt_ids: tuple[int, ...] = ()
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("prompt must be a non-empty string")
        if tokenizer is None:
            raise BadRequest("this model has no tokenizer: use token ids over the protocol")
        messages, prompt_ids = (), tuple(tokenizer.encode(prompt))
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "text":
        response_format = None
    try:
        return Generate(
            request_id=_typed(body.get("request_id") or f"http-{uuid.uuid4().hex}", str, "request_id"),
            messages=messages,
            prompt_ids=prompt_ids,
            sampling=_sampling(body),
            response_format=response_format,
            priority=Priority(body.get("priority", Priority.PLAN.value)),
            deadline_ms=_typed(body.get("deadline_ms"), (int, type(None)), "deadline_ms"),
            robot_id=_typed(body.get("robot_id", body.get("user", "")) or "", str, "robot_id"),
            stream=_flag(body, "stream"),
        )
    except ValueError as e:
        raise BadRequest(str(e)) from None


def include_usage_from_body(body: dict, stream: bool) -> bool:
    """OpenAI's ``stream_options.include_usage`` (absent or null: false). BadRequest when
    ``stream_options`` is not an object, ``include_usage`` not a bool, or either comes without
    ``"stream": true`` (OpenAI refuses that too). Other keys of ``stream_options`` are ignored."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise BadRequest(f"stream_options must be an object, not {type(options).__name__}")
    if not stream:
        raise BadRequest("stream_options is only allowed when stream is true")
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise BadRequest(f"stream_options.include_usage must be a bool, not {type(include).__name__}")
    return bool(include)


def _refuse_unsupported(body: dict, chat: bool) -> None:
    served = SERVED | {"messages" if chat else "prompt"}
    unsupported = sorted(k for k, v in body.items()
                         if k not in served and not (k in NOT_USED and _means_not_used(v, NOT_USED[k])))
    if unsupported:
        raise BadRequest(f"unsupported field{'s' if len(unsupported) > 1 else ''}: {', '.join(unsupported)} "
                         "(cloudd does not serve them; leave them out)")


def _means_not_used(value: Any, not_used: tuple[Any, ...]) -> bool:
    # NOTE: by type too: 0 == False and 1 == True in Python, and "n": true is no count
    return any(type(value) is type(v) and value == v for v in not_used)


def _sampling(body: dict) -> Sampling:
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple):
        raise BadRequest(f"stop must be a string or a list of strings, not {type(stop).__name__}")
    return Sampling(
        max_tokens=_typed(body.get("max_completion_tokens", body.get("max_tokens", 256)), int, "max_tokens"),
        temperature=_real(body.get("temperature", 1.0), "temperature"),
        top_p=_real(body.get("top_p", 1.0), "top_p"),
        top_k=_typed(body.get("top_k", 0), int, "top_k"),
        seed=_typed(body.get("seed"), (int, type(None)), "seed"),
        stop=tuple(_typed(s, str, "stop") for s in stop),
        ignore_eos=_flag(body, "ignore_eos"),
    )


def _chat_message(i: int, m: Any) -> ChatMessage:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise BadRequest(f"messages[{i}] must be an object with a string role")
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: text ones only (the model reads nothing else)
        content = "".join(_text_part(i, j, part) for j, part in enumerate(content))
    if not isinstance(content, str):
        raise BadRequest(f"messages[{i}].content must be a string or a list of text parts")
    try:
        return ChatMessage(m["role"], content)
    except ValueError as e:
        raise BadRequest(f"messages[{i}]: {e}") from None


def _text_part(i: int, j: int, part: Any) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise BadRequest(f"messages[{i}].content[{j}]: only text parts are served, not {kind!r}")
    if not isinstance(part.get("text"), str):
        raise BadRequest(f"messages[{i}].content[{j}].text must be a string")
    return part["text"]


def _real(value: Any, name: str) -> float:
    """A JSON number as a float; BadRequest for another type or one past a float's range."""
    try:
        return float(_typed(value, (int, float), name))
    except OverflowError:
        raise BadRequest(f"{name} is out of range ({str(value)[:20]}...)") from None


def _flag(body: dict, name: str) -> bool:
    """A boolean field (absent or null: false); BadRequest for any other type ("false" is a
    string, and as truthy as any non-empty one)."""
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, not {type(value).__name__}")
    return value


def _typed(value: Any, types: type | tuple[type, ...], name: str) -> Any:
    if isinstance(value, bool) or not isinstance(value, types):
        raise BadRequest(f"{name} has the wrong type ({type(value).__name__})")
    return value
