"""Checks the structured-output grammar tests share: a text against the grammar and the `jsonschema` reference
validator, random byte walks, and a vocabulary's cached masks against a token-by-token check."""

from __future__ import annotations

import json
import random

import jsonschema

from lorafleet.worker.json_schema_grammar import DONE, schema_grammar
from lorafleet.worker.json_vocab import JsonVocab


def accepts(schema: dict, text: str) -> bool:
    grammar = schema_grammar(schema)
    return grammar.advance(grammar.start, text.encode()) == DONE


def check_text(schema: dict, text: str, ok: bool) -> None:
    """The grammar takes `text` exactly when `ok`; a text it takes, the reference validator takes too."""
    assert accepts(schema, text) is ok
    if ok:
        jsonschema.Draft202012Validator(schema).validate(json.loads(text))


def allowed(grammar, state) -> list[int]:
    return [b for b in range(256) if grammar.advance(state, bytes((b,))) is not None]


def walk(grammar, rng: random.Random, max_bytes: int = 600) -> str | None:
    """A random value of the grammar, byte by byte (closing bytes favoured as it grows); None if none ended."""
    state, out = grammar.start, bytearray()
    for step in range(max_bytes):
        ways = allowed(grammar, state)
        assert ways, bytes(out)  # a state the grammar reaches always has a way on
        closing = [b for b in ways if b in b'"}]0']
        pick = rng.choice(closing) if closing and rng.random() < min(0.9, step / 80) else rng.choice(ways)
        out.append(pick)
        state = grammar.advance(state, bytes((pick,)))
        if state == DONE:
            return out.decode()
    return None


def walks_validate(schema: dict, seed: int, tries: int, at_least: int, max_bytes: int = 600) -> list[str]:
    """`tries` random walks of the schema's grammar: at least `at_least` end, each a value the reference
    validator takes. Returns them."""
    grammar, rng = schema_grammar(schema), random.Random(seed)
    validator = jsonschema.Draft202012Validator(schema)
    done = [t for t in (walk(grammar, rng, max_bytes) for _ in range(tries)) if t is not None]
    assert len(done) >= at_least
    for text in done:
        validator.validate(json.loads(text))
    return done


def check_masks(vocab: JsonVocab, grammar, rng: random.Random, walks: int, steps: int) -> int:
    """Random token walks of the grammar over `vocab`: at every state, for may_complete True and False, the
    cached mask equals a token-by-token check. Returns how many masks were checked."""
    checked = 0
    for _ in range(walks):
        state = grammar.start
        for _ in range(steps):
            for may_complete in (True, False):
                invalid, num_valid = vocab.mask(state, may_complete, grammar)
                expect = [vocab.accepts(state, t, may_complete, grammar) for t in range(vocab.vocab_size)]
                assert (~invalid).tolist() == expect and num_valid == sum(expect), state
                checked += 1
            nxt = [t for t, ok in enumerate(expect) if ok]
            if not nxt or grammar.is_complete(state):
                break
            state = grammar.advance(state, vocab.token_bytes(rng.choice(nxt)))
    return checked
