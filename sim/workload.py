"""A request as a workload describes it (no tokens yet), and a time-scaling helper.

``hash_ids`` are Mooncake-style prefix-block ids: two requests whose first k ids agree share
their first k blocks of ``trace_block_size`` tokens. ``None`` means the trace says nothing
about prefixes (each request's prompt is then unique).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival: float  # seconds from the start of the trace
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None
    session_id: str | None = None
    trace_block_size: int = 512


def scale_time(requests: Sequence[TraceRequest], speed: float) -> list[TraceRequest]:
    """Replay ``speed`` times faster (arrival times divided by ``speed``)."""
    if speed <= 0:
        raise ValueError("speed must be positive")
    return [replace(r, arrival=r.arrival / speed) for r in requests]
