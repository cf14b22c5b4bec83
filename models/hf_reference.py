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


def hf_pretrained(model: str | Path) -> Any:
    """transformers' model of a Hugging Face folder, or of a ``.gguf`` file through
    transformers' own dequantizer (float32), in eval mode."""
    import transformers

    path = Path(model)
    if path.suffix == ".gguf":
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name
        )
    else:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    return loaded.eval()


def hf_generate(model: Any, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """transformers' greedy ``generate`` of exactly ``new_tokens`` tokens (no EOS stop) for
    each row of ``ids`` [batch, prompt_len] (unpadded): [batch, prompt_len + new_tokens]."""
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out.shape[1] == ids.shape[1] + new_tokens
    return out


def hf_greedy(model_dir: str | Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's ``new_tokens`` greedy tokens (no EOS stop), one prompt at a time."""
    model = hf_model(model_dir)
    return [
        hf_generate(model, torch.tensor([p]), new_tokens)[0, len(p) :].tolist() for p in prompts
    ]
