"""`python -m lorafleet.worker.stager`: the stager process (its flags are StagerConfig's; worker/stager.py)."""

from __future__ import annotations

import logging
import sys

from aiohttp import web

from lorafleet.worker.cli import config_from_args
from lorafleet.worker.listen import close_all, listen_sockets
from lorafleet.worker.stager_config import StagerConfig

log = logging.getLogger("lorafleet.stager")


def main(argv: list[str] | None = None) -> None:
    from lorafleet.worker.stager_http import create_app  # the HTTP half imports this module

    config = config_from_args(StagerConfig, argv, prog="python -m lorafleet.worker.stager",
                              description="Stage adapters from the object store to local disk for one engine.")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # A folder or port it cannot use is a configuration error: one line and exit 2, as a bad flag.
    if problem := config.cache_dir_problem():
        log.error("cannot start: %s", problem)
        sys.exit(2)
    try:
        sockets = listen_sockets(config.stager_host, config.stager_port, host_flag="--stager-host",
                                 port_flag="--stager-port")
    except ValueError as exc:
        log.error("cannot start: %s", exc)
        sys.exit(2)
    try:
        app = create_app(config)
    except OSError as exc:  # the cache folder's entries could not be read
        close_all(sockets)
        log.error("cannot start: --stager-cache-dir %s: %s", config.stager_cache_dir, exc)
        sys.exit(2)
    port = sockets[0].getsockname()[1]  # the one chosen when --stager-port is 0
    log.info("stager listening on %s:%d, cache %s (%.1f GiB budget), engine %s", config.stager_host, port,
             config.stager_cache_dir, config.stager_cache_bytes / (1 << 30), config.engine_url or "none")
    web.run_app(app, sock=sockets, print=None, access_log=None)
