"""How fast the engine computes tokens, measured: the basis of deadline admission."""

from __future__ import annotations


class ServiceRate:
    """An exponentially weighted average of seconds per computed token over recent steps.

    Every token a step computes counts (prefill chunks and decodes alike), so the figure folds
    in how busy the batch is. Before the first observation it is 0: nothing is rejected on a
    guess.
    """

    def __init__(self, smoothing: float = 0.2):
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self.seconds_per_token = 0.0
        self._observed = False

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step computed ``num_tokens`` tokens in ``seconds``."""
        if num_tokens <= 0 or seconds < 0:
            return
        sample = seconds / num_tokens
        if not self._observed:
            self.seconds_per_token, self._observed = sample, True
        else:
            self.seconds_per_token += self.smoothing * (sample - self.seconds_per_token)

    def seconds_for(self, num_tokens: int) -> float:
        return num_tokens * self.seconds_per_token
