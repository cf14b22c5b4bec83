"""The pure rules behind weight updates on a Serve app: a request built at one weight
version is hashed again at the version of the replica that runs it (never served under a
stale version's hashes), and who may call the admin routes."""

from __future__ import annotations

import pytest

from actors.engine.request_builder import RequestBuilder, unversioned_salt
from actors.engine.request_limits import RequestLimits
from actors.serving import openai_protocol as oai
from actors.serving.admin import UpdateWeightsBody, require_admin
from actors.serving.config import ApiKeyConfig
from policies.request import SamplingParams
from store.hashing import chained_block_hashes, weight_version_salt

TOKENS = list(range(3, 40))


def built(salt: str | None):
    builder = RequestBuilder(4, RequestLimits(1000, 512, 512))
    return builder.build(TOKENS, SamplingParams(max_tokens=4), salt=salt)


@pytest.mark.parametrize("tenant", [None, "tenant-a"])
def test_a_request_is_hashed_at_the_version_of_the_replica_that_runs_it(tenant):
    at_2 = RequestBuilder.at_weight_version(built(tenant), 2)
    assert at_2.salt == weight_version_salt(tenant, 2)
    assert at_2.block_hashes == chained_block_hashes(TOKENS, 4, at_2.salt)
    assert RequestBuilder.at_weight_version(at_2, 2) is at_2  # already there: as it is
    # an ingress that has not heard of update 3 yet: the replica at 3 hashes it again
    at_3 = RequestBuilder.at_weight_version(at_2, 3)
    assert at_3.salt == weight_version_salt(tenant, 3)
    assert at_3.block_hashes == chained_block_hashes(TOKENS, 4, at_3.salt)
    assert set(at_3.block_hashes).isdisjoint(at_2.block_hashes)
    # a replica on the stored weights: the tenant's own salt, as built without a version
    at_0 = RequestBuilder.at_weight_version(at_3, 0)
    assert at_0.salt == tenant and at_0.block_hashes == built(tenant).block_hashes
    assert unversioned_salt(at_3.salt) == tenant


USER = ApiKeyConfig(key="sk-user-000001", tenant="u")
ADMIN = ApiKeyConfig(key="sk-admin-00001", tenant="ops", role="admin")


def test_admin_routes_need_an_admin_key_and_refuse_when_auth_is_off():
    require_admin(ADMIN, keys_configured=True)
    with pytest.raises(oai.APIError) as e:
        require_admin(USER, keys_configured=True)
    assert (
        e.value.status == 403 and "role 'admin'" in e.value.message and "'user'" in e.value.message
    )
    with pytest.raises(oai.APIError) as e:
        require_admin(None, keys_configured=False)
    assert e.value.status == 403 and "no api_keys configured" in e.value.message


def test_the_update_body_names_what_to_fix():
    assert UpdateWeightsBody.parse({"path": "/m", "abort_in_flight": True}).abort_in_flight
    for raw, param in [({}, "path"), ({"path": "rel/dir"}, "path"), ({"path": "/m", "x": 1}, "x")]:
        with pytest.raises(oai.APIError) as e:
            UpdateWeightsBody.parse(raw)
        assert e.value.status in (400, 422) and e.value.param == param, (raw, e.value.message)
