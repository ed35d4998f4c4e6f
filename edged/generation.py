"""Batch-1 generation over one backend's KV buffer: prefix reuse, pinned prompts, resumable jobs.

``Batch1Generator`` owns the buffer and knows which tokens it holds. Before a job runs it
reuses the longest common prefix of what the buffer holds (a robot's replan continues its own
conversation) or of a pinned system prompt's saved K/V, whichever is longer, and prefills only
the rest. Each token is chosen by the engine's sampler under the request's grammar mask; the
job records the model's own log-probability of it (before the mask) for the confidence rule.

With speculation (``edged.speculation``, on by default) each forward after a sampled token
also carries draft tokens: the text the grammar forces next (jump-forward), then what followed
the context's last n-gram earlier in the context or in the robot's recent outputs, as many as
pay for their rows (the generator times its forwards by token count). One forward
returns a logits row per token; the next token is sampled from the first row exactly as plain
decoding would (same mask, same sampler, one draw per token), and while it equals the next
draft, the following row is already computed: the draft's K/V stays and no forward is needed.
A mismatch drops the rest (their K/V is overwritten later). Output is plain decoding's: on the
torch backend and float-activation ONNX graphs (none, int4) to float rounding; ONNX int8 and
int4-a8 graphs quantize activations,
which makes a one-token forward differ from a row of a multi-token one by up to ~1 logit, so
there no token is ever sent alone after position 0 (``forward_tokens``) and the rows agree bit for bit.

A job can be interrupted between tokens (``should_yield``: a more urgent request is waiting)
and resumed later: its prompt plus the tokens it has are prefilled again, mostly from the
buffer or a pinned prompt, and it continues exactly where it stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edged.backends.base import Batch1Backend
from edged.pinned import PinnedKVStore, PinnedPrompt
from edged.speculation import (Confirmations, ForwardCosts, NgramDrafter, SpeculationConfig, SpellingWatch,
                               Spellings, draft_length, recent_outputs, remember)
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.grammar.compiler import GrammarCompiler
from shared.engine.grammar.matcher import GrammarState, MaskBatch
from shared.engine.grammar.response_format import GrammarSpec
from shared.engine.kv.radix import common_prefix_len
from shared.engine.request import FinishReason, stop_reason
from shared.engine.sampler import Sampler
from shared.engine.sampling_params import SamplingParams
from shared.model.tokenizer import Tokenizer

PREFILL_CHUNK = 512  # tokens per forward while prefilling (bounds activation memory)


@dataclass(eq=False)
class LocalJob:
    """One request generated on the robot; mutable progress, owned by the generator's thread."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    spec: GrammarSpec | None = None  # its response_format; compiled into ``grammar`` when it first runs
    grammar: GrammarState | None = None
    deadline: float | None = None  # absolute, on the generator's clock
    generated: list[int] = field(default_factory=list)
    text: str = ""
    raw_logprob_sum: float = 0.0  # the model's own log-probability of each token, unmasked
    finish_reason: FinishReason | None = None
    prefilled_tokens: int = 0  # computed by prefills (all runs of this job)
    reused_tokens: int = 0  # taken from the buffer or a pinned prompt on the first run
    pinned_prompt: str | None = None  # the pinned prompt the first run started from
    first_token_s: float | None = None  # clock time of the first token
    preemptions: int = 0
    drafted_tokens: int = 0  # speculative draft tokens sent with a forward (all runs of this job)
    accepted_drafts: int = 0  # of those, confirmed by sampling (the rest were refused or unused)
    error: str | None = None  # the backend failed; nothing usable was produced

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def mean_logprob(self) -> float | None:
        return self.raw_logprob_sum / len(self.generated) if self.generated else None


