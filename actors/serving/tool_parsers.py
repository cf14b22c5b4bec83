"""Tool calls in a model's output, per chat-template family: found, streamed and constrained.

A family is the syntax its chat template teaches the model:

- ``hermes`` (Hermes 2 Pro, Qwen 2.5 / 3): ``<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>``, one block per call; text outside the blocks is content.
- ``llama3_json`` (Llama 3.1 / 3.2): the whole answer is ``{"name": ..., "parameters":
  {...}}`` (calls separated by ``;``); an answer that does not start with ``{`` is content.

``ToolStream`` reads one choice's text as it arrives and returns what a client may see:
content (never the call markup) and OpenAI's ``delta.tool_calls`` entries, the first of a
call carrying its index, id, type and name with empty arguments, then the arguments' text
in fragments. The fragments of a call concatenate to its final ``arguments``. A
non-streamed answer is the same stream read at once (``parse``), so both agree.

``ToolFormat.grammar`` is the Lark grammar (llguidance) that only admits calls of the given
functions, each ``arguments`` value matching that function's JSON schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from actors.engine.structured import json_rule

# The start of a call object whose name is known: the arguments' text follows the match.
_HEADER = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)
_TAIL = re.compile(r"\s*(\}\s*)?$")  # what may close the call object after its arguments


@dataclass(frozen=True)
class Function:
    """One tool the request offers: its name and its arguments' JSON schema."""

    name: str
    parameters: dict[str, Any] | bool


@dataclass(frozen=True)
class ToolFormat:
    """A template family's call syntax. ``start``/``end``: the markers around each call
    (None: the answer itself is the calls, ``separator`` between them)."""

    name: str
    args_key: str
    start: str | None = None
    end: str | None = None
    separator: str = ";"

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        """Lark text admitting one call (``parallel``: one or more) of ``functions``."""
        lines = []
        for i, f in enumerate(functions):
            head = json.dumps(f'{{"name":{json.dumps(f.name)},"{self.args_key}":')
            lines.append(f'fn_{i}: {head} args_{i} "}}"')
            lines.append(f"args_{i}: {json_rule(f.parameters)}")
        calls = " | ".join(f"fn_{i}" for i in range(len(functions)))
        if self.start is not None and self.end is not None:
            block = f"{json.dumps(self.start + chr(10))} call {json.dumps(chr(10) + self.end)}"
            sep = json.dumps("\n")
        else:
            block, sep = "call", json.dumps(self.separator)
        start = f"block ({sep} block)*" if parallel else "block"
        return "\n".join([f"start: {start}", f"block: {block}", f"call: {calls}", *lines])


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "arguments", "<tool_call>", "</tool_call>"),
    "llama3_json": ToolFormat("llama3_json", "parameters"),
}


def detect_format(chat_template: str | None) -> str | None:
    """The family a chat template teaches, when it shows one (None: it shows none)."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "<|start_header_id|>" in chat_template and (
        "<|python_tag|>" in chat_template or '"parameters"' in chat_template
    ):
        return "llama3_json"
    return None


@dataclass
class ToolCallDelta:
    """One ``delta.tool_calls`` entry: the first of a call has ``id`` and ``name``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"arguments": self.arguments}
        d: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            d["id"], d["type"] = self.id, "function"
            fn = {"name": self.name, **fn}
        d["function"] = fn
        return d


@dataclass
class ToolOutput:
    """What one piece of text yields: content and tool-call deltas (either may be empty)."""

    content: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass
class _Call:
    index: int
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    name: str | None = None  # set once the header went out
    args_start: int = 0
    sent: str = ""  # the arguments' text streamed so far


