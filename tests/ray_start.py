"""``ray.init`` for test processes, once more when a local node times out at start-up.

Ray gives a new local node 30 s (a constant in ``ray._private.node.Node``) to register its
raylet with its GCS. On this 2-core machine, while the previous module's cluster is still
winding down, that was missed once in four full runs (the GCS did not answer its first
request within the 30 s: "The current node timed out during startup"). That is the
machine's load, not a broken Ray: the node is started once more, saying so. Any other
failure, or a second timeout, is raised as it is."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

STARTUP_TIMEOUT = "timed out during startup"


def retrying_startup_timeout(init: Callable[..., Any], shutdown: Callable[[], Any]) -> Any:
    """``init`` (``ray.init``'s signature) that calls ``shutdown`` and then ``init`` once more
    when the first call's node timed out at start-up."""

    def start(*args: Any, **kwargs: Any) -> Any:
        try:
            return init(*args, **kwargs)
        except Exception as e:
            if STARTUP_TIMEOUT not in str(e):
                raise
            print(f"ray.init: {e} Starting the node once more.", file=sys.stderr)
            shutdown()
            return init(*args, **kwargs)

    start.retries_startup_timeout = True  # type: ignore[attr-defined]
    return start


def install() -> None:
    """Route this process's ``ray.init`` through ``retrying_startup_timeout`` (once)."""
    import ray

    if not getattr(ray.init, "retries_startup_timeout", False):
        ray.init = retrying_startup_timeout(ray.init, ray.shutdown)