class Batch1Generator:
    """Runs ``LocalJob``s one at a time on ``backend``; not thread-safe (one worker thread)."""

    def __init__(self, backend: Batch1Backend, tokenizer: Tokenizer, compiler: GrammarCompiler,
                 pinned_dir: Path | str | None = None, clock: Callable[[], float] = time.monotonic,
                 speculation: SpeculationConfig = SpeculationConfig()):
        self.backend = backend
        self.tokenizer = tokenizer
        self.compiler = compiler
        self.clock = clock
        self.eos_token_ids = tokenizer.eos_token_ids
        self.sampler = Sampler()
        self.masks = MaskBatch(backend.vocab_size)
        self.store = PinnedKVStore(pinned_dir) if pinned_dir is not None else None
        self.pinned: dict[str, PinnedPrompt] = {}
        self.held: list[int] = []  # tokens whose K/V the buffer holds at positions 0..len-1
        self.speculation = speculation
        self.history = recent_outputs(speculation)  # the robot's recent outputs, for drafts
        self.spellings = Spellings()  # how the model spelled forced text, for drafts
        self.forward_costs = ForwardCosts()  # the backend's decode forwards, timed by token count
        self.drafted_tokens = 0  # over finished jobs: drafts verified, and those sampling confirmed
        self.accepted_drafts = 0

    # --- pinned prompts ----------------------------------------------------------------------

    def pin(self, name: str, token_ids: Sequence[int]) -> PinnedPrompt:
        """Make ``token_ids`` a pinned prefix: from the disk cache, else prefilled (and saved)."""
        ids = tuple(token_ids)
        if not ids or len(ids) >= self.backend.max_len:
            raise ValueError(f"pinned prompt {name!r}: {len(ids)} tokens does not fit a buffer of "
                             f"{self.backend.max_len}")
        identity = self.backend.identity()
        snapshot = self.store.load(identity, ids) if self.store else None
        from_disk = snapshot is not None
        if snapshot is None:
            self._forward_from(list(ids), 0)
            snapshot = self.backend.save_kv(len(ids))
            if self.store:
                self.store.save(identity, ids, snapshot)
        prompt = PinnedPrompt(name, ids, snapshot, from_disk)
        self.pinned[name] = prompt
        return prompt

    # --- generation --------------------------------------------------------------------------

    def run(self, job: LocalJob, emit: Callable[[list[int], str], None],
            should_yield: Callable[[], bool] = lambda: False,
            cancelled: Callable[[], bool] = lambda: False) -> bool:
        """Generate until ``job`` finishes (True) or ``should_yield()`` asks to pause it (False).

        ``emit(token_ids, text)`` gets each new token and the text it completes (text may lag
        behind tokens by a few characters; the stop token's text is never emitted).
        """
        if job.spec is not None and job.grammar is None:
            job.grammar = GrammarState(self.compiler.compile(job.spec), self.compiler.repeat_guard(job.spec))
        context = job.prompt_ids + job.generated
        first_run = job.prefilled_tokens == 0 and not job.generated
        reused = self._prepare(context, job if first_run else None)
        rows = [self._forward_from(context[reused:], reused)]  # logits rows not yet sampled from
        job.prefilled_tokens += len(context) - reused
        drafter = NgramDrafter(self.speculation, context, self.history) if self.speculation.enabled else None
        watch = SpellingWatch(self.spellings, self.tokenizer.decode)
        drafts: list[int] = []  # verified by ``rows``: rows[i] follows drafts[i - 1]
        confirmations = Confirmations()
        sent = 0  # drafts the last forward carried
        while True:
            if cancelled():
                return self._end(job, FinishReason.ABORT, emit, watch)
            if job.deadline is not None and self.clock() >= job.deadline:
                return self._end(job, FinishReason.DEADLINE, emit, watch)
            if should_yield():
                job.preemptions += 1
                return False
            token = self._choose(job, rows.pop(0))
            reason = self._stop_reason(job, token)
            emit([token], job.detok.push([token] if reason is not FinishReason.STOP else []))
            if reason is None and job.detok.stopped:
                reason = FinishReason.STOP
            if reason is None and len(self.held) + 1 >= self.backend.max_len:
                reason = FinishReason.LENGTH  # the buffer is full
            if reason is not None:
                return self._end(job, reason, emit, watch)
            if drafter is not None:
                drafter.accept([token])
            if drafts and token == drafts[0]:  # the buffer holds its K/V and rows[0] follows it
                drafts.pop(0)
                job.accepted_drafts += 1
                self.held.append(token)
                continue
            confirmations.verified(sent, confirmed=sent - len(drafts))
            drafts = self._draft(job, drafter, watch, confirmations.p)
            sent = len(drafts)
            began = time.perf_counter()
            rows = list(forward_tokens(self.backend, [token, *drafts], len(self.held),
                                       self.held[-1] if self.held else None, True))
            if drafter is not None:  # the costs only size drafts
                self.forward_costs.record(1 + sent, time.perf_counter() - began)
            self.held.append(token)

    def _draft(self, job: LocalJob, drafter: NgramDrafter | None, watch: SpellingWatch, p: float) -> list[int]:
        """Tokens to verify after the one just sampled: an n-gram lookup, or where the grammar
        forces text next (jump-forward) and the lookup's text does not agree with it, that
        text's tokens -- as the model spelled it before (``Spellings``), else the tokenizer's
        encoding -- and a lookup after them; as many of them as pay for their rows at the
        job's confirmation rate ``p`` (``edged.speculation.draft_length``); [] without
        speculation or room."""
        if drafter is None:
            return []
        watch.observe(job.generated)
        room = min(self.speculation.max_draft, job.params.max_tokens - len(job.generated) - 1,
                   self.backend.max_len - len(self.held) - 2)
        if room <= 0:
            return []
        drafts = drafter.draft(room)
        forced = job.grammar.forced_text() if job.grammar is not None and not job.grammar.finished else ""
        if forced:
            watch.expect(len(job.generated), forced)
        if forced and not _agree(self.tokenizer.decode(drafts), forced):
            # NOTE: the model often spells forced text as it did earlier in the context (its own
            # token boundaries), so the n-gram draft wins whenever its text agrees with it.
            drafts = (self.spellings.get(forced) or self.tokenizer.encode(forced))[:room]
            drafts += drafter.draft(room - len(drafts), after=drafts) if len(drafts) < room else []
        drafts = drafts[:draft_length(len(drafts), p, self.forward_costs)]
        job.drafted_tokens += len(drafts)
        return drafts

    def _prepare(self, context: list[int], job: LocalJob | None) -> int:
        """Load the best reusable prefix for ``context``; returns how many tokens it covers."""
        usable = len(context) - 1  # at least one token is computed, for its logits
        reused = min(common_prefix_len(self.held, context), usable)
        matches = [(min(common_prefix_len(p.token_ids, context), usable), p) for p in self.pinned.values()]
        from_pin, best = max(matches, key=lambda m: m[0], default=(0, None))
        if from_pin > reused:
            self.backend.load_kv(best.snapshot)
            reused = from_pin
        if job is not None:
            job.reused_tokens = reused
            job.pinned_prompt = best.name if best and from_pin == len(best.token_ids) else None
        self.held = context[:reused]
        return reused

    def _forward_from(self, tokens: list[int], start: int) -> torch.Tensor:
        """Prefill ``tokens`` at ``start`` in chunks; the buffer then holds them. Returns the
        last token's logits ``[vocab]``."""
        logits = None
        for i in range(0, len(tokens), PREFILL_CHUNK):
            before = tokens[i - 1] if i else (self.held[start - 1] if start else None)
            logits = forward_tokens(self.backend, tokens[i:i + PREFILL_CHUNK], start + i, before, False)[-1]
        self.held = self.held[:start] + list(tokens)
        return logits

    def _choose(self, job: LocalJob, logits: torch.Tensor) -> int:
        raw = torch.log_softmax(logits, dim=-1)  # the model's own belief, before the mask
        batch = logits[None]  # masked in place: the backend overwrites its logits every forward
        if job.grammar is not None and not job.grammar.finished:
            self.masks.apply(batch, [0], [job.grammar])
        token, _ = self.sampler.sample(batch, [job.request_id], [job.params])[0]
        job.generated.append(token)
        job.raw_logprob_sum += float(raw[token])
        if job.first_token_s is None:
            job.first_token_s = self.clock()
        if job.grammar is not None and not job.grammar.finished:
            job.grammar.accept(token)
        return token

    def _stop_reason(self, job: LocalJob, token: int) -> FinishReason | None:
        grammar_done = job.grammar is not None and job.grammar.finished
        return stop_reason(job.params, token, self.eos_token_ids, grammar_done, len(job.generated))

    def _end(self, job: LocalJob, reason: FinishReason, emit: Callable[[list[int], str], None],
             watch: SpellingWatch) -> bool:
        job.finish_reason = reason
        watch.observe(job.generated)  # the forced texts its last tokens spelled
        rest = job.detok.flush()
        if rest:
            emit([], rest)
        job.text = job.detok.text
        self.sampler.forget(job.request_id)
        if self.speculation.enabled:
            self.history = remember(self.history, job.generated, self.speculation)
            self.drafted_tokens += job.drafted_tokens
            self.accepted_drafts += job.accepted_drafts
        return True


def forward_tokens(backend: Batch1Backend, tokens: Sequence[int], start: int, before: int | None,
                   every_row: bool) -> torch.Tensor:
    """Logits ``[rows, vocab]`` of ``tokens`` placed at ``start`` (every row, or the last).

    On a backend that is not ``row_exact`` a lone token goes with ``before`` (the token at
    ``start - 1``, its K/V recomputed bit for bit): every token's logits then come from the
    backend's multi-row path, whether drafts came with it or not, so that speculation never
    changes a token.
    """
    if len(tokens) == 1 and before is not None and not backend.row_exact:
        return backend.forward_rows([before, tokens[0]], start - 1)[1:]
    if every_row and len(tokens) > 1:
        return backend.forward_rows(tokens, start)
    return backend.forward(tokens, start)[None]


def _agree(drafted: str, forced: str) -> bool:
    """Whether a draft's text is consistent with the text the grammar forces next."""
    return bool(drafted) and (drafted.startswith(forced) or forced.startswith(drafted))
