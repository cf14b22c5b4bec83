"""A load step up then down scales an autoscaled replica group 1 -> 2 -> 1 with no failed
request: ``serve run`` on a private local Ray cluster, real HTTP.

The group is small on purpose (4 sequences, 64 KV blocks, 64-token steps, no prefix cache)
so that 8 closed-loop clients with ~180-token prompts keep prompts queued on one replica:
Meridian's policy (``policies.autoscaling``) sees queued prefill tokens far over the target
and asks for 2 replicas (its maximum); with one client left, queued prefill and KV usage
fit one replica and the group shrinks, each removed replica draining before it leaves the
router. The replica count is the router's view (``/health``): a replica counts once its
first report arrives and stops counting when it leaves, so the test also checks
membership. Every response must be 200 with the in-process engine's greedy tokens.
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from typing import Any

import httpx
import pytest
from serve_common import serve_running

from actors import LLM, SamplingParams

MODEL = "meridian-tiny"
MAX_TOKENS = 24
PROMPTS = [f"prompt {i}: " + " ".join(f"w{i}x{j}" for j in range(30)) for i in range(6)]

pytestmark = pytest.mark.timeout(600)

APP_ARGS: dict[str, Any] = {
    "model_name": MODEL,
    "routing": "least_loaded",
    "groups": [
        {
            "name": "main",
            "engine": {
                "num_blocks": 64,
                "token_budget": 64,
                "max_num_seqs": 4,
                "enable_prefix_caching": False,
            },
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 2,
                "target_queued_prefill_tokens": 128,
                "target_kv_usage": 0.5,
                "upscale_delay_s": 1,
                "downscale_delay_s": 4,
                "look_back_period_s": 2,
                "metrics_interval_s": 0.5,
                "drain_timeout_s": 60,
            },
        }
    ],
}


class Load:
    """Closed-loop clients: each sends the next prompt as soon as its last one returned."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.results: list[tuple[int, int, str | None]] = []  # (prompt, status, text)
        self.lock = threading.Lock()
        self.clients: list[tuple[threading.Thread, threading.Event]] = []

    def add(self, n: int) -> None:
        for _ in range(n):
            stop = threading.Event()
            start = len(self.clients)
            t = threading.Thread(target=self._run, args=(start, stop), daemon=True)
            self.clients.append((t, stop))
            t.start()

    def stop(self, keep: int = 0) -> None:
        """Stop all clients but the first ``keep``; wait for the stopped ones to finish."""
        stopped = self.clients[keep:]
        for _, ev in stopped:
            ev.set()
        for t, _ in stopped:
            t.join(timeout=120)
        self.clients = self.clients[:keep]

    def _run(self, first: int, stop: threading.Event) -> None:
        i = first
        with httpx.Client(base_url=self.url, timeout=120) as http:
            while not stop.is_set():
                p = i % len(PROMPTS)
                i += 1
                body = {
                    "model": MODEL,
                    "prompt": PROMPTS[p],
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                }
                try:
                    r = http.post("/v1/completions", json=body)
                    text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                    status = r.status_code
                except Exception as e:  # a dropped connection counts as a failure
                    status, text = -1, repr(e)
                with self.lock:
                    self.results.append((p, status, text))


@pytest.fixture(scope="module")
def references() -> list[str]:
    llm = LLM()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [out.text for out in llm.generate(PROMPTS, params)]


def test_load_step_scales_the_group_up_and_back_without_failures(
    local_ray_cluster, tmp_path, references
):
    cluster = local_ray_cluster(dashboard=False)
    started = time.monotonic()
    with serve_running(cluster, APP_ARGS, tmp_path, replicas=1) as url:
        print(f"serving after {time.monotonic() - started:.1f}s")
        timeline: list[tuple[float, int]] = []  # (seconds since the step, router's replicas)
        done = threading.Event()
        t0 = time.monotonic()

        def watch() -> None:
            last = None
            while not done.is_set():
                try:
                    n = httpx.get(url + "/health", timeout=5).json().get("replicas")
                except Exception:
                    n = None
                if n != last:
                    timeline.append((round(time.monotonic() - t0, 1), n))
                    last = n
                time.sleep(0.25)

        def wait_for(replicas: int, timeout: float) -> float:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if timeline and timeline[-1][1] == replicas:
                    return time.monotonic() - t0
                time.sleep(0.25)
            raise AssertionError(f"never reached {replicas} replicas: {timeline}")

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        load = Load(url)
        try:
            load.add(8)  # the step up
            up = wait_for(2, timeout=240)
            deadline = time.monotonic() + 60  # the new replicas serve under the full load
            while True:
                served = served_per_replica(httpx.get(url + "/metrics", timeout=10).text)
                if len(served) == 2 and min(served.values()) > 0:
                    break
                assert time.monotonic() < deadline, served
                time.sleep(0.5)
            load.stop(keep=1)  # the step down
            down = wait_for(1, timeout=240)
        finally:
            load.stop()
            done.set()
            watcher.join(timeout=10)
        print(f"timeline (s, replicas): {timeline}; 2 at {up:.1f}s, 1 at {down:.1f}s")
        print(f"requests: {len(load.results)}; served per replica at 2: {served}")
        stopping = time.monotonic()
    print(f"stopped in {time.monotonic() - stopping:.1f}s")

    statuses = Counter(status for _, status, _ in load.results)
    assert set(statuses) == {200}, (statuses, [r for r in load.results if r[1] != 200][:3])
    wrong = [(p, text) for p, _, text in load.results if text != references[p]]
    assert not wrong, wrong[:3]
    assert len(load.results) >= 20
    counts = [n for _, n in timeline if n is not None]
    assert counts[0] == 1 and 2 in counts and counts[-1] == 1
    assert len(served) == 2 and min(served.values()) > 0, served  # the new ones took work


def served_per_replica(metrics_text: str) -> dict[str, float]:
    """Finished requests per replica, from the router's ``/metrics``."""
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("meridian:request_success_total{"):
            labels, value = line[line.index("{") + 1 :].rsplit("} ", 1)
            replica = re.search(r'replica="([^"]*)"', labels)
            if replica:
                out[replica.group(1)] = out.get(replica.group(1), 0.0) + float(value)
    return out