class ToolStream:
    """One choice's output text -> content and tool-call deltas, incrementally.

    Modes: ``text`` (content; a partial start marker is held back), ``call`` (inside a
    call's JSON), and for ``llama3_json`` ``start`` (a call may open here with ``{``) and
    ``after`` (a call ended: a separator, or content). ``_buf`` holds the text not yet
    decided; a call's name goes out once its arguments begin, its arguments up to what
    might still close the call object."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.calls: list[dict[str, Any]] = []  # finished calls, OpenAI's message.tool_calls
        self._buf = ""
        self._mode = "text" if fmt.start is not None else "start"
        self._call: _Call | None = None
        self._ws = ""  # trailing whitespace of the content, held until more content follows
        self._out = ToolOutput()

    @property
    def called(self) -> bool:
        return bool(self.calls) or self._call is not None

    def feed(self, text: str) -> ToolOutput:
        self._buf += text
        self._step(final=False)
        return self._take()

    def finish(self) -> ToolOutput:
        """The end of the text: flush what was held back."""
        self._step(final=True)
        if self._mode == "call":
            self._close(self._buf, unterminated=True)
            self._buf = ""
        else:
            self._content(self._buf)
            self._buf = ""
        if not self.called:
            self._out.content += self._ws
        self._ws = ""
        return self._take()

    # -- the state machine ------------------------------------------------------------------
    def _step(self, final: bool) -> None:
        while True:
            before = (self._mode, len(self._buf))
            if self._mode == "text":
                self._text(final)
            elif self._mode == "start":
                self._start()
            elif self._mode == "call":
                self._in_call()
            elif self._mode == "after":
                self._after()
            if (self._mode, len(self._buf)) == before:
                return

    def _text(self, final: bool) -> None:
        start = self.fmt.start
        if start is None:  # an answer that did not open with a call is all content
            self._content(self._buf)
            self._buf = ""
            return
        i = self._buf.find(start)
        if i >= 0:
            self._content(self._buf[:i])
            self._ws = ""  # whitespace before a call is not content
            self._buf = self._buf[i + len(start) :]
            self._open()
            return
        keep = 0 if final else _partial_suffix(self._buf, start)
        self._content(self._buf[: len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep :]

    def _start(self) -> None:
        """llama3_json: the answer (or what follows a separator) opens a call with ``{``."""
        stripped = self._buf.lstrip()
        if not stripped:
            return
        if stripped.startswith("{"):
            self._buf = stripped
            self._open()
        else:
            self._mode = "text"

    def _in_call(self) -> None:
        assert self._call is not None
        end = self.fmt.end
        if end is not None:
            j = self._buf.find(end)
            if j >= 0:
                self._close(self._buf[:j])
                self._buf, self._mode = self._buf[j + len(end) :], "text"
                return
            self._progress(self._buf[: len(self._buf) - _partial_suffix(self._buf, end)])
            return
        try:
            _, stop = json.JSONDecoder().raw_decode(self._buf)
        except json.JSONDecodeError:
            self._progress(self._buf)
            return
        self._close(self._buf[:stop])
        self._buf, self._mode = self._buf[stop:], "after"

    def _after(self) -> None:
        """llama3_json, after a call: a separator and another call, or content."""
        stripped = self._buf.lstrip()
        if stripped.startswith(self.fmt.separator):
            self._buf, self._mode = stripped[len(self.fmt.separator) :], "start"
        elif stripped:
            self._buf, self._mode = stripped, "text"

    def _open(self) -> None:
        self._call = _Call(len(self.calls))
        self._mode = "call"

    def _progress(self, text: str) -> None:
        """A call's text so far: its header once the name is known, then its arguments up
        to what might still close the call object."""
        call = self._call
        assert call is not None
        if call.name is None:
            m = _HEADER.match(text)
            if m is None:
                return
            call.name, call.args_start = _unescape(m.group(1)), m.end()
            self._out.calls.append(ToolCallDelta(call.index, "", call.id, call.name))
        args = text[call.args_start :]
        tail = _TAIL.search(args)
        self._send_args(call, args[: tail.start() if tail else len(args)])

    def _close(self, text: str, unterminated: bool = False) -> None:
        """A call's whole text: a call when it parses, else content (markup included, as
        the model wrote it) unless its header already went out."""
        call = self._call
        assert call is not None
        self._call = None
        parsed = _parse_call(text, self.fmt.args_key)
        if call.name is None and parsed is None:
            if self.fmt.start is not None:
                text = self.fmt.start + text + ("" if unterminated else str(self.fmt.end))
            self._content(text)
            return
        m = _HEADER.match(text)
        if call.name is None:
            assert parsed is not None
            call.name = parsed[0]
            call.args_start = m.end() if m else -1
            self._out.calls.append(ToolCallDelta(call.index, "", call.id, call.name))
        if call.args_start >= 0:
            args = text[call.args_start :].rstrip()
            if parsed is not None and args.endswith("}"):
                args = args[:-1].rstrip()  # the call object's own closing brace
        else:  # a call whose name did not come first: its arguments re-serialized
            assert parsed is not None
            args = parsed[1] if isinstance(parsed[1], str) else json.dumps(parsed[1])
        self._send_args(call, args)
        function = {"name": call.name, "arguments": call.sent}
        self.calls.append({"id": call.id, "type": "function", "function": function})

    def _send_args(self, call: _Call, args: str) -> None:
        if len(args) > len(call.sent) and args.startswith(call.sent):
            self._out.calls.append(ToolCallDelta(call.index, args[len(call.sent) :]))
            call.sent = args

    def _content(self, text: str) -> None:
        if not text:
            return
        body = text.rstrip()
        if body:
            self._out.content += self._ws + body
            self._ws = text[len(body) :]
        else:
            self._ws += text

    def _take(self) -> ToolOutput:
        out, self._out = self._out, ToolOutput()
        return out


def stream_delta(
    streams: dict[int, ToolStream],
    fmt: ToolFormat,
    idx: int,
    text: str | None,
    finished: bool,
    reason: str | None,
) -> tuple[str | None, list[dict[str, Any]] | None, str | None]:
    """Choice ``idx``'s streamed text read for tool calls (``streams`` holds one
    ``ToolStream`` per choice): its content, its ``delta.tool_calls`` and its finish reason
    (``tool_calls`` when it called)."""
    stream = streams.setdefault(idx, ToolStream(fmt))
    got = stream.feed(text or "")
    if finished:
        rest = stream.finish()
        got.content += rest.content
        got.calls += rest.calls
        reason = "tool_calls" if stream.calls and reason == "stop" else reason
    calls = [c.as_dict() for c in got.calls] or None
    return got.content or None, calls, reason


def parse(fmt: ToolFormat, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole answer: its content (None when it only calls) and its calls."""
    stream = ToolStream(fmt)
    content = stream.feed(text).content + stream.finish().content
    if stream.calls and not content.strip():
        return None, stream.calls
    return content, stream.calls


def _parse_call(text: str, args_key: str) -> tuple[str, Any] | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return obj["name"], args


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _unescape(name: str) -> str:
    try:
        return str(json.loads(f'"{name}"'))
    except json.JSONDecodeError:
        return name
