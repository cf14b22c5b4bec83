"""``build_parts`` wires a controller from a config: one KV manager per layout (one rank:
``KVCacheManager``, which P/D replicas reach as ``one_rank_kv``; several: the sharded one),
the request limits from it, and the executor it is given or builds."""

from __future__ import annotations

import pytest

from actors.engine.config import EngineConfig
from actors.engine.controller_builder import build_parts
from actors.engine.executor import LocalExecutor
from actors.engine.replica_controller import ReplicaController
from store.kv_manager import KVCacheManager
from store.kv_sharded_manager import ShardedKVManager


def test_one_rank_builds_an_in_process_worker_over_one_kv_manager():
    parts = build_parts(None, block_size=4, num_blocks=10)
    try:
        assert isinstance(parts.kv, KVCacheManager) and parts.one_rank_kv is parts.kv
        assert isinstance(parts.executor, LocalExecutor) and parts.worker_spec.num_blocks == 10
        controller = ReplicaController(parts)
        assert controller.one_rank_kv is parts.kv
        assert controller.limits.kv_capacity_tokens == 40
    finally:
        parts.executor.shutdown()


def test_kv_parallel_ranks_share_one_sharded_manager():
    given = object()  # a multi-worker executor is not built when one is given
    config = EngineConfig(kvp=2, block_size=4, num_blocks=8)
    parts = build_parts(None, config, given)  # type: ignore[arg-type]
    assert parts.executor is given
    assert isinstance(parts.kv, ShardedKVManager) and parts.kv.kvp == 2
    assert parts.one_rank_kv is None
    controller = ReplicaController(parts)
    assert controller.limits.kv_capacity_tokens == parts.kv.max_tokens
    with pytest.raises(ValueError, match="spans 2 ranks"):
        _ = controller.one_rank_kv


def test_config_and_keyword_options_are_not_both_taken():
    with pytest.raises(ValueError, match="not both"):
        build_parts(None, EngineConfig(), block_size=4)
