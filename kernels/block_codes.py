"""Exact block codes of an fp32 weight: ``W[n, k] = code * scale + offset`` per 32 weights.

A GGUF checkpoint's Q4_1 and Q8_0 tensors dequantize to exactly such weights (Q4_1: codes
0..15, an fp16 scale and minimum per 32 weights of a row; Q8_0: codes -127..127, an fp16
scale, no offset), and the loader hands the model their fp32 values. Recovered here from
those values alone, the codes hold the same weight in a quarter of the bytes, so a linear
layer that is bound by reading its weight (a decode step's few rows) reads a quarter.

A checkpoint saved in bf16 and loaded in fp32 (most Hugging Face checkpoints) has weights
whose low 16 bits are zero: :func:`bf16_values` holds them as bf16, half the bytes.

Nothing is approximated: :func:`block_codes` returns codes only where every block's
``code * scale + offset``, computed as fp32's fused multiply-add, gives back each weight bit
for bit; any other weight (random, trained, updated by a trainer) gets None, and its layer
keeps the fp32 weight. Callers check the decoded weight once more against the original with
the kernel's own decode (``kernels/cpu_linear.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

BLOCK = 32  # weights of a row sharing a scale and an offset


class BlockCodes(NamedTuple):
    codes: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # fp32 [N, K / 32]
    offsets: torch.Tensor  # fp32 [N, K / 32]


def _decoded(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """fp32 ``code * scale + offset``. Both forms keep the product exact (a 4-bit code times
    an fp16 scale; or no offset, so the product's one rounding is the FMA's), so this is
    what the kernel's fused multiply-add gives; the caller checks the kernel's own decode
    anyway."""
    return torch.addcmul(offset, codes, scale)


def _affine(blocks: torch.Tensor, levels: int) -> tuple[torch.Tensor, ...]:
    """Q4_1's form: ``offset`` = the block's minimum (the weight coded 0), ``scale`` = its
    range over ``levels - 1`` rounded to fp16, codes 0 .. levels - 1."""
    low = blocks.amin(-1, keepdim=True)
    high = blocks.amax(-1, keepdim=True)
    scale = ((high - low) / (levels - 1)).half().float()
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round((blocks - low) / safe).clamp_(0, levels - 1)
    return codes, scale, low


def _symmetric(blocks: torch.Tensor, top: int) -> tuple[torch.Tensor, ...]:
    """Q8_0's form: no offset, ``scale`` = the largest magnitude over ``top`` (that weight is
    coded +-top, so the division is exact), codes -top .. top."""
    scale = blocks.abs().amax(-1, keepdim=True) / top
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(blocks / safe).clamp_(-top, top)
    return codes, scale, torch.zeros_like(scale)


def _coded(blocks: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The codes of ``blocks [n, b, 32]`` (each block in the first form that reproduces it)
    and which blocks one of the forms reproduces ``[n, b]``."""
    chosen: tuple[torch.Tensor, ...] | None = None
    exact_any = torch.zeros(blocks.shape[:2], dtype=torch.bool)
    for form in (_affine(blocks, 16), _symmetric(blocks, 127)):
        exact = (_decoded(*form) == blocks).all(-1)
        if chosen is None:
            chosen = form
        else:
            take = (exact & ~exact_any).unsqueeze(-1)
            pairs = zip(form, chosen, strict=True)
            chosen = tuple(torch.where(take, new, old) for new, old in pairs)
        exact_any |= exact
        if bool(exact_any.all()):
            break
    assert chosen is not None
    return chosen, exact_any


def block_codes(weight: torch.Tensor) -> BlockCodes | None:
    """Codes of the fp32 ``weight [N, K]`` (K a multiple of 32), or None unless every block
    reproduces its 32 weights exactly in one of the two forms."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    n, k = weight.shape
    blocks = weight.detach().reshape(n, k // BLOCK, BLOCK)
    if not bool(_coded(blocks[:8])[1].all()):  # most weights that are not coded fail at once
        return None
    (codes, scale, offset), exact = _coded(blocks)
    if not bool(exact.all()):
        return None
    return BlockCodes(
        codes.to(torch.int8).reshape(n, k).contiguous(),
        scale.squeeze(-1).contiguous(),
        offset.squeeze(-1).contiguous(),
    )


def bf16_values(weight: torch.Tensor) -> torch.Tensor | None:
    """The fp32 ``weight [N, K]`` (K a multiple of 32) as bf16 where every value is a bf16
    exactly (the low 16 bits of each fp32 are zero, so the cast drops nothing), else None."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % BLOCK:
        return None
    bits = weight.detach().contiguous().view(torch.int32)
    if bool((bits[:8] & 0xFFFF).any()) or bool((bits & 0xFFFF).any()):
        return None
    return weight.detach().to(torch.bfloat16).contiguous()
