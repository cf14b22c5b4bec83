"""Load a Hugging Face model folder (``config.json`` + ``*.safetensors``) into ``CausalLM``.

Hugging Face tensor names map onto our (partly fused) parameters as follows, per layer i
(prefix ``model.layers.i.``):

- ``self_attn.{q,k,v}_proj.{weight,bias}`` -> rows of ``layers.i.self_attn.qkv_proj``
- ``self_attn.o_proj.*``, ``input_layernorm.weight``, ``post_attention_layernorm.weight``
- dense: ``mlp.{gate,up}_proj.weight`` -> rows of ``layers.i.mlp.gate_up_proj``;
  ``mlp.down_proj.weight``
- Mixtral: ``block_sparse_moe.gate.weight`` -> ``layers.i.mlp.gate``;
  ``block_sparse_moe.experts.j.{w1,w3}.weight`` -> ``layers.i.mlp.w13[j]`` (w1 rows, then w3);
  ``block_sparse_moe.experts.j.w2.weight`` -> ``layers.i.mlp.w2[j]``. The fused layout
  transformers 5 uses in memory (``mlp.experts.gate_up_proj`` [E, 2I, H],
  ``mlp.experts.down_proj`` [E, H, I], ``mlp.gate.weight``) is accepted too.

Plus ``model.embed_tokens.weight``, ``model.norm.weight`` and ``lm_head.weight`` (absent when
embeddings are tied). Tensors we do not need (e.g. ``rotary_emb.inv_freq``) are ignored.

A ``.gguf`` file loads the same way: ``models/gguf_checkpoint.py`` names its tensors as
Hugging Face does and dequantizes them; they are cast to ``dtype`` here.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from errors import ModelLoadError
from kernels import layer_ops_cpu, paged_attention_cpu
from models.config import ModelConfig, read_model_config
from models.decoder import CausalLM
from models.gguf_checkpoint import GGUFCheckpoint, is_gguf, open_gguf
from models.pretrained import resolve_model

INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class _Target:
    """Copy Hugging Face tensor ``hf_name`` into ``param[index]``."""

    param: str
    index: tuple[int | slice, ...]
    hf_name: str
    optional_group: str = ""  # targets in one group are loaded all-or-none (layout variants)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    attention_backend: str = "torch",
    overrides: Mapping[str, torch.Tensor] | None = None,
) -> CausalLM:
    """Build the model from ``model_dir`` (a Hugging Face folder or a ``.gguf`` file) with
    weights cast to ``dtype`` on ``device``; or a pretrained model by name. ``overrides``:
    Hugging Face-named tensors used instead of the stored ones (weights updated in place;
    checked by ``models.weight_update.check_weights``)."""
    model_dir = resolve_model(model_dir)
    config = read_model_config(model_dir)
    with torch.device("meta"):
        model = CausalLM(config, attention_backend=attention_backend)
    model.to(dtype)  # still on meta: free
    model.to_empty(device=device)
    model.rope.reset_cache(device)  # cos/sin tables stay float32
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if is_gguf(model_dir):
        load_gguf_weights(model, open_gguf(model_dir), overrides)
    else:
        load_weights(model, model_dir, overrides)
    if torch.device(device).type == "cpu" and dtype == torch.float32:
        # now, not inside the first request (a first build takes 20-30 s each)
        layer_ops_cpu.EXTENSION.load()
        if attention_backend == "torch":
            paged_attention_cpu.load()
    return model.eval()


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map every stored tensor name to its shard."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ModelLoadError(f"cannot read {index_path}: {exc}") from exc
        files = {name: model_dir / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.is_file():
                raise ModelLoadError(f"{shard} is listed in {index_path} but does not exist")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    files = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                files[name] = shard
    return files


def stored_tensor_names(model_dir: Path) -> Collection[str]:
    """The Hugging Face names of the tensors stored in ``model_dir`` (folder or GGUF)."""
    if is_gguf(model_dir):
        return open_gguf(model_dir).tensor_names()
    return weight_files(model_dir).keys()


def expected_tensors(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor the model of ``model_dir`` loads, with its shape: what an
    update of its weights may name. Built on the meta device (no weights read)."""
    model_dir = resolve_model(model_dir)
    config = read_model_config(model_dir)
    with torch.device("meta"):
        model = CausalLM(config)
    params = dict(model.named_parameters())
    targets = _select_layout(_targets(config), stored_tensor_names(model_dir))
    return {t.hf_name: tuple(params[t.param][t.index].shape) for t in targets}


