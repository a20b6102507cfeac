"""PageCopier: puts an adapter's packed pages (CPU tier) into its pool pages without blocking the
step loop. On CUDA the copies run on a side stream (from pinned memory, so they are asynchronous DMA)
after the compute stream's work queued so far, because the pages may have just been freed by it; on
CPU devices a loader thread copies. Consecutive page ids whose image pages are neighbours in host memory
(one chunk of the image's `HostPages`) are copied as one run. The handle holds the image's pages until
the copy is done: their host memory goes back to its arena only after that.
"""

from __future__ import annotations

import time
from concurrent.futures import Executor, Future
from dataclasses import dataclass

import torch

from lorafleet.worker.host_arena import HostPages


@dataclass(slots=True)
class CopyHandle:
    future: Future | None = None  # CPU device
    start: torch.cuda.Event | None = None  # CUDA: timing events around the copies on the side stream
    done: torch.cuda.Event | None = None
    source: HostPages | None = None  # keeps the source pages from their arena until the copy finished


class PageCopier:
    def __init__(self, pool: torch.Tensor, executor: Executor) -> None:
        self.pool = pool  # [num_pages, page_elems]
        self.executor = executor
        self.cuda = pool.device.type == "cuda"
        self.stream = torch.cuda.Stream(pool.device) if self.cuda else None

    def start(self, pages: HostPages, page_ids: list[int]) -> CopyHandle:
        """Copy `pages` (len(page_ids) pages, CPU) into the pool's `page_ids`."""
        pool = self.pool
        runs = [(dst + offset, piece) for dst, src, n in page_runs(page_ids) for offset, piece in pages.slices(src, n)]
        if not self.cuda:
            def job(_source: HostPages = pages) -> float:  # the queued job holds the pages too
                t0 = time.perf_counter()
                for dst, piece in runs:
                    pool[dst : dst + piece.shape[0]].copy_(piece)
                return time.perf_counter() - t0

            return CopyHandle(future=self.executor.submit(job), source=pages)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(pool.device))
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            start.record(self.stream)
            for dst, piece in runs:
                pool[dst : dst + piece.shape[0]].copy_(piece, non_blocking=True)
            done.record(self.stream)
        return CopyHandle(start=start, done=done, source=pages)

    @staticmethod
    def is_done(handle: CopyHandle) -> bool:
        return handle.future.done() if handle.future is not None else handle.done.query()

    @staticmethod
    def seconds(handle: CopyHandle) -> float:
        """Copy time of a finished copy; raises what the copy raised."""
        if handle.future is not None:
            return handle.future.result()
        return handle.start.elapsed_time(handle.done) / 1000.0

    @staticmethod
    def wait(handle: CopyHandle, timeout: float) -> None:
        if handle.future is not None:
            from concurrent.futures import wait

            wait([handle.future], timeout=timeout)
        else:
            handle.done.synchronize()


def page_runs(page_ids: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive page ids as (first pool page, first image page, length): one copy each."""
    runs: list[tuple[int, int, int]] = []
    for src, pid in enumerate(page_ids):
        if runs and runs[-1][0] + runs[-1][2] == pid:
            dst, s, n = runs[-1]
            runs[-1] = (dst, s, n + 1)
        else:
            runs.append((pid, src, 1))
    return runs
