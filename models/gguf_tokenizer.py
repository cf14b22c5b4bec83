"""The tokenizer a GGUF file describes, built as a ``tokenizers.Tokenizer`` from its metadata.

A GGUF holds no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``), the
BPE merges, each token's type, the special token ids, and the name of llama.cpp's
pre-tokenizer (``tokenizer.ggml.pre``). We rebuild what llama.cpp runs for that name:

- model ``gpt2`` (byte-level BPE; Llama 3, Qwen2, SmolLM, GPT-2): vocabulary and merges as
  stored, the pre-tokenizer's split expressions applied in order (``Split`` isolating each
  match), then the byte-to-unicode mapping, and a byte-level decoder;
- tokens typed CONTROL (3) are special tokens, USER_DEFINED (4) are added tokens: both are
  matched whole in the text, as llama.cpp does;
- ``tokenizer.ggml.add_bos_token``: BOS is prepended by ``encode`` when set.

Other tokenizer models (SentencePiece ``llama``, ``t5``, ...) and unknown pre-tokenizer names
are refused with a ``ModelLoadError`` naming them.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from errors import ModelLoadError
from models.gguf_checkpoint import GGUFCheckpoint

_CONTROL, _USER_DEFINED = 3, 4

# llama.cpp's split expressions per pre-tokenizer name (llama-vocab.cpp), applied in order.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,),
    "gpt-2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "llama3": (_LLAMA3,),
    "llama-v3": (_LLAMA3,),
    "llama-bpe": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "deepseek-r1-qwen": (_QWEN2,),
}
# Pre-tokenizers whose vocabulary takes a whole pre-token that is in it before any merge.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe"}


def build_backend(checkpoint: GGUFCheckpoint) -> tuple[HFTokenizer, dict[str, Any]]:
    """``(tokenizer, tokenizer_config)``: the ``tokenizer.json`` and ``tokenizer_config.json``
    this file's metadata describes."""
    name = checkpoint.path.name
    kind = checkpoint.field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{name}: tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE)"
        )
    pre = checkpoint.field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ModelLoadError(
            f"{name}: pre-tokenizer {pre!r} is not supported; "
            f"supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    tokens: list[str] = checkpoint.field("tokenizer.ggml.tokens")
    types: list[int] = checkpoint.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{name}: {len(types)} token types for {len(tokens)} tokens")
    merges = [tuple(m.split(" ", 1)) for m in checkpoint.field("tokenizer.ggml.merges") or []]
    vocab = {token: index for index, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES)
    tok = HFTokenizer(bpe)
    splits = [
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    added = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])

    def token_at(key: str) -> str | None:
        index = checkpoint.field(key)
        return None if index is None else tokens[int(index)]

    bos = token_at("tokenizer.ggml.bos_token_id")
    add_bos = bool(checkpoint.field("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        bos_id = vocab[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "add_bos_token": add_bos,
        "model_max_length": int(checkpoint.arch_field("context_length", 2048)),
    }
    template = checkpoint.field("tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    return tok, cfg


def tokenizer_files(checkpoint: GGUFCheckpoint) -> dict[str, str]:
    """File name -> text of ``tokenizer.json`` and ``tokenizer_config.json``."""
    tok, cfg = build_backend(checkpoint)
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(cfg, indent=2)}
