"""The replica controller: one model replica's scheduler, block tables and requests.

Each ``step`` is schedule -> run -> postprocess. The controller runs with the parts that
``actors.engine.controller_builder`` wires (``ReplicaController.build``). It takes requests
as built at the edge (``RequestBuilder``: validated and hashed once), owns their
detokenizers, builds each iteration's compact plan and hands it to its executor: in
process for a single worker, or worker actors on Ray driven through a compiled graph for a
``tp x spp x kvp`` layout. With pipeline stages it keeps up to ``spp`` steps in flight.
When a worker dies, it rebuilds the worker group and recomputes the KV of every running
request from its tokens, so no request is lost and no token changes.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from actors.engine.config import EngineConfig
from actors.engine.controller_builder import ControllerParts, build_parts
from actors.engine.detokenizer import IncrementalDetokenizer
from actors.engine.executor import Executor, WorkerFailure
from actors.engine.kv_cache import KVCache
from actors.engine.outputs import RequestOutput, StreamDelta, TokenLogprob
from actors.engine.request_builder import RequestBuilder
from actors.engine.request_limits import RequestLimits
from actors.engine.step_plan import PlanEntry, StepPlan, StepResult
from actors.engine.structured import GrammarCompiler, GrammarState
from actors.engine.worker_hooks import HooksFactory, WorkerHooks
from errors import InvalidRequestError
from models.config import ModelConfig
from models.loader import expected_tensors
from models.weight_update import checked_weights, is_object_ref
from policies.request import Request, SampleSpec
from policies.scheduler import ScheduledStep
from policies.sequence import FinishReason, Sequence
from store.hashing import extend_block_hashes
from store.kv_manager import KVCacheManager


@dataclass
class _Request:
    request: Request
    seq: Sequence
    detok: IncrementalDetokenizer
    kv_dest: Any = None  # where its KV is streamed as it is computed (a prefill replica's)
    logprobs: list[TokenLogprob] | None = None  # one per output token, when asked for
    grammar: GrammarState | None = None  # its response_format's state, when it has one
    prompt_set: tuple[int, ...] = ()  # distinct prompt ids, for a repetition penalty


class ReplicaController:
    def __init__(self, parts: ControllerParts) -> None:
        """Run with ``parts`` built by ``build_parts`` (or ``ReplicaController.build``)."""
        self.engine_config = parts.engine_config
        self.model_dir = parts.model_dir
        self.layout = parts.layout
        self.device = parts.device
        self.dtype = parts.dtype
        self.config: ModelConfig = parts.model_config
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.block_size = parts.engine_config.block_size
        self.num_blocks = parts.num_blocks  # per KV rank
        self.kv: KVCache = parts.kv
        self._one_rank_kv = parts.one_rank_kv
        self.scheduler = parts.scheduler
        self.predictor = parts.predictor
        self.worker_spec = parts.worker_spec
        self.executor: Executor = parts.executor
        self.eos_token_ids = parts.eos_token_ids
        self._grammar_compiler: GrammarCompiler | None = None  # on first use
        self._requests: dict[str, _Request] = {}
        self._reserved: dict[str, _Request] = {}  # KV reserved, prompt computed elsewhere
        self._step_ids = itertools.count()
        self._inflight: deque[tuple[ScheduledStep, object]] = deque()
        # overlap_steps: the step submitted ahead (not yet advanced), run by the next call
        self.overlap = parts.engine_config.overlap_steps
        self._ahead: tuple[ScheduledStep, object] | None = None
        self.num_recoveries = 0
        # True while a lost worker group is brought up again (read by other threads: the
        # replica's reporter tells the router, which routes to a warm spare meanwhile)
        self.recovering = False
        self.step_timings: list[tuple[int, list[tuple[int, float, float]]]] = []
        self.record_timings = False
        self.hook_reports: list[Any] = []  # the workers' step-hook reports, until taken
        self.weight_version = 0  # weight updates applied since load
        self.asleep = False  # sleep() freed the KV cache (and maybe the weights)
        self._expected: dict[str, tuple[int, ...]] | None = None  # expected_tensors()
        # ready before the first update: its meta build imports torch._dynamo (~1 s)
        threading.Thread(target=self._warm_expected, daemon=True, name="meridian-ex").start()

    @classmethod
    def build(
        cls,
        model_dir: str | Path | None = None,
        config: EngineConfig | None = None,
        executor: Executor | None = None,
        worker_hooks: WorkerHooks | HooksFactory | None = None,
        **options: Any,
    ) -> Self:
        """A controller over ``build_parts(model_dir, config, executor, worker_hooks,
        **options)``: ``config`` or keyword ``options`` (``EngineConfig`` fields)."""
        return cls(build_parts(model_dir, config, executor, worker_hooks, **options))

    # -- requests ---------------------------------------------------------------------------
    @property
    def limits(self) -> RequestLimits:
        """What a request must fit to run here; an edge ``RequestBuilder`` checks them."""
        return RequestLimits(self.config.vocab_size, self.max_model_len, self.kv.max_tokens)

    @property
    def one_rank_kv(self) -> KVCacheManager:
        """The KV manager of a one-rank replica (``kvp=1``), with its operations on blocks
        outside any request table (a P/D replica's loads into its prefix cache).
        Raises ValueError on a KV-parallel replica."""
        if self._one_rank_kv is None:
            raise ValueError(f"this replica's KV spans {self.kv.kvp} ranks, not one")
        return self._one_rank_kv

    def request_builder(self) -> RequestBuilder:
        """A builder of requests for this replica (its block size and limits)."""
        return RequestBuilder(self.block_size, self.limits)

    def add_request(self, request: Request, kv_dest: Any = None) -> str:
        """Queue ``request`` (built by a ``RequestBuilder``: not validated or hashed again).
        ``kv_dest``: stream its KV there as it is computed (``PlanEntry.kv_dest``)."""
        r = self._new_request(request)
        r.kv_dest = kv_dest
        self._requests[request.request_id] = r
        self.scheduler.add(r.seq)
        return request.request_id

    def _new_request(self, request: Request) -> _Request:
        """The request's sequence and detokenizer; not yet scheduled. After a weight update
        its ``r.request`` carries the weight version in its salt (``_at_weight_version``)."""
        if self.asleep:
            raise InvalidRequestError("the engine is asleep; call wake_up() first")
        request = self._at_weight_version(request)
        rid = request.request_id
        if rid in self._requests or rid in self._reserved:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        if request.block_size != self.block_size:  # its hashes would not match our blocks
            raise InvalidRequestError(
                f"request {rid!r} was hashed in blocks of {request.block_size} tokens; "
                f"this replica's blocks hold {self.block_size}"
            )
        params = request.params
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        seq = Sequence.from_request(request, stop_ids)
        assert isinstance(params.stop, list)
        r = _Request(request, seq, IncrementalDetokenizer(self.tokenizer, params.stop))
        if params.logprobs is not None:
            r.logprobs = []
        if params.response_format is not None:
            r.grammar = self._grammars().state(params.response_format)
        if params.repetition_penalty != 1.0:
            r.prompt_set = tuple(sorted(set(request.prompt_token_ids)))
        return r

    def _at_weight_version(self, request: Request) -> Request:
        """Invariant: KV computed with one version of the weights is found only by requests
        of that version (``RequestBuilder.at_weight_version``)."""
        return RequestBuilder.at_weight_version(request, self.weight_version)

    def _grammars(self) -> GrammarCompiler:
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer.backend_json(), self.config.vocab_size, sorted(self.eos_token_ids)
            )
        return self._grammar_compiler

    # -- disaggregated decode: requests whose prompt KV is computed elsewhere ----------------
    def reserve_prefilled(self, request: Request) -> list[int] | None:
        """Reserve KV blocks for a request's whole life (prompt + max_tokens) and return
        their ids in token order (block i holds tokens ``[i * bs, (i + 1) * bs)``; on a
        KV-parallel replica over its shards, ``kv.shards`` says each one's rank), or None
        if they are not free now. The request is not scheduled until ``admit_prefilled``:
        a prefill replica writes its prompt KV into these blocks first."""
        r = self._new_request(request)
        if not self.kv.allocate(r.seq, request.num_prompt_tokens + request.params.max_tokens):
            self.kv.free(r.seq)
            return None
        self._reserved[request.request_id] = r
        return [b for _, _, ids in self.kv.shards(request.request_id) for b in ids]

    def cancel_reservation(self, request_id: str) -> bool:
        """Free a reservation whose prefill will not deliver (its prefill replica died)."""
        r = self._reserved.pop(request_id, None)
        if r is None:
            return False
        self.kv.free(r.seq)
        return True

    def admit_prefilled(
        self, request_id: str, first_token: int, first_logprob: TokenLogprob | None = None
    ) -> StreamDelta:
        """Every prompt block of a reservation holds its KV and ``first_token`` was sampled
        from the prompt's last position: the request joins the decode batch (as if this
        replica had computed the prompt) and ``first_token`` goes through the same
        postprocessing as a sampled token (stop tokens, stop strings, max_tokens)."""
        r = self._reserved.pop(request_id)
        seq = r.seq
        seq.num_computed_tokens = seq.num_prompt_tokens
        self._requests[request_id] = r
        now = time.monotonic()
        self.scheduler.add_running(seq, now)
        admitted = ScheduledStep([(seq, 0)], [seq.num_computed_tokens])
        logprobs = {request_id: first_logprob} if first_logprob is not None else {}
        result = StepResult(-1, {request_id: first_token}, logprobs=logprobs)
        (delta,) = self._postprocess(admitted, result)
        return delta

    def block_table(self, request_id: str) -> list[int]:
        """A copy of a request's block ids (KV-parallel replicas: ``[]``)."""
        if self.kv.kvp > 1:
            return []
        return list(self.kv.block_table(request_id))

    def computed_full_blocks(
        self, request_id: str, table: list[int] | None = None
    ) -> tuple[list[int], list[int]]:
        """``(chained hashes, block ids)`` of a request's full blocks whose KV is computed
        (prompt blocks a decode replica received count), block 0 first; ``([], [])`` for an
        unknown request or a KV-parallel replica. Lets a decode replica write them back.
        ``table``: the request's block ids taken before the step that finished it (which
        freed them; their KV stays intact until the next step allocates)."""
        r = self._requests.get(request_id)
        if r is None or self.kv.kvp > 1:
            return [], []
        seq, bs = r.seq, self.block_size
        table = table if table is not None else self.kv.block_table(request_id)
        full = min(seq.num_computed_tokens // bs, len(table))
        extend_block_hashes(seq.block_hashes, seq.token_ids[: full * bs], bs, seq.salt)
        return list(seq.block_hashes[:full]), list(table[:full])

    def abort(self, request_id: str) -> None:
        self.scheduler.finish(request_id, FinishReason.ABORT, time.monotonic())
        self._drop_idle_ahead()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._inflight) or self._ahead is not None

    def request_ids(self) -> list[str]:
        """Every request added and not yet released, and every reservation."""
        return [*self._requests, *self._reserved]

    def has_request(self, request_id: str) -> bool:
        """Added and not yet released (reservations are not requests yet)."""
        return request_id in self._requests

    def output(self, request_id: str) -> RequestOutput:
        r = self._requests[request_id]
        s = r.seq
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=s.prompt_token_ids,
            token_ids=list(s.output_token_ids),
            text=r.detok.text,
            finished=s.is_finished,
            finish_reason=s.finish_reason.value if s.finish_reason else None,
            num_cached_tokens=s.num_cached_tokens,
            arrival_time=s.arrival_time,
            first_token_time=s.first_token_time,
            finish_time=s.finish_time,
            logprobs=None if r.logprobs is None else list(r.logprobs),
        )

    def release(self, request_id: str) -> RequestOutput:
        """The final output of a finished request, forgetting its state."""
        out = self.output(request_id)
        if out.finished:
            del self._requests[request_id]
        return out

    # -- one iteration ---------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Run one iteration; returns a delta for every request that produced a token.

        Fills the pipeline (up to ``executor.depth`` steps in flight), then completes the
        oldest step.
        """
        if self.overlap:
            return self._overlapped_step()
        began = time.monotonic()
        while len(self._inflight) < self.executor.depth:
            scheduled = self.scheduler.schedule(time.monotonic())
            if scheduled.is_empty:
                break
            handle = self.executor.submit(self._plan(scheduled))
            self._inflight.append((scheduled, handle))
        if not self._inflight:
            return []
        scheduled, handle = self._inflight.popleft()
        try:
            result = self.executor.result(handle)
        except WorkerFailure:
            self._recover()
            return []
        self._observe(scheduled, result, began)
        return self._postprocess(scheduled, result)

    def _overlapped_step(self) -> list[StreamDelta]:
        """``overlap_steps``: one step, with the next one scheduled, planned and submitted
        before this one's tokens are read back. Its requests' newest tokens are the
        scheduler's placeholders until then; the worker feeds the values to the next step on
        the device (``actors/engine/token_feed.py``). A step whose requests' next sampling
        needs a token's value (penalties, a grammar) is read back first, as in ``step``.
        Same tokens as ``step``: a request that stops on this step's token (a stop string,
        a stop token) has at most one more token computed in the step ahead, discarded."""
        began = time.monotonic()
        if self._ahead is None:
            scheduled = self.scheduler.schedule(began)
            if scheduled.is_empty:
                return []
            handle = self.executor.submit(self._plan(scheduled))
        else:
            (scheduled, handle), self._ahead = self._ahead, None
        advanced = self.scheduler.advance(scheduled, time.monotonic())
        if all(self._feedable(seq) for seq in advanced):
            ahead = self.scheduler.schedule(time.monotonic())
            if not ahead.is_empty:
                self._ahead = (ahead, self.executor.submit(self._plan(ahead)))
        result = self.executor.result(handle)
        self._observe(scheduled, result, began)
        deltas = self._postprocess(scheduled, result, advanced)
        self._drop_idle_ahead()
        return deltas

    def _drop_idle_ahead(self) -> None:
        """The step ahead holds only requests that ended since it was submitted (a stop
        string, an abort): let it complete, discarding its tokens, so no step is left
        pending with nothing to do."""
        if self._ahead is None:
            return
        scheduled, handle = self._ahead
        if all(seq.is_finished for seq, _ in scheduled.entries):
            self._ahead = None
            self.executor.result(handle)
            self.scheduler.advance(scheduled, time.monotonic())  # their tokens in flight

    def _feedable(self, seq: Sequence) -> bool:
        """The request's next token can be planned before the value of its newest one is
        known: its sample spec does not depend on it (finished ones plan nothing)."""
        r = self._requests.get(seq.request_id)
        if r is None or seq.is_finished:
            return True
        return r.grammar is None and not r.request.params.penalized and r.kv_dest is None

    def _observe(self, scheduled: ScheduledStep, result: StepResult, began: float) -> None:
        """A step's measured time to the predictor, its timings and hook reports kept."""
        seconds = self._step_seconds(result, began)
        if self.predictor is not None and seconds is not None:
            batch = [
                (n, at) for (_, n), at in zip(scheduled.entries, scheduled.starts, strict=True)
            ]
            self.predictor.observe(batch, seconds)
        if self.record_timings:
            self.step_timings.append((result.step_id, result.timings))
        self.hook_reports += result.hook_reports

    def _step_seconds(self, result: StepResult, began: float) -> float | None:
        """The measured time of one step, what the runtime predictor fits ``batch_time`` to.

        One step in flight: it ran from ``began`` (its scheduling included) to now. Pipelined
        (``depth > 1``, SPP): steps overlap, so the wall time from submit to result counts
        other steps' stages; the step's time is its own stages' compute, summed over the
        stages (``StepResult.compute_seconds``). Invariant: for one batch both measure the
        whole model's pass over it (SPP splits the layers, not the work), so the fitted
        model means the same with or without SPP. A decode is in at most one step in
        flight, so its next token comes no sooner than its step's last stage ends: with
        the stages overlapping (one device each) its time between tokens is about this
        measure; where they share cores it approaches ``spp`` times it. None: a pipelined
        step that reported no stage timings (not measured)."""
        if self.executor.depth == 1:
            return time.monotonic() - began
        return result.compute_seconds() if result.timings else None

    def take_hook_reports(self) -> list[Any]:
        """The workers' step-hook reports since the last take (``StepHook.end_step``)."""
        reports, self.hook_reports = self.hook_reports, []
        return reports

    def _plan(self, scheduled: ScheduledStep) -> StepPlan:
        plan = StepPlan(next(self._step_ids), keep_tokens=self.overlap)
        bs = self.block_size
        flags = scheduled.sample_flags()
        for (seq, n), start, samples in zip(
            scheduled.entries, scheduled.starts, flags, strict=True
        ):
            end = start + n
            shards = [
                (rank, first, blocks[: -(-(end - first) // bs)])
                for rank, first, blocks in self.kv.shards(seq.request_id)
                if first < end
            ]
            spec = None
            r = self._requests[seq.request_id]
            if samples:
                spec = self._sample_spec(r)
            entry = PlanEntry(seq.request_id, start, seq.token_ids[start:end], shards, spec)
            if r.kv_dest is not None:
                entry.kv_dest = r.kv_dest
                entry.stream_from_block = 0 if start <= seq.num_cached_tokens else start // bs
            plan.entries.append(entry)
        return plan

    def _sample_spec(self, r: _Request) -> SampleSpec:
        """The spec of the request's next token, with what its history decides: counts of
        its generated tokens (penalties), the stop ids ``min_tokens`` still forbids, and
        its grammar's allowed tokens. Workers keep no per-request state."""
        params, seq = r.request.params, r.seq
        index = len(seq.output_token_ids)
        context: dict[str, Any] = {}
        if params.penalized and seq.output_token_ids:
            context["output_counts"] = tuple(sorted(Counter(seq.output_token_ids).items()))
        if r.prompt_set:
            context["prompt_tokens"] = r.prompt_set
        if index < params.min_tokens and seq.stop_token_ids:
            context["suppress"] = tuple(sorted(seq.stop_token_ids))
        if r.grammar is not None:
            context["allowed"] = r.grammar.allowed()
        return params.spec(r.request.seed, index, **context)

    def _postprocess(
        self,
        scheduled: ScheduledStep,
        result: StepResult,
        advanced: list[Sequence] | None = None,
    ) -> list[StreamDelta]:
        """The step's tokens into its requests (``advanced``: the scheduler's ``advance``
        of it is done; only those requests' tokens count), and their stream deltas."""
        now = time.monotonic()
        if advanced is None:
            self.scheduler.update(scheduled, result.tokens, now)
            sampled = result.tokens
        else:
            self.scheduler.settle(advanced, result.tokens, now)
            sampled = {s.request_id: result.tokens[s.request_id] for s in advanced}
        deltas = []
        for rid, token in sampled.items():
            r = self._requests.get(rid)
            if r is None:
                continue
            logprob = result.logprobs.get(rid)
            if r.logprobs is not None and logprob is not None:
                r.logprobs.append(logprob)
            if r.grammar is not None and not r.seq.is_finished:
                if not r.grammar.accept(token) or r.grammar.done:
                    self.scheduler.finish(rid, FinishReason.STOP, now)  # the document is done
            check_stop = len(r.seq.output_token_ids) >= r.request.params.min_tokens
            text = r.detok.add([token], final=r.seq.is_finished, check_stop=check_stop)
            if r.detok.stopped:
                if r.seq.is_finished:  # the stop string completed on the last allowed token
                    r.seq.stopped_on_last_token()
                else:
                    self.scheduler.finish(rid, FinishReason.STOP, now)
            deltas.append(
                StreamDelta(
                    rid,
                    [token],
                    text,
                    r.seq.is_finished,
                    r.seq.finish_reason.value if r.seq.finish_reason else None,
                    None if logprob is None or r.logprobs is None else [logprob],
                )
            )
        return deltas

    def _recover(self) -> None:
        """A worker died: drop the steps in flight, bring up a fresh worker group, forget
        every cached prefix (its KV is gone) and recompute the running requests."""
        self._inflight.clear()
        self._ahead = None
        self.recovering = True
        try:
            self.executor.restart()
        finally:
            self.recovering = False
        self.scheduler.recompute_all()
        self.kv.evict_all_cached()
        self.num_recoveries += 1

    # -- weights and memory between rollout phases --------------------------------------------
    def update_weights(self, weights: Any, version: int | None = None) -> int:
        """Load new weights into every worker (``models.weight_update.read_weights``'
        sources; all of the model's tensors or some), between steps, with no request held:
        the caller drains or aborts them first. Refuses (InvalidRequestError, nothing
        changed) a tensor the model lacks, of another shape or not floating-point. Every
        cached prefix is forgotten and later requests hash with the new version
        (``version``, as a disaggregated cluster numbers it; default: one more). Returns
        the bytes received."""
        if self.has_unfinished() or self._reserved:
            raise RuntimeError("requests are running; drain or abort them before the update")
        update = getattr(self.executor, "update_weights", None)
        if update is None:
            raise InvalidRequestError(f"{type(self.executor).__name__} cannot update weights")
        tensors = checked_weights(self.expected_tensors(), weights)
        received = sum(t.numel() * t.element_size() for t in tensors.values())
        if isinstance(weights, Mapping):  # a trainer's live tensors: keep a snapshot
            tensors = {n: t.detach().clone() for n, t in tensors.items()}
        source = weights if is_object_ref(weights) else tensors
        del tensors  # an object ref's tensors: the workers read the store's copy
        update(source)
        self.kv.evict_all_cached()
        self.weight_version = self.weight_version + 1 if version is None else version
        return received

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """Every Hugging Face tensor name of this model, with its shape."""
        if self._expected is None:
            self._expected = expected_tensors(self.model_dir)
        return self._expected

    def _warm_expected(self) -> None:
        with contextlib.suppress(Exception):  # raised to the update that needs it
            self.expected_tensors()

    def sleep(self, level: int = 1) -> int:
        """Free the KV cache (level 1), and the weights too (level 2), with no request
        held; ``wake_up`` restores them. Returns the bytes freed."""
        if self.has_unfinished() or self._reserved:
            raise RuntimeError("requests are running; drain or abort them before sleeping")
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level}")
        sleep = getattr(self.executor, "sleep", None)
        if sleep is None:
            raise InvalidRequestError(f"{type(self.executor).__name__} cannot sleep")
        self.kv.evict_all_cached()  # their KV is freed
        freed = int(sleep(level))
        self.asleep = True
        return freed

    def wake_up(self) -> None:
        """Bring back what ``sleep`` freed; the KV cache starts empty."""
        if self.asleep:
            self.executor.wake_up()  # type: ignore[attr-defined]  # sleep() checked it has one
            self.asleep = False

    def on_idle(self) -> None:
        """Call when no request is left: idle compiled-graph workers stop polling (each would
        spin a core); the graph is compiled again on the next step."""
        if not self.has_unfinished():
            self.executor.on_idle()

    def check_workers(self) -> bool:
        """Idle and awake: a worker group with a dead worker is brought up again now, not at
        the next request (an idle replica, a warm standby, would otherwise hold a broken
        group until it is given work). True when it restarted the group."""
        alive = getattr(self.executor, "alive", None)
        if alive is None or self.has_unfinished() or self.asleep or alive():
            return False
        self._recover()
        return True

    def shutdown(self) -> None:
        """Stop the workers; requests still running are aborted."""
        for rid in list(self._requests):
            self.abort(rid)
        for rid in list(self._reserved):
            self.cancel_reservation(rid)
        self._inflight.clear()
        self._ahead = None
        self.executor.shutdown()
