"""The collectives one replica's workers use: TP all-reduce and KVP all-gather.

torch.distributed process groups, gloo on CPU and NCCL on GPU. Why not Ray's compiled-graph
collectives: on CPU their communicator is correct but ~10 ms per 2-rank all-reduce here and
has no all-gather, while gloo does a 16 KiB all-reduce in ~0.6 ms and runs fine inside a
method a compiled graph drives; on GPU, NCCL through torch.distributed is the standard path
and keeps tensors on the device. The compiled graph carries only plans, activations between
pipeline stages and sampled tokens.

World rank of a worker: ``(kvp_rank * spp + stage) * tp + tp_rank``. Every worker creates
every group in the same order (``new_group`` is collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    spp: int = 1
    kvp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "spp", "kvp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.spp * self.kvp

    def world_rank(self, tp_rank: int, stage: int, kvp_rank: int) -> int:
        return (kvp_rank * self.spp + stage) * self.tp + tp_rank

    def coords(self) -> list[tuple[int, int, int]]:
        """Every worker's (tp_rank, stage, kvp_rank), in world-rank order."""
        return [(t, s, k) for k in range(self.kvp) for s in range(self.spp) for t in range(self.tp)]


class Collectives:
    def __init__(
        self,
        layout: Layout,
        coords: tuple[int, int, int],
        init_method: str,
        device: torch.device,
    ) -> None:
        tp_rank, stage, kvp_rank = coords
        self.layout = layout
        backend = "nccl" if device.type == "cuda" else "gloo"
        rank = layout.world_rank(tp_rank, stage, kvp_rank)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=layout.world_size
        )
        spans = [(s, k) for k in range(layout.kvp) for s in range(layout.spp)]
        self.tp_group = self._own_group(
            layout.tp,
            [[layout.world_rank(t, s, k) for t in range(layout.tp)] for s, k in spans],
            rank,
        )
        columns = [(t, s) for s in range(layout.spp) for t in range(layout.tp)]
        self.kvp_group = self._own_group(
            layout.kvp,
            [[layout.world_rank(t, s, k) for k in range(layout.kvp)] for t, s in columns],
            rank,
        )

    @staticmethod
    def _own_group(size: int, rank_lists: list[list[int]], rank: int):
        """Create every group of ``rank_lists`` (``new_group`` is collective: every worker
        calls it for every group, in the same order); return the one holding ``rank``."""
        if size == 1:
            return None
        own = None
        for ranks in rank_lists:
            group = dist.new_group(ranks)
            if rank in ranks:
                own = group
        return own

    def all_reduce_tp(self, x: torch.Tensor) -> None:
        """Sum ``x`` in place over the TP group (every member has the same shape)."""
        if x.numel():
            dist.all_reduce(x, group=self.tp_group)

    def all_gather_kvp(self, x: torch.Tensor) -> list[torch.Tensor]:
        """``x`` of every KVP rank (equal shapes), in rank order."""
        out = [torch.empty_like(x) for _ in range(self.layout.kvp)]
        dist.all_gather(out, x.contiguous(), group=self.kvp_group)
        return out

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
