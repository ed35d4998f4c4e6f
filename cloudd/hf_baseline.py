"""The HF transformers baseline for `cloudd bench --baseline hf`: the same prompts through
``generate()`` in static batches (left-padded, greedy, same fixed output length).

transformers is a test/bench-only dependency: imported here, never by the engine.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from cloudd.bench_report import RequestTiming
from shared.model.checkpoint import Checkpoint


def build_hf_model(ckpt: Checkpoint, dtype: torch.dtype):
    """An HF ``*ForCausalLM`` with our checkpoint's weights (no hub, no file round trip)."""
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the install
        raise RuntimeError("--baseline hf needs transformers: pip install 'fleetserve[test]'") from e
    c = ckpt.config
    hf_config = transformers.AutoConfig.for_model(
        c.arch,
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias,
        rope_scaling=None if c.rope_scaling is None else {"rope_type": "llama3", **dataclasses.asdict(c.rope_scaling)},
    )
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    missing, unexpected = model.load_state_dict(ckpt.weights, strict=False)
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"HF model weights do not line up: missing {missing}, unexpected {unexpected}")
    if c.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


class _FirstTokenClock:
    """A logits processor that notes when the first decoding step starts (prefill done)."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids, scores):
        if self.first is None:
            self.first = time.perf_counter()
        return scores


@torch.inference_mode()
def run_hf_generate(
    ckpt: Checkpoint,
    prompts: list[list[int]],
    priorities: list[int],
    output_len: int,
    batch_size: int,
    dtype: torch.dtype,
    device: str = "cpu",
) -> tuple[list[RequestTiming], float]:
    """All prompts submitted at t0 and served batch after batch on ``device``; timings are from t0."""
    import transformers

    model = build_hf_model(ckpt, dtype).to(device)
    pad = min(ckpt.tokenizer.eos_token_ids)
    timings = []
    t0 = time.perf_counter()
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        clock = _FirstTokenClock()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            do_sample=False,
            pad_token_id=pad,
            logits_processor=transformers.LogitsProcessorList([clock]),
        )
        done = time.perf_counter()
        assert out.shape[1] - width == output_len
        for i, p in enumerate(batch):
            timings.append(
                RequestTiming(priorities[start + i], len(p), output_len, clock.first - t0, done - t0)
            )
    return timings, time.perf_counter() - t0
