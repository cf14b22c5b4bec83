"""Every paper's mechanism in one Serve config, token-identical to the single process.

``serve run`` of one ``ServeConfig`` (``serve_app:build_app``) on a private local Ray
cluster, on the built-in tiny random-weight model in fp64, real HTTP:

- SkyWalker: two regions (``us``, ``eu``), each with its balancer, 20 ms apart; clients
  name their region with ``X-Meridian-Region``;
- Mooncake: region ``us`` holds a P/D group (one prefill, one decode replica) whose prefill
  replica is two pipeline stages (chunked pipeline parallelism, ``prefill.spp = 2``), with
  a KV store (DRAM) that decode writes each filled block back to, and the Conductor's
  default predictive admission;
- DualPath: the store's prefixes are read on the side with the shorter read queue
  (``read_path: dual``) and DualPath's rules place requests (``scheduler: dualpath``);
- Mooncake in ``eu``: a second P/D group whose decode replica is two KV-parallel ranks
  (``decode.kvp = 2``, at most 96 tokens of a request per rank, so a long prompt's blocks
  are streamed to both); without a store (write-back and DualPath's decode-side reads need
  a single-worker decode replica, and the config refuses them with one);
- Medha: every engine (both groups' prefill and decode replicas) orders prefills by ILRS
  and packs adaptive chunks against a target batch time, in small steps so a prompt runs
  in several chunks (pipelined through ``us``'s two prefill stages).

Greedy tokens through each region equal ``LLM``'s in process on the same weights; a
conversation's second turn reads its first answer's blocks, written back by decode, from
the store (counted by ``/metrics`` and in ``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import re
import time

import httpx
import pytest
from serve_common import Server, greedy, ids, serve_running

from actors import LLM

MODEL = "meridian-tiny"
BS = 16
# Medha's scheduling on every engine; fp64 so that no chunking flips an argmax tie
ENGINE = {
    "dtype": "float64",
    "block_size": BS,
    "num_blocks": 128,
    "token_budget": 32,
    "scheduling": "ilrs",
    "target_batch_time": 0.05,
}
PD_GROUP = {
    "name": "pd",
    "num_prefill": 1,
    "num_decode": 1,
    "prefill": {"spp": 2},
    "engine": ENGINE,
    "store": {"dram_bytes": 8 << 20, "read_path": "dual", "write_back": True},
    "conductor": {"scheduler": "dualpath"},
}
KVP_GROUP = {
    "name": "eu",
    "num_prefill": 1,
    "num_decode": 1,
    "decode": {"kvp": 2},
    "engine": {**ENGINE, "kvp_rank_tokens": 96},
}
REGIONS = {
    "regions": [{"name": "us", "groups": ["pd"]}, {"name": "eu", "groups": ["eu"]}],
    "delay_ms": {"us/eu": 20},
}

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(local_ray_cluster, tmp_path_factory, expected):
    cluster = local_ray_cluster(dashboard=False)
    app_args = {
        "model_name": MODEL,
        "groups": [PD_GROUP, KVP_GROUP],
        "regions": REGIONS,
    }
    tmp = tmp_path_factory.mktemp("serve-composed")
    with serve_running(cluster, app_args, tmp, replicas=2) as url:
        yield Server(url, cluster)


REGION_PROMPTS = {
    region: [ids(seed * 10 + n, n) for n in (7, 150)] for region, seed in (("us", 1), ("eu", 2))
}
TURN1 = ids(31, 40)
TURN1_ANSWER = 24
TURN2_MESSAGE = ids(32, 9)


@pytest.fixture(scope="module")
def expected() -> dict[tuple[int, ...], list[int]]:
    """Prompt -> the single-process engine's greedy tokens on the same (built-in tiny)
    weights, fp64, FCFS, for every prompt the tests send; computed before the cluster
    starts (``server`` asks for it), since beside the cluster's waiting workers this
    process got a core's fraction (one turn's reference took 46 s)."""
    reference = LLM(dtype="float64", block_size=BS)
    out = {tuple(p): greedy(reference, p, 12) for ps in REGION_PROMPTS.values() for p in ps}
    answer = greedy(reference, TURN1, TURN1_ANSWER)
    out[tuple(TURN1)] = answer
    turn2 = TURN1 + answer + TURN2_MESSAGE
    out[tuple(turn2)] = greedy(reference, turn2, 12)
    return out


def complete(server: Server, region: str, prompt: list[int], n: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0}
    body |= {"ignore_eos": True, "return_token_ids": True}
    return server.http.post("/v1/completions", json=body, headers={"X-Meridian-Region": region})


def store_hits(server: Server) -> float:
    """Blocks the P/D group's KV store served, both tiers (``/metrics``)."""
    text = server.http.get("/metrics").text
    found = re.findall(r"^meridian:kv_store_hit_blocks_total\{[^}]*\} (\S+)$", text, re.M)
    return sum(float(v) for v in found)


