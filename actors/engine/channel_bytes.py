"""The size a worker group's compiled-graph channels start at, set in every process of the
group: its driver and each of its worker actors."""

from __future__ import annotations

import sys

# Channels start at this many bytes a message, and grow when a larger message comes.
CHANNEL_BYTES = 1 << 24


def use_channel_bytes() -> None:
    """Start this process's compiled-graph channels at ``CHANNEL_BYTES`` or more: what
    ``RAY_CGRAPH_buffer_size_bytes`` does, but set in the process itself. (A variable passed
    as a runtime environment makes Ray start each worker through its environment set-up, half
    a second of CPU, and keeps it from reusing an idle worker; the compile option alone makes
    the graph's teardown hang.) A process without Ray (a worker run in process) has no
    channels: nothing to do."""
    if "ray" not in sys.modules:
        return
    from ray.dag.context import DAGContext

    context = DAGContext.get_current()
    context.buffer_size_bytes = max(context.buffer_size_bytes, CHANNEL_BYTES)
