"""Choose the next token of every sampled row: greedy, or temperature with top-k / top-p.

Greedy rows are one batched argmax. A sampled row with a ``seed`` draws from its own
``torch.Generator``, so its tokens do not depend on what else shares the batch.
"""

from __future__ import annotations

import torch

from shared.engine.sampling_params import SamplingParams


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._shared = torch.Generator().manual_seed(0)

    def sample(
        self,
        logits: torch.Tensor,  # [N, vocab] float32
        request_ids: list[str],
        params: list[SamplingParams],
    ) -> list[tuple[int, float]]:
        """(token, logprob of that token) per row; the logprob is computed only when asked for."""
        tokens = logits.argmax(dim=-1)  # [N]; overwritten below for sampled rows
        for row, (rid, sp) in enumerate(zip(request_ids, params, strict=True)):
            if not sp.greedy:
                tokens[row] = self._draw(logits[row], sp, self._generator(rid, sp))
        want = [row for row, sp in enumerate(params) if sp.logprobs]
        logprobs = torch.zeros(len(params))
        if want:
            rows = torch.tensor(want)
            chosen = torch.log_softmax(logits[rows], dim=-1).gather(1, tokens[rows, None])
            logprobs[rows] = chosen.squeeze(1)
        return list(zip(tokens.tolist(), logprobs.tolist(), strict=True))

    def forget(self, request_id: str) -> None:
        """Drop a finished request's generator."""
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, sp: SamplingParams) -> torch.Generator:
        if sp.seed is None:
            return self._shared
        if request_id not in self._generators:
            self._generators[request_id] = torch.Generator().manual_seed(sp.seed)
        return self._generators[request_id]

    @staticmethod
    def _draw(logits: torch.Tensor, sp: SamplingParams, gen: torch.Generator) -> int:
        """One token from ``logits`` ([vocab]) under temperature, top-k and top-p."""
        scores = logits / sp.temperature
        if sp.top_k:
            kth = torch.topk(scores, min(sp.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if sp.top_p < 1.0:
            sorted_scores, order = scores.sort(descending=True)
            cum = sorted_scores.softmax(-1).cumsum(-1)
            drop = cum - sorted_scores.softmax(-1) >= sp.top_p  # keep the smallest set reaching p
            scores = scores.scatter(0, order[drop], float("-inf"))
        return int(torch.multinomial(scores.softmax(-1), 1, generator=gen))
