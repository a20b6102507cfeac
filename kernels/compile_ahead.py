"""Compile a start-up's Triton kernels on several threads, before the warm-up launches them.

Triton compiles a kernel the first time it is launched with a new specialization (its constexprs,
dtypes and the divisibility of its integer arguments), one after the other. An 8B worker's warm-up
and graph captures need about 150 of them, over 100 s on an empty cache. Instead:

    with launches_recorded() as found:
        run the warm-up's forwards       # no Triton kernel is compiled or run, each one is listed
    compile_all(found, threads=16)       # the list, compiled at once on a thread pool

and the warm-up proper then finds every kernel compiled. The compiler's MLIR passes and ptxas run
outside the GIL, so the threads overlap. While launches are recorded, the outputs of the skipped
kernels are whatever their buffers held: the forwards run only to reach every launch, and their
results are dropped. None of the kernels here writes indices that torch reads back, so the rest of
a forward runs on those values without fault.

Both use Triton's own hooks (`knobs.runtime.jit_cache_hook`, `JITFunction.preload` and its
asynchronous compile mode); `supported()` says whether this Triton has them. Where it does not, or
under the interpreter, the warm-up compiles as it goes, as before.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

try:
    import triton
    from triton import knobs
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction
except ImportError:  # an older Triton, or none
    triton = knobs = _async_compile = JITFunction = None


def supported() -> bool:
    """This Triton can record launches and compile the list ahead (never under the interpreter)."""
    if knobs is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return (hasattr(knobs.runtime, "jit_cache_hook") and hasattr(JITFunction, "preload")
            and hasattr(_async_compile, "AsyncCompileMode"))


@dataclass(frozen=True)
class Specialization:
    """One kernel launch Triton had not compiled: the kernel and its serialized specialization."""

    kernel: object  # the JITFunction
    key: str  # Triton's in-memory cache key for it
    data: str  # JSON, as JITFunction.preload takes it

    @property
    def name(self) -> str:
        return getattr(self.kernel, "__name__", repr(self.kernel))


class _Skip:
    """Stands in a kernel's in-memory cache for a specialization recorded already, while launches
    are recorded: its later launches do nothing, and cost no second call of the hook."""

    function = packed_metadata = None

    def launch_metadata(self, *args, **kwargs) -> None:
        return None

    def run(self, *args, **kwargs) -> None:
        return None


@contextlib.contextmanager
def launches_recorded() -> Iterator[list[Specialization]]:
    """Within: a Triton launch that would compile is neither compiled nor run; its specialization
    is appended to the yielded list (once per distinct one). Launches of kernels compiled already
    run as usual. On leaving, Triton's previous cache hook is put back and its caches hold only
    what they held before, and what compiled meanwhile."""
    found: list[Specialization] = []
    skips: list[tuple[dict, str]] = []
    skip = _Skip()

    def record(*, key, fn, compile, **_) -> bool:
        kernel = fn.jit_function
        found.append(Specialization(kernel, key, compile["specialization_data"]))
        cache = kernel.device_caches[compile["device"]][0]
        cache[key] = skip  # its next launches find it "compiled" and do nothing
        skips.append((cache, key))
        return True  # Triton: skip the compile, and with it this launch

    previous = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = record
    try:
        yield found
    finally:
        knobs.runtime.jit_cache_hook = previous
        for cache, key in skips:
            if cache.get(key) is skip:
                del cache[key]


def compile_all(found: list[Specialization], threads: int) -> int:
    """Compile every specialization in `found` on `threads` threads (Triton's disk cache serves
    those compiled before); each lands in its kernel's in-memory cache as a launch would leave it.
    A specialization that fails to compile is dropped here: its launch compiles it again and raises
    there, where the error belongs. Returns how many compiled."""
    if not found:
        return 0
    mode_class = _async_compile.AsyncCompileMode
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="triton-compile") as pool:
        try:
            mode = mode_class(pool, ignore_errors=True)
        except TypeError:  # a Triton whose mode has no ignore_errors: a failure raises on leaving
            mode = mode_class(pool)
        with contextlib.suppress(Exception), mode:
            for spec in found:
                spec.kernel.preload(spec.data)
    return sum(1 for spec in found if _compiled(spec))


def _compiled(spec: Specialization) -> bool:
    """The kernel's in-memory cache holds a compiled kernel under the specialization's key."""
    for caches in getattr(spec.kernel, "device_caches", {}).values():
        kernel = caches[0].get(spec.key)
        if kernel is not None and not isinstance(kernel, _async_compile.FutureKernel):
            return True
    return False


def default_threads() -> int:
    """One compile thread per CPU core this process may use (its affinity, and its cgroup's CPU
    quota where one is set, as in a pod with a CPU limit), at most 16."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpus()
    if quota is not None:
        cores = min(cores, quota)
    return max(1, min(16, cores))


def _cgroup_cpus(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """Whole CPUs of a cgroup v2 quota ("200000 100000" -> 2), or None where there is none."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, int(quota) // int(period))
