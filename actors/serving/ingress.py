"""The OpenAI-compatible HTTP ingress (FastAPI inside a Serve deployment).

Per request: authenticate (optional Bearer keys -> tenant), read and check the raw body
(size, UTF-8, JSON, fields), tokenize (chat template for chat), build each choice's typed
``Request`` once (``RequestBuilder``: the replicas' limits checked, the tenant-salted
chained block hashes computed), ask the router for a ranking, then stream from the chosen
replica, which takes the requests as built. Every failure becomes an OpenAI-shaped JSON
error; nothing a client sends can take the ingress down. Who may call, and how much, is
the ``TenantGate``'s (tenant_gate.py).
"""

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve

from actors.engine.events import Accepted, Delta, Done, Event, Failed
from actors.engine.heap_freeze import freeze_startup_heap
from actors.engine.outputs import RequestOutput
from actors.engine.request_builder import RequestBuilder
from actors.engine.request_limits import RequestLimits
from actors.engine.thread_priority import run_process_at_normal_priority
from actors.serving import openai_protocol as oai
from actors.serving.admin import SleepBody, UpdateWeightsBody, admin_error, require_admin
from actors.serving.config import ServeConfig
from actors.serving.metrics import render
from actors.serving.relay import ReplicaRelay, merge_prompts
from actors.serving.tenant_gate import TenantGate
from actors.serving.tool_calls import ToolPlan, plan_tools, template_messages
from actors.serving.tool_parsers import ToolFormat, ToolStream, detect_format, parse, stream_delta
from actors.serving.weight_updates import VersionWatch
from errors import (
    ContextLengthError,
    EngineUnavailableError,
    InvalidRequestError,
    MeridianError,
    OverloadedError,
)
from models import load_tokenizer, read_model_config, tiny_model_dir
from policies.request import Request, SamplingParams

log = logging.getLogger(__name__)
app = FastAPI(title="Meridian", docs_url=None, redoc_url=None)


class _Prepared:
    """One validated HTTP request: per prompt, the built request of each choice; the
    tool-call family its answers are parsed with (None: no parsing)."""

    def __init__(
        self, req: oai._Sampling, prompts: list[list[Request]], tools: ToolFormat | None
    ) -> None:
        self.req = req
        self.prompts = prompts
        self.n = req.n
        self.tools = tools
        self.reserved = 0  # tokens taken from the key's tokens_per_minute, settled at the end

    def max_tokens(self) -> int:
        """The most tokens the request may use: its largest ``usage.total_tokens``."""
        return sum(
            p[0].num_prompt_tokens + sum(c.params.max_tokens for c in p) for p in self.prompts
        )


