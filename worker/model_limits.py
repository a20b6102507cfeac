"""What a request may ask of this model: checks `Engine.add_request` makes once the model is known."""

from __future__ import annotations

from lorafleet.worker.engine_errors import EngineError
from lorafleet.worker.logit_bias import out_of_vocab
from lorafleet.worker.sampling_params import SamplingParams


def check_params(params: SamplingParams, *, has_tokenizer: bool, vocab_size: int) -> None:
    """Raise EngineError for options the model cannot serve: text-level options without a tokenizer, token
    ids outside the vocabulary."""
    if (params.stop or params.json_object) and not has_tokenizer:
        raise EngineError("stop strings and JSON mode need a tokenizer (this model directory has no "
                          "tokenizer.json); use stop_token_ids")
    for name, token_ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        if bad := out_of_vocab(token_ids, vocab_size):
            raise EngineError(f"{name} token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
