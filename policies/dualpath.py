"""DualPath's scheduler (arXiv 2602.21548): which prefill engine (PE) and decode engine
(DE) take a waiting request, from which side its stored KV is read, and how a PE fills
one prefill batch.

Inter-engine level. Each engine reports its unfinished requests ``seq_e``, their
unfinished tokens ``tok_e``, and sits on a node whose disk-read queue ``read_q`` (tokens
waiting to be read from storage) is known. Two thresholds:

    alpha = tokens one node's storage link reads in 3 s  (``read_threshold``)
    beta  = tokens one engine processes in 5 s           (``work_threshold``)

- PE choice, FIFO over the waiting queue: engines with ``tok_e > beta`` are skipped;
  engines whose node has ``read_q <= alpha`` are preferred over those with
  ``read_q > alpha``; within a class the smallest ``tok_e`` wins (then the engine id).
  After an assignment ``tok_e`` grows by the request's uncached tokens (its compute).
- DE choice: first the whole waiting queue is spread over DE groups, each request to the
  group with the smallest summed ``tok_e`` (grown by the request's length as it goes).
  Inside a group, ``Z = 1.05 * (sum of the group's queued lengths that fit in its free
  HBM, FIFO + sum of tok_e) / number of engines``; among engines with the HBM for the
  request, those with ``tok_e + len <= Z`` are preferred, fewest ``seq_e`` first, else
  the smallest ``tok_e``. Then ``tok_e += len``, ``seq_e += 1``, free HBM shrinks.
- Path: the request's stored (hit) tokens are read on the side, the PE's node or the
  DE's node, with the shorter disk-read queue (ties: the PE's); that queue grows by them.
  When the nodes' storage links read at different rates (``read_rates``), the queue is
  measured in time: the side whose read of this request would end first.

Scheduling stops at the first request no PE or no DE can take (FIFO: nothing overtakes
it). Token counts stand in for bytes: every token's KV has the same size.

Intra-engine level (``fill_batch``): a PE takes its queue in FIFO order while the
predicted attention time of the batch stays within a quota (the paper: 300 ms), and
binary-searches the largest chunk of the request that would overflow it, so data-parallel
attention ranks finish together. ``attention_time_fn`` turns the Conductor's fitted
``LinearPrefillTime`` (``policies.pd_costs``) into that prediction. ``AttentionQuotaPacker``
is that rule as a replica scheduler's packer (``policies.scheduler``; the engine option
``attention_quota``), predicting with the replica's runtime predictor
(``placement.runtime_predictor``, the one Medha's batch packer uses).

Pure: no clock, no I/O; the runtime and the simulator share it. Stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from policies.batch_packer import PrefillCandidate
from policies.pd_costs import LinearPrefillTime

PREFILL_PATH = "prefill"  # storage -> the PE's node
DECODE_PATH = "decode"  # storage -> the DE's node -> the PE over the compute network
Z_SLACK = 1.05


@dataclass(frozen=True)
class EngineLoad:
    """What one engine reports to the scheduler."""

    engine_id: str
    node: str  # whose storage link (and disk-read queue) it reads through
    unfinished_requests: int = 0  # seq_e
    unfinished_tokens: int = 0  # tok_e
    free_tokens: int = 0  # DEs: tokens of KV its free HBM still holds
    group: str = ""  # DEs: the DE group it belongs to


@dataclass(frozen=True)
class WaitingRequest:
    request_id: str
    tokens: int  # prompt length
    hit_tokens: int = 0  # of them, held by the KV store (to be read, not computed)

    def __post_init__(self) -> None:
        if self.tokens <= 0 or not 0 <= self.hit_tokens < self.tokens:
            raise ValueError(
                f"request {self.request_id!r}: need tokens > 0 and 0 <= hit_tokens < tokens "
                "(the last prompt token is always computed)"
            )

    @property
    def new_tokens(self) -> int:
        return self.tokens - self.hit_tokens


@dataclass(frozen=True)
class Assignment:
    request_id: str
    prefill: str  # PE id
    decode: str  # DE id
    path: str  # PREFILL_PATH or DECODE_PATH: where the hit tokens are read
    read_node: str  # whose storage link reads them


@dataclass
class Schedule:
    assignments: list[Assignment] = field(default_factory=list)
    prefill: dict[str, EngineLoad] = field(default_factory=dict)  # loads after assignment
    decode: dict[str, EngineLoad] = field(default_factory=dict)
    read_queues: dict[str, int] = field(default_factory=dict)  # node -> tokens to read


def read_threshold(read_tokens_per_second: float, seconds: float = 3.0) -> int:
    """alpha: tokens one node's storage link reads in ``seconds``."""
    return _positive_tokens(read_tokens_per_second, seconds, "read_tokens_per_second")


def work_threshold(compute_tokens_per_second: float, seconds: float = 5.0) -> int:
    """beta: tokens one engine processes in ``seconds``."""
    return _positive_tokens(compute_tokens_per_second, seconds, "compute_tokens_per_second")


