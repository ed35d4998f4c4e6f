"""The engine on each CPU kernel plan (``shared.engine.kernel_timing``, ``ModelRunner.apply_plan``):
every combination of implementations computes the plain-torch reference's logits over a step
with prompt chunks after cached context and decode rows; a timed plan is measured once per CPU
and model, then read from the cache; forced choices are honoured or refused."""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace

import pytest
import torch

from kernels import onednn_linear
from kernels.int8_linear import Int8Linear, int8_products_usable
from kernels.onednn_linear import PackedLinear
from kernels.paged_decode_cpu import supports as supports_in_place_decode
from kernels.paged_decode_cpu import supports_tiles
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.kernel_choice import OPT_IN, KernelSpec
from shared.engine.kernel_timing import candidates, choose_plan
from shared.engine.runner import MAX_DECODE_ROWS_CHUNK
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from shared.model.model_config import tiny_config
from tests.engine.tiny import dense_logits, tiny_model

BS = 16
TILES_SHAPE = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}  # paired pools: head_dim 32
IN_PLACE = supports_in_place_decode(tiny_config().head_dim, torch.float32)
PACKING = ("linear", "packed") if onednn_linear.supported(torch.float32) else ("linear",)
PLANS = [f"dense={d},head={h},decode_attention={a},prefill_attention={p}"
         for d, h, a, p in itertools.product(PACKING, PACKING, ("rows", "cascade") if IN_PLACE else ("cascade",),
                                             ("rows", "gemm") if IN_PLACE else ("gemm",))]


@pytest.mark.parametrize("kernels", PLANS)
def test_every_plan_computes_the_references_logits(kernels):
    engine = Engine(tiny_model(seed=5), None, EngineConfig(block_size=BS, num_blocks=64, kernels=kernels))
    runner, reference = engine.runner, tiny_model(seed=5)
    a, b = list(range(3, 61)), list(range(7, 50))  # two prompts (a: 58 tokens)
    table_a, table_b = [1, 2, 3, 4, 5], [6, 7, 8, 9]
    # step 1: a's first 40 tokens; step 2: a's next 17 (after 40 cached) beside all of b; step 3: decode both
    steps = [SchedulerOutput(prefills=[ScheduledChunk("a", a[:40], 0, table_a, sample=False)]),
             SchedulerOutput(prefills=[ScheduledChunk("a", a[40:57], 40, table_a, sample=True),
                                       ScheduledChunk("b", b, 0, table_b, sample=True)]),
             SchedulerOutput(decodes=[ScheduledChunk("a", [a[57]], 57, table_a, sample=True),
                                      ScheduledChunk("b", [9], len(b), table_b, sample=True)])]
    got = [runner.execute(out).float() for out in steps]
    want_a, want_b = dense_logits(reference, a[:58]), dense_logits(reference, b + [9])
    torch.testing.assert_close(got[1], torch.stack([want_a[56], want_b[len(b) - 1]]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got[2], torch.stack([want_a[57], want_b[len(b)]]), rtol=1e-4, atol=1e-4)
    greedy = runner.execute_greedy(steps[2])  # the head's greedy path: the logits' first maxima
    assert greedy == got[2].argmax(dim=-1).tolist()
    assert set(engine.stats().kernel_plan["how"].values()) == {"forced"}
    engine.close()


def test_untimed_plans_take_the_first_implementation_so_tests_never_depend_on_speed():
    engine = Engine(tiny_model(), None, EngineConfig(block_size=BS, num_blocks=64))
    plan = engine.stats().kernel_plan
    assert plan["chosen"] == {"dense": "linear", "head": "linear", "decode_attention": "rows" if IN_PLACE else "cascade",
                              "prefill_attention": "rows" if IN_PLACE else "gemm"}
    assert set(plan["how"].values()) == {"default"} and plan["timings_ms"] == {}
    engine.close()


def test_a_timed_plan_is_measured_once_per_cpu_and_model_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSERVE_CACHE_DIR", str(tmp_path))
    config = EngineConfig(block_size=BS, num_blocks=64, time_kernels=True)
    available = timed_candidates(config)
    engine = Engine(tiny_model(), None, config)
    first = engine.stats().kernel_plan
    for op, impls in available.items():  # int8 products are offered, never timed
        assert first["chosen"][op] in impls
        assert first["how"][op] == ("measured" if len(impls) > 1 else "only")
        if len(impls) > 1:
            assert all(set(bucket) == set(impls) and min(bucket.values()) > 0
                       for bucket in first["timings_ms"][op].values())
    engine.close()
    if not any(len(impls) > 1 for impls in available.values()):
        pytest.skip("one implementation of every operation here: nothing is measured")
    assert (tmp_path / "kernel-choice.json").exists()
    engine = Engine(tiny_model(), None, config)
    again = engine.stats().kernel_plan
    assert again["chosen"] == first["chosen"]
    assert {op: how for op, how in again["how"].items() if how != "only"} == {
        op: "cached" for op, impls in available.items() if len(impls) > 1}
    # a plan that packed the model still generates
    out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4))
    assert len(out[0].output_token_ids) == 4
    engine.close()


