"""The Serve deployment config: disaggregated groups (num_prefill / num_decode / store) and
their validation messages; the shipped serve_config.yaml still parses."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from actors.engine.config import EngineConfig
from actors.serving.config import ConfigError, ReplicaGroupConfig, ServeConfig

REPO = Path(__file__).resolve().parents[2]


def error(**group) -> str:
    with pytest.raises(ValidationError) as e:
        ReplicaGroupConfig(**group)
    return str(e.value)


def test_colocated_group_defaults_are_unchanged():
    g = ReplicaGroupConfig(name="main", engine={"block_size": 8, "tp": 2})
    assert not g.disaggregated
    assert g.num_replicas == 2
    assert g.num_prefill is None and g.num_decode is None and g.store is None
    assert g.engine == EngineConfig(block_size=8, tp=2)
    assert g.model_dump()["engine"] == {"block_size": 8, "tp": 2}  # what differs from defaults


def test_colocated_group_takes_engine_cores():
    g = ReplicaGroupConfig(name="main", engine={"cpu_cores": [0]})
    assert g.engine.cpu_cores == [0]
    assert "tp = spp = kvp = 1" in error(name="g", engine={"cpu_cores": [0], "tp": 2})


def test_the_engine_section_is_the_engine_config_built_once():
    config = EngineConfig(token_budget=512)
    g = ReplicaGroupConfig(engine=config)
    assert g.engine is config  # an EngineConfig object passes as is
    assert ReplicaGroupConfig(engine={"token_budget": 512}).engine == config
    assert ReplicaGroupConfig().engine == EngineConfig()


@pytest.mark.parametrize(
    "raw, line",
    [
        ({"groups": [{"engine": {"tokn_budget": 1}}]}, "groups[0].engine.tokn_budget: unknown key"),
        (
            {"groups": [{"name": "a"}, {"name": "b", "engine": {"kvp_rank": 1}}]},
            "groups[1].engine.kvp_rank: unknown key",
        ),
        (
            {"groups": [{"tp": 2}]},
            "groups[0].tp: unknown key; it is an engine option: put it under groups[0].engine",
        ),
        ({"limits": {"max_tokns": 1}}, "limits.max_tokns: unknown key"),
        ({"modle": "x"}, "modle: unknown key"),
        (
            {"groups": [{"num_prefill": 1, "num_decode": 1, "store": {"dram": 1}}]},
            "groups[0].store.dram: unknown key",
        ),
        (
            {"groups": [{"engine": {"token_budget": "many"}}]},
            "groups[0].engine.token_budget: Input should be a valid integer",
        ),
        ({"groups": [{"engine": {"token_budget": 0}}]}, "groups[0].engine: Value error, token"),
    ],
)
def test_a_bad_key_anywhere_is_refused_with_its_path(raw, line):
    with pytest.raises(ConfigError) as e:
        ServeConfig.from_args(raw)
    assert line in str(e.value)


def test_a_bad_key_in_a_yaml_file_is_refused_with_its_path(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("groups:\n  - name: main\n    engine: {block_size: 16, tokn_budget: 8}\n")
    with pytest.raises(ConfigError, match=r"groups\[0\]\.engine\.tokn_budget: unknown key"):
        ServeConfig.from_args({"config": str(path)})


def test_disaggregated_group_defaults_to_one_cluster_per_serve_replica():
    g = ReplicaGroupConfig(name="pd", num_prefill=2, num_decode=1)
    assert g.disaggregated
    assert (g.num_prefill, g.num_decode, g.num_replicas) == (2, 1, 1)
    assert ReplicaGroupConfig(num_prefill=1, num_decode=1, num_replicas=3).num_replicas == 3
    assert g.engine == EngineConfig()


def test_store_section_mirrors_store_config():
    g = ReplicaGroupConfig(
        num_prefill=1,
        num_decode=1,
        store={"dram_bytes": 1 << 20, "ssd_bytes": 2 << 20, "ssd_dir": "/tmp/kv", "num_shards": 2},
    )
    assert g.store is not None
    assert (g.store.dram_bytes, g.store.ssd_bytes, g.store.ssd_dir, g.store.num_shards) == (
        1 << 20,
        2 << 20,
        "/tmp/kv",
        2,
    )
    default = ReplicaGroupConfig(num_prefill=1, num_decode=1, store={}).store
    assert default is not None
    assert (default.dram_bytes, default.ssd_bytes, default.ssd_dir, default.num_shards) == (
        64 << 20,
        0,
        None,
        1,
    )


@pytest.mark.parametrize(
    "group, needle",
    [
        ({"num_prefill": 1}, "give both num_prefill and num_decode"),
        ({"num_decode": 2}, "give both num_prefill and num_decode"),
        ({"num_prefill": 0, "num_decode": 1}, "greater than or equal to 1"),
        ({"num_prefill": 1, "num_decode": 1, "engine": {"tp": 2}}, "remove engine.tp=2"),
        ({"prefill": {"tp": 2}}, "prefill needs num_prefill and num_decode"),
        (
            {"num_prefill": 1, "num_decode": 1, "prefill": {"tp": 2}, "store": {}},
            "the KV store needs prefill replicas of tp = 1",
        ),
        ({"num_prefill": 1, "num_decode": 1, "prefill": {"kvp": 2}}, "remove prefill.kvp=2"),
        (
            {
                "num_prefill": 1,
                "num_decode": 1,
                "decode": {"kvp": 2},
                "store": {"read_path": "dual"},
            },
            "store.read_path dual needs single-worker decode replicas",
        ),
        ({"num_prefill": 1, "num_decode": 1, "engine": {"spp": 3}}, "remove engine.spp=3"),
        ({"num_prefill": 1, "num_decode": 1, "engine": {"kvp": 2}}, "remove engine.kvp=2"),
        ({"store": {"write_back": True}}, "store.write_back is a disaggregated group's option"),
        (
            {"num_prefill": 1, "num_decode": 1, "store": {"ssd_bytes": 1 << 20}},
            "store.ssd_bytes > 0 needs store.ssd_dir",
        ),
        ({"num_prefill": 1, "num_decode": 1, "store": {"dram_byte": 1}}, "dram_byte"),
        ({"num_prefill": 1, "num_decode": 1, "store": {"num_shards": 0}}, "num_shards"),
        ({"num_prefill": 1, "num_decode": 1, "num_replicas": 0}, "num_replicas"),
        ({"conductor": {"ttft_slo": 1.0}}, "conductor needs num_prefill and num_decode"),
        ({"num_prefill": 1, "num_decode": 1, "conductor": {"admission": "late"}}, "admission"),
        ({"num_prefill": 1, "num_decode": 1, "conductor": {"tbt_slo": 0}}, "tbt_slo"),
        ({"num_prefill": 1, "num_decode": 1, "engine": {"cpu_cores": [0]}}, "remove cpu_cores"),
    ],
)
def test_bad_disaggregated_groups_say_what_to_fix(group, needle):
    assert needle in error(name="g", **group)


def test_errors_name_the_group():
    assert "group 'decode-heavy'" in error(name="decode-heavy", num_prefill=1)


def test_serve_config_with_a_disaggregated_group_round_trips():
    raw = {
        "groups": [
            {"name": "main", "num_replicas": 1},
            {"name": "pd", "num_prefill": 1, "num_decode": 2, "store": {"dram_bytes": 1 << 22}},
        ]
    }
    cfg = ServeConfig.from_args(raw)
    assert [g.disaggregated for g in cfg.groups] == [False, True]
    assert cfg.num_replicas == 2
    again = ServeConfig.model_validate(cfg.model_dump())  # a file made from a dump reads back
    assert again == cfg
    assert again.groups[1].num_replicas == 1


def test_shipped_serve_config_parses_and_stays_colocated():
    raw = yaml.safe_load((REPO / "serve_config.yaml").read_text())
    cfg = ServeConfig.from_args(raw["applications"][0]["args"])
    assert not any(g.disaggregated for g in cfg.groups)


def test_commented_pd_example_in_serve_config_validates():
    """The disaggregated group documented (commented out) in serve_config.yaml is valid."""
    lines = (REPO / "serve_config.yaml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# - name: pd")
    block = []
    for line in lines[start:]:
        if not line.strip().startswith("#"):
            break
        block.append(line.replace("# ", "", 1))
    (raw,) = yaml.safe_load("\n".join(block))
    g = ReplicaGroupConfig(**raw)
    assert g.disaggregated and g.num_replicas == 1


@pytest.mark.parametrize(
    "group, needle",
    [
        (
            {"store": {"read_path": "both"}},
            "store.read_path must be one of prefill, decode, dual, got 'both'",
        ),
        ({"store": {"write_back": "yes"}}, "write_back"),
        (
            {"conductor": {"scheduler": "dual"}},
            "conductor.scheduler must be one of mooncake, dualpath, got 'dual'",
        ),
        (
            {"store": {"write_back": True}, "decode": {"tp": 2}},
            "store.write_back needs single-worker decode replicas",
        ),
        (
            {"store": {"read_path": "dual"}, "decode": {"spp": 2}},
            "store.read_path dual needs single-worker decode replicas",
        ),
    ],
)
def test_dualpath_keys_refuse_unknown_values_naming_the_choices(group, needle):
    assert needle in error(name="g", num_prefill=1, num_decode=1, **group)


def test_dualpath_keys_reach_the_cluster():
    from actors.disagg.conductor import ConductorOptions
    from actors.serving.pd_group import pd_cluster_config

    g = ReplicaGroupConfig(
        num_prefill=2,
        num_decode=1,
        store={"read_path": "dual", "write_back": True, "ssd_bytes": 1, "ssd_dir": "/kv"},
        conductor={"scheduler": "dualpath", "ttft_slo": 5.0},
    )
    c = pd_cluster_config("m", g, "r1")
    assert (c.read_path, c.scheduler) == ("dual", "dualpath")
    assert (c.prefill.count, c.decode.count, c.model_dir) == (2, 1, "m")
    assert c.store is not None and c.store.write_back and c.store.ssd_dir == "/kv/r1"
    assert isinstance(c.conductor, ConductorOptions) and c.conductor.ttft_slo == 5.0
    assert c.engine is g.engine  # built once, by the group
    plain = pd_cluster_config(None, ReplicaGroupConfig(num_prefill=1, num_decode=1), "r0")
    assert (plain.read_path, plain.scheduler, plain.store) == ("prefill", "mooncake", None)
    stored = ReplicaGroupConfig(num_prefill=1, num_decode=1, store={}).store
    assert stored is not None and (stored.read_path, stored.write_back) == ("prefill", False)


def test_a_pipelined_prefill_side_keeps_the_kv_store():
    """Mooncake's chunked pipeline parallelism (prefill spp > 1, tp = 1) with the store."""
    from actors.serving.pd_group import pd_cluster_config

    g = ReplicaGroupConfig(
        num_prefill=1, num_decode=1, prefill={"spp": 2}, store={"write_back": True}
    )
    c = pd_cluster_config(None, g, "r0")
    assert (c.prefill.tp, c.prefill.spp) == (1, 2)
    assert c.store is not None and c.store.write_back


