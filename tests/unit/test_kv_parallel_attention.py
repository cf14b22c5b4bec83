"""KV-parallel attention in process: two ranks as threads with a thread all-gather give the
single-rank attention, including a chunk whose tokens straddle the shard boundary."""

from __future__ import annotations

import threading

import torch

from actors.engine.step_plan import PlanEntry, StepPlan
from actors.engine.worker_inputs import build_worker_inputs
from kernels.attention_metadata import AttentionMetadata
from kernels.attention_torch import TorchAttentionBackend
from kernels.kv_parallel_attention import KVParallelAttention

BS, HQ, HKV, D = 4, 4, 2, 8


class ThreadAllGather:
    def __init__(self, n: int) -> None:
        self.n = n
        self.barrier = threading.Barrier(n)
        self.slots: list[torch.Tensor | None] = [None] * n

    def for_rank(self, rank: int):
        def all_gather(x: torch.Tensor) -> list[torch.Tensor]:
            self.slots[rank] = x.clone()
            self.barrier.wait()
            out = [t.clone() for t in self.slots if t is not None]
            self.barrier.wait()
            return out

        return all_gather


def test_two_ranks_equal_one_rank_with_a_straddling_chunk():
    torch.manual_seed(0)
    # Request "long": 20 tokens computed before, this step computes positions 20..27; rank 0
    # holds [0, 24) (6 blocks), rank 1 holds [24, 28): the chunk straddles position 24.
    # Request "short" (5 tokens, all new) lives on rank 1 only.
    start, n, limit = 20, 8, 24
    long_q = torch.randn(n, HQ, D, dtype=torch.float64)
    long_k = torch.randn(start + n, HKV, D, dtype=torch.float64)
    long_v = torch.randn(start + n, HKV, D, dtype=torch.float64)
    short_q = torch.randn(5, HQ, D, dtype=torch.float64)
    short_k = torch.randn(5, HKV, D, dtype=torch.float64)
    short_v = torch.randn(5, HKV, D, dtype=torch.float64)

    # Reference: one rank, contiguous blocks.
    cache_k = torch.zeros(16, BS, HKV, D, dtype=torch.float64)
    cache_v = torch.zeros_like(cache_k)
    cache_k.view(-1, HKV, D)[: start + n] = long_k
    cache_v.view(-1, HKV, D)[: start + n] = long_v
    cache_k.view(-1, HKV, D)[32:37] = short_k
    cache_v.view(-1, HKV, D)[32:37] = short_v
    meta = AttentionMetadata.build([n, 5], [start + n, 5], [list(range(7)), [8, 9]], BS)
    ref_out, ref_lse = TorchAttentionBackend().attention(
        torch.cat([long_q, short_q]), cache_k, cache_v, meta, D**-0.5
    )

    plan = StepPlan(
        0,
        [
            PlanEntry(
                "long", start, list(range(n)), [(0, 0, [0, 1, 2, 3, 4, 5]), (1, limit, [3])], None
            ),
            PlanEntry("short", 0, list(range(5)), [(1, 0, [0, 1])], None),
        ],
    )
    gather = ThreadAllGather(2)
    results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    caches = {}

    def run(rank: int) -> None:
        k_cache = torch.zeros(8, BS, HKV, D, dtype=torch.float64)
        v_cache = torch.zeros_like(k_cache)
        if rank == 0:  # the 20 tokens computed before, in rank 0's blocks 0..4
            k_cache.view(-1, HKV, D)[:start] = long_k[:start]
            v_cache.view(-1, HKV, D)[:start] = long_v[:start]
        inputs = build_worker_inputs(plan, rank, 2, BS)
        backend = KVParallelAttention(gather.for_rank(rank))
        if rank == 1:  # computes both requests: "long" (its newest token is here) and "short"
            q = torch.cat([long_q, short_q])
            k = torch.cat([long_k[start:], short_k])
            v = torch.cat([long_v[start:], short_v])
        else:
            q = torch.zeros(0, HQ, D, dtype=torch.float64)
            k = v = torch.zeros(0, HKV, D, dtype=torch.float64)
        backend.write_kv(k_cache, v_cache, k, v, inputs.meta.slot_mapping)
        results[rank] = backend.attention(q, k_cache, v_cache, inputs.meta, D**-0.5)
        caches[rank] = k_cache

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out, lse = results[1]
    # lse is float32 (the backends' contract), so the merge weights carry ~1e-7 error
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-6, atol=1e-6)
    assert results[0][0].shape[0] == 0
    # Tokens 20..23 of "long" were written on rank 0 (block 5), 24..27 on rank 1 (block 3).
    torch.testing.assert_close(caches[0].view(-1, HKV, D)[20:24], long_k[20:24])
    torch.testing.assert_close(caches[1].view(-1, HKV, D)[12:16], long_k[24:28])