def timed_candidates(config: EngineConfig) -> dict[str, tuple[str, ...]]:
    """Each operation's candidates that a timed plan measures, read on an engine that converts no
    weights: once a plan picks packed products, the model offers only its form, whichever won."""
    engine = Engine(tiny_model(), None, dataclasses.replace(config, time_kernels=False))
    available = candidates(engine.runner)
    engine.close()
    return {op: tuple(c for c in impls if c not in OPT_IN.get(op, ())) for op, impls in available.items()}


@pytest.mark.skipif(not onednn_linear.supported(torch.float32), reason="this torch build has no oneDNN")
def test_a_model_packed_by_an_earlier_engine_stays_packed_for_the_next():
    model = tiny_model()
    Engine(model, None, EngineConfig(block_size=BS, num_blocks=64, kernels="dense=packed")).close()
    assert isinstance(model.layers[0].mlp.down_proj, PackedLinear)
    engine = Engine(model, None, EngineConfig(block_size=BS, num_blocks=64, time_kernels=True))
    assert candidates(engine.runner)["dense"] == ("packed",)
    assert engine.stats().kernel_plan["how"]["dense"] == "only"
    engine.close()


@pytest.mark.skipif(not int8_products_usable(), reason="the CPU kernels do not build here")
def test_int8_products_run_where_forced_near_the_references_logits_and_the_next_engine_keeps_them():
    model, reference = tiny_model(seed=5), tiny_model(seed=5)
    engine = Engine(model, None, EngineConfig(block_size=BS, num_blocks=64, kernels="dense=int8"))
    assert isinstance(model.layers[0].mlp.down_proj, Int8Linear)
    assert engine.stats().kernel_plan["chosen"]["dense"] == "int8"
    assert "int8" in candidates(engine.runner)["dense"]
    ids = list(range(3, 40))
    logits = engine.runner.execute(SchedulerOutput(prefills=[ScheduledChunk("a", ids, 0, [1, 2, 3], sample=True)]))
    want = dense_logits(reference, ids)[-1]
    torch.testing.assert_close(logits[0].float(), want, rtol=0.05, atol=0.05 * want.abs().max().item())
    engine.close()
    engine = Engine(model, None, EngineConfig(block_size=BS, num_blocks=64, time_kernels=True))
    assert candidates(engine.runner)["dense"] == ("int8",) and engine.stats().kernel_plan["how"]["dense"] == "only"
    engine.close()


def test_cpu_implementations_a_config_forces_do_not_apply_to_the_triton_backend():
    gpu_runner = SimpleNamespace(device=torch.device("cuda"), kernels="triton")  # "auto" on CUDA
    plan = choose_plan(gpu_runner, KernelSpec.parse("auto,dense=int8"), True, None)
    assert plan.chosen == {} and plan.how == {}


