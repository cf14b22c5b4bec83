"""The Serve app with Ray Serve's direct ingress (``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``, as
``make serve`` runs it): the ingress replica's own HTTP server answers like the proxy does,
with the real ``openai`` client."""

from __future__ import annotations

import httpx
import openai
import pytest
from bad_requests import MODEL
from serve_common import serve_running

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def urls(local_ray_cluster, tmp_path_factory):
    """(the proxy's URL, the ingress replica's own URL)."""
    direct_port = local_ray_cluster.free_port()
    env = {
        "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
        # the app's one ingress replica takes the first port of the range
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": str(direct_port),
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": str(direct_port + 50),
    }
    cluster = local_ray_cluster(dashboard=False, env=env)
    app_args = {
        "model_name": MODEL,
        "groups": [{"name": "main", "num_replicas": 1, "engine": {"kv_cache_memory": 1 << 25}}],
    }
    with serve_running(cluster, app_args, tmp_path_factory.mktemp("serve"), replicas=1) as url:
        yield url, f"http://127.0.0.1:{direct_port}"


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_ingress_port_streams_what_the_proxy_returns(urls):
    proxy, direct = urls
    assert httpx.get(direct + "/health", timeout=30).json()["replicas"] == 1
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9, seed=5)
    whole = client(proxy).completions.create(**kw)
    chunks = list(
        client(direct).completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    chat = client(direct).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, seed=1
    )
    assert chat.choices[0].message.role == "assistant"
    assert 1 <= chat.usage.completion_tokens <= 6


def test_the_ingress_port_refuses_bad_input_by_name(urls):
    _, direct = urls
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "frobnicate": 1}
    r = httpx.post(direct + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400
    assert "frobnicate" in r.text
    metrics = httpx.get(direct + "/metrics", timeout=60)
    assert metrics.status_code == 200 and "meridian:" in metrics.text
