"""GrammarCompiler: xgrammar's view of our tokenizer, the LRU cache, async compilation, errors."""

import threading

import pytest
import torch
import xgrammar as xgr

from shared.engine.grammar.compiler import GrammarCompiler
from shared.engine.grammar.response_format import GrammarSpec, grammar_spec
from tests.grammar.conftest import MODEL_VOCAB

DIGITS = GrammarSpec("regex", "[0-9]{1,3}")
YES_NO = GrammarSpec("regex", "yes|no")
BAD_SCHEMA = grammar_spec({"type": "json_schema", "schema": {"type": "objekt"}})


def allowed_tokens(matcher: xgr.GrammarMatcher) -> set[int]:
    bitmask = xgr.allocate_token_bitmask(1, MODEL_VOCAB)  # [1, 1536] int32
    matcher.fill_next_token_bitmask(bitmask, 0)
    bits = (bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [1536, 32]
    return set(bits.flatten()[:MODEL_VOCAB].nonzero().flatten().tolist())


def test_tokenizer_info_is_byte_level_with_our_stop_tokens(compiler, tokenizer):
    info = compiler.tokenizer_info
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and not info.add_prefix_space
    assert info.vocab_size == MODEL_VOCAB and info.stop_token_ids == sorted(tokenizer.eos_token_ids) == [0, 2]
    im_start = tokenizer.backend.token_to_id("<|im_start|>")
    assert im_start in info.special_token_ids
    vocab = info.decoded_vocab
    assert [vocab[i] for i in tokenizer.encode(' {"steps"\n')] == [b" {\"", b"steps", b"\"", b"\n"]


def test_special_tokens_never_match_text(compiler, tokenizer):
    matcher = xgr.GrammarMatcher(compiler.compile(grammar_spec({"type": "json_object"})))
    assert matcher.accept_string('{"note": "')
    allowed = allowed_tokens(matcher)
    assert tokenizer.encode("x")[0] in allowed
    assert not allowed & {tokenizer.backend.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>", "<filename>")}


def test_same_spec_compiles_once_then_hits(tokenizer):
    fresh = GrammarCompiler(tokenizer, MODEL_VOCAB, compile_threads=1)
    first = fresh.compile(DIGITS)
    assert fresh.compile(GrammarSpec("regex", "[0-9]{1,3}")) is first
    assert (fresh.stats.compiles, fresh.stats.cache_hits, fresh.stats.joins) == (1, 1, 0)
    assert fresh.stats.compile_seconds > 0
    fresh.close()


def test_lru_evicts_the_least_recently_used(tokenizer):
    fresh = GrammarCompiler(tokenizer, MODEL_VOCAB, max_cached=2, compile_threads=1)
    for future in fresh.precompile([DIGITS, YES_NO]):
        future.result()
    fresh.compile(DIGITS)  # DIGITS is now the most recent
    fresh.compile(GrammarSpec("regex", "a+"))  # evicts YES_NO
    assert fresh.cached() == 2 and (fresh.stats.compiles, fresh.stats.cache_hits) == (3, 1)
    fresh.compile(DIGITS)
    fresh.compile(YES_NO)
    assert (fresh.stats.compiles, fresh.stats.cache_hits) == (4, 2)
    fresh.close()


def test_concurrent_requests_for_one_spec_share_a_future(compiler, monkeypatch):
    gate = threading.Event()
    compile_in_worker = compiler._pool.compile

    def gated_compile(spec):
        gate.wait(10)
        return compile_in_worker(spec)

    monkeypatch.setattr(compiler._pool, "compile", gated_compile)
    spec = GrammarSpec("regex", "(left|right) [0-9]")
    joins, compiles = compiler.stats.joins, compiler.stats.compiles
    first, second = compiler.compile_async(spec), compiler.compile_async(spec)
    assert first is second and not first.done() and compiler.stats.joins == joins + 1
    gate.set()
    assert isinstance(first.result(timeout=10), xgr.CompiledGrammar)
    assert compiler.stats.compiles == compiles + 1


@pytest.mark.parametrize("spec, message", [
    (BAD_SCHEMA, 'invalid json schema: Unsupported type "objekt"'),
    (GrammarSpec("regex", "(("), "invalid regex: Regex parsing error at position 3: The parenthesis is not closed"),
    (GrammarSpec("ebnf", "root ::= foo"),
     'invalid ebnf: EBNF parser error at line 1, column 10: Rule "foo" is not defined'),
    (GrammarSpec("ebnf", 'start ::= "a"'), 'invalid ebnf: .*The root rule with name "root" is not found'),
])
def test_invalid_specs_raise_value_error_everywhere(compiler, spec, message):
    failures = compiler.stats.failures
    with pytest.raises(ValueError, match=message):
        compiler.validate(spec)
    with pytest.raises(ValueError, match=message):
        compiler.compile_async(spec).result(timeout=10)
    with pytest.raises(ValueError, match=message):
        compiler.compile(spec)
    assert compiler.stats.failures == failures + 2
