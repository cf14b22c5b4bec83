"""New weights for a running model: where they come from, and whether they fit it.

An update is a mapping of Hugging Face tensor names to tensors: all of the model's or
some. ``read_weights`` takes one from a mapping, a ``.safetensors`` file, a Hugging Face
folder, a ``SharedWeights`` (how updates travel through Ray's object store), or a Ray
object ref to any of these. ``check_weights`` refuses, before anything
changes, a tensor the model does not have, one of another shape, or one that is not a
floating-point tensor (any float dtype is cast to the engine's, as at load).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from errors import InvalidRequestError

Weights = dict[str, torch.Tensor]


@dataclass(frozen=True)
class SharedWeights:
    """Tensors as numpy arrays, for Ray's object store: every process on a node that reads
    them gets read-only views of the store's one copy (numpy is deserialized zero-copy;
    torch tensors would be copied per reader). ``dtypes``: each tensor's torch dtype name
    (bf16 travels as its int16 bits)."""

    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]

    @classmethod
    def of(cls, weights: Mapping[str, torch.Tensor]) -> SharedWeights:
        arrays, dtypes = {}, {}
        for name, t in weights.items():
            if not isinstance(t, torch.Tensor):
                raise InvalidRequestError(f"weight {name!r} is a {type(t).__name__}, not a tensor")
            t = t.detach().cpu().contiguous()
            dtypes[name] = str(t.dtype).removeprefix("torch.")
            bits = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
            arrays[name] = bits.numpy()
        return cls(arrays, dtypes)

    def tensors(self) -> Weights:
        """Views of the arrays (no copy; read-only where the arrays are)."""
        out = {}
        with warnings.catch_warnings():  # from_numpy warns on read-only store views
            warnings.simplefilter("ignore", UserWarning)
            for name, a in self.arrays.items():
                t = torch.from_numpy(a)
                dtype = getattr(torch, self.dtypes[name])
                out[name] = t.view(dtype) if dtype == torch.bfloat16 else t
        return out


def is_object_ref(source: Any) -> bool:
    """A Ray object ref (checked by name: this module does not import ray)."""
    return type(source).__name__ == "ObjectRef"


def checked_weights(expected: Mapping[str, tuple[int, ...]], source: Any) -> Weights:
    """The tensors of ``source`` (``read_weights``), less a tied head equal to the
    embeddings, refused unless they fit the model (``check_weights``); ``expected``:
    name -> shape, ``models.loader.expected_tensors``."""
    weights = without_tied_head(expected, read_weights(source))
    check_weights(expected, weights)
    return weights


def resolve_ref(source: Any) -> Any:
    """``source``, or the value of a Ray ``ObjectRef`` (zero-copy for tensors in the node's
    object store): kept after its owner's process may have died."""
    if is_object_ref(source):
        import ray

        return ray.get(source)
    return source


def read_weights(source: Any) -> Weights:
    """The tensors of ``source``: a name -> tensor mapping, a safetensors file, a folder
    of them, a ``SharedWeights``, or a Ray ``ObjectRef`` to one of these. Raises
    InvalidRequestError."""
    source = resolve_ref(source)
    if isinstance(source, SharedWeights):
        return source.tensors()
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, str | Path):
        return _read_safetensors(Path(source))
    raise InvalidRequestError(
        "weights must be a mapping of Hugging Face names to tensors, a path to a "
        f".safetensors file or a model folder, or a Ray object ref to one; got {type(source)}"
    )


def _read_safetensors(path: Path) -> Weights:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() and f.suffix == ".safetensors" for f in files):
        raise InvalidRequestError(f"{path} is neither a .safetensors file nor a folder of them")
    out: Weights = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


TIED_HEAD, EMBEDDINGS = "lm_head.weight", "model.embed_tokens.weight"


def without_tied_head(expected: Mapping[str, tuple[int, ...]], weights: Weights) -> Weights:
    """``weights`` less ``lm_head.weight`` where the model ties it to the embeddings and
    it equals the ``model.embed_tokens.weight`` sent beside it (a trainer's
    ``state_dict()`` holds both names); otherwise unchanged, for ``check_weights``."""
    if TIED_HEAD in expected or TIED_HEAD not in weights or EMBEDDINGS not in weights:
        return weights
    head, embeddings = weights[TIED_HEAD], weights[EMBEDDINGS]
    if head.shape != embeddings.shape or not torch.equal(head, embeddings):
        return weights  # refused by check_weights, by name
    return {n: t for n, t in weights.items() if n != TIED_HEAD}


def check_weights(expected: Mapping[str, tuple[int, ...]], weights: Mapping[str, Any]) -> None:
    """Refuse ``weights`` unless every entry is a floating-point tensor the model has
    (``expected``: name -> shape, ``models.loader.expected_tensors``) with its shape."""
    if not weights:
        raise InvalidRequestError("the weight update holds no tensors")
    for name, tensor in weights.items():
        if name == TIED_HEAD and name not in expected:
            raise InvalidRequestError(
                f"weight {name!r}: this model ties it to {EMBEDDINGS!r}; send that one (a "
                "tied head equal to it is accepted and ignored)"
            )
        if name not in expected:
            example = next(iter(expected))
            raise InvalidRequestError(
                f"weight {name!r} is not a tensor of this model (names are Hugging Face's, "
                f"e.g. {example!r})"
            )
        if not isinstance(tensor, torch.Tensor):
            raise InvalidRequestError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
        if not tensor.dtype.is_floating_point:
            raise InvalidRequestError(
                f"weight {name!r} has dtype {tensor.dtype}; send a floating-point tensor"
            )
        if tuple(tensor.shape) != expected[name]:
            raise InvalidRequestError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected[name]}"
            )
