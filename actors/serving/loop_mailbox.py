"""Calls from the engine thread onto one event loop, one wake-up at a time.

A step ends with an event for every running request; waking the event loop once per event
(``call_soon_threadsafe``: a write to its self-pipe, then the loop thread contending for the
GIL with the engine thread) costs the engine thread that many hand-offs per step. A mailbox
collects what the engine thread posts and wakes the loop once for all of it.

Invariants: every posted call runs on the loop exactly once, in posting order, unless the
loop closed first; at most one flush is scheduled at any time, so
a burst of posts before the loop runs costs one wake-up.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.wakeups = 0  # flushes scheduled so far
        self._lock = threading.Lock()
        self._items: list[tuple[Callable[[Any], None], Any]] = []
        self._scheduled = False

    def post(self, fn: Callable[[Any], None], item: Any) -> None:
        """Any thread: ``fn(item)`` on the loop, soon (``queue.put_nowait``, a socket's
        write). Dropped if the loop closed."""
        with self._lock:
            self._items.append((fn, item))
            if self._scheduled:
                return
            self._scheduled = True
            self.wakeups += 1
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            with self._lock:
                self._items.clear()
                self._scheduled = False

    def _flush(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._scheduled = False
        for fn, item in items:
            fn(item)


_MAILBOXES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = (
    weakref.WeakKeyDictionary()
)
_MAILBOXES_LOCK = threading.Lock()


def mailbox_of(loop: asyncio.AbstractEventLoop) -> LoopMailbox:
    """The one mailbox of ``loop`` (made on first use; gone with the loop)."""
    with _MAILBOXES_LOCK:
        box = _MAILBOXES.get(loop)
        if box is None:
            box = _MAILBOXES[loop] = LoopMailbox(loop)
        return box
