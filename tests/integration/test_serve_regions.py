"""The Serve app with regions: three regions of one replica each, one balancer per region
(selective pushing, injected delays), clients entering through ``X-Meridian-Region``.
Greedy outputs equal the in-process engine's; a burst at one region spills over to peers."""

from __future__ import annotations

import concurrent.futures
import time
import uuid

import pytest
from serve_common import Server, serve_running

from actors import LLM, SamplingParams

MODEL = "meridian-tiny"
REGIONS = ("us", "eu", "asia")
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(local_ray_cluster, tmp_path_factory):
    cluster = local_ray_cluster(dashboard=False)
    engine = {"kv_cache_memory": 1 << 25, "max_num_seqs": 1}
    app_args = {
        "model_name": MODEL,
        "groups": [{"name": r, "num_replicas": 1, "engine": engine} for r in REGIONS],
        "regions": {
            "regions": [{"name": r, "groups": [r]} for r in REGIONS],
            "delay_ms": {"us/eu": 20, "us/asia": 40, "eu/asia": 50},
        },
    }
    tmp = tmp_path_factory.mktemp("serve_regions")
    with serve_running(cluster, app_args, tmp, replicas=3) as url:
        yield Server(url, cluster)


@pytest.fixture(scope="module")
def reference():
    return LLM()


def complete(server: Server, prompt: str, region: str | None, n: int = 16):
    headers = {"X-Meridian-Region": region} if region else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
    body["ignore_eos"] = True
    return server.http.post("/v1/completions", json=body, headers=headers)


def greedy(reference: LLM, prompt: str, n: int = 16) -> str:
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return reference.generate([prompt], p)[0].text


def test_each_region_serves_exact_greedy_tokens(server, reference):
    for region in (*REGIONS, None):
        prompt = f"[{uuid.uuid4().hex}] region {region} says hello"
        r = complete(server, prompt, region)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy(reference, prompt)
    r = complete(server, "hi", "mars")
    assert r.status_code == 400 and "X-Meridian-Region" in r.text


def test_a_burst_at_one_region_spills_over_to_peers(server, reference):
    before = {s["region"]: s for s in server.http.get("/regions").json()["regions"]}
    assert {r: before[r]["replicas"] != [] for r in REGIONS} == dict.fromkeys(REGIONS, True)
    prompts = [f"[{uuid.uuid4().hex}] tree {i} " + "step " * 20 for i in range(9)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(server, p, "us", 24), prompts))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    for p, a in zip(prompts, answers, strict=True):
        assert a.json()["choices"][0]["text"] == greedy(reference, p, 24)
    after = {s["region"]: s for s in server.http.get("/regions").json()["regions"]}
    forwarded = after["us"]["forwarded"] - before["us"]["forwarded"]
    local = sum(after[r]["placed_local"] - before[r]["placed_local"] for r in REGIONS)
    assert local == len(prompts)  # each placed on exactly one replica
    assert forwarded > 0  # one replica per region, one request per batch: us spilled over
    assert all(s["queued"] == 0 for s in after.values())


def test_a_killed_balancer_loses_no_request(server, reference):
    """Kill us's balancer while requests wait in its queue: every request still ends with
    its exact tokens (placed again through the nearest balancer, eu), us's clients are
    served meanwhile, and once Serve restarted it us's balancer serves its region again."""
    import ray
    from ray._private import state

    server.cluster.connect()
    failovers_before = server.http.get("/regions").json()["failovers"]
    try:
        prompts = [f"[{uuid.uuid4().hex}] branch {i} " + "think " * 20 for i in range(10)]
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(complete, server, p, "us", 32) for p in prompts]
            time.sleep(0.5)  # requests are queued at us's balancer now
            (name,) = [
                a["Name"]
                for a in state.actors().values()
                if a.get("State") == "ALIVE" and "#Balancer-us#" in a.get("Name", "")
            ]
            ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
            deadline = time.monotonic() + 60  # the ingress's watcher finds it down
            while server.http.get("/regions").json()["failovers"] == failovers_before:
                assert time.monotonic() < deadline, "the ingress never found us's balancer down"
                time.sleep(0.2)
            during = complete(server, prompts[0] + " again", "us", 8)
            answers = [f.result() for f in futures]
        assert [a.status_code for a in answers] == [200] * len(prompts), [a.text for a in answers]
        for p, a in zip(prompts, answers, strict=True):
            assert a.json()["choices"][0]["text"] == greedy(reference, p, 32)
        assert during.status_code == 200, during.text
        assert during.json()["choices"][0]["text"] == greedy(reference, prompts[0] + " again", 8)
        assert server.http.get("/regions").json()["failovers"] > failovers_before
        # Serve restarts the balancer; us's requests find it again and eu lets go
        deadline = time.monotonic() + 120
        while True:
            r = complete(server, f"[{uuid.uuid4().hex}] back", "us", 4)
            assert r.status_code == 200, r.text
            stats = server.http.get("/regions").json()["regions"]
            if all(not s.get("unreachable") and not s["adopted"] for s in stats):
                break
            assert time.monotonic() < deadline, stats
            time.sleep(1)
    finally:
        ray.shutdown()
