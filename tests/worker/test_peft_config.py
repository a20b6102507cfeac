"""adapter_config.json checks (worker/peft_config.py): a malformed field is an AdapterError that names
it, never a TypeError or a regex error from deep inside PEFT's matching rules."""

from __future__ import annotations

import json
import re
import time

import pytest
import torch

from lorafleet.worker.peft_adapter import AdapterError, load_peft_adapter
from tests.ticker import ticking
from tests.worker.test_peft_adapter import make_adapter

pytest.importorskip("peft")


@pytest.mark.parametrize(("changes", "field"), [
    ({"target_modules": "q_proj|["}, "target_modules"),
    ({"target_modules": [1]}, "target_modules"),
    ({"target_modules": 5}, "target_modules"),
    ({"exclude_modules": "["}, "exclude_modules"),
    ({"exclude_modules": 5}, "exclude_modules"),
    ({"layers_to_transform": "01"}, "layers_to_transform"),
    ({"layers_to_transform": [0, "1"]}, "layers_to_transform"),
    ({"layers_to_transform": [0], "layers_pattern": ["layers", "("]}, "layers_pattern"),
    ({"layers_to_transform": [0], "layers_pattern": {"layers": 1}}, "layers_pattern"),
    ({"rank_pattern": {"q_proj(": 4}}, "rank_pattern"),
    ({"alpha_pattern": {"*q_proj": 4}}, "alpha_pattern"),
    ({"base_model_name_or_path": 5}, "base_model_name_or_path"),
], ids=["target_regex", "target_int_item", "target_int", "exclude_regex", "exclude_int",
        "layers_str", "layers_str_item", "layers_pattern_regex", "layers_pattern_dict", "rank_pattern_regex", "alpha_pattern_regex", "base_model_int"])
def test_malformed_fields_are_adapter_errors_naming_the_field(changes, field, tmp_path):
    from tests.worker.test_peft_adapter import tiny_base

    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    config_path = tmp_path / "x" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changes}))
    with pytest.raises(AdapterError, match=field):
        load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32,
                          base_model_name="org/tiny-llama")


def test_well_formed_optional_fields_still_load(tmp_path):
    from tests.worker.test_peft_adapter import tiny_base

    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], layers_to_transform=[1],
                 rank_pattern={"v_proj": 4}, alpha_pattern={r"layers\.1\.self_attn\.q_proj": 16})
    w = load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32)
    assert sorted(w.modules) == [(1, "q_proj"), (1, "v_proj")]
    assert w.modules[(1, "q_proj")].scale == 4.0 and w.modules[(1, "v_proj")].scale == 2.0


