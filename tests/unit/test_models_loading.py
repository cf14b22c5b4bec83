"""Config parsing, loader errors, the tiny model writer and the tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from errors import InvalidRequestError, ModelLoadError
from models import ModelConfig, load_model, load_tokenizer, tiny_model_dir, write_tiny_model
from models.tiny import tiny_config


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("dense"))


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


# ---- config -------------------------------------------------------------------------------


def test_config_fields_from_tiny_dense():
    cfg = ModelConfig.from_hf_dict(tiny_config("dense"))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers) == (512, 64, 4)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3"
    assert not cfg.tie_word_embeddings and not cfg.is_moe
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,) and cfg.eos_token_id == 2
    assert cfg.torch_dtype == torch.float32 and cfg.max_model_len == 2048


def test_config_moe_and_qwen2_and_defaults():
    moe = ModelConfig.from_hf_dict(tiny_config("moe"))
    assert moe.is_moe and moe.num_local_experts == 4 and moe.num_experts_per_tok == 2
    qwen = ModelConfig.from_hf_dict(tiny_config("dense", architectures=["Qwen2ForCausalLM"]))
    assert qwen.qkv_bias and not qwen.o_bias
    raw = tiny_config("dense", eos_token_id=[2, 7])
    del raw["head_dim"], raw["num_key_value_heads"]
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 4 and cfg.eos_token_ids == (2, 7)


def test_config_reads_transformers5_rope_parameters():
    raw = tiny_config("dense", rope_scaling=None)
    raw.pop("rope_theta")
    raw["rope_parameters"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.rope_theta == 5000.0 and cfg.rope_scaling["factor"] == 2.0


def test_sliding_window_caps_context():
    cfg = ModelConfig.from_hf_dict(
        tiny_config("dense", architectures=["MistralForCausalLM"], sliding_window=512)
    )
    assert cfg.max_model_len == 512 and cfg.max_position_embeddings == 2048


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture.*LlamaForCausalLM"),
        ({"architectures": []}, "unsupported architecture"),
        ({"hidden_size": None}, "hidden_size"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "yarn"),
        ({"num_key_value_heads": 3}, "multiple"),
    ],
)
def test_config_errors_name_the_problem(overrides, message):
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_dict(tiny_config("dense", **overrides))


# ---- loader errors ------------------------------------------------------------------------


def test_missing_config(tmp_path, dense_dir):
    model_dir = copy_model(dense_dir, tmp_path / "m")
    (model_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(model_dir)
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "does-not-exist")


def test_missing_weights(tmp_path, dense_dir):
    model_dir = copy_model(dense_dir, tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(model_dir)


def test_missing_shard_listed_in_index(tmp_path):
    model_dir = write_tiny_model(tmp_path / "m", num_shards=2)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00002"):
        load_model(model_dir)


def test_unsupported_architecture(tmp_path, dense_dir):
    model_dir = copy_model(dense_dir, tmp_path / "m")
    raw = json.loads((model_dir / "config.json").read_text())
    raw["architectures"] = ["FalconForCausalLM"]
    (model_dir / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="FalconForCausalLM.*supported"):
        load_model(model_dir)


def test_missing_tensor_is_named(tmp_path, dense_dir):
    from safetensors.torch import load_file, save_file

    model_dir = copy_model(dense_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.mlp\.up_proj\.weight"):
        load_model(model_dir)


def test_shape_mismatch_is_named(tmp_path, dense_dir):
    from safetensors.torch import load_file, save_file

    model_dir = copy_model(dense_dir, tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(63)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight.*\(63,\).*\(64,\)"):
        load_model(model_dir)


def test_fused_transformers5_moe_layout_loads(tmp_path):
    """Mixtral experts stored fused ([E, 2I, H] / [E, H, I]) load like the per-expert files."""
    from safetensors.torch import load_file, save_file

    split_dir = write_tiny_model(tmp_path / "split", kind="moe")
    fused_dir = copy_model(split_dir, tmp_path / "fused")
    tensors = load_file(split_dir / "model.safetensors")
    for i in range(4):
        p = f"model.layers.{i}.block_sparse_moe."
        experts = range(4)
        w13 = [
            torch.cat([tensors[f"{p}experts.{j}.w1.weight"], tensors[f"{p}experts.{j}.w3.weight"]])
            for j in experts
        ]
        w2 = [tensors[f"{p}experts.{j}.w2.weight"] for j in experts]
        for j in experts:
            for w in ("w1", "w2", "w3"):
                del tensors[f"{p}experts.{j}.{w}.weight"]
        q = f"model.layers.{i}.mlp."
        tensors[q + "gate.weight"] = tensors.pop(p + "gate.weight")
        tensors[q + "experts.gate_up_proj"] = torch.stack(w13)
        tensors[q + "experts.down_proj"] = torch.stack(w2)
    save_file(tensors, fused_dir / "model.safetensors")
    a, b = load_model(split_dir), load_model(fused_dir)
    for (name, p1), (_, p2) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p1, p2), name


# ---- tiny model ---------------------------------------------------------------------------


def test_tiny_model_is_deterministic(tmp_path):
    one = write_tiny_model(tmp_path / "one", kind="moe", seed=3)
    two = write_tiny_model(tmp_path / "two", kind="moe", seed=3)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    other = write_tiny_model(tmp_path / "three", kind="moe", seed=4)
    assert (one / "model.safetensors").read_bytes() != (other / "model.safetensors").read_bytes()


def test_tiny_model_dir_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("MERIDIAN_CACHE", str(tmp_path))
    first = tiny_model_dir("dense")
    assert first == tmp_path / "tiny-dense-v1" and (first / "model.safetensors").is_file()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir("dense") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-dense-v1"]  # no staging left over
    with pytest.raises(ValueError):
        tiny_model_dir("huge")


# ---- tokenizer ----------------------------------------------------------------------------


def test_tokenizer_round_trip_and_special_ids(dense_dir):
    tok = load_tokenizer(dense_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 512)
    assert tok.eos_token_ids == (2,)
    text = "Hello, wörld! 你好 \n\t tabs"
    ids = tok.encode(text)
    assert ids[0] == 1 and all(0 <= i < 512 for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]
    assert tok.decode([1, *ids[1:], 2], skip_special_tokens=False) == "<s>" + text + "</s>"
    assert isinstance(tok.decode(list(range(512))), str)  # every id decodes


def test_tokenizer_matches_hf_fast_tokenizer(dense_dir):
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(dense_dir)
    tok = load_tokenizer(dense_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    text = tok.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|assistant|>\n") and "<|user|>\nHi there</s>" in text
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith(
        "<|assistant|>\n"
    )
    assert tok.encode("abc def") == hf("abc def")["input_ids"]


def test_tokenizer_errors(tmp_path, dense_dir):
    model_dir = copy_model(dense_dir, tmp_path / "m")
    (model_dir / "tokenizer_config.json").unlink()
    tok = load_tokenizer(model_dir)
    assert not tok.has_chat_template and tok.eos_token_id == 2  # from generation_config.json
    with pytest.raises(InvalidRequestError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    (model_dir / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load_tokenizer(model_dir)
