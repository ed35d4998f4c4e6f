"""llama-server's ``/completion`` fed token ids: greedy continuations with each position's top-2
log-probabilities, and teacher-forced top-2s along a given continuation.

Token ids, not text, so both sides read exactly the same prompt (no second chat template, no
second tokenizer). Log-probs are the server's pre-sampling ones (``post_sampling_probs`` off):
a softmax over the whole vocabulary, as ours are.
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Sequence
from typing import Any

from cloudd.llamacpp_agreement.agreement import TopTwo
from edged.llamacpp_peer import LlamaServer


def greedy(server: LlamaServer, prompt: Sequence[int], tokens: int) -> tuple[list[int], list[TopTwo]]:
    """The server's greedy continuation of ``prompt`` (exactly ``tokens``, EOS ignored) and its
    top-2 at each of those positions."""
    return parse_completion(_post(server, prompt, tokens), tokens)


def teacher_forced(server: LlamaServer, prompt: Sequence[int], continuation: Sequence[int]) -> list[TopTwo]:
    """The server's top-2 at each position of ``continuation``: one one-token completion per
    prefix, ``prompt + continuation[:i]``. The slot keeps its cache between calls
    (``cache_prompt``), so each computes only the tokens that are new to it."""
    tops = []
    for i in range(len(continuation)):
        _, (top,) = parse_completion(_post(server, [*prompt, *continuation[:i]], 1), 1)
        tops.append(top)
    return tops


def parse_completion(body: dict[str, Any], tokens: int) -> tuple[list[int], list[TopTwo]]:
    """(generated ids, top-2 per generated position) of a non-streamed ``/completion`` reply that
    asked for ``return_tokens`` and ``n_probs: 2``. RuntimeError when it holds other than
    ``tokens`` positions or fewer than two candidates at one (the reply shape of another
    llama.cpp version)."""
    ids = [int(t) for t in body.get("tokens", [])]
    probs = body.get("completion_probabilities", [])
    if len(ids) != tokens or len(probs) != tokens:
        raise RuntimeError(f"llama-server returned {len(ids)} tokens and {len(probs)} probability rows "
                           f"for {tokens} asked; keys: {sorted(body)}")
    tops = []
    for position in probs:
        top = position.get("top_logprobs", [])
        if len(top) < 2:
            raise RuntimeError(f"llama-server sent no top-2 log-probs: {json.dumps(position)[:300]}")
        tops.append(TopTwo((int(top[0]["id"]), int(top[1]["id"])), (float(top[0]["logprob"]), float(top[1]["logprob"]))))
    return ids, tops


def _post(server: LlamaServer, prompt: Sequence[int], tokens: int) -> dict[str, Any]:
    body = {"prompt": [int(t) for t in prompt], "n_predict": tokens, "temperature": 0, "n_probs": 2,
            "cache_prompt": True, "ignore_eos": True, "return_tokens": True, "stream": False}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    try:
        conn.request("POST", "/completion", json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise RuntimeError(f"llama-server /completion: HTTP {response.status}: {raw[:300]!r}")
    reply = json.loads(raw)
    if reply.get("tokens_evaluated") not in (None, len(prompt)):
        # NOTE: a BOS or template the server added would shift every position against ours.
        raise RuntimeError(f"llama-server read {reply['tokens_evaluated']} prompt tokens, {len(prompt)} sent")
    return reply
