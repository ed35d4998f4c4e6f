"""Our paged-KV Llama against HF transformers (fp32) on the default model: logits and greedy text."""

from __future__ import annotations

import os

import pytest
import torch

from cloudd.hf_baseline import build_hf_model
from kernels.attention import PagedAttentionStep
from kernels.attention_metadata import AttentionMetadata, GatherWorkspace
from kernels.kv_layout import allocate_kv
from kernels.paged_decode_cpu import supports as supports_in_place_decode
from kernels.paged_decode_cpu import supports_paired
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.kv.block_pool import NULL_BLOCK
from shared.engine.sampling_params import SamplingParams
from shared.model.llama import build_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MESSAGES = [
    {"role": "system", "content": "You are the task planner of a warehouse robot. Answer with JSON."},
    {"role": "user", "content": "Bring the blue crate from aisle 4 to the packing station."},
]
BLOCK = 16


@pytest.fixture(scope="module")
def models(default_checkpoint):
    ours = build_model(default_checkpoint.config, default_checkpoint.weights)
    hf = build_hf_model(default_checkpoint, torch.float32)
    return ours, hf


@pytest.fixture(scope="module")
def prompt(default_checkpoint):
    return default_checkpoint.tokenizer.encode_chat(MESSAGES)


def _paged_forward(model, kv, tokens, start, table, in_place=False):
    """Compute tokens at positions [start, start+len) as one prefill segment (or a decode;
    ``in_place``: through the CPU decode kernel, a segment's tokens as its rows)."""
    end = start + len(tokens)
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
    used = table[: -(-end // BLOCK)]
    cfg = model.config
    ws = GatherWorkspace(BLOCK * cfg.num_kv_heads * cfg.head_dim, model.embed_tokens.weight.dtype)
    if len(tokens) == 1 and start > 0:
        meta = AttentionMetadata.build([used], [end], [], slots, BLOCK, NULL_BLOCK, ws, in_place=in_place)
    else:
        group = cfg.num_heads // cfg.num_kv_heads
        meta = AttentionMetadata.build([], [], [(used, start, len(tokens))], slots, BLOCK, NULL_BLOCK, ws, group,
                                       in_place=in_place)
    hidden = model(torch.tensor(tokens), torch.arange(start, end), kv, PagedAttentionStep(meta))
    return model.logits(hidden)


@torch.inference_mode()
def test_prefill_and_decode_logits_match_hf(models, prompt, default_checkpoint):
    ours, hf = models
    cfg = default_checkpoint.config
    kv = [
        (torch.zeros(64, BLOCK, cfg.num_kv_heads, cfg.head_dim), torch.zeros(64, BLOCK, cfg.num_kv_heads, cfg.head_dim))
        for _ in range(cfg.num_layers)
    ]
    table = list(range(1, 64))
    extra = [28, 1159, 314]  # three decode steps after the prompt
    hf_logits = hf(torch.tensor([prompt + extra])).logits[0]  # [T, vocab]

    prefill = _paged_forward(ours, kv, prompt, 0, table)
    torch.testing.assert_close(prefill, hf_logits[: len(prompt)], atol=2e-4, rtol=1e-4)
    for i, token in enumerate(extra):
        pos = len(prompt) + i
        step = _paged_forward(ours, kv, [token], pos, table)
        torch.testing.assert_close(step[0], hf_logits[pos], atol=2e-4, rtol=1e-4)


@torch.inference_mode()
@pytest.mark.parametrize(("in_place", "paired"), [(False, False), (True, False), (True, True)],
                         ids=["torch-cascade", "cpu-kernel", "cpu-kernel-paired-kv"])
def test_bf16_logits_stray_from_fp32_no_more_than_hf_bf16s(models, prompt, default_checkpoint, in_place, paired):
    """bf16 rounds; what it may not do is round worse than HF transformers in bf16 does. Both are
    measured against HF in fp32, prefill and decode positions alike."""
    if in_place and not supports_in_place_decode(default_checkpoint.config.head_dim, torch.bfloat16):
        pytest.skip("the CPU decode kernel could not be built here")
    if paired and not supports_paired(default_checkpoint.config.head_dim, torch.bfloat16, BLOCK):
        pytest.skip("the paired KV layout needs AVX-512 BF16")
    _, hf32 = models
    cfg = default_checkpoint.config
    ours = build_model(cfg, default_checkpoint.weights, dtype=torch.bfloat16)
    hf16 = build_hf_model(default_checkpoint, torch.bfloat16)
    extra = [28, 1159, 314]
    ids = torch.tensor([prompt + extra])
    reference = hf32(ids).logits[0]
    hf_error = (hf16(ids).logits[0].float() - reference).abs()
    kv = [allocate_kv(64, BLOCK, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16, "cpu", paired)
          for _ in range(cfg.num_layers)]
    table = list(range(1, 64))
    logits = [_paged_forward(ours, kv, prompt, 0, table, in_place)]
    logits += [_paged_forward(ours, kv, [t], len(prompt) + i, table, in_place) for i, t in enumerate(extra)]
    our_error = (torch.cat(logits).float() - reference).abs()
    # measured: mean 0.18 vs HF's 0.14, max 1.9 vs 1.2 (logits of the default model); a wrong
    # head, position or scale anywhere is off by far more than these bounds
    assert our_error.mean() <= 2 * hf_error.mean()
    assert our_error.max() <= 3 * hf_error.max()


@torch.inference_mode()
def test_greedy_continuation_matches_hf_generate(models, prompt, default_checkpoint):
    ours, hf = models
    n = 40
    expected = hf.generate(
        torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
    )[0, len(prompt):].tolist()
    engine = Engine(ours, default_checkpoint.tokenizer, EngineConfig(num_blocks=128))
    [req] = engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    assert req.output_token_ids == expected
