"""fp32 linear layers with oneDNN-prepacked weights, for CPU batches.

``F.linear`` re-reads the weight in its plain layout on every call; a weight reordered once
into oneDNN's blocked layout runs a [32, 512] x [512, 3072] product about 2x faster here,
with the same fp32 arithmetic (results agree to ~1e-6 relative: only the summation order
differs). Small batches (fewer than ``min_rows`` rows) keep the plain path, which is as fast
there. Weights are kept in both layouts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def can_pack(module: nn.Module) -> bool:
    w = next(module.parameters(), None)
    return (
        torch.backends.mkldnn.is_available()
        and w is not None
        and w.device.type == "cpu"
        and w.dtype == torch.float32
    )


class PackedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` on 2-D fp32 CPU input ``[rows, in] -> [rows, out]``."""

    def __init__(self, linear: nn.Linear, min_rows: int = 8) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.min_rows = min_rows
        self.packed = linear.weight.detach().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[0] < self.min_rows:
            return F.linear(x, self.weight, self.bias)
        bias = self.bias.detach() if self.bias is not None else None
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.packed, bias).to_dense()


def pack_linears(module: nn.Module, min_rows: int = 8) -> int:
    """Replace every ``nn.Linear`` below ``module`` by a ``PackedLinear``; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child, min_rows))
            count += 1
        else:
            count += pack_linears(child, min_rows)
    return count
