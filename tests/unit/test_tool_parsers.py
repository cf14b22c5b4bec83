"""Tool calls without a server: parsing and streaming per template family, the grammar of a
required call (run token by token through llguidance on the tiny tokenizer), request checks
(each a 400 naming its field) and rendering through a Hermes-style chat template."""

from __future__ import annotations

import json
import random

import pytest
from tool_template import HERMES_TEMPLATE, hermes_model_dir

from actors.engine.structured import GrammarCompiler
from actors.serving import openai_protocol as oai
from actors.serving.config import ConfigError, ServeConfig
from actors.serving.tool_calls import plan_tools, template_messages
from actors.serving.tool_parsers import FORMATS, Function, ToolStream, detect_format, parse
from models import load_tokenizer, tiny_model_dir

HERMES, LLAMA3 = FORMATS["hermes"], FORMATS["llama3_json"]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "noop"}},
]
HERMES_ANSWER = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": {"n": [1, "}"]}}}'
    '\n</tool_call>\n<tool_call>\n{"name":"noop","arguments":{}}\n</tool_call>'
)


def stream(fmt, text: str, sizes: list[int]):
    """Feed ``text`` in pieces of the given sizes (cycled); every output, then finish's."""
    s, outs, i, k = ToolStream(fmt), [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        outs.append(s.feed(text[i : i + n]))
        i, k = i + n, k + 1
    outs.append(s.finish())
    return s, outs


def assemble(outs):
    """OpenAI clients' reassembly of streamed content and ``delta.tool_calls``."""
    content, calls = "", {}
    for out in outs:
        content += out.content
        for d in (c.as_dict() for c in out.calls):
            if "id" in d:
                assert d["index"] not in calls and d["function"]["arguments"] == ""
                assert d["type"] == "function" and d["id"].startswith("call_")
                calls[d["index"]] = {"id": d["id"], "name": d["function"]["name"], "args": ""}
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["args"] += d["function"]["arguments"]
    return content, [calls[i] for i in sorted(calls)]


def test_hermes_answer_parses_into_content_and_calls():
    content, calls = parse(HERMES, HERMES_ANSWER)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
    args = json.loads(calls[0]["function"]["arguments"])
    assert args == {"city": "Paris", "days": {"n": [1, "}"]}}
    assert calls[1]["function"]["arguments"] == "{}"
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("sizes", [[1], [2, 3], [7], [1000], [5, 1, 13]])
def test_streamed_calls_reassemble_to_the_parsed_answer_without_markup(sizes):
    s, outs = stream(HERMES, HERMES_ANSWER, sizes)
    content, calls = assemble(outs)
    assert content == "Let me check."
    assert "<tool" not in content and "</" not in content
    assert [(c["id"], c["name"], c["args"]) for c in calls] == [
        (c["id"], c["function"]["name"], c["function"]["arguments"]) for c in s.calls
    ]
    assert json.loads(calls[0]["args"]) == {"city": "Paris", "days": {"n": [1, "}"]}}
    if sizes == [1]:  # the name goes out before the arguments are complete
        first_args = next(i for i, o in enumerate(outs) if o.calls and o.calls[0].id is None)
        header = next(i for i, o in enumerate(outs) if o.calls and o.calls[0].id is not None)
        assert header <= first_args < len(outs) - 10


def test_random_chunking_agrees_with_parse():
    rng = random.Random(0)
    _, expected = parse(HERMES, HERMES_ANSWER)
    for _ in range(20):
        _, outs = stream(HERMES, HERMES_ANSWER, [rng.randint(1, 9) for _ in range(30)])
        content, calls = assemble(outs)
        assert content == "Let me check."
        assert [c["args"] for c in calls] == [c["function"]["arguments"] for c in expected]


def test_text_without_calls_is_content_and_a_partial_marker_is_held_then_released():
    assert parse(HERMES, "no calls <tool") == ("no calls <tool", [])
    s = ToolStream(HERMES)
    assert s.feed("a <tool").content == "a"  # "<tool" might open a call: held
    assert s.feed("box> b").content == " <toolbox> b"


def test_malformed_call_stays_content():
    text = "<tool_call>\nnot json\n</tool_call> after"
    assert parse(HERMES, text) == (text, [])


def test_truncated_call_keeps_what_was_streamed():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    content, calls = parse(HERMES, text)
    assert content is None
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}


def test_llama3_json_calls_and_plain_answers():
    text = (
        ' {"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}; '
        '{"name": "noop", "parameters": {}}'
    )
    content, calls = parse(LLAMA3, text)
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "noop"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "days": 2}
    _, outs = stream(LLAMA3, text, [1])
    assert [c["args"] for c in assemble(outs)[1]] == [c["function"]["arguments"] for c in calls]
    assert parse(LLAMA3, 'It is {"a": 1}') == ('It is {"a": 1}', [])


def test_format_detection_from_templates():
    assert detect_format(HERMES_TEMPLATE) == "hermes"
    llama = '<|start_header_id|>assistant<|end_header_id|>{"name": x, "parameters": y}<|eot_id|>'
    assert detect_format(llama) == "llama3_json"
    assert detect_format(load_tokenizer(tiny_model_dir("dense")).chat_template) is None
    assert detect_format(None) is None


