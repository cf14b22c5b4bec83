"""fp32 linear layers with prepacked weights, for CPU batches.

A weight that is exactly block-coded (``kernels/block_codes.py``: a GGUF checkpoint's Q4_1 and
Q8_0 tensors, as the loader dequantizes them) is also held as int8 codes with a scale and
offset per 32 weights, a quarter of its fp32 bytes; one whose every value is a bf16 (a bf16
checkpoint loaded in fp32) as bf16, half its bytes. Calls of at most ``BLOCK_CODE_ROWS`` rows
(decode steps, bound by reading the weight) multiply through ``panel_linear_cpu.cpp``, which
decodes either form to the same fp32 values on the fly; longer ones (prefill chunks, bound by
compute, where oneDNN's kernel is faster) through oneDNN as below.

``F.linear`` re-reads the weight in its plain layout on every call; a weight reordered once
into oneDNN's blocked layout runs the same product 1.3-3x faster here (one thread, [1..300,
512] x [512, 1536]), with the same fp32 arithmetic (results agree to ~1e-6 relative: only
the summation order differs). ``_linear_pointwise`` takes and returns plain dense tensors,
so no activation is converted to or from oneDNN's layout on the way. Where that operator is
missing (a torch built without oneDNN's linear ops) the layer keeps ``F.linear``.
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

from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn

from kernels.block_codes import bf16_values, block_codes
from kernels.cpu_build import CompiledExtension

PANELS = CompiledExtension(
    "meridian_panel_linear_cpu",
    [Path(__file__).parent / "panel_linear_cpu.cpp"],
    switch="MERIDIAN_CPU_BLOCK_CODES",
)

PACK_ROWS_HINT = 32  # the batch size oneDNN tunes the packed layout for; any row count works
# Calls of at most this many rows use a weight's block codes or bf16 panels where it has
# them. SmolLM2's decode step, one thread, in process, codes over oneDNN: 0.40 / 0.47 / 0.62 /
# 0.81 at 1 / 4 / 8 / 16 rows; 0.98-1.00 at 24-64 rows (0.90 and 0.94 at 32 and 48 in an
# earlier sweep); 1.03-1.12 at 128-256. Up to 48 rows the codes are no slower alone, and they
# read a quarter of the bytes where two engines share the memory bus. bf16 panels (the 0.5B
# Qwen2 shape stored in bf16) over oneDNN: 0.53 / 0.46 / 0.47 / 0.65 at 1 / 4 / 8 / 16 rows,
# 0.80-0.84 / 0.89-0.92 / 0.95-0.98 at 24 / 32 / 48.
BLOCK_CODE_ROWS = 48


def can_pack(module: nn.Module) -> bool:
    w = next(module.parameters(), None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and w is not None
        and w.device.type == "cpu"
        and w.dtype == torch.float32
    )


def _panels():
    """The block-coded kernel's module where it is built with AVX-512, else None."""
    module = PANELS.load()
    return module if module is not None and module.available() else None


class PackedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` on fp32 CPU input ``[..., in] -> [..., out]``. Holds the
    weight only packed: in oneDNN's layout, and as block codes where it is exactly
    block-coded, else as bf16 where every value is one. The plain ``[out, in]`` copy is
    dropped (unless another module shares it, as a tied embedding does)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        w = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT)
        # codes [P, K, 64] int8, scales and offsets [P, K / 32, 64] (panel_linear_cpu.cpp)
        self.blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.bf16: torch.Tensor | None = None  # bf16 panels [P, K, 64], where no codes
        panels = _panels()
        if panels is None:
            return
        # the kernel's own decode must give back every bit, else only oneDNN's copy stays
        found = block_codes(w)
        if found is not None:
            blocks = tuple(panels.pack_blocks(*found))
            if torch.equal(panels.decode_blocks(*blocks, self.out_features), w):
                self.blocks = blocks
                return
        halves = bf16_values(w)
        if halves is not None:
            packed = panels.pack_bf16(halves)
            if torch.equal(panels.decode_bf16(packed, self.out_features), w):
                self.bf16 = packed

    def stored(self) -> list[torch.Tensor]:
        """The tensors that hold the weight."""
        return [self.packed, *(self.blocks or ()), *(() if self.bf16 is None else (self.bf16,))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        bias = self.bias.detach() if self.bias is not None else None
        if self.blocks is not None and rows.shape[0] <= BLOCK_CODE_ROWS:
            out = PANELS.require().linear_blocks(rows, *self.blocks, self.out_features, bias)
        elif self.bf16 is not None and rows.shape[0] <= BLOCK_CODE_ROWS:
            out = PANELS.require().linear_bf16(rows, self.bf16, self.out_features, bias)
        else:
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