def test_a_kv_parallel_decode_side_reaches_the_cluster():
    from actors.serving.pd_group import pd_cluster_config

    g = ReplicaGroupConfig(num_prefill=1, num_decode=1, decode={"kvp": 2}, store={})
    c = pd_cluster_config(None, g, "r0")
    assert (c.side_engine(c.decode).kvp, c.side_engine(c.prefill).kvp) == (2, 1)


def test_every_deployment_gets_the_one_config_object():
    """serve_app validates once and binds the ServeConfig itself, not a dump to validate again."""
    from serve_app import build_app

    raw = {"groups": [{"name": "main"}, {"name": "pd", "num_prefill": 1, "num_decode": 1}]}
    ingress = build_app(raw)._bound_deployment
    cfg = ingress.init_args[0]
    assert isinstance(cfg, ServeConfig) and cfg == ServeConfig.from_args(raw)
    replicas = ingress.init_args[2]
    assert [r._bound_deployment.init_args[:2] for r in replicas.values()] == [
        (cfg, "main"),
        (cfg, "pd"),
    ]
    assert all(r._bound_deployment.init_args[0] is cfg for r in replicas.values())


def test_the_session_header_is_a_header_name():
    assert ServeConfig().session_header == "x-session-id"
    assert ServeConfig.parse({"session_header": "x-user-key"}).session_header == "x-user-key"
    with pytest.raises(ConfigError, match="session_header"):
        ServeConfig.parse({"session_header": "x user"})


