"""Grammar compiles in worker processes with a time limit (issue 48 finding 2: a schema
``pattern`` that took 89 s to compile held every other new grammar behind it on one thread)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr

from shared.engine.grammar.compile_pool import CompileTimeout
from shared.engine.grammar.compiler import GrammarCompiler
from shared.engine.grammar.response_format import GrammarSpec, fleet_plan_format, grammar_spec
from tests.grammar.conftest import MODEL_VOCAB

# Past the static limits (grammar_spec refuses it), so built directly: about 89 s to compile.
RUNAWAY = GrammarSpec("json_schema", json.dumps({"type": "string", "pattern": "((a{0,30}){0,30}){0,30}"}))
DIGITS = GrammarSpec("regex", "[0-9]{1,3}")


def test_a_runaway_compile_leaves_the_others_compiling_meanwhile(tokenizer):
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, compile_threads=1, workers=2, timeout_s=600)
    try:
        runaway = compiler.compile_async(RUNAWAY)
        quick = compiler.compile_async(DIGITS)
        assert isinstance(quick.result(timeout=300), xgr.CompiledGrammar)
        assert not runaway.done()  # still compiling in its own worker
    finally:
        compiler.close()
    with pytest.raises(ValueError, match="closed"):
        runaway.result(timeout=60)


def test_a_compile_past_its_time_limit_is_killed_and_answered_and_its_worker_replaced(tokenizer):
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, compile_threads=1, workers=1, timeout_s=1)
    try:
        with pytest.raises(CompileTimeout,
                           match=r"json schema took longer than 1 s of CPU time to compile \(grammar_compile_timeout_s\)"):
            compiler.compile(RUNAWAY)
        assert compiler.stats.failures == 1
        assert isinstance(compiler.compile(DIGITS), xgr.CompiledGrammar)  # by the one new worker
    finally:
        compiler.close()


def test_a_grammar_compiled_in_a_worker_matches_as_one_compiled_here(tokenizer, compiler):
    plan = grammar_spec(fleet_plan_format())
    compiled = compiler.compile(plan)
    matcher = xgr.GrammarMatcher(compiled)
    text = '{"steps": [{"skill": "undock", "args": {}}'  # a prefix of a plan
    accepted = all(matcher.accept_token(t) for t in tokenizer.encode(text))
    assert accepted and compiled.tokenizer_info.vocab_size == MODEL_VOCAB


def test_compile_workers_run_at_the_lowest_cpu_priority(tokenizer):
    """A long compile must take what the engine's steps leave, not slow every robot's stream."""
    import os

    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, compile_threads=1, workers=2, timeout_s=600)
    try:
        both = [compiler.compile_async(DIGITS), compiler.compile_async(GrammarSpec("regex", "[a-z]{1,3}"))]
        assert all(isinstance(f.result(timeout=300), xgr.CompiledGrammar) for f in both)  # each worker set up
        pids = [worker.process.pid for worker in compiler._pool._all]
        assert len(pids) == 2 and all(os.getpriority(os.PRIO_PROCESS, pid) == 19 for pid in pids)
    finally:
        compiler.close()


def test_the_limit_counts_the_workers_cpu_time_not_its_wait_for_the_cores():
    """A worker waiting (here: asleep) is not killed by the CPU limit, only by the wall-clock
    backstop; one computing is stopped once it has used the CPU limit."""
    import subprocess
    import sys

    from shared.engine.grammar.compile_pool import _Worker

    waiting = _Worker(subprocess.Popen(["sleep", "60"], stdout=subprocess.PIPE))
    spinning = _Worker(subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.PIPE))
    try:
        assert waiting.reply_within_cpu(cpu_limit_s=0.05, wall_limit_s=1.0) is None
        assert waiting.cpu_seconds() < 0.05  # it ended at the wall-clock backstop
        assert spinning.reply_within_cpu(cpu_limit_s=0.3, wall_limit_s=120.0) is None
        assert spinning.cpu_seconds() >= 0.3
    finally:
        for worker in (waiting, spinning):
            worker.process.kill()
            worker.process.wait()
            worker.process.stdout.close()


def test_workers_start_only_when_a_compile_finds_none_free(tokenizer):
    """An engine's compiler costs no process until it compiles, and one at a time needs one."""
    compiler = GrammarCompiler(tokenizer, MODEL_VOCAB, compile_threads=1, workers=2, timeout_s=600)
    try:
        assert len(compiler._pool._all) == 0
        compiler.compile(DIGITS)
        compiler.compile(GrammarSpec("regex", "[a-z]{1,3}"))
        assert len(compiler._pool._all) == 1
    finally:
        compiler.close()
    with pytest.raises(ValueError, match="closed"):
        compiler._pool.compile(GrammarSpec("regex", "[a-z]{1,4}"))
