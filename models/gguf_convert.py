"""Write a GGUF file out as a Hugging Face model folder that other servers load.

    python -m models.gguf_convert MODEL.gguf OUT_DIR [--dtype float32|bfloat16|float16]

``OUT_DIR`` gets ``config.json``, ``generation_config.json``, ``model.safetensors`` (the
dequantized weights under Hugging Face names, q/k rows in Hugging Face order),
``tokenizer.json`` and ``tokenizer_config.json`` (with the chat template).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from models.gguf_checkpoint import open_gguf
from models.gguf_tokenizer import tokenizer_files

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write the folder; returns ``out_dir``. Raises ModelLoadError for unsupported files."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    checkpoint = open_gguf(gguf_path)
    files = tokenizer_files(checkpoint)  # before any write: an unsupported tokenizer refuses
    config = checkpoint.hf_config()
    config["torch_dtype"] = dtype
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: torch.from_numpy(checkpoint.tensor(name)).to(DTYPES[dtype])
        for name in checkpoint.tensor_names()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    for name, text in files.items():
        (out / name).write_text(text)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", help="the .gguf file")
    parser.add_argument("out_dir", help="the Hugging Face folder to write")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    args = parser.parse_args(argv)
    out = convert_gguf(args.gguf, args.out_dir, args.dtype)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
