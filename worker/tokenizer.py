"""Tokenizer: `tokenizer.json` through the `tokenizers` library, chat template from
`tokenizer_config.json` (or `chat_template.jinja`) rendered with jinja2.

A "developer" message (OpenAI's newer name for the system role, sent by recent clients) is rendered
as "system" unless the template tests for "developer" itself (gpt-oss's does): templates that do not
know the role render a turn the model never saw (Llama 3, SmolLM2), drop it silently (Qwen2.5) or
raise (Mistral)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.nodes
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
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises a bare Exception (bad JSON, UTF-8, structure)
            raise _file_error(path, "not a readable tokenizers file", exc) from None
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict = _read_config(cfg_path) if cfg_path.is_file() else {}
        template_file = model_dir / "chat_template.jinja"
        self.chat_template: str | None = _chat_template(self.config.get("chat_template"), cfg_path)
        if template_file.is_file():
            self.chat_template = _read_text(template_file)
        self.bos_token = _token_text(self.config.get("bos_token"), cfg_path, "bos_token")
        self.eos_token = _token_text(self.config.get("eos_token"), cfg_path, "eos_token")
        add_bos = self.config.get("add_bos_token", False)
        if add_bos is not None and not isinstance(add_bos, bool):
            raise TokenizerError(f"{cfg_path}: add_bos_token must be true or false, got {add_bos!r}")
        self.add_bos_token = bool(add_bos)

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

    @cached_property
    def template_knows_developer(self) -> bool:
        """Whether the chat template names the "developer" role: a string constant of its code (a role
        test, a list of roles), not words of its text ("You are a developer")."""
        source = self._template.environment.parse(self.chat_template)
        return any(node.value == "developer" for node in source.find_all(jinja2.nodes.Const))

    def apply_chat_template(
        self, messages: list[dict], *, add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The prompt text for a chat; special tokens are part of the text (encode it with
        add_special_tokens=False). "developer" messages become "system" ones unless the template knows
        the role."""
        template = self._template
        if not self.template_knows_developer:
            messages = [m | {"role": "system"} if m.get("role") == "developer" else m for m in messages]
        return template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            tools=tools,
        )


def _file_error(path: Path, what: str, exc: BaseException) -> TokenizerError:
    """One line naming the file and the problem (start-up errors are printed as one line)."""
    detail = " ".join(str(exc).split())
    return TokenizerError(f"{path}: {what} ({type(exc).__name__}: {detail})")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise _file_error(path, "cannot be read as UTF-8 text", exc) from None


def _read_config(path: Path) -> dict:
    text = _read_text(path)
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise _file_error(path, "not valid JSON", exc) from None
    if not isinstance(config, dict):
        raise TokenizerError(f"{path}: expected a JSON object, found a JSON {type(config).__name__}")
    return config


def _chat_template(value, cfg_path: Path) -> str | None:
    """chat_template: a string, or named templates [{"name", "template"}, ...] of which "default" is taken."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        return named.get("default") or next(iter(named.values()), None)
    raise TokenizerError(f"{cfg_path}: chat_template must be a string or a list of "
                         f"{{\"name\": ..., \"template\": ...}} objects, got {_short(value)}")


def _token_text(value, cfg_path: Path, key: str) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TokenizerError(f"{cfg_path}: {key} must be a token string or {{\"content\": ...}}, got {_short(value)}")
    return value


def _short(value) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."
