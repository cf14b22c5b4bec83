"""Each region's own ingress: the main application plus one application per region
(``serve_app:build_region_ingress``, route prefix ``/<region>``), over real HTTP. A request
to region A's endpoint is placed by A's balancer: served in A while A has a free replica,
forwarded to B's balancer when A's replica is busy (counted by the balancers)."""

from __future__ import annotations

import concurrent.futures
import time
import uuid

import httpx
import pytest
import yaml
from serve_common import APP, Server, serve_file_running

from actors import LLM, SamplingParams

MODEL = "meridian-tiny"
REGIONS = ("us", "eu")
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(local_ray_cluster, tmp_path_factory):
    cluster = local_ray_cluster(dashboard=False)
    engine = {"kv_cache_memory": 1 << 25, "max_num_seqs": 1}
    args = {
        "model_name": MODEL,
        "groups": [{"name": r, "num_replicas": 1, "engine": engine} for r in REGIONS],
        "regions": {
            "regions": [{"name": r, "groups": [r]} for r in REGIONS],
            "delay_ms": {"us/eu": 20},
        },
    }
    main = {"name": APP, "route_prefix": "/", "import_path": "serve_app:build_app", "args": args}
    per_region = [
        {
            "name": f"ingress-{r}",
            "route_prefix": f"/{r}",
            "import_path": "serve_app:build_region_ingress",
            "args": {**args, "region": r, "app": APP},
        }
        for r in REGIONS
    ]
    port = cluster.free_port()
    config = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [main, *per_region],
    }
    path = tmp_path_factory.mktemp("region_ingress") / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    with serve_file_running(cluster, path, port, replicas=2) as url:
        deadline = time.monotonic() + 300
        for r in REGIONS:  # the regional applications deploy beside the main one
            while True:
                try:
                    if httpx.get(f"{url}/{r}/health", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"/{r}/health never answered"
                time.sleep(1)
        yield Server(url, cluster)


@pytest.fixture(scope="module")
def reference():
    return LLM()


def complete(server: Server, region: str, prompt: str, n: int = 16) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
    body["ignore_eos"] = True
    return server.http.post(f"/{region}/v1/completions", json=body)


def counters(server: Server, via: str) -> dict[str, dict]:
    r = server.http.get(f"/{via}/regions")
    assert r.status_code == 200, r.text
    return {s["region"]: s for s in r.json()["regions"]}


def greedy(reference: LLM, prompt: str, n: int = 16) -> str:
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return reference.generate([prompt], p)[0].text


def test_a_region_endpoint_serves_in_its_region_while_it_has_room(server, reference):
    for region in REGIONS:
        before = counters(server, region)
        prompt = f"[{uuid.uuid4().hex}] hello from {region}"
        r = complete(server, region, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy(reference, prompt)
        after = counters(server, region)
        assert after[region]["placed_local"] - before[region]["placed_local"] == 1
        assert after[region]["forwarded"] == before[region]["forwarded"]
        other = next(g for g in REGIONS if g != region)
        assert after[other]["placed_local"] == before[other]["placed_local"]


def test_an_overloaded_region_endpoint_forwards_to_the_peer_balancer(server, reference):
    before = counters(server, "us")
    prompts = [f"[{uuid.uuid4().hex}] burst {i} " + "step " * 20 for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(server, "us", p, 24), prompts))
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    for p, a in zip(prompts, answers, strict=True):
        assert a.json()["choices"][0]["text"] == greedy(reference, p, 24)
    after = counters(server, "us")
    forwarded = after["us"]["forwarded"] - before["us"]["forwarded"]
    served_eu = after["eu"]["placed_local"] - before["eu"]["placed_local"]
    served_us = after["us"]["placed_local"] - before["us"]["placed_local"]
    assert forwarded > 0  # us's one replica runs one request at a time: us spilled over
    assert served_eu == forwarded  # every forward was placed by eu's balancer, none other
    assert served_us + served_eu == len(prompts)
    assert all(s["queued"] == 0 for s in after.values())
