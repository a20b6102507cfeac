"""Compile a start-up's Triton kernels on several threads, before the warm-up launches them.

Triton compiles a kernel the first time it is launched with a new specialization (its constexprs,
dtypes and the divisibility of its integer arguments), one after the other. An 8B worker's warm-up
and graph captures need about 150 of them, over 100 s on an empty cache. Instead:

    with launches_recorded() as found:
        run the warm-up's forwards       # each launch that would compile is listed, not run
    compile_all(found, threads=16)       # the list, compiled at once on a thread pool

and the warm-up proper then finds every kernel compiled. The compiler's MLIR passes and ptxas run
outside the GIL, so the threads overlap. `save_list` keeps the list beside Triton's disk cache, and a
later start of the same engine compiles it (`load_list`) without running the listing forwards again.
While launches are recorded, kernels compiled already run as usual and the skipped ones leave their
outputs as their buffers held them: the forwards run only
to reach every launch, and their results are dropped. None of the kernels here writes indices that
torch or another kernel reads back, so the rest of a forward runs on those values without fault.

Triton's hook is one for the whole process: one thread records at a time (a second waits), and only
its own launches are skipped. Another thread's launch compiles as usual, also one the recording
thread listed already (see `_Skip`).

Both use Triton's own hooks (`knobs.runtime.jit_cache_hook`, `JITFunction.preload` and its
asynchronous compile mode, with the `ignore_errors` of Triton 3.6 and later); `supported()` says
whether this Triton has them. Where it does not, or under the interpreter, the warm-up compiles as
it goes, as before.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import os
import pkgutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

try:
    import triton
    from triton import knobs
    from triton.runtime import _async_compile
    from triton.runtime.jit import JITFunction
except ImportError:  # an older Triton, or none
    triton = knobs = _async_compile = JITFunction = None

log = logging.getLogger(__name__)
_RECORDING = threading.RLock()  # one recording window at a time: the hook is the process's


def supported() -> bool:
    """This Triton can record launches and compile the list ahead (never under the interpreter)."""
    if knobs is None or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not (hasattr(knobs.runtime, "jit_cache_hook") and hasattr(JITFunction, "preload")
            and hasattr(_async_compile, "AsyncCompileMode")):
        return False
    # Before `ignore_errors`, a failed compile left the mode active with its pool shut down.
    return "ignore_errors" in inspect.signature(_async_compile.AsyncCompileMode).parameters


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
    """Stands in a kernel's in-memory cache for a specialization listed already while launches are
    recorded, so that its later launches cost no second call of the hook. On the recording thread a
    launch does nothing. On any other thread it compiles the specialization (which then replaces
    this in the cache) and launches it, as Triton's own launch would (JITFunction.run: launch
    metadata, then run with the kernel's function and packed metadata)."""

    def __init__(self, spec: Specialization, cache: dict, owner: int) -> None:
        self.spec, self.cache, self.owner = spec, cache, owner
        self._compiled = None

    def _kernel(self):
        if self._compiled is None:
            self.spec.kernel.preload(self.spec.data)
            self._compiled = self.cache[self.spec.key]
        return self._compiled

    def launch_metadata(self, *args, **kwargs):
        if threading.get_ident() == self.owner:
            return None
        return self._kernel().launch_metadata(*args, **kwargs)

    def run(self, *args, **kwargs):
        """Triton's call: (grid x, y, z, stream, function, packed metadata, launch metadata, ...)."""
        if threading.get_ident() == self.owner:
            return None
        kernel = self._kernel()
        launcher = kernel.run  # loads the kernel's module where not loaded yet
        return launcher(*args[:4], kernel.function, kernel.packed_metadata, *args[6:], **kwargs)

    function = packed_metadata = None


