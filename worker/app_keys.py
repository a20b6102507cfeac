"""Typed keys of the worker's aiohttp application state (shared by the server and its routes)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from lorafleet.worker.admission import Admission
from lorafleet.worker.async_engine import AsyncEngine
from lorafleet.worker.engine_adapters import EngineAdapters
from lorafleet.worker.fair_executor import FairExecutor
from lorafleet.worker.intake_waits import IntakeWaits
from lorafleet.worker.metrics import WorkerMetrics
from lorafleet.worker.parse_turns import ParseTurns
from lorafleet.worker.served_adapters import ServedAdapters
from lorafleet.worker.sources import Sources
from lorafleet.worker.tenants import Tenants
from lorafleet.worker.worker_config import WorkerConfig


@dataclass(slots=True)
class ServerStatus:
    ready: bool = False  # model loaded and engine stepping
    draining: bool = False  # SIGTERM received: refuse new work
    end_now: asyncio.Event = field(default_factory=asyncio.Event)  # set: the shutdown grace ends at once
    started_at: float = 0.0


CONFIG = web.AppKey("config", WorkerConfig)
ENGINE = web.AppKey("engine", AsyncEngine)
ADAPTERS = web.AppKey("adapters", ServedAdapters)
HOST = web.AppKey("host", EngineAdapters)  # the engine's adapter registry, as ServedAdapters needs it
TENANTS = web.AppKey("tenants", Tenants)
METRICS = web.AppKey("metrics", WorkerMetrics)
ADMISSION = web.AppKey("admission", Admission)
INTAKE_THREADS = web.AppKey("intake_threads", FairExecutor)  # parsing and tokenizing, by turns of tenants
INTAKE_WAITS = web.AppKey("intake_waits", IntakeWaits)  # requests waiting for an intake place
PARSE_TURNS = web.AppKey("parse_turns", ParseTurns)  # large bodies' JSON, one at a time, paced
STATUS = web.AppKey("status", ServerStatus)
ADMIN_LOCK = web.AppKey("admin_lock", asyncio.Lock)
SOURCES = web.AppKey("sources", Sources)  # the adapter roots admin sources are checked in, with their digests kept
IN_FLIGHT = web.AppKey("in_flight", set)  # tasks of the request handlers running now (for shutdown)
ADMIN_URL = web.AppKey("admin_url", str)  # the admin listener's base URL (--admin-port), once it listens
METRICS_URL = web.AppKey("metrics_url", str)  # /metrics' own listener's base URL (--metrics-port), once it listens
