"""What a failed start-up step was, in the user's terms: the `StartupError` line (worker/startup_errors.py)
for a failure that the user's input caused, naming the flag and what to do; None for the worker's own."""

from __future__ import annotations

from lorafleet.worker.adapter_dir import AdapterDirError
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.model_config import ModelConfigError
from lorafleet.worker.startup_errors import StartupError, flag_problem
from lorafleet.worker.tenants import TenantsError
from lorafleet.worker.tokenizer import TokenizerError


def load_refusal(config: EngineConfig, exc: BaseException) -> StartupError | None:
    """The one line for a model load that failed on what the user gave (the model folder's content, an
    --adapters folder where no adapter loads, the engine's sizes) or the machine lacks (the embedded
    model's package), naming the flag and what to do; None for an internal failure (exit 1)."""
    from lorafleet.worker.default_model import ConversionError  # imported only once a load failed

    if isinstance(exc, StartupError):
        return exc
    if isinstance(exc, AdapterDirError):
        return flag_problem("--adapters", config.adapters, exc.problem, exc.fix)
    if isinstance(exc, ConversionError):
        return StartupError(f"no --model given, and the embedded default model cannot be made: {exc}")
    if isinstance(exc, TokenizerError) and config.tokenizer:
        return flag_problem("--tokenizer", config.tokenizer, str(exc), "fix that folder or pass another --tokenizer")
    if isinstance(exc, ModelConfigError | TokenizerError):
        if config.model is None:
            return StartupError(f"no --model given, and the embedded default model cannot be served: {exc}; remove "
                                "its folder so that it is converted again, or pass --model")
        return flag_problem("--model", config.model, str(exc), "fix the model folder (or download it again) or "
                            "pass another --model")
    return None


def keys_file_refusal(path: str, exc: TenantsError) -> StartupError:
    """`--api-keys-file PATH: what is wrong; what to do`. The message names the file as its reload's log
    line needs (`API keys file PATH is not valid JSON/YAML: ...`); the flag's line names it once."""
    problem = str(exc)
    for prefix, instead in ((f"API keys file {path} is ", ""), (f"cannot read API keys file {path}: ", "cannot read it: ")):
        if problem.startswith(prefix):
            problem = instead + problem.removeprefix(prefix)
    return flag_problem("--api-keys-file", path, problem, "fix the file (a 'tenants' mapping of names to keys and "
                        "adapters: see the README) or pass another --api-keys-file")
