"""SkyWalker-CH through the Serve app: ``routing: consistent_hash`` keys each request by the
configured ``session_header`` (else the body's ``user``); over real HTTP, requests with one
key land on one replica whatever their prompts, and different keys spread over replicas.

Which replica served a request is read from the router's ``/metrics`` (finished requests
per replica) before and after it; requests go one at a time, so each owner is free and
the ring's first choice serves."""

from __future__ import annotations

import time
import uuid

import httpx
import pytest
from serve_common import Server, serve_running
from test_serve_autoscaling import served_per_replica

MODEL = "meridian-tiny"
HEADER = "X-User-Key"
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(local_ray_cluster, tmp_path_factory):
    cluster = local_ray_cluster(dashboard=False)
    app_args = {
        "model_name": MODEL,
        "groups": [{"name": "main", "num_replicas": 2, "engine": {"kv_cache_memory": 1 << 25}}],
        "routing": "consistent_hash",
        "session_header": HEADER.lower(),
    }
    tmp = tmp_path_factory.mktemp("serve_session_hash")
    with serve_running(cluster, app_args, tmp, replicas=2) as url:
        yield Server(url, cluster)


def served(server: Server) -> dict[str, float]:
    """Finished requests per replica (a fresh connection each time)."""
    return served_per_replica(httpx.get(server.url + "/metrics", timeout=30).text)


def served_by(server: Server, body: dict, headers: dict[str, str]) -> str:
    """Send one completion; the replica whose finished count rose."""
    before = served(server)
    r = server.http.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # replicas report to the router every report_interval_s
        after = served(server)
        grew = [rid for rid, n in after.items() if n > before.get(rid, 0.0)]
        if grew:
            assert len(grew) == 1, (before, after)
            return grew[0]
        time.sleep(0.2)
    raise AssertionError("no replica reported the request as finished")


def completion(prompt: str, **extra: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}


def test_one_header_key_lands_on_one_replica_and_keys_spread(server):
    owners: dict[str, str] = {}
    for k in range(13):  # replica ids are random: 13 keys all on one of 2 is 2 ** -12
        key = f"user-{k}"
        replicas = {
            served_by(server, completion(f"[{uuid.uuid4().hex}] turn {turn}"), {HEADER: key})
            for turn in range(3 if k < 3 else 1)
        }
        assert len(replicas) == 1, (key, replicas)  # different prompts, one key
        owners[key] = replicas.pop()
    assert len(set(owners.values())) == 2, owners  # the keys use both replicas


def test_the_user_field_keys_a_request_without_the_header(server):
    replicas = {
        served_by(server, completion(f"[{uuid.uuid4().hex}]", user="alice"), {}) for _ in range(3)
    }
    assert len(replicas) == 1, replicas
