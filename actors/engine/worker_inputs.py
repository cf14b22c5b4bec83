"""A step plan -> one worker's model inputs.

A worker of KV-parallel rank ``r`` runs the plan's entries whose newest token it holds, in
plan order, as one flat batch of T rows. With ``kvp == 1`` that is every entry and the
metadata is the usual ``AttentionMetadata``; otherwise it is ``KVParallelMetadata``, with
the exchange index plan when some request spans ranks (see
``kernels/kv_parallel_attention.py``). Every rank derives the same exchange sizes from the
same plan, so no sizes are ever sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from actors.engine.sampling import SampleSpec
from actors.engine.step_plan import PlanEntry, Shard, StepPlan
from kernels.attention_metadata import AttentionMetadata
from kernels.kv_parallel_attention import KVExchange, KVParallelMetadata


@dataclass
class WorkerInputs:
    entries: list[PlanEntry]  # the entries this rank computes, in batch order
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata | KVParallelMetadata
    sample_rows: list[int]  # rows whose hidden state is sampled
    sample_ids: list[str]
    sample_specs: list[SampleSpec]


def _slot(shard: Shard, pos: int, block_size: int) -> int:
    _, first, blocks = shard
    offset = pos - first
    return blocks[offset // block_size] * block_size + offset % block_size


def _shard_of(entry: PlanEntry, pos: int) -> Shard:
    for shard in reversed(entry.shards):
        if shard[1] <= pos:
            return shard
    raise ValueError(f"request {entry.request_id!r}: no shard holds position {pos}")


def _shard_on(entry: PlanEntry, rank: int) -> tuple[Shard, int] | None:
    """This rank's shard of the entry and the position where the shard ends."""
    for i, shard in enumerate(entry.shards):
        if shard[0] == rank:
            end = entry.shards[i + 1][1] if i + 1 < len(entry.shards) else entry.end
            return shard, min(end, entry.end)
    return None


def build_worker_inputs(
    plan: StepPlan, rank: int, kvp: int, block_size: int, device: torch.device | str = "cpu"
) -> WorkerInputs:
    if kvp == 1:
        entries = plan.entries
    else:
        entries = [e for e in plan.entries if e.compute_rank == rank]
    tokens: list[int] = []
    positions: list[int] = []
    query_lens, context_lens, tables, offsets, slots = [], [], [], [], []
    empty_rows: list[int] = []
    sample_rows, sample_ids, sample_specs = [], [], []
    first_row: dict[str, int] = {}
    for e in entries:
        row = len(tokens)
        first_row[e.request_id] = row
        tokens.extend(e.token_ids)
        positions.extend(range(e.start, e.end))
        shard = e.shards[-1]
        _, first, blocks = shard
        query_lens.append(e.num_tokens)
        context_lens.append(e.end - first)
        offsets.append(e.start - first)
        tables.append(blocks)
        for i, pos in enumerate(range(e.start, e.end)):
            if pos >= first:
                slots.append(_slot(shard, pos, block_size))
            else:  # a straddling chunk's early token: its KV lands on an earlier rank
                slots.append(-1)
                empty_rows.append(row + i)
        if e.sample is not None:
            sample_rows.append(len(tokens) - 1)
            sample_ids.append(e.request_id)
            sample_specs.append(e.sample)

    if kvp == 1:
        meta: AttentionMetadata | KVParallelMetadata = AttentionMetadata.build(
            query_lens, context_lens, tables, block_size, device=device
        )
    else:
        local = AttentionMetadata.build(
            query_lens,
            context_lens,
            tables,
            block_size,
            device=device,
            query_offsets=offsets,
            slot_mapping=slots,
        )
        exchange = (
            _exchange(plan, rank, kvp, block_size, first_row, device)
            if plan.needs_kv_exchange
            else None
        )
        meta = KVParallelMetadata(local, _index(empty_rows, device), exchange)
    return WorkerInputs(
        entries,
        torch.tensor(tokens, dtype=torch.int64, device=device),
        torch.tensor(positions, dtype=torch.int64, device=device),
        meta,
        sample_rows,
        sample_ids,
        sample_specs,
    )


