"""How one request wants its tokens chosen and when it stops."""

from __future__ import annotations

import struct
from dataclasses import dataclass

# Temperatures below this sample greedily (as vLLM does): 1 / temperature stays far from
# overflowing float32, so a sampler never sees non-finite scores.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 100.0


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping rules; validated on construction (ValueError names the field).

    ``temperature`` below ``GREEDY_BELOW`` (0 included) means greedy; it must be finite and at
    most ``MAX_TEMPERATURE``. ``top_k == 0`` and ``top_p == 1`` disable those filters.
    ``seed`` makes a sampled request reproducible on its own, whatever else shares the batch.
    Stop strings are cut from the returned text (OpenAI semantics); stop token ids are not
    returned in the text either. ``ignore_eos`` keeps going past the model's end-of-sequence
    tokens (benchmarks use it for a fixed output length).
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # NaN fails too
            raise ValueError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1 or _as_float32(self.top_p) == 0:  # the sampler's float32 would keep no token
            raise ValueError(f"top_p must be in (0, 1] and not 0 as a float32, got {self.top_p}")
        if isinstance(self.stop, str):  # OpenAI clients send a single stop as a plain string
            object.__setattr__(self, "stop", (self.stop,))
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @classmethod
    def from_wire(cls, s) -> SamplingParams:
        """From the protocol's ``Sampling`` (``shared.protocol.messages``); validated as above."""
        return cls(max_tokens=s.max_tokens, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                   stop=s.stop, stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos, logprobs=s.logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _as_float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]
