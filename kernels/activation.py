"""SwiGLU's activation: ``silu(gate) * up`` from a fused gate-up projection's output."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import layer_ops_cpu


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [T, 2I]`` (gate columns, then up) -> ``[T, I]``. On CPU in fp32 one compiled
    pass; elsewhere torch's ``silu`` and an in-place multiply (one ``[T, I]`` buffer)."""
    if gate_up.dim() == 2 and layer_ops_cpu.usable(gate_up):
        return layer_ops_cpu.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
