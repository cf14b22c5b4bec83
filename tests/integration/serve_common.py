"""What the Serve app tests share: ``serve run`` of one application on a private local Ray
cluster, ready once ``/health`` counts every replica."""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import yaml

from actors import LLM, RequestOutput, SamplingParams

APP = "meridian"


def ids(seed: int, n: int) -> list[int]:
    """``n`` deterministic token ids of the tiny model's vocabulary, one sequence per seed."""
    return [(seed * 7919 + i * 104729) % 500 + 3 for i in range(n)]


def greedy_output(reference: LLM, prompt: list[int], n: int) -> RequestOutput:
    """The in-process engine's greedy output of ``n`` tokens (EOS ignored)."""
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return reference.generate(prompt_token_ids=[prompt], sampling_params=p)[0]


def greedy(reference: LLM, prompt: list[int], n: int) -> list[int]:
    return greedy_output(reference, prompt, n).token_ids


class Server:
    """A running app: its URL, the cluster it runs on, an HTTP client and openai clients
    that send ``key`` (the app's API key, if it has keys) unless told otherwise."""

    def __init__(self, url: str, cluster: Any, key: str | None = None) -> None:
        self.url = url
        self.cluster = cluster
        self.key = key
        self.http = httpx.Client(base_url=url, timeout=120)

    def client(self, key: str | None = None) -> openai.OpenAI:
        api_key = key or self.key or "unused"
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120)

    def post(self, path: str, body: bytes | dict, key: Any = ...) -> httpx.Response:
        """POST JSON; ``key=None`` sends no Authorization header."""
        key = self.key if key is ... else key
        headers = {"Content-Type": "application/json"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return self.http.post(path, content=data, headers=headers)


def assert_greedy_completions(
    server: Server, model: str, reference: LLM, lengths: tuple[int, ...], n: int
) -> None:
    """``POST /v1/completions`` of an ``ids(k, k)`` prompt for each ``k`` in ``lengths``
    returns the in-process engine's ``n`` greedy token ids."""
    client = server.client()
    for k in lengths:
        prompt = ids(k, k)
        r = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=n,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        assert r.choices[0].model_extra["token_ids"] == greedy(reference, prompt, n), k


@contextlib.contextmanager
def serve_running(
    cluster: Any, app_args: dict[str, Any], tmp: Path, replicas: int
) -> Iterator[str]:
    """Run the app from ``app_args`` (``ServeConfig`` fields) with ``serve run``; yields its
    URL once ``/health`` reports ``replicas`` replicas; stops the app and the cluster."""
    port = cluster.free_port()
    config = {
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {
                "name": APP,
                "route_prefix": "/",
                "import_path": "serve_app:build_app",
                "args": app_args,
            }
        ],
    }
    path = tmp / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    with serve_file_running(cluster, path, port, replicas) as url:
        yield url


# `serve run --address` right after the head started: once in CI Ray's driver found no node
# to attach to ("No node info found matching attributes"); only that failure is retried
NOT_CONNECTED = "Failed to connect to Ray cluster"
CONNECT_TRIES = 3


@contextlib.contextmanager
def serve_file_running(cluster: Any, path: Path, port: int, replicas: int) -> Iterator[str]:
    """``serve run FILE`` of a Serve config file as it is (its app listening on ``port``);
    yields its URL once ``/health`` reports ``replicas`` replicas; stops it and the cluster."""
    command = [str(cluster.BIN / "serve"), "run", f"--address={cluster.address}", str(path)]
    proc = cluster.popen(command, "serve.log")
    url = f"http://127.0.0.1:{port}"
    tries = 1
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None and tries < CONNECT_TRIES:
                log = (cluster.tmp / "serve.log").read_text()
                if NOT_CONNECTED in log:  # Ray's head not yet resolvable: start it again
                    print(f"serve run could not connect to the cluster (try {tries}); again")
                    tries += 1
                    proc = cluster.popen(command, "serve.log")
                    continue
            assert proc.poll() is None, (cluster.tmp / "serve.log").read_text()[-5000:]
            assert time.monotonic() < deadline, "the server did not become healthy"
            try:
                r = httpx.get(url + "/health", timeout=5)
                if r.status_code == 200 and r.json().get("replicas") == replicas:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        yield url
    finally:
        # the cluster goes with its app: no graceful shutdown to wait for (SIGINT took 5-8 s)
        cluster.kill_group(proc, signal.SIGKILL, grace=0)
        cluster.stop()


def planned_config(
    cluster: Any, tmp: Path, trace_rows: list[dict[str, Any]], argv: list[str]
) -> Path:
    """``python -m sim plan ARGV --trace T --port P --out F``, with ``T`` a Mooncake
    trace of ``trace_rows`` and ``P`` a free port of ``cluster``; returns ``F``."""
    from sim.__main__ import main as sim_main

    trace = tmp / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in trace_rows))
    out = tmp / "plan.yaml"
    argv = [*argv, "--trace", str(trace), "--port", str(cluster.free_port()), "--out", str(out)]
    assert sim_main(argv) == 0
    return out
