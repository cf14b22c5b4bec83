"""Errors of the KV store shards and the KV transfer layer.

Each message says what is wrong and what to change. A *miss* is not an error: lookups of a
block that is absent (never written, evicted, or on a dead shard) return ``None`` or a
shorter prefix, and the caller recomputes.
"""

from __future__ import annotations

from errors import MeridianError


class KVStoreError(MeridianError):
    """Base class of store and transfer errors."""


class InvalidBlockError(KVStoreError, ValueError):
    """Bad input: a hash that is not a 64-bit unsigned int, empty or oversized data, ..."""

    http_status = 400


class StoreFullError(KVStoreError):
    """No room: every block that could make room is pinned (or a write is in progress)."""

    http_status = 503


class WriteStateError(KVStoreError, RuntimeError):
    """A commit/abort without a matching begin, or a second begin of the same block."""


class TransferError(KVStoreError, RuntimeError):
    """A transfer failed: the remote end is gone, or an offset lies outside its segment."""


class BackendUnavailableError(KVStoreError, RuntimeError):
    """A transfer backend was asked for but cannot run here (its package is missing, or
    the two ends cannot reach each other through it)."""
