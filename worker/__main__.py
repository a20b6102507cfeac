"""`python -m lorafleet.worker`: the GPU worker's HTTP service (see `--help`).

Exit codes: 0 after a clean stop (SIGTERM); 2 when what the user gave or the machine cannot be used, with
one line on stderr naming the flag, what is wrong and what to do, no traceback: a bad flag or variable,
and at start a port in use, a model folder, API keys file or --adapters folder whose content cannot be
served (worker/startup_errors.py); 1 for an internal failure; 130 for Ctrl-C while the model loads.

The flags are parsed before anything heavy is imported: `--help` and a bad flag answer without torch.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence

from lorafleet.worker.cli import config_from_args
from lorafleet.worker.listen import close_all, listen_sockets
from lorafleet.worker.startup_errors import StartupError
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


def listen_problem(host: str, port: int, *, host_flag: str = "--host", port_flag: str = "--port") -> str | None:
    """Why the worker could not listen on host:port, or None. Checked before the model loads, so a
    port in use is refused at once rather than after minutes of loading weights."""
    try:
        close_all(listen_sockets(host, port, host_flag=host_flag, port_flag=port_flag))
    except StartupError as exc:
        return str(exc)
    return None


def admin_listen_problem(config: WorkerConfig) -> str | None:
    """Why the admin API's own listener (--admin-port) could not listen, or None (as --port: before the
    model loads)."""
    if config.admin_port is None:
        return None
    return listen_problem(config.admin_listen_host, config.admin_port, host_flag="--admin-host",
                          port_flag="--admin-port")


def metrics_listen_problem(config: WorkerConfig) -> str | None:
    """Why /metrics' own listener (--metrics-port) could not listen, or None (before the model loads)."""
    if config.metrics_port is None:
        return None
    return listen_problem(config.host, config.metrics_port, port_flag="--metrics-port")


def stager_problem(config: WorkerConfig) -> str | None:
    """Why the stager child of an s3:// --adapters could not start (its cache folder, its port), or None:
    it starts only once the model has loaded, and would then end the start with its log's tail."""
    if not config.adapters_uri:
        return None
    from lorafleet.worker.stager_config import cache_dir_problem

    if problem := cache_dir_problem(config.stager_cache):
        return problem
    if config.stager_port:
        return listen_problem("127.0.0.1", config.stager_port, port_flag="--stager-port")
    return None


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    """The worker; SIGTERM before the server's own handlers take over (while the flags are checked and torch
    imports, seconds before the first log line) is a clean stop too: exit 0, as once serving, not 143."""
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None) -> int:
    prog = "python -m lorafleet.worker"
    config = config_from_args(WorkerConfig, argv, prog=prog, description=DESCRIPTION, epilog=EPILOG)

    def refuse(problem: str) -> int:
        print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2

    if problem := object_store_problem(config, os.environ) or listen_problem(config.host, config.port):
        return refuse(problem)
    if problem := admin_listen_problem(config) or metrics_listen_problem(config) or stager_problem(config):
        return refuse(problem)
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("lorafleet.worker")
    from lorafleet.worker.server import run  # after parsing and these checks: torch is imported from here on
    from lorafleet.worker.stager_client import StagerError

    try:
        run(config)
    except StartupError as exc:  # the model folder, keys file or adapters the user gave (worker/server.py)
        return refuse(str(exc))
    except (ValueError, OSError, StagerError) as exc:  # not the user's to fix: one line all the same
        log.error("cannot start: %s", exc)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the model loads (once serving, the server handles it)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