@contextlib.contextmanager
def launches_recorded(skip: bool = True) -> Iterator[list[Specialization]]:
    """Within: a launch from this thread that would compile is neither compiled nor run; its
    specialization is appended to the yielded list (once per distinct one). Launches of kernels
    compiled already run as usual, and other threads' launches as they would. On leaving, Triton's
    previous cache hook is put back and the kernels' caches hold what they held before, and what
    compiled meanwhile. With `skip` False, the launches that compile are listed and compile and run
    as usual."""
    with _RECORDING:
        found: list[Specialization] = []
        skips: list[tuple[dict, str, _Skip]] = []
        owner = threading.get_ident()
        previous = knobs.runtime.jit_cache_hook

        def record(*, key, fn, compile, **kwargs) -> bool | None:
            if threading.get_ident() != owner:
                return previous(key=key, fn=fn, compile=compile, **kwargs) if previous else None
            spec = Specialization(fn.jit_function, key, compile["specialization_data"])
            found.append(spec)
            if not skip:
                return False
            cache = spec.kernel.device_caches[compile["device"]][0]
            cache[key] = skip_it = _Skip(spec, cache, owner)  # its next launches find it "compiled"
            skips.append((cache, key, skip_it))
            return True  # Triton: skip the compile, and with it this launch

        knobs.runtime.jit_cache_hook = record
        try:
            yield found
        finally:
            knobs.runtime.jit_cache_hook = previous
            for cache, key, skip_it in skips:
                if cache.get(key) is skip_it:
                    del cache[key]


def compile_all(found: list[Specialization], threads: int) -> int:
    """Compile every specialization in `found` on `threads` threads (Triton's disk cache serves
    those compiled before); each lands in its kernel's in-memory cache as a launch would leave it.
    A specialization that fails to compile is logged and left out: its launch compiles it again and
    raises there, where the error belongs. Returns how many compiled."""
    if not found:
        return 0
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="triton-compile")
    with pool, _async_compile.AsyncCompileMode(pool, ignore_errors=True):
        for spec in found:
            try:
                spec.kernel.preload(spec.data)
            except Exception as e:  # noqa: BLE001 - any failure: the launch compiles it as usual
                log.warning("compiling %s ahead failed (%s): it compiles at its first launch", spec.name, e)
    compiled = 0
    for spec in found:
        for caches in getattr(spec.kernel, "device_caches", {}).values():
            kernel = caches[0].get(spec.key)
            if isinstance(kernel, _async_compile.FutureKernel):
                del caches[0][spec.key]  # failed, in a Triton that keeps it: the launch compiles anew
            elif kernel is not None:
                compiled += 1
                break
    return compiled


_LIST_FORMAT = 1
_LIST_BYTES = 8 << 20  # a start lists ~150 specializations of ~1 kB each
_LIST_DAYS = 30  # a list no start has used for that long is removed when another is written
LIST_PREFIX = "lorafleet-start-"


def kernel_name(kernel) -> str:
    return f"{kernel.fn.__module__}:{kernel.fn.__qualname__}"


def own_kernels() -> dict[str, object]:
    """This package's Triton kernels (JITFunctions) by `kernel_name`, from every module of the package
    (imported here: the engine imports some only at their first launch, after the list is read)."""
    for module in pkgutil.iter_modules(sys.modules[__package__].__path__):
        try:
            importlib.import_module(f"{__package__}.{module.name}")
        except ImportError as e:  # its kernels are left out of the list: they compile at their launch
            log.warning("kernel module %s does not import (%s): its kernels are not listed", module.name, e)
    table = {}
    for name, module in list(sys.modules.items()):
        if name.startswith(f"{__package__}.") and module is not None:
            for value in list(vars(module).values()):
                if isinstance(value, JITFunction) and value.fn.__module__ == name:
                    table[kernel_name(value)] = value
    return table


def save_list(found: list[Specialization], path: Path) -> None:
    """Write this package's kernels of `found` to `path` for `load_list` (JSON: each kernel named by
    module and name, with the hash of its source; one entry per kernel and key), through a file of its
    own replaced at once, as workers sharing a cache may write it together. Lists beside it unused for
    30 days are removed."""
    own, entries = own_kernels(), {}
    for s in found:
        name = kernel_name(s.kernel)
        if own.get(name) is s.kernel:
            entries[name, s.key] = {"kernel": name, "source": s.kernel.cache_key, "key": s.key, "data": s.data}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{LIST_PREFIX}")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"format": _LIST_FORMAT, "specializations": list(entries.values())}, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    for old in path.parent.glob(f"{LIST_PREFIX}*.json"):
        with contextlib.suppress(OSError):
            if old != path and time.time() - old.stat().st_mtime > _LIST_DAYS * 86400:
                old.unlink()


