"""`cloudd agreement`: how far a compute dtype's greedy output strays from float32's on a
trace's plan prompts (by default the first 100 requests of a fleet trace, the robot tasks the
grammar tests run), with the kernels the config forces (``--kernels dense=int8``: int8
products); the float32 reference runs the default ones.

Per request, the greedy continuation of ``tokens`` tokens (EOS ignored) through the engine in
float32 (the reference) and in the compared dtype. Reported:

- ``greedy_exact``: share of requests whose continuations are identical;
- ``greedy_prefix``: mean share of each continuation equal to the reference before the first
  difference (after it, the two read different text, so nothing more compares);
- ``top1``: teacher-forced, the compared dtype reads the reference's prompt and continuation
  in one forward; share of continuation positions where its argmax is the reference's token.
  This is the per-token figure: it does not compound after a first difference.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cloudd.teacher_forcing import teacher_forced_logprobs
from cloudd.trace import TraceRequest
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.kernel_choice import KernelSpec
from shared.engine.kv.radix import common_prefix_len
from shared.engine.sampling_params import SamplingParams
from shared.model.checkpoint import Checkpoint
from shared.model.llama import LlamaModel
from shared.model.weight_cache import build_cached_model


@dataclass(frozen=True)
class Agreement:
    dtype: str  # and the kernels it forced: "bfloat16 (auto,dense=int8)"
    requests: int
    tokens: int  # per continuation
    greedy_exact: float
    greedy_prefix: float
    top1: float
    seconds: float

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def measure_agreement(ckpt: Checkpoint, requests: list[TraceRequest], dtype: str, tokens: int,
                      config: EngineConfig, log: Callable[[str], None] = lambda _m: None) -> Agreement:
    """``dtype`` (a name of ``EngineConfig.dtype``, not "auto") against float32 on ``requests``."""
    start = time.perf_counter()
    prompts = [ckpt.tokenizer.encode_chat(list(r.messages)) for r in requests]
    log(f"greedy, float32 (reference), {len(prompts)} requests x {tokens} tokens ...")
    plain = KernelSpec.parse(config.kernels).backend
    reference = greedy_outputs(ckpt, build_cached_model(ckpt, torch.float32), prompts, tokens,
                               dataclasses.replace(config, dtype="float32", kernels=plain))
    label = dtype if config.kernels == plain else f"{dtype} ({config.kernels})"
    log(f"greedy, {label} ...")
    compared_config = dataclasses.replace(config, dtype=dtype)
    model = build_cached_model(ckpt, compared_config.torch_dtype)
    compared = greedy_outputs(ckpt, model, prompts, tokens, compared_config)
    prefixes = [common_prefix_len(a, b) / tokens for a, b in zip(compared, reference, strict=True)]
    log(f"teacher-forced top-1, {label} ...")
    hits = sum(_teacher_forced_hits(model, p, ref) for p, ref in zip(prompts, reference, strict=True))
    return Agreement(
        dtype=label, requests=len(prompts), tokens=tokens,
        greedy_exact=sum(p == 1.0 for p in prefixes) / len(prefixes),
        greedy_prefix=sum(prefixes) / len(prefixes),
        top1=hits / (tokens * len(prompts)),
        seconds=time.perf_counter() - start,
    )


def greedy_outputs(ckpt: Checkpoint, model: LlamaModel, prompts: list[list[int]], tokens: int,
                   config: EngineConfig) -> list[list[int]]:
    """Each prompt's first ``tokens`` greedy output tokens (end-of-text ignored) from an engine
    over ``model`` with ``config``."""
    engine = Engine(model, ckpt.tokenizer, config)
    done = engine.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
    engine.close()
    return [r.output_token_ids for r in done]


def _teacher_forced_hits(model: LlamaModel, prompt: list[int], continuation: list[int]) -> int:
    """Positions of ``continuation`` where ``model``'s argmax, reading everything before it, is
    that token (``cloudd.teacher_forcing``: one forward over prompt + continuation)."""
    predicted = teacher_forced_logprobs(model, prompt, continuation).argmax(dim=-1)  # [len(continuation)]
    return int((predicted == torch.tensor(continuation)).sum())


def format_agreement(a: Agreement) -> str:
    return (f"{a.dtype} vs float32 over {a.requests} requests x {a.tokens} greedy tokens: "
            f"top-1 {a.top1:.1%} (teacher-forced), greedy prefix {a.greedy_prefix:.1%}, "
            f"identical continuations {a.greedy_exact:.0%} ({a.seconds:.0f} s)")
