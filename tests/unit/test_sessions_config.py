"""Sessions at the edge: ``kv_retention_s`` on the OpenAI request, its defaults and bound in
the serve config, and the field on ``SamplingParams``."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from actors.disagg.messages import PDCounters
from actors.serving import openai_protocol as oai
from actors.serving.config import ConfigError, ServeConfig
from actors.serving.metrics import ReplicaMetrics, metric_families
from errors import InvalidRequestError
from policies.request import SamplingParams

BODY = {"model": "m", "prompt": "hi", "session_id": "agent-7"}


def test_retention_resolves_request_then_tenant_then_server_default():
    cfg = ServeConfig.parse(
        {
            "groups": [{"name": "pd", "num_prefill": 1, "num_decode": 1, "store": {}}],
            "sessions": {
                "default_kv_retention_s": 5,
                "max_kv_retention_s": 60,
                "tenant_kv_retention_s": {"acme": 30},
            },
        }
    ).sessions
    assert cfg.retention_s(None, None) == 5
    assert cfg.retention_s(None, "acme") == 30
    assert cfg.retention_s(None, "other") == 5
    assert cfg.retention_s(12.5, "acme") == 12.5
    assert cfg.retention_s(0, "acme") == 0  # asked for none: none
    with pytest.raises(ValueError, match="kv_retention_s must be at most 60"):
        cfg.retention_s(61, None)
    assert ServeConfig().sessions.retention_s(None, None) == 0.0  # off unless configured


def test_defaults_above_the_bound_are_config_errors():
    with pytest.raises(ConfigError, match="default_kv_retention_s"):
        ServeConfig.parse({"sessions": {"default_kv_retention_s": 90, "max_kv_retention_s": 60}})
    with pytest.raises(ConfigError, match="acme"):
        ServeConfig.parse({"sessions": {"tenant_kv_retention_s": {"acme": 601}}})


def test_the_request_field_reaches_sampling_params():
    req = oai.CompletionRequest.model_validate(dict(BODY, kv_retention_s=45))
    assert req.session_id == "agent-7"
    assert req.sampling_params(4, 0).kv_retention_s == 45
    assert oai.CompletionRequest.model_validate(BODY).sampling_params(4, 0).kv_retention_s == 0
    with pytest.raises(ValidationError) as e:
        oai.CompletionRequest.model_validate(dict(BODY, kv_retention_s=-1))
    err = oai.validation_error(e.value)
    assert err.status == 400 and err.param == "kv_retention_s"


def test_sampling_params_refuse_a_negative_retention():
    with pytest.raises(InvalidRequestError, match="kv_retention_s") as e:
        SamplingParams(kv_retention_s=-1.0)
    assert e.value.param == "kv_retention_s"


def test_retention_counters_are_exported():
    counters = PDCounters(
        0, 0, 0, 0, 0, 0, 0,
        store_retained_blocks=5, store_retention_hit_blocks=7, store_expired_retentions=2,
    )  # fmt: skip
    snap = ReplicaMetrics(lambda: counters).snapshot()
    values = {s.name: s.value for m in snap.families for s in m.samples}
    assert values["meridian:kv_store_retained_blocks"] == 5
    assert values["meridian:kv_store_retention_hit_blocks_total"] == 7
    assert values["meridian:kv_store_expired_retentions_total"] == 2
    families = metric_families()
    assert families["meridian:kv_store_retained_blocks"] == "gauge"
    assert families["meridian:kv_store_retention_hit_blocks"] == "counter"
