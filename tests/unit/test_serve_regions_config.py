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
