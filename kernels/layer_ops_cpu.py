"""A decoder layer's elementwise work as compiled CPU operators (``layer_ops_cpu.cpp``).

RMSNorm, RoPE and SwiGLU's ``silu(gate) * up`` are chains of small torch operators; on CPU in
fp32 each chain runs as one pass here instead: a 32-row decode step pays one dispatch per
chain rather than several, and a long prefill reads each activation once. :func:`usable`
says whether a tensor can take this path; elsewhere (GPU, other dtypes, no compiler) the
torch chains in ``kernels/norm.py``, ``kernels/rope.py`` and ``models/decoder.py`` serve.
``MERIDIAN_CPU_LAYER_OPS=0`` turns them off.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.cpu_build import CompiledExtension

_HERE = Path(__file__).parent
EXTENSION = CompiledExtension(
    "meridian_layer_ops_cpu",
    [_HERE / "layer_ops_cpu.cpp"],
    [_HERE / "cpu_math.h"],
    switch="MERIDIAN_CPU_LAYER_OPS",
)


def usable(x: torch.Tensor) -> bool:
    """fp32 CPU tensor, not recording autograd, and the module built."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not (torch.is_grad_enabled() and x.requires_grad)
        and EXTENSION.load() is not None
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [..., H]``, ``weight [H]`` fp32 -> ``[..., H]``."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    return EXTENSION.require().rms_norm(rows, weight.detach().contiguous(), eps).view(x.shape)


def rope_qkv_(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotated_heads: int,
    head_dim: int,
) -> None:
    """Rotates, in place, the first ``rotated_heads`` heads (q, then k) of each row of
    ``qkv [T, (Hq + 2 Hkv) * D]`` (contiguous) by ``positions [T]``; ``cos, sin [P, D]``."""
    EXTENSION.require().rope_qkv_(qkv, positions.contiguous(), cos, sin, rotated_heads, head_dim)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [T, 2I]`` (gate columns, then up) -> ``silu(gate) * up [T, I]``."""
    return EXTENSION.require().silu_and_mul(gate_up.contiguous())
