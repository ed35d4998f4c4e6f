"""Assemble edged from its config: backend, pinned prompts, local lane, escalation, server."""

from __future__ import annotations

import logging
import time

from edged.backends.factory import make_backend
from edged.cloud_link import CloudLink
from edged.config import EdgeConfig
from edged.escalation import EscalationPolicy
from edged.generation import Batch1Generator
from edged.local_worker import LocalWorker
from edged.server import EdgeServer
from shared.engine.grammar.compiler import GrammarCompiler
from shared.engine.grammar.response_format import fleet_plan_format, grammar_spec
from shared.model.checkpoint import load_checkpoint
from shared.model.fetch import ensure_default_model, resolve_model
from shared.model.summary import ModelSummary

log = logging.getLogger(__name__)


def build_server(config: EdgeConfig) -> EdgeServer:
    """A ready server: the model loaded, every pinned prompt prefilled (or read from disk)."""
    b = config.backend
    model_path = resolve_model(b.model) if b.model else ensure_default_model()
    checkpoint = load_checkpoint(model_path)
    backend = make_backend(b.kind, b.quant, checkpoint, model_path, b.max_len, b.threads, b.device,
                           products=b.products)
    if backend.products is not None:
        log.info("%s %s: block products in %s (configured %s)", b.kind, b.quant, backend.products, b.products)
    # NOTE: one compile process (about 300 MB each): a robot's clients are its own processes, and
    # its memory is the robot's
    compiler = GrammarCompiler(checkpoint.tokenizer, backend.vocab_size, workers=1)
    compiler.precompile([grammar_spec(fleet_plan_format())])
    generator = Batch1Generator(backend, checkpoint.tokenizer, compiler, pinned_dir=config.serve.pinned_dir,
                                speculation=config.speculation)
    worker = LocalWorker(generator)
    for pin in config.pinned:
        ids = checkpoint.tokenizer.encode_chat(pin.messages(config.base_dir), add_generation_prompt=False)
        start = time.monotonic()
        prompt = generator.pin(pin.name, ids)
        seconds = time.monotonic() - start
        if not prompt.from_disk:
            worker.rate.observe_prefill(len(ids), seconds)
        log.info("pinned %r: %d tokens, %s in %.2f s", pin.name, len(ids),
                 "loaded from disk" if prompt.from_disk else "prefilled", seconds)
    policy = EscalationPolicy(config.escalation, local_context=backend.max_len)
    cloud = CloudLink(config.escalation) if config.escalation.cloud_endpoint else None
    return EdgeServer(worker, compiler, policy, cloud, config.serve,
                      model=ModelSummary.of(model_path.stem, checkpoint.config))
