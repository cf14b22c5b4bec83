"""A chat request's tools at the edge: checked, rendered through the chat template, and
turned into what its answer needs (the grammar that constrains it, the parser that reads it).

``tool_choice``:
- ``none``: the tools are rendered (the model sees them) but no call is parsed;
- ``auto`` (the default with tools): unconstrained, calls parsed from the answer;
- ``required``: the answer is one or more calls (one with ``parallel_tool_calls: false``),
  each of a declared function with arguments valid for its schema (an llguidance grammar);
- a named function: the same, with that function only.

Every refusal is an ``APIError`` 400 naming its field (``tools.1.function.parameters``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from actors.engine.structured import schema_error
from actors.serving.openai_protocol import APIError, ChatCompletionRequest, NamedToolChoice
from actors.serving.tool_parsers import FORMATS, Function, ToolFormat

_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """``template_tools``: the ``tools`` the chat template renders; ``fmt``: the family the
    answer is parsed with (None: not parsed); ``response_format``: the grammar of a
    required or named call (None: unconstrained)."""

    template_tools: list[dict[str, Any]]
    fmt: ToolFormat | None
    response_format: dict[str, Any] | None


def plan_tools(req: ChatCompletionRequest, format_name: str | None) -> ToolPlan | None:
    """The request's tool plan (None: it has no tools). ``format_name``: the server's tool
    call family (configured, or detected from the chat template; None: unknown)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools: declare the functions", "tool_choice")
        return None
    functions: list[Function] = []
    for i, tool in enumerate(req.tools):
        fn = tool.function
        assert fn is not None and fn.name is not None  # the model's validators ensure it
        if any(f.name == fn.name for f in functions):
            raise APIError(
                400,
                f"tools declare the function name {fn.name!r} twice",
                f"tools.{i}.function.name",
            )
        params = _NO_ARGUMENTS if fn.parameters is None else fn.parameters
        error = schema_error(params)
        if error is not None:
            field = f"tools.{i}.function.parameters"
            raise APIError(400, f"{field} is not a valid JSON schema: {error}", field)
        functions.append(Function(fn.name, params))
    rendered = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice == "none":
        return ToolPlan(rendered, None, None)
    if format_name is None:
        raise APIError(
            400,
            "tools: this model's chat template shows no tool-call format this server reads "
            f"({', '.join(FORMATS)}); the server's tool_parser setting names one",
            "tools",
        )
    fmt = FORMATS[format_name]
    if choice in (None, "auto"):
        return ToolPlan(rendered, fmt, None)
    if isinstance(choice, NamedToolChoice):
        wanted = choice.function.name
        functions = [f for f in functions if f.name == wanted]
        if not functions:
            raise APIError(
                400, f"tool_choice names {wanted!r}, which tools do not declare", "tool_choice"
            )
    if req.response_format is not None and req.response_format.type != "text":
        raise APIError(
            400,
            "response_format cannot be combined with a required or named tool_choice",
            "response_format",
        )
    parallel = req.parallel_tool_calls is not False
    grammar = {"type": "grammar", "grammar": fmt.grammar(functions, parallel)}
    return ToolPlan(rendered, fmt, grammar)


def template_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as chat templates take them (transformers' shape): an assistant's
    ``tool_calls`` with their arguments as objects, a tool message's ``tool_call_id``."""
    messages = []
    for m in req.messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": json.loads(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
        messages.append(msg)
    return messages