@serve.ingress(app)
class Ingress:
    def __init__(
        self,
        config: ServeConfig,
        router: Any,
        replicas: dict[str, Any],
        balancers: dict[str, Any] | None = None,  # region -> its balancer (regions section)
    ) -> None:
        run_process_at_normal_priority()  # nice 0, as RAY_worker_niceness=0 (thread_priority)
        freeze_startup_heap()  # no full collection walks the imports: no pause of ~0.2 s
        self.cfg = config
        import ray

        # where decode replicas send tokens directly (``ReturnListener``)
        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.relay = ReplicaRelay(self.cfg, router, replicas, balancers, host)
        model_dir = Path(self.cfg.model) if self.cfg.model else tiny_model_dir("dense")
        self.tokenizer = load_tokenizer(model_dir)
        self.tool_format = self.cfg.tool_parser or detect_format(self.tokenizer.chat_template)
        positions = read_model_config(model_dir).max_position_embeddings
        self.max_model_len = min(g.engine.context_len(positions) for g in self.cfg.groups)
        self._builder: RequestBuilder | None = None  # from the replicas' limits, on first use
        self.router = router
        self.replicas = replicas
        self.gate = TenantGate(self.cfg)  # keys, rate limits, the pending cap
        self.http_counts: Counter[tuple[str, int]] = Counter()
        self.weights = VersionWatch(router)  # the app's weight version, requests hash at it

    # -- routes -----------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        try:
            snap = await self.router.snapshot.remote()
        except Exception as e:
            return self._error("/health", oai.APIError(503, f"router unavailable: {e}"))
        status = 200 if snap else 503
        return JSONResponse({"status": "ok" if snap else "starting", "replicas": len(snap)}, status)

    @app.get("/regions")
    async def regions(self) -> Response:
        """Each region balancer's counters (a config with a regions section; else empty)."""

        async def one(region: str, balancer: Any) -> dict[str, Any]:
            try:
                return await asyncio.wait_for(balancer.stats.remote(), timeout=2.0)
            except Exception:  # down, or restarting
                return {"region": region, "unreachable": True}

        relay = self.relay
        stats = await asyncio.gather(*(one(r, b) for r, b in relay.balancers.items()))
        failovers = relay.entry.failovers if relay.entry else 0
        return JSONResponse({"regions": list(stats), "failovers": failovers})

    @app.get("/v1/models")
    async def models(self, request: HTTPRequest) -> Response:
        try:
            self.gate.tenant(request)
        except oai.APIError as e:
            return self._error("/v1/models", e)
        card = {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "meridian"}
        card["max_model_len"] = self.max_model_len
        return self._ok("/v1/models", {"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics(self) -> Response:
        view = await self.router.metrics.remote()
        text = render(
            view,
            model_name=self.cfg.model_name,
            http_requests=dict(self.http_counts),
            pending=self.gate.pending,
        )
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(self, request: HTTPRequest) -> Response:
        return await self._serve("/v1/completions", request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self._serve("/v1/chat/completions", request, chat=True)

    @app.post("/admin/update_weights")
    async def admin_update_weights(self, request: HTTPRequest) -> Response:
        """New weights from a path on the server, for an API key with role admin (admin.py)."""

        async def call(raw: Any) -> dict[str, Any]:
            body = UpdateWeightsBody.parse(raw)
            return {"weight_version": await self.update_weights(body.path, body.abort_in_flight)}

        return await self._admin("/admin/update_weights", request, call)

    @app.post("/admin/sleep")
    async def admin_sleep(self, request: HTTPRequest) -> Response:
        """``{"level": 1 | 2}``: every replica frees its KV cache (and weights, 2)."""

        async def call(raw: Any) -> dict[str, Any]:
            return {"freed_bytes": await self.sleep(SleepBody.parse(raw).level)}

        return await self._admin("/admin/sleep", request, call)

    @app.post("/admin/wake_up")
    async def admin_wake_up(self, request: HTTPRequest) -> Response:
        async def call(raw: Any) -> dict[str, Any]:
            await self.wake_up()
            return {"awake": True}

        return await self._admin("/admin/wake_up", request, call)

    async def _admin(
        self, route: str, request: HTTPRequest, call: Callable[[Any], Awaitable[dict[str, Any]]]
    ) -> Response:
        """An admin route: the caller's key must have role admin (admin.py)."""
        try:
            require_admin(self.gate.tenant(request), bool(self.gate.keys))
            h = request.headers
            sized = "content-length" in h or "transfer-encoding" in h
            empty = h.get("content-length") == "0" or not sized
            raw = {} if empty else await self._body(request)  # no body: the defaults
            return self._ok(route, await call(raw))
        except oai.APIError as e:
            return self._error(route, e)
        except MeridianError as e:
            return self._error(route, admin_error(e))

    # -- the Python actor API's entry (LLM.attach(app_name)) --------------------------------
    async def update_weights(self, weights: Any, abort_in_flight: bool = False) -> int:
        """Every replica of the app loads ``weights`` (a path on the server, or a one-item
        list holding an object ref) as the next weight version; returns it once all have
        (the router's log, ``weight_updates.py``). Raises InvalidRequestError (a bad
        tensor; nothing changed), EngineUnavailableError."""
        return await self.weights.update(weights, abort_in_flight)

    async def sleep(self, level: int = 1) -> int:
        """Every replica frees its KV cache (level 1) or also its weights (level 2) once
        its running requests finish; requests sent while asleep wait for ``wake_up``.
        Returns the bytes freed by all, P/D groups' too."""
        return await self.weights.set_sleep(level)

    async def wake_up(self) -> None:
        await self.weights.set_sleep(None)

    async def generate_tokens(
        self,
        token_lists: list[list[int]],
        params: list[SamplingParams],
        api_key: str | None = None,
        region: str | None = None,
    ) -> list[RequestOutput]:
        tenant = self.gate.check_key(api_key)
        salt = tenant.tenant if tenant else None
        for p in params:  # kv_retention_s's bound and store rule hold for this door too
            try:
                self.cfg.session_retention_s(p.kv_retention_s, salt)
            except ValueError as e:
                raise InvalidRequestError(str(e), "kv_retention_s") from None
        builder = await self._request_builder()
        salted = self.weights.salt(salt)
        requests = builder.build_each(token_lists, params, salt=salted, tenant=salt)

        async def one(request: Request) -> RequestOutput:
            outs: list[Any] = [None]
            async for events in self.relay.start([request], None, region):
                for item in events if isinstance(events, list) else ():
                    if isinstance(item, Done):
                        outs[0] = item.output
                    elif isinstance(item, Failed):
                        raise (EngineUnavailableError if item.retriable else MeridianError)(
                            item.message
                        )
            return outs[0]

        try:
            return list(await asyncio.gather(*(one(r) for r in requests)))
        except oai.APIError as e:  # the same kind of error the in-process engine raises
            if e.status == 429:
                retry = e.headers.get("Retry-After")
                raise OverloadedError(e.message, float(retry) if retry else None) from None
            if e.status >= 500:
                raise EngineUnavailableError(e.message) from None
            raise InvalidRequestError(e.message) from None

    # -- the request path --------------------------------------------------------------------
    async def _serve(self, route: str, request: HTTPRequest, chat: bool) -> Response:
        key = None
        try:
            tenant = self.gate.tenant(request)
            key = tenant.key if tenant else None
            self.gate.rate_check(tenant)
            self.gate.admit(tenant)
        except oai.APIError as e:
            return self._error(route, e)
        handed_off = False  # once a stream owns the admission, it releases it
        streams: list[AsyncIterator[Accepted | list[Event]]] = []
        prep: _Prepared | None = None
        used = 0  # tokens the response used (total_tokens); 0 when it failed
        try:
            prep = await self._prepare(request, chat, tenant.tenant if tenant else None)
            prep.reserved = self.gate.reserve(tenant, prep.max_tokens())
            header = request.headers.get(self.cfg.session_header)
            session = prep.req.session_id or header or prep.req.user
            region = request.headers.get("x-meridian-region")
            streams = [self.relay.start(choices, session, region) for choices in prep.prompts]
            # Route and queue every prompt before answering: refusals keep their status.
            for s in streams:
                await anext(s)  # its Accepted (a refusal raises)
            if prep.req.stream:
                body = self._sse(prep, streams, chat, key)
                handed_off = True
                self.http_counts[(route, 200)] += 1
                return StreamingResponse(body, media_type="text/event-stream")
            result = await self._collect(prep, streams, chat)
            used = result["usage"]["total_tokens"]
            return self._ok(route, result)
        except oai.APIError as e:
            return self._error(route, e)
        except Exception as e:  # a replica died mid-request, or a bug: 503, never a crash
            log.exception("request failed")
            return self._error(route, oai.APIError(503, f"request failed: {e}; retry it"))
        finally:
            if not handed_off:
                self.gate.release(key)
                if prep is not None:
                    self.gate.settle(key, prep.reserved, used)
                for s in streams:
                    with contextlib.suppress(Exception):
                        await s.aclose()  # type: ignore[attr-defined]

    async def _prepare(self, request: HTTPRequest, chat: bool, salt: str | None) -> _Prepared:
        raw = await self._body(request)
        model_cls = oai.ChatCompletionRequest if chat else oai.CompletionRequest
        try:
            req = model_cls.model_validate(raw)
        except ValidationError as e:
            raise oai.validation_error(e) from None
        try:  # the turn's KV retention: asked, else the tenant's or the server's default
            retention = self.cfg.session_retention_s(req.kv_retention_s, salt)
        except ValueError as e:
            raise oai.APIError(400, str(e), "kv_retention_s") from None
        req = req.model_copy(update={"kv_retention_s": retention})
        if req.model != self.cfg.model_name:
            raise oai.APIError(
                404,
                f"model {req.model!r} does not exist; this server serves {self.cfg.model_name!r}",
                "model",
                "model_not_found",
            )
        limits = self.cfg.limits
        if req.n > limits.max_n:
            raise oai.APIError(400, f"n must be at most {limits.max_n}, got {req.n}", "n")
        stop = req.stop_list()
        if len(stop) > oai.MAX_STOP_SEQUENCES or any(not s for s in stop):
            raise oai.APIError(400, "stop takes at most 4 non-empty strings", "stop")
        tools: ToolPlan | None = None
        if chat:
            assert isinstance(req, oai.ChatCompletionRequest)
            tools = plan_tools(req, self.tool_format)
            msgs = template_messages(req)
            extra = {"tools": tools.template_tools} if tools is not None else {}
            try:
                text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, **extra)
            except InvalidRequestError as e:
                raise oai.APIError(400, str(e), "messages") from None
            prompts = [self.tokenizer.encode(text, add_special_tokens=False)]
            max_tokens, field, prompt_field = (
                req.max_completion_tokens or req.max_tokens,
                "max_tokens",
                "messages",
            )
        else:
            assert isinstance(req, oai.CompletionRequest)
            prompts = self._completion_prompts(req.prompt)
            max_tokens, field, prompt_field = req.max_tokens, "max_tokens", "prompt"
        if max_tokens is not None and max_tokens > limits.max_tokens:
            raise oai.APIError(
                400, f"max_tokens must be at most {limits.max_tokens}, got {max_tokens}", field
            )
        builder = await self._request_builder()
        room = builder.limits.max_model_len - max(len(p) for p in prompts)
        if max_tokens is None:
            max_tokens = min(limits.default_max_tokens, max(room, 1))
        try:
            params = [req.sampling_params(max_tokens, i) for i in range(req.n)]
        except InvalidRequestError as e:  # a sampling field out of its range
            raise oai.APIError(400, str(e), e.param) from None
        if tools is not None and tools.response_format is not None:  # a required call
            params = [dataclasses.replace(p, response_format=tools.response_format) for p in params]
        built = []
        for tokens in prompts:
            try:
                salted = self.weights.salt(salt)
                built.append(builder.build_choices(tokens, params, salt=salted, tenant=salt))
            except InvalidRequestError as e:  # the prompt, or prompt + max_tokens, too long
                param = field if room >= 1 and isinstance(e, ContextLengthError) else prompt_field
                param = e.param or param  # a sampling field the model cannot take
                message = str(e) if param in str(e) else f"{param}: {e}"
                code = "context_length_exceeded" if isinstance(e, ContextLengthError) else None
                raise oai.APIError(400, message, param, code) from None
        return _Prepared(req, built, tools.fmt if tools is not None else None)

    async def _request_builder(self) -> RequestBuilder:
        """The builder of this ingress's requests: the tightest limits of every replica
        group (a request may be routed to any), asked of one replica of each, once."""
        self.weights.follow()
        if self._builder is None:
            groups = [g.name for g in self.cfg.groups]
            limits = await asyncio.gather(*(self.replicas[g].limits.remote() for g in groups))
            self._builder = RequestBuilder(self.cfg.block_size, RequestLimits.tightest(limits))
        return self._builder

    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise oai.APIError(400, "prompt is empty; send text or token ids", "prompt")
        if all(isinstance(t, int) for t in prompt):
            prompts = [list(prompt)]
        else:
            prompts = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
        for i, p in enumerate(prompts):
            if not p:
                raise oai.APIError(400, f"prompt {i} is empty", "prompt")
        return prompts

    async def _body(self, request: HTTPRequest) -> Any:
        limit = self.cfg.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > limit:
            raise oai.APIError(413, f"the body has {declared} bytes; the limit is {limit}", "body")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise oai.APIError(413, f"the body is over the limit of {limit} bytes", "body")
        try:
            text = bytes(data).decode("utf-8")
        except UnicodeDecodeError as e:
            raise oai.APIError(
                400, f"the body is not valid UTF-8 (byte {e.start})", "body"
            ) from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise oai.APIError(400, f"the body is not valid JSON: {e}", "body") from None
        if not isinstance(raw, dict):
            raise oai.APIError(422, "the body must be a JSON object", "body")
        return raw

    async def _collect(
        self, prep: _Prepared, streams: list[AsyncIterator[Accepted | list[Event]]], chat: bool
    ) -> dict[str, Any]:
        async def drain(s: AsyncIterator[Accepted | list[Event]]) -> list[RequestOutput]:
            outs: list[Any] = [None] * prep.n
            async for events in s:
                for item in events if isinstance(events, list) else ():
                    if isinstance(item, Done):
                        outs[item.index] = item.output
                    elif isinstance(item, Failed):
                        raise oai.APIError(503, f"generation failed: {item.message}")
            return outs

        results = await asyncio.gather(*(drain(s) for s in streams))
        n, want_ids = prep.n, prep.req.return_token_ids
        choices, completion, cached = [], 0, 0
        for pi, outs in enumerate(results):
            cached += outs[0].num_cached_tokens
            for j, out in enumerate(outs):
                completion += len(out.token_ids)
                ids = out.token_ids if want_ids else None
                reason = oai.finish_reason(out.finish_reason)
                lps = self._logprobs(prep, out.logprobs, chat)
                text: str | None = out.text
                calls = None
                if prep.tools is not None:
                    text, calls = parse(prep.tools, out.text)
                    reason = "tool_calls" if calls and reason == "stop" else reason
                choice = oai.choice(pi * n + j, text, reason, chat, ids, lps, calls)
                choices.append(choice)
        prompt_tokens = sum(p[0].num_prompt_tokens for p in prep.prompts)
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        use = oai.usage(prompt_tokens, completion, cached)
        return oai.completion_body(rid, prep.req.model, choices, use, chat)

    async def _sse(
        self,
        prep: _Prepared,
        streams: list[AsyncIterator[Accepted | list[Event]]],
        chat: bool,
        key: str | None,
    ) -> AsyncIterator[str]:
        rid = oai.new_id("chatcmpl" if chat else "cmpl")
        n, want_ids, model = prep.n, prep.req.return_token_ids, prep.req.model
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], use: dict[str, Any] | None = None) -> str:
            body: dict[str, Any] = {"id": rid, "object": obj, "created": 0, "model": model}
            body["choices"] = choices
            if use is not None:
                body["usage"] = use
            return f"data: {json.dumps(body)}\n\n"

        merged = merge_prompts(streams)
        opts = prep.req.stream_options
        per_chunk = opts is not None and opts.usage_per_chunk()
        generated: Counter[int] = Counter()  # per choice: tokens streamed so far
        started: set[int] = set()
        tool_streams: dict[int, ToolStream] = {}  # per choice, when its calls are parsed
        offsets: dict[int, int] = {}  # per choice: text offset of its next logprob token
        completion, cached = 0, 0
        try:
            async for pi, events in merged:
                # One body write per frame the replica sent: one SSE event per delta, one
                # ASGI message (and one proxy hop) per engine step.
                out: list[str] = []
                for item in events:
                    if isinstance(item, Delta):
                        idx, d = pi * n + item.index, item.delta
                        generated[idx] += len(d.token_ids)
                        first = idx not in started
                        reason = oai.finish_reason(d.finish_reason) if d.finished else None
                        text: str | None = d.text
                        calls = None
                        if prep.tools is not None:  # content and call deltas, no markup
                            text, calls, reason = stream_delta(
                                tool_streams, prep.tools, idx, d.text, d.finished, reason
                            )
                        if not (first or text or calls or d.finished or want_ids or d.logprobs):
                            continue  # a token that completes no character yet: nothing to send
                        started.add(idx)
                        ids = d.token_ids if want_ids else None
                        lps = self._logprobs(prep, d.logprobs, chat, offsets, idx)
                        choice = oai.chunk_choice(idx, text, reason, chat, ids, first, lps, calls)
                        use = None
                        if per_chunk:
                            prompt_len = prep.prompts[pi][0].num_prompt_tokens
                            use = oai.usage(prompt_len, generated[idx], None)
                        out.append(chunk([choice], use))
                    elif isinstance(item, Done):
                        completion += len(item.output.token_ids)
                        cached += item.output.num_cached_tokens if item.index == 0 else 0
                    elif isinstance(item, Failed):
                        msg = f"generation failed: {item.message}; retry the request"
                        out.append(f"data: {json.dumps(oai.APIError(503, msg).body())}\n\n")
                if out:
                    yield "".join(out)
            if opts is not None and opts.include_usage:
                prompt_tokens = sum(p[0].num_prompt_tokens for p in prep.prompts)
                yield chunk([], oai.usage(prompt_tokens, completion, cached))
            yield "data: [DONE]\n\n"
        finally:
            self.gate.release(key)
            used = sum(p[0].num_prompt_tokens for p in prep.prompts) + completion
            self.gate.settle(key, prep.reserved, used)
            # a client gone mid-stream: stop relaying, abort on the replicas
            with contextlib.suppress(Exception):
                await merged.aclose()
            for s in streams:
                with contextlib.suppress(Exception):
                    await s.aclose()  # type: ignore[attr-defined]

    def _logprobs(
        self,
        prep: _Prepared,
        lps: list[Any] | None,
        chat: bool,
        offsets: dict[int, int] | None = None,
        idx: int = 0,
    ) -> dict[str, Any] | None:
        """A choice's (or a stream chunk's) logprobs in OpenAI's shape; None when the
        request did not ask for them. ``offsets``: text offsets streamed so far, per choice."""
        if lps is None:
            return None
        as_ids = prep.req.return_tokens_as_token_ids
        if chat:
            return oai.chat_logprobs(lps, self.tokenizer, as_ids)
        start = 0 if offsets is None else offsets.get(idx, 0)
        body = oai.completion_logprobs(lps, self.tokenizer, as_ids, start)
        if offsets is not None and lps:
            offsets[idx] = body["text_offset"][-1] + len(body["tokens"][-1])
        return body

    # -- responses ---------------------------------------------------------------------------
    def _ok(self, route: str, body: dict[str, Any]) -> Response:
        self.http_counts[(route, 200)] += 1
        return JSONResponse(body)

    def _error(self, route: str, e: oai.APIError) -> Response:
        self.http_counts[(route, e.status)] += 1
        return JSONResponse(e.body(), e.status, headers=e.headers)
