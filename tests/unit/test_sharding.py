"""Model shards in process: stages chained, and TP ranks run as threads with a thread
all-reduce, give the full model's hidden states (fp64)."""

from __future__ import annotations

import threading

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.kv_cache import allocate_kv_cache
from models import load_model
from models.sharding import ModelShard, layer_range
from models.tiny import tiny_model_dir


def test_layer_range_covers_every_layer_once():
    for layers in (1, 4, 7):
        for spp in range(1, layers + 1):
            ranges = [layer_range(layers, spp, s) for s in range(spp)]
            assert ranges[0][0] == 0 and ranges[-1][1] == layers
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))
            assert all(hi > lo for lo, hi in ranges)
    with pytest.raises(ValueError, match="between 1 and the 4 layers"):
        layer_range(4, 5, 0)


def _inputs(num_tokens: int = 12):
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [[0]], 16)
    ids = torch.arange(3, 3 + num_tokens)
    return ids, torch.arange(num_tokens), meta


def _caches(shard, kv_heads):
    cfg = shard.config
    return allocate_kv_cache(shard.num_layers, 1, 16, kv_heads, cfg.head_dim, torch.float64)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_stages_chained_equal_the_full_model(kind):
    ids, pos, meta = _inputs()
    full = load_model(tiny_model_dir(kind), torch.float64)
    cfg = full.config
    ref = full(
        ids, pos, allocate_kv_cache(cfg.num_hidden_layers, 1, 16, 2, 16, torch.float64), meta
    )
    hidden = None
    for stage in range(3):
        shard = ModelShard(load_model(tiny_model_dir(kind), torch.float64), stage, 3)
        hidden = shard(ids if stage == 0 else None, pos, _caches(shard, 2), meta, hidden)
    assert hidden is not None
    torch.testing.assert_close(hidden, ref, rtol=1e-12, atol=1e-12)


class ThreadAllReduce:
    """Sums a tensor in place across ``n`` threads (stands in for gloo in process)."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n)
        self.parts: dict[int, torch.Tensor] = {}
        self.lock = threading.Lock()

    def for_rank(self, rank: int):
        def all_reduce(x: torch.Tensor) -> None:
            with self.lock:
                self.parts[rank] = x.clone()
            self.barrier.wait()
            total = sum(self.parts[r] for r in sorted(self.parts))
            self.barrier.wait()
            x.copy_(total)

        return all_reduce


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_tensor_parallel_ranks_sum_to_the_full_model(kind):
    ids, pos, meta = _inputs()
    full = load_model(tiny_model_dir(kind), torch.float64)
    cfg = full.config
    ref = full(
        ids, pos, allocate_kv_cache(cfg.num_hidden_layers, 1, 16, 2, 16, torch.float64), meta
    )
    group = ThreadAllReduce(2)
    outs: dict[int, torch.Tensor] = {}

    def run(rank: int) -> None:
        model = load_model(tiny_model_dir(kind), torch.float64)
        shard = ModelShard(model, 0, 1, rank, 2, group.for_rank(rank))
        assert shard.layers[0].self_attn.num_heads == cfg.num_attention_heads // 2
        with torch.inference_mode():
            outs[rank] = shard(ids, pos, _caches(shard, 1), meta)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(outs) == {0, 1}
    torch.testing.assert_close(outs[0], ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
