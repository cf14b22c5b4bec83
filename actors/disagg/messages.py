"""Typed messages between a disaggregated deployment's Conductor and its replicas.

Every attempt at a request has its own ``key`` (request id and attempt number), so a
message from an attempt the Conductor has given up on (its replica died, it was placed
again) is recognised and dropped.

    Conductor -> prefill:  PrefillTask          (prefill.submit)
    prefill  -> decode:    admit(key, token)    (directly, once the KV has arrived)
    replica  -> Conductor: Report               (the Conductor's long poll, replica.report)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.engine.outputs import RequestOutput, StreamDelta
from policies.request import Request

if TYPE_CHECKING:  # the router and the ingress import these messages without torch
    from actors.disagg.kv_stream import KVDestination


@dataclass(frozen=True)
class PrefillTask:
    key: str
    request: Request
    dest: KVDestination  # the decode replica's blocks reserved for the whole request
    # has admit(key, first_token, ...): the decode replica, or a RemoteDecode; called with
    # receipts= only for KV written device to device (``kv_ipc_route``)
    decode: Any
    store_shard: str | None = None  # where the prompt's new full blocks are written
    # DualPath: where the stored prefix is read. "prefill": storage -> this prefill
    # replica; "decode": storage -> the decode replica (``relay``, its actor handle), then
    # layer by layer over the compute path to the prefill replica
    read_path: str = "prefill"
    relay: Any = None


@dataclass(frozen=True)
class PrefillDone:
    """The prompt's KV has arrived at the decode replica, which was told to admit it."""

    key: str
    first_token: int
    cached_tokens: int  # prompt tokens reused (own prefix cache or the KV store)


@dataclass(frozen=True)
class PrefillFailed:
    """The KV stream broke (the decode side is gone or unreachable); nothing was admitted."""

    key: str
    why: str


@dataclass(frozen=True)
class ReservationLost:
    """The decode replica lost the cache its reservation was in (a worker restart)."""

    key: str


@dataclass(frozen=True)
class TokenDelta:
    key: str
    delta: StreamDelta
    time: float  # time.monotonic() on the decode replica when the token was produced


@dataclass(frozen=True)
class Finished:
    key: str
    output: RequestOutput


@dataclass(frozen=True)
class PrefillStats:
    queued_tokens: int
    queued_requests: int
    loaded_blocks: int
    stored_blocks: int
    bytes_streamed: int
    layers_streamed: int
    backends: dict[str, str]  # decode endpoint -> transfer backend (shm / tcp / nixl)
    # (uncomputed tokens, computed tokens) of each queued request, in serving order
    queued: tuple[tuple[int, int], ...] = ()
    # store shard endpoint -> the backend this replica's store reads use
    load_backends: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DecodeStats:
    num_running: int
    used_blocks: int  # held by admitted requests
    pending: int  # reservations whose prefill has not delivered yet
    pending_blocks: int
    total_blocks: int
    stored_blocks: int = 0  # full blocks written back to the KV store
    loaded_blocks: int = 0  # blocks read from the store for prefill replicas (decode path)
    remaining: tuple[int, ...] = ()  # tokens each running request may still generate


@dataclass(frozen=True)
class PrefillStep:
    """One measured prefill step, for the Conductor's cost model."""

    chunks: list[tuple[int, int]]  # (new tokens, context tokens) of each request
    seconds: float


@dataclass(frozen=True)
class StoreLoad:
    blocks: int  # loaded from the KV store into the prefill replica's cache
    seconds: float


@dataclass(frozen=True)
class DecodeStep:
    batch: int  # running requests
    blocks: int  # their context blocks
    seconds: float


@dataclass(frozen=True)
class TokenGaps:
    """One decode step's gaps between tokens (seconds, ``TokenGapClock``'s shares) of the
    requests whose tokens went straight to their ingress, for the Conductor's process's
    inter-token-latency histogram (relayed tokens are timed there from ``TokenDelta``)."""

    gaps: tuple[float, ...]


@dataclass(frozen=True)
class CacheEvent:
    """A prefill replica's prefix cache stored or evicted a block."""

    stored: bool
    block_hash: int


Event = (
    PrefillDone
    | PrefillFailed
    | ReservationLost
    | TokenDelta
    | TokenGaps
    | Finished
    | PrefillStep
    | StoreLoad
    | DecodeStep
    | CacheEvent
)


@dataclass
class Report:
    """What a replica tells the Conductor: its events in order, then its state now."""

    replica_id: str
    events: list[Event]
    stats: PrefillStats | DecodeStats
    leaving: bool = False  # asked to leave its pool (``drain``): drain it, then retire it


@dataclass(frozen=True)
class PDCounters:
    """A disaggregated Serve replica's transfer and store counters since its start
    (``PDEngine.pd_counters``, exported on ``/metrics``); a prefill replica that restarts
    starts its own from zero again."""

    kv_transfer_bytes: int  # KV bytes streamed prefill -> decode
    kv_transfer_layers: int  # layer transfers streamed prefill -> decode
    store_loaded_blocks: int  # blocks prefill replicas loaded from the KV store
    store_stored_blocks: int  # blocks prefill replicas stored into the KV store
    store_replicated_blocks: int  # blocks copied into a chosen instance's home shard
    prefill_restarts: int
    decode_restarts: int
    # tokens decode replicas sent through the Conductor (none of a Serve ingress's requests)
    relayed_tokens: int = 0
    # blocks the store's shards served from DRAM / from SSD, and blocks asked for that no
    # shard served, since each shard started (a restarted shard counts from zero again)
    store_dram_hit_blocks: int = 0
    store_ssd_hit_blocks: int = 0
    store_miss_blocks: int = 0
    # sessions (store.retention): blocks retained now, blocks served while retained, and
    # retentions that reached their deadline, summed over the shards
    store_retained_blocks: int = 0
    store_retention_hit_blocks: int = 0
    store_expired_retentions: int = 0
    # requests placed after waiting for decode room, and their waits summed (seconds)
    decode_waits: int = 0
    decode_wait_seconds: float = 0.0
    # each pool's replicas now (taking work or starting), and for a scaled pool the
    # replicas its load needs at its target and the signal (``policies.pool_scaling``)
    pool_replicas: tuple[tuple[str, int], ...] = ()
    pool_needs: tuple[tuple[str, str, float], ...] = ()  # (pool, signal, need)
    # (path, backend, peers): which transfer backend carries KV on each path, counted
    # over the (replica, peer) pairs that have moved KV; path "prefill->decode" (the
    # layer stream) or "store->prefill" (store reads)
    transfer_links: tuple[tuple[str, str, int], ...] = ()
