"""KV-cache parallelism (Medha): a long request's KV is split by sequence over ranks.

Each rank runs the layers only for the requests whose newest token it holds (its "own"
requests); a request whose KV spans ranks is "distributed". Per layer, for own tokens:

1. ``write_kv`` writes the K/V rows that land in this rank's shard and remembers the layer's
   K/V, because tokens of a chunk that straddles a shard boundary land on an earlier rank.
2. ``attention`` attends over this rank's shard. If any request in the step is distributed
   (the same answer on every rank: it comes from the shared plan), ranks all-gather a
   payload of [queries of their distributed requests, K/V rows bound for other ranks]; each
   rank writes the rows bound for it, attends the received queries over its shard of those
   requests, and a second all-gather returns the partial (out, lse) to the owners, which
   merge them (``merge_attention_states``: exact).

Every rank calls both all-gathers, in the same order, whenever the plan has a distributed
request, so collectives never mismatch. Shard attention uses the torch reference kernel,
which takes ``query_offsets`` (the flashinfer causal kernel does not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.attention_torch import TorchAttentionBackend, write_kv
from kernels.merge import merge_attention_states

AllGather = Callable[[torch.Tensor], list[torch.Tensor]]  # equal-size tensors, rank order


@dataclass
class KVExchange:
    """Index plan of one step's exchange, identical in shape on every rank."""

    rank: int
    q_counts: list[int]  # per rank: query rows it sends (of its distributed requests)
    kv_counts: list[int]  # per rank: K/V rows it sends to other ranks
    send_q_rows: torch.Tensor  # [q_counts[rank]] own token rows
    send_kv_rows: torch.Tensor  # [kv_counts[rank]] own token rows whose slot is remote
    # per source rank: (rows of its K/V payload bound here, their slots here)
    recv_kv: list[tuple[torch.Tensor, torch.Tensor]]
    # the remote queries this rank answers: index into the concatenation of every source's
    # query rows (source order), and the metadata of those (query, shard) pairs
    answer_q_index: torch.Tensor  # [A]
    answer_meta: AttentionMetadata | None
    answer_empty_rows: torch.Tensor  # rows of the A answers that see no key of this shard
    answer_counts: list[int]  # per rank: partial rows it computes (A of each rank)
    # per source rank: (rows of its partial answers meant for this rank, own token rows)
    recv_partials: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class KVParallelMetadata:
    """What one rank's layers need for a step. ``slot_mapping`` has -1 for remote rows."""

    local: AttentionMetadata  # own requests over this rank's shard of each
    local_empty_rows: torch.Tensor  # own rows that see no key of this rank's shard
    exchange: KVExchange | None  # None when no request of the step is distributed

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self.local.slot_mapping


def _blank_rows(out: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor) -> None:
    """Rows that saw no key: weight 0 in the merge (out 0, lse -inf)."""
    if rows.numel():
        out.index_fill_(0, rows, 0.0)
        lse.index_fill_(0, rows, float("-inf"))


def _padded_gather(
    all_gather: AllGather, flat: torch.Tensor, sizes: list[int]
) -> list[torch.Tensor]:
    """All-gather 1-D tensors of known per-rank ``sizes``, padding to the largest."""
    width = max(max(sizes), 1)
    buf = flat.new_zeros(width)
    buf[: flat.numel()] = flat
    return [t[:n] for t, n in zip(all_gather(buf), sizes, strict=True)]


