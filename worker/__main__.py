"""`python -m lorafleet.worker`: the GPU worker's HTTP service (see `--help`)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence

from lorafleet.worker.cli import config_from_args
from lorafleet.worker.listen import close_all, listen_sockets
from lorafleet.worker.worker_config import WorkerConfig

DESCRIPTION = (
    "Serve one base model and many LoRA adapters over an OpenAI-compatible HTTP API "
    "(/v1/completions, /v1/chat/completions, /v1/models), with an admin API for adapter directives, "
    "/metrics, /healthz and /readyz."
)


EPILOG = (
    "An s3:// --adapters is downloaded by a stager child, which reads the object store's settings from the "
    "environment: LORAFLEET_S3_ENDPOINT (host:port, required), LORAFLEET_S3_ACCESS_KEY and "
    "LORAFLEET_S3_SECRET_KEY (unset: anonymous), LORAFLEET_S3_SECURE (TLS, default true), LORAFLEET_S3_REGION."
)


def object_store_problem(config: WorkerConfig, env: Mapping[str, str]) -> str | None:
    """Why an s3:// --adapters cannot be staged, or None: without an endpoint the stager child would
    retry forever and the worker never turn ready."""
    if config.adapters_uri and not env.get("LORAFLEET_S3_ENDPOINT"):
        return (f"--adapters {config.adapters_uri}: no object store configured; set LORAFLEET_S3_ENDPOINT "
                "(host:port) and, unless the bucket is public, LORAFLEET_S3_ACCESS_KEY and LORAFLEET_S3_SECRET_KEY")
    return None


def listen_problem(host: str, port: int) -> str | None:
    """Why the worker could not listen on host:port, or None. Checked before the model loads, so a
    port in use is refused at once rather than after minutes of loading weights."""
    try:
        close_all(listen_sockets(host, port))
    except ValueError as exc:
        return str(exc)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    prog = "python -m lorafleet.worker"
    config = config_from_args(WorkerConfig, argv, prog=prog, description=DESCRIPTION, epilog=EPILOG)
    if problem := object_store_problem(config, os.environ):
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("lorafleet.worker")
    if problem := listen_problem(config.host, config.port):
        log.error("cannot start: %s", problem)
        return 1
    from lorafleet.worker.default_model import ConversionError  # after parsing: --help stays fast
    from lorafleet.worker.server import run
    from lorafleet.worker.stager_client import StagerError

    try:
        run(config)
    except (ValueError, OSError, StagerError, ConversionError) as exc:  # bad model/adapters/keys, stager
        log.error("cannot start: %s", exc)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the model loads (once serving, the server handles it)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
