"""Where the Conductor has each request's stored prefix read (DualPath): on the prefill
replica's side or the decode replica's, by a fixed mode or, in ``"dual"`` mode, on the side
whose read queue (stored blocks assigned to it and not yet read) is shorter
(``policies.dualpath.pick_path``). Each replica stands for its own node's storage link.

Invariant: ``queue[r]`` is the sum of the hit blocks of the attempts reading on replica
``r`` whose prefill has not ended (done, failed or given up: ``done(key)``).
"""

from __future__ import annotations

from policies.dualpath import DECODE_PATH, PREFILL_PATH, pick_path

READ_PATHS = (PREFILL_PATH, DECODE_PATH, "dual")


class ReadPaths:
    def __init__(self, mode: str) -> None:
        if mode not in READ_PATHS:
            raise ValueError(f"read_path must be one of {', '.join(READ_PATHS)}, got {mode!r}")
        self.mode = mode
        self.queue: dict[str, int] = {}  # replica id -> stored blocks it is reading
        self._reads: dict[str, tuple[str, int]] = {}  # attempt key -> (replica, blocks)
        self.counts = {PREFILL_PATH: 0, DECODE_PATH: 0}  # requests read on each side

    def choose(self, key: str, hit_blocks: int, prefill_id: str, decode_id: str) -> str:
        """The side that reads this attempt's ``hit_blocks`` stored blocks; queued there."""
        if hit_blocks <= 0:
            return PREFILL_PATH
        path = self.mode
        if path == "dual":
            path = pick_path(prefill_id, decode_id, self.queue)
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

    def tokens(self, block_size: int) -> dict[str, int]:
        """The read queues in tokens (the unit of ``policies.dualpath``)."""
        return {side: blocks * block_size for side, blocks in self.queue.items()}

    def done(self, key: str) -> None:
        """The attempt's prefill ended (or was given up): its blocks leave the queue."""
        side, hit = self._reads.pop(key, ("", 0))
        if side:
            self.queue[side] -= hit