def _positive_tokens(rate: float, seconds: float, name: str) -> int:
    if rate <= 0 or seconds <= 0:
        raise ValueError(f"{name} and seconds must be positive")
    return int(rate * seconds)


def pick_prefill(
    engines: Sequence[EngineLoad], read_queues: dict[str, int], alpha: int, beta: int
) -> EngineLoad | None:
    """The PE for the next request, or None when every PE has more than beta tokens."""
    open_ = [e for e in engines if e.unfinished_tokens <= beta]
    light = [e for e in open_ if read_queues.get(e.node, 0) <= alpha]
    pool = light or open_
    if not pool:
        return None
    return min(pool, key=lambda e: (e.unfinished_tokens, e.engine_id))


def spread_over_groups(
    waiting: Sequence[WaitingRequest], engines: Sequence[EngineLoad]
) -> dict[str, list[WaitingRequest]]:
    """Each request (FIFO) to the DE group with the smallest summed tok_e, which then grows
    by its length; group -> its requests in order. Ties: the group name."""
    load: dict[str, int] = {}
    for e in engines:
        load[e.group] = load.get(e.group, 0) + e.unfinished_tokens
    queues: dict[str, list[WaitingRequest]] = {g: [] for g in load}
    for r in waiting:
        g = min(load, key=lambda name: (load[name], name))
        queues[g].append(r)
        load[g] += r.tokens
    return queues


def z_bound(queued: Sequence[WaitingRequest], engines: Sequence[EngineLoad]) -> float:
    """Z = 1.05 * (queued lengths that fit the group's free HBM, FIFO, + sum tok_e) / n."""
    free = sum(e.free_tokens for e in engines)
    fitting = 0
    for r in queued:
        if fitting + r.tokens > free:
            break
        fitting += r.tokens
    return Z_SLACK * (fitting + sum(e.unfinished_tokens for e in engines)) / len(engines)


def pick_decode(engines: Sequence[EngineLoad], tokens: int, z: float) -> EngineLoad | None:
    """The DE for a request of ``tokens``, or None when no engine has the HBM for it."""
    room = [e for e in engines if e.free_tokens >= tokens]
    under = [e for e in room if e.unfinished_tokens + tokens <= z]
    if under:
        return min(under, key=lambda e: (e.unfinished_requests, e.unfinished_tokens, e.engine_id))
    if room:
        return min(room, key=lambda e: (e.unfinished_tokens, e.engine_id))
    return None


def pick_path(
    prefill_node: str,
    decode_node: str,
    read_queues: dict[str, int],
    read_rates: dict[str, float] | None = None,
    hit_tokens: int = 0,
) -> str:
    """Read on the side whose node has the shorter disk-read queue (ties: the PE's).
    ``read_rates`` (tokens per second each node's storage link reads; None: all equal):
    on the side whose read of ``hit_tokens`` would end first, ``(queue + hit) / rate``,
    which is the shorter queue when the rates are equal."""
    q_p, q_d = read_queues.get(prefill_node, 0), read_queues.get(decode_node, 0)
    if read_rates is None:
        return DECODE_PATH if q_d < q_p else PREFILL_PATH
    r_p, r_d = _rate(read_rates, prefill_node), _rate(read_rates, decode_node)
    return DECODE_PATH if (q_d + hit_tokens) * r_p < (q_p + hit_tokens) * r_d else PREFILL_PATH


def _rate(read_rates: dict[str, float], node: str) -> float:
    rate = read_rates.get(node, 0.0)
    if rate <= 0:
        raise ValueError(f"read_rates needs a positive rate for node {node!r}, got {rate}")
    return rate


def schedule(
    waiting: Sequence[WaitingRequest],
    prefill: Sequence[EngineLoad],
    decode: Sequence[EngineLoad],
    read_queues: dict[str, int],
    alpha: int,
    beta: int,
    dual_path: bool = True,
    read_rates: dict[str, float] | None = None,
) -> Schedule:
    """Assign waiting requests (FIFO) to (PE, DE, read path) until one cannot be placed.
    ``dual_path=False`` always reads on the PE's side (the Basic baseline).
    ``read_rates``: tokens per second each node's storage link reads (``pick_path``;
    None: every link alike)."""
    if not prefill or not decode:
        raise ValueError("schedule needs at least one prefill and one decode engine")
    out = Schedule(
        prefill={e.engine_id: e for e in prefill},
        decode={e.engine_id: e for e in decode},
        read_queues=dict(read_queues),
    )
    groups: dict[str, list[EngineLoad]] = {}
    for e in decode:
        groups.setdefault(e.group, []).append(e)
    group_of = {
        r.request_id: g for g, rs in spread_over_groups(waiting, decode).items() for r in rs
    }
    z = {
        g: z_bound([r for r in waiting if group_of[r.request_id] == g], es)
        for g, es in groups.items()
    }
    for r in waiting:
        pe = pick_prefill(list(out.prefill.values()), out.read_queues, alpha, beta)
        if pe is None:
            break
        members = [out.decode[e.engine_id] for e in groups[group_of[r.request_id]]]
        de = pick_decode(members, r.tokens, z[group_of[r.request_id]])
        if de is None:
            break
        path = PREFILL_PATH
        if dual_path:
            path = pick_path(pe.node, de.node, out.read_queues, read_rates, r.hit_tokens)
        node = pe.node if path == PREFILL_PATH else de.node
        if r.hit_tokens:
            out.read_queues[node] = out.read_queues.get(node, 0) + r.hit_tokens
        out.prefill[pe.engine_id] = replace(
            pe,
            unfinished_requests=pe.unfinished_requests + 1,
            unfinished_tokens=pe.unfinished_tokens + r.new_tokens,
        )
        out.decode[de.engine_id] = replace(
            de,
            unfinished_requests=de.unfinished_requests + 1,
            unfinished_tokens=de.unfinished_tokens + r.tokens,
            free_tokens=de.free_tokens - r.tokens,
        )
        out.assignments.append(Assignment(r.request_id, pe.engine_id, de.engine_id, path, node))
    return out


