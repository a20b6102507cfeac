"""The Prometheus servers the autoscaler may ask: the origins (scheme://host:port) of ``--prometheus-urls``.

A LoRAPool names its Prometheus (``spec.scaling.prometheusURL``), and whoever may write a pool is not whoever
runs the operator: asked wherever a pool points, the operator would send requests from inside the cluster
to any service, or to a cloud's metadata endpoint (169.254.169.254). So it asks only a listed origin; any
path on it is allowed (a Prometheus served under a path prefix). An empty list allows none: autoscaling is
off. URLs are read as aiohttp reads them when it sends a request (yarl): scheme and host lowercased, the
port explicit or the scheme's default.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from yarl import URL

SETTING = "--prometheus-urls (env LORAFLEET_PROMETHEUS_URLS; Helm value operator.prometheusURLs)"
# An origin as the setting lists it: no user, path, query or fragment (one trailing slash is allowed).
_ORIGIN_RE = re.compile(r"^https?://[^/?#@\s]+/?$", re.IGNORECASE)

Origin = tuple[str, str, int]  # (scheme, host, port)


def url_problem(url: str) -> str | None:
    """Why the operator must never send a request to ``url`` whatever the setting lists, or None: not http or
    https, no host (or one that is not a valid name), a user or password in it (a pool's spec is readable by
    whoever may read the pool), or a query or fragment (the operator's POST would carry it to whatever path the
    URL names). The URL is never echoed: it may hold a password."""
    try:
        parsed = URL(url)
        host = parsed.host  # decoded (IDNA) here: a malformed name raises a UnicodeError, a ValueError
    except ValueError as exc:
        return f"is not a valid URL ({exc})"
    if parsed.scheme not in ("http", "https"):
        return "must be an http:// or https:// URL"
    if parsed.user is not None or parsed.password is not None:
        return (
            "carries a user or password (user:password@host), and credentials in the URL are not allowed: the "
            "operator does not send them, as the pool's spec is readable by whoever may read it; remove them, "
            "and name a Prometheus the operator may ask without them (listed in " + SETTING + ")"
        )
    if not host:
        return "names no host"
    if "?" in url or "#" in url:  # the query is Prometheus' own (a POST to /api/v1/query): none may be carried
        return "carries a query or fragment; name the Prometheus by scheme://host:port and a path prefix only"
    return None


def _origin(url: str) -> Origin:
    parsed = URL(url)
    assert parsed.host is not None and parsed.port is not None  # url_problem found none missing
    return parsed.scheme, parsed.host, parsed.port


class PrometheusAllowlist:
    """The allowed origins; ``problem(url)`` says why a pool's URL is not one of them."""

    def __init__(self, urls: Iterable[str]) -> None:
        self.urls = tuple(urls)
        for url in self.urls:
            if not _ORIGIN_RE.fullmatch(url) or url_problem(url) is not None:
                raise ValueError(
                    f"prometheus_urls: {url!r} must be scheme://host[:port] with scheme http or https "
                    f"and no user, path, query or fragment (e.g. http://prometheus.monitoring:9090)"
                )
        self._origins = {_origin(url) for url in self.urls}

    def problem(self, url: str) -> str | None:
        """None when the operator may ask the Prometheus at ``url``; else why not and what to change, naming
        the setting."""
        invalid = url_problem(url)
        if invalid is not None:
            return invalid
        if not self._origins:
            return (
                f"the operator may ask no Prometheus: {SETTING} is empty, so autoscaling is off; list this "
                f"pool's Prometheus there as scheme://host:port"
            )
        if _origin(url) not in self._origins:
            return (
                f"{url!r} is not on a Prometheus the operator may ask ({', '.join(self.urls)}); add its "
                f"scheme://host:port to {SETTING}, or name one listed"
            )
        return None
