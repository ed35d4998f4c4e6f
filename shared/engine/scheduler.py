"""Continuous batching: each step fills a token budget in this order:

1. admissions that may preempt (a ``safety`` request under ``FleetPolicy``): they take the seats
   and memory of lower-class running requests, which keep their prefix cached and resume later;
2. running decodes, then running prefill chunks, in policy order (memory pressure preempts the
   largest key);
3. new admissions in policy order while budget, seats and memory last.

A step that admits an urgent request runs urgent work only: everything else (decodes included)
waits one step, so the urgent request's first token comes after the shortest possible step
rather than after a full batch (on a CPU a full prefill budget takes seconds). Nothing is lost:
the deferred work runs in the next step.

It also ends requests whose deadline has passed (``expire``), estimates when a new request
would get its first token (``first_token_eta``) so the engine can reject a deadline it cannot
meet, and holds requests whose grammar is still compiling (``WAITING_FOR_GRAMMAR``) out of the
queue until it is ready (``admit_compiled``). A request with jump-forward drafts gets them
appended to its chunk when budget and memory allow. Plain ints only; never touches tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.grammar.matcher import GrammarState
from shared.engine.kv.hicache import LoadTicket, TierCopyError
from shared.engine.kv.manager import KVCacheManager
from shared.engine.kv.prefix_cache import PrefixMatch
from shared.engine.kv.radix import common_prefix_len
from shared.engine.policy import SchedulingPolicy
from shared.engine.request import FinishReason, Request, RequestStatus, stop_reason
from shared.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from shared.engine.service_rate import ServiceRate

log = logging.getLogger(__name__)


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


# Requests loading from the KV tiers, or loaded and not yet admitted, at once, and the share
# of the pool's blocks they may hold beyond the first load: each holds device blocks, so many
# of them could starve the running requests. A request past either bound waits for a slot.
MAX_TIER_LOADS = 4
MAX_TIER_LOAD_FRAC = 0.5


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
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.config = config
        self.kv = kv
        self.policy = policy
        self.eos_token_ids = eos_token_ids
        self.clock = clock
        self.rate = ServiceRate()
        self.waiting: dict[Request, None] = {}  # in arrival order; the policy orders each step
        self.awaiting_grammar: dict[Request, None] = {}  # WAITING_FOR_GRAMMAR
        self.loading: dict[Request, None] = {}  # WAITING_FOR_TIER_LOAD
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request by id
        self.resumed_complete: list[Request] = []  # resumed with an output that already ends them
        self.num_preemptions = 0
        self.num_deadline_misses = 0
        self.num_forced_tokens = 0  # output tokens from accepted jump-forward drafts
        self.num_prompt_tokens_admitted = 0
        self.num_cached_tokens_admitted = 0

    # --- requests in and out -------------------------------------------------------------

    def check_admissible(self, req: Request) -> None:
        """ValueError if ``add`` would refuse ``req`` (a prompt too long, an id in use)."""
        if req.num_tokens >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {req.num_tokens} tokens does not fit max_model_len "
                f"{self.config.max_model_len}"
            )
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")

    def add(self, req: Request) -> None:
        """Queue ``req``: waiting for its grammar (``grammar_pending``) or for a seat."""
        self.check_admissible(req)
        if req.grammar_pending is not None:
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.awaiting_grammar[req] = None
        else:
            self.waiting[req] = None
            self.kv.prefetch(req)
        self.requests[req.request_id] = req
        self.policy.on_add(req)
        if req.output_token_ids and self._stop_reason(req, req.output_token_ids[-1]) is not None:
            self.resumed_complete.append(req)  # ``expire`` ends it before anything is computed

    def finish(self, req: Request, reason: FinishReason) -> None:
        """End ``req`` (running or waiting): cache what it computed and release its KV."""
        if req in self.waiting:
            del self.waiting[req]
            self.kv.release_waiting(req)
        elif req in self.loading:
            del self.loading[req]
            req.cache.tier_load.cancelled = True  # its blocks go back when the copy is done
        elif req in self.awaiting_grammar:
            del self.awaiting_grammar[req]
        elif req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.kv.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        del self.requests[req.request_id]
        self.policy.on_finish(req)

    def fail(self, req: Request) -> FinishReason:
        """In an ``except`` block: log the exception serving ``req`` and end ``req`` alone
        (finish reason ``error``, its KV released; the other requests go on), unless it has
        ended already. Returns ``FinishReason.ERROR``."""
        log.exception("serving request %s failed: it ends with an error, the others go on", req.request_id)
        if req.status is not RequestStatus.FINISHED:
            self.finish(req, FinishReason.ERROR)
        return FinishReason.ERROR

    def expire(self) -> list[FinishedRequest]:
        """End every request whose deadline has passed, with what it has (``deadline``), and
        every resumed one whose resumed output already ended it (a stop token, max_tokens)."""
        complete = [FinishedRequest(r, self._stop_reason(r, r.output_token_ids[-1])) for r in self.resumed_complete
                    if r.request_id in self.requests]
        self.resumed_complete.clear()
        for f in complete:
            self.finish(f.request, f.reason)
        now = self.clock()
        late = [r for r in self.requests.values() if r.deadline is not None and r.deadline <= now]
        for req in late:
            self.finish(req, FinishReason.DEADLINE)
        self.num_deadline_misses += len(late)
        return complete + [FinishedRequest(r, FinishReason.DEADLINE) for r in late]

    def admit_compiled(self) -> list[FinishedRequest]:
        """Queue the requests whose grammar has compiled; end (``abort``) any whose compilation
        failed or whose grammar refuses its resumed output. Returns those it ended."""
        failed = []
        for req in [r for r in self.awaiting_grammar if r.grammar_pending.done()]:
            future, req.grammar_pending = req.grammar_pending, None
            if future.exception() is not None:
                self.finish(req, FinishReason.ABORT)
                failed.append(FinishedRequest(req, FinishReason.ABORT))
                continue
            del self.awaiting_grammar[req]
            req.grammar = GrammarState(future.result(), req.repeat_guard)
            if not all(req.grammar.accept(t) for t in req.output_token_ids):  # a resumed output
                log.warning("%s: its grammar refuses its resumed output", req.request_id)
                self.finish(req, FinishReason.ABORT)
                failed.append(FinishedRequest(req, FinishReason.ABORT))
                continue
            req.status = RequestStatus.WAITING
            self.waiting[req] = None
            self.kv.prefetch(req)
        return failed

    def admit_loaded(self, timeout: float | None = None) -> list[LoadTicket]:
        """Requeue the requests whose tier load finished (their loaded prefix now cached and
        locked for them); returns every finished load, each released (`KVCacheManager.end_load`).
        With ``timeout``, wait that long for a load when none has finished. Raises
        `TierCopyError` (after releasing every finished load) when a layer-by-layer load failed."""
        if self.kv.tiers is None:
            return []
        broken = []
        finished = self.kv.tiers.poll(timeout)
        for ticket in finished:
            self.kv.end_load(ticket)
            req = ticket.request
            if ticket.layerwise and ticket.error is not None:
                broken.append(f"{req.request_id}: {ticket.error}")
            if not ticket.cancelled and not ticket.layerwise:  # a layerwise one never waited
                del self.loading[req]
                req.status = RequestStatus.WAITING
                self.waiting[req] = None
        if broken:
            raise TierCopyError(f"layer-by-layer KV loads failed after their requests started ({'; '.join(broken)})")
        return finished

    def first_token_eta(self, req: Request) -> float:
        """Seconds until ``req`` (not yet added) would get its first token: the prefill work
        the policy puts ahead of it plus its own uncached prompt, in steps of the token budget
        that also carry the running decodes, at the measured step cost. An estimate for
        rejecting hopeless deadlines, 0 before any step has been measured."""
        now = self.clock()
        key = self.policy.key(req, now)
        ahead = sum(r.num_tokens - r.num_computed_tokens for r in self.running if r.is_prefilling)
        ahead += sum(r.num_tokens - r.num_computed_tokens for r in self.waiting if self.policy.key(r, now) <= key)
        own = req.num_tokens - self.kv.match(req).num_tokens
        decoding = sum(1 for r in self.running if not r.is_prefilling)
        return self.rate.seconds_for(ahead + own, self.config.max_num_batched_tokens, riders=decoding)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running) or bool(self.waiting) or bool(self.awaiting_grammar) or bool(self.loading)

    # --- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        now = self.clock()
        budget = self.config.max_num_batched_tokens
        queue = self.policy.order(list(self.waiting), now, lambda r: self.kv.match(r).num_tokens)
        scheduled: set[int] = set()
        budget = self._admit_preempting(queue, budget, scheduled, out)
        urgent_step = bool(scheduled)
        key = self.policy.key
        for req in sorted(self.running, key=lambda r: (r.is_prefilling, key(r, now))):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING or id(req) in scheduled:  # preempted, or admitted above
                continue
            if urgent_step and not self.policy.is_urgent(req):
                continue
            left = req.num_tokens - req.num_computed_tokens
            n = min(left, budget)
            drafts = req.draft_token_ids if n == left and n + len(req.draft_token_ids) <= budget else []
            if not self._reserve(req, n + len(drafts), scheduled, out, now):
                continue
            self._emit(req, n, out, drafts)
            scheduled.add(id(req))
            budget -= n + len(drafts)
        if not out.preempted and not urgent_step:
            self._admit([r for r in queue if r.status == RequestStatus.WAITING], budget, out)
        if self.kv.tiers is not None and self.kv.tiers.num_layerwise_loading:
            bs = self.kv.block_size
            read = {b for c in out.chunks for b in c.block_table} | {s // bs for c in out.copies for s in c.src}
            out.fences = self.kv.tiers.fences_reading(read)
        return out

    def _admit_preempting(self, queue: list[Request], budget: int, scheduled: set[int], out: SchedulerOutput) -> int:
        """Admit the policy's urgent waiting requests before any running work, taking seats and
        memory from running requests they may preempt (largest key first). Returns the budget
        left."""
        now = self.clock()
        for req in queue:
            if budget == 0:
                break
            if not self.policy.is_urgent(req):
                continue
            while (n := self._try_start(req, self.kv.match(req), budget, out)) is None:
                victims = [r for r in self.running if id(r) not in scheduled and self.policy.preempts(req, r)]
                if not victims:
                    return budget  # no room: a later urgent request must not overtake this one
                victim = max(victims, key=lambda r: self.policy.key(r, now))
                self._preempt(victim)
                out.preempted.append(victim.request_id)
            scheduled.add(id(req))
            budget -= n
        return budget

    def _reserve(self, req: Request, n: int, scheduled: set[int], out: SchedulerOutput, now: float) -> bool:
        """Find room for ``n`` tokens of ``req`` by preempting the largest-key request (at
        ``now``) among ``req`` and those with no work yet this step. False if ``req`` itself
        yielded."""
        while not self.kv.allocate_slots(req, n):
            idle = [r for r in self.running if id(r) not in scheduled and r is not req]
            victim = max(idle + [req], key=lambda r: self.policy.key(r, now))
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
        req.draft_token_ids = []  # recomputed on resumption's first sample
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting[req] = None

    def _admit(self, queue: list[Request], budget: int, out: SchedulerOutput) -> None:
        """Admit waiting requests in policy order while budget, seats and memory last."""
        in_flight = [r for r in self.running if r.is_prefilling]
        for req in queue:
            if budget == 0:
                return
            match = self.kv.match(req)
            if self._someone_computes_prefix(req, match.num_tokens, in_flight):
                continue
            if len(self.running) >= self.config.max_num_seqs:
                return  # no seat: later requests must not overtake this one
            loading = self._start_tier_load(req, match)
            if loading is None and self._release_loaded(req):
                match = self.kv.match(req)  # the failed attempt evicted: match afresh
                loading = self._start_tier_load(req, match)
            if loading is None:
                return  # no memory for its load: later requests must not overtake it
            if loading:
                continue
            if req.cache.tier_handle is not None:  # a layer-by-layer load just cached its prefix
                match = self.kv.match(req)
            n = self._try_start(req, match, budget, out)
            if n is None and self._release_loaded(req):
                n = self._try_start(req, self.kv.match(req), budget, out)
            if n is None:
                return  # no memory: later requests must not overtake this one
            in_flight.append(req)
            budget -= n

    def _release_loaded(self, head: Request) -> bool:
        """``head`` found no memory: drop the locks that the other waiting requests hold on
        their loaded prefixes (their pages stay in the tiers; they can load again). A loaded
        request behind the head must not starve it. True if any lock was dropped."""
        held = [r for r in self.waiting if r.cache.tier_handle is not None and r is not head]
        for r in held:
            self.kv.release_waiting(r)
        return bool(held)

    def _start_tier_load(self, req: Request, match: PrefixMatch) -> bool | None:
        """Move ``req`` to WAITING_FOR_TIER_LOAD when the tiers hold more of its prefix and the
        cost model prefers loading it: True if it now waits (on its load, or for a load slot
        while other loads hold ``MAX_TIER_LOADS`` slots or ``MAX_TIER_LOAD_FRAC`` of the pool),
        False if it should start now, None if its load found no device memory. The first load
        is always allowed, so a deferred request never waits on nothing. A layer-by-layer load
        (`HiCache.start_load`) caches its prefix at once and returns False: start now."""
        tiers = self.kv.tiers
        if tiers is None or req.cache.tier_handle is not None:
            return False
        hit = self.kv.find_in_tiers(req, match)
        if hit is None:
            return False
        loaded = [r for r in self.waiting if r.cache.tier_handle is not None]
        held = sum(len(r.cache.tier_load.blocks) for r in self.loading) + sum(
            -(-r.cache.num_tier_loaded_tokens // self.kv.block_size) for r in loaded)
        if held and (len(self.loading) + len(loaded) >= MAX_TIER_LOADS
                     or held + len(hit.tiers) > self.kv.pool.num_blocks * MAX_TIER_LOAD_FRAC):
            return True  # wait for a load slot: the loads in flight finish and are admitted first
        if not self.kv.start_load(req, match, hit):
            return None
        if req.cache.tier_load is None:  # layer by layer: its blocks are readable now
            return False
        del self.waiting[req]
        self.loading[req] = None
        req.status = RequestStatus.WAITING_FOR_TIER_LOAD
        return True

    def _try_start(self, req: Request, match: PrefixMatch, budget: int, out: SchedulerOutput) -> int | None:
        """Admit ``req`` with its cached prefix ``match`` and schedule its first chunk (at most
        ``budget`` tokens); returns the chunk's size, or None if there is no seat or memory."""
        if len(self.running) >= self.config.max_num_seqs:
            return None
        n = min(req.num_tokens - match.num_tokens, budget)
        copies = self.kv.admit(req, match, n)
        if copies is None:
            return None
        del self.waiting[req]
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        if req.scheduled_time is None:
            req.scheduled_time = self.clock()
        if req.num_preemptions == 0:  # a resumed request's own prefix is not a cache hit
            self.num_prompt_tokens_admitted += req.num_prompt_tokens
            self.num_cached_tokens_admitted += match.num_tokens
        out.copies.extend(copies)
        self._emit(req, n, out)
        return n

    def _someone_computes_prefix(self, req: Request, num_cached: int, in_flight: list[Request]) -> bool:
        """True if an in-flight prefill will soon compute enough of ``req``'s uncached prefix."""
        need = num_cached + self.config.in_batch_prefix_min_tokens
        tokens = req.all_token_ids
        for other in in_flight:
            if common_prefix_len(tokens, other.all_token_ids) >= need:
                return True
        return False

    def _emit(self, req: Request, n: int, out: SchedulerOutput, drafts: list[int] = ()) -> None:
        """Schedule ``n`` tokens of ``req`` from its first uncomputed one, plus ``drafts`` (only
        when the chunk reaches the newest token)."""
        start = req.num_computed_tokens
        tokens = req.token_ids_between(start, start + n)  # a new list: the drafts go on its end
        if drafts:
            tokens += drafts
        # NOTE: positional: a frozen dataclass's keyword call costs ~2x, once per running request
        chunk = ScheduledChunk(req.request_id, tokens, start, req.block_table, start + n == req.num_tokens, len(drafts))
        (out.decodes if len(chunk.token_ids) == 1 and chunk.sample and start > 0 else out.prefills).append(chunk)

    # --- after the forward pass -------------------------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[str, list[tuple[int, float]]]) -> list[FinishedRequest]:
        """Advance counters, append sampled tokens, finish on stop rules, cache new prefixes.

        Args:
            sampled: request_id -> [(token, logprob), ...] for every chunk with ``sample``: the
                token sampled at the newest position, or, for a chunk with drafts, the accepted
                drafts followed by the token sampled after the last of them.
        Returns the requests that finished this step (already released).
        """
        finished = []
        for chunk, is_prefill in [(c, False) for c in out.decodes] + [(c, True) for c in out.prefills]:
            req = self.requests.get(chunk.request_id)
            if req is None:
                continue  # it ended during the step (its sampling failed): nothing to advance
            tokens = sampled.get(chunk.request_id, [])
            req.num_computed_tokens = chunk.end - chunk.num_drafts
            if req.draft_token_ids:
                req.draft_token_ids = []
            self.policy.on_served(req, len(chunk.token_ids) if is_prefill else 0, len(tokens))
            reason = None
            for i, (token, logprob) in enumerate(tokens):
                req.output_token_ids.append(token)
                if req.sampling.logprobs:
                    req.output_logprobs.append(logprob)
                if i < len(tokens) - 1:  # an accepted draft: its KV was computed this step
                    req.num_computed_tokens += 1
                    req.num_forced_tokens += 1
                    self.num_forced_tokens += 1
                reason = self._stop_reason(req, token, last=i == len(tokens) - 1)
                if reason is not None:
                    self.finish(req, reason)  # caches what it computed
                    finished.append(FinishedRequest(req, reason))
                    break
            if is_prefill and reason is None:
                self.kv.cache(req)  # others can reuse this prefix from the next step on
        return finished

    def _stop_reason(self, req: Request, token: int, last: bool = True) -> FinishReason | None:
        """``last``: ``token`` is the last of this step's picks; the grammar has already
        accepted them all, so its state speaks for the last one only."""
        grammar_done = last and req.grammar is not None and req.grammar.finished  # it accepted its end
        reason = stop_reason(req.sampling, token, self.eos_token_ids, grammar_done, req.num_output_tokens)
        if reason is None and req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        return reason

