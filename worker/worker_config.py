"""WorkerConfig: everything `python -m lorafleet.worker` needs, one flag / env var per field.

The engine's settings are composed, not copied: `engine: EngineConfig` is flattened by cli.py, so
`--model`, `--adapters`, `--device`, `--max-num-seqs`, ... come from EngineConfig's own fields.
`--adapters` may also be an object-store URI (`s3://bucket/prefix/`): the worker then starts the
stager as a child process, which downloads and verifies the adapters and registers them through the
admin API; the engine process never holds object-store credentials.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from lorafleet.worker.cors import parse_origins
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.metrics import RETIRED_GRACE_S, LatencySeries
from lorafleet.worker.tenants import keys_file_problem

ToolParserName = Literal["auto", "hermes", "llama3_json"]

REMOTE_SCHEMES = ("s3://",)

# The worker's wording for engine settings it widens, or that EngineConfig leaves undescribed.
ENGINE_HELP = {
    "adapters": "adapters to serve from the start: a directory of PEFT adapter folders (name = folder name), "
                "or s3://bucket/prefix/ whose subfolders a stager child downloads and verifies",
    "device": "cpu, cuda or cuda:N",
    "max_num_seqs": "sequences in one engine step (the running batch)",
    "max_num_batched_tokens": "tokens in one engine step (prefill chunks + decodes)",
    "enable_chunked_prefill": "split long prompts over several steps so decodes keep flowing",
}


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(slots=True)
class WorkerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"help": ENGINE_HELP})
    host: str = field(default="127.0.0.1", metadata=_help(
        "address to listen on (* in a pod: every address of IPv4 and IPv6, for IPv4, IPv6 and dual-stack clusters)"))
    port: int = field(default=8000, metadata=_help("TCP port of the HTTP API"))
    served_model_name: str | None = field(
        default=None, metadata=_help("name of the base model in the API (`model` field); default: the model "
                                     "directory's name"))
    api_keys_file: str | None = field(
        default=None, metadata=_help("JSON/YAML file mapping API keys to tenants and their adapters; unset = "
                                     "development mode, open to everyone"))
    admin_token: str | None = field(
        default=None, metadata=_help("bearer token for /admin/v1/* and /v1/load_lora_adapter, at least 8 "
                                     "characters; unset = the admin API refuses every call"))
    admin_port: int | None = field(default=None, metadata=_help(
        "serve the admin API (/admin/v1/*, /v1/load_lora_adapter, /v1/unload_lora_adapter) on this port of its "
        "own, on --admin-host, and no longer on --port, where it then answers 404 (0 = any free port, logged); "
        "unset = on --port, beside the OpenAI API"))
    admin_host: str | None = field(default=None, metadata=_help(
        "address the admin API listens on with --admin-port; default 127.0.0.1, so that only this machine (a "
        "pod's own containers: the stager sidecar) reaches it"))
    metrics_port: int | None = field(default=None, metadata=_help(
        "serve /metrics (and the probes /healthz, /readyz) on this port of its own, on --host, and no longer on "
        "--port, where /metrics then answers 404: its per-adapter series tell anyone who reaches --port which "
        "adapters run and how much (0 = any free port, logged); unset = on --port"))
    enable_prompt_tokens_details: bool = field(default=False, metadata=_help(
        "answers' usage carries prompt_tokens_details.cached_tokens, the prompt tokens found in the prefix cache "
        "(vLLM's flag, off as there: with it, a caller learns exactly which of its tenant's prompts were sent "
        "before; a tenant serving many users behind one key should have them send cache_salt)"))
    max_body_bytes: int = field(default=4 * 1024 * 1024,
                                metadata=_help("largest accepted request body in bytes (larger: 413)"))
    max_queued_requests: int = field(
        default=256, metadata=_help("sequences that may wait beyond the running batch (max_num_seqs); more "
                                    "are refused with 429 and Retry-After"))
    max_sequences_per_tenant: int = field(
        default=0, metadata=_help("sequences one tenant may have admitted at once (running + queued); more are "
                                  "refused with 429 tenant_queue_full and Retry-After, so one tenant cannot fill "
                                  "the queue; 0 = none beyond three quarters of the queue where the keys file "
                                  "lists two tenants or more. Without --api-keys-file every caller is tenant dev, "
                                  "so the limit then caps all callers together"))
    max_intake_requests: int = field(
        default=0, metadata=_help("requests whose bodies may be read, JSON-parsed and tokenized at once; more wait "
                                  "--intake-wait-s for a place, then are refused with 429 intake_full and "
                                  "Retry-After, their body unread (every request is, at once, while the queue is "
                                  "full); 0 = 4 x the CPUs of this process, or as many bodies of --max-body-bytes "
                                  "as fit in 256 MiB when that is more"))
    intake_wait_s: float = field(
        default=5.0, metadata=_help("seconds a request waits for an intake place while all --max-intake-requests "
                                    "are taken (its body unread), before 429 intake_full: a burst of more "
                                    "connections than places is read in turn, tenants fairly; 0 = refused at once"))
    request_read_timeout_s: float = field(
        default=30.0, metadata=_help("seconds a request's body may take to arrive once the worker reads it; a "
                                     "slower one is answered 408 request_timeout and its intake place freed, so "
                                     "clients that upload slowly cannot hold --max-intake-requests"))
    request_timeout_s: float = field(
        default=0.0, metadata=_help("seconds an inference request may run, from its admission (body read and "
                                    "tokenized) to its last token, waiting in the queue included; a request past "
                                    "it has its sequences aborted (their KV pages and adapter freed, as when a "
                                    "client leaves) and is answered 504 deadline_exceeded, a stream that started "
                                    "with an in-band error event; 0 = no limit"))
    stream_write_timeout_s: float = field(
        default=60.0, metadata=_help("seconds a stream's client may take to accept the next bytes once the "
                                     "worker's send buffer is full; a client that stops reading longer is cut "
                                     "off (its sequences aborted, its seats given back), so clients that stop "
                                     "reading cannot hold --max-num-seqs or their tenant's cap"))
    retry_after_s: int = field(default=1, metadata=_help("Retry-After seconds sent with 429"))
    shutdown_grace_s: float = field(
        default=30.0, metadata=_help("on SIGTERM: seconds in-flight requests get to finish; then they end with "
                                     "an error (a stream with an in-band error event)"))
    retired_series_grace_s: float = field(default=RETIRED_GRACE_S, metadata=_help(
        "seconds the request series of a retired adapter version (a rolled-back canary, a replaced stable "
        "version, an unloaded name) stay in /metrics after its last request was counted, so a scrape reads "
        "the final counts; keep it above Prometheus' scrape interval"))
    adapter_latency_series: LatencySeries = field(default="rollouts", metadata=_help(
        "which adapters get latency histograms of their own in /metrics (about 45 series each, per version): "
        "rollouts = names serving two versions (a canary, or a new version loading beside the old), the others "
        "counted under adapter __other__; all = every adapter (heavy with thousands of them). Request and "
        "token counters are per adapter and version either way"))
    lora_info_metric: bool = field(default=True, metadata=_help(
        "export vLLM's vllm:lora_requests_info, whose labels list the adapters running and waiting (each list's "
        "first --max-loras names, sorted), as routers read it; each new set of names is a new series, so a busy "
        "worker of many adapters makes one about every scrape: --no-lora-info-metric where no router reads it"))
    stager_port: int = field(default=0, metadata=_help(
        "port of the stager child started for an s3:// --adapters (0 = a free port)"))
    stager_cache_dir: str | None = field(default=None, metadata=_help(
        "node-local disk cache of that stager child; default: $LORAFLEET_CACHE/adapters"))
    adapter_roots: str | None = field(default=None, metadata=_help(
        "comma-separated local folders that adapter paths pushed through the admin API must lie in "
        "(symlinks resolved, '..' refused); default: the --adapters folder and the stager's cache"))
    ready_after_push: bool = field(default=False, metadata=_help(
        "with a stager sidecar: /readyz answers 503 awaiting_push until an admin push has been applied, so that an "
        "engine restarted beside a running sidecar re-enters its Service only once the sidecar has handed it its "
        "adapters again (the sidecar does so by itself)"))
    ready_without_push_s: float | None = field(default=None, metadata=_help(
        "with --ready-after-push: ready anyway this many seconds after the start with no push applied (unset: never)"))
    chat_control_tokens_in_content: bool = field(default=False, metadata=_help(
        "let special-token strings in chat messages (\"<|im_end|>\" in a user's text) become the control tokens "
        "they spell, as vLLM does, so a message can forge turns of its own; off = they are encoded as plain text "
        "and only the chat template's own control tokens are tokens"))
    tool_call_parser: ToolParserName = field(default="auto", metadata=_help(
        "how tool calls are read out of a chat answer when a request sends tools (vLLM's --tool-call-parser): "
        "hermes = <tool_call>{...}</tool_call> blocks (Hermes, Qwen), llama3_json = a JSON object {\"name\", "
        "\"parameters\"} (Llama 3.1/3.2); auto = hermes when the chat template for tools writes <tool_call>, else "
        "llama3_json"))
    allowed_origins: str = field(default="", metadata=_help(
        "comma-separated origins (scheme://host[:port]) browser pages may call the API from, or * for any "
        "(vLLM's --allowed-origins, whose default is *); empty = no CORS headers, so browsers refuse "
        "cross-origin calls"))
    log_level: str = field(default="info", metadata=_help("debug | info | warning | error"))

    def __post_init__(self) -> None:
        if not isinstance(self.engine, EngineConfig):
            raise TypeError("engine must be an EngineConfig")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535 (0 = any free port), got {self.port}")
        if not 0 <= self.stager_port < 65536:
            raise ValueError(f"stager_port must be in 0..65535, got {self.stager_port}")
        self._check_admin_listener()
        self._check_metrics_listener()
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_queued_requests < 0:
            raise ValueError(f"max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if self.max_sequences_per_tenant < 0:
            raise ValueError(f"max_sequences_per_tenant must be >= 0 (0 = no per-tenant limit), got "
                             f"{self.max_sequences_per_tenant}")
        if self.max_intake_requests < 0:
            raise ValueError(f"max_intake_requests must be >= 0 (0 = sized from the CPUs), got {self.max_intake_requests}")
        if not (math.isfinite(self.intake_wait_s) and self.intake_wait_s >= 0):
            raise ValueError(f"intake_wait_s must be a finite number >= 0 (0 = refused at once), got {self.intake_wait_s}")
        if not (math.isfinite(self.request_read_timeout_s) and self.request_read_timeout_s > 0):
            raise ValueError(f"request_read_timeout_s must be a finite number > 0, got {self.request_read_timeout_s}")
        if not (math.isfinite(self.request_timeout_s) and self.request_timeout_s >= 0):
            raise ValueError(f"request_timeout_s must be a finite number >= 0 (0 = no limit), got "
                             f"{self.request_timeout_s}")
        if not (math.isfinite(self.stream_write_timeout_s) and self.stream_write_timeout_s > 0):
            raise ValueError(f"stream_write_timeout_s must be a finite number > 0, got {self.stream_write_timeout_s}")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1, got {self.retry_after_s}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if not (math.isfinite(self.retired_series_grace_s) and self.retired_series_grace_s >= 0):
            raise ValueError(f"retired_series_grace_s must be a finite number >= 0, got {self.retired_series_grace_s}")
        parse_origins(self.allowed_origins)  # ValueError naming one that is no origin
        if self.log_level.lower() not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.admin_token is not None and len(self.admin_token) < 8:
            raise ValueError("admin_token must be at least 8 characters")
        if self.api_keys_file is not None and (problem := keys_file_problem(self.api_keys_file)):
            raise ValueError(problem)
        adapters = self.engine.adapters
        if adapters and not self.adapters_uri and not Path(adapters).is_dir():
            raise ValueError(f"--adapters {adapters}: not a directory (give a directory of PEFT adapter folders "
                             "or an s3:// URI)")
        name = self.served_model_name
        if name and adapters and not self.adapters_uri and (Path(adapters) / name / "adapter_config.json").is_file():
            raise ValueError(f"--served-model-name {name} is also the name of the adapter {Path(adapters) / name}: "
                             "requests naming it would get the base model; choose another --served-model-name")

    def _check_admin_listener(self) -> None:
        port = self.admin_port
        if port is None:
            if self.admin_host is not None:
                raise ValueError(f"--admin-host {self.admin_host} needs --admin-port: without it the admin API is "
                                 "served on --host and --port, beside the OpenAI API")
            return
        if not 0 <= port < 65536:
            raise ValueError(f"admin_port must be in 0..65535 (0 = any free port), got {port}")
        for flag, other in (("--port", self.port), ("--stager-port", self.stager_port)):
            if port and port == other:
                raise ValueError(f"--admin-port {port} is {flag} too: the admin API needs a port of its own; choose "
                                 "another --admin-port, or leave it unset to serve the admin API on --port")

    def _check_metrics_listener(self) -> None:
        port = self.metrics_port
        if port is None:
            return
        if not 0 <= port < 65536:
            raise ValueError(f"metrics_port must be in 0..65535 (0 = any free port), got {port}")
        for flag, other in (("--port", self.port), ("--admin-port", self.admin_port), ("--stager-port", self.stager_port)):
            if port and port == other:
                raise ValueError(f"--metrics-port {port} is {flag} too: /metrics needs a port of its own; choose "
                                 "another --metrics-port, or leave it unset to serve /metrics on --port")

    @property
    def admin_listen_host(self) -> str:
        """Where the admin listener binds (with `admin_port`): `admin_host`, else the loopback address."""
        return self.admin_host or "127.0.0.1"

    @property
    def adapters_uri(self) -> str | None:
        """The object-store URI of --adapters, when it is one (the stager child handles it)."""
        a = self.engine.adapters
        return a if a and a.startswith(REMOTE_SCHEMES) else None

    @property
    def stager_cache(self) -> Path:
        from lorafleet.worker.default_model import cache_root

        return Path(self.stager_cache_dir) if self.stager_cache_dir else cache_root() / "adapters"

    @property
    def local_adapter_roots(self) -> list[str]:
        """Where admin-pushed adapter paths may point (see `adapter_roots`)."""
        if self.adapter_roots:
            return [r.strip() for r in self.adapter_roots.split(",") if r.strip()]
        roots = [str(self.stager_cache)]
        if self.engine.adapters and not self.adapters_uri:
            roots.append(self.engine.adapters)
        return roots

    @property
    def capacity(self) -> int:
        """Sequences admitted at once: the running batch plus the queue."""
        return self.engine.max_num_seqs + self.max_queued_requests

    @property
    def intake_limit(self) -> int:
        """Requests in intake at once (body read, parse, tokenization): `max_intake_requests`, or 4 x CPUs,
        or more when bodies are small (256 MiB of them), so that a burst of small requests is not refused."""
        if self.max_intake_requests:
            return self.max_intake_requests
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(4 * cpus, (256 << 20) // self.max_body_bytes)
