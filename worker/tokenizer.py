"""Tokenizer: `tokenizer.json` through the `tokenizers` library, chat template from
`tokenizer_config.json` (or `chat_template.jinja`) rendered with jinja2."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
    """The model directory's tokenizer files are missing or unusable."""


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{path} not found: the engine needs a `tokenizers` tokenizer.json")
        self.path = path
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template_file = model_dir / "chat_template.jinja"
        self.chat_template: str | None = self.config.get("chat_template")
        if template_file.is_file():
            self.chat_template = template_file.read_text()
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.add_bos_token = bool(self.config.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self.token_to_id(self.eos_token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos, *ids]
        return ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @cached_property
    def _template(self) -> jinja2.Template:
        if not self.chat_template:
            raise TokenizerError("this model has no chat template (tokenizer_config.json lacks chat_template)")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
        return env.from_string(self.chat_template)

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The prompt text for a chat; special tokens are part of the text (encode it with
        add_special_tokens=False)."""
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            tools=tools,
        )


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value
