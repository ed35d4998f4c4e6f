"""GrammarState and MaskBatch: random logits under a mask always decode to text the grammar
describes; masking touches exactly the constrained rows and disallowed tokens; forced text."""

import json
import re

import pytest
import torch
import xgrammar as xgr

from shared.engine.grammar.matcher import GrammarState, MaskBatch
from shared.engine.grammar.response_format import GrammarSpec, grammar_spec
from tests.grammar.conftest import MODEL_VOCAB

SKILLS = [
    {"name": "goto", "args": {"waypoint": "string", "speed": "number"}},
    {"name": "lift", "args": {"load": ["shelf", "pallet"], "height": "integer", "slow": "boolean"}},
    {"name": "undock", "args": {}},
]
PYTHON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool}
MOVE_REGEX = r"(goto|dock) [a-z]{1,8} [0-9]{1,3}"
MOVE_EBNF = 'root ::= "move(" num ", " num ")"\nnum ::= "-"? [0-9]+'
MAX_TOKENS = 300


def allowed_mask(state: GrammarState) -> torch.Tensor:  # [MODEL_VOCAB] bool
    bitmask = xgr.allocate_token_bitmask(1, MODEL_VOCAB)  # [1, 1536] int32
    state.fill(bitmask, 0)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [1536, 32]
    return bits.flatten()[:MODEL_VOCAB].bool()


def decode_randomly(state: GrammarState, masks: MaskBatch, generator: torch.Generator,
                    bias: torch.Tensor) -> list[int] | None:
    """Argmax of masked random logits until the state finishes; None if it runs past MAX_TOKENS."""
    tokens = []
    for _ in range(MAX_TOKENS):
        logits = torch.randn(1, MODEL_VOCAB, generator=generator) + bias  # [1, vocab]
        masks.apply(logits, [0], [state])
        token = int(logits[0].argmax())
        assert state.accept(token), f"masked argmax {token} rejected after {tokens}"
        tokens.append(token)
        if state.finished:
            return tokens
    return None


def check_plan(plan: dict) -> None:
    """The plan matches plan_schema(SKILLS, max_steps=3), key order included."""
    assert list(plan) == ["steps", "done", "confidence"] and isinstance(plan["done"], bool)
    assert 0 <= plan["confidence"] <= 1
    assert 1 <= len(plan["steps"]) <= 3
    skills = {skill["name"]: skill["args"] for skill in SKILLS}
    for step in plan["steps"]:
        assert list(step) == ["skill", "args"] and list(step["args"]) == list(skills[step["skill"]])
        for name, kind in skills[step["skill"]].items():
            value = step["args"][name]
            if isinstance(kind, list):
                assert value in kind
            else:
                assert isinstance(value, PYTHON_TYPES[kind]) and (kind == "boolean") == isinstance(value, bool)
                assert len(value) <= 32 if kind == "string" else kind == "boolean" or abs(value) <= 10_000


@pytest.fixture(scope="module")
def quote_bias(tokenizer) -> torch.Tensor:  # [MODEL_VOCAB] float32
    """Favours tokens holding a double quote: a random model that ends its JSON strings.

    NOTE: under a JSON string mask ~0.1% of the allowed tokens close the string, so unbiased
    random logits would write strings of ~1000 tokens.
    """
    bias = torch.zeros(MODEL_VOCAB)
    for token, index in tokenizer.backend.get_vocab().items():
        if '"' in token:
            bias[index] = 3.0
    return bias


def test_random_decoding_of_a_skill_plan_always_parses(compiler, tokenizer, quote_bias):
    compiled = compiler.compile(grammar_spec({"type": "skills", "skills": SKILLS, "max_steps": 3}))
    generator, masks = torch.Generator().manual_seed(0), MaskBatch(MODEL_VOCAB)
    for _ in range(20):
        tokens = decode_randomly(GrammarState(compiled), masks, generator, quote_bias)
        assert tokens is not None and tokens[-1] in tokenizer.eos_token_ids
        check_plan(json.loads(tokenizer.decode(tokens)))


@pytest.mark.parametrize("spec, pattern", [
    (GrammarSpec("regex", MOVE_REGEX), MOVE_REGEX),
    (GrammarSpec("ebnf", MOVE_EBNF), r"move\((-?[0-9]+), (-?[0-9]+)\)"),
])
def test_random_decoding_matches_regex_and_ebnf(compiler, tokenizer, spec, pattern):
    compiled = compiler.compile(spec)
    generator, masks = torch.Generator().manual_seed(1), MaskBatch(MODEL_VOCAB)
    no_bias = torch.zeros(MODEL_VOCAB)
    for _ in range(20):
        tokens = decode_randomly(GrammarState(compiled), masks, generator, no_bias)
        assert tokens is not None and re.fullmatch(pattern, tokenizer.decode(tokens))


