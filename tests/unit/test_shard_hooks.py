"""What a ``ModelShard`` takes through its constructor: the attention backend its layers use,
and a layer hook called after each layer has written the step's K/V."""

from __future__ import annotations

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.kv_cache import allocate_kv_cache
from kernels.registry import get_attention_backend
from models import load_model
from models.sharding import ModelShard
from models.tiny import tiny_model_dir

TOKENS = 12


def _step():
    meta = AttentionMetadata.build([TOKENS], [TOKENS], [[0]], 16)
    return torch.arange(3, 3 + TOKENS), torch.arange(TOKENS), meta


def _shard(stage: int = 0, spp: int = 1, **kwargs) -> ModelShard:
    return ModelShard(load_model(tiny_model_dir("dense"), torch.float64), stage, spp, **kwargs)


def _caches(num_layers: int):
    """One 16-slot block per layer; the tiny model has 2 KV heads of 16."""
    return allocate_kv_cache(num_layers, 1, 16, 2, 16, torch.float64)


class Recorder:
    """Records each call with what the shard's caches held at that moment."""

    def __init__(self, caches) -> None:
        self.caches = caches  # the shard's per-layer caches, to look at the layers around
        self.calls: list[tuple[int, bool, bool]] = []  # (layer, this written, next written)

    def after_layer(self, layer: int, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        local = next(i for i, c in enumerate(self.caches) if c is kv_cache)
        written = bool(kv_cache[0][0, :TOKENS].abs().sum() > 0)
        later = self.caches[local + 1 :]
        next_written = bool(later) and bool(later[0][0].abs().sum() > 0)
        self.calls.append((layer, written, next_written))


def test_layer_hook_sees_each_layer_after_its_kv_write_with_global_indices():
    ids, pos, meta = _step()
    plain_first, plain_second = _shard(0, 2), _shard(1, 2)  # layers 0, 1 and 2, 3
    plain_hidden = plain_first(ids, pos, _caches(2), meta)
    reference = plain_second(None, pos, _caches(2), meta, plain_hidden)

    first_caches, second_caches = _caches(2), _caches(2)
    first_hook, second_hook = Recorder(first_caches), Recorder(second_caches)
    first = _shard(0, 2)
    first.set_layer_hook(first_hook)  # set after construction, as a worker does
    second = _shard(1, 2, layer_hook=second_hook)  # or given to the constructor
    hidden = first(ids, pos, first_caches, meta)
    out = second(None, pos, second_caches, meta, hidden)

    assert first_hook.calls == [(0, True, False), (1, True, False)]  # stage 0: layers 0, 1
    assert second_hook.calls == [(2, True, False), (3, True, False)]  # stage 1: layers 2, 3
    torch.testing.assert_close(out, reference, rtol=0, atol=0)  # the hook changes nothing

    second.set_layer_hook(None)
    second(None, pos, _caches(2), meta, hidden)
    assert len(second_hook.calls) == 2


class CountingBackend:
    """The torch backend, counting attention calls."""

    name = "counting"

    def __init__(self) -> None:
        self.inner = get_attention_backend("torch")
        self.write_kv = self.inner.write_kv
        self.calls = 0

    def attention(self, q, k_cache, v_cache, meta, scale):
        self.calls += 1
        return self.inner.attention(q, k_cache, v_cache, meta, scale)


def test_attention_backend_comes_through_the_constructor():
    ids, pos, meta = _step()
    reference = _shard()(ids, pos, _caches(4), meta)
    backend = CountingBackend()
    shard = _shard(attention_backend=backend)
    out = shard(ids, pos, _caches(4), meta)
    assert backend.calls == shard.num_layers
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
