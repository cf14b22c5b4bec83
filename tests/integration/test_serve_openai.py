"""The Serve app end to end: ``serve run`` of a Serve config file on a private local Ray
cluster, real HTTP, the real ``openai`` client.

One server per module (two replicas, prefix-aware routing, three API keys). Greedy outputs
are compared with the in-process engine on the same weights, so every layer in between
(tokenizing, routing, the engine thread, streaming) must be exact.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import openai
import pytest
from bad_requests import BAD, BODY_LIMIT, GOOD, MAX_TOKENS_LIMIT, MODEL
from serve_common import Server, serve_running

from actors import LLM, SamplingParams

REPO = Path(__file__).resolve().parents[2]
KEY_A, KEY_B, KEY_LIMITED = "sk-tenant-a-0001", "sk-tenant-b-0002", "sk-limited-0003"
KEY_RATED = "sk-rated-0004"  # 2 requests and 300 tokens per minute

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def server(local_ray_cluster, tmp_path_factory):
    cluster = local_ray_cluster(dashboard=False)
    app_args = {
        "model_name": MODEL,
        "groups": [{"name": "main", "num_replicas": 2, "engine": {"kv_cache_memory": 1 << 25}}],
        "routing": "prefix_aware",
        "api_keys": [
            {"key": KEY_A, "tenant": "tenant-a"},
            {"key": KEY_B, "tenant": "tenant-b"},
            {"key": KEY_LIMITED, "tenant": "limited", "max_concurrent_requests": 1},
            {
                "key": KEY_RATED,
                "tenant": "rated",
                "requests_per_minute": 2,
                "tokens_per_minute": 300,
            },
        ],
        "limits": {"max_tokens": MAX_TOKENS_LIMIT, "max_body_bytes": BODY_LIMIT},
    }
    tmp = tmp_path_factory.mktemp("serve")
    with serve_running(cluster, app_args, tmp, replicas=2) as url:
        yield Server(url, cluster, KEY_A)


@pytest.fixture(scope="module")
def reference():
    """The in-process engine on the same (built-in tiny) weights."""
    return LLM()


def greedy_ref(reference: LLM, prompt: str, n: int) -> str:
    p = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return reference.generate([prompt], p)[0].text


def unique_prompt(words: int = 12) -> str:
    return f"[{uuid.uuid4().hex}] " + " ".join(f"word{i}" for i in range(words))


# -- the happy paths ------------------------------------------------------------------------
def test_models_and_health(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    health = server.http.get("/health").json()
    assert health["status"] == "ok" and health["replicas"] == 2


def test_completion_matches_in_process_engine(server, reference):
    prompt = "The quick brown fox jumps over the lazy dog"
    r = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].text == greedy_ref(reference, prompt, 12)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(reference.tokenizer.encode(prompt))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_completion(server, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    r = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    ref = reference.chat(messages, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 8


def test_streaming_equals_non_streaming(server):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0.9, seed=11)
    whole = server.client().completions.create(**kw)
    chunks = list(
        server.client().completions.create(
            **kw, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]


def test_continuous_usage_stats_count_each_choice_so_far(server):
    # vLLM's stream option, which load generators such as guidellm send
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0.9, seed=5, n=2)
    opts = {"include_usage": True, "continuous_usage_stats": True}
    extra = {"ignore_eos": True}
    chunks = list(
        server.client().completions.create(**kw, stream=True, stream_options=opts, extra_body=extra)
    )
    body = [c for c in chunks if c.choices]
    assert body and all(c.usage is not None for c in body)
    prompt_tokens = chunks[-1].usage.prompt_tokens
    for index in (0, 1):
        mine = [c.usage for c in body if c.choices[0].index == index]
        counts = [u.completion_tokens for u in mine]
        assert counts == sorted(counts) and counts[-1] == 8  # grows to the choice's tokens
        assert all(u.prompt_tokens == prompt_tokens for u in mine)
        assert all(u.total_tokens == prompt_tokens + u.completion_tokens for u in mine)
    assert chunks[-1].usage.completion_tokens == 16  # the final usage: every choice


def test_chat_stream_ends_with_done(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": 6,
        "stream": True,
    }
    with server.http.stream(
        "POST", "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY_A}"}
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][6:])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"]["role"] == "assistant"


def test_seeds_and_n_choices(server):
    kw = dict(model=MODEL, prompt="Seeded sampling", max_tokens=10, temperature=1.0, seed=5, n=3)
    a = server.client().completions.create(**kw)
    b = server.post("/v1/completions", dict(kw, return_token_ids=True)).json()
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    # The same seed reproduces every choice; usage counts every choice's tokens.
    assert [c.text for c in a.choices] == [c["text"] for c in b["choices"]]
    assert b["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in b["choices"])
    assert a.usage.completion_tokens == b["usage"]["completion_tokens"]


def test_stop_sequence(server, reference):
    prompt = "Once upon a time"
    base = greedy_ref(reference, prompt, 24)
    # A stop string from the middle of the greedy text: generation ends right before it.
    stop = next(c for c in base[1:] if c != "\ufffd")
    r = server.client().completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == base[: base.index(stop)]
    assert r.usage.completion_tokens < 24


def test_sampling_fields_and_logprobs_equal_in_process(server, reference):
    """Penalties, a bias, min_tokens and logprobs over HTTP (completions, and chat streamed)
    give the in-process engine's tokens and logprobs; a JSON schema is followed."""
    kw = dict(
        temperature=0.0,
        presence_penalty=1.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.3,
        logit_bias={"42": 4.0},
        min_tokens=6,
    )
    prompt = "Sampling over HTTP"
    body = dict(kw, model=MODEL, prompt=prompt, max_tokens=6, logprobs=2, return_token_ids=True)
    got = server.post("/v1/completions", body).json()["choices"][0]
    (ref,) = reference.generate(prompt, SamplingParams(max_tokens=6, logprobs=2, **p_kw(kw)))
    assert got["token_ids"] == ref.token_ids
    assert got["logprobs"]["token_logprobs"] == pytest.approx(
        [lp.logprob for lp in ref.logprobs], abs=1e-5
    )
    assert [len(t) for t in got["logprobs"]["top_logprobs"]] == [2] * 6

    messages = [{"role": "user", "content": "Stream logprobs"}]
    chunks = list(
        server.client().chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            stream=True,
            logprobs=True,
            top_logprobs=1,
            extra_body=kw,
        )
    )
    content = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    ref = reference.chat(messages, SamplingParams(max_tokens=6, logprobs=1, **p_kw(kw)))
    assert [e.logprob for e in content] == pytest.approx(
        [lp.logprob for lp in ref.logprobs], abs=1e-5
    )
    assert all(len(e.top_logprobs) == 1 for e in content)

    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 99}},
        "required": ["n"],
        "additionalProperties": False,
    }
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    data = json.loads(r.choices[0].message.content)
    assert set(data) == {"n"} and isinstance(data["n"], int) and data["n"] <= 99


