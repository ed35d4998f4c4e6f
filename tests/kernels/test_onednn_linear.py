"""oneDNN's packed products (``kernels.onednn_linear``) against plain torch: the op at random
shapes, eager and compiled, a packed model's forward against the dense one, and the dense
weights' pages released without changing what a reader of them sees."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import onednn_linear
from kernels.greedy_head import greedy_head_reference
from kernels.onednn_linear import PackedHead, PackedLinear
from kernels.weight_forms import FORM_LAYERS, form_linear
from shared.model.projection_forms import convert_layer_linears, pack_head
from shared.model.weight_cache import load_model
from tests.engine.tiny import dense_logits, tiny_model
from tests.model.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(not onednn_linear.supported(torch.float32), reason="this torch build has no oneDNN")
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # relative to the largest output
DTYPES = [d for d in TOLERANCE if onednn_linear.supported(d)]


def assert_same_logits(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 logits of the same weights, within ``TOLERANCE`` of the largest: oneDNN's packed
    kernels sum in another order than torch's ``linear``, and each order differs by CPU, so a
    logit near 0 may be off by more than 1e-4 of itself (1.1e-4 in a logit of 0.07 on an AMD
    EPYC, where they reach 71)."""
    torch.testing.assert_close(got, want, rtol=TOLERANCE[torch.float32],
                               atol=TOLERANCE[torch.float32] * want.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 70), k=st.integers(1, 96), n=st.integers(1, 80), bias=st.booleans(), seed=st.integers(0, 99))
def test_a_packed_product_is_linears(dtype, rows, k, n, bias, seed):
    generator = torch.Generator().manual_seed(seed)
    x, w = (torch.randn(shape, generator=generator).to(dtype) for shape in ((rows, k), (n, k)))
    b = torch.randn(n, generator=generator).to(dtype) if bias else None
    layer = PackedLinear(w, b)
    assert layer.weight.shape == (n, k) and layer.weight.dtype == torch.int8  # the handle, one byte
    got = form_linear(x, layer.weight, b)
    want = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert got.dtype == dtype and got.shape == (rows, n)
    assert (got.double() - want).abs().max() <= TOLERANCE[dtype] * max(want.abs().max().item(), 1.0)
    assert torch.equal(layer(x[None]).squeeze(0), got)  # the module's forward, any leading dims


@pytest.mark.parametrize("compiled", [False, True])
def test_a_packed_models_forward_is_the_dense_ones(compiled):
    dense, packed = tiny_model(seed=3), tiny_model(seed=3)
    assert convert_layer_linears(packed, PackedLinear) == 4 * packed.config.num_layers
    assert convert_layer_linears(packed, PackedLinear) == 0  # already packed: nothing to do
    packed.use_layer_functions(FORM_LAYERS)
    if compiled:
        packed.compile_layers(min_tokens=2)
    ids = list(range(3, 40))
    assert_same_logits(dense_logits(packed, ids), dense_logits(dense, ids))


def test_a_mapped_models_packed_forward_is_its_dense_one_and_released_pages_read_back_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEETSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    reference, _ = load_model(path, torch.float32)  # converts, writes the file, maps it
    model, _ = load_model(path, torch.float32)  # maps it again
    mapped = model.mapped_weights
    weights = {name: p for name, p in model.layers.named_parameters() if name.endswith("proj.weight")}
    copies = {name: p.clone() for name, p in weights.items()}
    convert_layer_linears(model, PackedLinear)
    model.use_layer_functions(FORM_LAYERS)
    ids = list(range(2, 30))
    assert_same_logits(dense_logits(model, ids), dense_logits(reference, ids))
    for name, weight in weights.items():  # released: a reader still sees the file's bytes
        mapped.release(weight)
        assert torch.equal(weight, copies[name])
    mapped.release(torch.randn(4096))  # not in the mapping: nothing happens


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 40), vocab=st.integers(1, 300), slice_rows=st.sampled_from([16, 64, 4096]),
       seed=st.integers(0, 99))
def test_a_packed_head_gives_the_logits_and_their_first_maxima(dtype, rows, vocab, slice_rows, seed):
    generator = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(24, vocab, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, 24, generator=generator).round())  # small integers: exact sums, ties
    hidden = torch.randn(rows, 24, generator=generator).round().to(dtype)
    packed = PackedHead(head, slice_rows)
    assert packed.weight is head.weight
    torch.testing.assert_close(packed(hidden), F.linear(hidden, head.weight))
    assert torch.equal(packed.greedy(hidden), greedy_head_reference(hidden, head.weight))


def test_packing_a_tied_head_keeps_the_embeddings_and_the_logits():
    model, reference = tiny_model(seed=4, tie_word_embeddings=True), tiny_model(seed=4, tie_word_embeddings=True)
    assert pack_head(model) and not pack_head(model)
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = list(range(1, 20))
    torch.testing.assert_close(dense_logits(model, ids), dense_logits(reference, ids), rtol=1e-5, atol=1e-5)
