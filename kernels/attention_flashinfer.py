"""Paged attention over flashinfer (CUDA only; flashinfer-python 0.2 or newer).

The cache layout is flashinfer's NHD: ``[num_pages, page_size, Hkv, D]`` with our blocks as its
pages. Each step is planned once (on the first layer that sees a new ``AttentionMetadata``)
with ``BatchPrefillWithPagedKVCacheWrapper`` in causal mode, which aligns the causal mask to
the end of each sequence's KV, exactly our "query at position p sees keys 0..p" rule; decode
is the special case of one query per sequence. flashinfer returns lse in base 2 by default; we ask
for natural log where the installed version can (``lse_base="ln"``) and otherwise convert
(``lse_e = lse_2 * ln 2``) so states merge with the torch backend's.
flashinfer kernels take float16 / bfloat16 inputs only.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import flashinfer  # noqa: F401  (fail at import time, so the registry can say it is missing)
import torch
from flashinfer import BatchPrefillWithPagedKVCacheWrapper

from kernels.attention_metadata import AttentionMetadata
from kernels.attention_torch import write_kv

WORKSPACE_BYTES = 128 * 1024 * 1024
LN2 = math.log(2.0)


@dataclass
class PagedKVIndex:
    """flashinfer's CSR view of our block tables (all int32)."""

    qo_indptr: torch.Tensor  # [B + 1] query rows of sequence b: qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: torch.Tensor  # [B + 1] pages of sequence b: kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [total_pages] block ids, in sequence order
    kv_last_page_len: torch.Tensor  # [B] tokens in the last page, 1..page_size


def paged_kv_index(meta: AttentionMetadata) -> PagedKVIndex:
    """Convert ``block_tables [B, max_blocks]`` and ``context_lens [B]`` to flashinfer's CSR."""
    block_size = meta.block_size
    ctx = meta.context_lens.to(torch.int64)
    num_pages = (ctx + block_size - 1) // block_size  # [B]
    kv_indptr = torch.zeros(ctx.shape[0] + 1, dtype=torch.int64, device=ctx.device)
    kv_indptr[1:] = torch.cumsum(num_pages, dim=0)
    width = meta.block_tables.shape[1]
    used = torch.arange(width, device=ctx.device)[None, :] < num_pages[:, None]  # [B, W]
    kv_indices = meta.block_tables[used]  # row-major: sequence b's pages in order
    last_page_len = ctx - (num_pages - 1) * block_size
    return PagedKVIndex(
        qo_indptr=meta.query_start.to(torch.int32),
        kv_indptr=kv_indptr.to(torch.int32),
        kv_indices=kv_indices.to(torch.int32),
        kv_last_page_len=last_page_len.to(torch.int32),
    )


class FlashInferAttentionBackend:
    """One prefill wrapper (and workspace) per backend instance, replanned once per step."""

    name = "flashinfer"

    def __init__(self, backend: str = "auto") -> None:
        self._kernel_backend = backend
        self._wrapper: BatchPrefillWithPagedKVCacheWrapper | None = None
        self._device: torch.device | None = None
        self._planned_meta: AttentionMetadata | None = None
        self._planned_key: tuple | None = None
        # flashinfer >= 0.6 can return lse in base e itself (``lse_base="ln"``); older ones
        # always return base 2.
        params = inspect.signature(BatchPrefillWithPagedKVCacheWrapper.run).parameters
        self._native_ln = "lse_base" in params

    def _wrapper_for(self, device: torch.device) -> BatchPrefillWithPagedKVCacheWrapper:
        if self._wrapper is None or self._device != device:
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
            self._wrapper = BatchPrefillWithPagedKVCacheWrapper(
                workspace, kv_layout="NHD", backend=self._kernel_backend
            )
            self._device = device
            self._planned_meta = None
        return self._wrapper

    write_kv = staticmethod(write_kv)  # the paged layout is the same for every backend

    def attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q: [T, Hq, D]`` -> ``(out [T, Hq, D], lse [T, Hq] float32, natural log)``."""
        if q.device.type != "cuda":
            raise ValueError("the flashinfer backend runs on CUDA tensors only")
        if meta.query_offsets is not None:
            raise NotImplementedError(
                "flashinfer's causal paged kernel assumes the queries are the newest tokens; "
                "KV-parallel shard attention (query_offsets) runs on the torch backend"
            )
        wrapper = self._wrapper_for(q.device)
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
        key = (num_heads, num_kv_heads, head_dim, page_size, q.dtype, k_cache.dtype, scale)
        if self._planned_meta is not meta or self._planned_key != key:
            index = paged_kv_index(meta)
            wrapper.plan(
                index.qo_indptr,
                index.kv_indptr,
                index.kv_indices.to(q.device),
                index.kv_last_page_len,
                num_heads,
                num_kv_heads,
                head_dim,
                page_size,
                causal=True,
                sm_scale=scale,
                q_data_type=q.dtype,
                kv_data_type=k_cache.dtype,
            )
            self._planned_meta, self._planned_key = meta, key
        if self._native_ln:
            out, lse = wrapper.run(
                q.contiguous(), (k_cache, v_cache), return_lse=True, lse_base="ln"
            )
            return out, lse.float()
        out, lse = wrapper.run(q.contiguous(), (k_cache, v_cache), return_lse=True)
        return out, lse.float() * LN2