def p_kw(kw: dict) -> dict:
    """The HTTP sampling fields as SamplingParams keywords (logit_bias keyed by int)."""
    return dict(kw, logit_bias={int(k): v for k, v in kw["logit_bias"].items()})


def test_bad_input_table_while_serving(server, reference):
    """Every bad request gets its 4xx naming the field, while a good request runs
    alongside; afterwards the server is healthy and still exact."""
    prompt = unique_prompt()
    pool = concurrent.futures.ThreadPoolExecutor(1)
    good = pool.submit(
        server.client().completions.create,
        model=MODEL,
        prompt=prompt,
        max_tokens=64,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    failures = []
    for name, path, body, status, param in BAD:
        r = server.post(path, body)
        try:
            err = r.json()["error"]
        except Exception:
            failures.append(f"{name}: {r.status_code} {r.text[:200]}")
            continue
        if r.status_code != status or err.get("param") != param or param not in err["message"]:
            failures.append(f"{name}: {r.status_code} {err}")
        if not isinstance(err.get("type"), str):
            failures.append(f"{name}: no error type in {err}")
    assert not failures, "\n".join(failures)
    assert good.result().choices[0].text == greedy_ref(reference, prompt, 64)
    assert server.http.get("/health").status_code == 200
    r = server.post("/v1/completions", GOOD)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_api_keys(server):
    with pytest.raises(openai.AuthenticationError):
        server.client("sk-not-a-key-000").completions.create(model=MODEL, prompt="x", max_tokens=1)
    r = server.post("/v1/completions", GOOD, key=None)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_overload_gets_429_with_retry_after(server):
    """The limited key allows one request at once: a second one, while the first streams,
    is refused with 429 and Retry-After; once the first ends, the key serves again."""
    body = dict(GOOD, max_tokens=MAX_TOKENS_LIMIT, stream=True, ignore_eos=True)
    headers = {"Authorization": f"Bearer {KEY_LIMITED}"}
    with server.http.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept alive: dropping the iterator closes the connection
        assert next(lines).startswith("data: {")  # the first is accepted and streaming
        second = server.post("/v1/completions", GOOD, key=KEY_LIMITED)
        assert second.status_code == 429
        assert int(second.headers["retry-after"]) >= 1
        assert second.json()["error"]["type"] == "rate_limit_error"
    # Closing the stream aborts the first request and frees the slot.
    deadline = time.monotonic() + 120
    while (r := server.post("/v1/completions", GOOD, key=KEY_LIMITED)).status_code == 429:
        assert time.monotonic() < deadline, "the aborted stream never released its slot"
        time.sleep(0.5)
    assert r.status_code == 200


def test_per_key_rate_limits(server):
    """A request over the key's whole tokens_per_minute gets 400 (waiting would not help) and
    takes nothing; two fit its requests_per_minute; the third gets 429 naming the limit."""
    r = server.post("/v1/completions", dict(GOOD, max_tokens=400), key=KEY_RATED)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "max_tokens"
    assert "tokens_per_minute" in r.json()["error"]["message"]
    for _ in range(2):
        assert server.post("/v1/completions", GOOD, key=KEY_RATED).status_code == 200
    r = server.post("/v1/completions", GOOD, key=KEY_RATED)
    assert r.status_code == 429
    assert 1 <= int(r.headers["retry-after"]) <= 30
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
    assert "requests_per_minute" in err["message"]


README_MODEL = "SmolLM2-135M-Instruct"  # what `make serve` serves; this server has the tiny one


def test_readme_openai_snippet(server):
    """The README's OpenAI client snippet as written, with this server's URL, key and model
    name; it prints the server's greedy answer to the README's question."""
    from readme_common import readme_block

    code = readme_block("python", "import openai")
    for readme, here in [
        ("http://127.0.0.1:8000/v1", server.url + "/v1"),
        ('api_key="unused"', f'api_key="{KEY_A}"'),
        (f'model="{README_MODEL}"', f'model="{MODEL}"'),
    ]:
        assert readme in code, f"the README's snippet no longer has {readme!r}"
        code = code.replace(readme, here)
    assert "What is the capital of France?" in code
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}  # bytes as printed, no newline mapping
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-3000:]
    expected = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0.0,
    )
    assert r.stdout.decode("utf-8") == f"{expected.choices[0].message.content}\n"


