"""Through the Serve app: a colocated group with a ``store`` section keeps its KV store
shards app-wide, so a replica that replaces a dead one reads what the dead one computed. The
group's one replica serves a prompt (its blocks go to the shard ``<app>/<group>``), is
killed, and Serve's replacement serves a prompt extending it: the prefix is loaded from the
store, reported in ``usage.prompt_tokens_details.cached_tokens``, and the tokens are the
in-process engine's."""

from __future__ import annotations

import time

import httpx
import pytest
import ray

from actors import fault_targets
from bench import soak_app  # noqa: E402
from bench.app_probe import healthy  # noqa: E402

pytestmark = pytest.mark.timeout(600)

GROUP = {
    "name": "main",
    "num_replicas": 1,
    "engine": {"kv_cache_memory": 1 << 24},
    "store": {"dram_bytes": 1 << 24, "min_load_tokens": 32},
}
PHASE = soak_app.Phase("store", GROUP, [], {"ingress": 1, "router": 1, "replica": 1})
POOL = f"{soak_app.APP}/main"
N = 8


@pytest.fixture(scope="module")
def app():
    with soak_app.running_app(PHASE, num_cpus=2) as url:
        yield url


def complete(url: str, prompt: list[int]) -> dict:
    body = {
        "model": soak_app.MODEL,
        "prompt": prompt,
        "max_tokens": N,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def reference(prompt: list[int]) -> list[int]:
    from actors import LLM, SamplingParams

    p = SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)
    return LLM().generate(prompt_token_ids=[prompt], sampling_params=p)[0].token_ids


def stored(prompt: list[int], blocks: int, timeout: float = 60) -> None:
    """Wait until the group's shard holds the prompt's first ``blocks`` blocks."""
    from actors.disagg import pool_actors
    from store.hashing import chained_block_hashes

    hashes = chained_block_hashes(prompt, 16, None)[:blocks]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        held = [ray.get(h.match_prefix.remote(hashes)) for h in pool_actors.find(POOL).values()]
        if blocks in held:
            return
        time.sleep(0.2)
    raise TimeoutError("the store never held the prompt")


def test_a_replacement_replica_loads_what_the_dead_one_stored(app):
    first = [3 + (i * 37) % 500 for i in range(100)]  # 6 full blocks
    out = complete(app, first)
    assert out["choices"][0]["token_ids"] == reference(first)
    stored(first, 6)
    (old,) = soak_app.serve_replica_ids("main")
    (replica,) = [a for a in fault_targets.live_actors() if a.kind == "replica"]
    fault_targets.kill(replica)
    deadline = time.monotonic() + 300
    while soak_app.serve_replica_ids("main") in ([], [old]) or not healthy(app, 1):
        assert time.monotonic() < deadline, "no replacement replica"
        time.sleep(0.5)
    longer = first + [3 + (i * 53) % 500 for i in range(40)]
    out = complete(app, longer)
    assert out["choices"][0]["token_ids"] == reference(longer)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * 16
    blocks = soak_app.blocks_in_use("main")
    assert all(v == 0 for pools in blocks.values() for v in pools.values()), blocks
