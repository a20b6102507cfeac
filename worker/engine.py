"""Engine: the offline API over scheduler, model runner and sampler.

    engine = Engine(EngineConfig(model="path"))
    outs = engine.generate(["hi", [1, 2, 3]], SamplingParams(max_tokens=8), adapters=["a", None])

`add_request` / `step` / `abort` drive it one step at a time (the AsyncEngine does so from its
thread). Adapters are registered by name; requests name an adapter ("name" or "name@version").
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from lorafleet.kernels.lora import resolve_backend
from lorafleet.worker.adapter_dir import AdapterDirReport, register_adapter_dir
from lorafleet.worker.adapter_entry import AdapterNotFoundError
from lorafleet.worker.adapter_image import ModelDims
from lorafleet.worker.adapter_pool import AdapterPool, AdapterPoolConfig, TenantQuota
from lorafleet.worker.block_manager import BlockManager
from lorafleet.worker.cuda_graphs import DecodeGraphs
from lorafleet.worker.engine_config import EngineConfig
from lorafleet.worker.engine_errors import ContextLengthError, EngineError, UnknownAdapterError
from lorafleet.worker.engine_offline import Prompt, generate
from lorafleet.worker.forward_failures import ForwardFailures
from lorafleet.worker.json_guide import JsonGuide
from lorafleet.worker.kv_room import KVRoom
from lorafleet.worker.model_dir import read_model_dir
from lorafleet.worker.model_limits import check_params
from lorafleet.worker.model_runner import ModelRunner
from lorafleet.worker.page_pool import PagePool, PagePoolConfig, kv_page_elems
from lorafleet.worker.peft_adapter import load_peft_adapter
from lorafleet.worker.request_output import OutputTracker, RequestOutput
from lorafleet.worker.sampler import Sampler
from lorafleet.worker.sampling_params import SamplingParams
from lorafleet.worker.scheduled_batch import ScheduledBatch, by_adapter
from lorafleet.worker.scheduler import Scheduler
from lorafleet.worker.sequence import Sequence, generator_seed
from lorafleet.worker.stop_checker import StopChecker
from lorafleet.worker.vocab_digest import probe_encodings, vocab_digest
from lorafleet.worker.warmup import warm_up

log = logging.getLogger(__name__)


class ShutdownError(RuntimeError):
    """The worker shut down before the request finished (it outlived the shutdown grace)."""


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_dir = config.model
        if model_dir is None:
            from lorafleet.worker.default_model import default_model_dir

            model_dir = str(default_model_dir())
        self.model_dir = Path(model_dir)
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self._tokenizer_digest, self._tokenizer_encodings = None, None  # str, list[list[int]]: computed when first asked
        read = read_model_dir(self.model_dir, config, dtype=self.dtype, device=self.device)
        self.sampling_defaults, self.model_config, self.tokenizer = read.sampling_defaults, read.config, read.tokenizer
        self.eos_token_ids, self.model = read.eos_token_ids, read.model
        mc = self.model_config
        page_elems = kv_page_elems(num_layers=mc.num_hidden_layers, block_size=config.block_size,
                                   num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim)
        num_pages = config.resolve_num_pages(page_elems)
        # Never longer than the KV cache holds: a request of max_model_len tokens must fit it.
        self.max_model_len = config.resolve_max_model_len(mc.max_position_embeddings, num_pages)
        self.page_pool = PagePool(PagePoolConfig(
            num_pages=num_pages, page_elems=page_elems, dtype=self.dtype, device=str(self.device),
            max_pages={"kv": None, "adapter": config.max_adapter_pages},
        ))
        self.block_manager = BlockManager(self.page_pool, config.block_size, prefix_caching=config.enable_prefix_caching)
        self.adapter_pool = AdapterPool(
            self.page_pool, ModelDims.from_model_config(mc),
            AdapterPoolConfig(max_slots=config.max_loras, max_rank=config.max_lora_rank, default_quota=TenantQuota(
                max_adapters=config.max_loras_per_tenant, max_bytes=config.max_lora_bytes_per_tenant),
                num_load_threads=config.adapter_load_threads, load_timeout_s=config.adapter_load_timeout_s),
        )
        if (cache := self.block_manager.prefix_cache) is not None:
            cache.adapter_tag = self.adapter_pool.content_tag  # an adapter's KV is its registration's
            self.adapter_pool.on_dropped = cache.drop_tag  # whose blocks are plain free pages once it is gone
        # A request that could never get its KV pages (its adapter's and pinned ones' taken off) is refused.
        self.kv_room = KVRoom(self.adapter_pool, num_pages=num_pages, block_size=config.block_size,
                              max_model_len=self.max_model_len)
        self.scheduler = Scheduler(
            self.block_manager, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill, adapter_pool=self.adapter_pool,
            max_loras_per_batch=config.max_loras_per_batch, max_adapter_wait_steps=config.max_adapter_wait_steps,
            reclaim_pages=self._reclaim_adapter_pages, adapter_state=self.adapter_pool.residency,
            never_fits=self.kv_room.refusal, max_grammar_seconds_per_step=config.max_grammar_seconds_per_step,
        )
        kv_caches = self.page_pool.kv_caches(num_layers=mc.num_hidden_layers, block_size=config.block_size,
                                             num_kv_heads=mc.num_key_value_heads, head_dim=mc.head_dim)
        gpu_kernels = self.device.type == "cuda" and resolve_backend(config.kernel_backend, self.device) == "triton"
        lora_stream = torch.cuda.Stream(self.device) if config.lora_overlap and self.device.type == "cuda" else None
        graphs = DecodeGraphs(
            self.model, kv_caches, device=self.device, max_num_seqs=config.max_num_seqs,
            max_blocks=-(-self.max_model_len // config.block_size), backend=config.kernel_backend,
            lora_layout=self._lora_layout, lora_stream=lora_stream, lora_segment_len=config.lora_segment_len,
        ) if config.cuda_graphs and gpu_kernels else None
        self.runner = ModelRunner(self.model, self.block_manager, kv_caches, device=self.device,
                                  backend=config.kernel_backend, lora_layout=self._lora_layout,
                                  slot_max_rank=self._slot_max_rank, lora_segment_len=config.lora_segment_len,
                                  graphs=graphs, lora_stream=lora_stream)
        if gpu_kernels:
            warm_up(self.runner, config, mc, self.max_model_len)
        self.sampler = Sampler(seed=config.seed, device=self.device, eos_token_ids=self.eos_token_ids,
                               json_guide=JsonGuide.of(self.tokenizer, mc.vocab_size, self.eos_token_ids, self.device))
        self.scheduler.grammar_estimate, self.requests = self.sampler.grammar_costs.estimate, {}  # requests: id -> Sequence
        self.adapter_eos: dict[str, frozenset[int]] = {}  # adapter key -> its own end token, where the base has it
        self.stop_checker = StopChecker(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.outputs, self._ids, self.last_batch_size, self.last_batch_adapters = OutputTracker(), itertools.count(), 0, 0
        self.forward_failures = ForwardFailures(config.max_failed_forwards)  # many in a row: unhealthy
        self.adapter_dir_report = AdapterDirReport()  # what --adapters DIR registered, and what not
        if config.adapters:
            self.register_adapter_dir(config.adapters)

    # ---- setup helpers ------------------------------------------------------------------------------
    def _lora_layout(self):
        return self.adapter_pool.layout

    def _slot_max_rank(self, slot: int) -> int:
        """Largest rank of the adapter in `slot` (sizes the step's shrink buffer, and the kernels cut every
        slot's rank to the batch's largest); host-side, no sync."""
        rank = self.adapter_pool.slot_rank(slot)
        return self.config.max_lora_rank if rank is None else rank

    def _reclaim_adapter_pages(self, num_pages: int) -> int:
        """Before preempting for KV room: evict idle, unpinned adapters that no waiting request needs
        (the adapter pool decides, in its eviction order). Returns pages freed."""
        return self.adapter_pool.reclaim_for_kv(num_pages)

    # ---- adapters -----------------------------------------------------------------------------------
    def register_adapter(
        self, name: str, path: str | Path, version: str | None = None, *, tenant: str = "default",
        pinned: bool = False, make_current: bool = True, sha256: str | None = None, keep_previous: str | None = None,
    ) -> str:
        """Load and validate a PEFT adapter directory and register it as `name@version`; returns the key.

        `version` defaults to the adapter's content digest. The adapter is copied to the GPU pool on
        first use (or now when pinned). A new version of a registered name becomes current once
        resident (`keep_previous`: that key, if it is the version replaced then, stays registered: its canary); with
        `make_current=False` it is only registered beside the current one (a canary).
        `sha256`, when given, is the digest the files must have (as `sources.adapter_digest`); other files
        are refused (AdapterError naming both digests) before their weights are parsed."""
        if not name or "@" in name or "/" in name:
            raise EngineError(f"adapter name {name!r} must be non-empty and contain neither '@' nor '/'")
        started = time.perf_counter()
        weights = load_peft_adapter(
            path, self.model_config, dtype=self.dtype, strict_base=self.config.strict_base,
            base_model_name=self.base_model_names, tokenizer_digest=self.tokenizer_digest, name=name, version=version,
            tokenizer_encodings=self.tokenizer_encodings,
            base_token_id=self.tokenizer.token_to_id if self.tokenizer is not None else None,
            max_file_bytes=self.config.max_adapter_file_bytes, sha256=sha256, max_rank=self.config.max_lora_rank)
        key = f"{name}@{weights.version}"
        notes, own = self.tokenizer.adapter_chat(Path(path), self.config.max_adapter_file_bytes) if self.tokenizer else ([], None)
        registered = set(self.adapter_pool.registered())  # before its first request can resolve to it:
        self.adapter_eos = {k: v for k, v in self.adapter_eos.items() if k in registered} | {  # its requests end on it
            key: frozenset(() if own is None else (own,))}
        self.adapter_pool.add(key, weights, tenant=tenant, pinned=pinned, make_current=make_current,
                              keep_previous=keep_previous, read_seconds=time.perf_counter() - started)
        log.log(logging.WARNING if notes else logging.INFO, "registered adapter %s from %s%s", key, path, "".join(f"; {n}" for n in notes))
        return key

    def register_adapter_dir(self, directory: str | Path) -> list[str]:
        """Register every PEFT subfolder of `directory` (name = folder name); those that fail are logged
        and kept in `adapter_dir_report` (worker/adapter_dir.py). Returns the keys registered."""
        self.adapter_dir_report = register_adapter_dir(self, directory)
        return self.adapter_dir_report.keys

    def unregister_adapter(self, name: str) -> None:
        """Remove every version of `name`; requests already using it finish on it."""
        try:
            self.adapter_pool.unregister(name)
        except AdapterNotFoundError as exc:
            raise EngineError(str(exc)) from exc
        self.adapter_eos = {k: v for k, v in self.adapter_eos.items() if k.split("@")[0] != name}

    def adapters(self) -> list[str]:
        return self.adapter_pool.registered()

    @property
    def model_name(self) -> str:
        return self.model_config.name or self.model_dir.name

    @property
    def base_model_names(self) -> list[str]:
        """The names an adapter's base_model_name_or_path may give the served base (peft_adapter.py)."""
        return [self.model_name, self.model_config.name_or_path, *self.config.base_model_aliases]

    @property
    def tokenizer_digest(self) -> str | None:
        """Digest of the served vocabulary: adapters shipping a different tokenizer are refused."""
        if self.tokenizer is None:
            return None
        if self._tokenizer_digest is None:
            self._tokenizer_digest = vocab_digest(self.tokenizer.path)
        return self._tokenizer_digest

    @property
    def tokenizer_encodings(self) -> list[list[int]] | None:
        """The served tokenizer's ids of `vocab_digest.PROBE_TEXTS` (an adapter's that gives others is refused)."""
        if self.tokenizer is None:
            return None
        if self._tokenizer_encodings is None:
            self._tokenizer_encodings = probe_encodings(self.tokenizer.path, isolated=False)  # the served base's own
        return self._tokenizer_encodings

    # ---- requests -----------------------------------------------------------------------------------
    def encode(self, prompt: Prompt, *, add_special_tokens: bool = True, limit: int | None = None) -> list[int]:
        """A text's ids (BOS first unless not `add_special_tokens`; PromptTooLong past `limit`), or ids checked."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise EngineError("this model directory has no tokenizer.json: pass token ids, not text")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens, limit=limit)
        vocab = self.model_config.vocab_size
        ids = list(prompt) if isinstance(prompt, list) and set(map(type, prompt)) <= {int} else [int(t) for t in prompt]
        if ids and (min(ids) < 0 or max(ids) >= vocab) and (bad := [t for t in ids if not 0 <= t < vocab]):
            raise EngineError(f"token ids {bad[:5]} are outside the vocabulary (0..{self.model_config.vocab_size - 1})")
        return ids

    def add_request(self, request_id: str | None, prompt: Prompt, params: SamplingParams | None = None, *,
                    adapter: str | None = None, tenant: str | None = None) -> str:
        params = copy.copy(params) if params is not None else SamplingParams()  # its own: kv_room may lower max_tokens
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise EngineError(f"request id {request_id!r} is already in flight")
        check_params(params, has_tokenizer=self.tokenizer is not None, vocab_size=self.model_config.vocab_size)
        prompt_ids = self.encode(prompt)
        if not prompt_ids:
            raise EngineError("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ContextLengthError(f"the prompt has {len(prompt_ids)} tokens; the model accepts at most "
                                     f"{self.max_model_len - 1} (max_model_len {self.max_model_len})")
        seq = Sequence(request_id, prompt_ids, params, adapter=self._resolve_adapter(adapter), tenant=tenant)
        seq.adapter_eos = self.adapter_eos.get(seq.adapter, frozenset())
        if (refusal := self.kv_room.refusal(seq)) is not None:
            raise refusal
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device)
            seq.generator.manual_seed(generator_seed(params.seed, seq.generator.device))
        self._resolve_adapter(adapter, hold=seq)  # its version stays registered until it takes it (push: switch)
        self.requests[request_id] = seq
        self.outputs.start(request_id)
        self.scheduler.add(seq)
        return request_id

    def _resolve_adapter(self, adapter: str | None, hold: Sequence | None = None) -> str | None:
        """"name" (its current version) or "name@version" -> the key the request is served by; `hold`: the
        sequence resolved to it holds it (AdapterPool.hold: counted as its GPU hit or miss), unless it went since."""
        if adapter is None:
            return None
        try:
            pool = self.adapter_pool
            return pool.resolve(adapter) if hold is None else pool.hold(hold.adapter, hold.seq_id, count=True, tenant=hold.tenant)
        except AdapterNotFoundError as exc:
            raise UnknownAdapterError(f"adapter {adapter!r} is not registered (registered: "
                              f"{', '.join(self.adapter_pool.registered()) or 'none'})") from exc

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.outputs.forget(request_id)
        if not seq.is_finished:
            self.scheduler.finish(seq, "abort")
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -----------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.adapter_pool.keep_warm(kv_reserve=self.num_running)  # never blocks (adapter_warmth.py)
        batch = self.scheduler.schedule()
        self.last_batch_size = batch.num_seqs
        self.last_batch_adapters = len(batch.adapters())
        outputs = self._report_failed()
        if batch.is_empty:
            return outputs
        try:
            done = self._forward(batch)
        except Exception as exc:
            return outputs + self._forward_failed(batch, exc)
        self.forward_failures.succeeded()
        return outputs + self._advance(batch, *done)

    def _forward(self, batch: ScheduledBatch) -> tuple[list[Sequence], list, dict[int, Exception]]:
        """Run `batch`: the sequences that sample, their (token, logprob) and the sampler's rows that failed."""
        logits, samplers = self.runner.run(batch)
        if logits is None:
            return samplers, [], {}
        return samplers, self.sampler.sample(logits, samplers), dict(self.sampler.row_errors)

    def _forward_failed(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        """A forward of several adapters' requests (the base model's counting as one) failed: each adapter's run
        again alone, so one adapter's failure (a kernel refusing its shapes, its weights) fails only its requests,
        not the other tenants' in the step. One adapter's alone does not count as the device's (ForwardFailures)
        while a forward without adapters still runs (ModelRunner.probe)."""
        groups = by_adapter(batch)
        alone = len(groups) == 1
        if not alone:
            log.warning("a forward of %d requests over %d adapters failed (%r): each adapter's requests run alone",
                        batch.num_seqs, len(groups), exc)
        outputs, ran = [], False
        for adapter, part in groups.items():
            try:
                if alone:
                    raise exc
                done = self._forward(part)
            except Exception as part_exc:
                log.exception("a forward of %d requests of %s failed; they end with an error", part.num_seqs,
                              f"adapter {adapter}" if adapter else "the base model")
                self.scheduler.fail([seq for seq, _ in part.scheduled], part_exc)
                continue
            ran = True
            outputs += self._advance(part, *done)
        if ran:
            self.forward_failures.succeeded()
        else:
            self.forward_failures.failed(exc, counted=not alone or None in groups or not self.runner.probe())
        return outputs + self._report_failed()

    def _advance(self, batch: ScheduledBatch, samplers: list[Sequence], sampled: list,
                 row_errors: dict[int, Exception]) -> list[RequestOutput]:
        """What a forward of `batch` that ran gives: tokens computed, each sampled one checked for a stop."""
        outputs, failing = [], {id(samplers[i]) for i in row_errors}  # a failed sequence's last blocks are not kept
        for seq, num_new in batch.scheduled:
            seq.num_computed_tokens += num_new
            if id(seq) not in failing:
                self.block_manager.keep_computed(seq)  # shared with sequences admitted from now on (prefix_cache.py)
        for i, (seq, (token, logprob)) in enumerate(zip(samplers, sampled, strict=True)):
            if (exc := row_errors.get(i)) is not None:  # this request fails, the others go on
                self.scheduler.fail([seq], exc)
                continue
            seq.output_token_ids.append(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            try:  # its stop check or its text failing (a bug, a tokenizer's) fails it alone, never the step
                self.stop_checker.check(seq)
                if seq.finish_reason is not None:
                    self.scheduler.finish(seq, seq.finish_reason)
                outputs.append(self._output(seq))
            except Exception as exc:
                log.exception("request %s failed after its step", seq.request_id)
                self.scheduler.fail([seq], row_errors.setdefault(i, exc))
        return outputs + (self._report_failed() if row_errors else [])

    def _report_failed(self) -> list[RequestOutput]:
        outputs = [self._output(self.stop_checker.ended(seq)) for seq in self.scheduler.failed]
        self.scheduler.failed.clear()
        return outputs

    def _output(self, seq: Sequence) -> RequestOutput:
        if seq.is_finished:
            self.requests.pop(seq.request_id, None)
        return self.outputs.next(seq)

    def generate(self, prompts: Seq[Prompt] | Prompt, sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 adapters: Seq[str | None] | None = None) -> list[RequestOutput]:
        """Run the prompts to completion together; one finished RequestOutput per prompt, in order."""
        return generate(self, prompts, sampling_params, adapters)

    def close(self) -> None:
        self.adapter_pool.close()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_preemptions(self) -> int:
        """Running sequences preempted for KV pages since the start (each recomputed later)."""
        return self.scheduler.num_preemptions

    @property
    def kv_usage(self) -> float:
        """KV pages over the pages the KV cache could hold now: free ones and idle adapters' (unified paging), not
        pinned or in-use adapters'. 1.0 when adapters hold the whole pool."""
        kv = self.page_pool.num_used("kv")
        capacity = kv + self.page_pool.num_free + self.adapter_pool.reclaimable_pages()
        return kv / capacity if capacity else 1.0

