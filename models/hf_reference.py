"""The reference every exactness test compares with: Hugging Face transformers' greedy
tokens on the same model folder (float64 on the CPU unless told otherwise)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import torch

from models.model_cache import cached_folder


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
    transformers' own dequantizer (float32, ``hf_gguf_folder``), in eval mode."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(_hf_folder(model)).eval()


def hf_tokenizer(model: str | Path) -> Any:
    """transformers' tokenizer of a Hugging Face folder, or of a ``.gguf`` file through
    transformers' own converter of its vocabulary."""
    import transformers

    return transformers.AutoTokenizer.from_pretrained(_hf_folder(model))


def _hf_folder(model: str | Path) -> str:
    path = Path(model)
    return str(hf_gguf_folder(path) if path.suffix == ".gguf" else path)


@functools.cache  # the file is hashed once per process (the model and its tokenizer)
def hf_gguf_folder(gguf: Path) -> Path:
    """What transformers reads from a ``.gguf`` file (its own dequantizer, float32, and its
    own tokenizer converter), saved once per machine as a Hugging Face folder in the model
    cache: reading the file takes transformers about 25 s, the folder under half a second.
    Nothing of Meridian's loader is in it, so the exactness tests still compare two
    independent readings of the file. Keyed by the file's bytes (a fresh install of the same
    package writes the same file at another time) and transformers' version."""
    import transformers

    digest = hashlib.sha256(transformers.__version__.encode())
    with open(gguf, "rb") as f:
        while chunk := f.read(1 << 23):
            digest.update(chunk)
    key = digest.hexdigest()[:16]

    def write(folder: Path) -> None:
        auto = transformers.AutoModelForCausalLM
        read = auto.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = read.config
        del config.quantization_config  # the weights are dequantized: a plain folder
        plain = auto.from_config(config, dtype=torch.float32)
        plain.load_state_dict(read.state_dict())
        plain.save_pretrained(folder)
        tokenizer = transformers.AutoTokenizer.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name
        )
        tokenizer.save_pretrained(folder)

    return cached_folder(f"hf-{gguf.stem}-{key}", write, marker="config.json")


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
