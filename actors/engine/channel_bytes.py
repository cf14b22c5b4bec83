"""The size a worker group's actors start their compiled-graph channel buffers at."""

from __future__ import annotations

import sys

CHANNEL_BYTES = 1 << 24


def use_channel_bytes() -> None:
    """In a Ray actor's process (a worker of a group), start compiled-graph channel buffers
    at ``CHANNEL_BYTES`` or more: what ``RAY_CGRAPH_buffer_size_bytes`` in the worker's
    environment did, set in the process instead. (Passed as a runtime environment, the
    variable made Ray start each worker through its environment set-up, half a second of
    CPU, and kept it from reusing an idle worker; the compile option alone makes the graph's
    teardown hang.) Elsewhere nothing changes: a group's driver (a replica, a test) keeps
    Ray's default, as it did with the variable (it had imported ``ray.dag.context``, which
    reads it, before the executor set it); a worker run in process has no channels."""
    if "ray" not in sys.modules:
        return
    import ray

    if not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return
    from ray.dag.context import DAGContext

    context = DAGContext.get_current()
    context.buffer_size_bytes = max(context.buffer_size_bytes, CHANNEL_BYTES)
