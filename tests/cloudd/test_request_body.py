"""OpenAI bodies into protocol requests (``cloudd.http_api.request_body``): every bad value is a
400 naming the field, never an exception the server turns into a 500. The cases marked "fuzz"
were found by fuzzing a running cloudd serve (each was a 500 with a traceback)."""

from __future__ import annotations

import pytest

from cloudd.http_api.request_body import BadRequest, decode_json, generate_from_body

USER = [{"role": "user", "content": "hi"}]
HUGE = 10**400  # a JSON integer no float holds


def chat(**fields) -> dict:
    return {"messages": USER, **fields}


@pytest.mark.parametrize("body, words", [
    (chat(temperature=HUGE), "temperature is out of range"),  # fuzz: OverflowError
    (chat(top_p=-HUGE), "top_p is out of range"),
    (chat(temperature="0.5"), "temperature has the wrong type"),
    (chat(stream="false"), "stream must be true or false, not str"),  # was read as true
    (chat(stream=1), "stream must be true or false, not int"),
    (chat(ignore_eos="no"), "ignore_eos must be true or false"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text must be a string"),  # fuzz: TypeError
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text must be a string"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "only text parts are served, not 'image_url'"),
    ({"messages": [{"role": "user", "content": [None]}]}, "only text parts are served, not 'NoneType'"),
    ({"messages": [{"role": "bogus", "content": "hi"}]}, "messages[0]: role 'bogus': expected one of system, user, assistant"),
    ({"messages": [{"role": "", "content": "hi"}]}, "role ''"),
])
def test_a_bad_chat_field_is_a_bad_request_naming_it(body, words):
    with pytest.raises(BadRequest) as info:
        generate_from_body(body, chat=True, tokenizer=None)
    assert words in str(info.value)


def test_text_parts_are_joined_and_flags_read_as_given():
    parts = [{"type": "text", "text": "Bring "}, {"type": "text", "text": "crate 17."}]
    request = generate_from_body({"messages": [{"role": "user", "content": parts}], "stream": True,
                                  "ignore_eos": None}, chat=True, tokenizer=None)
    assert request.messages[0].content == "Bring crate 17." and request.stream is True
    assert request.sampling.ignore_eos is False  # null: not asked
    assert generate_from_body(chat(temperature=0), chat=True, tokenizer=None).sampling.temperature == 0.0


def test_a_number_past_pythons_digit_limit_is_a_bad_request():
    """fuzz: ``"max_tokens": 1000...0`` of 5,000 digits raised ValueError outside the JSON errors."""
    with pytest.raises(BadRequest, match="an integer of more than 4,300 digits"):
        decode_json(b'{"max_tokens": 1' + b"0" * 5000 + b"}")
