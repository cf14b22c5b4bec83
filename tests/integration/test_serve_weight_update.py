"""Weights updated on a running Serve app (``serve run`` on a private local Ray cluster, real
HTTP): through the admin route (``LLM.attach(url, api_key=admin)``) and through the app's
handle (``LLM.attach(app_name)``).

One app for the module: a colocated group of two replicas and a disaggregated group (one
prefill, one decode replica), round-robin routing, so consecutive requests visit every
replica of both groups. After each update the greedy tokens are transformers' on the new
weights, no prefix cached before it is hit after it, a bad tensor or a caller without an
admin key changes nothing, a replica Serve starts after the updates (in place of a
killed one) serves the newest weights, the app sleeps and wakes with no request lost, and
the weight log outlives a killed router.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest
import ray
import torch
from serve_common import APP, Server, serve_running

from actors import LLM, SamplingParams
from actors.serving.weight_updates import STORE_NAMESPACE
from errors import InvalidRequestError
from models import write_tiny_model
from models.hf_reference import hf_greedy
from models.tiny import write_perturbed_copy

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny-rl"
ADMIN, USER = "sk-admin-0001", "sk-user-00002"
NEW = 6
NUM_REPLICAS = 3  # main: 2, pd: 1 (its prefill and decode replicas are actors it owns)
PARAMS = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """(the base folder, two successive perturbed folders and their tensors)."""
    base = write_tiny_model(tmp_path_factory.mktemp("base"))
    t1, v1 = write_perturbed_copy(base, tmp_path_factory.mktemp("v1") / "model", seed=3)
    t2, v2 = write_perturbed_copy(v1, tmp_path_factory.mktemp("v2") / "model", seed=4)
    return base, (v1, t1), (v2, t2)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(17)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (13, 22, 30)]


@pytest.fixture(scope="module")
def server(local_ray_cluster, tmp_path_factory, weights):
    base = weights[0]
    cluster = local_ray_cluster(dashboard=False)
    engine = {"dtype": "float64", "block_size": 4, "kv_cache_memory": 1 << 24}
    app_args = {
        "model": str(base),
        "model_name": MODEL,
        "routing": "round_robin",
        "groups": [
            {"name": "main", "num_replicas": 2, "engine": engine},
            {"name": "pd", "num_prefill": 1, "num_decode": 1, "engine": engine},
        ],
        "api_keys": [
            {"key": ADMIN, "tenant": "trainer", "role": "admin"},
            {"key": USER, "tenant": "user"},
        ],
    }
    with serve_running(cluster, app_args, tmp_path_factory.mktemp("serve"), NUM_REPLICAS) as url:
        cluster.connect()  # for LLM.attach(APP) and to kill a replica
        try:
            yield Server(url, cluster, USER)
        finally:
            ray.shutdown()


def run_everywhere(llm: LLM, prompts: list[list[int]]) -> list[list]:
    """Each prompt ``NUM_REPLICAS`` times in a row (round robin: once on every replica);
    the outputs per prompt."""
    return [
        [llm.generate(prompt_token_ids=[p], sampling_params=PARAMS)[0] for _ in range(NUM_REPLICAS)]
        for p in prompts
    ]


def assert_tokens(runs: list[list], expected: list[list[int]]) -> None:
    for outs, want in zip(runs, expected, strict=True):
        assert [o.token_ids for o in outs] == [want] * NUM_REPLICAS


def test_updates_through_the_admin_route_and_the_handle(server, weights, prompts):
    base, (v1_dir, _), (v2_dir, t2) = weights
    old, new1, new2 = (hf_greedy(d, prompts, NEW) for d in (base, v1_dir, v2_dir))
    assert old != new1 != new2
    with pytest.raises(ValueError):  # no update yet: the app runs no weight log process
        ray.get_actor(f"{APP}/weight-log", namespace=STORE_NAMESPACE)
    user = LLM.attach(server.url, api_key=USER)
    runs = run_everywhere(user, prompts)
    assert_tokens(runs, old)
    again = run_everywhere(user, prompts)
    assert sum(o.num_cached_tokens for outs in again for o in outs) > 0  # cached now

    # refused, nothing changed: a bad tensor (by handle), callers without an admin key
    by_name = LLM.attach(APP)
    with pytest.raises(InvalidRequestError, match=r"model.norm.weight.*shape"):
        by_name.update_weights({"model.norm.weight": torch.zeros(5)})
    body = {"path": str(v1_dir)}
    assert server.post("/admin/update_weights", body, key=None).status_code == 401
    assert server.post("/admin/update_weights", body, key="sk-unknown-999").status_code == 401
    refused = server.post("/admin/update_weights", body, key=USER)
    assert refused.status_code == 403 and "role 'admin'" in refused.json()["error"]["message"]
    missing = server.post("/admin/update_weights", {"path": str(v1_dir / "nope")}, key=ADMIN)
    assert missing.status_code == 400 and "nope" in missing.json()["error"]["message"]
    admin = LLM.attach(server.url, api_key=ADMIN)
    with pytest.raises(InvalidRequestError, match="only a path on the server"):
        admin.update_weights(t2)
    assert_tokens(run_everywhere(user, prompts), old)

    # over HTTP: a folder on the server; every replica of both groups loads it
    admin.update_weights(v1_dir)
    after = run_everywhere(user, prompts)
    assert_tokens(after, new1)
    assert [outs[0].num_cached_tokens for outs in after] == [0] * len(prompts)

    # by handle: tensors from this process, through the object store
    by_name.update_weights(t2)
    after = run_everywhere(user, prompts)
    assert_tokens(after, new2)
    assert [outs[0].num_cached_tokens for outs in after] == [0] * len(prompts)


def test_a_replica_started_after_the_updates_serves_the_newest_weights(server, weights, prompts):
    """Kill a colocated replica; Serve starts another, which loads both updates (the
    router's log) before its first request. Runs after the updates above."""
    from ray import serve
    from ray._private import state

    new2 = hf_greedy(weights[2][0], prompts, NEW)
    router = serve.get_deployment_handle("Router", APP)

    def main_replicas() -> set[str]:
        return {
            a["Name"]
            for a in state.actors().values()
            if a.get("State") == "ALIVE" and "#Replica-main#" in a.get("Name", "")
        }

    before = main_replicas()
    victim = sorted(before)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 240
    while True:  # Serve replaced it, and the router routes to the new one only
        now = main_replicas()
        routed = set(router.snapshot.remote().result())
        started = {n.rsplit("#", 1)[1] for n in now - before}
        if len(now) == 2 and started and started <= routed and len(routed) == NUM_REPLICAS:
            break
        assert time.monotonic() < deadline, (now, routed)
        time.sleep(0.5)
    user = LLM.attach(server.url, api_key=USER)
    assert_tokens(run_everywhere(user, prompts), new2)  # every replica, the new one too
    health = httpx.get(server.url + "/health", timeout=10).json()
    assert health["replicas"] == NUM_REPLICAS


def test_sleep_and_wake_through_the_handle_and_the_admin_route(server, weights, prompts):
    """Level 2 frees every replica's weights, level 1 every replica's KV cache (of both
    groups); a request sent while the app sleeps waits and, after the wake, gets the newest
    weights' tokens. Runs after the updates above."""
    import concurrent.futures

    new2 = hf_greedy(weights[2][0], prompts, NEW)
    by_name = LLM.attach(APP)
    user = LLM.attach(server.url, api_key=USER)
    admin = LLM.attach(server.url, api_key=ADMIN)
    assert server.post("/admin/sleep", {"level": 2}, key=USER).status_code == 403
    bad = server.post("/admin/sleep", {"level": 3}, key=ADMIN)
    assert bad.status_code == 422 and "level" in bad.json()["error"]["message"]

    assert by_name.sleep(2) > 0
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(user.generate, prompt_token_ids=[prompts[0]], sampling_params=PARAMS)
        admin.wake_up()  # over HTTP
        assert waiting.result(timeout=120)[0].token_ids == new2[0]
    assert_tokens(run_everywhere(user, prompts), new2)

    # level 1 frees the KV caches of every group's replicas, the P/D group's too
    assert admin.sleep(1) > 0
    by_name.wake_up()
    assert_tokens(run_everywhere(user, prompts), new2)
    update = server.post("/admin/update_weights", {"path": str(weights[1][0])}, key=ADMIN)
    assert update.status_code == 200  # awake again: updates are taken


def test_the_weight_log_outlives_a_killed_router(server, weights, prompts):
    """Kill the Router actor; Serve's replacement reads the log back (the tensors too) and
    numbers the next update after it, and every replica loads that update. Runs after the
    three updates above (version 3: the first folder's weights again)."""
    from ray import serve
    from ray._private import state

    (v1_dir, _), (v2_dir, _) = weights[1], weights[2]
    new1, new2 = (hf_greedy(d, prompts, NEW) for d in (v1_dir, v2_dir))
    router = serve.get_deployment_handle("Router", APP)

    def router_actors() -> set[str]:
        return {
            a["Name"]
            for a in state.actors().values()
            if a.get("State") == "ALIVE" and "#Router#" in a.get("Name", "")
        }

    (victim,) = before = router_actors()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    deadline = time.monotonic() + 120
    while True:  # the new router runs and every replica reported to it
        try:
            routed = router.snapshot.remote().result(timeout_s=10)
        except Exception:  # the call that met the dying router
            routed = {}
        if router_actors() - before and len(routed) == NUM_REPLICAS:
            break
        assert time.monotonic() < deadline, routed
        time.sleep(0.5)
    updates = router.weight_updates.remote(0).result()
    assert [u.version for u in updates] == [1, 2, 3]
    assert ray.get(updates[-1].ref).arrays  # owned by the log's store, not the dead router
    user = LLM.attach(server.url, api_key=USER)
    assert_tokens(run_everywhere(user, prompts), new1)

    update = server.post("/admin/update_weights", {"path": str(v2_dir)}, key=ADMIN)
    assert update.status_code == 200, update.text  # no replica reports the router's death
    assert update.json() == {"weight_version": 4}
    assert_tokens(run_everywhere(user, prompts), new2)
