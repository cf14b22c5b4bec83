"""The reference every exactness test compares with: Hugging Face transformers' greedy
tokens on the same model folder (float64 on the CPU unless told otherwise)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def hf_model(model_dir: str | Path, dtype: torch.dtype = torch.float64) -> Any:
    """transformers' model for the folder, in eval mode. Eager experts: the grouped-matmul
    MoE path of transformers has no float64 kernel."""
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, experts_implementation="eager"
    )
    return model.to(dtype).eval()


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's ``new_tokens`` greedy tokens (no EOS stop), one prompt at a time."""
    model = hf_model(model_dir)
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        gen = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        out.append(gen[0, len(p) :].tolist())
    return out