def _trained(pm, seed: int = 0):
    """Random non-zero steps on every LoRA weight, as training would leave them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return pm.eval()


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora"])
def test_adapter_trained_against_a_changed_base_is_refused(init, tmp_path):
    """PiSSA/OLoRA subtract their initial B @ A from the base weights: on the served, unmodified base the
    adapter's outputs differ from PEFT's, so it is refused, naming the way to convert it."""
    import peft

    from tests.worker.test_peft_adapter import tiny_base

    pm = peft.get_peft_model(tiny_base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                          init_lora_weights=init, lora_dropout=0.0))
    _trained(pm).save_pretrained(str(tmp_path / "x"))
    with pytest.raises(AdapterError, match=f"init_lora_weights='{init}'.*path_initial_model_for_weight_conversion"):
        load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32)


def test_pissa_adapter_converted_to_plain_lora_loads_and_matches_peft(tmp_path):
    import peft

    from tests.worker.test_peft_adapter import IDS, tiny_base, unmerged_logits

    pm = peft.get_peft_model(tiny_base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                          init_lora_weights="pissa", lora_dropout=0.0))
    pm.peft_config["default"].init_lora_weights = True
    pm.save_pretrained(str(tmp_path / "init"))
    pm.peft_config["default"].init_lora_weights = "pissa"
    _trained(pm).save_pretrained(str(tmp_path / "x"), path_initial_model_for_weight_conversion=str(tmp_path / "init"))
    with torch.no_grad():
        trained = pm(IDS).logits
    w = load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32)
    assert w.ranks == {8}  # the conversion doubles the rank
    torch.testing.assert_close(unmerged_logits(w, IDS), trained, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("changes", "what"), [
    ({"use_bdlora": {"target_modules_bd_a": ["q_proj"], "nblocks": 2}}, "block-diagonal"),
    ({"kasa_config": {}}, "KaSA"),
    ({"arrow_config": {"top_k": 2}}, "Arrow"),
    ({"init_lora_weights": "corda"}, "corda"),
    ({"init_lora_weights": "loftq"}, "loftq"),
    ({"init_lora_weights": "lora_ga"}, "lora_ga"),
])
def test_variants_that_change_the_forward_are_refused_by_config(changes, what, tmp_path):
    from tests.worker.test_peft_adapter import tiny_base

    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    config_path = tmp_path / "x" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changes}))
    with pytest.raises(AdapterError, match=f"{what}.*not supported"):
        load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32)


@pytest.mark.parametrize("init", [True, False, "gaussian", "eva", "orthogonal", "mica"])
def test_initialisations_that_keep_the_base_still_load(init, tmp_path):
    from tests.worker.test_peft_adapter import tiny_base

    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    config_path = tmp_path / "x" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "init_lora_weights": init}))
    assert load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32).ranks == {4}


@pytest.mark.parametrize("field", ["target_modules", "exclude_modules", "rank_pattern"])
def test_a_regex_that_backtracks_without_end_refuses_its_adapter_and_stalls_no_one(field, tmp_path):
    """Matched by Python's `re`, such a pattern against a module name takes longer than any worker would
    wait, holding the interpreter lock all the while (no probe or request answered); even the `regex`
    engine, which sees through `(.*.*)*!`, does not end this one. It is refused, naming the field, while
    another thread keeps running."""
    from tests.worker.test_peft_adapter import tiny_base

    evil = r"(?:.{1,40}){1,40}\d{3}|.*\.q_proj"  # the second branch keeps it a valid target set
    changes = {"target_modules": {"target_modules": evil}, "exclude_modules": {"exclude_modules": evil},
               "rank_pattern": {"rank_pattern": {evil.split("|")[0]: 4}}}[field]
    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    config_path = tmp_path / "x" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **changes}))
    with ticking(0.01) as ticks, pytest.raises(AdapterError, match=f"{field}.*backtracks"):
        load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32,
                          base_model_name="org/tiny-llama")
    assert max(b - a for a, b in zip(ticks, ticks[1:], strict=False)) < 0.15  # never held up for a whole match


def test_one_loads_matches_share_a_budget_so_many_slow_keys_cannot_hold_the_worker(tmp_path, monkeypatch):
    """Thousands of rank_pattern keys, each just under the per-match limit, tried against every module, held the
    admin lock (every other tenant's push and load) for hours. One load's matches now share PATTERN_BUDGET_S;
    here a budget of nothing: the load is refused naming the budget, and loads again once it is back."""
    from lorafleet.worker import peft_patterns
    from tests.worker.test_peft_adapter import tiny_base

    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    config_path = tmp_path / "x" / "adapter_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "rank_pattern": {"q_proj": 4}}))
    monkeypatch.setattr(peft_patterns, "PATTERN_BUDGET_S", 0.0)
    with pytest.raises(AdapterError, match=r"takes over 0.0 s in all"):
        load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32)
    monkeypatch.setattr(peft_patterns, "PATTERN_BUDGET_S", 5.0)
    assert load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32).ranks == {4}


def _config_loader(tmp_path):
    """load(**changes): an adapter with those changes to its adapter_config.json, loaded on the tiny base."""
    from tests.worker.test_peft_adapter import tiny_base

    make_adapter(tmp_path / "x", r=4, lora_alpha=8, target_modules=["q_proj"])
    config_path = tmp_path / "x" / "adapter_config.json"
    config = json.loads(config_path.read_text())

    def load(**changes):
        config_path.write_text(json.dumps({**config, **changes}))
        return load_peft_adapter(tmp_path / "x", tiny_base().config.to_dict(), dtype=torch.float32)

    return load


def test_a_pattern_slow_to_compile_is_refused_by_its_length_or_the_loads_budget(tmp_path, monkeypatch):
    """Python's `re` (what PEFT compiles with, so checked too) takes about 0.3 s a kilobyte to compile a
    case-insensitive class over most of Unicode: a 20 KB target_modules held the admin lock for some 15 s, and
    thousands of such rank_pattern keys for hours. A pattern past MAX_PATTERN_CHARS is refused naming the limit,
    and one load's compiles count against the same budget as its matches."""
    from lorafleet.worker import peft_patterns
    from lorafleet.worker.peft_config import MAX_PATTERN_CHARS
    slow = "(?i:" + "[\u00c0-\uffff]" * 8 + ")"  # valid, matches no module: compiled, never the cause of a refusal
    load = _config_loader(tmp_path)

    long = slow * (MAX_PATTERN_CHARS // len(slow) + 1) + "|.*q_proj"
    for field, changes in (("target_modules", {"target_modules": long}),
                           ("exclude_modules", {"exclude_modules": long}),
                           ("rank_pattern", {"rank_pattern": {long: 4}}),
                           ("layers_pattern", {"layers_pattern": [long]})):
        with pytest.raises(AdapterError, match=rf"{field} .*{len(long)} characters, over the {MAX_PATTERN_CHARS}"):
            load(**changes)
    keys = {f"{slow}(?#{i})": 4 for i in range(200)}
    compiled = []
    monkeypatch.setattr(peft_patterns, "PATTERN_BUDGET_S", 0.05)
    real = re.compile
    monkeypatch.setattr(re, "compile", lambda p, *a: compiled.append(p) or real(p, *a))
    with pytest.raises(AdapterError, match=r"compiling and matching its patterns .*takes over 0.05 s in all"):
        load(rank_pattern=keys)
    assert 0 < len(compiled) < len(keys)  # it stopped once the budget was spent
    monkeypatch.setattr(peft_patterns, "PATTERN_BUDGET_S", 5.0)
    assert load(rank_pattern={slow: 8, "q_proj": 4}).ranks == {4}


def test_a_pattern_whose_counted_repeats_write_out_past_the_limit_is_refused_before_it_is_compiled(tmp_path):
    """The `regex` engine writes counted repeats out in full as it compiles: a 20-character target_modules
    `(?:a{3000}){3000}` took 2.6 GB and 5 s with the interpreter lock held (every tenant's stream stalled), and
    `(?:a{65535}){65535}` got the worker killed for memory. Each field's pattern is refused by its written-out size,
    quickly and without compiling it; patterns with small counted repeats, as real configs write them, load."""
    import resource

    import regex

    from lorafleet.worker.peft_config import MAX_PATTERN_CHARS

    load = _config_loader(tmp_path)

    bomb = "(?:a{65535}){65535}|.*q_proj"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for field, changes in (("alpha_pattern", {"alpha_pattern": {"(?:(?:q{40}){40}){40}": 4}}),
                           ("target_modules", {"target_modules": bomb}),
                           ("exclude_modules", {"exclude_modules": bomb}),
                           ("rank_pattern", {"rank_pattern": {bomb: 4}}),
                           ("layers_pattern", {"layers_pattern": ["(?:layers|(?:x{100,}){100})"],
                                               "layers_to_transform": [0]})):
        started = time.monotonic()
        with pytest.raises(AdapterError, match=rf"{field} .*counted repeats that write out to over {MAX_PATTERN_CHARS}"):
            load(**changes)
        assert time.monotonic() - started < 5.0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # KiB: nothing was written out

    from lorafleet.worker.peft_patterns import written_out_size

    assert written_out_size("a{3}b") == 4 and written_out_size("(?:ab){2,5}") == 10
    assert written_out_size("(x|yz)+c*?") == written_out_size("(x|yz)c") == 6  # open repeats count their least
    assert written_out_size("(?=a{5})(?<!b{3})") == 10 and written_out_size("(?>a{7})") == 8
    assert written_out_size("((?:a{100}){100}){100}") > MAX_PATTERN_CHARS
    with pytest.raises(re.error):
        written_out_size("(?V1)a")  # regex's own syntax: Python's `re`, PEFT's, refuses it
    real = load(target_modules=r"model\.layers\.\d{1,3}\.self_attn\.(q)_proj",
                rank_pattern={r"layers\.[0-9]{1,2}\.self_attn\.q_proj": 4})
    assert real.ranks == {4}
    regex.compile("control: cached q_proj")  # what the module caches, as the check below reads its cache
    cached = [key[0] for key in regex._main._cache if isinstance(key, tuple) and key and isinstance(key[0], str)]
    assert [p for p in cached if "q_proj" in p] == ["control: cached q_proj"]  # none of the adapter's patterns


def test_an_astra_adapter_is_refused_as_trained_against_a_changed_base(tmp_path):
    """Astra (PEFT 0.22) subtracts its initial B @ A from the base weights, as PiSSA does: unconverted, it was
    served on the unmodified base, a different model without a word."""
    load = _config_loader(tmp_path)
    with pytest.raises(AdapterError, match=r"init_lora_weights='astra'.*path_initial_model_for_weight_conversion"):
        load(init_lora_weights="astra", astra_config={})
    assert load(init_lora_weights=True, astra_config={}).ranks == {4}  # converted: plain LoRA


@pytest.mark.parametrize("changes", [
    {"alpha_pattern": {r"layers\.[[:digit:]]\.self_attn\.q_proj": 64}},
    {"rank_pattern": {r"q_pro[[:alpha:]]": 4}},
    {"target_modules": r"model\.layers\.0\.self_attn\.q_pro[[:alpha:]]"},
    {"target_modules": r"model\.layers\.[0-9[:digit:]]+\.self_attn\.(q|v)_proj"},
    {"alpha_pattern": {r"self_attn\.[^[:digit:]]_proj": 64}},
    {"target_modules": r".*\.(?#[)(q_proj){e<=1}"},
    {"target_modules": r".*\.(?#\)[)q_proj{e<=1}"},
    {"target_modules": r"(?x) .*q_proj  # [:digit:]"},
    {"target_modules": r".*(q_proj){e<=1}"},
    {"exclude_modules": r".*k_proj{e<=2}"},
    {"layers_pattern": "lay{e<=1}ers", "layers_to_transform": [0]},
], ids=["alpha_posix", "rank_posix", "target_posix", "target_posix_later", "alpha_posix_negated",
         "fuzzy_after_comment", "fuzzy_after_escaped_comment", "verbose", "target_fuzzy", "exclude_fuzzy", "layers_fuzzy"])
def test_a_pattern_the_two_regex_engines_read_otherwise_is_refused(changes, tmp_path):
    """PEFT matches with Python's `re`, the worker with `regex`: `[[:digit:]]` is a POSIX class to one and a set
    then `]` to the other, `{e<=1}` fuzzy matching to one and literal text to the other. An alpha_pattern key
    `layers\\.[[:digit:]]\\.…` scaled layer 0's q_proj by 64/4 where PEFT keeps 8/4: other tokens, accepted."""
    load = _config_loader(tmp_path)
    (field,) = (f for f in changes if f != "layers_to_transform")
    with pytest.raises(AdapterError, match=rf"{field} .*has (a POSIX class|a literal '\{{'|the verbose flag).* \(PEFT matches it with Python's re\)"):
        load(**changes)


def test_patterns_both_regex_engines_read_alike_still_load(tmp_path):
    load = _config_loader(tmp_path)
    w = load(target_modules=r"model\.layers\.\d{1,2}\.self_attn\.[q]_pro\N{LATIN SMALL LETTER J}",
             alpha_pattern={r"layers\.[0-9]\.self_attn\.q_proj": 16, r"x\{e<=1\}": 2, "q_pr[]{]": 3})
    assert w.modules[(0, "q_proj")].scale == 4.0
