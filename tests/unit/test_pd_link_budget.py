"""A disaggregated group's storage-link budget (``prefill`` / ``decode``
``storage_bytes_per_s``) reaches its cluster's sides as their ``LinkBudget``."""

from __future__ import annotations

import pytest

from actors.serving.config import ConfigError, ServeConfig
from actors.serving.pd_group import pd_cluster_config


def group(**sides):
    raw = {"groups": [{"name": "pd", "num_prefill": 1, "num_decode": 1, "store": {}, **sides}]}
    return ServeConfig.parse(raw).groups[0]


def test_each_side_gets_its_storage_link():
    g = group(prefill={"storage_bytes_per_s": 2e6}, decode={"storage_bytes_per_s": 8e6})
    c = pd_cluster_config(None, g, "r0")
    assert c.prefill.link_budget is not None and c.decode.link_budget is not None
    assert (c.prefill.link_budget.storage_bps, c.decode.link_budget.storage_bps) == (2e6, 8e6)
    assert c.prefill.link_budget.compute_bps is None  # only the storage link is limited


def test_without_a_rate_the_links_are_not_limited():
    c = pd_cluster_config(None, group(prefill={"tp": 1}), "r0")
    assert c.prefill.link_budget is None and c.decode.link_budget is None


@pytest.mark.parametrize("rate", [0, -1.0, "fast"])
def test_a_bad_rate_is_refused_naming_its_path(rate):
    with pytest.raises(ConfigError, match=r"prefill\.storage_bytes_per_s"):
        group(prefill={"storage_bytes_per_s": rate})
