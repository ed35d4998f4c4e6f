"""edged's link to cloudd: one DEALER (CURVE-encrypted with the robot's key when configured),
heartbeats while escalations wait, and a circuit breaker.

An escalation is sent under ``<robot_id>/<request_id>`` (ids are only unique per robot; see
``escalated_id``) with the deadline that is left. Link failures (the cloud silent past ``link_timeout_s``, a refused
CURVE key, an internal error) count against the breaker; answers the cloud gives on purpose
(deadline, rejected, invalid request) do not, but still end the escalation. Callbacks run on
a waiter thread per escalation.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from dataclasses import replace

from edged.circuit import CircuitBreaker
from edged.escalation import EscalationConfig
from shared.protocol.messages import MAX_REQUEST_ID_CHARS, Error, ErrorCode, Escalation, Generate, Result
from shared.transport.client import ClientConfig, FleetClient, RequestFailed
from shared.transport.curve import ClientCurve

LINK_FAILURES = (ErrorCode.UNAVAILABLE, ErrorCode.INTERNAL)


def escalated_id(robot_id: str, request_id: str) -> str:
    """The id of a robot's request at cloudd: ``robot/request`` (ids are the robots' own, so
    two robots' may collide), the request id's digest instead when that is too long for the
    protocol. The same request always gets the same id: a retry stays a retry."""
    cloud_id = f"{robot_id}/{request_id}"
    if len(cloud_id) <= MAX_REQUEST_ID_CHARS:
        return cloud_id
    return f"{robot_id}/~{hashlib.blake2b(request_id.encode(), digest_size=16).hexdigest()}"


class CloudLink:
    def __init__(self, config: EscalationConfig, breaker: CircuitBreaker | None = None):
        if not config.cloud_endpoint:
            raise ValueError("[escalation] cloud_endpoint is empty: there is no cloud to link to")
        curve = (ClientCurve.from_files(config.server_public_key, config.robot_secret_key)
                 if config.server_public_key else None)
        self.config = config
        self.endpoint = config.cloud_endpoint
        self.breaker = breaker or CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s)
        self.client = FleetClient(self.endpoint, ClientConfig(
            timeout_s=config.link_timeout_s, heartbeat_s=config.heartbeat_s, retries=0, curve=curve))
        self._cloud_ids: dict[str, str] = {}
        self._lock = threading.Lock()

    def submit(self, msg: Generate, robot_id: str, deadline_ms: int | None,
               on_result: Callable[[Result], None], on_error: Callable[[Error], None]) -> None:
        cloud_id = escalated_id(robot_id, msg.request_id)
        call = self.client.start(replace(msg, request_id=cloud_id, robot_id=robot_id, deadline_ms=deadline_ms,
                                         escalation=Escalation.AUTO, stream=False, resume_from=0))
        with self._lock:
            self._cloud_ids[msg.request_id] = cloud_id

        def wait() -> None:
            try:
                result = call.result()
            except RequestFailed as e:
                if e.code in LINK_FAILURES:
                    self.breaker.record_failure()
                else:
                    self.breaker.record_success()  # the link works; the cloud said no
                on_error(e.error)
            else:
                self.breaker.record_success()
                on_result(result)
            finally:
                with self._lock:
                    self._cloud_ids.pop(msg.request_id, None)

        threading.Thread(target=wait, name=f"escalation {cloud_id}", daemon=True).start()

    def abandon(self, request_id: str) -> None:
        """Stop waiting for an escalation and ask the cloud to drop it (no reply awaited)."""
        with self._lock:
            cloud_id = self._cloud_ids.get(request_id)
        if cloud_id is not None:
            self.client.cancel_nowait(cloud_id)

    def close(self) -> None:
        self.client.close()
