"""How a prefill replica reaches a decode replica actor (``PrefillTask.decode``): the
replica's ``admit`` (``actors/disagg/decode.py``, its signature) as a Ray call, so the prefill
side holds the same ``admit`` whether the decode replica is in its process or an actor."""

from __future__ import annotations

from typing import Any


class RemoteDecode:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def admit(self, *args: Any, **kwargs: Any) -> None:
        """``DecodeReplica.admit``'s arguments, sent without waiting for the call."""
        self.handle.admit.remote(*args, **kwargs)
