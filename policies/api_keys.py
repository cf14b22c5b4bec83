"""Matching a presented API key against the configured ones without a timing side channel.

Both sides are hashed (SHA-256) first, so every comparison is between 32-byte digests
whatever the keys' lengths, and the presented digest is compared with *every* configured
one by ``hmac.compare_digest``, with no early exit: the time taken says neither how much of
a key matched nor which key did. Only digests are kept, not the keys themselves.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


def key_digest(key: str) -> bytes:
    # surrogatepass: any Python str hashes (a header can carry odd bytes), never raises
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyRing(Generic[T]):
    """Configured keys, each with a value (its tenant); ``match`` finds a presented key's."""

    def __init__(self, entries: Mapping[str, T]) -> None:
        self._entries = [(key_digest(k), v) for k, v in entries.items()]

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, presented: str) -> T | None:
        digest = key_digest(presented)
        found: T | None = None
        for known, value in self._entries:
            if hmac.compare_digest(known, digest):  # no break: always compare them all
                found = value
        return found
