"""The sampling options both OpenAI endpoints share, parsed from a request body into SamplingOptions.

OpenAI's fields, and vLLM's extensions a vLLM client sends: `top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, `min_tokens`, `skip_special_tokens`,
`prompt_logprobs` (0..20, as vLLM's default max_logprobs; refused with `stream`, as vLLM does),
`response_format` ("text", "json_object" or "json_schema", on both endpoints as vLLM takes it) and vLLM's
`structured_outputs`, `guided_json`, `guided_choice`, `guided_regex` and `guided_grammar` (GBNF, gbnf.py)
(`spaces_between_special_tokens` only at its default, true: the `tokenizers` decoder places special
tokens its own way, as vLLM's fast-tokenizer path does). What depends on the model (token ids within
its vocabulary, `min_tokens` within the context left by the prompt) is checked in completion_job.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from lorafleet.worker.choice_grammar import ChoiceError, ChoiceGrammar
from lorafleet.worker.gbnf import GbnfGrammar
from lorafleet.worker.json_constraint import COMPACT_JSON_OBJECT
from lorafleet.worker.json_schema import SchemaError
from lorafleet.worker.json_schema_grammar import SchemaGrammar, schema_grammar
from lorafleet.worker.logit_bias import LogitBiasError, parse_logit_bias
from lorafleet.worker.openai_fields import Fields, bad_request, check_text, is_id_list
from lorafleet.worker.regex_dfa import RegexError
from lorafleet.worker.regex_grammar import RegexGrammar, TextGrammar
from lorafleet.worker.sampling_defaults import RANGES, SamplingDefaults
from lorafleet.worker.sampling_params import MAX_LOGPROBS

MAX_PROMPT_LOGPROBS = MAX_LOGPROBS  # vLLM's default max_logprobs

# Wider than OpenAI's API (4 stops), as vLLM's: evaluation harnesses send many stop strings. A request's
# sequences (prompts x n) are held to what the worker runs and queues at once as well (openai_api.py).
MAX_N = 256
MAX_STOP = 64
# Characters of all stop strings together: each token's check scans a window as long as the longest one for
# every one of them, on the engine thread every sequence shares.
MAX_STOP_CHARS = 4096
MAX_STOP_TOKEN_IDS = 64
STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_choice", "guided_regex",
                     "guided_grammar")  # one per request
RESPONSE_FORMATS = {"text": set(), "json_object": {"schema"}, "json_schema": {"json_schema"}}  # type -> its other keys
JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}
STREAM_OPTIONS = ("include_usage", "include_obfuscation", "continuous_usage_stats")


@dataclass(slots=True)
class SamplingOptions:
    """The per-request options shared by both endpoints, before the engine's SamplingParams."""

    max_tokens: int | None = None  # None: up to the end of the context, or default_max_tokens
    default_max_tokens: int | None = None  # chat: the model's max_new_tokens for an unset max_tokens
    max_tokens_param: str = "max_tokens"  # the field that set it: errors name what the caller sent
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off (vLLM's -1 is accepted as off too)
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # number of top alternatives per token; None = no logprobs
    echo: bool = False  # completions: each choice's text (and logprobs) starts with the prompt's
    prompt_logprobs: int | None = None  # vLLM extension: per prompt token, its logprob and the top k; None = off
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats (with include_usage)
    user: str | None = None
    ignore_eos: bool = False  # vLLM extension: generate max_tokens even past end-of-sequence (benchmarks)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # vLLM extension (transformers' semantics); unset: the model's default
    logit_bias: dict[int, float] | None = None  # token id -> bias; the ids' vocabulary check: completion_job.py
    min_p: float = 0.0  # vLLM extension; unset: the model's default
    # vLLM extensions: token ids that end the request like EOS (vocabulary check: completion_job.py); the
    # matched stop string (or stop token's text) kept in the text; tokens generated before EOS, a stop
    # token or a stop string may end it; special tokens left out of the text.
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    json_object: bool = False  # response_format {"type": "json_object"}: JSON mode (json_guide.py)
    grammar: Any = None  # structured output: a schema's grammar (json_schema_grammar.py), or choices' (choice_grammar.py)
    grammar_param: str | None = None  # the field that set it: errors name what the caller sent
    request_id: str | None = None  # vLLM's: the answer's id is cmpl-/chatcmpl- and it (the engine's ids stay unique)
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks are shared only with requests of the same salt


def _user(f: Fields) -> str | None:
    """`user`, else OpenAI's successor of it, `safety_identifier`: who the request is for (the canary split).
    Both are read, so each is type-checked and neither is refused as unknown when both are sent."""
    user, safety_identifier = f.string("user"), f.string("safety_identifier")
    return user or safety_identifier


MAX_REQUEST_ID = 256  # characters of a caller's request_id


def _vllm_fields(f: Fields) -> tuple[str | None, str | None]:
    """vLLM's own request fields that clients written for it send: those that change nothing here are
    type-checked and ignored, those whose effect would be silently lost are accepted only at their no-op
    value; the caller's `request_id` and `cache_salt`."""
    cache_salt = f.string("cache_salt")
    if cache_salt is not None and not cache_salt.strip():  # vLLM's: a non-empty string (any length the body allows)
        raise bad_request("'cache_salt' must be a non-empty string", "cache_salt")
    f.flag("include_reasoning", True)  # the model has no reasoning mode: nothing is held back either way
    f.neutral("use_beam_search", False, "beam search is not implemented; use n")
    f.neutral("length_penalty", 1.0, "it applies to beam search, which is not implemented")
    f.neutral("early_stopping", False, "it applies to beam search, which is not implemented")
    f.neutral("priority", 0, "requests are scheduled by arrival within their tenant's share")
    f.neutral("truncate_prompt_tokens", None, "prompts are never cut: a prompt too long is answered 400")
    f.neutral("allowed_token_ids", None, "use logit_bias or guided_choice")
    f.neutral("bad_words", [], "use logit_bias")
    f.neutral("return_tokens_as_token_ids", False, "logprobs name tokens by their text")
    f.neutral("detokenize", True, "the output is always text")
    request_id = f.string("request_id")
    if request_id is not None and not 0 < len(request_id) <= MAX_REQUEST_ID:
        raise bad_request(f"'request_id' must be 1 to {MAX_REQUEST_ID} characters", "request_id")
    return request_id, cache_salt


def _stop(f: Fields) -> list[str]:
    v = f.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > MAX_STOP:
        raise bad_request(f"'stop' takes at most {MAX_STOP} sequences (got {len(stops)})", "stop")
    if any(s == "" for s in stops):
        raise bad_request("'stop' sequences must not be empty", "stop")
    if (chars := sum(map(len, stops))) > MAX_STOP_CHARS:
        raise bad_request(f"'stop' sequences take at most {MAX_STOP_CHARS} characters together (got {chars})",
                          "stop")
    return [check_text(s, "stop") for s in stops]


def _stop_token_ids(f: Fields) -> list[int]:
    """vLLM's `stop_token_ids`: a list of token ids (their upper bound, the vocabulary: completion_job.py)."""
    v = f.get("stop_token_ids")
    if v is None:
        return []
    if not is_id_list(v):
        raise bad_request("'stop_token_ids' must be a list of token ids (integers)", "stop_token_ids", "invalid_type")
    if len(v) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"'stop_token_ids' takes at most {MAX_STOP_TOKEN_IDS} token ids (got {len(v)})",
                          "stop_token_ids")
    if any(t < 0 for t in v):
        raise bad_request("'stop_token_ids' must hold token ids >= 0", "stop_token_ids")
    return list(v)


