"""The in-process engine API both daemons drive: submit, step, stream deltas, abort, stats.

Single-threaded by contract: one owner calls ``submit``/``step``/``abort``. ``stream`` drives
``step`` itself until its request finishes, buffering other requests' deltas for their own
``stream`` or ``drain`` calls, so a simple caller needs no loop of its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.engine_config import EngineConfig
from shared.engine.kv.block_pool import BlockPool
from shared.engine.kv.hashed import HashedBlockIndex
from shared.engine.kv.manager import KVCacheManager
from shared.engine.kv.prefix_cache import PrefixCache
from shared.engine.kv.radix import RadixTree
from shared.engine.policy import FCFS, SchedulingPolicy
from shared.engine.request import FinishReason, Request
from shared.engine.runner import ModelRunner
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import Scheduler
from shared.model.checkpoint import load_checkpoint
from shared.model.llama import LlamaModel, build_model
from shared.model.tokenizer import Tokenizer

Messages = Sequence[Mapping[str, str]]


@dataclass(frozen=True)
class TokenDelta:
    """What one request produced in one step (or its end)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    blocks_total: int
    blocks_used: int
    blocks_free: int
    prompt_tokens: int  # prompt tokens of admitted requests (recounted after a preemption)
    cache_hit_tokens: int  # of those, tokens reused from the prefix cache
    cached_tokens: int  # tokens the prefix index holds now
    preemptions: int
    steps: int

    @property
    def prefix_hit_rate(self) -> float:
        return self.cache_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer | None,
        config: EngineConfig = EngineConfig(),
        policy: SchedulingPolicy | None = None,
    ):
        self.config = config
        self.tokenizer = tokenizer
        self.pool = BlockPool(config.num_blocks, config.block_size)
        self.index = _make_index(config.prefix_index, self.pool)
        eos = tokenizer.eos_token_ids if tokenizer is not None else frozenset()
        # A request may never outgrow the model's positions or the whole KV pool.
        max_len = min(
            config.scheduler.max_model_len,
            model.config.max_position_embeddings,
            (config.num_blocks - 1) * config.block_size,
        )
        self.scheduler = Scheduler(
            dataclasses.replace(config.scheduler, max_model_len=max_len),
            KVCacheManager(self.pool, self.index),
            policy or FCFS(),
            eos,
        )
        self.runner = ModelRunner(model, config.num_blocks, config.block_size)
        self.sampler = Sampler()
        self._seq = itertools.count()
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: dict[str, list[TokenDelta]] = defaultdict(list)
        self._live: set[str] = set()  # submitted, and not yet fully delivered
        self._buffered: set[str] = set()  # live ids whose deltas wait for stream/drain
        self.num_steps = 0

    @classmethod
    def from_checkpoint(cls, path: Path | str, config: EngineConfig = EngineConfig()) -> "Engine":
        ckpt = load_checkpoint(path)
        model = build_model(ckpt.config, ckpt.weights, dtype=config.torch_dtype)
        return cls(model, ckpt.tokenizer, config)

    # --- requests -----------------------------------------------------------------------------

    def submit(
        self,
        prompt: Sequence[int] | Messages | str,
        sampling: SamplingParams = SamplingParams(),
        request_id: str | None = None,
        buffered: bool = True,
    ) -> str:
        """Queue a request: token ids, a plain string, or chat messages (rendered with the
        model's chat template). Raises ValueError for an empty or over-long prompt, an id in
        use, or text without a tokenizer.

        ``buffered`` keeps the request's deltas for ``stream``/``drain``; a caller that consumes
        what ``step`` returns (a daemon's loop) passes False, and nothing is kept."""
        rid = request_id if request_id is not None else f"req-{next(self._seq)}"
        if rid in self._live:
            raise ValueError(f"request id {rid!r} is already in use")
        req = Request(
            request_id=rid,
            prompt_token_ids=self._tokenize(prompt),
            sampling=sampling,
            arrival_seq=next(self._seq),
            arrival_time=time.perf_counter(),
        )
        self.scheduler.add(req)
        if self.tokenizer is not None:
            self._detok[rid] = IncrementalDetokenizer(self.tokenizer, sampling.stop)
        self._live.add(rid)
        if buffered:
            self._buffered.add(rid)
        return rid

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV; its stream ends with finish reason ``abort``.
        Returns False if it had already finished or never existed."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return False
        self.scheduler.finish(req, FinishReason.ABORT)
        self._deliver(req, [], FinishReason.ABORT)
        return True

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # --- stepping -------------------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        """Schedule, run the model once, sample, apply stop rules. Returns this step's deltas
        (buffered requests' deltas are also kept for ``stream``/``drain``)."""
        out = self.scheduler.schedule()
        if out.is_empty:
            return [] if out.preempted else self._unblock()
        logits = self.runner.execute(out)
        sampled_chunks = [c for c in out.chunks if c.sample]
        reqs = [self.scheduler.requests[c.request_id] for c in sampled_chunks]
        picks = self.sampler.sample(logits, [r.request_id for r in reqs], [r.sampling for r in reqs])
        now = time.perf_counter()
        for req in reqs:
            if req.first_token_time is None:
                req.first_token_time = now
        finished = {f.request.request_id: f.reason for f in self.scheduler.update(
            out, {r.request_id: p for r, p in zip(reqs, picks, strict=True)})}
        self.num_steps += 1
        return [
            self._deliver(req, [token], finished.get(req.request_id), [lp] if req.sampling.logprobs else [])
            for req, (token, lp) in zip(reqs, picks, strict=True)
        ]

    def _unblock(self) -> list[TokenDelta]:
        """Nothing could run although requests wait: the first in line cannot get its blocks
        even with everything else evicted (a tiny pool). End it with what it has (``length``)
        rather than wait forever."""
        if self.scheduler.running or not len(self.scheduler.waiting):
            return []
        head = next(iter(self.scheduler.waiting))
        self.scheduler.finish(head, FinishReason.LENGTH)
        return [self._deliver(head, [], FinishReason.LENGTH)]

    def stream(self, request_id: str) -> Iterator[TokenDelta]:
        """Yield ``request_id``'s deltas as they are produced, stepping the engine as needed.
        Raises KeyError at once for an id that is not live and buffered."""
        if request_id not in self._buffered:
            raise KeyError(f"unknown or unbuffered request id {request_id!r}")
        return self._stream(request_id)

    def _stream(self, request_id: str) -> Iterator[TokenDelta]:
        while True:
            for delta in self._take(request_id):
                yield delta
                if delta.finished:
                    return
            self.step()

    def drain(self, request_id: str) -> list[TokenDelta]:
        """Deltas buffered for ``request_id`` since the last call (does not step)."""
        return self._take(request_id)

    def generate(
        self, prompts: Sequence[Sequence[int] | Messages | str], sampling: SamplingParams = SamplingParams()
    ) -> list[Request]:
        """Run prompts to completion (offline batch); returns the finished requests in order."""
        rids = [self.submit(p, sampling) for p in prompts]
        reqs = [self.scheduler.requests[r] for r in rids]
        while self.has_unfinished:
            self.step()
        for rid in rids:
            self._take(rid)
        return reqs

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting),
            blocks_total=self.pool.num_blocks - 1,
            blocks_used=self.pool.num_used,
            blocks_free=self.pool.num_free,
            prompt_tokens=s.num_prompt_tokens_admitted,
            cache_hit_tokens=s.num_cached_tokens_admitted,
            cached_tokens=self.index.num_cached_tokens,
            preemptions=s.num_preemptions,
            steps=self.num_steps,
        )

    # --- internals -------------------------------------------------------------------------

    def _tokenize(self, prompt: Sequence[int] | Messages | str) -> list[int]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], Mapping)):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: submit token ids")
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            return self.tokenizer.encode_chat(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.runner.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        return ids

    def _deliver(
        self, req: Request, tokens: list[int], reason: FinishReason | None, logprobs: list[float] = ()
    ) -> TokenDelta:
        """Turn new tokens into a delta; a stop string found here finishes the request.
        A stop token (reason STOP from the scheduler) is delivered as a token, not as text."""
        detok = self._detok.get(req.request_id)
        text = ""
        if detok is not None:
            text = detok.push(tokens[:-1] if reason == FinishReason.STOP else tokens)
            if detok.stopped and reason is None:
                self.scheduler.finish(req, FinishReason.STOP)
                reason = FinishReason.STOP
            if reason is not None:
                text += detok.flush()
        if reason is not None:
            req.finish_time = time.perf_counter()
        delta = TokenDelta(req.request_id, tokens, text, list(logprobs), reason)
        if req.request_id in self._buffered:
            self._pending[req.request_id].append(delta)
        elif reason is not None:
            self._forget(req.request_id)
        return delta

    def _take(self, request_id: str) -> list[TokenDelta]:
        deltas = self._pending.pop(request_id, [])
        if deltas and deltas[-1].finished:
            self._forget(request_id)
        return deltas

    def _forget(self, request_id: str) -> None:
        """The request is over and fully delivered: drop its per-request state."""
        self._live.discard(request_id)
        self._buffered.discard(request_id)
        self._detok.pop(request_id, None)
        self.sampler.forget(request_id)


def _make_index(kind: str, pool: BlockPool) -> PrefixCache:
    """``kind`` was validated by EngineConfig."""
    return RadixTree(pool) if kind == "radix" else HashedBlockIndex(pool)
