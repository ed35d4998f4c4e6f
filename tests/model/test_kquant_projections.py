"""A GGUF's K-quant blocks as codes (``shared.model.kquant_codes``) equal gguf's dequantized
values; a model's projections built from them (``shared.model.kquant_projections``) are its
dense weights, part by part; and a model whose small steps run on them gives the dense model's
log-probabilities up to bf16 rounding."""

from __future__ import annotations


import gguf
import numpy as np
import pytest
import torch

from cloudd.teacher_forcing import teacher_forced_logprobs
from kernels.tile_quant_linear import TILE_QUANT_LAYERS
from kernels.tile_quant_matmul_cpu import max_rows, tile_quant_matmul_usable
from shared.model.gguf_loader import read_gguf
from shared.model.kquant_codes import kquant_codes
from shared.model.kquant_projections import attach_projections, has_kquant_projections, kquant_projections
from shared.model.weight_cache import load_model
from tests.model.tiny_gguf import LAYER_KINDS, write_tiny_gguf

Q = gguf.GGMLQuantizationType
ALL_KQUANT = {name: Q.Q6_K if kind == Q.Q6_K else Q.Q4_K if kind != Q.F32 else kind
              for name, kind in LAYER_KINDS.items()}  # v and down Q6_K, the other weights Q4_K


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("kquant") / "tiny.gguf", layer_kinds=ALL_KQUANT, seed=3)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("mixed") / "tiny.gguf", seed=4)


def test_the_codes_are_the_blocks_gguf_dequantizes(kquant_file):
    _, tensors = read_gguf(kquant_file)
    kinds = set()
    for tensor in tensors:
        codes = kquant_codes(tensor.kind, tensor.data) if tensor.data.ndim == 2 else None
        if tensor.kind not in (Q.Q4_K, Q.Q6_K):
            assert codes is None
            continue
        kinds.add(tensor.kind)
        assert codes.codes.max() < (16 if tensor.kind == Q.Q4_K else 64)
        np.testing.assert_allclose(codes.dequantize(), gguf.quants.dequantize(tensor.data, tensor.kind),
                                   rtol=1e-6, atol=1e-9)
    assert kinds == {Q.Q4_K, Q.Q6_K}


def test_each_projection_is_the_dense_weight_of_its_module(kquant_file):
    model, _ = load_model(kquant_file, torch.float32, cache=False)
    projections = kquant_projections(kquant_file)
    layer_modules = {m for m in projections if m.startswith("layers.")}
    assert len(layer_modules) == 4 * model.config.num_layers
    assert "lm_head" not in projections  # 262 vocabulary rows: not a multiple of the tiles' 16
    qkv = projections["layers.0.self_attn.qkv_proj"]
    assert [s.bits for s in qkv.segments] == [4, 8]  # q and k Q4_K, v Q6_K: two segments
    for module, projection in projections.items():
        dense = torch.cat([s.dequantize() for s in projection.segments])
        torch.testing.assert_close(dense, model.get_submodule(module).weight, rtol=1e-6, atol=1e-7)


def test_a_projection_with_a_part_in_another_format_keeps_its_dense_product(mixed_file, kquant_file):
    assert has_kquant_projections(mixed_file) and has_kquant_projections(kquant_file)
    # LAYER_KINDS: q Q4_K with k Q5_0, gate Q4_K with up Q5_0, o Q8_0: only down (Q6_K) has codes
    assert sorted({m.split(".", 2)[2] for m in kquant_projections(mixed_file)}) == ["mlp.down_proj"]


@pytest.mark.skipif(not tile_quant_matmul_usable(), reason="the kernel needs a CPU with AMX or AVX-512 BF16")
@pytest.mark.parametrize("file", ["kquant_file", "mixed_file"])
def test_small_steps_on_the_codes_give_the_dense_models_log_probabilities(file, request):
    path = request.getfixturevalue(file)
    dense, _ = load_model(path, torch.bfloat16, cache=False)
    quant, _ = load_model(path, torch.bfloat16, cache=False)
    assert attach_projections(quant, kquant_projections(path)) > 0
    quant.use_small_step_functions(TILE_QUANT_LAYERS, max_rows())
    prompt, continuation = [5, 9, 77, 130], [17, 250, 3, 96]
    assert len(prompt) + len(continuation) - 1 <= max_rows()  # one small step
    exact = teacher_forced_logprobs(load_model(path, torch.float32, cache=False)[0], prompt, continuation)
    want = teacher_forced_logprobs(dense, prompt, continuation)
    got = teacher_forced_logprobs(quant, prompt, continuation)
    # the same weights (bf16-rounded in the dense model, exact on the tiles), bf16 activations:
    # no further from the float32 model's than the dense bf16 model is
    assert (got - exact).abs().max() <= 2 * (want - exact).abs().max() + 0.01 * exact.abs().max()
    quant.use_small_step_functions(None)  # a longer step runs the dense products again, as does this
    torch.testing.assert_close(teacher_forced_logprobs(quant, prompt, continuation), want)


@pytest.mark.skipif(not tile_quant_matmul_usable(), reason="the kernel needs a CPU with AMX or AVX-512 BF16")
def test_an_engine_forced_to_kquant_small_steps_runs_them_and_says_so(kquant_file, tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSERVE_CACHE_DIR", str(tmp_path / "cache"))
    from shared.engine.engine import Engine
    from shared.engine.engine_config import EngineConfig
    from shared.engine.sampling_params import SamplingParams

    engine = Engine.from_checkpoint(kquant_file, EngineConfig(dtype="bfloat16", kernels="torch,small_steps=kquant",
                                                              num_blocks=64))
    try:
        assert engine.runner.kernel_plan.chosen["small_steps"] == "kquant"
        assert "small_steps=kquant (forced)" in engine.runner.kernel_plan.describe()
        model = engine.runner.model
        assert model.small_step_functions is TILE_QUANT_LAYERS and model.small_step_max_tokens == max_rows()
        [request] = engine.generate([[5, 9, 77, 130]], SamplingParams(max_tokens=6, temperature=0.0))
        assert len(request.output_token_ids) == 6
    finally:
        engine.close()


def test_forcing_kquant_small_steps_where_the_model_has_no_codes_names_the_problem(kquant_file):
    from shared.engine.engine import Engine
    from shared.engine.engine_config import EngineConfig

    with pytest.raises(ValueError, match="small_steps=kquant"):  # float32: the tiles multiply bf16
        Engine.from_checkpoint(kquant_file, EngineConfig(dtype="float32", kernels="torch,small_steps=kquant",
                                                         num_blocks=64), cache=False)
