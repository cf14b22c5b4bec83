"""Reliability at CI size (``bench/soak.py`` is the full-size soak): a Serve app with one
``tp=2`` replica and one warm spare (``standby_replicas``) under closed-loop load while a
worker actor, a replica and the router deployment are killed; every request ends with its
exact greedy tokens or a clear retriable error, a killed replica's place (and a restarting
one's) is taken by the spare, the app is back at full strength by itself, spare included,
and no block is left in use. A client that disconnects
mid-stream frees its blocks at once (the Serve proxy, the ingress and the replica's stream
are each closed in turn, and the engine loop aborts the request)."""

from __future__ import annotations

import httpx
import pytest

from bench import soak, soak_app  # noqa: E402

pytestmark = [pytest.mark.reliability, pytest.mark.timeout(600)]

PHASE = soak_app.colocated_phase(kinds=["worker", "replica", "router"], replicas=1, standby=1)
GROUP = PHASE.group["name"]


@pytest.fixture(scope="module")
def cases():
    token_lists = soak_app.prompts(6, seed=1)
    return list(zip(token_lists, soak_app.reference_tokens(token_lists), strict=True))


@pytest.fixture(scope="module")
def app():
    with soak_app.running_app(PHASE, num_cpus=2) as url:
        yield url


def test_faults_under_load_lose_nothing(app, cases):
    lines: list[str] = []
    report = soak.soak(app, PHASE, cases, faults=1, clients=2, pause=(0.5, 1.5), log=lines.append)
    table = soak.table([report]) + "\n" + "\n".join(lines)
    for kind in PHASE.kinds:
        k = report.kinds[kind]
        assert k.faults == 1 and k.not_recovered == 0 and len(k.recovery_s) == 1, table
    for kind in ("worker", "replica"):  # the spare served, then was whole again
        assert len(report.kinds[kind].whole_s) == 1, table
    tallies = report.tally.values()
    assert sum(t.ok for t in tallies) > 0, table
    assert sum(t.lost + t.dropped for t in tallies) == 0, table
    assert sum(t.wrong for t in tallies) == 0, table
    assert report.leaked == 0 and report.blocks, table


def test_client_disconnecting_mid_stream_frees_its_blocks_at_once(app, cases):
    idle = soak_app.blocks_in_use(GROUP, wait_s=30)
    assert idle and all(v == 0 for b in idle.values() for v in b.values()), idle
    prompt = cases[0][0]
    body = {
        "model": soak_app.MODEL,
        "prompt": prompt,
        "max_tokens": 1000,  # seconds of decoding, were it not aborted
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    in_use: dict = {}
    with httpx.Client(base_url=app, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 3:  # streaming: the request holds blocks now
                    in_use = soak_app.blocks_in_use(GROUP, wait_s=0)
                    break  # leaving the iteration closes the response: the client is gone
    assert any(v for b in in_use.values() for v in b.values()), in_use
    # the response and its connection are closed here: the request is aborted, and its
    # blocks are back at 0 within the wait (decoding its 1,000 tokens would take longer)
    blocks = soak_app.blocks_in_use(GROUP, wait_s=5)
    assert all(v == 0 for b in blocks.values() for v in b.values()), blocks