def _min_tokens(f: Fields, max_tokens: int | None, max_tokens_param: str) -> int:
    """vLLM's `min_tokens`: at most `max_tokens` (when the context bounds it instead: completion_job.py)."""
    min_tokens = f.integer("min_tokens", 0, 0)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must not exceed '{max_tokens_param}' ({max_tokens})",
                          "min_tokens")
    return min_tokens


def _response_format(f: Fields, compact: bool = False) -> tuple[bool, Any]:
    """OpenAI's `response_format` (vLLM takes it on /v1/completions too): "text"; "json_object" for JSON mode;
    "json_schema" (`{"name", "schema", "strict", "description"}`) for structured output, the output held to the
    schema (json_schema.py says which keywords, and refuses the others rather than ignore them). LoRAX's form,
    `{"type": "json_object", "schema": {...}}`, is the same. -> (constrained, the schema's grammar or None)."""
    v = f.get("response_format")
    if v is None:
        return False, None
    kind = v.get("type") if isinstance(v, dict) else None
    if not isinstance(kind, str):
        raise bad_request('\'response_format\' must be an object like {"type": "json_object"} or {"type": "text"}',
                          "response_format", "invalid_type")
    if kind not in RESPONSE_FORMATS:
        raise bad_request(f"'response_format' type must be one of {', '.join(RESPONSE_FORMATS)} (got {json.dumps(kind)})",
                          "response_format")
    allowed = RESPONSE_FORMATS[kind]
    if extra := sorted(set(v) - allowed - {"type"}):
        takes = f"only 'type' and {', '.join(repr(k) for k in sorted(allowed))}" if allowed else "only 'type'"
        raise bad_request(f"'response_format' of type '{kind}' takes {takes} (got {', '.join(extra)})", "response_format")
    if kind == "text":
        return False, None
    if kind == "json_object":
        if "schema" in v:
            return True, _schema(v["schema"], "response_format.schema", compact=compact)
        return True, (COMPACT_JSON_OBJECT if compact else None)
    spec = v.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise bad_request('\'response_format.json_schema\' must be an object like {"name": ..., "schema": {...}}',
                          "response_format", "invalid_type")
    if extra := sorted(set(spec) - JSON_SCHEMA_FIELDS):
        raise bad_request(f"'response_format.json_schema' takes only {', '.join(sorted(JSON_SCHEMA_FIELDS))} (got "
                          f"{', '.join(extra)})", "response_format")
    for key, kinds in (("name", str), ("description", str), ("strict", bool)):
        if spec.get(key) is not None and not isinstance(spec[key], kinds):
            raise bad_request(f"'response_format.json_schema.{key}' must be a {kinds.__name__}", "response_format",
                              "invalid_type")
    return True, _schema(spec["schema"], "response_format.json_schema.schema", compact=compact)


