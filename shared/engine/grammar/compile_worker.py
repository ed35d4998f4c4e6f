"""The loop of one grammar compile process (``compile_pool`` starts it as a plain subprocess:
no fork of the engine, and no re-import of the daemon's ``__main__`` as multiprocessing's
spawn would do).

Protocol on its stdin and stdout, one JSON object a line, no pickle: its first line in is the
``TokenizerInfo.serialize_json()`` text and the number of xgrammar threads
(``{"tokenizer_info": ..., "threads": n}``); it answers ``{"ready": true}`` once its compiler is
built. Then for each ``{"kind": ..., "source": ...}`` (a GrammarSpec) it answers
``{"compiled": n}`` followed by the n bytes of ``CompiledGrammar.serialize_json()`` (megabytes:
sent raw, so the engine's process never parses them as a Python string) or ``{"error": <the
ValueError's message>}``. It returns when its stdin closes. A compile that runs away is the parent's to
kill: nothing here times it. What xgrammar prints goes to stderr, never into the protocol.

A compile is background work beside the engine's steps, which every streaming robot waits on: the
process runs at the lowest CPU priority (``nice`` 19), so on a machine with few cores a long
compile takes what the engine leaves instead of slowing every stream (a 10 s nested-repeat
schema had stretched another robot's token gaps 4.7x).
"""

from __future__ import annotations

import json
import os
import sys
from typing import BinaryIO

import xgrammar as xgr

from shared.engine.grammar.build import compile_spec
from shared.engine.grammar.response_format import GrammarSpec


def serve() -> None:
    """Compile what stdin asks for, answering on stdout, until stdin closes."""
    os.nice(19)
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # stray prints cannot corrupt a reply
    setup = json.loads(sys.stdin.readline())
    info = xgr.TokenizerInfo.deserialize_json(setup["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=setup["threads"], cache_enabled=False)
    _answer(replies, {"ready": True})
    for line in sys.stdin:
        ask = json.loads(line)
        try:
            compiled = compile_spec(compiler, GrammarSpec(ask["kind"], ask["source"])).serialize_json().encode()
        except ValueError as exc:
            _answer(replies, {"error": str(exc)})
            continue
        _answer(replies, {"compiled": len(compiled)}, compiled)


def _answer(replies: BinaryIO, reply: dict, payload: bytes = b"") -> None:
    replies.write(json.dumps(reply).encode() + b"\n" + payload)
    replies.flush()


if __name__ == "__main__":
    serve()
