"""Tokenizer: `tokenizer.json` through the `tokenizers` library, chat template from `tokenizer_config.json`
(or `chat_template.jinja`) compiled when it loads and rendered as transformers does (chat_template.py). A model
that ships a separate `tool_use` template (a named one in tokenizer_config.json, or
`additional_chat_templates/tool_use.jinja`) has chats with tools rendered by it, as transformers and vLLM do.

The template sees every named special token of tokenizer_config.json (`bos_token`, `eos_token`, `unk_token`,
`pad_token`, any other `*_token`, named `extra_special_tokens`) and `additional_special_tokens`, as
transformers passes them. A chat's prompt ids are its rendered text encoded without the tokenizer's own
special tokens (the template writes them), except that control-token strings from the caller's messages are
encoded as plain text (control_tokens.py) unless the worker is told to let them be tokens, as vLLM does.
Where transformers' LlamaTokenizer replaces tokenizer.json's normalizer, pre-tokenizer and decoder with its own
(a Llama-2-style file whose tokenizer_config.json names that class), so does the worker (llama_pipeline.py).
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from tokenizers import Tokenizer as HFTokenizer

from lorafleet.worker.chat_template import ChatTemplate, ChatTemplateOptions
from lorafleet.worker.control_tokens import ControlTokens
from lorafleet.worker.file_limits import FileLimitError, read_limited
from lorafleet.worker.llama_pipeline import LlamaPipeline, llama_pipeline
from lorafleet.worker.token_floor import token_floor

LONG_TEXT = 16384  # characters: a longer text is encoded without holding the GIL (Tokenizer.encode)
MAX_CONTROL_STRINGS = 4096  # control-token strings a chat's text may hold, each encoded as text (encode_chat)
CHAT_CONFIG_BYTES = 4 << 20  # an adapter's tokenizer_config.json read for its chat template (Llama-3's: 55 KB)


class TokenizerError(ValueError):
    """The model directory's tokenizer files are missing or unusable."""


