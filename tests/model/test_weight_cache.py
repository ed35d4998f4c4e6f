"""The converted-weight cache against its naive reference, a fresh build from the GGUF: a load
through the cache gives the same model whether it wrote the file, read it, or found it cut short
or corrupt (then rebuilt); a read dequantizes nothing."""

import functools
import os

import gguf
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.sampling_params import SamplingParams
from shared.model.checkpoint import load_checkpoint
from shared.model.llama import LlamaModel, build_model
from shared.model.weight_cache import converted_file, load_model
from tests.model.tiny_gguf import write_tiny_gguf

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """FLEETSERVE_CACHE_DIR for the module: converted files go to a fresh folder."""
    folder = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLEETSERVE_CACHE_DIR", str(folder))
        yield folder / "models" / "converted"


@pytest.fixture(scope="module", params=[("qwen2", False), ("llama", True)], ids=["qwen2", "llama-tied"])
def tiny(request, tmp_path_factory, cache_dir):
    arch, tied = request.param
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / f"{arch}.gguf", arch, tied)


@functools.cache
def fresh(path, dtype) -> LlamaModel:
    """The reference: built from the GGUF, no cache (once per file and dtype: tests only read it)."""
    ckpt = load_checkpoint(path)
    return build_model(ckpt.config, ckpt.weights, dtype)


def assert_same(model: LlamaModel, reference: LlamaModel) -> None:
    ours, ref = model.state_dict(), reference.state_dict()
    assert ours.keys() == ref.keys()
    assert all(ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]) for k in ref)
    assert torch.equal(model.rotary.cos, reference.rotary.cos)
    assert (model.lm_head.weight is model.embed_tokens.weight) == model.config.tie_word_embeddings


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_first_load_writes_the_file_and_the_second_reads_it_without_dequantizing(tiny, dtype, monkeypatch):
    file = converted_file(tiny, dtype)
    file.unlink(missing_ok=True)
    reference = fresh(tiny, dtype)
    first, _ = load_model(tiny, dtype)
    assert file.is_file() and not list(file.parent.glob(".*.tmp"))
    assert_same(first, reference)
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *_: pytest.fail("dequantized a cached model"))
    second, ckpt = load_model(tiny, dtype)
    assert_same(second, reference)
    assert ckpt.config == second.config and ckpt.tokenizer.encode("hello") == [256, 257, 78]  # he, ll, o


def test_a_model_s_own_writes_never_reach_the_file(tiny):
    load_model(tiny, torch.bfloat16)
    model, _ = load_model(tiny, torch.bfloat16)  # its parameters map the file, copy-on-write
    before = model.layers[0].mlp.down_proj.weight.clone()
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.add_(1)
    again, _ = load_model(tiny, torch.bfloat16)
    assert torch.equal(again.layers[0].mlp.down_proj.weight, before)


def test_cache_false_neither_reads_nor_writes(tiny, monkeypatch, tmp_path):
    monkeypatch.setenv("FLEETSERVE_CACHE_DIR", str(tmp_path))
    model, _ = load_model(tiny, torch.float32, cache=False)
    assert_same(model, fresh(tiny, torch.float32))
    assert not (tmp_path / "models").exists()


def test_a_touched_gguf_gets_a_new_file(tiny):
    before = converted_file(tiny, torch.bfloat16)
    stat = tiny.stat()
    os.utime(tiny, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert converted_file(tiny, torch.bfloat16) != before
    assert converted_file(tiny, torch.float32) != converted_file(tiny, torch.bfloat16)


@pytest.mark.parametrize("keep", [0, 7, 4096, 0.5, -1])
def test_a_file_cut_short_is_rebuilt(tiny, keep):
    load_model(tiny, torch.bfloat16)
    file = converted_file(tiny, torch.bfloat16)
    data = file.read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    file.write_bytes(data[:cut])
    model, _ = load_model(tiny, torch.bfloat16)
    assert_same(model, fresh(tiny, torch.bfloat16))
    assert file.read_bytes() == data  # written again, whole


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.one_of(st.integers(0, 4095), st.floats(0, 1, exclude_max=True)), flip=st.integers(1, 255))
def test_any_corrupt_byte_is_never_trusted(tiny, where, flip):
    """One byte changed anywhere (the header more often): the model is still the GGUF's."""
    load_model(tiny, torch.bfloat16)
    file = converted_file(tiny, torch.bfloat16)
    data = bytearray(file.read_bytes())
    index = where if isinstance(where, int) else int(where * len(data))
    data[index] ^= flip
    file.write_bytes(data)
    model, _ = load_model(tiny, torch.bfloat16)
    assert_same(model, fresh(tiny, torch.bfloat16))


def test_the_engine_generates_the_same_tokens_from_a_cached_load(tiny):
    config = EngineConfig(dtype="bfloat16", block_size=4, num_blocks=64)
    greedy = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 2, 77, 31, 8, 8, 1, 40], [256, 257, 78]]
    converted_file(tiny, torch.bfloat16).unlink(missing_ok=True)
    outputs = []
    for cache in (False, True, True):  # fresh; then writing the file; then reading it
        engine = Engine.from_checkpoint(tiny, config, cache=cache)
        outputs.append([r.output_token_ids for r in engine.generate(prompts, greedy)])
        engine.close()
    assert outputs[0] == outputs[1] == outputs[2]
    assert len(set(outputs[0][0])) > 1  # not a degenerate repetition
