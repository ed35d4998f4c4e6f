"""HTTP tenants and their request id namespaces.

A tenant is an API key (its name) or, when the API has no keys, the one anonymous tenant of the
loopback API. Each tenant's ``request_id`` lives in a namespace of its own: the id the core
loop sees is ``/http/<key name>/<client id>`` (anonymous: ``/http//<client id>``). So:

- no tenant can take or squat a robot's id: with CURVE a robot's ids start with its key file's
  name and ``/``, and a file name is never empty and never holds ``/``, so no robot id starts
  with ``/``; without CURVE, robots are trusted loopback clients that share one namespace anyway;
- no tenant can touch another's: API key names (``cloudd.api_keys.NAME``) hold no ``/``, so two
  tenants' prefixes differ, and the anonymous tenant's empty name is no key's;
- an answer shows the client its own id only (the prefix is taken off).

Idempotency (a retry under the same id joins the request or gets its kept result) and the 409 of
an id in flight therefore only ever concern the tenant's own ids.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.protocol.messages import MAX_REQUEST_ID_CHARS, Generate

NAMESPACE = "/http/"


class BadRequestId(ValueError):
    """A client's ``request_id`` that cannot be namespaced: the message says why."""


@dataclass(frozen=True)
class Tenant:
    """Who asks over HTTP: ``name`` is the API key's name ("" without API keys)."""

    name: str

    @property
    def prefix(self) -> str:
        return f"{NAMESPACE}{self.name}/"

    @property
    def max_id_chars(self) -> int:
        """The longest client id that still fits the protocol's bound once prefixed."""
        return MAX_REQUEST_ID_CHARS - len(self.prefix)

    def core_request(self, request: Generate) -> Generate:
        """The client's ``request`` as the core loop gets it: its id in this tenant's namespace
        and, for an API key's tenant, served as the key (its ``robot_id``; a key's name is never
        empty). BadRequestId if the id does not fit once prefixed."""
        if len(request.request_id) > self.max_id_chars:
            raise BadRequestId(f"request_id must be 1 to {self.max_id_chars} characters, got {len(request.request_id)}")
        return replace(request, request_id=self.prefix + request.request_id, robot_id=self.name or request.robot_id)
