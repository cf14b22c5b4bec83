"""A disaggregated replica group through the Serve app: ``serve run`` of a config whose one
group has ``num_prefill: 1, num_decode: 1`` and a small KV store (DRAM + SSD in a tmp
folder) on a private local Ray cluster, real HTTP, the real ``openai`` client.

Greedy outputs equal the in-process engine on the same weights, and the decode replica's
tokens reach the ingress without passing through the Conductor's process (its
``pd_conductor_relayed_tokens`` counter stays 0). The Conductor's rejection
(``decode_full``: a running request holds the decode pool) reaches the client as a 429
with the Conductor's Retry-After, before any 200, while a request that fits still
completes, and the router drops its record of each refused one; afterwards every block of
every prefill and decode pool is back.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from serve_common import Server, greedy, greedy_output, ids, serve_running

from actors import LLM, SamplingParams

MODEL = "meridian-tiny"
BS = 16
DECODE_BLOCKS = 128  # per replica: 2,048 tokens, the tiny model's whole context
MAX_TOKENS = 2000
APP = "meridian"
GROUP = "pd"

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(local_ray_cluster, tmp_path_factory):
    cluster = local_ray_cluster(dashboard=False)
    tmp = tmp_path_factory.mktemp("serve-pd")
    group = {
        "name": GROUP,
        "num_prefill": 1,
        "num_decode": 1,
        "engine": {"block_size": BS, "num_blocks": DECODE_BLOCKS},
        "store": {"dram_bytes": 4 << 20, "ssd_bytes": 4 << 20, "ssd_dir": str(tmp / "kv")},
        "conductor": {"decode_wait_s": 0},  # no waiting for decode room: refused at once
    }
    app_args = {"model_name": MODEL, "groups": [group], "limits": {"max_tokens": MAX_TOKENS}}
    with serve_running(cluster, app_args, tmp, replicas=1) as url:
        yield Server(url, cluster)


@pytest.fixture(scope="module")
def reference():
    """The in-process engine on the same (built-in tiny) weights."""
    return LLM()


def completion(server: Server, **body) -> httpx.Response:
    return server.post("/v1/completions", {"model": MODEL, **body})


# -- exact through the disaggregated group ----------------------------------------------------
def test_health_reports_the_one_pd_replica(server):
    health = server.http.get("/health").json()
    assert health == {"status": "ok", "replicas": 1}


def test_greedy_completions_equal_in_process_engine(server, reference):
    shared = ids(1, 40)  # > 2 blocks: the second request reuses the prefix
    client = server.client()
    for prompt in (ids(2, 7), shared + ids(3, 5), shared + ids(4, 21)):
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            n=2,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        want = greedy(reference, prompt, 12)
        assert [c.model_extra["token_ids"] for c in r.choices] == [want, want]
        assert r.usage.prompt_tokens == len(prompt)
        assert r.usage.completion_tokens == 24


def test_chat_equals_in_process_engine(server, reference):
    messages = [{"role": "user", "content": "Split prefill from decode, please."}]
    r = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    ref = reference.chat(messages, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert r.choices[0].message.content == ref.text
    assert r.usage.completion_tokens == 8


def test_streaming_equals_reference_and_ends_with_done(server, reference):
    prompt = ids(5, 30)
    want = greedy_output(reference, prompt, 16).text
    chunks = list(
        server.client().completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with server.http.stream(
        "POST", "/v1/completions", json={"model": MODEL, **body, "stream": True}
    ) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
    assert text == want
    # The decode replica wrote these tokens straight to the ingress: once ``/metrics``
    # counts them as generated, the Conductor's process has relayed none of them.
    deadline = time.monotonic() + 30
    while metric(server, "meridian:generation_tokens_total") < 32:
        assert time.monotonic() < deadline, "the replica never reported the tokens"
        time.sleep(0.2)
    assert metric(server, "meridian:pd_conductor_relayed_tokens_total") == 0
    # ... and measured their gaps: every token after each request's first one or two (the
    # prefill's token may come in one batch with the first decode's) is in the histogram
    assert metric(server, "meridian:inter_token_latency_seconds_count") >= 2 * 14


def metric(server: Server, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(server.http.get("/metrics").text)
    return sum(s.value for f in families for s in f.samples if s.name == name)


# -- the Conductor's rejection ----------------------------------------------------------------
def _check_retry_after(response: httpx.Response) -> None:
    """Retry-After is the Conductor's ``retry_after`` rounded up (at least 1); the message
    names the reason and prints that value to 0.1 s."""
    err = response.json()["error"]
    assert err["type"] == "rate_limit_error"
    assert "decode_full" in err["message"]
    shown = float(re.search(r"retry after ([0-9.]+) s", err["message"])[1])
    ceilings = {max(1, math.ceil(shown - 0.05)), max(1, math.ceil(shown + 0.05))}
    assert int(response.headers["retry-after"]) in ceilings


LONG = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": MAX_TOKENS, "stream": True}
TOO_BIG = {"prompt": [9, 10, 11, 12], "max_tokens": 40}


@contextlib.contextmanager
def pool_held(server: Server) -> Iterator[None]:
    """Holds the decode pool with one long greedy stream (4 + 2000 tokens reserve 126 of the
    128 blocks) while the body runs. Closing the stream aborts it; opening waits until an
    earlier one's blocks are back."""
    deadline = time.monotonic() + 120
    while True:
        with server.http.stream("POST", "/v1/completions", json={**LONG, "ignore_eos": True}) as r:
            if r.status_code == 429:
                r.read()
                assert time.monotonic() < deadline, "an aborted stream never freed its blocks"
                time.sleep(0.5)
                continue
            assert r.status_code == 200
            lines = r.iter_lines()  # kept alive: dropping the iterator closes the connection
            assert next(lines).startswith("data: {")  # placed, decoding
            yield
            return