# -- tenants --------------------------------------------------------------------------------
def test_tenants_share_no_cache_hits(server):
    prompt = unique_prompt(words=20)  # > 4 blocks of 16 tokens

    def cached(key: str) -> int:
        r = server.client(key).completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(KEY_A) == 0
    assert cached(KEY_A) >= 64  # the same tenant hits its own prefix
    assert cached(KEY_B) == 0  # another tenant never does, whatever replica it lands on
    assert cached(KEY_B) >= 64


# -- metrics ---------------------------------------------------------------------------------
def test_metrics_exposed_per_replica(server):
    from prometheus_client.parser import text_string_to_metric_families

    server.client().completions.create(model=MODEL, prompt="metrics please", max_tokens=4)
    per_replica = [
        "meridian:time_to_first_token_seconds_count",
        "meridian:inter_token_latency_seconds_count",
        "meridian:e2e_request_latency_seconds_count",
        "meridian:num_requests_running",
        "meridian:num_requests_waiting",
        "meridian:kv_cache_usage_perc",
        "meridian:prefix_cache_queries_total",
        "meridian:prefix_cache_hits_total",
        "meridian:generation_tokens_total",
    ]
    deadline = time.monotonic() + 60
    while True:  # replicas push metrics every report interval
        text = server.http.get("/metrics").text
        samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
        replicas = {s.labels["replica"] for s in samples if "replica" in s.labels}
        ttft = sum(s.value for s in samples if s.name == per_replica[0])
        if ttft > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert ttft > 0
    assert len(replicas) == 2
    for name in per_replica:
        got = {s.labels["replica"] for s in samples if s.name == name}
        assert got == replicas, name
        assert all(s.labels["model_name"] == MODEL for s in samples if s.name == name), name
    assert sum(s.value for s in samples if s.name == "meridian:inter_token_latency_seconds_count")
    http = [s for s in samples if s.name == "meridian:http_requests_total"]
    assert any(s.labels["route"] == "/v1/completions" and s.labels["status"] == "200" for s in http)
    decisions = [s for s in samples if s.name == "meridian:router_decisions_total"]
    assert sum(s.value for s in decisions if s.labels["outcome"] == "routed") > 0


# -- the Python API attached to the running app ----------------------------------------------
def test_llm_attach_over_http_equals_in_process(server, reference):
    llm = LLM.attach(server.url, api_key=KEY_A)
    prompts = ["Attach one", "Attach two, a little longer"]
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, p)
    refs = reference.generate(prompts, p)
    assert [o.token_ids for o in outs] == [r.token_ids for r in refs]
    assert [o.text for o in outs] == [r.text for r in refs]


def test_llm_attach_by_app_name_equals_in_process(server, reference):
    """A separate driver process (a user's script) connects to the cluster and attaches by
    app name. In its own process: this test process has already held other Ray sessions."""
    script = textwrap.dedent(
        """
        import json, sys
        import ray
        from actors import LLM, SamplingParams
        ray.init(address=sys.argv[1], log_to_driver=False)
        llm = LLM.attach("meridian", api_key=sys.argv[2])
        p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate(["By name", "By app name"], p)
        print(json.dumps([o.token_ids for o in outs]))
        """
    )
    cluster = server.cluster
    done = subprocess.run(
        [sys.executable, "-c", script, cluster.address, KEY_B],
        env=cluster.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    refs = reference.generate(["By name", "By app name"], p)
    assert got == [r.token_ids for r in refs]
