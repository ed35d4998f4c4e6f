"""The runner's persistent block tables against the lists they mirror, and the in-place kernel's
step built from them against its definition (every token a row seeing its context up to itself)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.paged_decode_cpu import supports as supports_in_place_decode
from shared.engine.block_table_rows import BlockTableRows
from shared.engine.runner import ModelRunner
from shared.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from shared.model.model_config import tiny_config
from tests.engine.tiny import tiny_model

NULL = 0
BS = 4


def _chunk(request_id: str, table: list[int], start: int = 0, num_tokens: int = 1, num_drafts: int = 0,
           sample: bool = True) -> ScheduledChunk:
    return ScheduledChunk(request_id, list(range(num_tokens)), start, table, sample, num_drafts)


# Per step, per request: None (sits the step out), ("grow", k blocks) or ("readmit", n blocks).
_actions = st.lists(st.lists(st.one_of(st.none(), st.tuples(st.sampled_from(["grow", "readmit"]), st.integers(0, 9))),
                             min_size=6, max_size=6), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(steps=_actions, seed=st.integers(0, 2**16))
def test_each_row_mirrors_its_requests_list_through_growth_readmission_and_absence(steps, seed):
    rng = np.random.default_rng(seed)
    rows = BlockTableRows(NULL, rows=2, width=3)  # both grow on demand
    tables: dict[str, list[int]] = {}
    for actions in steps:
        chunks = []
        for i, action in enumerate(actions):
            rid = f"r{i}"
            if action is None:
                continue
            kind, n = action
            if kind == "readmit" or rid not in tables:  # a new list object, as KVCacheManager.admit gives
                tables[rid] = [int(b) for b in rng.integers(1, 1000, n)]
            else:
                tables[rid].extend(int(b) for b in rng.integers(1, 1000, n))  # appended in place
            chunks.append(_chunk(rid, tables[rid]))
        indices = rows.update(chunks)
        assert len(set(indices.tolist())) == len(chunks)
        for chunk, index in zip(chunks, indices.tolist(), strict=True):
            table = tables[chunk.request_id]
            assert rows.array[index, : len(table)].tolist() == table
            assert (rows.array[index, len(table) :] == NULL).all()


def test_a_step_copies_only_the_blocks_appended_since_the_last():
    rows = BlockTableRows(NULL)
    table = [5, 6]
    (index,) = rows.update([_chunk("a", table)])
    rows.array[index, 0] = 99  # a row is not rewritten while its list is the same object
    table.append(7)
    assert rows.update([_chunk("a", table)]).tolist() == [index]
    assert rows.array[index, :3].tolist() == [99, 6, 7]
    assert rows.array[rows.update([_chunk("a", [5, 6, 7])])[0], :3].tolist() == [5, 6, 7]  # a new list


def _random_step(rng: np.random.Generator, num_chunks: int) -> SchedulerOutput:
    """Decode rows, prompt chunks and chunks with drafts; each table covers its chunk, maybe with
    a block more (left by rejected drafts), its own blocks distinct from every other chunk's, its
    first half maybe the previous one's."""
    out = SchedulerOutput()
    for i in range(num_chunks):
        start = int(rng.integers(0, 40))
        n = 1 if start > 0 and rng.integers(0, 2) else int(rng.integers(1, 12))
        drafts = int(rng.integers(0, n))  # a chunk's drafts are its last tokens
        num_blocks = -(-(start + n) // BS) + int(rng.integers(0, 2))
        table = [int(b) for b in rng.integers(1 + 200 * i, 200 * (i + 1), num_blocks)]
        if out.chunks and rng.integers(0, 2):
            shared = min(len(table), len(out.chunks[-1].block_table)) // 2
            table[:shared] = out.chunks[-1].block_table[:shared]
        chunk = ScheduledChunk(f"r{i}", [int(t) for t in rng.integers(0, 50, n)], start, table,
                               sample=bool(drafts) or bool(rng.integers(0, 4)), num_drafts=drafts)
        (out.decodes if n == 1 and chunk.sample and start > 0 else out.prefills).append(chunk)
    return out


@pytest.mark.skipif(not supports_in_place_decode(tiny_config().head_dim, torch.float32),
                    reason="the CPU decode kernel could not be built here")
@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), num_chunks=st.integers(1, 8), num_steps=st.integers(1, 3))
def test_an_in_place_step_is_every_token_as_a_row_seeing_its_context_up_to_itself(seed, num_chunks, num_steps):
    rng = np.random.default_rng(seed)
    runner = ModelRunner(tiny_model(), num_blocks=256, block_size=BS)
    assert runner.decode_in_place
    for _ in range(num_steps):  # the persistent rows carry over between steps
        out = _random_step(rng, num_chunks)
        batch = runner._rows_batch(out)
        rows = batch.meta.kernel_rows
        ids, positions, tables, runs, row_start, sample_rows = [], [], [], [], 0, []
        for run, c in enumerate(out.chunks):
            ids += c.token_ids
            positions += range(c.start, c.end)
            tables += [c.block_table] * len(c.token_ids)
            runs += [run] * len(c.token_ids)
            row_start += len(c.token_ids)
            sample_rows += range(row_start - c.num_logits, row_start)
        assert batch.input_ids.tolist() == ids and batch.positions.tolist() == positions
        assert batch.sample_rows.tolist() == sample_rows
        assert batch.meta.slot_mapping.tolist() == [t[p // BS] * BS + p % BS for t, p in zip(tables, positions)]
        assert batch.meta.num_decodes == len(out.decodes)
        assert rows.context_lens.tolist() == [p + 1 for p in positions]
        for row, (table, p) in enumerate(zip(tables, positions, strict=True)):
            assert rows.block_tables[row, : p // BS + 1].tolist() == list(table[: p // BS + 1])
        order = rows.order.tolist()
        assert sorted(order) == list(range(len(ids)))
        width = max(-(-c.end // BS) for c in out.chunks)  # the step's table width: blocks past it go unread
        # by table (equal ones in run order), a run's rows in position order
        keys = [(list(tables[r][:width]), runs[r], positions[r]) for r in order]
        assert keys == sorted(keys)