def total_blocks(server: Server) -> dict[str, float]:
    """Each group's decode KV blocks in all (``/metrics``, as the Conductor sees them)."""
    text = server.http.get("/metrics").text
    found = re.findall(r"^meridian:kv_cache_total_blocks\{([^}]*)\} (\S+)$", text, re.M)
    return {re.search(r'group="([^"]*)"', labels)[1]: float(v) for labels, v in found}


def test_each_decode_side_has_its_layout(server):
    """``us``'s single-worker decode replica holds one pool, ``eu``'s two KV ranks two."""
    deadline = time.monotonic() + 60
    while (blocks := total_blocks(server)).keys() != {"pd", "eu"}:
        assert time.monotonic() < deadline, blocks  # replicas report every 0.1 s
        time.sleep(0.2)
    assert blocks == {"pd": ENGINE["num_blocks"], "eu": 2 * ENGINE["num_blocks"]}


def placed(server: Server) -> dict[str, int]:
    """Requests each region's balancer placed on its own replicas so far."""
    return {s["region"]: s["placed_local"] for s in server.http.get("/regions").json()["regions"]}


def wait_free(server: Server, region: str) -> None:
    """Until ``region``'s balancer sees a free local replica (its probes report the last
    request done), so that the next request is placed there, not forwarded."""
    deadline = time.monotonic() + 60
    while True:
        stats = {s["region"]: s for s in server.http.get("/regions").json()["regions"]}
        if stats[region]["free_replicas"] > 0:
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def test_each_region_serves_exact_greedy_tokens(server, expected):
    """Short and multi-chunk prompts (up to 5 chunks of the 32-token budget) through each
    region's balancer, one at a time, so each is placed in its own region."""
    for region, prompts in REGION_PROMPTS.items():
        for prompt in prompts:
            wait_free(server, region)
            before = placed(server)
            r = complete(server, region, prompt, 12)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == expected[tuple(prompt)]
            after = placed(server)
            assert after[region] - before[region] == 1, (region, before, after)


def test_a_second_turn_reads_the_written_back_answer_from_the_store(server, expected):
    """Turn 1 (40 prompt + 24 answer tokens) in ``us``: decode writes the answer's blocks
    back as they fill, before the answer returns. Turn 2 is turn 1, its answer and a new
    message: it reuses at least three blocks, the third (tokens 32-47, half of them the
    answer, which the prefill replica never computed) read from the store, which counts
    the hit, and its tokens stay exact."""
    r = complete(server, "us", TURN1, TURN1_ANSWER)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["token_ids"]
    assert answer == expected[tuple(TURN1)]
    hits = store_hits(server)
    turn2 = TURN1 + answer + TURN2_MESSAGE
    wait_free(server, "us")  # placed in ``us``, where the store is (not forwarded to eu)
    before = placed(server)
    r = complete(server, "us", turn2, 12)
    assert r.status_code == 200, r.text
    assert placed(server)["us"] - before["us"] == 1
    assert r.json()["choices"][0]["token_ids"] == expected[tuple(turn2)]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * BS
    deadline = time.monotonic() + 30
    while store_hits(server) <= hits:  # replicas report their counters every 0.1 s
        assert time.monotonic() < deadline, "the KV store counted no hit for turn 2"
        time.sleep(0.2)