def _schema(schema: object, where: str, param: str = "response_format", compact: bool = False) -> SchemaGrammar:
    """The grammar of a request's schema (`compact`: no whitespace between JSON's tokens); a 400 naming what
    cannot be enforced."""
    try:
        return schema_grammar(schema, compact)
    except SchemaError as exc:
        raise bad_request(f"'{where}': {exc}", param) from None


def _structured_output(f: Fields) -> tuple[bool, Any, str | None]:
    """-> (constrained, grammar or None, the field that asked for it), from `response_format` or vLLM's fields: `structured_outputs`
    (`{"json": <schema>}`, `{"choice": [...]}`, `{"regex": ...}`, `{"grammar": <GBNF>}` or `{"json_object": true}`,
    with `"disable_any_whitespace": true` no whitespace between JSON's tokens, as vLLM's xgrammar backend) and
    the older `guided_json` (a schema, or its JSON text), `guided_choice`, `guided_regex` and `guided_grammar`
    (the whole text matches). One of them at most."""
    given = [name for name in STRUCTURED_FIELDS if f.get(name) is not None]
    # A preference among vLLM's backends: this server has one of its own. Older vLLM clients asked for JSON
    # without whitespace between its tokens with the option `xgrammar:disable-any-whitespace`: honoured.
    compact = "disable-any-whitespace" in (f.string("guided_decoding_backend") or "")
    f.neutral("guided_whitespace_pattern", None, "JSON whitespace is not configurable here")
    if len(given) > 1:
        raise bad_request(f"send one of {', '.join(repr(g) for g in given)}: each sets what the output is held to",
                          given[1])
    field = given[0] if given else None
    if field is None or field == "response_format":
        return (*_response_format(f, compact), field)
    name, v, kind = field, f.get(field), {"guided_json": "json", "guided_choice": "choice", "guided_regex": "regex",
                                          "guided_grammar": "grammar"}.get(field)
    if field == "structured_outputs":
        kinds = [k for k in v if k != "disable_any_whitespace"] if isinstance(v, dict) else []
        if len(kinds) != 1 or kinds[0] not in ("json", "choice", "regex", "grammar", "json_object") \
                or len(v) - len(kinds) > 1:
            raise bad_request("'structured_outputs' takes one of 'json' (a schema), 'choice' (a list of strings), "
                              "'regex' (a pattern the whole text matches), 'grammar' (GBNF) or 'json_object': true, "
                              "and 'disable_any_whitespace'", name)
        compact = v.get("disable_any_whitespace", compact)
        if not isinstance(compact, bool):
            raise bad_request("'structured_outputs.disable_any_whitespace' must be true or false", name, "invalid_type")
        kind, v = kinds[0], v[kinds[0]]
        if kind == "json_object":
            if not isinstance(v, bool):
                raise bad_request("'structured_outputs.json_object' must be true or false", name, "invalid_type")
            return v, (COMPACT_JSON_OBJECT if v and compact else None), field
        name = f"structured_outputs.{kind}"
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except (ValueError, RecursionError) as exc:
                why = exc if isinstance(exc, ValueError) else "nested too deeply"
                raise bad_request(f"'{name}' must be a JSON schema (an object, or its JSON text): {why}", field) from None
        return True, _schema(v, name, field, compact), field
    if kind in ("regex", "grammar"):
        if not isinstance(v, str):
            what = "a regular expression" if kind == "regex" else "a GBNF grammar"
            raise bad_request(f"'{name}' must be {what} (a string)", field, "invalid_type")
        try:
            return True, RegexGrammar(v) if kind == "regex" else GbnfGrammar(v), field
        except RegexError as exc:
            raise bad_request(f"'{name}': {exc}", field) from None
    try:
        return True, ChoiceGrammar(v), field
    except ChoiceError as exc:
        raise bad_request(f"'{name}' {exc}", field) from None


