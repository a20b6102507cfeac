"""ToolCalls: how one chat request's choices answer with tool calls, whole or streamed.

tool_choice "auto": each choice's text is read by the request's ToolParser; calls found make the message's
`tool_calls` (`content`: the text before them, or null) and its finish_reason "tool_calls". A named function
(tool_choice `{"type": "function", ...}`): the output was held to one JSON object (JSON mode) and is that
function's arguments, as vLLM answers it (an output that is exactly `{"name": <that function>, "arguments"
or "parameters": {...}}` gives the inner object); the finish_reason stays the engine's ("stop", or "length" for
arguments cut short), as OpenAI answers a forced call (its documentation: "stop" when tool_choice names a
function) and vLLM does too. tool_choice "required": the output was held to a JSON array of calls
(tool_request.py) and each item is a call (its arguments the parameters' text as written, tool_call_array.py),
finish_reason "tool_calls"; an array cut short (max_tokens, a stop string) answers the calls begun, the last
one's arguments cut short, with the engine's finish_reason (content, where no call's name was written). tool_choice "none" needs
none of this: the output is plain content.

Streamed, a named function held to its schema streams its arguments as they are generated: the first delta
carries the call's index, id, type and name, each later one a piece of `function.arguments` (as OpenAI
streams a forced call). "required" calls stream the same way, each once its name is written, with its index
in the array. Otherwise a choice's text goes out as content up to where it may be the start of a
call (ToolParser.hold_from);
the rest is held until the choice ends, then sent as content, or as `delta.tool_calls` (each call whole, with
its index, id and name) with finish_reason "tool_calls". Chunks keep carrying the logprobs of their tokens
while text is held, as they do for text held back by a possible stop string: a stream's logprobs are the
same, token for token, as the whole answer's, which gives the logprobs of every generated token, calls too.
"""

from __future__ import annotations

from typing import Any

from lorafleet.worker.openai_fields import APIError
from lorafleet.worker.tool_call_array import CallArray
from lorafleet.worker.tool_parser import ToolCall, ToolParser, json_value, read_call, tool_parser
from lorafleet.worker.tool_request import ToolRequest

_JSON_WS = " \t\n\r"  # JSON's whitespace


class ToolStream:
    """One streamed choice: its text so far, and the end of it not sent yet. Each chunk costs about its own
    length: the parser looks at the held text only (a few characters that may begin a call), and not at all
    once a call has begun."""

    def __init__(self, parser: ToolParser | None) -> None:
        self.parser = parser  # None: hold it all (a named function's arguments)
        self.pieces: list[str] = []
        self.held = ""  # the text after what went out as content, while some of it may still go out
        self.num_sent = 0  # characters sent as content
        self.is_call = parser is None  # all of the rest is held to the end

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def feed(self, new_text: str) -> str:
        """The content to send now, given the choice's new text."""
        self.pieces.append(new_text)
        if self.is_call:
            return ""
        self.held += new_text
        cut = self.parser.hold_from(self.held, at_start=self.num_sent == 0)
        out, self.held = self.held[:cut], self.held[cut:]
        self.num_sent += cut
        self.is_call = self.parser.call_begins(self.held)
        return out


