"""fp32 linear layers with oneDNN-prepacked weights, for CPU batches.

``F.linear`` re-reads the weight in its plain layout on every call; a weight reordered once
into oneDNN's blocked layout runs the same product 1.3-3x faster here (one thread, [1..300,
512] x [512, 1536]), with the same fp32 arithmetic (results agree to ~1e-6 relative: only
the summation order differs). ``_linear_pointwise`` takes and returns plain dense tensors,
so no activation is converted to or from oneDNN's layout on the way. Where that operator is
missing (a torch built without oneDNN's linear ops) the layer keeps ``F.linear``. A packed
layer keeps its weight in oneDNN's layout only.
"""

from __future__ import annotations

import os

# oneDNN builds one kernel (primitive) per linear shape, i.e. per row count, and caches the
# last 1024. A step's row count is its token count (1..token budget), and each row count
# needs ~4 linear shapes per model, so a budget of 256 already cycles more shapes than the
# default cache holds and a server seeing varied batches rebuilds kernels (1-2 ms a step
# here) all the time. Read by oneDNN when it builds its first primitive, so it is set at
# import, before any packed layer runs; a capacity the operator chose is kept.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")

import torch  # noqa: E402
from torch import nn

PACK_ROWS_HINT = 32  # the batch size oneDNN tunes the packed layout for; any row count works


def can_pack(module: nn.Module) -> bool:
    w = next(module.parameters(), None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and w is not None
        and w.device.type == "cpu"
        and w.dtype == torch.float32
    )


class PackedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` on fp32 CPU input ``[..., in] -> [..., out]``. Holds the
    weight only in oneDNN's layout: the plain ``[out, in]`` copy is dropped (unless another
    module shares it, as a tied embedding does), so a packed model takes its weights' memory
    once."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        w = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        bias = self.bias.detach() if self.bias is not None else None
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, bias, "none", [], "")
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)


def pack_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` below ``module`` by a ``PackedLinear``; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, PackedLinear(child))
            count += 1
        else:
            count += pack_linears(child)
    return count
