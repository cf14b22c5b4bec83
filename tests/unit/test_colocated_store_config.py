"""A colocated group may have a ``store`` section (app-wide shards its replicas share,
``actors.serving.store_engine``): the sizes and ``min_load_tokens`` are its own; the
disaggregated-only options and multi-worker layouts are refused, each naming what to
remove; its store keeps sessions' retained KV (``tenant_retained_share`` bounds a
tenant's share)."""

from __future__ import annotations

import pytest

from actors.engine.defaults import STORE_MIN_LOAD_TOKENS
from actors.serving.config import ConfigError, ServeConfig


def group(**fields) -> dict:
    return {"name": "main", "num_replicas": 2, **fields}


def parse(**fields) -> ServeConfig:
    return ServeConfig.parse({"groups": [group(**fields)]})


def problem(**fields) -> str:
    with pytest.raises(ConfigError) as e:
        parse(**fields)
    return str(e.value)


def test_a_colocated_group_takes_a_store_section():
    store = {
        "dram_bytes": 1 << 22,
        "ssd_bytes": 1 << 24,
        "ssd_dir": "/tmp/kv",
        "num_shards": 2,
        "min_load_tokens": 32,
    }
    (g,) = parse(store=store).groups
    assert not g.disaggregated
    assert g.store is not None
    assert (g.store.dram_bytes, g.store.num_shards, g.store.min_load_tokens) == (1 << 22, 2, 32)
    default = parse(store={}).groups[0].store
    assert default is not None and default.min_load_tokens == STORE_MIN_LOAD_TOKENS
    # the defaults of the P/D-only fields, written out, are fine
    assert parse(store={"read_path": "prefill", "write_back": False}).groups[0].store
    cfg = parse(store=store)
    assert ServeConfig.model_validate(cfg.model_dump()) == cfg  # a dump reads back


@pytest.mark.parametrize(
    "store, field",
    [
        ({"read_path": "dual"}, "read_path"),
        ({"read_path": "decode"}, "read_path"),
        ({"write_back": True}, "write_back"),
    ],
)
def test_disaggregated_only_store_options_are_refused_by_name(store, field):
    text = problem(store=store)
    assert f"group 'main': store.{field} is a disaggregated group's option" in text
    assert f"remove store.{field} or add num_prefill and num_decode" in text


@pytest.mark.parametrize(
    "engine, named",
    [
        ({"tp": 2}, "engine.tp=2"),
        ({"spp": 2}, "engine.spp=2"),
        ({"kvp": 2}, "engine.kvp=2"),
        ({"attention_workers": 1, "expert_workers": 1}, "engine.attention_workers=1"),
    ],
)
def test_a_colocated_store_needs_single_worker_replicas(engine, named):
    text = problem(store={}, engine=engine)
    assert "a colocated group's store needs single-worker replicas" in text
    assert f"remove store or {named}" in text


def test_a_colocated_store_needs_the_prefix_cache():
    text = problem(store={}, engine={"enable_prefix_caching": False})
    assert "loads into the prefix cache" in text


def test_sizes_are_checked_as_for_a_disaggregated_group():
    assert "store.ssd_bytes > 0 needs store.ssd_dir" in problem(store={"ssd_bytes": 1 << 20})
    assert "num_shards" in problem(store={"num_shards": 0})
    assert "min_load_tokens" in problem(store={"min_load_tokens": -1})


def test_min_load_tokens_is_refused_for_a_disaggregated_group():
    pd = {"name": "pd", "num_prefill": 1, "num_decode": 1, "store": {"min_load_tokens": 16}}
    with pytest.raises(ConfigError, match="store.min_load_tokens is a colocated group's option"):
        ServeConfig.parse({"groups": [pd]})
    pd["store"] = {"min_load_tokens": STORE_MIN_LOAD_TOKENS}  # the default: a dump reads back
    assert ServeConfig.parse({"groups": [pd]}).groups[0].store is not None


def test_sessions_retention_is_kept_by_a_colocated_store():
    raw = {"groups": [group(store={})], "sessions": {"default_kv_retention_s": 30}}
    assert ServeConfig.parse(raw).session_retention_s(None, None) == 30
    cfg = parse(store={"tenant_retained_share": 0.2})
    assert cfg.storeless_group() is None
    assert cfg.session_retention_s(10, None) == 10
    with pytest.raises(ConfigError, match="group 'main' has none"):
        ServeConfig.parse({"groups": [group()], "sessions": {"default_kv_retention_s": 30}})


def test_a_colocated_store_replica_refuses_a_gpu_cache_before_building():
    # its loads and writes move the cache through host memory (no GPU needed to check:
    # the refusal comes before any model or cache is built)
    from actors.engine.config import EngineConfig
    from actors.serving.store_engine import store_engine

    with pytest.raises(ValueError, match="run on the CPU"):
        store_engine(None, EngineConfig(device="cuda"), "app/main", "r0", 64)
