"""RMSNorm as Hugging Face's ``LlamaRMSNorm``: normalise in float32, cast back, then scale by
the weight (in the weight's dtype). :func:`rms_norm` matches it bit for bit; the module runs
fp32 CPU input through one compiled pass instead (``kernels/layer_ops_cpu.py``: the same
arithmetic, the mean summed in another order, so within an ulp)."""

from __future__ import annotations

import torch
from torch import nn

from kernels import layer_ops_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x: [..., H]``, ``weight: [H]`` -> ``[..., H]``."""
    input_dtype = x.dtype
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(input_dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if layer_ops_cpu.usable(x) and self.weight.dtype == torch.float32:
            return layer_ops_cpu.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)
