"""Continuous batching: each step fills a token budget with running decodes first, then
chunked prefill, then new admissions in policy order. Plain ints only; never touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.kv.manager import KVCacheManager
from shared.engine.kv.radix import common_prefix_len
from shared.engine.policy import SchedulingPolicy, WaitingQueue
from shared.engine.request import FinishReason, Request, RequestStatus
from shared.engine.scheduler_output import ScheduledChunk, SchedulerOutput


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # running requests at once
    max_num_batched_tokens: int = 512  # tokens computed per step (decodes + prefill chunks)
    max_model_len: int = 8192  # prompt + output; longer requests finish with "length"
    # A waiting request defers while an in-flight prefill is about to compute at least this
    # many more of its prefix tokens (SGLang's in-batch prefix check): never compute twice.
    in_batch_prefix_min_tokens: int = 32

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "in_batch_prefix_min_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class FinishedRequest:
    request: Request
    reason: FinishReason


class Scheduler:
    """Owns the waiting queue and the running set; `schedule` then `update` once per step."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        policy: SchedulingPolicy,
        eos_token_ids: frozenset[int] = frozenset(),
    ):
        self.config = config
        self.kv = kv
        self.policy = policy
        self.eos_token_ids = eos_token_ids
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request by id
        self.num_preemptions = 0
        self.num_prompt_tokens_admitted = 0
        self.num_cached_tokens_admitted = 0

    # --- requests in and out -------------------------------------------------------------

    def add(self, req: Request) -> None:
        if req.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {req.num_tokens} tokens does not fit max_model_len "
                f"{self.config.max_model_len}"
            )
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.waiting.add(req)
        self.requests[req.request_id] = req

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End ``req`` (running or waiting): cache what it computed and release its KV."""
        if req in self.waiting:
            self.waiting.remove(req)
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(len(self.waiting))

    # --- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        order = sorted(self.running, key=lambda r: (r.is_prefilling, self.policy.key(r)))
        scheduled: set[int] = set()
        for req in order:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._reserve(req, n, scheduled, out):
                continue
            self._emit(req, n, out)
            scheduled.add(id(req))
            budget -= n
        if not out.preempted:
            self._admit(budget, out)
        return out

    def _reserve(self, req: Request, n: int, scheduled: set[int], out: SchedulerOutput) -> bool:
        """Find room for ``n`` tokens of ``req`` by preempting the largest-key request among
        ``req`` and those with no work yet this step. False if ``req`` itself yielded."""
        while not self.kv.allocate_slots(req, n):
            idle = [r for r in self.running if id(r) not in scheduled and r is not req]
            victim = max(idle + [req], key=self.policy.key)
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        """Recompute-style preemption: keep its prefix in the cache, drop its KV, requeue it."""
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req)

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        """Admit waiting requests in policy order while budget, seats and memory last."""
        in_flight = [r for r in self.running if r.is_prefilling]
        for req in self.waiting:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            match = self.kv.match(req)
            if self._someone_computes_prefix(req, match.num_tokens, in_flight):
                continue
            n = min(req.num_tokens - match.num_tokens, budget)
            copies = self.kv.admit(req, match, n)
            if copies is None:
                return  # no memory: later requests must not overtake this one
            self.waiting.remove(req)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.num_preemptions == 0:  # a resumed request's own prefix is not a cache hit
                self.num_prompt_tokens_admitted += req.num_prompt_tokens
                self.num_cached_tokens_admitted += match.num_tokens
            out.copies.extend(copies)
            self._emit(req, n, out)
            in_flight.append(req)
            budget -= n

    def _someone_computes_prefix(self, req: Request, num_cached: int, in_flight: list[Request]) -> bool:
        """True if an in-flight prefill will soon compute enough of ``req``'s uncached prefix."""
        need = num_cached + self.config.in_batch_prefix_min_tokens
        tokens = req.all_token_ids
        for other in in_flight:
            if common_prefix_len(tokens, other.all_token_ids) >= need:
                return True
        return False

    def _emit(self, req: Request, n: int, out: SchedulerOutput) -> None:
        start = req.num_computed_tokens
        chunk = ScheduledChunk(
            request_id=req.request_id,
            token_ids=req.token_ids_between(start, start + n),
            start=start,
            block_table=tuple(req.block_table),
            sample=start + n == req.num_tokens,
        )
        (out.decodes if n == 1 and chunk.sample and start > 0 else out.prefills).append(chunk)

    # --- after the forward pass -------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[str, tuple[int, float]]) -> list[FinishedRequest]:
        """Advance counters, append sampled tokens, finish on stop rules, cache new prefixes.

        Args:
            sampled: request_id -> (token, logprob) for every chunk with ``sample``.
        Returns the requests that finished this step (already released).
        """
        finished = []
        for chunk, is_prefill in [(c, False) for c in out.decodes] + [(c, True) for c in out.prefills]:
            req = self.requests[chunk.request_id]
            req.num_computed_tokens = chunk.end
            if is_prefill:
                self.kv.cache(req)  # others can reuse this prefix from the next step on
            if not chunk.sample:
                continue
            token, logprob = sampled[chunk.request_id]
            req.output_token_ids.append(token)
            if req.sampling.logprobs:
                req.output_logprobs.append(logprob)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req, reason)
                finished.append(FinishedRequest(req, reason))
        return finished

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        sp = req.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids):
            return FinishReason.STOP
        if req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return None

