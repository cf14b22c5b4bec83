"""Per-iteration time of a batch: a roofline of a GPU spec x a model spec.

A batch is a list of ``(new_tokens, context_tokens)``: each request computes ``new_tokens``
tokens on top of ``context_tokens`` whose KV already exists (a prefill chunk over a cached
prefix, or a decode step with ``new_tokens == 1``). Terms, from the papers:

- linear layers: ``2 * params`` FLOPs per token (Mooncake Eq. 1's ``b*n*d^2``), the LM head
  only for the last token of each request; they read every weight once per iteration
  (for MoE only the experts the batch's tokens touch);
- attention: causal, ``4 * hq * hd`` FLOPs per (query, key) pair per layer (Medha Eq. 1 with
  the causal half), reading the K and V of every context token (Medha Eq. 2);
- tensor parallelism: FLOPs and bytes split over ``tp`` GPUs, plus two ring all-reduces of the
  activations per layer over the GPUs' link;
- a fixed per-iteration overhead (scheduling, kernel launches).

Each operator takes ``max(compute time, memory time)`` (its own roofline), and the iteration
is the sum of the operators. Efficiency factors ``mfu`` / ``mbu`` scale the peaks.

Medha's long-context layouts (``tp x spp x kvp``):

- KV parallelism (``kvp`` groups of ``tp`` GPUs): a request's KV fills one group up to
  ``kvp_rank_tokens`` tokens, then spills to the next; its attention (FLOPs and KV reads)
  splits over the ``r`` groups holding it, the rest of the model does not (Medha Eq. 5/6),
  and every layer all-gathers the partial outputs and log-sum-exps of its query tokens
  across them over the inter-node link;
- sequence pipeline parallelism (``spp`` stages, layers split evenly): a batch's latency
  (``batch_time``) passes every stage plus ``spp - 1`` activation hops between nodes; the
  next batch may enter when this one leaves the first stage (``stage_time``), so a long
  prompt's chunks overlap across stages: ``prefill_time`` of consecutive chunks is their
  stage times plus one pipeline fill (Medha Eq. 4). Each stage holds its layers' weights
  and KV, so the KV capacity grows with both degrees.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from placement.gpus import GPUSpec
from placement.model_specs import ModelSpec

Batch = Sequence[tuple[int, int]]  # (new tokens, context tokens already in KV) per request


class CostModel(Protocol):
    def batch_time(self, batch: Batch) -> float:
        """Seconds one iteration computing ``batch`` takes."""
        ...


@dataclass
class RooflineCostModel:
    model: ModelSpec
    gpu: GPUSpec
    tp: int = 1
    mfu: float = 0.55  # share of peak FLOP/s a large GEMM reaches
    mbu: float = 0.8  # share of peak HBM bandwidth a streaming read reaches
    overhead_s: float = 0.002
    allreduce_latency_s: float = 10e-6
    mem_util: float = 0.9  # share of HBM the KV cache and weights may use
    spp: int = 1  # sequence-pipeline stages
    kvp: int = 1  # KV-parallel groups
    kvp_rank_tokens: int = (
        0  # one request's tokens per KVP group before it spills; 0: a group's capacity
    )
    node_link_bw: float = 50e9  # bytes/s between nodes (SPP activations, KVP partial outputs)
    node_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        if self.tp < 1 or self.spp < 1 or self.kvp < 1:
            raise ValueError("tp, spp and kvp must be >= 1")
        if self.kvp_rank_tokens < 0:
            raise ValueError("kvp_rank_tokens must be >= 0 (0: a group's capacity)")
        m = self.model
        self._compute = self.tp * self.gpu.flops * self.mfu
        self._bandwidth = self.tp * self.gpu.mem_bw * self.mbu
        self._lm_head = m.vocab * m.hidden
        self._body_params = m.active_params - 2 * self._lm_head  # embedding lookup is free
        self._attn_coef = 4 * m.num_layers * m.num_heads * m.head_dim
        self._kv = m.kv_bytes_per_token
        self._weight_bytes = float(m.weight_bytes)
        self._dense_weight_bytes = (
            m.total_params - m.num_layers * m.num_experts * m.expert_params
        ) * m.dtype_bytes
        self._allreduce_cache: dict[int, float] = {}
        self._expert_bytes = (
            m.num_layers * m.expert_params * m.dtype_bytes
        )  # one expert, all layers

    # -- the terms -------------------------------------------------------------------------
    def linear_flops(self, tokens: int, requests: int) -> float:
        return 2.0 * self._body_params * tokens + 2.0 * self._lm_head * requests

    def attention_flops(self, batch: Batch) -> float:
        return self._attn_coef * sum(n * c + n * (n + 1) / 2 for n, c in batch)

    def weight_read_bytes(self, tokens: int) -> float:
        m = self.model
        if not m.is_moe:
            return self._weight_bytes
        touched = m.num_experts * (1.0 - (1.0 - m.top_k / m.num_experts) ** tokens)
        return self._dense_weight_bytes + touched * self._expert_bytes

    def kv_bytes(self, batch: Batch) -> float:
        return float(self._kv * sum(n + c for n, c in batch))

    def allreduce_time(self, tokens: int) -> float:
        if self.tp == 1:
            return 0.0
        m = self.model
        nbytes = tokens * m.hidden * m.dtype_bytes
        per = 2 * (self.tp - 1) / self.tp * nbytes / self.gpu.link_bw + self.allreduce_latency_s
        return 2 * m.num_layers * per

    # -- what the simulator and the Conductor ask ----------------------------------------------
    def batch_time(self, batch: Batch) -> float:
        """Seconds from a batch entering the first stage to its outputs (its latency)."""
        if not batch:
            return 0.0
        if self.spp == 1 and self.kvp == 1:
            # One pass over the batch (this runs once per simulated iteration).
            tokens = pairs = context = 0
            for n, c in batch:
                tokens += n
                pairs += n * c + n * (n + 1) // 2
                context += n + c
            return self.totals_time(tokens, pairs, context, len(batch))
        return self._layout_time(batch, stage=False)

    def stage_time(self, batch: Batch) -> float:
        """Seconds a batch holds the first pipeline stage (with its hop to the next): how
        soon the next batch may enter. ``batch_time`` when ``spp == 1``."""
        if not batch:
            return 0.0
        if self.spp == 1:
            return self.batch_time(batch)
        return self._layout_time(batch, stage=True)

    def kvp_groups(self, tokens: int) -> int:
        """KV-parallel groups holding a request of ``tokens`` tokens."""
        if self.kvp == 1:
            return 1
        limit = self.kvp_rank_tokens or self._group_capacity()
        return min(self.kvp, max(1, -(-tokens // limit)))

    def _layout_time(self, batch: Batch, stage: bool) -> float:
        m = self.model
        tokens = pairs = context = 0
        split_pairs = split_context = 0.0  # attention work, divided over each one's groups
        gather_tokens = 0  # query tokens whose attention spans groups
        for n, c in batch:
            p, k = n * c + n * (n + 1) // 2, n + c
            tokens += n
            pairs += p
            context += k
            r = self.kvp_groups(k)
            split_pairs += p / r
            split_context += k / r
            if r > 1:
                gather_tokens += n
        whole = self.totals_time(tokens, pairs, context, len(batch))
        full_attn = max(
            self._attn_coef * pairs / self._compute, self._kv * context / self._bandwidth
        )
        split_attn = max(
            self._attn_coef * split_pairs / self._compute,
            self._kv * split_context / self._bandwidth,
        )
        layers_time = whole - self.overhead_s - full_attn + split_attn
        hop = self.node_latency_s + tokens * m.hidden * m.dtype_bytes / self.node_link_bw
        gather = 0.0
        if gather_tokens:  # per layer: (out, lse) of each query token from every group
            nbytes = gather_tokens * (m.num_heads * m.head_dim + m.num_heads) * m.dtype_bytes
            per_layer = self.node_latency_s + (self.kvp - 1) * nbytes / self.node_link_bw
            gather = m.num_layers * per_layer
        if stage:
            return self.overhead_s + (layers_time + gather) / self.spp + hop
        return self.overhead_s + layers_time + gather + (self.spp - 1) * hop

    def totals_time(self, tokens: int, pairs: int, context: int, requests: int) -> float:
        """``batch_time`` from the batch's totals: new tokens, causal (query, key) pairs,
        context tokens read (new + cached) and requests."""
        t_linear = max(
            self.linear_flops(tokens, requests) / self._compute,
            self.weight_read_bytes(tokens) / self._bandwidth,
        )
        t_attn = max(self._attn_coef * pairs / self._compute, self._kv * context / self._bandwidth)
        ar = self._allreduce_cache.get(tokens)
        if ar is None:
            ar = self._allreduce_cache[tokens] = self.allreduce_time(tokens)
        return self.overhead_s + t_linear + t_attn + ar

    def prefill_time(
        self, new_tokens: int, cached_tokens: int = 0, chunk: int | None = None
    ) -> float:
        return prefill_time(self, new_tokens, cached_tokens, chunk)

    def decode_time(self, batch_size: int, total_context: int) -> float:
        return decode_time(self, batch_size, total_context)

    def transfer_time(self, num_tokens: int, bandwidth: float, latency_s: float = 0.0) -> float:
        """Moving ``num_tokens`` tokens' KV over a link of ``bandwidth`` bytes/s."""
        if num_tokens <= 0:
            return 0.0
        return latency_s + num_tokens * self._kv / bandwidth

    def _group_capacity(self) -> int:
        """Tokens of KV one KV-parallel group (``tp x spp`` GPUs) holds after the weights:
        each stage holds its share of the layers' weights and of every token's KV."""
        free = self.tp * self.gpu.mem_bytes * self.mem_util - self.model.weight_bytes / self.spp
        if free <= 0:
            raise ValueError(
                f"{self.model.name} does not fit on {self.tp} x {self.gpu.name} per stage"
            )
        return int(free // (self._kv / self.spp))

    def kv_capacity_tokens(self) -> int:
        """Tokens of KV the instance's HBM holds after the weights (every group)."""
        return self.kvp * self._group_capacity()


def prefill_time(
    cost: CostModel, new_tokens: int, cached_tokens: int = 0, chunk: int | None = None
) -> float:
    """One request's prefill alone, in chunks of ``chunk`` tokens (None: one pass)."""
    if new_tokens <= 0:
        return 0.0
    step = chunk or new_tokens
    stage = getattr(cost, "stage_time", None)  # a pipeline: chunks overlap across stages
    t, done, last = 0.0, 0, 0.0
    while done < new_tokens:
        n = min(step, new_tokens - done)
        batch = [(n, cached_tokens + done)]
        last = cost.batch_time(batch)
        t += stage(batch) if stage is not None else last
        done += n
    if stage is not None:  # the last chunk still has to leave the pipeline
        t += last - stage([(n, cached_tokens + done - n)])
    return t


def decode_time(cost: CostModel, batch_size: int, total_context: int) -> float:
    """One decode iteration of ``batch_size`` requests holding ``total_context`` tokens, the
    context spread evenly (every term is linear in per-request context for decode)."""
    if batch_size <= 0:
        return 0.0
    totals = getattr(cost, "totals_time", None)
    if totals is not None:  # the same sums in closed form: each request has n = 1
        return float(
            totals(batch_size, total_context + batch_size, total_context + batch_size, batch_size)
        )
    per, extra = divmod(total_context, batch_size)
    return cost.batch_time([(1, per + 1)] * extra + [(1, per)] * (batch_size - extra))
