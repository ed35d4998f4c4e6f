"""Robot-fleet request traces (one JSON object per line; ../shared/workloads/README.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TraceRequest:
    id: str
    robot: str
    kind: str  # plan | replan | urgent
    priority: int  # 0 normal, 1 urgent
    arrival_s: float
    messages: tuple[dict, ...]
    max_tokens: int


def load_trace(path: Path | str, limit: int | None = None) -> list[TraceRequest]:
    """Read a trace; ValueError names the line and field of a malformed entry."""
    requests = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(requests) >= limit:
                break
            try:
                d = json.loads(line)
                requests.append(
                    TraceRequest(
                        id=str(d["id"]),
                        robot=str(d.get("robot", "")),
                        kind=str(d.get("kind", "plan")),
                        priority=int(d.get("priority", 0)),
                        arrival_s=float(d.get("arrival_s", 0.0)),
                        messages=tuple(d["messages"]),
                        max_tokens=int(d.get("max_tokens", 128)),
                    )
                )
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: bad trace entry ({e!r})") from e
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def bundled_trace() -> Path:
    """The small trace shipped with cloudd (8 robots, 32 requests), used by `make demo`."""
    return Path(__file__).parent / "traces" / "fleet-demo.jsonl"