class KVParallelAttention:
    """An ``AttentionBackend`` for one KV-parallel rank (per TP rank and pipeline stage),
    given to that worker's ``ModelShard`` as the backend of all its layers. With TP, K/V rows
    carry only the rank's KV heads (``k_cache.shape[2]``: one when TP replicates KV heads)."""

    name = "kv_parallel"

    def __init__(self, all_gather: AllGather) -> None:
        self.all_gather = all_gather
        self._local = TorchAttentionBackend()
        self._answers = TorchAttentionBackend()
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def write_kv(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write the rows whose slot is here (>= 0); keep ``k, v [T, Hkv, D]`` for
        ``attention``, which sends the others to their ranks."""
        rows = (slot_mapping >= 0).nonzero().squeeze(1)
        slots = slot_mapping.index_select(0, rows)
        write_kv(k_cache, v_cache, k.index_select(0, rows), v.index_select(0, rows), slots)
        self._k, self._v = k, v

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata | KVParallelMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q: [T, Hq, D]`` own rows -> exact ``(out [T, Hq, D], lse [T, Hq])``. ``meta`` is
        always the step's ``KVParallelMetadata``; the union keeps this an ``AttentionBackend``
        (models pass the step's metadata through to their backend as is)."""
        assert isinstance(meta, KVParallelMetadata)
        if meta.local.num_seqs:
            out, lse = self._local.attention(q, k_cache, v_cache, meta.local, scale)
            out, lse = out.clone(), lse.clone()
            _blank_rows(out, lse, meta.local_empty_rows)
        else:  # this rank computes nothing itself this step, but still answers queries
            out = torch.zeros_like(q)
            lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        ex = meta.exchange
        if ex is None:
            return out, lse
        assert self._k is not None and self._v is not None
        heads, dim = q.shape[1], q.shape[2]
        kv_heads = k_cache.shape[2]
        q_size, kv_size = heads * dim, kv_heads * dim

        # 1. Queries of distributed requests and K/V rows bound elsewhere, to every rank.
        send = torch.cat(
            [
                q.index_select(0, ex.send_q_rows).reshape(-1),
                self._k.index_select(0, ex.send_kv_rows).reshape(-1),
                self._v.index_select(0, ex.send_kv_rows).reshape(-1),
            ]
        )
        sizes = [
            qc * q_size + 2 * kc * kv_size for qc, kc in zip(ex.q_counts, ex.kv_counts, strict=True)
        ]
        received = _padded_gather(self.all_gather, send, sizes)
        queries = []
        for src, payload in enumerate(received):
            qn, kn = ex.q_counts[src], ex.kv_counts[src]
            queries.append(payload[: qn * q_size].view(qn, heads, dim))
            if src == ex.rank:
                continue
            rows, slots = ex.recv_kv[src]
            if rows.numel():
                ks = payload[qn * q_size : qn * q_size + kn * kv_size].view(kn, kv_heads, dim)
                vs = payload[qn * q_size + kn * kv_size :].view(kn, kv_heads, dim)
                ks, vs = ks.index_select(0, rows), vs.index_select(0, rows)
                write_kv(k_cache, v_cache, ks, vs, slots)

        # 2. Answer the remote queries over this rank's shards. Partial states travel in at
        # least fp32 so a bf16 model's lse keeps its precision.
        wire = torch.promote_types(q.dtype, torch.float32)
        if ex.answer_meta is not None:
            asked = torch.cat(queries).index_select(0, ex.answer_q_index)
            a_out, a_lse = self._answers.attention(asked, k_cache, v_cache, ex.answer_meta, scale)
            a_out, a_lse = a_out.clone(), a_lse.clone()
            _blank_rows(a_out, a_lse, ex.answer_empty_rows)
            answer = torch.cat([a_out.to(wire).reshape(-1), a_lse.to(wire).reshape(-1)])
        else:
            answer = q.new_zeros(0, dtype=wire)

        # 3. Partial states back to their owners; merge.
        sizes = [n * (q_size + heads) for n in ex.answer_counts]
        partials = _padded_gather(self.all_gather, answer, sizes)
        outs, lses = [out], [lse]
        for src, payload in enumerate(partials):
            rows, own_rows = ex.recv_partials[src]
            if src == ex.rank or not rows.numel():
                continue
            n = ex.answer_counts[src]
            p_out = payload[: n * q_size].view(n, heads, dim).index_select(0, rows).to(out.dtype)
            p_lse = payload[n * q_size :].view(n, heads).index_select(0, rows).float()
            full_out = torch.zeros_like(out)
            full_lse = torch.full_like(lse, float("-inf"))
            full_out.index_copy_(0, own_rows, p_out)
            full_lse.index_copy_(0, own_rows, p_lse)
            outs.append(full_out)
            lses.append(full_lse)
        return merge_attention_states(outs, lses)
