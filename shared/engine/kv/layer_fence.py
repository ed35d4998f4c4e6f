"""A layer-by-layer tier load's signals: its copier says when each layer has landed, a forward
pass that reads the loaded blocks waits per layer, so compute of layer ``l`` overlaps the copy
of layers ``l + 1 ...``.

On CUDA a layer "lands" when its copy is *enqueued* on the load stream: ``landed`` records a
CUDA event there, and ``wait`` makes the reader's stream wait on that event, so neither host
thread blocks on the copy itself (the host only waits until the loader thread has issued the
layer, a gather of a few pages). On a CPU ``landed`` is called after the copy finished and
``wait`` blocks the reader until then. Layers land in order, so the last layer's signal
covers the whole load.
"""

from __future__ import annotations

import threading

import torch


class LayerFence:
    """Per-layer "landed" signals of one load. ``landed`` is called by the loader thread (on
    the load stream, on CUDA), every other method by the engine thread."""

    def __init__(self, num_layers: int, device: torch.device) -> None:
        """``device``: the KV pool's (CUDA: readers wait on its current stream)."""
        self._device = device
        self._issued = [threading.Event() for _ in range(num_layers)]
        self._events = [torch.cuda.Event() for _ in range(num_layers)] if device.type == "cuda" else None

    def landed(self, layer: int) -> None:
        """Layer ``layer``'s K and V are in their device blocks (CPU), or their copy is on the
        current stream (CUDA: recorded here)."""
        if self._events is not None:
            self._events[layer].record()
        self._issued[layer].set()

    def wait(self, layer: int) -> None:
        """Make what the caller runs next (on its current stream) see layer ``layer``."""
        self._issued[layer].wait()
        if self._events is not None:
            torch.cuda.current_stream(self._device).wait_event(self._events[layer])

    def wait_all(self) -> None:
        self.wait(len(self._issued) - 1)

    def release(self) -> None:
        """Let every reader through: the loader failed (the load reports its error)."""
        for issued in self._issued:
            issued.set()
