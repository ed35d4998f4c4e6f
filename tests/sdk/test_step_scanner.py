"""The incremental parser reports steps[i] exactly when its closing brace has arrived, however
the text is cut into pieces."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from robot_sdk.step_scanner import StepScanner

# strings that look like JSON structure, escapes and a nested "steps" key
TRICKY = st.text(alphabet=st.sampled_from(list('{}[],:"\\ab steps\n\u00e9\U0001f916')), max_size=12)
VALUE = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), TRICKY),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TRICKY, inner, max_size=3),
                     max_leaves=6)
STEP = st.fixed_dictionaries({"skill": TRICKY, "args": st.dictionaries(TRICKY, VALUE, max_size=3)})


@st.composite
def plan_texts(draw) -> tuple[str, list[dict], list[int]]:
    """A plan's JSON text with random spacing and key order, its steps, and the offset just
    past each step's closing brace (written here, independently of the scanner)."""
    steps = draw(st.lists(STEP, max_size=4))
    ws = draw(st.sampled_from(["", " ", "\n  "]))
    sep = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
    dumps = lambda v: json.dumps(v, separators=sep, ensure_ascii=draw(st.booleans()))  # noqa: E731
    ends, body = [], "[" + ws
    for i, step in enumerate(steps):
        body += ("," + ws if i else "") + dumps(step)
        ends.append(body)
    body += ws + "]"
    fields = [f'"steps"{sep[1]}{body}', f'"done"{sep[1]}true', f'"note"{sep[1]}{dumps(draw(VALUE))}',
              f'"steps_seen"{sep[1]}{dumps(draw(st.lists(STEP, max_size=1)))}']
    order = draw(st.permutations(range(len(fields))))
    head = "{" + ws
    text, offsets = head, []
    for n, k in enumerate(order):
        text += ("," + ws if n else "")
        if k == 0:
            offsets = [len(text) + len('"steps"') + len(sep[1]) + len(prefix) for prefix in ends]
        text += fields[k]
    text += ws + "}"
    assert json.loads(text)["steps"] == steps
    return text, steps, offsets


def scan(pieces: list[str]) -> list[tuple[int, dict]]:
    scanner, found = StepScanner(), []
    for piece in pieces:
        found += [(i, json.loads(element)) for i, element in scanner.feed(piece)]
    return found


@settings(max_examples=100, deadline=None)
@given(plan_texts())
def test_cutting_a_plan_at_every_position_reports_exactly_the_steps_closed_before_the_cut(case):
    text, steps, ends = case
    for cut in range(len(text) + 1):
        closed = sum(end <= cut for end in ends)
        assert scan([text[:cut]]) == list(enumerate(steps[:closed]))
        assert scan([text[:cut], text[cut:]]) == list(enumerate(steps))


@settings(max_examples=150, deadline=None)
@given(plan_texts(), st.data())
def test_any_chunking_reports_each_step_once_at_the_chunk_that_closes_it(case, data):
    text, steps, ends = case
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    scanner, seen = StepScanner(), []
    for a, b in zip(bounds, bounds[1:]):
        new = scanner.feed(text[a:b])
        assert [i for i, _ in new] == [i for i, end in enumerate(ends) if a < end <= b]
        seen += [json.loads(element) for _, element in new]
    assert seen == steps


def test_a_step_is_reported_when_its_brace_closes_not_when_the_array_does():
    scanner = StepScanner()
    assert scanner.feed('{"steps": [{"skill": "pick", "args": {"object": "}]"}') == []
    assert scanner.feed('}') == [(0, '{"skill": "pick", "args": {"object": "}]"}}')]
    assert scanner.feed(', {"skill": "wait", "args": {}}') == [(1, '{"skill": "wait", "args": {}}')]
    assert scanner.feed('], "done": true, "extra": {"steps": [{"a": 1}]}}') == []
