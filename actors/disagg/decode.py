"""A decode replica of a disaggregated deployment (plain class; ``PDCluster`` makes it a
Ray actor).

Its worker's paged KV cache lives in a shared-memory segment (``SharedKVCache``) so a
prefill replica writes a request's KV straight into the blocks reserved for it here. A
request goes through three states:

    reserve(...) -> KVDestination | None   blocks for its whole life (prompt + max_tokens)
    admit(request_id, first_token)         all prompt KV arrived: joins the decode batch
    cancel(request_id)                     its prefill died: the reservation is freed

Reserving the whole life up front means a decoding request is never preempted here (the
Conductor only picks an instance with that much room).
"""

from __future__ import annotations

import time
from typing import Any

from actors.disagg.kv_stream import KVDestination, SharedKVCache
from actors.engine.outputs import StreamDelta
from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from actors.kvstore.shard import current_node_id


class DecodeReplica:
    def __init__(
        self,
        replica_id: str,
        model_dir: str | None = None,
        serve_tcp: bool = False,
        tcp_host: str = "127.0.0.1",
        **controller_options: Any,
    ) -> None:
        """``serve_tcp``: prefill replicas on other nodes stream KV in over TCP to
        ``tcp_host`` (this node's address); same-node ones always use shared memory."""
        self.replica_id = replica_id
        self.controller = ReplicaController(model_dir, **controller_options)
        c = self.controller
        if c.layout.world_size != 1:
            raise ValueError("a decode replica runs one in-process worker (tp=spp=kvp=1)")
        worker = c.executor.worker  # type: ignore[attr-defined]
        shard = worker.shard
        self.cache = SharedKVCache(
            f"decode-{replica_id}",
            current_node_id(),
            shard.num_layers,
            c.num_blocks,
            c.block_size,
            shard.num_kv_heads,
            shard.config.head_dim,
            c.dtype,
            serve_tcp=serve_tcp,
            tcp_host=tcp_host,
        )
        self.cache.install(worker)
        self._reserved_blocks: dict[str, int] = {}

    def ping(self) -> str:
        return self.replica_id

    def node(self) -> str:
        return self.cache.endpoint.node_id

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.controller.validate(prompt_token_ids, params)

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        salt: str | None = None,
    ) -> KVDestination | None:
        blocks = self.controller.reserve_prefilled(
            prompt_token_ids, params, request_id, seed, salt=salt
        )
        if blocks is None:
            return None
        self._reserved_blocks[request_id] = len(blocks)
        return self.cache.destination(blocks)

    def cancel(self, request_id: str) -> bool:
        self._reserved_blocks.pop(request_id, None)
        return self.controller.cancel_reservation(request_id)

    def admit(self, request_id: str, first_token: int) -> dict[str, Any]:
        self._reserved_blocks.pop(request_id, None)
        delta = self.controller.admit_prefilled(request_id, first_token)
        return self._report([delta])

    def step(self) -> dict[str, Any]:
        """One decode iteration; ``costs["decode_steps"]`` is its (batch size, context
        blocks, seconds), for the Conductor's TBT model."""
        c = self.controller
        if not c.has_unfinished():
            return self._report([])
        batch = c.scheduler.num_running
        blocks = c.pool.num_in_use - sum(self._reserved_blocks.values())
        start = time.perf_counter()
        deltas = c.step()
        return self._report(deltas, [(batch, blocks, time.perf_counter() - start)])

    def _report(
        self, deltas: list[StreamDelta], samples: list[tuple[int, int, float]] | None = None
    ) -> dict[str, Any]:
        finished = [self.controller.release(d.request_id) for d in deltas if d.finished]
        costs = {"decode_steps": samples or []}
        return {"deltas": deltas, "finished": finished, "stats": self.stats(), "costs": costs}

    def abort(self, request_id: str) -> None:
        """Drop a reserved or decoding request and free its blocks (unknown ids: no-op)."""
        if not self.cancel(request_id) and self.controller.has_request(request_id):
            self.controller.abort(request_id)
            self.controller.release(request_id)

    def stats(self) -> dict[str, Any]:
        c = self.controller
        reserved = sum(self._reserved_blocks.values())
        return {
            "num_running": c.scheduler.num_running,
            "used_blocks": c.pool.num_in_use - reserved,
            "pending": len(self._reserved_blocks),
            "pending_blocks": reserved,
            "total_blocks": c.num_blocks,
        }

    def check_blocks(self) -> int:
        """Blocks in use (0 when idle), after the pool's integrity check."""
        self.controller.pool.check_integrity()
        return self.controller.pool.num_in_use

    def shutdown(self) -> None:
        self.controller.shutdown()
        self.cache.close()
