"""Where the Conductor has each request's stored prefix read (DualPath): on the prefill
replica's side or the decode replica's, by a fixed mode or, in ``"dual"`` mode, on the side
whose read queue (stored blocks assigned to it and not yet read) is shorter
(``policies.dualpath.pick_path``). Each replica stands for its own node's storage link;
when both sides' links have a known rate (``storage_rates``: emulated link budgets), the
queues are measured in time: the side whose read of the request would end first.

Invariant: ``queue[r]`` is the sum of the hit blocks of the attempts reading on replica
``r`` whose prefill has not ended (done, failed or given up: ``done(key)``).
"""

from __future__ import annotations

from policies.dualpath import DECODE_PATH, PREFILL_PATH, pick_path
from store.transfer.links import LinkBudget

READ_PATHS = (PREFILL_PATH, DECODE_PATH, "dual")
Rates = tuple[float, float] | None  # (prefill side, decode side) blocks per second


def storage_rates(prefill: LinkBudget | None, decode: LinkBudget | None, block_bytes: int) -> Rates:
    """Blocks per second one replica's storage link reads on each side, when both sides'
    storage links are limited (else None: rates unknown)."""
    if prefill is None or decode is None or not prefill.storage_bps or not decode.storage_bps:
        return None
    return prefill.storage_bps / block_bytes, decode.storage_bps / block_bytes


class ReadPaths:
    def __init__(self, mode: str, rates: Rates = None) -> None:
        if mode not in READ_PATHS:
            raise ValueError(f"read_path must be one of {', '.join(READ_PATHS)}, got {mode!r}")
        self.mode = mode
        self.rates = rates
        self.queue: dict[str, int] = {}  # replica id -> stored blocks it is reading
        self._reads: dict[str, tuple[str, int]] = {}  # attempt key -> (replica, blocks)
        self.counts = {PREFILL_PATH: 0, DECODE_PATH: 0}  # requests read on each side

    def choose(self, key: str, hit_blocks: int, prefill_id: str, decode_id: str) -> str:
        """The side that reads this attempt's ``hit_blocks`` stored blocks; queued there."""
        if hit_blocks <= 0:
            return PREFILL_PATH
        path = self.mode
        if path == "dual":
            rates = None
            if self.rates is not None:
                rates = {prefill_id: self.rates[0], decode_id: self.rates[1]}
            path = pick_path(prefill_id, decode_id, self.queue, rates, hit_blocks)
        side = prefill_id if path == PREFILL_PATH else decode_id
        self.record(key, path, side, hit_blocks)
        return path

    def record(self, key: str, path: str, side: str, hit_blocks: int) -> None:
        """This attempt reads ``hit_blocks`` stored blocks on replica ``side`` (chosen
        elsewhere, e.g. by DualPath's scheduler): queued there until ``done``."""
        if hit_blocks <= 0:
            return
        self.queue[side] = self.queue.get(side, 0) + hit_blocks
        self._reads[key] = (side, hit_blocks)
        self.counts[path] += 1

    def token_rates(
        self, block_size: int, prefill_ids: list[str], decode_ids: list[str]
    ) -> dict[str, float] | None:
        """Tokens per second each replica's storage link reads (``read_rates`` of
        ``policies.dualpath``; None: rates unknown)."""
        if self.rates is None:
            return None
        pr, dr = self.rates
        return {i: pr * block_size for i in prefill_ids} | {i: dr * block_size for i in decode_ids}

    def tokens(self, block_size: int) -> dict[str, int]:
        """The read queues in tokens (the unit of ``policies.dualpath``)."""
        return {side: blocks * block_size for side, blocks in self.queue.items()}

    def done(self, key: str) -> None:
        """The attempt's prefill ended (or was given up): its blocks leave the queue."""
        side, hit = self._reads.pop(key, ("", 0))
        if side:
            self.queue[side] -= hit
