"""The device-to-device KV route from a prefill worker into decode workers' caches on the
same device: CUDA IPC on one GPU, or, on the CPU, the decode worker's shared-memory
segment mapped straight into the prefill process (``store.kv_cache_ipc``).

A decode worker's cache offers an export (``KVTarget.export``: on a GPU always, on the CPU
with ``kv_route="ipc"``), which travels to the prefill side inside the request's
``KVDestination``, in the step plan, like the target's endpoint. ``IPCRoute`` (held by a
prefill worker's ``LayerStreamer``) decides per request and target, at the start of each
step, whether that step's blocks go through the export:

- the target holds exactly the layers and heads this worker computes (the same sharding
  on both sides) and its export opens here: same device kind, the same GPU (by UUID) or
  node, the same block layout. Then every layer's blocks are copied device to device
  (``KVCacheImport.write_layer``, issued on the compute stream right after the layer);
- otherwise today's transfer-layer route (``kv_route="auto"``), or the request fails with
  the reason (``kv_route="ipc"``, where the route was asked for explicitly). A weight
  version that differs (the export's against the destination's, which the prefill replica
  stamps) always fails the request: that KV would be wrong on any route.

Each export is opened once per generation and kept, one mapping per decode endpoint. An
export of a newer generation (its cache was released or replaced: a sleep, a worker
restart; or its weights updated) replaces the mapping; one older than the mapping held
fails the request rather than write into a revoked cache. After a step, ``complete`` waits
for the step's copies (on CUDA: a synchronize of the stream that issued them) and returns
one receipt per request and decode worker; the prefill replica hands a request's receipts
to the decode replica with its admission, which accepts them against its current exports
before the request joins its batch (``DecodeReplica._admit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from store.kv_block_layout import KVBlockLayout
from store.kv_cache_ipc import KVCacheExport, KVCacheImport, KVHandleError, KVWriteDone

if TYPE_CHECKING:
    from actors.disagg.kv_routes import KVTarget

KV_ROUTES = ("auto", "ipc", "transfer")


def check_kv_route(kv_route: str) -> str:
    """``kv_route`` if it is one of ``KV_ROUTES``, else ValueError saying which are."""
    if kv_route not in KV_ROUTES:
        raise ValueError(f"kv_route must be one of {', '.join(KV_ROUTES)}, got {kv_route!r}")
    return kv_route


def cache_device(device: str | None) -> torch.device:
    """The device a worker of an engine config with ``device`` computes on, as the engine
    picks it (``actors.engine.controller_builder.build_parts``), in this process."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def prefill_route(
    kv_route: str,
    staged: bool,
    device: str | None,
    node_id: str,
    layers: tuple[int, int],
    heads: tuple[int, int],
) -> IPCRoute | None:
    """A prefill replica's route for its one worker (``layers`` and ``heads``: every one
    of the model), or None: the transfer layer only (``kv_route="transfer"``, or a replica
    of more than one worker, ``staged``). ``device``: the engine config's. ValueError for
    what cannot stream: "ipc" from several workers; on a GPU, anything but one worker
    writing device to device."""
    if check_kv_route(kv_route) == "ipc" and staged:
        raise ValueError(
            'kv_route="ipc" streams from a one-worker prefill replica (tp = spp = 1); '
            "a replica of more workers streams through the transfer layer"
        )
    if cache_device(device).type != "cpu" and (kv_route == "transfer" or staged):
        raise ValueError(
            "a prefill replica on a GPU streams KV device to device only (no transfer "
            'backend moves device memory yet): one worker (tp = spp = 1), kv_route "auto" '
            'or "ipc", and its decode replicas on the same GPU'
        )
    if kv_route == "transfer" or staged:
        return None
    return IPCRoute(node_id, layers, heads, strict=kv_route == "ipc")


def _identity(export: KVCacheExport) -> tuple[str, int, int | None]:
    return (export.exporter, export.generation, export.weight_version)


