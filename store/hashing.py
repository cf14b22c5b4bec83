"""Chained block hashes: the hash of a block covers every token before it.

``h_0 = H(seed, salt)``; ``h_i = H(h_{i-1}, tokens of block i)``. Two sequences share the
hash of block i exactly when they share all tokens of blocks 0..i (up to hash collisions,
which the block pool rules out by comparing tokens) and the same salt. The seed is fixed so
every process on every node computes the same hashes; a per-tenant salt keeps one tenant's
prefixes invisible to another. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_SEED = b"meridian-block-hash-v1"


def root_hash(salt: str | None = None) -> int:
    """The parent hash of block 0 for this tenant."""
    data = HASH_SEED + b"\x00" + (salt or "").encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hash(parent: int, tokens: Sequence[int]) -> int:
    """Hash of one full block given its parent's hash; a 64-bit unsigned int."""
    payload = struct.pack(f"<Q{len(tokens)}q", parent, *tokens)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def chained_block_hashes(
    tokens: Sequence[int], block_size: int, salt: str | None = None
) -> list[int]:
    """Hashes of the full blocks of ``tokens``, block 0 first."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return extend_block_hashes([], tokens, block_size, salt)


def extend_block_hashes(
    hashes: list[int], tokens: Sequence[int], block_size: int, salt: str | None = None
) -> list[int]:
    """Append to ``hashes`` (the chain of ``tokens``' first blocks) the hashes of any newly
    completed full blocks, and return it. Incremental: hashes already known are reused."""
    parent = hashes[-1] if hashes else root_hash(salt)
    for i in range(len(hashes), len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


WEIGHT_VERSION_MARK = "\x00weights-v"


def weight_version_salt(salt: str | None, version: int) -> str:
    """The block-hash salt of a request of ``salt`` (its tenant's) served by weights of
    ``version`` (>= 1): KV computed with other weights never matches its hashes."""
    return f"{salt or ''}{WEIGHT_VERSION_MARK}{version}"
