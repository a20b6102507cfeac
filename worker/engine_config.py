"""EngineConfig: everything the offline engine needs to start, validated on construction.

It imports torch only where a value needs it (a cuda device to check, the dtype, the pool's size): the
worker's and the stager's flags are generated from it, and `--help` or a bad flag answers without torch.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from lorafleet.worker.file_limits import MAX_FILE_BYTES
from lorafleet.worker.startup_errors import StartupError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes
_DEVICE = re.compile(r"(cpu|cuda)(?::(\d+))?")  # what torch.device accepts of the two kinds served
KERNEL_BACKENDS = ("auto", "reference", "triton")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # HF-style model dir; None = the embedded default model
    tokenizer: str | None = None  # dir with tokenizer.json; None = the model dir
    device: str = "cpu"
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (bfloat16 on cuda, float32 on cpu)
    kernel_backend: str = "auto"  # auto = triton on cuda, the torch reference on cpu
    seed: int = 0  # for requests without their own seed
    generation_config: bool = True  # requests that leave temperature, top_p, top_k, min_p or repetition_penalty (chat: max_tokens, from max_new_tokens) unset take the model's generation_config.json values (as vLLM's --generation-config auto); off: OpenAI's defaults

    # Paged KV cache and adapters share one page pool.
    block_size: int = 16  # tokens per KV block (= one page)
    num_pages: int | None = None  # pages in the pool; None = sized from pool_bytes / pool_memory_fraction
    pool_bytes: int | None = None  # bytes for the pool; None = 256 MiB on cpu, pool_memory_fraction on cuda
    pool_memory_fraction: float = 0.85  # cuda: share of the free memory after the weights are loaded
    max_adapter_pages: int | None = None  # ceiling on pages adapters may take (None = no ceiling)

    # Batching.
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    max_grammar_seconds_per_step: float = 0.05  # estimated seconds a step may spend on guided rows' grammars (their masks): past it, rows take turns, the longest waiting going first (worker/grammar_pacing.py); 0 = no bound
    enable_prefix_caching: bool = True  # keep the KV of finished requests' full blocks for requests of the same tenant and adapter version that begin with the same tokens (worker/prefix_cache.py)

    # Adapters.
    adapters: str | None = None  # directory: every PEFT subfolder is registered (name = folder name)
    max_loras: int = 16  # adapter slots resident at once
    max_lora_rank: int = 64
    max_loras_per_batch: int | None = None  # distinct adapters per step; None = no bound
    max_loras_per_tenant: int | None = None  # adapter slots the adapters of one tenant may hold at once (its GPU share; unset = no limit): over it, the tenant's own idle adapters leave first, and its request waits for one of its own to go idle; adapters registered without a tenant count as tenant "default"
    max_lora_bytes_per_tenant: int | None = None  # bytes of adapter weights one tenant's adapters may hold on the GPU at once (unset = no limit)
    adapter_load_threads: int = 2  # threads reading adapters from disk into the CPU tier, shared by tenants in turns; a request's load of a tenant with none running gets one of 8 more at once
    adapter_load_timeout_s: float = 300.0  # an adapter read still running after this fails the requests waiting for it (a hung disk or mount)
    max_adapter_wait_steps: int = 32  # a request skipped that many steps for grouping (or KV pages) goes first
    strict_base: bool = True  # refuse adapters trained on another base model / tokenizer
    base_model_aliases: tuple[str, ...] = ()  # other names of the served base that adapters' base_model_name_or_path may give (the hub id of a copy in a folder of another name); --served-model-name is one too
    max_adapter_file_bytes: int = MAX_FILE_BYTES  # largest adapter weights file read (the stager's limit of the same name)
    lora_segment_len: int = 64  # most tokens of one adapter per LoRA kernel segment; a step's own grows from 16 with its size (kernels.lora_layout.segment_len)
    cuda_graphs: bool = True  # cuda + triton kernels: replay decode steps as CUDA graphs (worker/cuda_graphs.py)
    warmup: bool = True  # cuda + triton kernels: compile the kernels of common step shapes at start
    compile_threads: int = 0  # cuda + triton kernels: threads that compile the start-up's kernels ahead of the warm-up (0 = one per CPU core, at most 16 and one per GiB free; 1 = compile each as the warm-up first launches it)
    lora_overlap: bool = True  # cuda: run LoRA deltas on a side stream beside the base GEMMs (worker/lora_linear.py)
    max_failed_forwards: int = 8  # forwards failing in a row (e.g. a lasting CUDA error) that mark the engine unhealthy: /healthz and /readyz answer 503 so the container restarts; a single failure fails only its requests

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.kernel_backend not in KERNEL_BACKENDS:
            raise ValueError(f"kernel_backend must be one of {KERNEL_BACKENDS}, got {self.kernel_backend!r}")
        self._check_device()
        if self.kernel_backend == "triton" and self.device.startswith("cpu") and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--kernel-backend triton needs --device cuda; on cpu use --kernel-backend auto or "
                             "reference (TRITON_INTERPRET=1 runs the Triton kernels in its slow interpreter instead)")
        if self.tokenizer is not None and not (Path(self.tokenizer) / "tokenizer.json").is_file():
            raise ValueError(f"--tokenizer {self.tokenizer}: no tokenizer.json there (give the directory that "
                             "holds it, or leave --tokenizer unset to use the model directory's)")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank",
                     "lora_segment_len", "max_adapter_file_bytes", "max_failed_forwards", "adapter_load_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.adapter_load_timeout_s > 0:
            raise ValueError(f"adapter_load_timeout_s must be > 0, got {self.adapter_load_timeout_s}")
        if self.compile_threads < 0:
            raise ValueError(f"compile_threads must be >= 0 (0: one per CPU core), got {self.compile_threads}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {self.num_pages}")
        if not 0.0 < self.pool_memory_fraction <= 1.0:
            raise ValueError(f"pool_memory_fraction must be in (0, 1], got {self.pool_memory_fraction}")
        for name in ("max_loras_per_batch", "max_loras_per_tenant", "max_lora_bytes_per_tenant"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {getattr(self, name)}")
        if not self.max_grammar_seconds_per_step >= 0:
            raise ValueError(f"max_grammar_seconds_per_step must be >= 0 (0: no bound), got {self.max_grammar_seconds_per_step}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    def _check_device(self) -> None:
        """cpu, cuda or cuda:N, and a CUDA device must exist: refused here, not as a traceback at load."""
        device = _DEVICE.fullmatch(self.device)
        if device is None:
            raise ValueError(f"--device must be cpu, cuda or cuda:N, got {self.device!r}")
        if device[1] != "cuda":
            return
        import torch

        if not torch.cuda.is_available():
            why = "this torch is built without CUDA" if torch.version.cuda is None else "no GPU is visible"
            raise ValueError(f"--device {self.device}: CUDA is not available ({why}); use --device cpu")
        if device[2] is not None and int(device[2]) >= torch.cuda.device_count():
            raise ValueError(f"--device {self.device}: this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
        return getattr(torch, self.dtype)

    def resolve_num_pages(self, page_elems: int) -> int:
        """Pages of the pool: `num_pages`, else `pool_bytes`, else `pool_memory_fraction` of the free
        CUDA memory (call it after the weights are loaded); 256 MiB on cpu."""
        if self.num_pages is not None:
            return self.num_pages
        import torch

        page_bytes = page_elems * torch.tensor([], dtype=self.torch_dtype).element_size()
        pool_bytes = self.pool_bytes
        if pool_bytes is None:
            device = torch.device(self.device)
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                pool_bytes = int(free * self.pool_memory_fraction)
            else:
                pool_bytes = 256 << 20
        num_pages = pool_bytes // page_bytes
        if num_pages < 1:
            raise StartupError(f"a pool of {pool_bytes} bytes holds no page of {page_bytes} bytes; give the engine a "
                               "larger pool (--pool-bytes, --pool-memory-fraction or --num-pages)")
        return int(num_pages)

    def resolve_max_model_len(self, model_max: int, num_pages: int) -> int:
        """The context the engine serves (as vLLM): `max_model_len`, else the model's
        max_position_embeddings, and never more than the KV cache holds. The model's own length is
        lowered to the cache's with a warning; an explicit `max_model_len` the cache cannot hold is
        refused, since requests would be refused or cut short at a length the user did not choose."""
        kv_tokens = num_pages * self.block_size
        if self.max_model_len is not None and self.max_model_len > model_max:
            log.warning("--max-model-len %d is more than the model's max_position_embeddings (%d): the engine "
                        "serves at most %d tokens", self.max_model_len, model_max, model_max)
        wanted = min(self.max_model_len or model_max, model_max)
        if wanted <= kv_tokens:
            return wanted
        fix = ("give the engine a larger pool (--pool-bytes, --pool-memory-fraction or --num-pages; now "
               f"{num_pages} pages of {self.block_size} tokens)")
        if self.max_model_len is not None:
            raise StartupError(f"max_model_len {self.max_model_len} is larger than the KV cache holds ({kv_tokens} "
                               f"tokens); lower --max-model-len to at most {kv_tokens} or {fix}")
        if kv_tokens < 2:
            raise StartupError(f"the KV cache holds {kv_tokens} token; {fix}")
        log.warning("max_model_len lowered from the model's %d to %d tokens, what the KV cache holds; to serve "
                    "the full context, %s", model_max, kv_tokens, fix)
        return kv_tokens