def test_forcing_rows_without_the_in_place_kernel_is_refused():
    engine = Engine(tiny_model(), None, EngineConfig(block_size=BS, num_blocks=64))
    runner = engine.runner
    if runner.decode_in_place:
        runner._table_rows = None  # as on a machine where the kernel does not build
        runner.decode_in_place = False
    with pytest.raises(ValueError, match="prefill_attention=rows, which this machine or model lacks"):
        choose_plan(runner, KernelSpec.parse("prefill_attention=rows"), measure=False, cache=None)
    engine.close()


@pytest.mark.skipif(not supports_tiles(32, torch.bfloat16, BS), reason="the tiles need a CPU with AMX (amx_bf16)")
def test_rows_on_the_tiles_compute_the_vector_kernels_logits():
    """bf16 on paired pools (head_dim 32): the AMX task's step logits are the vector task's up to
    the order of float32 sums, for prompt rows (after cached context, beside a decode row) and
    decode rows alike; a step with prompt chunks takes the prefill's task, a decode step the
    decode's."""
    runs = {}
    for impl in ("rows", "tiles"):
        model = tiny_model(seed=6, **TILES_SHAPE).to(torch.bfloat16)
        engine = Engine(model, None, EngineConfig(block_size=BS, num_blocks=64, dtype="bfloat16",
                                                  kernels=f"decode_attention={impl},prefill_attention={impl}"))
        assert engine.runner.kv_layout == "paired"
        a, b = list(range(3, 61)), list(range(7, 50))
        steps = [SchedulerOutput(prefills=[ScheduledChunk("a", a[:40], 0, [1, 2, 3, 4], sample=True),
                                           ScheduledChunk("b", b, 0, [6, 7, 8], sample=True)]),
                 SchedulerOutput(decodes=[ScheduledChunk("b", [9], len(b), [6, 7, 8], sample=True)],
                                 prefills=[ScheduledChunk("a", a[40:57], 40, [1, 2, 3, 4], sample=True)]),
                 SchedulerOutput(decodes=[ScheduledChunk("a", [a[57]], 57, [1, 2, 3, 4], sample=True),
                                          ScheduledChunk("b", [10], len(b) + 1, [6, 7, 8], sample=True)])]
        assert all(engine.runner.step_batch(out).meta.kernel_rows.tiles == (impl == "tiles") for out in steps)
        runs[impl] = [engine.runner.execute(out).float() for out in steps]
        engine.close()
    for rows, tiles in zip(runs["rows"], runs["tiles"], strict=True):
        torch.testing.assert_close(tiles, rows, atol=0.1, rtol=0.05)


@pytest.mark.skipif(not supports_tiles(32, torch.bfloat16, BS), reason="the tiles need a CPU with AMX (amx_bf16)")
@pytest.mark.parametrize(("prefill", "decode", "prompt_step_tiles", "decode_step_tiles"), [
    ("tiles", "rows", True, False), ("rows", "tiles", False, True), ("gemm", "tiles", True, True)])
def test_a_step_with_prompt_chunks_takes_the_prefills_task_and_a_decode_step_the_decodes(
        prefill, decode, prompt_step_tiles, decode_step_tiles):
    engine = Engine(tiny_model(seed=6, **TILES_SHAPE).to(torch.bfloat16), None, EngineConfig(
        block_size=BS, num_blocks=64, dtype="bfloat16",
        kernels=f"decode_attention={decode},prefill_attention={prefill}"))
    # a prompt chunk longer than MAX_DECODE_ROWS_CHUNK after cached context, beside a decode row
    mixed = SchedulerOutput(decodes=[ScheduledChunk("b", [9], 43, [6, 7, 8], sample=True)],
                            prefills=[ScheduledChunk("a", list(range(3, 3 + MAX_DECODE_ROWS_CHUNK + 2)), 10,
                                                     [1, 2, 3, 4], sample=True)])
    decode_only = SchedulerOutput(decodes=[ScheduledChunk("b", [9], 43, [6, 7, 8], sample=True)])
    meta = engine.runner.step_batch(mixed).meta
    assert meta.kernel_rows.tiles == prompt_step_tiles
    assert bool(meta.prefills) == (prefill == "gemm")  # GEMM segments beside the decode rows in the kernel
    assert engine.runner.step_batch(decode_only).meta.kernel_rows.tiles == decode_step_tiles
    engine.close()
