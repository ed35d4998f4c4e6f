"""edged's batch-1 generation on the torch backend with the default model: the same tokens as
the shared engine, whatever prefix is reused (the buffer's, a pinned prompt's, one read from
disk) and across a preemption; torn pinned files are recomputed."""

from __future__ import annotations

import pytest
import torch

from edged.backends.torch_backend import TorchBackend
from edged.generation import Batch1Generator, LocalJob
from edged.speculation import ForwardCosts, SpeculationConfig
from shared.engine.detokenizer import IncrementalDetokenizer
from shared.engine.engine import Engine
from shared.engine.engine_config import EngineConfig
from shared.engine.grammar.compiler import GrammarCompiler
from shared.engine.grammar.response_format import fleet_plan_format, grammar_spec
from shared.engine.sampling_params import SamplingParams
from shared.model.llama import build_model

MAX_LEN = 768
TOKENS = 16


@pytest.fixture(scope="module")
def compiler(default_checkpoint):
    return GrammarCompiler(default_checkpoint.tokenizer)


@pytest.fixture(scope="module")
def backend(default_checkpoint):
    return TorchBackend(default_checkpoint, MAX_LEN, model_digest="test")


def generator(backend, default_checkpoint, compiler, pinned_dir=None) -> Batch1Generator:
    return Batch1Generator(backend, default_checkpoint.tokenizer, compiler, pinned_dir=pinned_dir)


def job(tokenizer, prompt, rid="r", max_tokens=TOKENS, **sampling) -> LocalJob:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
    return LocalJob(rid, list(prompt), params, IncrementalDetokenizer(tokenizer))


def run(gen: Batch1Generator, j: LocalJob) -> list[int]:
    assert gen.run(j, lambda tokens, text: None)
    return j.generated


def test_greedy_tokens_match_the_engine(default_checkpoint, backend, compiler, plan_prompt):
    gen = generator(backend, default_checkpoint, compiler)
    ours = run(gen, job(default_checkpoint.tokenizer, plan_prompt))
    engine = Engine(build_model(default_checkpoint.config, default_checkpoint.weights), default_checkpoint.tokenizer,
                    EngineConfig(num_blocks=128))
    engine.submit(list(plan_prompt), SamplingParams(max_tokens=TOKENS, ignore_eos=True), "e")
    theirs = []
    while engine.has_unfinished:
        for delta in engine.step():
            theirs += delta.token_ids
    assert ours == theirs


def test_reused_prefixes_give_the_same_tokens(default_checkpoint, backend, compiler, plan_prompt, tmp_path):
    tok = default_checkpoint.tokenizer
    fresh = run(generator(backend, default_checkpoint, compiler), job(tok, plan_prompt))
    gen = generator(backend, default_checkpoint, compiler)
    run(gen, job(tok, plan_prompt[:-5] + [tok.encode("x")[0]] * 5))  # leaves a long common prefix
    again = job(tok, plan_prompt)
    assert run(gen, again) == fresh
    assert again.reused_tokens == len(plan_prompt) - 5  # only the differing tail was prefilled
    system_len = 300
    pinned = generator(backend, default_checkpoint, compiler, tmp_path)
    assert not pinned.pin("amr", plan_prompt[:system_len]).from_disk
    run(pinned, job(tok, list(reversed(plan_prompt))))  # the buffer now holds something else
    from_pin = job(tok, plan_prompt)
    assert run(pinned, from_pin) == fresh
    assert from_pin.reused_tokens == system_len and from_pin.pinned_prompt == "amr"