class ToolCalls:
    def __init__(self, request: ToolRequest, parser: ToolParser) -> None:
        self.request = request
        self.parser = parser
        self.names = frozenset(request.names)
        self._streams: dict[int, ToolStream] = {}  # choice index -> its stream
        self._calls_sent: set[int] = set()  # choices whose named call went out (its arguments stream after it)
        self._args_begun: set[int] = set()  # choices whose named call's arguments began (past any whitespace)
        self._arrays: dict[int, tuple[CallArray, list[str]]] = {}  # "required" choices: the calls read, the text

    @classmethod
    def of(cls, request: ToolRequest | None, tokenizer, parser_name: str) -> ToolCalls | None:
        """The request's tool calls (None: no tools, or tool_choice "none"). Refuses tools for a model whose chat
        template takes none, unless tool_choice is "none" (no call is wanted: agent frameworks send their tools
        with every turn). vLLM renders such a template without them and answers as if they had never been sent;
        here that is a 400, so a caller does not mistake a model that never saw the tools for one that chose not
        to call them."""
        template = tokenizer.template_for(request.tools) if request is not None and tokenizer is not None else None
        if template is None or request.choice == "none":  # no tools, no template (tokenizing says so), or no call
            return None
        if not template.takes_tools:
            raise APIError(400, "this model's chat template takes no tools (it never reads `tools`), so they would "
                                "not reach the model; send the request without 'tools', or serve a model whose "
                                "template renders them", code="invalid_value", param="tools")
        return cls(request, tool_parser(parser_name, template.source))

    def calls(self, text: str, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content, calls, finish_reason) of a choice's whole text."""
        if self.request.choice == "named":
            return None, [ToolCall(self.request.function, self._named_arguments(text))], finish_reason
        if self.request.choice == "required":
            array = CallArray()
            array.feed(text)
            return self._required(text, array, finish_reason)
        parsed = self.parser.parse(text, self.names)
        if parsed is None:
            return text, [], finish_reason
        content, calls = parsed
        calls = calls if self.request.parallel_tool_calls else calls[:1]
        if not all(self._fits_strict(c) for c in calls):
            return text, [], finish_reason
        return content, calls, "tool_calls"

    @staticmethod
    def _required(text: str, array: CallArray, finish_reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """A "required" choice's answer: its calls, finish_reason "tool_calls" once the array closed; cut short
        (max_tokens, a stop string), the calls begun so far with the engine's finish_reason, as a named call cut
        short is answered; content where no call's name was written yet."""
        calls = array.calls()
        if not calls:
            return text, [], finish_reason
        return None, calls, "tool_calls" if array.done else finish_reason

    def _fits_strict(self, call: ToolCall) -> bool:
        """Whether a parsed call's arguments fit its function's schema, where the function says strict: true."""
        if call.name not in self.request.strict:
            return True
        grammar = self.request.grammars.get(call.name)
        return grammar is not None and grammar.validates(json_value(call.arguments))

    def _named_arguments(self, text: str) -> str:
        """A named function's arguments: the output, or the object inside it when the output is exactly
        `{"name": <that function>, "arguments" (or "parameters"): {...}}`, the call a model prompted the Hermes
        or Qwen way writes."""
        if self.request.output_grammar is not None:  # held to the function's own schema: the output is its arguments
            return text.lstrip(_JSON_WS)  # as OpenAI's begin: the SDK's partial parse fails on whitespace alone
        obj, keys = json_value(text), ("arguments", "parameters")
        wrapped = isinstance(obj, dict) and len(obj) == 2 and any(k in obj for k in keys)  # the name and one of them
        call = read_call(obj, (self.request.function,), keys) if wrapped else None
        return text if call is None else call.arguments

    def _arguments_delta(self, index: int, new_text: str, finish_reason: str | None) -> list[dict]:
        """A named call's streamed piece: the call itself first (arguments so far), then its arguments' new text;
        whitespace before the arguments' first character is left out (`_named_arguments`)."""
        if index not in self._args_begun:
            new_text = new_text.lstrip(_JSON_WS)
            if new_text:
                self._args_begun.add(index)
        if finish_reason is not None:
            self._args_begun.discard(index)
        if index not in self._calls_sent:
            self._calls_sent.add(index)
            call = ToolCall(self.request.function, new_text)
            out = [{"index": 0} | call.openai()]
        else:
            out = [{"index": 0, "function": {"arguments": new_text}}] if new_text else []
        if finish_reason is not None:
            self._calls_sent.discard(index)
        return out

    def _required_delta(self, index: int, new_text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """A "required" choice's streamed piece: each call once its name is read, then its arguments as they come;
        at the end, the text as content where no call began (as the whole answer gives it)."""
        array, text = self._arrays.setdefault(index, (CallArray(), []))
        text.append(new_text)
        array.feed(new_text)
        deltas = array.deltas()
        if finish_reason is None:
            return "", deltas, None
        del self._arrays[index]
        content, _, finish_reason = self._required("".join(text), array, finish_reason)
        return content or "", deltas, finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's `message` and finish_reason."""
        content, calls, finish_reason = self.calls(text, finish_reason)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message, finish_reason

    def delta(self, index: int, new_text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """A streamed chunk of choice `index`: (content to send, `delta.tool_calls`, finish_reason); its
        finish_reason, when set, ends the choice."""
        if self.request.choice == "named" and self.request.output_grammar is not None:
            return "", self._arguments_delta(index, new_text, finish_reason), finish_reason
        if self.request.choice == "required":
            return self._required_delta(index, new_text, finish_reason)
        if index not in self._streams:
            self._streams[index] = ToolStream(None if self.request.choice == "named" else self.parser)
        stream = self._streams[index]
        content = stream.feed(new_text)
        if finish_reason is None:
            return content, [], None
        del self._streams[index]
        text = stream.text
        whole, calls, finish_reason = self.calls(text, finish_reason)
        if not calls:  # all of it is content: the rest of it goes now
            return content + text[stream.num_sent:], [], finish_reason
        # content is the text before the calls, and at most that went out (hold_from)
        rest = (whole or "")[stream.num_sent:]
        return content + rest, [{"index": k} | c.openai() for k, c in enumerate(calls)], finish_reason
