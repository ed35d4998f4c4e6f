"""`cloudd agreement`'s teacher-forced count: one forward reads prompt + continuation, and a
position counts when the model's argmax there is the continuation's token."""

from __future__ import annotations

import torch

from cloudd.dtype_agreement import _teacher_forced_hits
from tests.engine.tiny import tiny_model


def test_hits_count_continuation_positions_whose_argmax_is_their_token():
    model = tiny_model()
    vocab = model.config.vocab_size
    rows_seen = []

    def logits(hidden):  # row r of the rows asked for predicts token 10 + r: no near-ties
        rows_seen.append(hidden.shape[0])
        return torch.nn.functional.one_hot(10 + torch.arange(hidden.shape[0]), vocab).float()

    model.logits = logits
    prompt = [3, 4, 5, 6]
    assert _teacher_forced_hits(model, prompt, [10, 11, 12]) == 3
    assert _teacher_forced_hits(model, prompt, [10, 50, 12, 50]) == 2
    assert _teacher_forced_hits(model, prompt, [50]) == 0
    assert rows_seen == [3, 4, 1]  # one row per continuation token: prompt's last position on


def test_kernels_a_config_forces_run_in_the_compared_dtype_only_and_name_the_result(default_checkpoint, monkeypatch):
    import cloudd.dtype_agreement as agreement
    from cloudd.trace import TraceRequest
    from shared.engine.engine_config import EngineConfig

    configs = []

    def greedy(ckpt, model, prompts, tokens, config):
        configs.append((config.dtype, config.kernels))
        return [[7] * tokens for _ in prompts]

    monkeypatch.setattr(agreement, "greedy_outputs", greedy)
    monkeypatch.setattr(agreement, "_teacher_forced_hits", lambda model, prompt, continuation: len(continuation) - 1)
    request = TraceRequest("r1", "amr-001", "plan", 0, 0.0, ({"role": "user", "content": "go to the dock"},), 4)
    result = agreement.measure_agreement(default_checkpoint, [request, request], "bfloat16", 4,
                                         EngineConfig(kernels="auto,dense=int8"))
    assert configs == [("float32", "auto"), ("bfloat16", "auto,dense=int8")]
    assert result.dtype == "bfloat16 (auto,dense=int8)" and result.greedy_exact == 1.0 and result.top1 == 0.75
