import pytest

from shared.engine.grammar.compiler import GrammarCompiler
from shared.model.gguf_loader import build_tokenizer, read_gguf

MODEL_VOCAB = 49152  # columns of the default model's logits


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    """The default model's tokenizer alone, read from the GGUF metadata (no weights dequantized)."""
    return build_tokenizer(read_gguf(default_model_path)[0])


@pytest.fixture(scope="session")
def compiler(tokenizer):
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, compile_threads=2)
    yield compiler
    compiler.close()
