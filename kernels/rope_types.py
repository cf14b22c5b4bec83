"""The RoPE scalings the kernels implement, by the name a Hugging Face config gives them
(read by ``models.config`` without loading torch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type_of(rope_scaling: Mapping[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))
