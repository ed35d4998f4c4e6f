import pytest

from shared.model.fetch import ensure_default_model


@pytest.fixture(scope="session")
def default_model_path():
    """The default GGUF in the user's cache, fetched once per machine."""
    return ensure_default_model()


@pytest.fixture(scope="session")
def default_checkpoint(default_model_path):
    """The default model loaded once per test session (dequantizing takes seconds)."""
    from shared.model.checkpoint import load_checkpoint

    return load_checkpoint(default_model_path)
