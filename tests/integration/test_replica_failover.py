"""A replica that dies mid-request costs a replay, not the request: with two replicas, the
replica streaming a request is killed; the ingress routes the prompt again and the client
gets every greedy token once, in order, with no error, and the group is back at two
replicas by itself."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from actors import fault_targets
from bench import soak_app  # noqa: E402
from bench.app_probe import healthy  # noqa: E402

pytestmark = pytest.mark.timeout(600)

GROUP = {
    "name": "main",
    "num_replicas": 2,
    "engine": {"dtype": "float64", "num_blocks": 256, "block_size": 16},
}
PHASE = soak_app.Phase("failover", GROUP, [], {"ingress": 1, "router": 1, "replica": 2})
TOKENS = 160  # long enough to kill the replica mid-stream


@pytest.fixture(scope="module")
def app():
    with soak_app.running_app(PHASE, num_cpus=2) as url:
        yield url


def reference(prompt: list[int]) -> list[int]:
    from actors import LLM, SamplingParams

    p = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    return LLM(dtype="float64").generate(prompt_token_ids=[prompt], sampling_params=p)[0].token_ids


def holder(group: str) -> str:
    """The one replica of ``group`` holding blocks now."""
    busy = [
        rid for rid, pools in soak_app.blocks_in_use(group, wait_s=0).items() if any(pools.values())
    ]
    assert len(busy) == 1, busy
    return busy[0]


def test_a_stream_survives_its_replica_dying(app):
    prompt = soak_app.prompts(1, seed=5)[0]
    want = reference(prompt)
    body = {
        "model": soak_app.MODEL,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    got: list[int] = []
    errors: list[str] = []
    killed = threading.Event()
    with httpx.Client(base_url=app, timeout=120) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    errors.append(chunk["error"]["message"])
                for c in chunk.get("choices", []):
                    got += c.get("token_ids") or []
                if len(got) >= 8 and not killed.is_set():
                    victim = holder("main")
                    (actor,) = [a for a in fault_targets.live_actors() if a.name.endswith(victim)]
                    fault_targets.kill(actor)
                    killed.set()
    assert killed.is_set() and not errors, errors
    assert got == want
    deadline = time.monotonic() + 120
    while not healthy(app, 2):
        assert time.monotonic() < deadline, "the group did not return to two replicas"
        time.sleep(0.5)
    blocks = soak_app.blocks_in_use("main", wait_s=30)
    assert all(v == 0 for b in blocks.values() for v in b.values()), blocks
