import pytest

from shared.model.fetch import ensure_default_model


@pytest.fixture(scope="session")
def default_model_path():
    """The default GGUF in the user's cache, fetched once per machine."""
    return ensure_default_model()