def test_regions_choose_by_trie_or_session_hash():
    from actors.regions.serve_balancer import RegionBalancerDeployment
    from policies.target_choice import SessionHashChoice

    regions = {"regions": [{"name": "us", "groups": ["default"]}], "choice": "hash"}
    cfg = ServeConfig.parse({"regions": regions})
    balancer = RegionBalancerDeployment(cfg, "us", router=None)
    assert isinstance(balancer.policy.local_choice, SessionHashChoice)
    assert isinstance(balancer.policy.snapshot_choice, SessionHashChoice)  # peers too
    with pytest.raises(ConfigError, match="local_view must be trie"):
        ServeConfig.parse({"regions": {**regions, "local_view": "index"}})


def test_report_interval_is_slower_without_regions_unless_set():
    from actors.engine.defaults import REGION_REPORT_INTERVAL_S, REPORT_INTERVAL_S

    regions = {"regions": [{"name": "us", "groups": ["default"]}]}
    assert ServeConfig.parse({}).report_interval() == REPORT_INTERVAL_S == 0.5
    assert ServeConfig.parse({"regions": regions}).report_interval() == REGION_REPORT_INTERVAL_S
    assert ServeConfig.parse({"regions": regions, "report_interval_s": 2}).report_interval() == 2
    with pytest.raises(ValueError, match="report_interval_s"):
        ServeConfig.parse({"report_interval_s": 0})


def test_store_placement_defaults_by_group_kind_and_is_checked():
    pd = ReplicaGroupConfig(num_prefill=1, num_decode=1, store={}).store
    colocated = ReplicaGroupConfig(store={}).store
    assert pd is not None and colocated is not None
    assert pd.placement_for(disaggregated=True) == "local"
    assert colocated.placement_for(disaggregated=False) == "key"
    chosen = ReplicaGroupConfig(num_prefill=1, num_decode=1, store={"placement": "key"}).store
    assert chosen is not None and chosen.placement_for(disaggregated=True) == "key"
    with pytest.raises(ValidationError, match="placement"):
        ReplicaGroupConfig(store={"placement": "nearest"})
