"""The tokenizer a GGUF file describes, built as a ``tokenizers.Tokenizer`` from its metadata.

A GGUF holds no ``tokenizer.json``: it stores the vocabulary (``tokenizer.ggml.tokens``), the
BPE merges, each token's type, the special token ids, and the name of llama.cpp's
pre-tokenizer (``tokenizer.ggml.pre``). We rebuild what llama.cpp runs for that name:

- model ``gpt2`` (byte-level BPE; Llama 3, Qwen2, SmolLM, GPT-2): vocabulary and merges as
  stored, the pre-tokenizer's split expressions applied in order (``Split`` isolating each
  match), then the byte-to-unicode mapping, and a byte-level decoder;
- tokens typed CONTROL (3) are special tokens, USER_DEFINED (4) are added tokens: both are
  matched whole in the text, as llama.cpp does;
- model ``llama`` (SentencePiece BPE; Llama 2, Mistral, Mixtral): the vocabulary with byte
  fallback, merges recovered from the pieces' scores (a pair merges when both halves and
  their concatenation are pieces; the higher-scored concatenation merges first), spaces as
  ``\u2581`` with one prepended to the text when ``tokenizer.ggml.add_space_prefix`` (the
  default);
- ``tokenizer.ggml.add_bos_token`` (default: on for ``llama``, off for ``gpt2``): BOS is
  prepended by ``encode``.

Other tokenizer models (``t5``, ``rwkv``, ...) and unknown pre-tokenizer names are refused
with a ``ModelLoadError`` naming them.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from errors import ModelLoadError
from models.gguf_checkpoint import GGUFCheckpoint

_CONTROL, _USER_DEFINED = 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space

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
    tokens: list[str] = checkpoint.field("tokenizer.ggml.tokens") or []
    types: list[int] = checkpoint.field("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ModelLoadError(f"{name}: {len(types)} token types for {len(tokens)} tokens")
    if kind == "gpt2":
        tok = _byte_level_bpe(checkpoint, tokens)
        add_bos = bool(checkpoint.field("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tok = _sentencepiece_bpe(checkpoint, tokens)
        add_bos = bool(checkpoint.field("tokenizer.ggml.add_bos_token", True))
    else:
        raise ModelLoadError(
            f"{name}: tokenizer model {kind!r} is not supported; supported: "
            "'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
        )
    special = [t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    added = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED]
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])

    def token_at(key: str) -> str | None:
        index = checkpoint.field(key)
        return None if index is None else tokens[int(index)]

    bos = token_at("tokenizer.ggml.bos_token_id")
    if add_bos and bos is not None:
        bos_id = tokens.index(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    elif kind == "gpt2":
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


def _byte_level_bpe(checkpoint: GGUFCheckpoint, tokens: list[str]) -> HFTokenizer:
    pre = checkpoint.field("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise ModelLoadError(
            f"{checkpoint.path.name}: pre-tokenizer {pre!r} is not supported; "
            f"supported: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}"
        )
    merges = [tuple(m.split(" ", 1)) for m in checkpoint.field("tokenizer.ggml.merges") or []]
    vocab = {token: index for index, token in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=pre in _IGNORE_MERGES))
    splits = [
        pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(checkpoint: GGUFCheckpoint, tokens: list[str]) -> HFTokenizer:
    scores = checkpoint.field("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ModelLoadError(f"{checkpoint.path.name}: a SentencePiece vocabulary needs scores")
    unk = checkpoint.field("tokenizer.ggml.unknown_token_id")
    merges = [tuple(m.split(" ", 1)) for m in checkpoint.field("tokenizer.ggml.merges") or []]
    vocab = {token: index for index, token in enumerate(tokens)}
    bpe = models.BPE(
        vocab=vocab,
        merges=merges or merges_from_scores(tokens, scores),
        unk_token=None if unk is None else tokens[int(unk)],
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(bpe)
    prefix = bool(checkpoint.field("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges of a SentencePiece vocabulary: every split of a piece into two pieces,
    best-scored piece first (then longer left, longer right halves; ties in vocabulary
    order), the order transformers' converter uses."""
    index = {token: i for i, token in enumerate(tokens)}
    found: list[tuple[float, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        halves = [
            (piece[:cut], piece[cut:])
            for cut in range(1, len(piece))
            if piece[:cut] in index and piece[cut:] in index
        ]
        halves.sort(key=lambda h: (index[h[0]], index[h[1]]))
        found.extend((float(score), left, right) for left, right in halves)
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def tokenizer_files(checkpoint: GGUFCheckpoint) -> dict[str, str]:
    """File name -> text of ``tokenizer.json`` and ``tokenizer_config.json``."""
    tok, cfg = build_backend(checkpoint)
    return {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(cfg, indent=2)}
