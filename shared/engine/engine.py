"""The in-process engine API both daemons drive: submit, step, stream deltas, abort, stats.

Single-threaded by contract: one owner calls ``submit``/``step``/``abort``. ``stream`` drives
``step`` itself until its request finishes, buffering other requests' deltas for their own
``stream`` or ``drain`` calls, so a simple caller needs no loop of its own.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


from shared.engine.delivery import Delivery, TokenDelta
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.engine_config import EngineConfig
from shared.engine.grammar.compiler import GrammarCompiler
from shared.engine.grammar.matcher import MaskBatch
from shared.engine.grammar.response_format import GrammarSpec, grammar_spec
from shared.config import kernel_choice_file
from shared.engine.kernel_choice import ChoiceCache, KernelSpec
from shared.engine.kernel_timing import choose_plan
from shared.engine.kv.block_pool import BlockPool
from shared.engine.kv.disk_tier import DiskTier
from shared.engine.kv.hashed import HashedBlockIndex
from shared.engine.kv.hicache import HiCache, LoadTicket, TierCopyError
from shared.engine.kv.manager import KVCacheManager
from shared.engine.kv.prefix_cache import PrefixCache
from shared.engine.kv.radix import RadixTree
from shared.engine.kv.tier_stats import TierStats
from shared.engine.jump_forward import forced_draft
from shared.engine.policy import FCFS, SchedulingPolicy
from shared.engine.request import FinishReason, Request
from shared.engine.request_budget import RequestBudget
from shared.engine.runner import ModelRunner
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams
from shared.engine.sampling_step import Pick, SamplingStep
from shared.engine.scheduler import Scheduler
from shared.engine.scheduler_output import SchedulerOutput
from shared.engine.sampled_rows import SampledRows
from shared.engine.step_profile import StepProfile, timed_phase
from shared.model.fingerprint import weights_fingerprint
from shared.model.llama import LlamaModel
from shared.model.tokenizer import Tokenizer
from shared.model.weight_cache import load_model
from shared.protocol.messages import Priority

Messages = Sequence[Mapping[str, str]]
# A text prompt longer than this many characters per token of max_model_len cannot fit whatever
# the tokenizer: it is refused before tokenizing (which would hold the engine's thread).
MAX_CHARS_PER_TOKEN = 32
log = logging.getLogger(__name__)


class DeadlineUnmeetable(ValueError):
    """The request's deadline is sooner than its estimated first token: rejected at submit."""


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt tokenized and its ``response_format`` checked (``Engine.prepare``): ``submit``
    takes it in place of the prompt and does neither again."""

    token_ids: list[int]
    spec: GrammarSpec | None


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int  # queued, including those awaiting their grammar
    blocks_total: int
    blocks_used: int
    blocks_free: int
    prompt_tokens: int  # prompt tokens of admitted requests (recounted after a preemption)
    cache_hit_tokens: int  # of those, tokens reused from the prefix cache
    cached_tokens: int  # tokens the prefix index holds now
    preemptions: int
    deadline_misses: int  # requests ended by their deadline (waiting or running)
    steps: int
    seconds_per_token: float  # measured step cost: per computed token ...
    seconds_per_step: float  # ... plus per step (deadline admission and the tier cost model use it)
    awaiting_grammar: int = 0  # requests whose grammar is compiling
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_s: float = 0.0
    mask_s: float = 0.0  # filling and applying grammar masks, all steps
    forced_tokens: int = 0  # output tokens from jump-forward drafts: decode steps saved
    tier_loading: int = 0  # requests waiting for their prefix to load from the KV tiers
    tiers: TierStats | None = None  # HiCache counters, when the tiers are on
    dtype: str = "float32"  # what the model, activations and KV compute in
    compiled: bool = False  # the layers' dense halves run compiled (EngineConfig.compile)
    kernels: str = "torch"  # what a step runs on: "torch" | "triton" (EngineConfig.kernels resolved)
    cuda_graphs: bool = False  # decode-only steps replay CUDA graphs
    kv_layout: str = "tokens"  # the KV pools' layout (EngineConfig.kv_layout resolved)
    # the CPU operations' implementations and how each was settled (KernelPlan.as_dict; empty
    # off the CPU torch backend)
    kernel_plan: dict = field(default_factory=dict)

    @property
    def prefix_hit_rate(self) -> float:
        return self.cache_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _compile_layers(model: LlamaModel) -> float | None:
    """``model.compile_layers()``'s seconds, or None (logged) where it cannot compile here: the
    engine then runs its layers eager, as it would with ``compile`` off."""
    try:
        return model.compile_layers()
    except Exception as e:  # inductor needs a C++ compiler (or Triton on a GPU): eager still serves
        log.warning("compiling the layers failed, running them eager: %s: %s", type(e).__name__, e)
        return None


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer | None,
        config: EngineConfig = EngineConfig(),
        policy: SchedulingPolicy | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        """``clock`` times everything (arrivals, deadlines, ageing, step rates); tests pass a
        fake one. ``model`` is moved to ``config.device`` in place (``nn.Module.to``)."""
        self.config = config
        self.clock = clock
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
        kernels = config.kernel_choice
        self.runner = ModelRunner(model.to(config.device), config.num_blocks, config.block_size, kernels=kernels,
                                  cuda_graphs=config.uses_cuda_graphs, max_decode_rows=config.scheduler.max_num_seqs,
                                  max_model_len=max_len, kv_layout=config.kv_layout)
        # NOTE: compiled here, at start-up, so that no request waits on the compiler. The Triton
        # layers are fused kernels already: nothing for inductor to fuse.
        if config.compile and kernels == "triton":
            log.info("compile ignored: the Triton kernels fuse the layers' small ops")
        self.runner.apply_plan(choose_plan(self.runner, KernelSpec.parse(config.kernels), config.time_kernels,
                                           ChoiceCache(kernel_choice_file())))
        if self.runner.kernel_plan.chosen:
            log.info("kernels: %s", self.runner.kernel_plan.describe())
        self.compile_seconds = _compile_layers(model) if config.compile and kernels == "torch" else None
        self.tiers = _make_tiers(config, self.pool, self.runner, lambda n: self.scheduler.rate.seconds_for(
            n, self.scheduler.config.max_num_batched_tokens))
        self.scheduler = Scheduler(
            dataclasses.replace(config.scheduler, max_model_len=max_len),
            KVCacheManager(self.pool, self.index, self.tiers),
            policy or FCFS(),
            eos,
            clock,
        )
        self.sampler = Sampler()
        self.sampling = SamplingStep(self.sampler, MaskBatch(model.config.vocab_size), self.scheduler)
        self.delivery = Delivery(self.scheduler, clock, self.sampler.forget)
        self.budget = RequestBudget(config.request_step_budget_s)  # each request's own work per step
        self._grammar: GrammarCompiler | None = None  # built on first use (0.2 s)
        self._grammar_lock = threading.Lock()  # prepare() may build it on a daemon's preparing thread
        self._seq = itertools.count()
        self.num_steps = 0
        self.profile: StepProfile | None = None

    @classmethod
    def from_checkpoint(cls, path: Path | str, config: EngineConfig = EngineConfig(), cache: bool = True) -> "Engine":
        """The engine over the model at ``path``; a GGUF's converted weights cached unless not
        ``cache`` (``shared.model.weight_cache.load_model``)."""
        model, ckpt = load_model(path, config.torch_dtype, cache=cache)
        return cls(model, ckpt.tokenizer, config)

    # --- requests -----------------------------------------------------------------------------

    def prepare(self, prompt: Sequence[int] | Messages | str, response_format: Mapping | None = None) -> PreparedPrompt:
        """Tokenize ``prompt`` and check ``response_format``; ValueError naming the problem (a
        bad format, an over-long text, token ids outside the vocabulary). Safe on any thread: it
        reads only the tokenizer, the model's config and the grammar compiler (which locks), so a
        daemon runs it beside the engine's thread and a long prompt never holds the steps."""
        spec = grammar_spec(response_format) if response_format is not None else None
        if spec is not None:
            self.grammar_compiler.validate(spec)
        return PreparedPrompt(self._tokenize(prompt), spec)

    def submit(
        self,
        prompt: Sequence[int] | Messages | str | PreparedPrompt,
        sampling: SamplingParams = SamplingParams(),
        request_id: str | None = None,
        buffered: bool = True,
        priority: Priority = Priority.PLAN,
        robot_id: str = "",
        deadline_s: float | None = None,
        response_format: Mapping | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> str:
        """Queue a request: token ids, a plain string, chat messages (rendered with the model's
        chat template), or what ``prepare`` made of one (``response_format`` is then ignored:
        the prepared one holds). Raises ValueError for an empty or over-long prompt, an id in
        use, or text without a tokenizer, and ``DeadlineUnmeetable`` when ``deadline_s``
        (seconds from now by which it must finish) is sooner than the estimated first token
        given the work queued ahead of it. A request that starts in time but does not finish
        is stopped at its deadline with what it has (finish reason ``deadline``).

        ``priority`` and ``robot_id`` feed the scheduling policy (classes, fairness).
        ``response_format`` (json_schema | json_object | regex | ebnf | skills, as in the protocol)
        constrains every sampled token; a bad one raises ValueError naming the problem. Its
        grammar compiles on a worker (cached by spec) while the request waits in
        ``WAITING_FOR_GRAMMAR``; the step loop never blocks on it.
        ``buffered`` keeps the request's deltas for ``stream``/``drain``; a caller that consumes
        what ``step`` returns (a daemon's loop) passes False, and nothing is kept.

        ``resume_token_ids``: output an earlier execution of this request already delivered (a
        cluster front resuming a request whose replica died): the request starts as a preempted
        one would, with them as its output (computed again with the prompt, counted against
        ``max_tokens``, accepted by its grammar before it samples); its deltas carry only the
        tokens and text that follow them. One whose resumed output already ended it (a stop
        token, ``max_tokens``) ends at the next step without computing anything."""
        rid = request_id if request_id is not None else f"req-{next(self._seq)}"
        if rid in self.delivery.live:
            raise ValueError(f"request id {rid!r} is already in use")
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        prepared = prompt if isinstance(prompt, PreparedPrompt) else self.prepare(prompt, response_format)
        if resume_token_ids:
            self._tokenize(list(resume_token_ids))  # ValueError for ids outside the vocabulary
        spec = prepared.spec
        now = self.clock()
        req = Request(
            request_id=rid,
            prompt_token_ids=prepared.token_ids,
            sampling=sampling,
            arrival_seq=next(self._seq),
            arrival_time=now,
            priority=priority,
            robot_id=robot_id,
            deadline=None if deadline_s is None else now + deadline_s,
            output_token_ids=list(resume_token_ids),
            output_logprobs=[math.nan] * len(resume_token_ids) if sampling.logprobs else [],
        )
        if deadline_s is not None:
            eta = self.scheduler.first_token_eta(req)
            if eta > deadline_s:
                raise DeadlineUnmeetable(
                    f"deadline in {deadline_s * 1000:.0f} ms, but the first token is estimated in "
                    f"{eta * 1000:.0f} ms behind the queued work"
                )
        if spec is not None:  # NOTE: only once admissible: a refused request's would take the compile thread
            self.scheduler.check_admissible(req)
            req.grammar_pending = self.grammar_compiler.compile_async(spec)
            req.repeat_guard = self.grammar_compiler.repeat_guard(spec)
        self.scheduler.add(req)
        detok = IncrementalDetokenizer(self.tokenizer, sampling.stop) if self.tokenizer is not None else None
        if detok is not None:
            detok.push(resume_token_ids)  # their text was delivered by the earlier execution
        self.delivery.open(rid, detok, buffered)
        return rid

    def abort(self, request_id: str) -> TokenDelta | None:
        """Stop a request and free its KV; returns its last delta (finish reason ``abort``,
        also queued for ``stream``/``drain`` when buffered), or None if it had already finished
        or never existed."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        self.scheduler.finish(req, FinishReason.ABORT)
        return self.delivery.deliver(req, [], FinishReason.ABORT)

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # --- stepping -------------------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        """Schedule, run the model once, sample, update the requests, deliver. Returns this
        step's deltas (buffered requests' deltas are also kept for ``stream``/``drain``).

        A failure serving one request (its grammar's mask or next state, its sampling, its
        drafts, its detokenizing) ends that request alone with finish reason ``error``, the
        exception logged, and so does its grammar's and detokenizer's work in this step past
        ``config.request_step_budget_s`` (its delta's ``detail`` names the budget); a forward
        pass that raises ends the requests of its step the same way and leaves the queue to the
        next step. Only a failure in the scheduler itself raises."""
        deltas, out = self._schedule()
        if out.is_empty:
            return deltas + self._idle(out)
        batch = SampledRows.of(out, self.scheduler.requests)
        started = self.clock()
        try:  # NOTE: an all-greedy step never builds its logits (kernels.greedy_head)
            result = self.runner.execute_greedy(out) if batch.greedy else self.runner.execute(out)
        except Exception:
            log.exception("the forward pass failed: ending the %d requests of its step", len(out.chunks))
            return deltas + self._fail_step(out)
        picks = self.sampling.pick(result, batch)
        finished = self._update(batch, picks, started)
        deltas += self.delivery.deliver_step(batch, finished)
        deltas += self.delivery.end_overruns(batch, self.budget)
        if self.profile is not None:
            self.profile.steps += 1
        return deltas

    @timed_phase("schedule")
    def _schedule(self) -> tuple[list[TokenDelta], SchedulerOutput]:
        """Collect finished tier loads, end the expired requests and admit the compiled ones,
        then schedule the step: the deltas of the requests that ended (one whose grammar failed
        to compile, e.g. past its time limit, with the compiler's reason as ``detail``), and
        the step's work."""
        self.scheduler.admit_loaded()
        failed = {r.request_id: str(r.grammar_pending.exception()) for r in self.scheduler.awaiting_grammar
                  if r.grammar_pending.done() and r.grammar_pending.exception() is not None}
        ended = self.scheduler.expire() + self.scheduler.admit_compiled()
        deltas = [self.delivery.deliver(f.request, [], f.reason, detail=failed.get(f.request.request_id))
                  for f in ended]
        return deltas, self.scheduler.schedule()

    @timed_phase("update")
    def _update(self, batch: SampledRows, picks: list[list[Pick] | None], started: float) -> dict[str, FinishReason]:
        """Count the step (its cost into the service rate), hand the picks to the scheduler
        (which appends them and ends requests by their stop rules), then draft the jump-forward
        tokens of those that go on. Returns why each request of ``batch`` that ended now ended:
        a stop rule, or ``error`` (its picking or drafting failed)."""
        now = self.clock()
        self.scheduler.rate.observe(batch.out.num_tokens, now - started)
        for req in batch.requests:
            if req.first_token_time is None:
                req.first_token_time = now
        sampled = {r.request_id: p for r, p in zip(batch.requests, picks, strict=True) if p is not None}
        finished = {f.request.request_id: f.reason for f in self.scheduler.update(batch.out, sampled)}
        finished.update((r.request_id, FinishReason.ERROR) for r in batch.requests if r.request_id not in sampled)
        self.num_steps += 1
        if self.config.jump_forward and self.tokenizer is not None:
            for req in batch.requests:
                if req.request_id not in finished:
                    try:
                        req.draft_token_ids = forced_draft(req, self.tokenizer, self.scheduler.config.max_model_len)
                    except Exception:
                        finished[req.request_id] = self.scheduler.fail(req)
        return finished

    def _idle(self, out: SchedulerOutput) -> list[TokenDelta]:
        """A step with nothing to compute: wait briefly for a tier load or a grammar, else
        unblock a queue that can never run."""
        if not out.preempted and not self.scheduler.running and self._tiers_busy:
            # nothing to compute meanwhile; a load (or a backup holding blocks) will finish
            self.scheduler.admit_loaded(timeout=0.005)
            return []
        if not out.preempted and not self.scheduler.running and self.scheduler.awaiting_grammar:
            pending = [r.grammar_pending for r in self.scheduler.awaiting_grammar]
            concurrent.futures.wait(pending, timeout=0.005, return_when=concurrent.futures.FIRST_COMPLETED)
            return []
        return [] if out.preempted else self._unblock()

    def warm_up(self) -> float:
        """Do the first-use work a daemon's first request would otherwise wait for: compile the
        tokenizer's chat template and run one forward of a full step's tokens (``ModelRunner.
        warm_up``). Changes no request, cache or counter. Returns the seconds it took."""
        started = time.perf_counter()
        if self.tokenizer is not None and self.tokenizer.chat_template:
            self.tokenizer.encode_chat([{"role": "user", "content": "warm-up"}])
        self.runner.warm_up(min(self.scheduler.config.max_num_batched_tokens, self.scheduler.config.max_model_len))
        return time.perf_counter() - started

    def enable_profile(self) -> StepProfile:
        """Time every later step's phases and count the model's FLOPs (see ``step_profile``)."""
        self.profile = self.runner.profile = self.sampling.profile = self.delivery.profile = StepProfile()
        return self.profile

    def _fail_step(self, out: SchedulerOutput) -> list[TokenDelta]:
        """End every request of a step whose forward pass failed (``error``)."""
        reqs = [self.scheduler.requests[rid] for rid in dict.fromkeys(c.request_id for c in out.chunks)]
        for req in reqs:
            self.scheduler.finish(req, FinishReason.ERROR)
        return [self.delivery.deliver(req, [], FinishReason.ERROR) for req in reqs]

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """The model's grammar compiler (built on first use, by whichever thread asks first);
        needs a tokenizer."""
        with self._grammar_lock:
            if self._grammar is None:
                if self.tokenizer is None:
                    raise ValueError("response_format needs a tokenizer: this engine has none")
                self._grammar = GrammarCompiler(self.tokenizer, self.runner.model.config.vocab_size,
                                                workers=self.config.grammar_compile_workers,
                                                timeout_s=self.config.grammar_compile_timeout_s)
            return self._grammar

    def precompile(self, response_formats: Iterable[Mapping]) -> list[concurrent.futures.Future]:
        """Compile these response formats now (a daemon's configured schemas, at start-up)."""
        specs = [grammar_spec(rf) for rf in response_formats]
        return self.grammar_compiler.precompile(s for s in specs if s is not None)

    def _unblock(self) -> list[TokenDelta]:
        """Nothing could run although requests wait: the first in line cannot get its blocks
        even with everything else evicted (a tiny pool). End it with what it has (``length``)
        rather than wait forever. Never while the tiers hold blocks it could get by waiting."""
        if self.scheduler.running or self._tiers_busy or not self.scheduler.waiting:
            return []
        if any(r.cache.tier_handle is not None for r in self.scheduler.waiting):
            for r in self.scheduler.waiting:  # their loaded prefixes stay in the tiers
                self.scheduler.kv.release_waiting(r)
            return []  # the next step schedules with those blocks evictable
        now = self.clock()
        head = min(self.scheduler.waiting, key=lambda r: self.scheduler.policy.key(r, now))
        self.scheduler.finish(head, FinishReason.LENGTH)
        return [self.delivery.deliver(head, [], FinishReason.LENGTH)]

    @property
    def _tiers_busy(self) -> bool:
        """Tier loads are in flight, or copies that may hold device blocks are queued."""
        return bool(self.scheduler.loading) or (self.tiers is not None and self.tiers.copier.pending > 0)

    def stream(self, request_id: str) -> Iterator[TokenDelta]:
        """Yield ``request_id``'s deltas as they are produced, stepping the engine as needed.
        Raises KeyError at once for an id that is not live and buffered."""
        if request_id not in self.delivery.buffered:
            raise KeyError(f"unknown or unbuffered request id {request_id!r}")
        return self._stream(request_id)

    def _stream(self, request_id: str) -> Iterator[TokenDelta]:
        while True:
            for delta in self.delivery.take(request_id):
                yield delta
                if delta.finished:
                    return
            self.step()

    def drain(self, request_id: str) -> list[TokenDelta]:
        """Deltas buffered for ``request_id`` since the last call (does not step)."""
        return self.delivery.take(request_id)

    def generate(
        self, prompts: Sequence[Sequence[int] | Messages | str], sampling: SamplingParams = SamplingParams()
    ) -> list[Request]:
        """Run prompts to completion (offline batch); returns the finished requests in order."""
        rids = [self.submit(p, sampling) for p in prompts]
        reqs = [self.scheduler.requests[r] for r in rids]
        while self.has_unfinished:
            self.step()
        for rid in rids:
            self.delivery.take(rid)
        return reqs

    def settle_tiers(self) -> list[LoadTicket]:
        """Wait for every queued tier copy and release each load that finished as a step does
        (``Scheduler.admit_loaded``: its block refs and index locks; a whole load's request
        back in the queue); returns those loads. ``generate`` returns as soon as its requests
        end, when a layer-by-layer load they read may not be collected yet (its blocks still
        held until the next step): call this before checking the pool's refs or shutting down."""
        finished = []
        while self.tiers is not None and self.tiers.copier.pending:
            finished += self.scheduler.admit_loaded(timeout=1.0)
        return finished

    def close(self) -> None:
        """Stop the grammar compile workers and the tier copier (after its queued copies, the
        finished loads released) and free the host tier."""
        if self._grammar is not None:
            self._grammar.close()
        if self.tiers is not None:
            try:
                self.settle_tiers()
            except TierCopyError as e:  # its requests ended already: nothing is left to fail
                log.warning("a tier load failed at shutdown: %s", e)
            self.tiers.copier.close()
            self.tiers = self.scheduler.kv.tiers = None

    def stats(self) -> EngineStats:
        s = self.scheduler
        g = self._grammar.stats if self._grammar is not None else None
        return EngineStats(
            running=len(s.running),
            waiting=len(s.waiting) + len(s.awaiting_grammar),
            blocks_total=self.pool.num_blocks - 1,
            blocks_used=self.pool.num_used,
            blocks_free=self.pool.num_free,
            prompt_tokens=s.num_prompt_tokens_admitted,
            cache_hit_tokens=s.num_cached_tokens_admitted,
            cached_tokens=self.index.num_cached_tokens,
            preemptions=s.num_preemptions,
            deadline_misses=s.num_deadline_misses,
            steps=self.num_steps,
            seconds_per_token=s.rate.seconds_per_token,
            seconds_per_step=s.rate.seconds_per_step,
            awaiting_grammar=len(s.awaiting_grammar),
            grammar_compiles=g.compiles if g else 0,
            grammar_cache_hits=g.cache_hits if g else 0,
            grammar_compile_s=g.compile_seconds if g else 0.0,
            mask_s=self.sampling.masks.stats.fill_seconds + self.sampling.masks.stats.apply_seconds,
            forced_tokens=s.num_forced_tokens,
            tier_loading=len(s.loading),
            tiers=dataclasses.replace(self.tiers.snapshot()) if self.tiers is not None else None,
            dtype=str(self.runner.dtype).removeprefix("torch."),
            compiled=self.compile_seconds is not None,
            kernels=self.runner.kernels,
            cuda_graphs=self.runner.graphs is not None,
            kv_layout=self.runner.kv_layout,
            kernel_plan=self.runner.kernel_plan.as_dict() if self.runner.kernel_plan.chosen else {},
        )

    # --- internals -------------------------------------------------------------------------

    def _tokenize(self, prompt: Sequence[int] | Messages | str) -> list[int]:
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], Mapping)):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: submit token ids")
            chars = len(prompt) if isinstance(prompt, str) else sum(len(str(m.get("content", ""))) for m in prompt)
            limit = MAX_CHARS_PER_TOKEN * self.scheduler.config.max_model_len
            if chars > limit:  # refused before tokenizing it would hold the engine's thread
                raise ValueError(f"prompt of {chars} characters cannot fit max_model_len "
                                 f"{self.scheduler.config.max_model_len} tokens")
            if isinstance(prompt, str):
                return self.tokenizer.encode(prompt)
            return self.tokenizer.encode_chat(prompt)
        ids = [int(t) for t in prompt]
        vocab = self.runner.model.config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be in [0, {vocab})")
        return ids


