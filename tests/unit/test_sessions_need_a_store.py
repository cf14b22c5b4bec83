"""KV retention works only in a group's KV store (colocated or disaggregated), and the
router may send a request to any group: a retention the app cannot keep is refused, never
accepted and ignored. In the config, a nonzero ``sessions`` default or tenant entry needs a store in
every group (``ConfigError``); at the edge, ``ServeConfig.session_retention_s`` (what the
ingress calls for each request, its ValueError a 400 on ``kv_retention_s``) refuses a
request asking for retention where a group has none."""

from __future__ import annotations

import pytest

from actors.serving.config import ConfigError, ServeConfig

PD = {"name": "pd", "num_prefill": 1, "num_decode": 1, "store": {"dram_bytes": 1 << 22}}
PD_NO_STORE = {"name": "pd", "num_prefill": 1, "num_decode": 1}
COLOCATED = {"name": "main", "num_replicas": 1}
COLOCATED_STORE = {"name": "chat", "num_replicas": 2, "store": {"dram_bytes": 1 << 22}}


@pytest.mark.parametrize(
    "groups, bare",
    [
        (None, "default"),  # the default group: colocated
        ([COLOCATED], "main"),
        ([PD_NO_STORE], "pd"),
        ([COLOCATED, PD], "main"),  # a request may be routed to either group
    ],
)
def test_a_default_retention_without_a_store_everywhere_is_a_config_error(groups, bare):
    raw: dict = {"sessions": {"default_kv_retention_s": 30}}
    if groups is not None:
        raw["groups"] = groups
    with pytest.raises(ConfigError) as e:
        ServeConfig.parse(raw)
    text = str(e.value)
    assert "sessions.default_kv_retention_s = 30.0" in text
    assert f"group {bare!r} has none" in text
    assert "give every group a store section, or set sessions.default_kv_retention_s to 0" in text


def test_a_tenant_retention_without_a_store_is_a_config_error():
    raw = {"sessions": {"tenant_kv_retention_s": {"free": 0, "acme": 30}}}
    with pytest.raises(ConfigError, match=r"sessions.tenant_kv_retention_s\['acme'\] = 30"):
        ServeConfig.parse(raw)


def test_zero_retentions_need_no_store():
    sessions = {"default_kv_retention_s": 0, "tenant_kv_retention_s": {"acme": 0}}
    cfg = ServeConfig.parse({"groups": [COLOCATED], "sessions": sessions})
    assert cfg.storeless_group() == "main"
    assert cfg.session_retention_s(None, "acme") == 0
    assert cfg.session_retention_s(0, None) == 0  # asking for none is fine anywhere


@pytest.mark.parametrize("groups", [[PD], [COLOCATED_STORE], [COLOCATED_STORE, PD]])
def test_with_a_store_in_every_group_defaults_and_requests_are_kept(groups):
    sessions = {"default_kv_retention_s": 5, "tenant_kv_retention_s": {"acme": 30}}
    cfg = ServeConfig.parse({"groups": groups, "sessions": sessions})
    assert cfg.storeless_group() is None
    assert cfg.session_retention_s(None, None) == 5
    assert cfg.session_retention_s(None, "acme") == 30
    assert cfg.session_retention_s(60, "acme") == 60
    with pytest.raises(ValueError, match="kv_retention_s must be at most 600"):
        cfg.session_retention_s(601, None)


@pytest.mark.parametrize("groups", [None, [COLOCATED], [PD_NO_STORE], [COLOCATED, PD]])
def test_a_request_asking_for_retention_without_a_store_everywhere_is_refused(groups):
    cfg = ServeConfig.parse({} if groups is None else {"groups": groups})
    with pytest.raises(ValueError) as e:
        cfg.session_retention_s(60, None)
    text = str(e.value)
    assert text.startswith("kv_retention_s needs a KV store")
    assert "leave kv_retention_s out or send 0" in text
    assert "every group has a store section" in text
    with pytest.raises(ValueError, match="kv_retention_s must be at most 600"):
        cfg.session_retention_s(601, None)  # the bound still names itself first
