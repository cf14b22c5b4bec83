"""Talking to a spawned child process over a pipe, with bounded waits (plain
``multiprocessing``, where Ray is not there: the GPU benches and tests)."""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

WAIT_S = 600  # bounds every wait on a child; never reached when things work


def guarded(body: Callable[..., None], conn: Any, *args: Any) -> None:
    """Run ``body(conn, *args)`` in the child; a failure is sent as ``("error", traceback)``
    before it propagates, so the parent reports it instead of waiting."""
    try:
        body(conn, *args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def expect(conn: Any, kind: str, proc: Any, wait_s: float = WAIT_S) -> tuple[Any, ...]:
    """The next message from ``proc``, which must be ``(kind, ...)``: its fields after the
    kind. AssertionError if the child died, failed or did not answer within ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while not conn.poll(1.0):
        assert proc.is_alive(), f"the child died (exit code {proc.exitcode}) before {kind!r}"
        assert time.monotonic() < deadline, f"no {kind!r} from the child within {wait_s} s"
    msg = conn.recv()
    assert msg[0] != "error", f"the child failed:\n{msg[1]}"
    assert msg[0] == kind, msg
    return tuple(msg[1:])
