"""Regions whose balancers use the router's exact block index as their local view
(``local_view: index``): the path runs end to end (the router measures each prompt's cached
prefix per replica, the balancer picks by it), a repeated prompt goes back to the replica
that holds its blocks, and every answer equals the in-process engine's greedy tokens. (The
trie would send these repeats to the holder too; ``tests/unit/test_region_balancer.py``
shows where the two views differ.)"""

from __future__ import annotations

import uuid

import pytest
from serve_common import Server, serve_running

from actors import LLM, SamplingParams

MODEL = "meridian-tiny"
pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(local_ray_cluster, tmp_path_factory):
    cluster = local_ray_cluster(dashboard=False)
    app_args = {
        "model_name": MODEL,
        "groups": [
            {"name": "us", "num_replicas": 2, "engine": {"kv_cache_memory": 1 << 25}},
            {"name": "eu", "num_replicas": 1, "engine": {"kv_cache_memory": 1 << 25}},
        ],
        "regions": {
            "regions": [{"name": "us", "groups": ["us"]}, {"name": "eu", "groups": ["eu"]}],
            "delay_ms": {"us/eu": 20},
            "local_view": "index",
        },
    }
    tmp = tmp_path_factory.mktemp("serve_regions_index")
    with serve_running(cluster, app_args, tmp, replicas=3) as url:
        yield Server(url, cluster)


def test_repeated_prompts_hit_their_cached_blocks(server):
    reference = LLM()
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for region in ("us", "eu", "us"):
        prompt = f"[{uuid.uuid4().hex}] " + "a long shared context " * 8
        want = reference.generate([prompt], params)[0].text
        cached = []
        for _ in range(3):  # one at a time: the holder is free each time
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
            body["ignore_eos"] = True
            r = server.http.post(
                "/v1/completions", json=body, headers={"X-Meridian-Region": region}
            )
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want
            cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert cached[0] == 0 and cached[1] > 0 and cached[2] > 0, cached