def load_list(path: Path) -> list[Specialization] | None:
    """The list `save_list` wrote at `path`, less the entries that no longer fit this code (a kernel
    gone, not this package's, or changed since: its source hash differs) or that do not agree with
    themselves; None where there is none left, or the file is not a regular file of at most 8 MiB
    that reads as such a list. It is trusted as Triton's cache beside it is (whoever may write there
    may put compiled kernels there too), but its text is never imported: kernels are looked up by
    name among this package's kernel modules."""
    try:
        if not path.is_file():  # also a fifo or device behind a link
            return None
        with open(path, "rb") as f:
            text = f.read(_LIST_BYTES + 1)
        if len(text) > _LIST_BYTES:
            raise ValueError(f"larger than {_LIST_BYTES} bytes")
        saved = json.loads(text)
        if saved.get("format") != _LIST_FORMAT:
            raise ValueError(f"format {saved.get('format')!r}")
        entries = list(saved["specializations"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as e:
        log.warning("the kernel list of an earlier start (%s) is not used: %s", path, e)
        return None
    own, found, dropped = own_kernels(), [], []
    for entry in entries:
        try:
            kernel, key, data = own.get(entry["kernel"]), str(entry["key"]), str(entry["data"])
            if kernel is None or kernel.cache_key != entry["source"]:
                raise ValueError(f"{entry['kernel']} is not a kernel of this code")
            described = json.loads(data)
            names = (kernel.fn.__name__, f"{kernel.fn.__module__}.{kernel.fn.__qualname__}")  # as Triton versions write it
            if described.get("key") != key or described.get("name") not in names:
                raise ValueError(f"{entry['kernel']}: its specialization names another kernel or key")
            found.append(Specialization(kernel, key, data))
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            dropped.append(str(e)[:200])
    if dropped:
        log.warning("%d of %d entries of the kernel list %s are left out (%s): they compile at their launch",
                    len(dropped), len(entries), path, dropped[0])
    if not found:
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # in use
    return found


COMPILE_BYTES = 1 << 30  # memory left free per compile thread: a bound for LLVM and ptxas, not a measured peak


def default_threads(cgroup_root: str = "/sys/fs/cgroup", meminfo: str = "/proc/meminfo") -> int:
    """One compile thread per CPU core this process may use (its affinity, and its cgroup's CPU
    quota where one is set, as in a pod with a CPU limit), at most 16, and at most one per
    COMPILE_BYTES of the memory free to it (its cgroup's limit less its use, and the machine's
    available memory): a pod with a small memory limit is not killed for compiling on every core."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpus(cgroup_root)
    if quota is not None:
        cores = min(cores, quota)
    free = [b for b in (_cgroup_free_bytes(cgroup_root), _available_bytes(meminfo)) if b is not None]
    if free:
        cores = min(cores, min(free) // COMPILE_BYTES)
    return max(1, min(16, cores))


def _cgroup_free_bytes(root: str) -> int | None:
    """The cgroup's memory limit less its use (v2 memory.max and memory.current, or v1's
    memory.limit_in_bytes and memory.usage_in_bytes); None without a limit or where none can be read."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            with open(os.path.join(root, limit_file)) as f:
                limit = f.read().strip()
            with open(os.path.join(root, usage_file)) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:  # v1 says "no limit" with a huge number
            return None
        return max(0, int(limit) - usage)
    return None


def _available_bytes(meminfo: str) -> int | None:
    """MemAvailable of /proc/meminfo, in bytes; None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_cpus(root: str) -> int | None:
    """Whole CPUs of the cgroup's quota (v2 cpu.max "200000 100000", or v1 cpu.cfs_quota_us and
    cpu.cfs_period_us: 2), at least 1; None where no quota is set or none can be read."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        try:
            with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        except OSError:
            return None
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:  # "max", or unreadable
        return None
    return max(1, quota_us // period_us) if quota_us > 0 and period_us > 0 else None