def load_weights(
    model: CausalLM, model_dir: Path, overrides: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Fill every parameter of ``model`` from the shards in ``model_dir`` (in place), or
    from ``overrides`` for the names it holds."""
    files = weight_files(model_dir)
    with ExitStack() as stack:
        handles: dict[Path, object] = {}

        def fetch(name: str) -> torch.Tensor:
            if overrides is not None and name in overrides:
                return overrides[name]
            shard = files[name]
            if shard not in handles:
                handles[shard] = stack.enter_context(safe_open(str(shard), framework="pt"))
            return handles[shard].get_tensor(name)  # type: ignore[attr-defined]

        _fill(model, files, fetch, str(model_dir))


def load_gguf_weights(
    model: CausalLM, checkpoint: GGUFCheckpoint, overrides: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Fill every parameter of ``model`` from a GGUF file, dequantized (in place), or from
    ``overrides`` for the names it holds."""
    names = set(checkpoint.tensor_names())
    given = overrides or {}

    def fetch(name: str) -> torch.Tensor:
        return given[name] if name in given else torch.from_numpy(checkpoint.tensor(name))

    _fill(model, names, fetch, checkpoint.path.name)


def _fill(
    model: CausalLM,
    names: Collection[str],
    fetch: Callable[[str], torch.Tensor],
    origin: str,
) -> None:
    """Copy ``fetch(hf_name)`` into every parameter; ``names``: the tensors ``origin`` has."""
    targets = _select_layout(_targets(model.config), names)
    params = dict(model.named_parameters())
    covered = {t.param for t in targets}
    uncovered = sorted(set(params) - covered)
    if uncovered:  # a bug in _targets, not in the checkpoint
        raise RuntimeError(f"loader has no source for parameters {uncovered}")
    missing = [t.hf_name for t in targets if t.hf_name not in names]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(
            f"{origin} lacks tensor(s) {missing[:5]}{more} needed by {model.config.architecture}"
        )
    with torch.no_grad():
        for target in sorted(targets, key=lambda t: t.hf_name):
            dest = params[target.param].data[target.index]
            tensor = fetch(target.hf_name)
            if tuple(tensor.shape) != tuple(dest.shape):
                raise ModelLoadError(
                    f"tensor {target.hf_name} in {origin} has shape "
                    f"{tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)


def _select_layout(targets: list[_Target], files: Collection[str]) -> list[_Target]:
    """Keep plain targets; of each layout-variant group keep the variant the files hold."""
    plain = [t for t in targets if not t.optional_group]
    groups: dict[str, list[_Target]] = defaultdict(list)
    for t in targets:
        if t.optional_group:
            groups[t.optional_group].append(t)
    chosen: dict[str, list[_Target]] = {}
    for group, members in groups.items():
        key, _, _ = group.rpartition("|")  # "<param set>|<variant>"
        if key in chosen:
            continue
        if all(t.hf_name in files for t in members):
            chosen[key] = members
    for group, members in groups.items():  # fall back to the first variant: names the gaps
        key, _, _ = group.rpartition("|")
        chosen.setdefault(key, members)
    return plain + [t for members in chosen.values() for t in members]


def _targets(config: ModelConfig) -> list[_Target]:
    all_rows: tuple[int | slice, ...] = (slice(None),)
    out = [_Target("embed_tokens.weight", all_rows, "model.embed_tokens.weight")]
    out.append(_Target("norm.weight", all_rows, "model.norm.weight"))
    if not config.tie_word_embeddings:
        out.append(_Target("lm_head.weight", all_rows, "lm_head.weight"))
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    qkv_rows = {
        "q_proj": slice(0, q_size),
        "k_proj": slice(q_size, q_size + kv_size),
        "v_proj": slice(q_size + kv_size, q_size + 2 * kv_size),
    }
    inter = config.intermediate_size
    for i in range(config.num_hidden_layers):
        ours, hf = f"layers.{i}.", f"model.layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.append(_Target(f"{ours}{norm}.weight", all_rows, f"{hf}{norm}.weight"))
        kinds = ["weight"] + (["bias"] if config.qkv_bias else [])
        for kind in kinds:
            for proj, rows in qkv_rows.items():
                out.append(
                    _Target(
                        f"{ours}self_attn.qkv_proj.{kind}", (rows,), f"{hf}self_attn.{proj}.{kind}"
                    )
                )
        for kind in ["weight"] + (["bias"] if config.o_bias else []):
            out.append(
                _Target(f"{ours}self_attn.o_proj.{kind}", all_rows, f"{hf}self_attn.o_proj.{kind}")
            )
        if config.is_moe:
            out.extend(_moe_targets(config, ours, hf))
            continue
        out.append(
            _Target(
                f"{ours}mlp.gate_up_proj.weight", (slice(0, inter),), f"{hf}mlp.gate_proj.weight"
            )
        )
        out.append(
            _Target(
                f"{ours}mlp.gate_up_proj.weight",
                (slice(inter, 2 * inter),),
                f"{hf}mlp.up_proj.weight",
            )
        )
        out.append(_Target(f"{ours}mlp.down_proj.weight", all_rows, f"{hf}mlp.down_proj.weight"))
    return out


def _moe_targets(config: ModelConfig, ours: str, hf: str) -> list[_Target]:
    """Per-expert Mixtral tensors (variant "split") or transformers-5 fused ones ("fused")."""
    inter = config.intermediate_size
    split, fused = f"{ours}moe|split", f"{ours}moe|fused"
    moe = f"{hf}block_sparse_moe."
    out = [_Target(f"{ours}mlp.gate.weight", (slice(None),), f"{moe}gate.weight", split)]
    for j in range(config.num_local_experts):
        expert = f"{moe}experts.{j}."
        out.append(_Target(f"{ours}mlp.w13", (j, slice(0, inter)), f"{expert}w1.weight", split))
        out.append(
            _Target(f"{ours}mlp.w13", (j, slice(inter, 2 * inter)), f"{expert}w3.weight", split)
        )
        out.append(_Target(f"{ours}mlp.w2", (j,), f"{expert}w2.weight", split))
    out.append(_Target(f"{ours}mlp.gate.weight", (slice(None),), f"{hf}mlp.gate.weight", fused))
    out.append(_Target(f"{ours}mlp.w13", (slice(None),), f"{hf}mlp.experts.gate_up_proj", fused))
    out.append(_Target(f"{ours}mlp.w2", (slice(None),), f"{hf}mlp.experts.down_proj", fused))
    return out
