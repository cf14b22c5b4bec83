"""Rotary position embeddings, Hugging Face Llama convention ("rotate_half": the head dim is
split into two halves, not interleaved pairs).

Supported ``rope_scaling`` types: none / "default", "linear" (positions divided by ``factor``)
and "llama3" (the Llama 3.1 frequency-dependent scaling). The inverse frequencies are computed
exactly as ``transformers.modeling_rope_utils`` does; cos/sin are precomputed in float32 for
every position below ``max_positions`` and looked up by position id. A model in another dtype
gets the tables cast to it once (Hugging Face casts the looked-up rows to the activations'
dtype; casting every row once gives the same values), so no layer casts them per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kernels import layer_ops_cpu
from kernels.rope_types import SUPPORTED_ROPE_TYPES, rope_type_of


def inverse_frequencies(
    head_dim: int,
    theta: float,
    rope_scaling: Mapping[str, Any] | None = None,
    max_position_embeddings: int | None = None,
) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies, after scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = rope_type_of(rope_scaling)
    if kind == "default":
        return inv_freq
    assert rope_scaling is not None
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "llama3":
        return _llama3_inverse_frequencies(inv_freq, rope_scaling, max_position_embeddings)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inverse_frequencies(
    inv_freq: torch.Tensor,
    rope_scaling: Mapping[str, Any],
    max_position_embeddings: int | None,
) -> torch.Tensor:
    """Mirrors ``transformers.modeling_rope_utils._compute_llama3_parameters``."""
    factor = float(rope_scaling["factor"])
    low_freq_factor = float(rope_scaling["low_freq_factor"])
    high_freq_factor = float(rope_scaling["high_freq_factor"])
    old_context_len = rope_scaling.get("original_max_position_embeddings", max_position_embeddings)
    if old_context_len is None:
        raise ValueError("llama3 rope_scaling needs original_max_position_embeddings")
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # wavelen < high_freq_wavelen: unchanged; wavelen > low_freq_wavelen: divided by factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # in between: interpolate smoothly
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds ``cos, sin: [max_positions, head_dim]`` float32 (non-persistent buffers)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        rope_scaling: Mapping[str, Any] | None = None,
        max_position_embeddings: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.rope_scaling = dict(rope_scaling) if rope_scaling else None
        self.max_position_embeddings = max_position_embeddings or max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        # (cos, sin) cast to another dtype, keyed by dtype and device; made on first use
        self._cast: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]]
        self._cast = {}
        if self.cos.device.type != "meta":  # on meta (a model being built): after to_empty
            self.reset_cache()

    def reset_cache(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables, e.g. after ``to_empty`` moved the module off the meta device."""
        if device is None:
            device = self.cos.device
        inv_freq = inverse_frequencies(
            self.head_dim, self.theta, self.rope_scaling, self.max_position_embeddings
        )
        positions = torch.arange(self.max_positions, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [P, D/2]; one product each, as HF
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)
        self._cast = {}

    def tables(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin) [max_positions, head_dim]`` in ``dtype``: the float32 tables
        themselves, or their cast, made once. Make them before a CUDA graph is captured
        (a warm-up run does): a tensor first made inside a capture holds no values."""
        if dtype == self.cos.dtype:
            return self.cos, self.sin
        key = (dtype, self.cos.device)
        cast = self._cast.get(key)
        if cast is None:
            cast = self._cast[key] = (self.cos.to(dtype), self.sin.to(dtype))
        return cast

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q: [T, Hq, D]``, ``k: [T, Hkv, D]``, ``positions: [T]`` -> rotated (q, k)."""
        q_cos, q_sin = self._rows(q.dtype, positions)  # [T, 1, D]
        if k.dtype == q.dtype:
            k_cos, k_sin = q_cos, q_sin
        else:
            k_cos, k_sin = self._rows(k.dtype, positions)
        q_out = q * q_cos + rotate_half(q) * q_sin
        k_out = k * k_cos + rotate_half(k) * k_sin
        return q_out, k_out

    def _rows(
        self, dtype: torch.dtype, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def at(self, positions: torch.Tensor) -> RotaryRows:
        """The rotation at one step's ``positions [T]``, for every layer of the step."""
        return RotaryRows(self, positions)

    def split_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        num_heads: int,
        num_kv_heads: int,
        rows: RotaryRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv [T, (Hq + 2 Hkv) * D]`` (a fused projection's output) -> rotated ``q [T, Hq,
        D]``, rotated ``k [T, Hkv, D]`` and ``v [T, Hkv, D]`` (views whose rows are not
        contiguous: backends take them so). On CPU in fp32 the rotation is one compiled pass
        over ``qkv`` in place; elsewhere q's and k's heads rotate together, as one ``[T, Hq
        + Hkv, D]`` tensor, with the rows ``rows`` looked up (``at``; None: looked up here).
        Both are the arithmetic of :meth:`forward`, element by element."""
        tokens, head_dim = qkv.shape[0], self.head_dim
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        if layer_ops_cpu.usable(qkv) and self.cos.dtype == torch.float32:
            qkv = qkv.contiguous()
            layer_ops_cpu.rope_qkv_(
                qkv, positions, self.cos, self.sin, num_heads + num_kv_heads, head_dim
            )
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            # head counts spelled out: a step with no token on this rank has T = 0
            kv_shape = (tokens, num_kv_heads, head_dim)
            return q.view(tokens, num_heads, head_dim), k.view(kv_shape), v.view(kv_shape)
        cos, sin = (rows or self.at(positions)).rows(qkv.dtype)  # [T, 1, D]
        qk = qkv[:, : q_size + kv_size].view(tokens, num_heads + num_kv_heads, head_dim)
        qk = qk * cos + rotate_half(qk) * sin
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        v = qkv[:, q_size + kv_size :].view(tokens, num_kv_heads, head_dim)
        return q, k, v


class RotaryRows:
    """RoPE's ``cos, sin`` rows at one step's positions, looked up once per dtype and
    shared by every layer of the step (a model's forward makes one: ``RotaryEmbedding.at``).
    In a captured CUDA graph the lookup is a kernel of the first layer, replayed."""

    def __init__(self, rope: RotaryEmbedding, positions: torch.Tensor) -> None:
        self.rope = rope
        self.positions = positions
        self._rows: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def rows(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin) [T, 1, D]`` in ``dtype``."""
        rows = self._rows.get(dtype)
        if rows is None:
            rows = self._rows[dtype] = self.rope._rows(dtype, self.positions)
        return rows

    def split_qkv(
        self, qkv: torch.Tensor, positions: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``RotaryEmbedding.split_qkv`` at this step's positions (``positions`` must be
        them)."""
        if positions is not self.positions:
            raise ValueError("these rows are of another step's positions")
        return self.rope.split_qkv(qkv, positions, num_heads, num_kv_heads, self)