class PromptTooLong(TokenizerError):
    """A text that encodes to at least `at_least` tokens, refused before it is tokenized (token_floor.py)."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"This model's maximum context length is {limit} tokens; the prompt has at least "
                         f"{at_least} tokens. Shorten the prompt.")  # OpenAI's words, as the job's own refusal
        self.at_least, self.limit = at_least, limit


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
        # A file saved with truncation or padding on cut or padded every prompt; transformers turns both off
        # unless a call asks for them (PreTrainedTokenizerFast.set_truncation_and_padding), and so does the worker.
        self._tok.no_truncation()
        self._tok.no_padding()
        cfg_path = model_dir / "tokenizer_config.json"
        self.config: dict = _read_config(cfg_path) if cfg_path.is_file() else {}
        self.llama_pipeline: LlamaPipeline | None = llama_pipeline(model_dir, self.config, self._tok)
        if self.llama_pipeline is not None:  # transformers' LlamaTokenizer: its own pipeline, not the file's
            self.llama_pipeline.apply(self._tok)
        files = {"default": model_dir / "chat_template.jinja",
                 "tool_use": model_dir / "additional_chat_templates" / "tool_use.jinja"}
        named = _chat_templates(self.config.get("chat_template"), cfg_path)
        if any(path.is_file() for path in files.values()):  # transformers: the files take the config's place
            named = {name: _read_text(path) for name, path in files.items() if path.is_file()}
        where = {name: path if path.is_file() else cfg_path for name, path in files.items()}
        self.chat_template: str | None = named.get("default")
        self.template = _compile(self.chat_template, where["default"])
        # a separate template for requests with tools (Hermes 2 Pro, Hermes 3, Command R), as transformers takes it
        self.tool_template = _compile(named.get("tool_use"), where["tool_use"])
        self.special_tokens = _special_tokens(self.config, cfg_path)
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        add_bos = self.config.get("add_bos_token", False)
        if add_bos is not None and not isinstance(add_bos, bool):
            raise TokenizerError(f"{cfg_path}: add_bos_token must be true or false, got {add_bos!r}")
        self.add_bos_token = bool(add_bos)
        self.floor = token_floor(self._tok)  # the fewest tokens a text's length alone says it has

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

    def encode(self, text: str, *, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """`text`'s ids. With a `limit`, a text whose length alone shows it encodes to at least that many
        tokens is refused (PromptTooLong) before it is tokenized."""
        self._refuse_past(limit, [text])
        ids = self._ids(text, add_special_tokens)
        return self._with_bos(ids) if add_special_tokens else ids

    def _ids(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The tokenizer's ids of `text`. `encode` holds the GIL throughout (seconds for megabytes: every thread
        stalls, the event loop and the engine's steps too); `encode_batch` releases it, same ids."""
        if len(text) > LONG_TEXT:
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @cached_property
    def control_tokens(self) -> ControlTokens:
        """The special tokens, and the added tokens the chat template writes (or those tokenizer_config.json
        lists as `chat_control_tokens`), as transformers' sanitize_control_tokens takes them."""
        listed = self.config.get("chat_control_tokens")
        written = "\0".join(t.literal_text for t in (self.template, self.tool_template) if t is not None)
        return ControlTokens(t.content for t in self._tok.get_added_tokens_decoder().values() if t.special or (
            t.content in listed if isinstance(listed, list) else t.content in written and not t.content.isspace()))

    def template_for(self, tools: list[dict] | None) -> ChatTemplate | None:
        """The chat template a chat is rendered with: the `tool_use` one for a chat with tools, where the model
        has one (transformers' and vLLM's choice), else the default."""
        return self.tool_template if tools is not None and self.tool_template is not None else self.template

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, template_kwargs: dict | None = None,
                            tools: list[dict] | None = None) -> str:
        """The prompt text for a chat; special tokens are part of the text (encode it with
        add_special_tokens=False). `template_kwargs`: more template variables (a request's chat_template_kwargs);
        `tools`: the request's tools (the template's `tools`).
        Raises TokenizerError without a template, jinja2.TemplateError when it fails on these messages."""
        template = self.template_for(tools)
        if template is None:
            raise TokenizerError("this model has no chat template (tokenizer_config.json lacks chat_template)")
        variables = {"bos_token": "", "eos_token": ""} | self.special_tokens | (template_kwargs or {})
        return template.render(messages, variables, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, tools=tools)

    def encode_chat(self, messages: list[dict], options: ChatTemplateOptions | None = None, *,
                    control_tokens_in_content: bool = False, tools: list[dict] | None = None,
                    limit: int | None = None) -> list[int]:
        """A chat's prompt ids. Control-token strings in the messages, in options.kwargs and in `tools` are
        encoded as plain text, unless `control_tokens_in_content` (vLLM's way: they become the tokens). With a
        `limit`, a chat that encodes to at least that many tokens by its rendered length is refused first."""
        options = options or ChatTemplateOptions()
        render = {"add_generation_prompt": options.add_generation_prompt,
                  "continue_final_message": options.continue_final_message}
        if control_tokens_in_content:
            text = self.apply_chat_template(messages, template_kwargs=options.kwargs, tools=tools, **render)
            return self.encode(text, add_special_tokens=options.add_special_tokens, limit=limit)
        marks = self.control_tokens
        kwargs = {name: marks.wrap(v) for name, v in options.kwargs.items()}  # names of variables, not text
        text = self.apply_chat_template(marks.wrap(messages), template_kwargs=kwargs, tools=marks.wrap(tools),
                                        **render)
        pieces = marks.split(text)
        # Each later piece is encoded after a newline then dropped (_encode_piece), and rounds down on its own.
        joins = (len(pieces) - 1) * (len(self._newline) + 2)
        self._refuse_past(limit, [piece for piece, _ in pieces], joins)
        typed = [piece for piece, is_text in pieces if is_text]  # the caller's control-token strings
        if len(typed) > MAX_CONTROL_STRINGS:  # each is encoded on its own, with the GIL held
            raise TokenizerError(f"the chat holds {len(typed)} control-token strings (such as {typed[0]!r}) as "
                                 f"text; at most {MAX_CONTROL_STRINGS} are encoded")
        if len(pieces) == 1:
            return self.encode(pieces[0][0], add_special_tokens=options.add_special_tokens)
        ids = self._ids(pieces[0][0])  # a long chat's text, with a control-token string in it, too
        for piece, is_text in pieces[1:]:
            ids += self._encode_piece(piece, is_text)
        if options.add_special_tokens:
            before, after = self._frame
            ids = self._with_bos([*before, *ids, *after])
        return ids

    def chat_differences(self, adapter_dir: Path, max_bytes: int | None) -> list[str]:
        return self.adapter_chat(adapter_dir, max_bytes)[0]

    def adapter_chat(self, adapter_dir: Path, max_bytes: int | None) -> tuple[list[str], int | None]:
        """(notes, own end token) of an adapter folder. Notes: what it declares for chats unlike this tokenizer, its
        own default chat template (chat_template.jinja, else tokenizer_config.json's) or end-of-sequence token. This
        tokenizer's serve it, which the adapter may not have been trained with: worth a warning, not a refusal (vLLM
        serves adapters so too). Its own end token: the id of that end-of-sequence token where the base's vocabulary
        has it as an added (special) token (an instruct fine-tune of a base model ending its turns with its chat
        template's token), on which its requests end too (never an ordinary word: it would end answers
        mid-sentence). Files that cannot be read say nothing here (the tokenizer check reports them), and a
        tokenizer_config.json over CHAT_CONFIG_BYTES is left unread (parsed here, with the interpreter lock held, a
        tenant's 64 MiB one would stall every stream): a chat_template.jinja beside it is still compared."""
        cfg, jinja = adapter_dir / "tokenizer_config.json", adapter_dir / "chat_template.jinja"
        limit = CHAT_CONFIG_BYTES if max_bytes is None else min(max_bytes, CHAT_CONFIG_BYTES)
        try:
            try:
                config = json.loads(read_limited(cfg, limit).decode("utf-8")) if cfg.is_file() else {}
            except FileLimitError:
                config = {}
            if not isinstance(config, dict):
                return [], None
            template = _chat_templates(config.get("chat_template"), cfg).get("default")
            if jinja.is_file():
                template = read_limited(jinja, max_bytes).decode("utf-8")
        except (FileLimitError, TokenizerError, OSError, ValueError, RecursionError):
            return [], None
        notes, own = [], None
        if template and template.strip() != (self.chat_template or "").strip():
            notes.append("its chat template differs from the served base's, which renders its chats")
        theirs = _token(config.get("eos_token"))
        if theirs and self.eos_token and theirs != self.eos_token:
            known = self.token_to_id(theirs)
            own = known if known in self._tok.get_added_tokens_decoder() else None
            ends = ("both end its answers" if own is not None else "which ends its answers (the base's vocabulary "
                    + ("has no such token)" if known is None else "has it as an ordinary token)"))
            notes.append(f"its end-of-sequence token {theirs!r} is not the served base's {self.eos_token!r}: {ends}")
        return notes, own

    def _refuse_past(self, limit: int | None, texts: list[str], slack: int = 0) -> None:
        if limit is not None and (least := self.floor.at_least(texts, slack)) >= limit:
            raise PromptTooLong(least, limit)

    def _encode_piece(self, piece: str, is_text: bool) -> list[int]:
        """A piece from the middle of a prompt; `is_text`: with no added token matched. Encoded after a newline
        that is then dropped, so that a SentencePiece tokenizer adds no word-start space (transformers' way)."""
        encode = self._encode_text if is_text else self._ids
        newline = self._newline
        ids = encode("\n" + piece)
        ids = ids[len(newline):] if ids[:len(newline)] == newline else encode(piece)
        if is_text and self.token_to_id(piece) in ids:
            raise TokenizerError(f"the chat's text holds {piece!r}, which this model's tokenizer cannot encode as text")
        return ids

    def _encode_text(self, text: str) -> list[int]:
        """`text` encoded by the tokenizer's model alone, no added token matched (nor a special one)."""
        tok = self._tok
        text = tok.normalizer.normalize_str(text) if tok.normalizer is not None else text
        splits = [s for s, _ in tok.pre_tokenizer.pre_tokenize_str(text)] if tok.pre_tokenizer is not None else [text]
        return [t.id for split in splits for t in tok.model.tokenize(split)]

    @cached_property
    def _newline(self) -> list[int]:
        return self._tok.encode("\n", add_special_tokens=False).ids

    @cached_property
    def _frame(self) -> tuple[list[int], list[int]]:
        """The ids the tokenizer's post-processor puts before and after one sequence (Llama's BOS)."""
        bare = self._tok.encode("a", add_special_tokens=False).ids
        framed = self._tok.encode("a", add_special_tokens=True).ids
        at = next((i for i in range(len(framed) - len(bare) + 1) if framed[i:i + len(bare)] == bare), len(framed))
        return framed[:at], framed[at + len(bare):]

    def _with_bos(self, ids: list[int]) -> list[int]:
        """`ids` with BOS first where tokenizer_config.json's add_bos_token asks for it and it is not there."""
        bos = self.bos_token_id
        return [bos, *ids] if self.add_bos_token and bos is not None and (not ids or ids[0] != bos) else ids


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


