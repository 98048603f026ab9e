"""What the CPU backends need of the host machine, apart from the backend interface (base.py): how
many threads to spread memory-bound work over, what CPU this is, the thread pool's bookkeeping, and
the process's memory (glibc's reuse of freed blocks, resident size for the benchmarks)."""
from __future__ import annotations

import ctypes
import os
import threading
import time

import numpy as np
from threadpoolctl import threadpool_info

try:
    import resource  # POSIX only: the memory limit and the peak where /proc is missing
except ImportError:
    resource = None


def _loaded_openblas():
    """ctypes handle of the OpenBLAS this process has loaded (NumPy's), or None (another BLAS, or a
    system that does not list its mappings)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in os.path.basename(line.split()[-1]).lower()}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def blas_thread_timeout() -> int | None:
    """The thread timeout the loaded OpenBLAS holds (log2 of the cycles its idle threads spin; 0
    for its built-in 2^28), or None where it cannot say."""
    lib = _loaded_openblas()
    fn = getattr(lib, "openblas_thread_timeout", None)
    return None if fn is None else int(fn())


def rearm_blas_thread_timeout() -> bool:
    """Make an OpenBLAS that NumPy loaded before OPENBLAS_THREAD_TIMEOUT was set take it: OpenBLAS
    reads its environment again (``openblas_read_env``) and stops its worker threads
    (``blas_thread_shutdown_``, what it does itself around a fork); the next threaded product
    starts them again, with the timeout.  Both are exported by OpenBLAS builds (NumPy's wheels'
    included); where either is missing, nothing is done.  True if done."""
    lib = _loaded_openblas()
    read_env, shutdown = (getattr(lib, name, None) for name in ("openblas_read_env", "blas_thread_shutdown_"))
    if read_env is None or shutdown is None:
        return False
    read_env()
    shutdown()
    return True

def machine_memory() -> int | None:
    """Bytes of physical memory of this machine, or the process's address-space limit where one is
    set lower (``ulimit -v``, a batch system's); None where the system says neither."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = None
    try:
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit != resource.RLIM_INFINITY and limit > 0:
            total = limit if total is None else min(total, limit)
    except (AttributeError, OSError, ValueError):  # (no resource module: AttributeError on None)
        pass
    return total


def cpu_threads() -> int:
    """Host threads a CPU backend splits its memory-bound work over: ``PYCAPSNET_THREADS`` where it
    is set (any count), else the cores this process may use, fewer where OMP_NUM_THREADS asks for
    fewer (torchrun sets it to 1 for each of its processes).  Every core, not a fixed cap: a
    16-core host's step ran faster on 16 threads than on 4 (docs/performance.md)."""
    own = os.environ.get("PYCAPSNET_THREADS", "").strip()
    if own:
        if not own.isdigit() or int(own) < 1:
            from .base import BackendError

            raise BackendError(f"PYCAPSNET_THREADS={own!r}: give a whole number of threads, 1 or more "
                               f"(or unset it to use the cores this process may use)")
        return int(own)
    try:
        available = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        available = os.cpu_count() or 1
    try:
        asked = int(os.environ.get("OMP_NUM_THREADS", "") or 0)
    except ValueError:
        asked = 0
    return max(1, min(available, asked or available))


def _cpu_seconds(cpus) -> float | None:
    """Seconds the CPUs ``cpus`` have spent busy since boot, every process's (Linux's /proc/stat:
    user, nice, system, irq, softirq and steal time), or None where the system does not say."""
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                    t = [int(v) for v in fields[:8]]
                    busy += t[0] + t[1] + t[2] + t[5] + t[6] + t[7]
    except (OSError, ValueError, IndexError):
        return None
    return busy / os.sysconf("SC_CLK_TCK")


def busy_cores(window: float = 0.2) -> float | None:
    """How many of the cores this process may use other processes keep busy, measured over the next
    ``window`` seconds (their busy time less this process's own CPU time), or None where the system
    does not say.  A step spread over every core waits for the slowest: on a 2-core machine with one
    core busy, two threads ran slower than one (docs/performance.md)."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # not on Linux
        return None
    before, own, t0 = _cpu_seconds(cpus), time.process_time(), time.perf_counter()
    if before is None:
        return None
    time.sleep(window)
    after = _cpu_seconds(cpus)
    if after is None:
        return None
    others = (after - before) - (time.process_time() - own)
    return min(float(len(cpus)), max(0.0, others / (time.perf_counter() - t0)))


def cpu_info() -> dict:
    """The first processor's fields in Linux's /proc/cpuinfo ('vendor_id', 'model name', 'cpu
    family', 'model', 'flags', ...), or {} where there is none."""
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not key.strip() and info:
                    break  # a blank line ends the first processor's entry
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_vendor() -> str:
    """The CPU's vendor as Linux names it ('AuthenticAMD', 'GenuineIntel'), or '' where unknown."""
    return cpu_info().get("vendor_id", "")


def blas_kernels() -> str:
    """The BLAS libraries this process has loaded and the kernels each runs, e.g. "openblas Haswell
    (OPENBLAS_CORETYPE=Haswell)", "; "-joined; '' where none reports.  A product's float rounding,
    and its speed, depend on the kernels (an AVX-512 CPU held to Haswell's runs them at half rate),
    so the records that measure and the units that train say which ran."""
    return "; ".join(sorted({kernels_of(i) for i in threadpool_info() if i.get("user_api") == "blas"}))


def kernels_of(info: dict) -> str:
    """One threadpoolctl entry as "LIBRARY KERNELS", with the variable that forced OpenBLAS's kernels."""
    forced = os.environ.get("OPENBLAS_CORETYPE") if info.get("internal_api") == "openblas" else None
    return " ".join(filter(None, (info.get("internal_api"), info.get("architecture")))) \
        + (f" (OPENBLAS_CORETYPE={forced})" if forced else "")


def even_slices(n: int, parts: int) -> list:
    """``parts`` slices that split range(n) into nearly equal runs."""
    bounds = [k * n // parts for k in range(parts + 1)]  # in integers: np.linspace costs more than a small part
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def sample_parts(n: int, sample_size: int, block: int, threads: int) -> int:
    """How many parts Backend.split_batch cuts a batch of n samples of ``sample_size`` elements
    into: blocks of about ``block`` elements, at least one per thread (when n allows).  A count,
    not the slices, so that ``plan`` can ask it of any batch size."""
    per_part = max(1, block // max(1, sample_size))
    return max(-(-n // per_part), min(threads, n))


_ON_POOL = threading.local()


def mark_pool_thread():
    """The initializer of a backend's pool threads: work that runs on one of them runs in place."""
    _ON_POOL.on = True


def on_pool_thread() -> bool:
    return getattr(_ON_POOL, "on", False)


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed large blocks for reuse instead of returning them to the OS.

    A train step allocates and frees many 10-60 MB temporaries.  By default glibc serves each from
    fresh mmap'd pages, and the kernel must fault in and zero every page again, a large share of a
    NumPy step on a machine with few cores.  With the mmap and trim thresholds at 1 GiB, freed
    blocks are reused.  The process's resident size then stays near its peak between steps (the
    peak itself does not grow).  An explicit MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ in
    the environment wins (the benchmark's live-memory run sets one).  Returns whether it applied;
    a no-op off glibc."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 2**30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**30))
    except (OSError, AttributeError):
        return False


def no_huge_page_advice() -> bool:
    """Stop NumPy advising the kernel to back its large arrays with 2 MB pages (``madvise``), unless
    NUMPY_MADVISE_HUGEPAGE says what to do.  A step's heap grows over the first steps (NumPy's and
    PyTorch's temporaries share it) until it holds the step's high water, which keep_freed_memory
    then keeps for reuse; where advised, each fresh 2 MB page is cleared whole at its first touch,
    most of those steps' kernel time, where 4 KB pages cost a fraction of it and the steps after them
    run as fast (docs/performance.md).  Returns whether it applied."""
    if "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        return False
    core = getattr(np, "_core", None) or getattr(np, "core", None)  # NumPy 2, NumPy 1
    setter = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if setter is None:
        return False
    setter(False)
    return True


def process_memory() -> dict:
    """Resident set size of this process and its high-water mark (Linux /proc), in bytes."""
    cur = peak = None
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    cur = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    peak = int(line.split()[1]) * 1024
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 if resource else None
    return {"current": cur, "peak": peak, "kind": "process RSS"}


def reset_process_peak() -> None:
    """Reset the RSS high-water mark (Linux: write 5 to /proc/self/clear_refs); silently a no-op elsewhere."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
