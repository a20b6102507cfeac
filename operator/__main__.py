"""``python -m lorafleet.operator``: run the LoRAPool/LoRAAdapter operator (kopf) in this process."""

from __future__ import annotations

import asyncio
import logging
import random
import sys
import threading
from collections.abc import Sequence

import kopf

from lorafleet.operator.deployments import DeploymentClient, default_login
from lorafleet.operator.handlers import register
from lorafleet.operator.operator_config import OperatorConfig
from lorafleet.worker.cli import config_from_args


async def run(config: OperatorConfig, *, registry: kopf.OperatorRegistry | None = None,
              stop_flag: asyncio.Event | threading.Event | None = None,
              ready_flag: asyncio.Event | threading.Event | None = None,
              deployments: DeploymentClient | None = None) -> None:
    """``deployments``: the autoscaler's Kubernetes client (default: logged in as kopf does, see handlers).
    ``stop_flag``/``ready_flag``: threading events where the operator runs in a thread of its own."""
    if registry is None:
        registry = kopf.OperatorRegistry()
        # A fresh registry has none of the logins kopf's default one has: log in as that one does with the
        # Kubernetes client library installed (service account, else kubeconfig).
        kopf.on.login(registry=registry)(kopf.login_via_client)
    controllers = register(registry, config, deployments)
    host = f"[{config.liveness_host}]" if ":" in config.liveness_host else config.liveness_host
    liveness = f"http://{host}:{config.liveness_port}/healthz" if config.liveness_port else None
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


_HOW_TO_LOG_IN = "run it in a pod with a service account, or set KUBECONFIG to a kubeconfig file"


def login_problem() -> str | None:
    """Why no Kubernetes credentials can be found, or None. Checked before kopf starts: kopf itself
    would only log tracebacks of its failed logins."""
    try:
        default_login()
    except OSError as exc:  # KUBECONFIG names a file that is not there or cannot be read
        return f"kubeconfig {exc.filename}: {exc.strerror}; {_HOW_TO_LOG_IN}"
    except Exception as exc:  # none found, or a kubeconfig that does not parse
        return f"{exc}; {_HOW_TO_LOG_IN}"
    return None


def main(argv: Sequence[str] | None = None) -> None:
    config = config_from_args(OperatorConfig, argv, prog="python -m lorafleet.operator",
                              description="Reconcile LoRAPool and LoRAAdapter resources into worker directives.")
    # kopf's setup is the only one (a second root handler would print every line twice); the prefix names
    # the object a handler's message is about.
    kopf.configure(verbose=False, log_prefix=True)
    log = logging.getLogger("lorafleet.operator")
    if problem := login_problem():
        log.error("cannot reach Kubernetes: %s", problem)
        sys.exit(2)  # configuration: where the cluster is and how to log in
    try:
        asyncio.run(run(config))
    except kopf.LoginError as exc:  # credentials found, but the cluster refused them or did not answer
        log.error("cannot reach Kubernetes: %s", exc)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