def _chat_templates(value, cfg_path: Path) -> dict[str, str]:
    """chat_template: a string (the default), or named templates [{"name", "template"}, ...] of which "default"
    (else the first) and "tool_use" are taken."""
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        named = {t["name"]: t["template"] for t in value}
        default = named.get("default") or next(iter(named.values()), None)
        return {"default": default} | ({"tool_use": named["tool_use"]} if "tool_use" in named else {})
    raise TokenizerError(f"{cfg_path}: chat_template must be a string or a list of "
                         f"{{\"name\": ..., \"template\": ...}} objects, got {_short(value)}")


def _compile(source: str | None, path: Path) -> ChatTemplate | None:
    """The chat template, compiled; a template jinja2 cannot parse is a TokenizerError naming its file."""
    if not source:
        return None
    try:
        return ChatTemplate(source)
    except (jinja2.TemplateError, RecursionError) as exc:
        line = f" at line {exc.lineno}" if isinstance(exc, jinja2.TemplateSyntaxError) else ""
        raise _file_error(path, f"the chat template cannot be parsed by jinja2{line}", exc) from None


def _special_tokens(config: dict, cfg_path: Path) -> dict[str, Any]:
    """The variables of the special tokens (transformers' rule): each `*_token` whose value is a token, and
    the named `extra_special_tokens`; `additional_special_tokens` (or a list `extra_special_tokens`) as a list."""
    named = config.get("extra_special_tokens")
    tokens = {key: _token_text(value, cfg_path, key) if key in ("bos_token", "eos_token") else _token(value)
              for key, value in config.items() if key.endswith("_token")}
    tokens |= {key: _token(value) for key, value in (named.items() if isinstance(named, dict) else ())}
    extra = config.get("additional_special_tokens", named if isinstance(named, list) else None)
    if isinstance(extra, list):
        tokens["additional_special_tokens"] = [t for t in map(_token, extra) if t is not None]
    return {key: value for key, value in tokens.items() if value is not None}


def _token(value) -> str | None:
    """A token's text: a string, or {"content": ...} (older configs); None for anything else (add_bos_token)."""
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _token_text(value, cfg_path: Path, key: str) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TokenizerError(f"{cfg_path}: {key} must be a token string or {{\"content\": ...}}, got {_short(value)}")
    return value


def _short(value) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 80 else text[:77] + "..."