# -- the grammar of a required call ---------------------------------------------------------
@pytest.fixture(scope="module")
def grammars():
    tok = load_tokenizer(tiny_model_dir("dense"))
    return tok, GrammarCompiler(tok.backend_json(), tok.vocab_size, list(tok.eos_token_ids))


def accepts(grammars, grammar: str, text: str) -> bool:
    tok, compiler = grammars
    state = compiler.state({"type": "grammar", "grammar": grammar})
    ids = tok.encode(text, add_special_tokens=False)
    if not all(state.accept(t) for t in ids):
        return False
    eos = tok.eos_token_ids[0]  # the answer may end here: done, or EOS allowed next
    return state.done or bool(state.allowed()[eos // 8] >> (eos % 8) & 1)


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3])
def test_grammar_admits_calls_of_declared_functions_with_valid_arguments(grammars, fmt):
    functions = [Function("get_weather", WEATHER), Function("noop", {"type": "object"})]
    key = fmt.args_key

    def call(name: str, args: str) -> str:
        body = f'{{"name":"{name}","{key}":{args}}}'
        return f"<tool_call>\n{body}\n</tool_call>" if fmt is HERMES else body

    one = fmt.grammar(functions, parallel=False)
    good = call("get_weather", '{"city":"Rome","days":3}')
    assert accepts(grammars, one, good)
    assert accepts(grammars, one, call("noop", "{}"))
    assert not accepts(grammars, one, call("get_weather", '{"city":"Oslo","days":3}'))
    assert not accepts(grammars, one, call("get_weather", '{"city":"Rome","days":9}'))
    assert not accepts(grammars, one, call("other", "{}"))
    joined = ("\n" if fmt is HERMES else ";").join([good, call("noop", "{}")])
    assert not accepts(grammars, one, joined)
    assert accepts(grammars, fmt.grammar(functions, parallel=True), joined)


# -- request checks and rendering -----------------------------------------------------------
CHAT = {"model": "m", "messages": [{"role": "user", "content": "weather?"}]}


def plan(body, fmt="hermes"):
    try:
        return plan_tools(oai.ChatCompletionRequest.model_validate(body), fmt)
    except oai.ValidationError as e:
        raise oai.validation_error(e) from None


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function"}]}, "tools.0.function"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name"),
        (
            {"tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": 3}}]},
            "tools.1.function.parameters",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools.0.function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"type": "frob"}}},
                        },
                    }
                ]
            },
            "tools.0.function.parameters",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools.2.function.name"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "noop"}}}, "tool_choice"),
        (
            {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "1"}]},
            "messages.1.tool_call_id",
        ),
        (
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]},
            "messages.0.tool_call_id",
        ),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{oops"},
                            }
                        ],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(extra, param):
    with pytest.raises(oai.APIError) as err:
        plan({**CHAT, **extra})
    assert err.value.status == 400, err.value.message
    assert err.value.param == param, err.value.message
    assert param.split(".")[-1] in err.value.message


def test_tools_without_a_known_format_are_refused_unless_choice_is_none():
    with pytest.raises(oai.APIError) as err:
        plan({**CHAT, "tools": TOOLS}, fmt=None)
    assert err.value.status == 400 and err.value.param == "tools"
    none = plan({**CHAT, "tools": TOOLS, "tool_choice": "none"}, fmt=None)
    assert none is not None and none.fmt is None and len(none.template_tools) == 2


def test_plans_per_tool_choice():
    auto = plan({**CHAT, "tools": TOOLS})
    assert auto.fmt is HERMES and auto.response_format is None
    named = {"type": "function", "function": {"name": "noop"}}
    one = plan({**CHAT, "tools": TOOLS, "tool_choice": named})
    assert one.response_format["type"] == "grammar"
    assert "noop" in one.response_format["grammar"]
    assert "get_weather" not in one.response_format["grammar"]
    assert plan(CHAT) is None and plan({**CHAT, "tool_choice": "none"}) is None


def test_a_tool_round_trip_renders_through_the_chat_template(tmp_path):
    folder = hermes_model_dir(tmp_path / "m")
    tok = load_tokenizer(folder)
    body = {
        **CHAT,
        "tools": TOOLS,
        "messages": [
            {"role": "user", "content": "weather in Rome?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": '{"city": "Rome", "days": 1}',
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24C"},
        ],
    }
    req = oai.ChatCompletionRequest.model_validate(body)
    tools = plan_tools(req, "hermes")
    text = tok.apply_chat_template(template_messages(req), tools=tools.template_tools)
    assert '"name": "get_weather"' in text and '"parameters": {"type": "object"' in text
    args = '{"city": "Rome", "days": 1}'
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    assert call in text
    assert "<tool_response>\nsunny, 24C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    import transformers  # the reference renders the same

    theirs = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        template_messages(req),
        tools=tools.template_tools,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == theirs


def test_tool_parser_config_is_typed():
    assert ServeConfig.parse({"tool_parser": "llama3_json"}).tool_parser == "llama3_json"
    assert ServeConfig.parse({}).tool_parser is None
    with pytest.raises(ConfigError, match="tool_parser"):
        ServeConfig.parse({"tool_parser": "xml"})
