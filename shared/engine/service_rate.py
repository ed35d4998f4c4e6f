"""How fast the engine computes tokens, measured: the basis of deadline admission.

A step's time is modelled as ``seconds_per_step + seconds_per_token * tokens``: a fixed cost
(weights read once, attention set-up, sampling, Python) plus a cost per computed token. Steps of
a few decode tokens are dominated by the first term, prefill chunks by the second, so one
average of seconds per token would price a queued prompt at the decode steps' rate (10-50x too
slow on a CPU with one request decoding) and reject deadlines the engine can meet.
"""

from __future__ import annotations

import math


class ServiceRate:
    """A least-squares line through recent (tokens, seconds) steps, weighted exponentially.

    With too little spread in step sizes to separate the two terms (e.g. one observation), the
    whole time is charged per token, as a plain average. Before the first observation both
    terms are 0: nothing is rejected on a guess.
    """

    def __init__(self, smoothing: float = 0.05):
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        self.smoothing = smoothing
        self.seconds_per_step = 0.0
        self.seconds_per_token = 0.0
        # Decayed weight, weighted means, and weighted sums of squared / crossed deviations,
        # updated in Welford's form (no cancellation between large sums).
        self._w = self._mean_n = self._mean_t = self._ss_n = self._ss_nt = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step computed ``num_tokens`` tokens in ``seconds``."""
        if num_tokens <= 0 or seconds < 0:
            return
        keep = 1.0 - self.smoothing if self._w else 0.0
        self._w = keep * self._w + 1.0
        dn = num_tokens - self._mean_n
        self._mean_n += dn / self._w
        self._mean_t += (seconds - self._mean_t) / self._w
        self._ss_n = keep * self._ss_n + dn * (num_tokens - self._mean_n)
        self._ss_nt = keep * self._ss_nt + dn * (seconds - self._mean_t)
        self._fit()

    def _fit(self) -> None:
        if self._ss_n > 1e-9 * self._w * self._mean_n ** 2:  # step sizes spread enough for a line
            per_token = self._ss_nt / self._ss_n
            per_step = self._mean_t - per_token * self._mean_n
            if per_token >= 0 and per_step >= 0:
                self.seconds_per_token, self.seconds_per_step = per_token, per_step
                return
            if per_token < 0:  # bigger steps were not slower: all fixed cost
                self.seconds_per_token, self.seconds_per_step = 0.0, self._mean_t
                return
        # a line through the origin: sum(w n t) / sum(w n^2), from the same moments
        nn = self._ss_n + self._w * self._mean_n ** 2
        self.seconds_per_token = (self._ss_nt + self._w * self._mean_n * self._mean_t) / nn
        self.seconds_per_step = 0.0

    def seconds_for(self, num_tokens: int, tokens_per_step: int, riders: int = 0) -> float:
        """Time to compute ``num_tokens`` in steps of at most ``tokens_per_step`` tokens, each
        step also computing ``riders`` other tokens (the running decodes) first."""
        room = max(tokens_per_step - riders, 1)
        steps = math.ceil(num_tokens / room) if num_tokens > 0 else 0
        return steps * (self.seconds_per_step + riders * self.seconds_per_token) + num_tokens * self.seconds_per_token
