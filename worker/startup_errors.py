"""Start-up errors that the user's input or environment caused, as opposed to the worker's own failures.

A setting the worker cannot start with is one line on stderr and exit 2 (`python -m lorafleet.worker:
error: ...`), whether argparse or a config's validation refuses it, or it shows only once the worker reads
what the setting names: a model folder whose content cannot be served, an API keys file whose content is
not a keys file, an --adapters folder where no adapter loads, a port already in use. Such a failure is
raised as (or mapped to, in worker/server.py) a `StartupError`, whose message names the flag, what is
wrong and what to do. Anything else that stops the start is an internal failure: exit 1.

No heavy import here: `python -m lorafleet.worker` reads it before torch.
"""

from __future__ import annotations

from pathlib import Path


class StartupError(ValueError):
    """The worker cannot start with what it was given; the message is the one line the user sees."""


def flag_problem(flag: str, value: str | Path, problem: str, fix: str | None = None) -> StartupError:
    """`--flag VALUE: problem; fix`, without repeating VALUE when `problem` starts with it (as the
    errors about a file often do: `/m: config.json lacks hidden_size`). A problem worded for its flag
    already (`--model /m: the model directory does not exist; pass ...`) is the whole line."""
    problem = " ".join(str(problem).splitlines()).strip()
    if problem.startswith("--"):
        return StartupError(problem)
    message = f"{flag} {value}: {problem.removeprefix(f'{value}: ')}"
    return StartupError(f"{message}; {fix}" if fix else message)
