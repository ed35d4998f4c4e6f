"""What an attention step waits on before a layer reads the KV cache, as the step sees it."""

from __future__ import annotations

from typing import Protocol


class LayerWait(Protocol):
    """A signal per layer that the step's KV blocks are ready to read, such as a KV tier load
    still landing layer by layer (``shared.engine.kv.layer_fence.LayerFence``)."""

    def wait(self, layer: int) -> None:
        """Return once what the caller runs next (on its current stream) sees layer ``layer``."""
        ...
