import os

import pytest
import torch

# The Triton kernels run under the interpreter where there is no GPU: it is read when a kernel
# is defined, so before any test imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from shared.model.fetch import ensure_default_model
from shared.model.gguf_loader import build_tokenizer, read_gguf


@pytest.fixture(scope="session")
def default_model_path():
    """The default GGUF in the user's cache, fetched once per machine."""
    return ensure_default_model()


@pytest.fixture(scope="session")
def tokenizer(default_model_path):
    """The default model's tokenizer alone, read from the GGUF metadata (no weights dequantized)."""
    return build_tokenizer(read_gguf(default_model_path)[0])


@pytest.fixture(scope="session")
def default_checkpoint(default_model_path):
    """The default model loaded once per test session (dequantizing takes seconds)."""
    from shared.model.checkpoint import load_checkpoint

    return load_checkpoint(default_model_path)
