"""``python -m lorafleet.operator``: run the LoRAPool/LoRAAdapter operator (kopf) in this process."""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import threading
from collections.abc import Sequence

import kopf

from lorafleet.operator.deployments import DeploymentClient
from lorafleet.operator.handlers import register
from lorafleet.operator.operator_config import OperatorConfig
from lorafleet.worker.cli import config_from_args


async def run(config: OperatorConfig, *, registry: kopf.OperatorRegistry | None = None,
              stop_flag: asyncio.Event | threading.Event | None = None,
              ready_flag: asyncio.Event | threading.Event | None = None,
              deployments: DeploymentClient | None = None) -> None:
    """``deployments``: the autoscaler's Kubernetes client (default: logged in as kopf does, see handlers).
    ``stop_flag``/``ready_flag``: threading events where the operator runs in a thread of its own."""
    registry = registry or kopf.OperatorRegistry()
    controllers = register(registry, config, deployments)
    liveness = f"http://0.0.0.0:{config.liveness_port}/healthz" if config.liveness_port else None
    priority = None
    if config.peering:
        # The highest priority runs, the others wait; a tie would pause them all.
        priority = config.peering_priority or random.SystemRandom().randint(1, 2**31 - 1)
        logging.getLogger(__name__).info("peering %r with priority %d", config.peering, priority)
    try:
        await kopf.operator(
            registry=registry,
            namespaces=[config.namespace] if config.namespace else [],
            clusterwide=config.namespace is None,
            standalone=config.peering is None,
            peering_name=config.peering,
            priority=priority,
            liveness_endpoint=liveness,
            stop_flag=stop_flag,
            ready_flag=ready_flag,
        )
    finally:
        await controllers.close()


def main(argv: Sequence[str] | None = None) -> None:
    config = config_from_args(OperatorConfig, argv, prog="python -m lorafleet.operator",
                              description="Reconcile LoRAPool and LoRAAdapter resources into worker directives.")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kopf.configure(verbose=False)
    try:
        asyncio.run(run(config))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
