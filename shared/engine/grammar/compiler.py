"""GrammarSpec -> xgrammar CompiledGrammar for one model: cached, and compiled in worker processes.

Compilation precomputes token masks over the whole vocabulary (tens of ms for a skill plan,
seconds for a large schema, minutes for a pathological one), so the engine asks with
`compile_async` and keeps stepping other requests until the future is done; the compile runs
in a `CompilePool` process with a time limit, so no compile waits behind a runaway one.
`validate` is the cheap synchronous check (it only converts the spec to a grammar, no token
masks), for rejecting a bad request at admission.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import tokenizers
import xgrammar as xgr

from shared.engine.grammar.build import parse_grammar
from shared.engine.grammar.compile_pool import CompilePool
from shared.engine.grammar.repeat_guard import StepRepeatGuard, TokenBytes
from shared.engine.grammar.response_format import GrammarSpec
from shared.model.tokenizer import Tokenizer


@dataclass
class CompileStats:
    """Counters since construction. A `join` is a request for a spec that was already compiling."""

    compiles: int = 0
    cache_hits: int = 0
    joins: int = 0
    failures: int = 0
    compile_seconds: float = 0.0


class GrammarCompiler:
    """Compiles GrammarSpecs for one model's tokenizer; thread-safe.

    JSON is constrained to one line with `", "` / `": "` separators, as the fleet prompts write
    it (free whitespace lets a small model emit newlines until max_tokens), and to xgrammar's
    strict mode: no properties or items beyond those the schema lists.

    Compiled grammars are kept in an LRU of `max_cached` entries keyed by (tokenizer
    fingerprint, spec). `workers` processes compile (``compile_pool``), one grammar each at a
    time, each compile killed past `timeout_s` (its future raises ``CompileTimeout``, a
    ValueError); `compile_threads` are xgrammar's own threads for building one grammar's masks.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None, *, max_cached: int = 128,
                 compile_threads: int = 8, workers: int = 2, timeout_s: float = 60.0) -> None:
        if max_cached < 1:
            raise ValueError(f"max_cached must be >= 1, got {max_cached}")
        self.tokenizer_info = tokenizer_info(tokenizer, vocab_size)
        self.vocab_size: int = self.tokenizer_info.vocab_size  # the model's: width of logits and masks
        self.fingerprint = hashlib.sha256(self.tokenizer_info.serialize_json().encode()).hexdigest()[:16]
        self.stats = CompileStats()
        self._max_cached = max_cached
        self._pool = CompilePool(self.tokenizer_info, workers, timeout_s, compile_threads)
        self._cache: OrderedDict[tuple[str, GrammarSpec], xgr.CompiledGrammar] = OrderedDict()
        self._inflight: dict[tuple[str, GrammarSpec], Future[xgr.CompiledGrammar]] = {}
        self._lock = threading.Lock()
        self._token_bytes: Future[TokenBytes] | None = None  # the vocabulary as bytes, for repeat guards
        # one waiting thread per compile process, and one more for the vocabulary's bytes
        self._worker = ThreadPoolExecutor(max_workers=workers + 1, thread_name_prefix="grammar-compile")

    def validate(self, spec: GrammarSpec) -> None:
        """Raise ValueError naming the problem if xgrammar rejects `spec`; cheap (no token masks:
        about a millisecond a kilobyte) and free for a spec compiled or compiling already."""
        key = (self.fingerprint, spec)
        with self._lock:
            if key in self._cache or key in self._inflight:
                return
        parse_grammar(spec)

    def compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """The compiled grammar of `spec`, waiting for it; ValueError if xgrammar rejects the spec."""
        return self.compile_async(spec).result()

    def compile_async(self, spec: GrammarSpec) -> Future[xgr.CompiledGrammar]:
        """A future of the compiled grammar; never blocks on compilation.

        A cached spec gets an already-done future; a spec being compiled gets the same future as
        the first request. The future raises ValueError if xgrammar rejects the spec; failures
        are not cached.
        """
        if spec.repeatable is not None:  # its repeat guard's vocabulary goes first
            self._vocabulary_bytes()
        key = (self.fingerprint, spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                done: Future[xgr.CompiledGrammar] = Future()
                done.set_result(compiled)
                return done
            future = self._inflight.get(key)
            if future is not None:
                self.stats.joins += 1
                return future
            # NOTE: submitted under the lock, so the worker cannot finish before _inflight holds it.
            future = self._worker.submit(self._compile_now, key)
            self._inflight[key] = future
            return future

    def precompile(self, specs: Iterable[GrammarSpec]) -> list[Future[xgr.CompiledGrammar]]:
        """Queue `specs` for compilation (e.g. the fleet's plan schemas at startup)."""
        return [self.compile_async(spec) for spec in specs]

    def repeat_guard(self, spec: GrammarSpec) -> StepRepeatGuard | None:
        """The no-repeated-step guard of a skills plan's spec (None for any other spec); never
        blocks (the vocabulary it reads is built on the compile thread)."""
        return None if spec.repeatable is None else StepRepeatGuard(self._vocabulary_bytes(), spec.repeatable)

    def _vocabulary_bytes(self) -> Future[TokenBytes]:
        """The vocabulary indexed as bytes (0.6 s), built once on a compile thread (queued ahead
        of the first plan grammar)."""
        with self._lock:
            if self._token_bytes is None:
                self._token_bytes = self._worker.submit(
                    lambda: TokenBytes([bytes(t) for t in self.tokenizer_info.decoded_vocab]))
            return self._token_bytes

    def cached(self) -> int:
        """Number of compiled grammars held."""
        with self._lock:
            return len(self._cache)

    def close(self) -> None:
        """Stop the workers; queued compilations are cancelled, running ones fail (ValueError)."""
        self._worker.shutdown(wait=False, cancel_futures=True)
        self._pool.close()

    def _compile_now(self, key: tuple[str, GrammarSpec]) -> xgr.CompiledGrammar:
        _, spec = key
        start = time.perf_counter()
        try:
            compiled = self._pool.compile(spec)
        except BaseException:
            with self._lock:
                self.stats.failures += 1
                del self._inflight[key]
            raise
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_seconds += time.perf_counter() - start
            self._cache[key] = compiled
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
            del self._inflight[key]
        return compiled


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int | None = None) -> xgr.TokenizerInfo:
    """xgrammar's view of `tokenizer`: token bytes by id, vocab type, stop ids, mask width.

    `vocab_size` is the model's (the logits' width; default the tokenizer's). Ids the tokenizer
    lacks and special added tokens (`<|im_start|>`) get an empty string, which xgrammar never
    allows inside a grammar: spelled out they would match literal text that the detokenizer
    drops. NOTE: `TokenizerInfo.from_huggingface` does not do that -- with it the grammar lets
    `<|im_start|>` appear inside a JSON string. The stop tokens are `tokenizer.eos_token_ids`;
    the matcher ends after accepting one.
    """
    backend = tokenizer.backend
    size = vocab_size or tokenizer.vocab_size
    encoded = [""] * size
    for token, index in backend.get_vocab(with_added_tokens=True).items():
        if index < size:
            encoded[index] = token
    for index, added in backend.get_added_tokens_decoder().items():
        if added.special and index < size:
            encoded[index] = ""
    vocab_type = vocab_type_of(backend)
    return xgr.TokenizerInfo(encoded, vocab_type, vocab_size=size,
                             stop_token_ids=sorted(i for i in tokenizer.eos_token_ids if i < size),
                             add_prefix_space=_adds_prefix_space(backend, vocab_type))


def vocab_type_of(backend: tokenizers.Tokenizer) -> xgr.VocabType:
    """How vocabulary strings spell bytes, read from the backend's decoder.

    A ByteLevel decoder means GPT-2 byte-to-unicode spelling (`Ġ` for a space); a ByteFallback
    one means sentencepiece pieces with `<0xNN>` byte tokens; anything else is taken as raw.
    """
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    if "ByteLevel" in kinds:
        return xgr.VocabType.BYTE_LEVEL
    if "ByteFallback" in kinds:
        return xgr.VocabType.BYTE_FALLBACK
    return xgr.VocabType.RAW


def _adds_prefix_space(backend: tokenizers.Tokenizer, vocab_type: xgr.VocabType) -> bool:
    """Whether encoding prepends a space, observed as xgrammar does: the first token of "a"."""
    tokens = backend.encode("a", add_special_tokens=False).tokens
    space = "\u2581" if vocab_type == xgr.VocabType.BYTE_FALLBACK else "\u0120"
    return bool(tokens) and tokens[0].startswith(space)
