"""Structured output (``response_format``) through llguidance, on CPU.

``grammar_of(response_format)`` turns an OpenAI ``response_format`` into an llguidance
grammar and checks it: the edge (``RequestBuilder``) calls it, so an invalid JSON schema is
a 400 naming ``response_format`` before anything runs. Besides OpenAI's types, an internal
``{"type": "grammar", "grammar": <lark>}`` carries a Lark grammar whose JSON parts are
``json_rule(schema)`` (tool calls: ``actors/serving/tool_parsers.py`` wraps each function's
arguments schema in its template family's call syntax). JSON is generated compactly (no
whitespace between tokens, ``,`` and ``:`` separators), as vLLM does with
``disable_any_whitespace``: a free whitespace rule lets a weak model emit blanks forever.

Grammar state is per request and lives with the replica controller, which owns the
request's tokens (``GrammarState``): it computes the allowed-token bitmask of the next
token into the step plan's ``SampleSpec.allowed`` and advances on each accepted token, so
the sampling worker stays stateless and a recomputed, preempted or disaggregated request
(its first token sampled on a prefill replica) follows the same grammar.
"""

from __future__ import annotations

import json
from typing import Any

from errors import InvalidRequestError

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # pragma: no cover - a declared dependency
        raise InvalidRequestError(
            "response_format needs the llguidance package, which this server lacks",
            "response_format",
        ) from None
    return llguidance


def json_rule(schema: dict[str, Any] | bool) -> str:
    """A Lark rule body matching one compact JSON value of ``schema`` (its own root, so
    its ``$ref``s resolve against it)."""
    return "%json " + json.dumps({**_as_object(schema), "x-guidance": _JSON_OPTIONS})


def schema_error(schema: Any) -> str | None:
    """Why ``schema`` is not a JSON schema llguidance can compile (None: it is)."""
    if not isinstance(schema, dict | bool):
        return f"a JSON schema is an object, got {type(schema).__name__}"
    ll = _llguidance()
    try:
        grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS)
    except Exception as e:  # the Rust side raises ValueError / plain Exception
        return str(e)
    error = ll.LLMatcher.validate_grammar(grammar)
    return error if error and not error.startswith("WARNING") else None


def _as_object(schema: dict[str, Any] | bool) -> dict[str, Any]:
    if schema is True:
        return {}
    if schema is False:
        return {"not": {}}
    return schema


def grammar_of(response_format: dict[str, Any]) -> str:
    """The llguidance grammar of a ``json_object`` / ``json_schema`` / ``grammar``
    response format; InvalidRequestError (param ``response_format``) if it is malformed or
    unsupported."""
    ll = _llguidance()
    kind = response_format.get("type")
    if kind == "grammar":
        lark = response_format.get("grammar")
        if not isinstance(lark, str):
            raise InvalidRequestError(
                'response_format: grammar needs {"grammar": "<lark text>"}', "response_format"
            )
        grammar = ll.LLMatcher.grammar_from_lark(lark)
        error = ll.LLMatcher.validate_grammar(grammar)
        if error and not error.startswith("WARNING"):
            raise InvalidRequestError(
                f"response_format: invalid grammar: {error}", "response_format"
            )
        return str(grammar)
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict | bool):
            raise InvalidRequestError(
                'response_format: json_schema needs {"json_schema": {"name": ..., '
                '"schema": {...}}}',
                "response_format",
            )
        schema = spec["schema"]
    else:
        raise InvalidRequestError(
            f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
            "response_format",
        )
    error = schema_error(schema)
    if error is not None:
        raise InvalidRequestError(
            f"response_format: invalid JSON schema: {error}", "response_format"
        )
    return str(ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_JSON_OPTIONS))


class GrammarCompiler:
    """One replica's llguidance tokenizer (built once, on the first structured request)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        ll = _llguidance()
        self._tokenizer = ll.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        self.vocab_size = vocab_size

    def state(self, response_format: dict[str, Any]) -> GrammarState:
        ll = _llguidance()
        matcher = ll.LLMatcher(self._tokenizer, grammar_of(response_format), log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"response_format: {matcher.get_error()}", "response_format")
        return GrammarState(matcher)


class GrammarState:
    """The grammar of one request: which tokens may come next, advanced token by token."""

    def __init__(self, matcher: Any) -> None:
        self._m = matcher

    def allowed(self) -> bytes:
        """The next token's bitmask (``SampleSpec.allowed``)."""
        return bytes(self._m.compute_bitmask())

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False when the grammar is done or broken (then
        the request ends: nothing more may follow)."""
        if self._m.is_stopped() or self._m.is_error():
            return False
        self._m.consume_token(token_id)
        return not self._m.is_error()

    @property
    def done(self) -> bool:
        """The grammar accepts nothing more (the document is complete)."""
        return bool(self._m.is_stopped())