class IPCRoute:
    """One prefill worker's mappings of decode caches on its device, and the step's writes
    through them (see the module doc). Used on the worker's compute thread only."""

    def __init__(
        self,
        node_id: str,
        layers: tuple[int, int],
        heads: tuple[int, int],
        strict: bool = False,
    ) -> None:
        """``layers`` / ``heads``: the global layers and KV heads this worker computes and
        sends; ``node_id``: its node (as the decode side names it). ``strict``
        (``kv_route="ipc"``): a target the route cannot serve fails the request instead of
        going through the transfer layer."""
        self.node_id = node_id
        self.layers, self.heads = layers, heads
        self.strict = strict
        self._imports: dict[str, KVCacheImport] = {}  # decode endpoint id -> its mapping
        self._refused: dict[tuple[str, int, int | None], str] = {}  # export -> why
        self._pending: dict[tuple[str, str], set[int]] = {}  # (request, endpoint) -> blocks
        self.opens = 0  # exports mapped so far (one per decode cache and generation)
        self.bytes_written = 0

    def mapping(
        self,
        target: KVTarget,
        weight_version: int | None,
        layout: KVBlockLayout,
        device: torch.device,
    ) -> KVCacheImport | None:
        """The open mapping of ``target``'s cache that this step's blocks of a request
        are written through, or None: use the transfer layer. ``weight_version``: of the
        request's KV (``KVDestination.weight_version``); ``layout`` and ``device``: this
        worker's cache. Raises KVHandleError (the request fails) for a stale export, a
        weight version that differs, or, when strict, a target the route cannot serve."""
        export = target.export
        why = self._unservable(target, device)
        if why is not None:
            if self.strict:
                raise KVHandleError(why)
            return None
        assert export is not None
        if export.weight_version != weight_version:
            raise KVHandleError(
                f"{export.exporter!r}'s cache holds KV of weight version "
                f"{export.weight_version}, this prefill computes version {weight_version}"
            )
        key = target.endpoint.endpoint_id
        held = self._imports.get(key)
        if held is not None:
            if _identity(held.export) == _identity(export):
                return held
            if held.export.exporter == export.exporter and (
                export.generation < held.export.generation
            ):
                raise KVHandleError(
                    f"the destination's export of {export.exporter!r} is generation "
                    f"{export.generation}, revoked: generation {held.export.generation} is "
                    "mapped here (the decode cache was released or replaced since)"
                )
            self.drop(key)  # a newer generation, new weights or a new cache: map it again
        refused = self._refused.get(_identity(export))
        if refused is None:
            try:
                imp = KVCacheImport.open(
                    export, layout, weight_version, device=device, node=self.node_id
                )
            except KVHandleError as e:
                refused = self._refused[_identity(export)] = str(e)
            else:
                self._imports[key] = imp
                self.opens += 1
                return imp
        if self.strict:
            raise KVHandleError(refused)
        return None

    def _unservable(self, target: KVTarget, device: torch.device) -> str | None:
        """Why ``target`` cannot be written through an export from here, or None."""
        name = target.endpoint.endpoint_id
        if target.export is None:
            return f"decode cache {name!r} offers no export (its replica's kv_route)"
        if (target.layers, target.heads) != (self.layers, self.heads):
            return (
                f"decode cache {name!r} holds layers {target.layers} and KV heads "
                f"{target.heads}, this prefill worker {self.layers} and {self.heads}: the "
                "device-to-device route needs the same sharding on both sides"
            )
        if target.export.device != device.type:
            return (
                f"decode cache {name!r} is on {target.export.device}, this prefill worker "
                f"computes on {device.type}"
            )
        return None

    def write(
        self,
        request_id: str,
        target: KVTarget,
        imp: KVCacheImport,
        layer: int,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        src_blocks: Sequence[int],
        dst_blocks: Sequence[int],
    ) -> int:
        """Copy one layer (global index ``layer``) of blocks ``src_blocks`` of this worker's
        cache into blocks ``dst_blocks`` of ``target``'s; complete after ``complete``."""
        if not dst_blocks:
            return 0
        n = imp.write_layer(layer - target.layers[0], kv_cache, src_blocks, dst_blocks)
        self._pending.setdefault((request_id, target.endpoint.endpoint_id), set()).update(
            int(b) for b in dst_blocks
        )
        self.bytes_written += n
        return n

    def complete(self) -> tuple[dict[str, list[KVWriteDone]], dict[str, str]]:
        """Wait for the step's writes. Returns each request's receipts (one per decode
        cache it was written into), and why for requests whose mapping was dropped
        meanwhile (their writes cannot be vouched for)."""
        pending, self._pending = self._pending, {}
        receipts: dict[str, list[KVWriteDone]] = {}
        failed: dict[str, str] = {}
        for (request_id, key), blocks in pending.items():
            imp = self._imports.get(key)
            if imp is None:
                failed[request_id] = f"the mapping of decode cache {key!r} was dropped mid-step"
                continue
            receipts.setdefault(request_id, []).append(imp.complete(sorted(blocks)))
        return receipts, failed

    def backends(self) -> dict[str, str]:
        """Decode endpoint id -> "ipc", for the caches this route has mapped."""
        return dict.fromkeys(self._imports, "ipc")

    def drop(self, key: str | None = None) -> None:
        """Close the mapping of decode endpoint ``key`` (None: every mapping): its cache
        is being released, or this worker sleeps, updates its weights or stops. On CUDA a
        mapping keeps the exporter's allocation alive until it is closed."""
        keys = list(self._imports) if key is None else [key]
        for k in keys:
            imp = self._imports.pop(k, None)
            if imp is not None:
                imp.close()
        if key is None:
            self._refused.clear()
