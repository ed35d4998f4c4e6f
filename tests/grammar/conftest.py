import pytest

from shared.engine.grammar.compiler import GrammarCompiler

MODEL_VOCAB = 49152  # columns of the default model's logits


@pytest.fixture(scope="session")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, compile_threads=2)
    yield compiler
    compiler.close()
