"""The GPU worker: engine, scheduler, adapter pool, HTTP service."""

from lorafleet.worker.engine import Engine
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.request_output import RequestOutput
from lorafleet.worker.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
