"""The OpenAI-compatible HTTP surface of cloudd, plus ``/health`` and Prometheus ``/metrics``:
an ASGI app (Starlette) under uvicorn, as vLLM and SGLang serve the OpenAI API.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (a text prompt, tokenized
here), ``GET /v1/models``, ``GET /health``, ``GET /metrics``. Streaming is server-sent events
(``data: {...}`` lines, then ``data: [DONE]``). What a body may hold, and the 400 naming each
unsupported field, is ``request_body``'s; integers out of the protocol's range and bodies that
cannot be encoded are a 400 naming the field; a ``request_id`` of the tenant's own already in
flight is a 409 (two callers cannot share its replies).

Streams follow OpenAI's chunks. A stream sends at most one ``data:`` message per engine step: a
step's text, with ``finish_reason`` on the message of the step that ended the request, not in a
message of its own, which clients such as ``vllm bench serve`` count as one more inter-token gap
(a request ended by a stop string or a finished grammar may still get one: see
``calls.replies_by_step``). ``stream_options: {"include_usage": true}`` (only with ``"stream":
true``, else 400) adds ONE last chunk before ``[DONE]`` whose ``choices`` is ``[]`` and whose
``usage`` holds ``prompt_tokens``, ``completion_tokens`` (the tokens generated, counted by the
engine) and ``total_tokens``; every other chunk then carries ``"usage": null``. Without it no
chunk has a ``usage`` key, as in OpenAI's API.

Every request becomes a protocol ``generate`` sent to the core loop over ``inproc`` through one
shared ``FleetClient``, so HTTP and ZeroMQ clients share one queue, one policy and one ledger;
its id is kept in its tenant's namespace (``tenants``). A client that leaves, or stops reading,
has its request cancelled, streamed or not. Protocol errors map to statuses in
``response_body.STATUS`` (a quota's ``rejected`` is a 429 with ``Retry-After``).

Files: ``server`` (uvicorn on its thread; ``start_http_api``, ``HttpApi``), ``connection`` (the
h11 protocol: head deadline, strict framing, one log line per bad connection), ``app`` (routes,
keys, bodies, slots), ``limits``, ``tenants``, ``request_body``, ``response_body``, ``calls``
(the FleetClient call on the event loop), ``streaming`` (SSE, client leaving, write timeout).
"""

from cloudd.http_api.app import ApiContext
from cloudd.http_api.limits import HttpLimits
from cloudd.http_api.server import HttpApi, HttpServer, start_http_api

__all__ = ["ApiContext", "HttpApi", "HttpLimits", "HttpServer", "start_http_api"]
