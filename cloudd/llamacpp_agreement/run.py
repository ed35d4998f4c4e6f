"""The agreement check end to end: our engine and llama-server on the same GGUF and the same
prompt token ids, per prompt and per compute dtype of ours (see ``agreement``).

llama-server runs beside us for the whole check; its greedy continuations are asked once (they
do not depend on our dtype), its teacher-forced top-2s once per dtype (along that dtype's
greedy output). Our model is built once per dtype (from its converted weights when cached:
``shared.model.weight_cache``) and dropped before the next.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from cloudd.dtype_agreement import greedy_outputs
from cloudd.llamacpp_agreement import peer
from cloudd.llamacpp_agreement.agreement import PromptAgreement, compare
from cloudd.llamacpp_agreement.prompts import NamedPrompt
from cloudd.teacher_forcing import teacher_forced_logprobs
from edged.llamacpp_peer import LlamaServer
from shared.engine.engine_config import EngineConfig
from shared.model.checkpoint import Checkpoint
from shared.model.llama import LlamaModel
from shared.model.weight_cache import build_cached_model


def measure(ckpt: Checkpoint, prompts: Sequence[NamedPrompt], dtypes: Sequence[str], tokens: int, threads: int,
            log: Callable[[str], None] = lambda _m: None) -> list[PromptAgreement]:
    """Every prompt's agreement in every dtype (names of ``EngineConfig.dtype`` other than
    "auto"), dtype by dtype; ``ckpt`` loaded from a GGUF, which llama-server reads too.

    Raises PeerMissing without llama.cpp's build, RuntimeError when llama-server fails or
    answers in an unknown shape, ValueError on an unknown dtype.
    """
    configs = [_engine_config(d) for d in dtypes]  # ValueError before llama-server starts
    ids = [ckpt.tokenizer.encode_chat(list(p.messages)) for p in prompts]
    results = []
    with LlamaServer(ckpt.source, threads, context=max(map(len, ids)) + tokens) as server:  # the longest fits whole
        log(f"llama.cpp greedy, {len(ids)} prompts x {tokens} tokens ...")
        theirs = [peer.greedy(server, p, tokens) for p in ids]
        for config in configs:
            dtype = config.dtype
            log(f"ours greedy, {dtype} ...")
            net = build_cached_model(ckpt, config.torch_dtype)
            ours = our_greedy(ckpt, net, ids, tokens, config)
            for prompt, p, o, (t, t_tops) in zip(prompts, ids, ours, theirs, strict=True):
                log(f"teacher-forced top-2, {dtype}, {prompt.name} ...")
                forced = peer.teacher_forced(server, p, o)
                rows = teacher_forced_logprobs(net, p, o)  # [tokens, vocab]
                results.append(compare(prompt.name, dtype, o, rows, t, t_tops, forced))
            del net
    return results


def our_greedy(ckpt: Checkpoint, net: LlamaModel, prompts: list[list[int]], tokens: int,
               config: EngineConfig) -> list[list[int]]:
    """Our engine's greedy continuations of ``prompts`` (exactly ``tokens`` each, EOS ignored),
    batched, on a KV pool just large enough for all of them; ``net`` built in ``config``'s dtype."""
    blocks = sum(-(-(len(p) + tokens) // config.block_size) for p in prompts) + 1  # + the null block
    return greedy_outputs(ckpt, net, prompts, tokens, dataclasses.replace(config, num_blocks=blocks))


def _engine_config(dtype: str) -> EngineConfig:
    if dtype == "auto":
        raise ValueError("dtype: name one (float32, bfloat16, ...), not 'auto'")
    return EngineConfig(dtype=dtype)
