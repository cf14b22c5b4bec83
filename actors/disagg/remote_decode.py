"""How a prefill replica reaches a decode replica actor (``PrefillTask.decode``): the
replica's ``admit`` as a Ray call, so the prefill side holds the same ``admit`` whether the
decode replica is in its process or an actor."""

from __future__ import annotations

from typing import Any

from store.kv_cache_ipc import KVWriteDone


class RemoteDecode:
    def __init__(self, handle: Any) -> None:
        self.handle = handle

    def admit(
        self,
        key: str,
        first_token: int,
        first_logprob: Any = None,
        cached_tokens: int = 0,
        receipts: tuple[KVWriteDone, ...] = (),
    ) -> None:
        self.handle.admit.remote(key, first_token, first_logprob, cached_tokens, receipts)