def _stream_options(v: object, stream: bool) -> tuple[bool, bool]:
    """`stream_options` -> (include_usage, continuous_usage). OpenAI's `include_obfuscation` is accepted and
    ignored: it pads chunks against a length side channel, the text is the same without it. vLLM's
    `continuous_usage_stats` puts the running usage in every chunk, with include_usage (as vLLM), which it
    turns on where left out."""
    if v is None:
        return False, False
    if not isinstance(v, dict):
        raise bad_request(f"'stream_options' must be an object (got {json.dumps(v)})", "stream_options", "invalid_type")
    unknown = sorted(set(v) - set(STREAM_OPTIONS))
    if unknown:
        raise bad_request(f"'stream_options' takes only {', '.join(STREAM_OPTIONS)} (got {', '.join(unknown)})",
                          "stream_options")
    if not stream:
        raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
    for key, value in v.items():
        if value is not None and not isinstance(value, bool):
            raise bad_request(f"'stream_options.{key}' must be true or false (got {json.dumps(value)})",
                              "stream_options", "invalid_type")
    continuous = bool(v.get("continuous_usage_stats"))
    # Left out: OpenAI's default (no usage), but asking for continuous usage asks for usage (vLLM defaults it on).
    include_usage = bool(v["include_usage"]) if "include_usage" in v else continuous
    return include_usage, include_usage and continuous


def _ranged(f: Fields, name: str, default: float) -> float:
    """A field whose range a model's default shares (sampling_defaults.RANGES)."""
    r = RANGES[name]
    return f.number(name, default, r.lo, r.hi, lo_open=r.lo_open)


def parse_sampling_options(f: Fields, max_tokens_names: tuple[str, ...], default_max_tokens: int | None,
                           defaults: SamplingDefaults, least_max_tokens: int = 1) -> SamplingOptions:
    """The fields both endpoints share; ``defaults``: what an unset temperature, top_p, top_k, min_p or
    repetition_penalty means (the model's, sampling_defaults.py); ``least_max_tokens``: 0 where a request
    may only score its prompt (completions with echo)."""
    max_tokens, max_tokens_param = default_max_tokens, max_tokens_names[0]
    for name in max_tokens_names:  # the later name wins (chat: max_completion_tokens over max_tokens)
        value = f.integer(name, None, least_max_tokens)
        if value is not None:
            max_tokens, max_tokens_param = value, name
    stream = f.flag("stream", False)
    include_usage, continuous_usage = _stream_options(f.get("stream_options"), stream)
    try:
        logit_bias = parse_logit_bias(f.get("logit_bias"))
    except LogitBiasError as exc:
        raise bad_request(str(exc), "logit_bias", exc.code) from None
    if not f.flag("spaces_between_special_tokens", True):
        raise bad_request("'spaces_between_special_tokens': false is not supported by this server (special "
                          "tokens are decoded as the tokenizer's decoder places them)",
                          "spaces_between_special_tokens", "unsupported_parameter")
    prompt_logprobs = f.integer("prompt_logprobs", None, 0, MAX_PROMPT_LOGPROBS)
    json_object, grammar, grammar_param = _structured_output(f)
    if prompt_logprobs is not None and stream:
        raise bad_request("'prompt_logprobs' is not available with 'stream': true", "prompt_logprobs")
    options = SamplingOptions(
        max_tokens=max_tokens,
        prompt_logprobs=prompt_logprobs,
        max_tokens_param=max_tokens_param,
        temperature=_ranged(f, "temperature", defaults.temperature),
        top_p=_ranged(f, "top_p", defaults.top_p),
        top_k=max(0, f.integer("top_k", defaults.top_k, -1, 1 << 20)),
        n=f.integer("n", 1, 1, MAX_N),
        seed=f.integer("seed", None, -(2**63), 2**63 - 1),
        stop=_stop(f),
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        user=_user(f),
        ignore_eos=f.flag("ignore_eos", False),
        presence_penalty=f.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_ranged(f, "repetition_penalty", defaults.repetition_penalty),
        logit_bias=logit_bias,
        min_p=_ranged(f, "min_p", defaults.min_p),
        stop_token_ids=_stop_token_ids(f),
        include_stop_str_in_output=f.flag("include_stop_str_in_output", False),
        min_tokens=_min_tokens(f, max_tokens, max_tokens_param),
        skip_special_tokens=f.flag("skip_special_tokens", True),
        json_object=json_object,
        grammar=grammar,
        grammar_param=grammar_param,
    )
    options.request_id, options.cache_salt = _vllm_fields(f)
    if isinstance(grammar, (ChoiceGrammar, TextGrammar)) and (options.ignore_eos or options.min_tokens):
        raise bad_request(f"'{grammar_param}' cannot be combined with 'ignore_eos' or 'min_tokens': the text is exactly "
                          "what it allows, which nothing may pad", grammar_param)
    return options
