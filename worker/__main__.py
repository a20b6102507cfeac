"""`python -m lorafleet.worker`: the GPU worker's HTTP service (see `--help`)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from lorafleet.worker.cli import config_from_args
from lorafleet.worker.worker_config import WorkerConfig

DESCRIPTION = (
    "Serve one base model and many LoRA adapters over an OpenAI-compatible HTTP API "
    "(/v1/completions, /v1/chat/completions, /v1/models), with an admin API for adapter directives, "
    "/metrics, /healthz and /readyz."
)


def main(argv: Sequence[str] | None = None) -> int:
    config = config_from_args(WorkerConfig, argv, prog="python -m lorafleet.worker", description=DESCRIPTION)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from lorafleet.worker.server import run  # after parsing: --help stays fast
    from lorafleet.worker.stager_client import StagerError

    try:
        run(config)
    except (ValueError, OSError, StagerError) as exc:  # bad model/adapters/keys file, port in use, stager
        logging.getLogger("lorafleet.worker").error("cannot start: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