def test_pinned_kv_is_read_back_from_disk_and_torn_files_are_recomputed(default_checkpoint, compiler, plan_prompt,
                                                                         tmp_path):
    tok = default_checkpoint.tokenizer
    first = generator(TorchBackend(default_checkpoint, MAX_LEN, model_digest="m"), default_checkpoint, compiler,
                      tmp_path)
    assert not first.pin("amr", plan_prompt[:200]).from_disk
    expected = run(first, job(tok, plan_prompt))
    restarted = generator(TorchBackend(default_checkpoint, MAX_LEN, model_digest="m"), default_checkpoint,
                          compiler, tmp_path)
    assert restarted.pin("amr", plan_prompt[:200]).from_disk
    reloaded = job(tok, plan_prompt)
    assert run(restarted, reloaded) == expected and reloaded.prefilled_tokens == len(plan_prompt) - 200
    (path,) = tmp_path.glob("*.npz")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a torn write
    torn = generator(TorchBackend(default_checkpoint, MAX_LEN, model_digest="m"), default_checkpoint, compiler,
                     tmp_path)
    assert not torn.pin("amr", plan_prompt[:200]).from_disk
    assert run(torn, job(tok, plan_prompt)) == expected
    other_model = generator(TorchBackend(default_checkpoint, MAX_LEN, model_digest="other"), default_checkpoint,
                            compiler, tmp_path)
    assert not other_model.pin("amr", plan_prompt[:200]).from_disk  # keyed by the backend's identity


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 3}])
def test_a_preempted_job_resumes_where_it_stopped(default_checkpoint, backend, compiler, plan_prompt, sampling):
    tok = default_checkpoint.tokenizer
    gen = generator(backend, default_checkpoint, compiler)
    whole = run(gen, job(tok, plan_prompt, rid="whole", **sampling))
    interrupted = job(tok, plan_prompt, rid="cut", **sampling)
    assert not gen.run(interrupted, lambda *_: None, should_yield=lambda: len(interrupted.generated) == 6)
    assert len(interrupted.generated) == 6 and interrupted.preemptions == 1
    run(gen, job(tok, plan_prompt[:40], rid="urgent"))  # something else uses the buffer meanwhile
    assert gen.run(interrupted, lambda *_: None)
    assert interrupted.generated == whole


def test_forward_rejects_positions_beyond_the_buffer(backend):
    with pytest.raises(ValueError):
        backend.forward([1, 2], MAX_LEN - 1)
    with pytest.raises(ValueError):
        backend.forward([], 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_gives_the_eager_tokens(default_checkpoint, compiler, plan_prompt):
    tok = default_checkpoint.tokenizer
    graphed = TorchBackend(default_checkpoint, MAX_LEN, device="cuda")
    eager = TorchBackend(default_checkpoint, MAX_LEN, device="cuda", cuda_graph=False)
    assert graphed.uses_cuda_graph and not eager.uses_cuda_graph
    tokens = [run(generator(b, default_checkpoint, compiler), job(tok, plan_prompt, max_tokens=48))
              for b in (graphed, eager)]
    assert tokens[0] == tokens[1]


@pytest.fixture(scope="module")
def onnx_int4_a8(default_model_path):
    """A graph whose one-token forward differs from its multi-token rows (int8 activations)."""
    pytest.importorskip("onnxruntime_genai", reason="needs the onnx extra: pip install 'fleetserve[onnx]'")
    from edged.backends.onnx_backend import OnnxBackend
    from edged.export import export_onnx

    return OnnxBackend(export_onnx(default_model_path, "int4-a8"), max_len=MAX_LEN, threads=1)


class _FixedCosts(ForwardCosts):
    """Forward costs given, not measured (tests must not depend on timing)."""

    def __init__(self, seconds: dict[int, float]) -> None:
        super().__init__()
        self._seconds = dict(seconds)

    def record(self, tokens: int, seconds: float) -> None:
        pass


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 11}], ids=["greedy", "seeded"])
@pytest.mark.parametrize("constrained", [False, True], ids=["text", "plan-schema"])
@pytest.mark.parametrize("kind", ["torch", "onnx-int4-a8"])
def test_speculation_changes_no_token(request, default_checkpoint, compiler, plan_prompt, sampling, constrained,
                                      kind):
    """Drafts (the grammar's forced text, n-grams of the prompt) are verified in one forward
    and kept only where sampling confirms them: the same tokens as one token per forward. Rows
    are given as free (not timed), so every draft found goes."""
    tok = default_checkpoint.tokenizer
    backend = request.getfixturevalue("backend" if kind == "torch" else "onnx_int4_a8")
    spec = grammar_spec(fleet_plan_format()) if constrained else None
    outputs = []
    for speculation in (SpeculationConfig(enabled=False), SpeculationConfig()):
        gen = Batch1Generator(backend, tok, compiler, speculation=speculation)
        gen.forward_costs = _FixedCosts({1: 1.0})
        j = job(tok, plan_prompt, max_tokens=48, **sampling)
        j.spec = spec
        outputs.append((run(gen, j), j))
    (plain, plain_job), (fast, fast_job) = outputs
    assert fast == plain
    assert plain_job.drafted_tokens == 0 and 0 < fast_job.accepted_drafts <= fast_job.drafted_tokens
    if constrained:  # the plan's forced texts were learned as the model spelled them, for later drafts
        assert len(gen.spellings) > 0
        for text, tokens in gen.spellings.items():
            assert tok.decode(list(tokens)).startswith(text)


