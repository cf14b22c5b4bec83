"""Devices named the way tensors report theirs."""

from __future__ import annotations

import torch


def with_index(device: str | torch.device) -> torch.device:
    """``device`` with its index where it has one: ``"cuda"`` is the current CUDA device,
    ``cuda:N`` (a tensor made on ``"cuda"`` reports ``cuda:N``, and ``torch.device("cuda") !=
    torch.device("cuda:0")``). Other devices as given."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d
