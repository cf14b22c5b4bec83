"""``Tokenizer``: a Hugging Face ``tokenizer.json`` (via the ``tokenizers`` library) plus the
special tokens and chat template of ``tokenizer_config.json`` (or ``chat_template.jinja``).

Prompts tokenize exactly as ``transformers.AutoTokenizer`` (and so vLLM) tokenizes them on
the same folder: the special tokens ``encode`` adds are those of ``tokenizer.json``'s
post-processor alone. ``add_bos_token`` / ``add_eos_token`` in ``tokenizer_config.json``
are ignored, as the fast tokenizer ignores them (tests/unit/test_tokenizer_hf.py).

The chat template is rendered with jinja2's ``ImmutableSandboxedEnvironment``, with the same
globals and filters transformers provides (``raise_exception``, ``strftime_now``, ``tojson``).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from errors import InvalidRequestError, ModelLoadError
from models.gguf_checkpoint import GGUFCheckpoint, is_gguf, open_gguf
from models.gguf_tokenizer import build_backend
from models.pretrained import resolve_model


class Tokenizer:
    def __init__(
        self,
        tokenizer: HFTokenizer,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        eos_token_id: int | None = None,
        bos_token_id: int | None = None,
        extra_eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id = _id_of(tokenizer, bos_token, bos_token_id)
        self.eos_token_id = _id_of(tokenizer, eos_token, eos_token_id)
        # Every id that ends generation: the EOS token, then generation_config's extra ones.
        eos_all = ([self.eos_token_id] if self.eos_token_id is not None else []) + list(
            extra_eos_token_ids
        )
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_all))
        self.chat_template = chat_template
        self._compiled = None
        if chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            env.filters["tojson"] = _tojson
            try:
                self._compiled = env.from_string(chat_template)
            except TemplateError as exc:
                raise ModelLoadError(f"chat template does not compile: {exc}") from exc

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def has_chat_template(self) -> bool:
        return self._compiled is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with special tokens, those ``tokenizer.json``'s
        post-processor adds (as ``AutoTokenizer.encode`` does)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def backend_json(self) -> str:
        """The ``tokenizer.json`` this tokenizer was read from (for llguidance)."""
        return str(self._tok.to_str())

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` (``{"role": ..., "content": ...}``) into the prompt text."""
        if self._compiled is None:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt (completions) instead"
            )
        try:
            return str(
                self._compiled.render(
                    messages=messages,
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                    **kwargs,
                )
            )
        except TemplateError as exc:
            raise InvalidRequestError(f"chat template rejected the messages: {exc}") from exc


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Read ``tokenizer.json`` and, when present, ``tokenizer_config.json``,
    ``chat_template.jinja``, ``generation_config.json`` and ``config.json`` (for token ids).
    A ``.gguf`` file's tokenizer is built from its metadata (``models/gguf_tokenizer.py``)."""
    model_dir = resolve_model(model_dir)
    if is_gguf(model_dir):
        return _gguf_tokenizer(open_gguf(model_dir))
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{path} not found: the runtime needs a fast tokenizer.json")
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as exc:  # the Rust library raises plain Exception
        raise ModelLoadError(f"cannot parse {path}: {exc}") from exc
    cfg = _read_json(model_dir / "tokenizer_config.json")
    template = cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = model_dir / "chat_template.jinja"
    if not template and jinja_file.is_file():
        template = jinja_file.read_text()
    gen = _read_json(model_dir / "generation_config.json")
    model_cfg = _read_json(model_dir / "config.json")
    eos_ids = gen.get("eos_token_id", model_cfg.get("eos_token_id"))
    return Tokenizer(
        tok,
        bos_token=_token_text(cfg.get("bos_token")),
        eos_token=_token_text(cfg.get("eos_token")),
        chat_template=template or None,
        eos_token_id=_first_id(eos_ids),
        bos_token_id=_first_id(gen.get("bos_token_id", model_cfg.get("bos_token_id"))),
        extra_eos_token_ids=tuple(_all_ids(eos_ids)),
    )


def _gguf_tokenizer(checkpoint: GGUFCheckpoint) -> Tokenizer:
    backend, cfg = build_backend(checkpoint)
    return Tokenizer(
        backend,
        bos_token=cfg["bos_token"],
        eos_token=cfg["eos_token"],
        chat_template=cfg.get("chat_template"),
        eos_token_id=checkpoint.field("tokenizer.ggml.eos_token_id"),
        bos_token_id=checkpoint.field("tokenizer.ggml.bos_token_id"),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else None


def _first_id(value: Any) -> int | None:
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def _all_ids(value: Any) -> list[int]:
    if isinstance(value, list):
        return [int(v) for v in value]
    return [] if value is None else [int(value)]


def _id_of(tok: HFTokenizer, token: str | None, fallback: int | None) -> int | None:
    if token is not None:
        found = tok.token_to_id(token)
        if found is not None:
            return int(found)
    return fallback


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)
