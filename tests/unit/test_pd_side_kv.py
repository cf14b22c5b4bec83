"""Per-side KV size of a disaggregated group: a ``prefill`` / ``decode`` section's
``kv_cache_memory`` becomes that side's replicas' engine KV size, over the group engine's;
bad values are refused naming the field."""

from __future__ import annotations

import pytest

from actors.disagg.cluster_config import PDClusterConfig, PDSideConfig
from actors.engine.config import EngineConfig
from actors.serving.config import ConfigError, ServeConfig
from actors.serving.pd_group import pd_cluster_config

MIB = 1 << 20


def group(**sections) -> dict:
    return {"name": "pd", "num_prefill": 1, "num_decode": 1, **sections}


def cluster(**sections) -> PDClusterConfig:
    cfg = ServeConfig.from_args({"groups": [group(**sections)]})
    return pd_cluster_config(None, cfg.groups[0], "r0")


def test_each_side_gets_its_own_kv_size_over_the_group_engine():
    c = cluster(
        engine={"kv_cache_memory": 64 * MIB, "block_size": 16},
        prefill={"kv_cache_memory": 32 * MIB},
        decode={"kv_cache_memory": 96 * MIB, "storage_bytes_per_s": 1e8},
    )
    prefill, decode = c.side_engine(c.prefill), c.side_engine(c.decode)
    assert (prefill.kv_cache_memory, decode.kv_cache_memory) == (32 * MIB, 96 * MIB)
    assert prefill.block_size == decode.block_size == 16  # the rest is the group engine's
    assert c.decode.link_budget is not None and c.decode.link_budget.storage_bps == 1e8


def test_a_side_without_its_own_size_keeps_the_group_engines():
    c = cluster(engine={"kv_cache_memory": 64 * MIB}, decode={"kv_cache_memory": 96 * MIB})
    assert c.side_engine(c.prefill).kv_cache_memory == 64 * MIB
    assert c.side_engine(c.decode).kv_cache_memory == 96 * MIB
    plain = cluster(engine={"kv_cache_memory": 64 * MIB})
    assert plain.side_engine(plain.decode) is plain.engine  # nothing to override


@pytest.mark.parametrize(
    ("side", "value", "line"),
    [
        ("decode", 0, "groups[0].decode.kv_cache_memory: Input should be greater than 0"),
        ("prefill", -5, "groups[0].prefill.kv_cache_memory: Input should be greater than 0"),
        ("decode", "lots", "groups[0].decode.kv_cache_memory: Input should be a valid integer"),
    ],
)
def test_a_bad_side_kv_size_is_refused_naming_the_field(side, value, line):
    with pytest.raises(ConfigError) as e:
        ServeConfig.from_args({"groups": [group(**{side: {"kv_cache_memory": value}})]})
    assert line in str(e.value)


def test_a_side_kv_size_conflicts_with_a_fixed_block_count():
    raw = group(engine={"num_blocks": 64}, prefill={"kv_cache_memory": 8 * MIB})
    with pytest.raises(ConfigError, match=r"prefill\.kv_cache_memory .* engine\.num_blocks=64"):
        ServeConfig.from_args({"groups": [raw]})


def test_a_colocated_group_takes_no_side_section():
    with pytest.raises(ConfigError, match="decode needs num_prefill and num_decode"):
        ServeConfig.from_args({"groups": [{"decode": {"kv_cache_memory": MIB}}]})


def test_the_cluster_config_checks_side_sizes_too():
    with pytest.raises(ValueError, match="kv_cache_memory must be positive bytes"):
        PDSideConfig(kv_cache_memory=0)
    with pytest.raises(ValueError, match="engine.num_blocks fixes every pool"):
        PDClusterConfig(
            engine=EngineConfig(num_blocks=32), decode=PDSideConfig(kv_cache_memory=MIB)
        )
    c = PDClusterConfig(decode=PDSideConfig(kv_cache_memory=3 * MIB))
    assert c.side_engine(c.decode).kv_cache_memory == 3 * MIB
    assert c.side_engine(c.prefill).kv_cache_memory == c.engine.kv_cache_memory
