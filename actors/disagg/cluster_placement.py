"""How ``PDCluster`` places one request (or its next attempt after a fault).

1. The choice of (prefill replica, decode replica): Mooncake's Conductor
   (``policies.conductor``: lowest predicted TTFT, then lowest TBT with room, or a 429 by
   the SLOs), or with ``scheduler="dualpath"`` DualPath's rules
   (``actors.disagg.dualpath_placement``, which call ``policies.dualpath.schedule``).
2. The decode replica reserves the request's lifetime KV blocks (a stale view that finds
   no room there is a 429; a dead decode replica is replaced and the request retried).
3. Blocks the Conductor wants on the chosen prefill replica are copied into its home
   shard (``transfer_from``, ``replicate_blocks``); the views take the decision
   (``apply_decision``) before the replicas' next reports.
4. The side that reads the stored prefix (``ReadPaths``: a fixed mode, the shorter read
   queue, or DualPath's choice), then the prefill task is queued on the prefill replica.

Invariant: an accepted attempt is bound to its key in the ``RequestTable`` and has its
reservation on the decode replica before its prefill task is queued. A replica found dead
here is handed to ``Recovery`` (it replaces the replica and queues its requests again).
"""

from __future__ import annotations

import dataclasses
import time

import ray

from actors.disagg.cluster_faults import Recovery
from actors.disagg.conductor import RequestRejected
from actors.disagg.dualpath_placement import DualPathPlacer
from actors.disagg.messages import PrefillTask
from actors.disagg.pd_request import PDRequest
from actors.disagg.read_paths import ReadPaths
from actors.disagg.remote_decode import RemoteDecode
from actors.disagg.replica_set import ReplicaSet, call_replica
from actors.disagg.request_table import RequestTable
from actors.disagg.store_view import DEAD, PDStore
from policies.conductor import Conductor, ConductorRequest, apply_decision
from policies.dualpath import DECODE_PATH, PREFILL_PATH, Assignment
from policies.request import Request


class RequestPlacement:
    """Placement of one ``PDCluster``'s requests onto its replicas."""

    def __init__(
        self,
        table: RequestTable,
        replicas: ReplicaSet,
        recovery: Recovery,
        conductor: Conductor,
        store: PDStore | None,
        read_paths: ReadPaths,
        dualpath: DualPathPlacer | None,
        block_size: int,
    ) -> None:
        self.table, self.replicas, self.recovery = table, replicas, recovery
        self.conductor, self.store, self.read_paths = conductor, store, read_paths
        self.dualpath, self.block_size = dualpath, block_size
        self.replicated_blocks = 0  # blocks copied into a chosen instance's home shard

    def stored_blocks(self, request: Request) -> int:
        """How many of the prompt's leading blocks the KV store holds (the last prompt
        token is always computed)."""
        if self.store is None:
            return 0
        usable = request.block_hashes[: (request.num_prompt_tokens - 1) // self.block_size]
        return self.store.client.directory.best_holder(usable)[1]

    def place(self, req: PDRequest) -> None:
        """Place one request (or its next attempt): choose (prefill, decode) by the
        Conductor or DualPath's rules, reserve its KV on decode, copy wanted blocks, pick
        the read side, queue its prefill; raises ``RequestRejected`` when it cannot now."""
        r, conductor = self.replicas, self.conductor
        now = time.monotonic()
        request = req.request
        creq = ConductorRequest(
            request.request_id,
            request.block_hashes,
            request.num_prompt_tokens,
            request.params.max_tokens,
            self.block_size,
        )
        if self.store is not None:
            self.store.refresh()
        prefills = []
        for view in r.prefill_views.values():
            if r.accepting(view.instance_id):
                view.cached = r.local_cached[view.instance_id] | self.home_blocks(view.instance_id)
                prefills.append(view)
        decodes = [v for v in r.decode_views.values() if r.accepting(v.instance_id)]
        rule: Assignment | None = None  # DualPath's placement, with its read side
        hit = self.stored_blocks(request)
        if self.dualpath is not None:
            in_prefill = self.table.in_prefill_counts()
            queues = self.read_paths.tokens(self.block_size)
            ids = [v.instance_id for v in prefills], [v.instance_id for v in decodes]
            rates = self.read_paths.token_rates(self.block_size, *ids)
            decision, rule = self.dualpath.decide(
                creq, hit, prefills, in_prefill, decodes, queues, conductor, rates
            )
        else:
            decision = conductor.schedule(creq, prefills, decodes, now)
        if not decision.accepted:
            raise RequestRejected(decision.reason, decision.retry_after or 1.0)
        pid, did = decision.prefill_id, decision.decode_id
        assert pid is not None and did is not None
        key = f"{request.request_id}#{req.attempts + 1}"
        decode = r.decodes[did]
        try:
            route = req.route and dataclasses.replace(req.route, attempt=req.attempts + 1)
            dest = ray.get(decode.reserve.remote(key, request, route))
        except DEAD:
            self.recovery.decode_died(did)
            raise RequestRejected("decode_restarting", conductor.min_retry_after) from None
        if dest is None:  # the view was stale: the instance has no room now
            raise RequestRejected("decode_full", conductor.min_retry_after)
        wanted = decision.replicate_blocks
        if decision.transfer_from is not None:  # this request reads the copied prefix
            mine = r.prefill_views[pid].cached
            hashes = request.block_hashes[: decision.cached_blocks]
            wanted = [h for h in hashes if h not in mine]
        source = decision.replicate_from or decision.transfer_from
        apply_decision(decision, creq, prefills, decodes, now)
        if wanted and source is not None:
            self.copy_blocks(request, wanted, source, pid)
        req.start_attempt(key, pid, did)
        self.table.bind(key, req)
        if rule is None:
            path = self.read_paths.choose(key, hit, pid, did) if self.store else PREFILL_PATH
        else:
            path = rule.path if hit else PREFILL_PATH  # nothing stored: nothing to relay
            self.read_paths.record(key, path, rule.read_node, hit)
        task = PrefillTask(
            key,
            request,
            dest,
            RemoteDecode(decode),
            r.home_shard(pid),
            read_path=path,
            relay=decode if path == DECODE_PATH else None,
        )
        if not call_replica(r.prefills[pid].submit, task):
            self.recovery.prefill_died(pid)  # queues this request again

    def home_blocks(self, pid: str) -> set[int]:
        return self.store.blocks_of(self.replicas.home_shard(pid)) if self.store else set()

    def copy_blocks(self, request: Request, hashes: list[int], src_pid: str, dst_pid: str) -> None:
        """Copy blocks the Conductor wants on ``dst_pid`` into its home shard, from a shard
        (``src_pid``'s home first) or out of ``src_pid``'s own cache."""
        r = self.replicas
        dst = r.home_shard(dst_pid)
        if self.store is None or dst is None:
            return  # no store: nowhere to copy to

        def export(rest: list[int]) -> int:
            handle = r.prefills[src_pid]
            try:
                ref = handle.export_blocks.remote(
                    request.block_hashes, request.prompt_token_ids, rest, dst
                )
                return int(ray.get(ref))
            except DEAD:
                return 0  # its death is handled when its poll fails

        home = r.home_shard(src_pid)
        self.replicated_blocks += self.store.copy_blocks(hashes, dst, home, export)
