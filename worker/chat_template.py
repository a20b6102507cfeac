"""ChatTemplate: a model's chat template, compiled once when its tokenizer loads and rendered as transformers'
`apply_chat_template` renders it.

The jinja2 environment is transformers': a sandbox that cannot change what it is given, `trim_blocks` and
`lstrip_blocks`, loop controls (`{% break %}`, `{% continue %}`), `raise_exception`, `strftime_now`,
`tojson` with transformers' arguments (`ensure_ascii`, `indent`, `separators`, `sort_keys`) and no HTML
escaping, and the `{% generation %}` tag of TRL-prepared templates (it marks the assistant's tokens for
training masks; here its body is simply rendered). A template jinja2 cannot parse fails where it is compiled,
when the worker starts, not on every request.

A "developer" message (OpenAI's newer name for the system role, sent by recent clients) is rendered as
"system" unless the template tests for "developer" itself (gpt-oss's does): templates that do not know the
role render a turn the model never saw (Llama 3, SmolLM2), drop it silently (Qwen2.5) or raise (Mistral).

`continue_final_message` (vLLM's and transformers' option) leaves the last message open, without the
template's end of turn, so that the model continues it: the message is rendered with a tag after its text and
the prompt is cut at the tag (transformers' tag and rule, so the prompts are the same).

A request's `tools` are the template's `tools` variable, as transformers passes them. Whether the template
reads that variable at all is known when it compiles (`takes_tools`): a request with tools for a template
that does not is refused (tool_calls.py) rather than rendered without them, unless its tool_choice is "none".
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta
import jinja2.nodes
from jinja2.defaults import DEFAULT_NAMESPACE
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "  # transformers': its rule for a template that trims the tag's space
GLOBALS = ("raise_exception", "strftime_now")
# What a request's chat_template_kwargs may not set: the variables the worker passes (the tokenizer's special
# tokens are its `*_token` names, as transformers names them), the template's functions, and vLLM's refused ones.
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                      "additional_special_tokens", "chat_template", "tokenize", *GLOBALS, *DEFAULT_NAMESPACE})


def is_reserved(name: str) -> bool:
    """Whether chat_template_kwargs may not set `name` (see RESERVED)."""
    return name in RESERVED or name.endswith("_token")


class ChatTemplateError(jinja2.TemplateError):
    """The template failed on these messages: an error of its code (a TypeError adding a list to a string, a
    ValueError, a LookupError, an ArithmeticError), or a message continue_final_message cannot continue."""


@dataclass(slots=True)
class ChatTemplateOptions:
    """How one chat becomes a prompt: vLLM's request fields of the same names."""

    add_generation_prompt: bool = True  # the template's start of an assistant turn after the messages
    continue_final_message: bool = False  # the last message left open for the model to continue
    kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs: more template variables
    add_special_tokens: bool = False  # the tokenizer's BOS/EOS around the rendered prompt (the template has its own)


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: its body, rendered in place."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTemplate:
    def __init__(self, source: str) -> None:
        """Raises jinja2.TemplateSyntaxError for a template jinja2 cannot parse."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        self.source = source
        self._template = env.from_string(source)
        tree = env.parse(source)
        strings = [node.value for node in tree.find_all(jinja2.nodes.Const) if isinstance(node.value, str)]
        # A string constant of its code (a role test, a list of roles), not words of its text ("You are a developer").
        self.knows_developer = "developer" in strings
        # The text it writes itself, strings apart ("\0" cannot join two): where its control tokens are written.
        self.literal_text = "\0".join([*(node.data for node in tree.find_all(jinja2.nodes.TemplateData)), *strings])
        self.takes_tools = "tools" in jinja2.meta.find_undeclared_variables(tree)

    def render(self, messages: list[dict[str, Any]], variables: dict[str, Any], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text; `variables`: the tokenizer's special tokens and the request's chat_template_kwargs;
        `tools`: the request's tools (None: none, as transformers passes no tools).
        Raises jinja2.TemplateError: the template's raise_exception, or a ChatTemplateError."""
        if not self.knows_developer:
            messages = [m | {"role": "system"} if m.get("role") == "developer" else m for m in messages]
        final = messages[-1].get("content", "") if continue_final_message else ""
        if continue_final_message:
            messages = [*messages[:-1], messages[-1] | {"content": final + CONTINUE_TAG}]
        try:
            text = self._template.render(variables | {
                "messages": messages, "tools": tools or None, "documents": None, "add_generation_prompt": add_generation_prompt})
        except (TypeError, ValueError, LookupError, ArithmeticError) as exc:
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc
        if not continue_final_message:
            return text
        tag = CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ChatTemplateError("continue_final_message: the chat template does not render the final message's "
                                    "text as it is, so it cannot be continued")
        at = text.rindex(tag)
        return text[:at] if text.startswith(CONTINUE_TAG, at) else text[:at].rstrip()  # a trimmed message: no space