def _index(values: list[int], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _exchange(
    plan: StepPlan,
    rank: int,
    kvp: int,
    block_size: int,
    first_row: dict[str, int],
    device: torch.device | str,
) -> KVExchange:
    # Distributed requests per computing rank, and the K/V rows each sends elsewhere.
    dist: list[list[PlanEntry]] = [[] for _ in range(kvp)]
    for e in plan.entries:
        if e.is_distributed:
            dist[e.compute_rank].append(e)
    kv_out: list[list[tuple[PlanEntry, int, int]]] = []  # (entry, position, target rank)
    for owned in dist:
        outgoing = []
        for e in owned:
            tail_first = e.shards[-1][1]
            for pos in range(e.start, min(e.end, tail_first)):
                outgoing.append((e, pos, _shard_of(e, pos)[0]))
        kv_out.append(outgoing)
    q_counts = [sum(e.num_tokens for e in owned) for owned in dist]
    q_base = [sum(q_counts[:j]) for j in range(kvp)]

    # answers[k]: (source rank, entry, first query row in the source-ordered concatenation)
    answers: list[list[tuple[int, PlanEntry, int]]] = [[] for _ in range(kvp)]
    for k in range(kvp):
        for src in range(kvp):
            if src == k:
                continue
            q_row = q_base[src]
            for e in dist[src]:
                if _shard_on(e, k) is not None:
                    answers[k].append((src, e, q_row))
                q_row += e.num_tokens

    send_q_rows = [first_row[e.request_id] + i for e in dist[rank] for i in range(e.num_tokens)]
    send_kv_rows = [first_row[e.request_id] + pos - e.start for e, pos, _ in kv_out[rank]]
    recv_kv = []
    for src in range(kvp):
        rows: list[int] = []
        slots: list[int] = []
        if src != rank:
            for i, (e, pos, target) in enumerate(kv_out[src]):
                if target == rank:
                    found = _shard_on(e, rank)
                    assert found is not None
                    rows.append(i)
                    slots.append(_slot(found[0], pos, block_size))
        recv_kv.append((_index(rows, device), _index(slots, device)))

    q_index: list[int] = []
    a_query_lens: list[int] = []
    a_ctx: list[int] = []
    a_tables: list[list[int]] = []
    a_offsets: list[int] = []
    a_empty: list[int] = []
    for _, e, q_row in answers[rank]:
        found = _shard_on(e, rank)
        assert found is not None
        (_, first, blocks), end = found
        base = len(q_index)
        q_index.extend(range(q_row, q_row + e.num_tokens))
        a_query_lens.append(e.num_tokens)
        a_ctx.append(end - first)
        a_offsets.append(e.start - first)
        a_tables.append(blocks)
        a_empty.extend(base + i for i in range(e.num_tokens) if e.start + i < first)
    answer_meta = None
    if a_query_lens:
        answer_meta = AttentionMetadata.build(
            a_query_lens,
            a_ctx,
            a_tables,
            block_size,
            device=device,
            query_offsets=a_offsets,
            slot_mapping=[-1] * len(q_index),
        )

    recv_partials = []
    for src in range(kvp):
        rows = []
        own_rows: list[int] = []
        if src != rank:
            a_row = 0
            for source, e, _ in answers[src]:
                if source == rank:
                    rows.extend(range(a_row, a_row + e.num_tokens))
                    base = first_row[e.request_id]
                    own_rows.extend(range(base, base + e.num_tokens))
                a_row += e.num_tokens
        recv_partials.append((_index(rows, device), _index(own_rows, device)))

    return KVExchange(
        rank=rank,
        q_counts=q_counts,
        kv_counts=[len(rows) for rows in kv_out],
        send_q_rows=_index(send_q_rows, device),
        send_kv_rows=_index(send_kv_rows, device),
        recv_kv=recv_kv,
        answer_q_index=_index(q_index, device),
        answer_meta=answer_meta,
        answer_empty_rows=_index(a_empty, device),
        answer_counts=[sum(e.num_tokens for _, e, _ in ans) for ans in answers],
        recv_partials=recv_partials,
    )
