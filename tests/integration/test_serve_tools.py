"""Tool calling through the Serve app with the real ``openai`` client: the tiny random model
with a Hermes-style chat template (the tool-call format detected from it).

A random model calls a tool only when made to, so round trips use ``tool_choice: required``
or a named function: the grammar makes every answer a call whose arguments validate.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from bad_requests import MODEL
from serve_common import Server, serve_running
from tool_template import hermes_model_dir

pytestmark = pytest.mark.timeout(900)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Rome?"}]


@pytest.fixture(scope="module")
def server(local_ray_cluster, tmp_path_factory):
    cluster = local_ray_cluster(dashboard=False)
    tmp = tmp_path_factory.mktemp("serve_tools")
    app_args = {
        "model": str(hermes_model_dir(tmp / "model")),
        "model_name": MODEL,
        "groups": [{"name": "main", "num_replicas": 1, "engine": {"kv_cache_memory": 1 << 25}}],
    }
    with serve_running(cluster, app_args, tmp, replicas=1) as url:
        yield Server(url, cluster)


def valid(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def test_required_call_round_trip(server):
    client = server.client()
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=200,
            seed=seed,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        valid(call.function.name, call.function.arguments)


def test_named_function_streamed_in_openai_deltas(server):
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0.8,
        seed=7,
        stream=True,
    )
    calls: dict[int, dict] = {}
    content, reasons, fragments = "", [], 0
    for chunk in stream:
        delta = chunk.choices[0].delta
        reasons.append(chunk.choices[0].finish_reason)
        content += delta.content or ""
        for d in delta.tool_calls or []:
            if d.id is not None:  # a call's first delta: id, type and name, no arguments yet
                assert d.index not in calls and d.type == "function"
                assert d.function.name == "get_weather" and not d.function.arguments
                calls[d.index] = {"id": d.id, "arguments": ""}
            else:
                assert d.function.name is None
                calls[d.index]["arguments"] += d.function.arguments
                fragments += 1
    assert "<tool_call>" not in content and "</tool_call>" not in content
    assert reasons[-1] == "tool_calls" and all(r is None for r in reasons[:-1])
    assert list(calls) == [0] and fragments > 1  # arguments arrive in pieces
    args = valid("get_weather", calls[0]["arguments"])
    assert set(args) == {"city", "unit", "days"}


def test_parallel_calls_each_validate(server):
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        seed=1,
    )
    choice = r.choices[0]
    calls = choice.message.tool_calls
    assert calls, choice
    done = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # the last may be cut
    for call in done:
        valid(call.function.name, call.function.arguments)
    assert len({c.id for c in calls}) == len(calls)


def test_multi_turn_with_a_tool_result_completes(server):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Rome", "unit": "celsius", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 24 C"},
    ]
    client = server.client()
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8, seed=0
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")
    # the call and its result are rendered into the prompt
    added = len('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + added
    auto = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=16
    )
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"tools": [{"type": "function", "function": {"description": "x"}}]},
            "tools.0.function.name",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools.0.function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "object", "required": 3}},
                    }
                ]
            },
            "tools.0.function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"messages": [*ASK, {"role": "tool", "content": "orphan result"}]},
            "messages.1.tool_call_id",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(server, extra, param):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
    r = server.post("/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
