"""edged's config: the shipped TOML loads, and a bad backend choice is refused with its name."""

from __future__ import annotations

from pathlib import Path

import pytest

from edged.config import BackendConfig, EdgeConfig

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "edged.toml"


def test_the_shipped_config_loads_with_products_auto():
    backend = EdgeConfig.load(CONFIG).backend
    assert (backend.kind, backend.quant, backend.products) == ("onnx", "int4", "auto")


@pytest.mark.parametrize(("field", "value"), [("products", "int8"), ("quant", "int3"), ("kind", "tflite")])
def test_a_bad_backend_choice_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field} must be one of"):
        BackendConfig(**{field: value})