def _make_tiers(config: EngineConfig, pool: BlockPool, runner: ModelRunner,
                recompute_seconds: Callable[[int], float]) -> HiCache | None:
    """The host (and disk) tiers of ``config.hicache``, or None when they are off."""
    from shared.engine.kv.tier_copier import TierCopier, page_bytes

    hc = config.hicache
    if not hc.enabled:
        return None
    size = page_bytes(runner.kv_caches)
    num_host_pages = int(hc.host_pool_mb * 2**20) // size
    if num_host_pages < 1:
        raise ValueError(f"[hicache] host_pool_mb {hc.host_pool_mb} holds no page ({size} bytes each)")
    # whose pages these are: the weights, and each layer's KV dtype and block shape (not the pool's size)
    namespace = repr((weights_fingerprint(runner.model), [(str(k.dtype), tuple(k.shape[1:])) for k, _ in runner.kv_caches]))
    max_pages = max(1, int(hc.disk_max_mb * 2**20) // size)  # a bound below one page still bounds
    disk = DiskTier(hc.disk_dir, max_pages, namespace.encode()) if hc.disk_dir else None
    copier = TierCopier(runner.kv_caches, num_host_pages, disk)
    return HiCache(hc, pool, copier, num_host_pages, disk, recompute_seconds,
                   layerwise=hc.layerwise_for(on_gpu=runner.device.type == "cuda"))


def _make_index(kind: str, pool: BlockPool) -> PrefixCache:
    """``kind`` was validated by EngineConfig."""
    return RadixTree(pool) if kind == "radix" else HashedBlockIndex(pool)