# -- intra-engine: one prefill batch -----------------------------------------------------

Chunk = tuple[int, int]  # (new tokens this step, context tokens before them)


@dataclass(frozen=True)
class QueuedPrefill:
    request_id: str
    new_tokens: int  # still to compute
    context_tokens: int = 0  # computed or loaded before them


def attention_time_fn(model: LinearPrefillTime) -> Callable[[Sequence[Chunk]], float]:
    """The attention part of a fitted prefill step: pairs of (new token, earlier token) and
    the context read, ``sum per_attention_pair * n * (n + c) + per_cached_token * c``."""

    def attention_time(chunks: Sequence[Chunk]) -> float:
        return sum(
            model.per_attention_pair * n * (n + c) + model.per_cached_token * c for n, c in chunks
        )

    return attention_time


def fill_batch(
    queue: Sequence[QueuedPrefill],
    attention_time: Callable[[Sequence[Chunk]], float],
    quota: float,
) -> list[tuple[str, int]]:
    """FIFO: take requests whole while the batch's predicted attention time stays within
    ``quota``; the first that would overflow gets the largest chunk that fits (binary
    search; ``attention_time`` must grow with the chunk) and the batch ends there. An empty
    batch always takes at least one token of its first request (progress). Returns
    ``(request_id, tokens this step)``."""
    if quota <= 0:
        raise ValueError("quota must be positive (seconds of attention per batch)")
    batch: list[tuple[str, int]] = []
    chunks: list[Chunk] = []
    for q in queue:
        if q.new_tokens <= 0:
            continue
        whole = (q.new_tokens, q.context_tokens)
        if attention_time([*chunks, whole]) <= quota:
            batch.append((q.request_id, q.new_tokens))
            chunks.append(whole)
            continue
        lo, hi = 0, q.new_tokens - 1  # largest n in [lo, hi] that fits; 0: none
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if attention_time([*chunks, (mid, q.context_tokens)]) <= quota:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0 and not batch:
            lo = 1
        if lo > 0:
            batch.append((q.request_id, lo))
        break
    return batch


class AttentionPredictor(Protocol):
    def attention_time(self, batch: Sequence[Chunk]) -> float: ...


class AttentionQuotaPacker:
    """The intra-engine rule as a scheduler's packer: ``pack`` sizes the prefills of one
    step by ``fill_batch`` (FIFO, the candidates' order), the step's decodes counted in
    the attention time first. Then the scheduler's limits: each chunk at most
    ``max_chunk`` and all together at most ``budget`` tokens, in order (cutting a chunk
    only lowers the attention time, so the quota still holds)."""

    def __init__(
        self, predictor: AttentionPredictor, quota: float, max_chunk: int | None = None
    ) -> None:
        if quota <= 0:
            raise ValueError("attention_quota must be positive (seconds of attention per step)")
        if max_chunk is not None and max_chunk < 1:
            raise ValueError("max_chunk must be at least 1")
        self.predictor = predictor
        self.quota = quota
        self.max_chunk = max_chunk

    def pack(
        self,
        decodes: Sequence[Chunk],
        candidates: Sequence[PrefillCandidate],
        budget: int,
    ) -> list[int]:
        """Tokens per candidate this step (0: not this time), at most ``budget`` in all."""
        chunks = [0] * len(candidates)
        if not candidates or budget <= 0:
            return chunks
        fixed = list(decodes)

        def attention_time(batch: Sequence[Chunk]) -> float:
            return self.predictor.attention_time([*fixed, *batch])

        queue = [QueuedPrefill(str(i), c.uncomputed, c.context) for i, c in enumerate(candidates)]
        for rid, n in fill_batch(queue, attention_time, self.quota):
            if self.max_chunk is not None:
                n = min(n, self.max_chunk)
            n = min(n, budget)
            chunks[int(rid)] = n
            budget -= n
        return chunks
