"""A request's life in the engine, as counters rather than phases.

Prefill, chunked prefill, prefix hit and decode all mean the same thing: compute
``num_tokens - num_computed_tokens`` more tokens, capped by the step's budget::

    | prefix-cache hit | computed by us | scheduled this step | not yet computed |
    0                  num_cached       num_computed_tokens               num_tokens
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.engine.sampling_params import SamplingParams
from shared.protocol.messages import Priority, Sampling

if TYPE_CHECKING:
    from shared.engine.grammar.matcher import GrammarState
    from shared.engine.grammar.repeat_guard import StepRepeatGuard
    from shared.engine.kv.hicache import LoadTicket
    from shared.engine.kv.prefix_cache import PrefixHandle
    from shared.engine.kv.radix import TreeNode


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2
    WAITING_FOR_GRAMMAR = 3  # its grammar is compiling on a worker; it is not queued yet
    WAITING_FOR_TIER_LOAD = 4  # its prefix is being copied up from the host/disk tiers


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens, or the model's context is full
    ABORT = "abort"  # the client cancelled
    DEADLINE = "deadline"  # its deadline passed: it ends with what it has
    ERROR = "error"  # serving this request alone raised (logged): it ends, the others go on



def stop_reason(sampling: SamplingParams | Sampling, token: int | None, eos_token_ids: Collection[int],
                grammar_finished: bool, num_output_tokens: int) -> FinishReason | None:
    """Why a request ends after emitting ``token`` (its ``num_output_tokens``-th), or None: a stop
    token or end-of-sequence (unless ``ignore_eos``), a grammar that accepted its end, ``max_tokens``.
    The engine's rule, also read by a protocol client (the HTTP API) from the wire's ``Sampling``."""
    if token in sampling.stop_token_ids or (not sampling.ignore_eos and token in eos_token_ids):
        return FinishReason.STOP
    if grammar_finished:
        return FinishReason.STOP
    if num_output_tokens >= sampling.max_tokens:
        return FinishReason.LENGTH
    return None


@dataclass(slots=True)
class RequestCacheState:
    """A request's holds on the prefix index and the KV tiers. Written only by the KV manager
    (``kv/manager.py``: the locks and the load) and HiCache (``kv/hicache.py``: the page
    bookkeeping); the scheduler reads it to tell loading and loaded requests apart."""

    prefix_handle: PrefixHandle | None = None  # locked prefix-cache entry while running
    page_hashes: list[bytes] = field(default_factory=list)  # keys of its first full pages, a cache
    num_backed_pages: int = 0  # write-through: pages already handed to the tiers
    tier_load: LoadTicket | None = None  # its load in flight while WAITING_FOR_TIER_LOAD
    tier_handle: TreeNode | None = None  # locked radix node of loaded KV, until admitted
    num_tier_loaded_tokens: int = 0  # of its next admission's match, tokens loaded from the tiers


@dataclass(eq=False, slots=True)
class Request:
    """One generation. Identity-hashed so it can sit in sets; owned by the scheduler."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_seq: int  # order of submission; FCFS and tie-breaks use it
    arrival_time: float  # on the engine's clock
    priority: Priority = Priority.PLAN
    robot_id: str = ""  # fairness is per robot; "" is one anonymous client
    deadline: float | None = None  # on the engine's clock: it must finish by then
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit at the last admission
    num_preemptions: int = 0
    block_table: list[int] = field(default_factory=list)
    scheduled_time: float | None = None  # first admitted (its queue time ends)
    first_token_time: float | None = None
    finish_time: float | None = None
    grammar_pending: Future | None = None  # a compiling grammar (an xgrammar CompiledGrammar)
    repeat_guard: StepRepeatGuard | None = None  # a skills plan's: no step twice in a row
    grammar: GrammarState | None = None  # constrains every sampled token once compiled
    draft_token_ids: list[int] = field(default_factory=list)  # jump-forward: forced next tokens
    num_forced_tokens: int = 0  # output tokens that came from accepted drafts (no step of their own)
    cache: RequestCacheState = field(default_factory=RequestCacheState)  # prefix index and tiers

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("prompt must have at least one token")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output as a new list (the rest not copied)."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """More than the newest token is still to compute (prompt, or recompute after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1