def test_apply_masks_only_constrained_rows_at_disallowed_tokens(compiler, tokenizer):
    compiled = compiler.compile(GrammarSpec("regex", MOVE_REGEX))
    fresh, moving = GrammarState(compiled), GrammarState(compiled)
    for token in tokenizer.encode("goto ab"):
        assert moving.accept(token)
    masks = MaskBatch(MODEL_VOCAB)
    masks.apply(torch.zeros(1, MODEL_VOCAB), [0], [fresh])  # a smaller batch first: the buffer grows
    logits = torch.randn(5, MODEL_VOCAB, generator=torch.Generator().manual_seed(2))  # [5, vocab]
    before = logits.clone()
    masks.apply(logits, [3, 1], [fresh, moving])
    for row in (0, 2, 4):
        assert torch.equal(logits[row], before[row])
    for row, state in ((3, fresh), (1, moving)):
        allowed = allowed_mask(state)
        assert 0 < int(allowed.sum()) < MODEL_VOCAB
        assert torch.equal(logits[row] == float("-inf"), ~allowed)
        assert torch.equal(logits[row][allowed], before[row][allowed])
    assert (masks.stats.calls, masks.stats.rows) == (2, 3) and masks.stats.fill_seconds > 0


def test_empty_rows_touch_nothing():
    masks, logits = MaskBatch(MODEL_VOCAB), torch.ones(2, MODEL_VOCAB)
    masks.apply(logits, [], [])
    assert torch.equal(logits, torch.ones(2, MODEL_VOCAB)) and masks.stats.calls == 0


def test_forced_text_follows_the_plan_schema(compiler, tokenizer):
    state = GrammarState(compiler.compile(grammar_spec({"type": "skills", "skills": SKILLS, "max_steps": 3})))
    assert state.forced_text() == '{"steps": [{"skill": "'
    prefix = tokenizer.encode('{"steps": [{"skill": "li')
    for token in prefix:
        assert state.accept(token)
    assert state.forced_text() == 'ft", "args": {"load": "'  # only "lift" starts with "li"
    state.rollback(1)
    assert state.forced_text() == ""  # after `"` any skill may follow
    assert not state.accept(tokenizer.encode("x")[0]) and not state.finished


def test_finished_after_a_stop_token(compiler, tokenizer):
    state = GrammarState(compiler.compile(GrammarSpec("regex", "yes|no")))
    assert state.accept(tokenizer.encode("yes")[0]) and not state.finished
    assert torch.equal(allowed_mask(state).nonzero().flatten(), torch.tensor(sorted(tokenizer.eos_token_ids)))
    assert state.accept(2) and state.finished and not state.accept(0)


def test_a_fast_batch_charges_each_row_a_share_and_a_slow_one_each_row_its_own_fill(compiler, monkeypatch):
    """The batched fill is timed as a whole; past METER_ROWS_PAST_S each row is filled again
    alone, so that one slow grammar is charged its own time and not its neighbours'."""
    from shared.engine.grammar.matcher import METER_ROWS_PAST_S
    from shared.engine.request_budget import WorkMeter

    compiled = compiler.compile(GrammarSpec("regex", MOVE_REGEX))
    slow, quick = GrammarState(compiled), GrammarState(compiled)
    masks = MaskBatch(MODEL_VOCAB)
    ticks = iter([0.0, METER_ROWS_PAST_S])  # the batch: at the threshold
    monkeypatch.setattr(WorkMeter, "timer", staticmethod(lambda: next(ticks)))
    masks.apply(torch.zeros(2, MODEL_VOCAB), [0, 1], [slow, quick])
    assert slow.work.take() == quick.work.take() == pytest.approx(METER_ROWS_PAST_S / 2)

    ticks = iter([0.0, 1.0])  # the batch: 1 s; then each row alone, by its own meter's timer
    slow.work.timer = iter([1.0, 1.9]).__next__
    quick.work.timer = iter([1.9, 1.901]).__next__
    logits = torch.zeros(2, MODEL_VOCAB)
    masks.apply(logits, [0, 1], [slow, quick])
    assert slow.work.take() == pytest.approx(0.9) and quick.work.take() == pytest.approx(0.001)
    slow.work.timer = lambda: 0.0
    assert torch.equal(logits[0] == float("-inf"), ~allowed_mask(slow))  # the masks as filled in one batch
