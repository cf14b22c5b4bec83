"""The regions section of the Serve config: every group in exactly one region, delays and
residency naming known regions, delays both ways."""

import pytest
from pydantic import ValidationError

from actors.serving.config import ServeConfig


def config(**regions):
    section = {
        "regions": [{"name": "us", "groups": ["a"]}, {"name": "eu", "groups": ["b"]}],
        **regions,
    }
    return {"groups": [{"name": "a"}, {"name": "b"}], "regions": section}


def test_valid_section_and_delays():
    cfg = ServeConfig.model_validate(config(delay_ms={"us/eu": 40}, residency={"t": ["eu"]}))
    assert cfg.regions is not None
    assert cfg.regions.delay_s("eu", "us") == cfg.regions.delay_s("us", "eu") == 0.04
    assert cfg.regions.delay_s("us", "us") == 0.0
    assert ServeConfig.model_validate({}).regions is None


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"delay_ms": {"us/mars": 1}}, "two regions"),
        ({"delay_ms": {"us/eu": -1}}, ">= 0"),
        ({"residency": {"t": ["mars"]}}, "known regions"),
        ({"residency": {"t": []}}, "known regions"),
        ({"push": "eager"}, "push"),
        ({"probe_interval_s": 0}, "probe_interval_s"),
        ({"probe_ms": 5}, "probe_ms"),
    ],
)
def test_bad_sections_are_refused(bad, match):
    with pytest.raises(ValidationError, match=match):
        ServeConfig.model_validate(config(**bad))


def test_every_group_in_exactly_one_region():
    raw = config()
    raw["regions"]["regions"][1]["groups"] = ["a"]
    with pytest.raises(ValidationError, match="exactly one region"):
        ServeConfig.model_validate(raw)
    raw["regions"]["regions"][1]["groups"] = ["b", "c"]
    with pytest.raises(ValidationError, match="exactly one region"):
        ServeConfig.model_validate(raw)
    raw = config()
    raw["regions"]["regions"].append({"name": "us", "groups": ["x"]})
    with pytest.raises(ValidationError, match="distinct"):
        ServeConfig.model_validate(raw)


def test_region_node_resources_pin_its_replicas_and_balancer():
    from serve_app import _actor_options

    raw = config()
    raw["regions"]["regions"][0]["node_resource"] = "region-us"
    raw["groups"][0]["num_cpus"] = 0.5
    cfg = ServeConfig.model_validate(raw)
    a, b = cfg.groups
    assert _actor_options(cfg, a) == {"num_cpus": 0.5, "resources": {"region-us": 0.01}}
    assert _actor_options(cfg, b) == {"num_cpus": 0.0}  # eu names no resource
    assert cfg.regions is not None
    us, eu = cfg.regions.regions
    assert cfg.regions.actor_resources(us) == {"region-us": 0.01}
    assert cfg.regions.actor_resources(eu) == {}
    assert _actor_options(ServeConfig.model_validate({}), ServeConfig().groups[0]) == {
        "num_cpus": 0.0
    }


def test_a_pinned_regions_workers_reserve_its_node_resource():
    """tp/spp > 1 replicas start worker actors; in a region with a node resource they
    reserve it too (``EngineConfig.worker_resources``), beside any the engine section
    names; a region without one leaves them unpinned."""
    raw = config()
    raw["regions"]["regions"][0]["node_resource"] = "region-us"
    raw["groups"][0]["engine"] = {"worker_resources": {"fast-nic": 1}, "tp": 2}
    cfg = ServeConfig.model_validate(raw)
    a, b = cfg.groups
    assert cfg.group_engine_config(a).worker_resources == {"fast-nic": 1, "region-us": 0.01}
    assert cfg.group_engine_config(a).tp == 2
    assert cfg.group_engine_config(b).worker_resources is None
    assert ServeConfig.model_validate({}).group_engine_config(ServeConfig().groups[0]) == (
        ServeConfig().groups[0].engine
    )
    raw["groups"][0]["engine"] = {"worker_resources": {"fast-nic": 0}}
    with pytest.raises(ValidationError, match="worker_resources"):
        ServeConfig.model_validate(raw)
