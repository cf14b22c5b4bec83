"""The replica controller: one model replica's scheduler, block tables and requests.

Each ``step`` is schedule -> run -> postprocess. The engine validates requests, owns their
sampling state and detokenizers, and reports per-step deltas for streaming.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from actors.detokenizer import IncrementalDetokenizer
from actors.model_runner import ModelRunner
from actors.outputs import RequestOutput, StreamDelta
from actors.sampling import SamplingParams, sample
from errors import ContextLengthError, InvalidRequestError
from kernels.cpu_linear import can_pack, pack_linears
from kernels.kv_cache import allocate_kv_cache
from models import load_model, load_tokenizer, tiny_model_dir
from models.config import ModelConfig
from policies.chunking import ChunkRule, FixedChunk
from policies.ordering import Ordering
from policies.scheduler import Scheduler, SchedulerConfig
from policies.sequence import FinishReason, Sequence
from store.block_pool import BlockPool
from store.kv_manager import KVCacheManager


@dataclass
class _Request:
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator
    detok: IncrementalDetokenizer


class ReplicaController:
    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: str | None = None,
        attention_backend: str | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        kv_cache_memory: int = 1 << 30,
        token_budget: int = 2048,
        max_num_seqs: int = 256,
        chunk_size: int | None = None,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        ordering: Ordering | None = None,
        chunk_rule: ChunkRule | None = None,
        pack_weights: bool | None = None,
    ) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else tiny_model_dir("dense")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        on_gpu = self.device.type == "cuda"
        self.dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
        backend = attention_backend or ("flashinfer" if on_gpu else "torch")
        self.model = load_model(self.model_dir, self.dtype, self.device, backend)
        if pack_weights if pack_weights is not None else can_pack(self.model):
            pack_linears(self.model)  # fp32 CPU: oneDNN-prepacked weights, same arithmetic
        self.config: ModelConfig = self.model.config
        self.tokenizer = load_tokenizer(self.model_dir)
        self.max_model_len = min(
            max_model_len or self.config.max_position_embeddings,
            self.config.max_position_embeddings,
        )
        self.block_size = block_size
        cfg = self.config
        bytes_per_block = (
            2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim
        ) * torch.tensor([], dtype=self.dtype).element_size()
        if num_blocks is None:
            # Enough for every running request at full context, within the memory budget.
            wanted = max_num_seqs * -(-self.max_model_len // block_size)
            num_blocks = max(1, min(wanted, kv_cache_memory // bytes_per_block))
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.dtype,
            self.device,
        )
        self.pool = BlockPool(num_blocks, block_size)
        self.kv = KVCacheManager(self.pool, enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(token_budget, max_num_seqs),
            self.kv,
            ordering=ordering,
            chunk_rule=chunk_rule or FixedChunk(chunk_size),
        )
        self.runner = ModelRunner(self.model, self.kv_caches, block_size, self.device)
        self.eos_token_ids = frozenset(
            t for t in (cfg.eos_token_ids or [self.tokenizer.eos_token_id]) if t is not None
        )
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()

    # -- requests ---------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError (a 400) if this request can never run here."""
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty; send at least one token")
        vocab = self.config.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"token ids must be integers in [0, {vocab}); got {bad[:5]!r}"
            )
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ContextLengthError(
                f"the prompt has {n} tokens but the model's context is {self.max_model_len}; "
                "shorten the prompt"
            )
        if n + params.max_tokens > self.max_model_len:
            raise ContextLengthError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the context "
                f"of {self.max_model_len}; set max_tokens <= {self.max_model_len - n}"
            )
        if -(-(n + params.max_tokens) // self.block_size) > self.num_blocks:
            raise ContextLengthError(
                f"prompt + max_tokens needs more KV blocks than this replica has "
                f"({self.num_blocks} of {self.block_size} tokens); lower max_tokens"
            )

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        salt: str | None = None,
    ) -> str:
        self.validate(prompt_token_ids, params)
        request_id = request_id or self.new_request_id()
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        seq = Sequence(
            request_id,
            list(prompt_token_ids),
            params.max_tokens,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            stop_token_ids=stop_ids,
            salt=salt,
        )
        assert isinstance(params.stop, list)
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        self._requests[request_id] = _Request(seq, params, params.make_generator(), detok)
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        self.scheduler.finish(request_id, FinishReason.ABORT, time.monotonic())

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

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
        )

    def release(self, request_id: str) -> RequestOutput:
        """The final output of a finished request, forgetting its state."""
        out = self.output(request_id)
        if out.finished:
            del self._requests[request_id]
        return out

    # -- one iteration ----------------------------------------------------------------------
    def step(self) -> list[StreamDelta]:
        """Run one iteration; returns a delta for every request that produced a token."""
        step = self.scheduler.schedule(time.monotonic())
        if step.is_empty:
            return []
        tables = {s.request_id: self.kv.block_table(s.request_id) for s, _ in step.entries}
        samplers, logits = self.runner.run(step, tables)
        reqs = [self._requests[s.request_id] for s in samplers]
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        now = time.monotonic()
        sampled = {s.request_id: t for s, t in zip(samplers, tokens, strict=True)}
        self.scheduler.update(step, sampled, now)
        deltas = []
        for r, token in zip(reqs, tokens, strict=True):
            text = r.detok.add([token], final=r.seq.is_finished)
            if r.detok.stopped:
                if r.seq.is_finished:  # the stop string completed on the last allowed token
                    r.seq.finish_reason = FinishReason.STOP
                else:
                    self.scheduler.finish(r.seq.request_id, FinishReason.STOP, now)
            deltas.append(
                StreamDelta(
                    r.seq.request_id,
                    [token],
                    text,
                    r.seq.is_finished,
                    r.seq.finish_reason.value if r.seq.finish_reason else None,
                )
            )
        return deltas
