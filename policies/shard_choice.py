"""Which KV store shard a prefix is written to.

- ``"key"``: the shard that owns the chain's first block, by rendezvous (highest random
  weight) hashing over the live shards. A conversation's every block (its prompt, each
  answer written back, each later turn) goes to one shard, wherever the replica that
  computed it runs, so one read brings the whole prefix; different prefixes spread over
  all shards, so the pool's capacity is the sum of its shards'. A shard that dies moves
  only its own keys; one that joins takes about ``1 / n`` of them.
- ``"local"``: the writer's own shard (its home, else one on its node, else any), so a
  replica reads what it wrote at memory speed; a prefix written by replicas on two nodes
  is split over two shards.

Hot blocks are copied to a reader's shard on top of either (the Conductor's replication).

Pure: stdlib only; the weight is a hash of the bytes of the key and the shard id, the same
in every process.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

PLACEMENTS = ("key", "local")


def check_placement(placement: str) -> str:
    if placement not in PLACEMENTS:
        raise ValueError(
            f"store placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}"
        )
    return placement


def key_owner(key: int, shards: Iterable[str]) -> str | None:
    """The shard of ``shards`` that owns ``key`` (None: no shard)."""
    return max(shards, key=lambda s: (_weight(key, s), s), default=None)


def local_choice(wanted: str | None, local: Iterable[str], shards: Iterable[str]) -> str | None:
    """``wanted`` if it is live, else the first live shard on the writer's node
    (``local``), else the first live one (None: none is live)."""
    live = sorted(shards)
    if wanted in live:
        return wanted
    on_node = sorted(local)
    return (on_node or live)[0] if on_node or live else None


def _weight(key: int, shard: str) -> int:
    digest = hashlib.blake2b(f"{int(key)}/{shard}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
