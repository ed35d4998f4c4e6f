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