def _refused_while_held(server: Server, ask: Callable[[], int]) -> int:
    """``ask()``'s status code while a long stream holds the pool. The long stream decodes
    its 2000 tokens in a few seconds on the tiny model, so a check that lands after it ended
    (a 200) is tried again with a fresh one, up to 3 times."""
    for _ in range(3):
        with pool_held(server):
            status = ask()
        if status == 429:
            break
    return status


def test_conductor_rejection_is_429_with_retry_after(server, reference):
    """A running request reserves its lifetime KV (prompt + max_tokens) on the one decode
    replica: 4 + 2000 tokens hold 126 of its 128 blocks. A request needing 3 more blocks is
    rejected (429, non-streaming, streaming and through the openai client alike); one needing
    1 block runs and is exact. Closing the long stream aborts it and frees its reservation."""

    def non_streaming() -> int:
        refused = completion(server, **TOO_BIG)
        if refused.status_code == 429:
            _check_retry_after(refused)
        return refused.status_code

    def streaming() -> int:
        body = {"model": MODEL, **TOO_BIG, "stream": True}
        with server.http.stream("POST", "/v1/completions", json=body) as s:
            s.read()  # a 429 comes before any 200 or SSE byte
            if s.status_code == 429:
                _check_retry_after(s)
            return s.status_code

    def through_openai() -> int:
        try:
            server.client().completions.create(model=MODEL, **TOO_BIG)
        except openai.RateLimitError as err:
            assert int(err.response.headers["retry-after"]) >= 1
            return 429
        return 200

    for ask in (non_streaming, streaming, through_openai):
        assert _refused_while_held(server, ask) == 429, ask.__name__

    fits = [13, 14, 15, 16]
    with pool_held(server):
        ok = server.client().completions.create(
            model=MODEL,
            prompt=fits,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    assert ok.choices[0].model_extra["token_ids"] == greedy(reference, fits, 8)
    # The long stream was closed mid-way: its reservation is freed, the big one now fits.
    deadline = time.monotonic() + 120
    while (r := completion(server, **TOO_BIG)).status_code == 429:
        assert time.monotonic() < deadline, "the aborted stream never freed its decode blocks"
        time.sleep(0.5)
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] >= 1
    # The router recorded each refused request on the replica before it refused: the
    # ingress told it, and it dropped each record (its view holds no request that runs
    # nowhere).
    deadline = time.monotonic() + 30
    while router_decisions(server, "not_run") < 3:
        assert time.monotonic() < deadline, "the router never heard of the refusals"
        time.sleep(0.2)


def router_decisions(server: Server, outcome: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(server.http.get("/metrics").text)
    samples = [s for f in families for s in f.samples]
    name = "meridian:router_decisions_total"
    return sum(s.value for s in samples if s.name == name and s.labels["outcome"] == outcome)


def test_session_turns_are_retained_in_the_store(server, reference):
    """Two turns of a session (the ``X-Session-Id`` header, ``kv_retention_s``) run exact;
    the store retains their blocks, and ``/metrics`` shows it; asking for more than the
    configured bound is a 400 naming the field."""
    turn1 = ids(31, 40)
    headers = {"X-Session-Id": "agent-31"}
    body = {"model": MODEL, "prompt": turn1, "max_tokens": 8, "temperature": 0}
    r = server.http.post(
        "/v1/completions", json={**body, "ignore_eos": True, "kv_retention_s": 60}, headers=headers
    )
    assert r.status_code == 200, r.text
    out1 = greedy(reference, turn1, 8)
    turn2 = turn1 + out1 + ids(32, 8)
    body2 = {**body, "prompt": turn2, "ignore_eos": True, "return_token_ids": True}
    r = server.http.post("/v1/completions", json={**body2, "kv_retention_s": 60}, headers=headers)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == greedy(
        reference, turn2, 8
    )
    deadline = time.monotonic() + 60
    while True:
        text = server.http.get("/metrics").text
        kept = re.findall(r"^meridian:kv_store_retained_blocks\{[^}]*\} (\S+)$", text, re.M)
        if kept and float(kept[0]) >= len(turn2) // BS:
            break
        assert time.monotonic() < deadline, kept
        time.sleep(0.5)
    refused = completion(server, prompt=turn1, max_tokens=1, kv_retention_s=601)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "kv_retention_s"


# -- nothing leaked -----------------------------------------------------------------------------
def test_every_block_returned(server):
    """Every prefill and decode pool passes its integrity check with no block in use, read
    on the replica's engine thread (``ReplicaServer.check_blocks``) from a separate driver
    (this test process has held other Ray sessions)."""
    script = textwrap.dedent(
        """
        import json, sys, time
        import ray
        from ray import serve
        ray.init(address=sys.argv[1], log_to_driver=False)
        handle = serve.get_deployment_handle(sys.argv[3], app_name=sys.argv[2])
        deadline = time.monotonic() + 120
        while True:  # requests the client closed are aborted asynchronously
            blocks = handle.check_blocks.remote().result()
            if set(blocks.values()) == {0} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        print(json.dumps(blocks))
        """
    )
    cluster = server.cluster
    done = subprocess.run(
        [sys.executable, "-c", script, cluster.address, APP, f"Replica-{GROUP}"],
        env=cluster.env,
        cwd=cluster.REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    blocks = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(blocks) == ["d0", "p0"]
    assert set(blocks.values()) == {0}