class _RowPathBackend:
    """The torch backend declared not row-exact, recording how many tokens each forward sends."""

    row_exact = False

    def __init__(self, inner):
        self.inner = inner
        self.sizes: list[tuple[int, int]] = []  # (tokens, start) per forward

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, token_ids, start):
        self.sizes.append((len(token_ids), start))
        return self.inner.forward(token_ids, start)

    def forward_rows(self, token_ids, start):
        self.sizes.append((len(token_ids), start))
        return self.inner.forward_rows(token_ids, start)


@pytest.mark.parametrize("speculation", [SpeculationConfig(enabled=False), SpeculationConfig()], ids=["plain", "spec"])
def test_a_backend_that_is_not_row_exact_never_gets_one_token_alone(default_checkpoint, backend, compiler, plan_prompt,
                                                                    speculation):
    tok = default_checkpoint.tokenizer
    expected = run(generator(backend, default_checkpoint, compiler), job(tok, plan_prompt))
    recording = _RowPathBackend(backend)
    gen = Batch1Generator(recording, tok, compiler, speculation=speculation)
    assert run(gen, job(tok, plan_prompt)) == expected
    assert len(recording.sizes) > 1 and all(n >= 2 for n, start in recording.sizes if start > 0)



@pytest.mark.parametrize("second_token_costs", [1.0, 10.0], ids=["cheap-rows", "dear-rows"])
def test_drafts_go_only_where_their_rows_pay(default_checkpoint, backend, compiler, plan_prompt, second_token_costs):
    """Where a forward's extra rows cost next to nothing every draft goes; where a second token
    costs ten times the first, a job confirming half its drafts sends none (same tokens)."""
    tok = default_checkpoint.tokenizer
    expected = run(generator(backend, default_checkpoint, compiler), job(tok, plan_prompt, max_tokens=48))
    gen = Batch1Generator(backend, tok, compiler)
    gen.forward_costs = _FixedCosts({1: 1.0, 2: second_token_costs})
    j = job(tok, plan_prompt, max_tokens=48)
    assert run(gen, j) == expected
    assert (j.drafted_tokens > 0) == (second_token_costs == 1.0)


class _RecordedCosts(ForwardCosts):
    """Forward costs that keep every measurement's token count."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[int] = []

    def record(self, tokens: int, seconds: float) -> None:
        self.counts.append(tokens)
        super().record(tokens, seconds)


def test_the_generator_times_each_decode_forward(default_checkpoint, backend, compiler, plan_prompt):
    tok = default_checkpoint.tokenizer
    recording = _RowPathBackend(backend)
    recording.row_exact = True
    gen = Batch1Generator(recording, tok, compiler)
    gen.forward_costs = _RecordedCosts()
    run(gen, job(tok, plan_prompt, max_tokens=24))
    assert gen.forward_costs.counts == [tokens for tokens, _ in recording.sizes[1:]]  # all but the prefill
    assert all(gen.forward_costs.of(n) > 0 for n in gen.forward_costs.counts)
