"""A prefill replica of a disaggregated deployment (plain class; ``PDCluster`` makes it a
Ray actor).

It runs a ``ReplicaController`` whose requests stop after their first token: each computes
its prompt (chunked like any prefill, reusing a cached prefix), streams every layer's KV
into the blocks its decode replica reserved (``actors.disagg.kv_stream``) and samples the first
token. Around that, the KV store:

- before a request runs, the longest prefix the store holds beyond what this replica's
  own prefix cache has is loaded straight into free cache blocks (one copy out of the
  store shard's segment, from DRAM or promoted from SSD) and published in the local prefix
  cache, so the scheduler's ordinary prefix match picks it up; a dead shard reads as a miss;
- after the step that completes a prompt, its full blocks that no shard holds yet are
  written to the store shard on this node (a dead shard drops out of the map).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from actors.disagg.kv_stream import KVCaches, KVDestination, LayerStreamer, StreamingExecutor
from actors.engine.replica_controller import ReplicaController
from actors.engine.sampling import SamplingParams
from actors.engine.step_plan import StepPlan
from actors.kvstore.shard import KVStoreClient, current_node_id
from store.hashing import chained_block_hashes
from store.kv_store_errors import KVStoreError
from store.transfer import TransferEngine


@dataclasses.dataclass
class _Meta:
    tokens: list[int]
    hashes: list[int]  # chained hashes of the prompt's full blocks
    store_shard: str | None  # where its new blocks are written (the Conductor's choice)


class PrefillReplica:
    def __init__(
        self,
        replica_id: str,
        model_dir: str | None = None,
        store_shards: dict[str, Any] | None = None,
        **controller_options: Any,
    ) -> None:
        self.replica_id = replica_id
        self.controller = ReplicaController(model_dir, **controller_options)
        c = self.controller
        if c.layout.world_size != 1:
            raise ValueError("a prefill replica runs one in-process worker (tp=spp=kvp=1)")
        self.block_size = c.block_size
        self.node_id = current_node_id()
        self.engine = TransferEngine(f"prefill-{replica_id}", self.node_id)
        self.streamer = LayerStreamer(self.engine, self.block_size)
        c.executor = StreamingExecutor(c.executor, self.streamer, self._after_step)
        self.client: KVStoreClient | None = None
        if store_shards:
            self.client = KVStoreClient(f"prefill-{replica_id}", node_id=self.node_id)
            for shard_id, handle in store_shards.items():
                self.client.add_shard(shard_id, handle)
        self._meta: dict[str, _Meta] = {}
        self.loaded_blocks = 0  # blocks brought in from the store
        self.stored_blocks = 0  # blocks written to the store
        # Measurements for the Conductor's cost model, drained by each ``step`` report:
        # (chunks (new tokens, context tokens) of a step, seconds) and (blocks loaded, s).
        self._prefill_samples: list[tuple[list[tuple[int, int]], float]] = []
        self._transfer_samples: list[tuple[int, float]] = []
        self._step_chunks: list[tuple[int, int]] = []
        self._step_end = 0.0

    @property
    def kv_caches(self) -> KVCaches:
        caches: KVCaches = self.controller.executor.inner.worker.kv_caches  # type: ignore[attr-defined]
        return caches

    def ping(self) -> str:
        return self.replica_id

    def node(self) -> str:
        return self.node_id

    # -- requests -------------------------------------------------------------------------
    def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        dest: KVDestination,
        salt: str | None = None,
        store_shard: str | None = None,
    ) -> int:
        """Queue a request's prefill; returns the prefix blocks loaded from the store. Its
        new full blocks go to ``store_shard`` (default: a shard on this node)."""
        tokens = list(prompt_token_ids)
        hashes = chained_block_hashes(tokens, self.block_size, salt)
        self._meta[request_id] = _Meta(tokens, hashes, store_shard)
        loaded = self._load_prefix(request_id, tokens, hashes)
        first = dataclasses.replace(params, max_tokens=1, seed=seed, stop=[])
        self.streamer.expect(request_id, dest)
        self.controller.add_request(tokens, first, request_id, salt=salt)
        return loaded

    def step(self) -> dict[str, Any]:
        """One iteration. ``done``: (request id, first token, cached prompt tokens) of the
        requests whose KV has fully arrived at their decode replica; ``failed``: (request
        id, why) of those whose stream broke (their decode side is gone)."""
        deltas = []
        if self.controller.has_unfinished():
            self._step_chunks = []
            start = time.perf_counter()
            deltas = self.controller.step()
            if self._step_chunks:
                self._prefill_samples.append((self._step_chunks, self._step_end - start))
        done, failed = [], []
        for d in deltas:
            if not d.finished:
                continue
            out = self.controller.release(d.request_id)
            why = self.streamer.failed.get(d.request_id)
            if why is None:
                done.append((d.request_id, out.token_ids[0], out.num_cached_tokens))
            else:
                failed.append((d.request_id, why))
            self._forget(d.request_id)
        for rid, why in list(self.streamer.failed.items()):  # still running: stop it
            if rid in self._meta:
                self.controller.abort(rid)
                self.controller.release(rid)
                failed.append((rid, why))
                self._forget(rid)
        costs = {"prefill_steps": self._prefill_samples, "transfers": self._transfer_samples}
        self._prefill_samples, self._transfer_samples = [], []
        return {"done": done, "failed": failed, "stats": self.stats(), "costs": costs}

    def abort(self, request_id: str) -> None:
        if request_id in self._meta:
            self.controller.abort(request_id)
            self.controller.release(request_id)
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._meta.pop(request_id, None)
        self.streamer.forget(request_id)

    # -- the KV store -----------------------------------------------------------------------
    def _load_prefix(self, request_id: str, tokens: list[int], hashes: list[int]) -> int:
        client = self.client
        pool = self.controller.pool
        bs = self.block_size
        usable = hashes[: (len(tokens) - 1) // bs]  # the last token is always computed
        held: list[int] = []
        for i, h in enumerate(usable):
            block = pool.lookup(h, tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            held.append(block)
        rest = usable[len(held) :]
        if client is None or not rest:
            return 0
        client.refresh()
        if not client.directory.holders(rest[0]):
            return 0
        for b in held:  # keep the local prefix from being evicted by the allocation
            pool.acquire(b)
        want = min(len(rest), pool.num_free - len(held))
        blocks = pool.allocate(want) if want > 0 else []
        n = 0
        try:
            if blocks:
                start = time.perf_counter()
                n = client.load_into_cache(request_id, rest[:want], self.kv_caches, blocks)
                self._transfer_samples.append((n, time.perf_counter() - start))
        except KVStoreError:
            n = 0  # a broken transfer: recompute
        finally:
            k = len(held)
            for i in range(n):
                pool.register(blocks[i], rest[i], tokens[(k + i) * bs : (k + i + 1) * bs])
            pool.release(blocks[::-1] + held[::-1])
        self.loaded_blocks += n
        return n

    def _store_shard(self, wanted: str | None = None) -> str | None:
        """``wanted`` if it is live, else a live shard on this node, else any."""
        client = self.client
        if client is None or not client.endpoints:
            return None
        if wanted in client.endpoints:
            return wanted
        local = [s for s, ep in client.endpoints.items() if ep.node_id == self.node_id]
        return sorted(local or client.endpoints)[0]

    def export_blocks(
        self, prompt_token_ids: list[int], salt: str | None, wanted: list[int], shard_id: str
    ) -> int:
        """Write the blocks of a prompt whose hashes are in ``wanted`` from this replica's
        prefix cache to a store shard (replication); returns blocks written. Blocks no
        longer cached here are skipped."""
        client = self.client
        if client is None or shard_id not in client.endpoints:
            return 0
        bs, pool, want = self.block_size, self.controller.pool, set(wanted)
        tokens = list(prompt_token_ids)
        hashes = chained_block_hashes(tokens, bs, salt)
        picked: list[tuple[int, int, int | None]] = []  # (hash, block id, parent hash)
        for i, h in enumerate(hashes):
            if h not in want:
                continue
            block = pool.lookup(h, tokens[i * bs : (i + 1) * bs])
            if block is not None:
                picked.append((h, block, hashes[i - 1] if i else None))
        if not picked:
            return 0
        try:
            stored = client.store_from_cache(
                shard_id,
                [h for h, _, _ in picked],
                self.kv_caches,
                [b for _, b, _ in picked],
                [p for _, _, p in picked],
            )
        except KVStoreError:
            client.mark_dead(shard_id)
            return 0
        self.stored_blocks += len(stored)
        return len(stored)

    def _after_step(self, plan: StepPlan, kv_caches: KVCaches) -> None:
        """The step's compute and KV stream are done (timed here); write new blocks back."""
        self._step_end = time.perf_counter()
        self._step_chunks = [(len(e.token_ids), e.start) for e in plan.entries]
        self._store_new_blocks(plan, kv_caches)

    def _store_new_blocks(self, plan: StepPlan, kv_caches: KVCaches) -> None:
        client = self.client
        if client is None:
            return
        for e in plan.entries:
            meta = self._meta.get(e.request_id)
            if e.sample is None or meta is None:
                continue  # the prompt is not complete yet
            hashes = meta.hashes
            blocks = e.shards[0][2][: len(hashes)]
            todo = [i for i, h in enumerate(hashes) if not client.directory.holders(h)]
            while todo:
                shard = self._store_shard(meta.store_shard)
                if shard is None:
                    return
                i0 = todo[0]
                parents: list[int | None] = [hashes[i0 - 1] if i0 else None, *hashes[i0:-1]]
                try:
                    stored = client.store_from_cache(
                        shard, hashes[i0:], kv_caches, blocks[i0:], parents
                    )
                except KVStoreError:
                    client.mark_dead(shard)
                    continue
                self.stored_blocks += len(stored)
                if shard in client.endpoints:
                    break  # written (or the shard is full): done with this request

    # -- observation ----------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        c = self.controller
        return {
            "queued_tokens": c.scheduler.queued_prefill_tokens(),
            "queued_requests": c.scheduler.num_waiting + c.scheduler.num_running,
            "pool_events": c.pool.drain_events(),
            "loaded_blocks": self.loaded_blocks,
            "stored_blocks": self.stored_blocks,
            "bytes_streamed": self.streamer.bytes_sent,
            "layers_streamed": self.streamer.layers_sent,
            "backends": self.engine.chosen_backends(),  # decode endpoint -> shm / tcp
        }

    def check_blocks(self) -> int:
        """Blocks in use (0 when idle), after the pool's integrity check."""
        self.controller.pool.check_integrity()
        return self.controller.pool.num_in_use

    def drop_local_cache(self) -> int:
        """Forget this replica's own cached prefixes (so a hit must come from the store)."""
        return self.controller.pool.evict_all_cached()

    def crash_after_layers(self, layers: int) -> None:
        """Fault injection for tests: exit the process after streaming ``layers`` more
        layers of KV (mid-stream)."""
        self.streamer.crash_after_layers = self.streamer.layers_sent + layers

    def shutdown(self) -> None:
        self.controller.shutdown()
        if self.client is not None:
            self.client.close()
        self.engine.close()
