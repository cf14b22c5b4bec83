"""The shipped disaggregated config (``serve_config_pd.yaml``) is a valid ``ServeConfig``
whose one group is one cluster: one Conductor, a scaled prefill pool, and the store with
decode write-back, so later turns find the earlier answers in the pool."""

from __future__ import annotations

from pathlib import Path

import yaml

from actors.serving.config import ServeConfig
from actors.serving.pd_group import shared_pool_name

FILE = Path(__file__).resolve().parents[2] / "serve_config_pd.yaml"


def test_the_shipped_pd_config_is_one_cluster_with_a_scaled_prefill_pool_and_the_store():
    (app,) = yaml.safe_load(FILE.read_text())["applications"]
    cfg = ServeConfig.from_args(app["args"])
    (group,) = cfg.groups
    pool = shared_pool_name(app["name"], group, cfg.model)
    assert group.disaggregated and pool is not None and pool.startswith("meridian/pd/")
    other = group.model_copy(update={"num_prefill": 2})
    assert shared_pool_name(app["name"], other, cfg.model) != pool  # another config
    assert group.prefill is not None and group.prefill.autoscaling is not None
    assert group.store is not None and group.store.write_back
