"""Our engine against the real llama-server on the cloud tier's model (Qwen2.5-Coder-1.5B
Q4_K_M): the demo's plan, 24 greedy tokens in bfloat16, token for token the same as
llama.cpp's, or parting only at a near-tie (either side's top-2 margin there under 0.5 nats).

Skipped, never fetched or built, without llama.cpp's build (``../shared/peers/llamacpp/setup.sh``)
or the GGUF in the model cache (``python -m shared.model.fetch qwen2.5-coder-1.5b``). Greedy
only (``python -m cloudd.llamacpp_agreement`` adds teacher forcing): llama-server on one thread
(two spinning threads on two busy cores decode 5x slower), its 24 tokens; then the model in bfloat16
(mapped from its converted weights when cached, else read from the GGUF and cached: ~30 s more)
and our 24 tokens.
"""

from __future__ import annotations

import pytest

from cloudd.llamacpp_agreement import peer
from cloudd.llamacpp_agreement.agreement import facing
from cloudd.llamacpp_agreement.prompts import demo_prompts
from cloudd.llamacpp_agreement.run import our_greedy
from cloudd.teacher_forcing import teacher_forced_logprobs
from edged.llamacpp_peer import LlamaServer, PeerMissing, peer_binary
from shared.config import model_cache_dir
from shared.engine.engine_config import EngineConfig
from shared.engine.kv.radix import common_prefix_len
from shared.model.checkpoint import load_checkpoint
from shared.model.fetch import MODELS
from shared.model.weight_cache import build_cached_model

TOKENS = 24


@pytest.fixture(scope="module")
def cloud_model():
    try:
        peer_binary("llama-server")
    except PeerMissing as e:
        pytest.skip(str(e))
    path = model_cache_dir() / MODELS["qwen2.5-coder-1.5b"].filename
    if not path.is_file():
        pytest.skip(f"the cloud model's GGUF is not cached at {path}")
    return path


def test_the_demos_greedy_plan_matches_llamacpps_or_parts_at_a_near_tie(cloud_model):
    ckpt = load_checkpoint(cloud_model)
    prompt = ckpt.tokenizer.encode_chat(list(demo_prompts()[0].messages))
    with LlamaServer(cloud_model, threads=1, context=len(prompt) + TOKENS) as server:
        theirs, their_tops = peer.greedy(server, prompt, TOKENS)
    config = EngineConfig(dtype="bfloat16")
    net = build_cached_model(ckpt, config.torch_dtype)
    (ours,) = our_greedy(ckpt, net, [prompt], TOKENS, config)
    match = common_prefix_len(ours, theirs)
    if match < TOKENS:  # both read the same prefix up to here: was it a coin toss?
        row = teacher_forced_logprobs(net, prompt, ours[: match + 1])[match]
        divergence = facing(match, row, their_tops[match])
        assert divergence.near_tie(), divergence
