"""Model shards in process: stages chained, and TP ranks run as threads with a thread
all-reduce, give the full model's hidden states (fp64), also when TP ranks outnumber the KV
heads (replicated KV heads)."""

from __future__ import annotations

import threading

import pytest
import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.kv_cache import allocate_kv_cache
from models import load_model
from models.sharding import ModelShard, kv_head_range, kv_heads_per_rank, layer_range
from models.tiny import tiny_model_dir, write_tiny_model


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
        self.barrier = threading.Barrier(n, timeout=120)  # a failed rank breaks it
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


def test_kv_head_range_splits_or_replicates():
    assert [kv_head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, 4, r) for r in range(4)] == [(0, 1)] * 4
    assert [kv_head_range(8, 16, r)[0] for r in range(16)] == [r // 2 for r in range(16)]
    assert kv_heads_per_rank(8, 2) == 4 and kv_heads_per_rank(8, 16) == 1
    with pytest.raises(ValueError, match="must divide the 8 KV heads"):
        kv_head_range(8, 3, 0)
    with pytest.raises(ValueError, match="must be a multiple"):
        kv_heads_per_rank(4, 6)
    with pytest.raises(ValueError, match="not in"):
        kv_head_range(2, 2, 2)


def _greedy(run, logits_of, prompt_len: int = 12, new_tokens: int = 4):
    """Prefill a prompt, then decode greedily over the cache (blocks 0 and 1 of 16 slots).
    ``run(ids, positions, meta) -> hidden``. Returns (prompt logits [T, V], tokens)."""
    table = [[0, 1]]
    meta = AttentionMetadata.build([prompt_len], [prompt_len], table, 16)
    logits = logits_of(run(torch.arange(3, 3 + prompt_len), torch.arange(prompt_len), meta))
    tokens = [int(logits[-1].argmax())]
    for pos in range(prompt_len, prompt_len + new_tokens - 1):
        meta = AttentionMetadata.build([1], [pos + 1], table, 16)
        hidden = run(torch.tensor([tokens[-1]]), torch.tensor([pos]), meta)
        tokens.append(int(logits_of(hidden)[-1].argmax()))
    return logits, tokens


@pytest.mark.parametrize(
    ("kind", "kv_heads", "tp"),
    [("dense", 1, 2), ("dense", 1, 4), ("dense", 2, 4), ("moe", 1, 2)],
    ids=lambda v: str(v),
)
def test_tensor_parallel_beyond_kv_heads_equals_the_full_model(kind, kv_heads, tp):
    """tp > KV heads: each rank holds one (replicated) KV head and caches only that one."""
    model_dir = tiny_model_dir(kind, num_key_value_heads=kv_heads)
    full = load_model(model_dir, torch.float64)
    cfg = full.config
    assert cfg.num_key_value_heads == kv_heads
    caches = allocate_kv_cache(cfg.num_hidden_layers, 2, 16, kv_heads, 16, torch.float64)
    ref_logits, ref_tokens = _greedy(
        lambda ids, pos, meta: full(ids, pos, caches, meta), full.compute_logits
    )
    group = ThreadAllReduce(tp)
    results: dict[int, tuple[torch.Tensor, list[int]]] = {}
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            shard = ModelShard(
                load_model(model_dir, torch.float64), 0, 1, rank, tp, group.for_rank(rank)
            )
            assert shard.num_kv_heads == 1
            attn = shard.layers[0].self_attn
            assert (attn.num_heads, attn.num_kv_heads) == (cfg.num_attention_heads // tp, 1)
            rank_caches = allocate_kv_cache(shard.num_layers, 2, 16, 1, 16, torch.float64)
            with torch.inference_mode():
                results[rank] = _greedy(
                    lambda ids, pos, meta: shard(ids, pos, rank_caches, meta),
                    shard.compute_logits,
                )
        except BaseException as exc:  # reported below; the barrier breaks for the others
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    for rank in range(tp):
        logits, tokens = results[rank]
        torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-10)
        assert tokens == ref_tokens


def test_tensor_parallel_refuses_tp_not_a_multiple_of_kv_heads(tmp_path):
    model_dir = write_tiny_model(
        tmp_path, hidden_size=48, num_attention_heads=12, num_key_value_heads=3
    )
    with pytest.raises(ValueError, match="larger than the 3 KV heads, so it must be a multiple"):
        ModelShard(load_model(model_dir), 0, 1, 0, 4, lambda x: None)
    with pytest.raises(ValueError, match="tp=2 must divide the 3 KV heads"):
        ModelShard(load_model(model_dir), 0, 1, 0, 2, lambda x: None)
    with pytest.raises(ValueError, match="tp=5 must divide the 12 query heads"):
        ModelShard(load_model(model_dir), 0, 1, 0, 5, lambda x: None)
