"""OpenBLAS thread settings that must be in the environment before numpy loads OpenBLAS."""
from __future__ import annotations

import os

# After each product OpenBLAS's idle threads spin (yielding) for 2**OPENBLAS_THREAD_TIMEOUT
# cycles before they sleep; the default, 2**28, is ~0.1 s. A worker alternates passes on
# OpenBLAS's threads (prefill chunks, large batches) with passes on numba's threads (decode of
# a few rows), and on 2 cores the spinning threads slowed the first compiled decode step after
# a 12-token prefill from 20-30 ms to 56-123 ms (docs/BENCHMARKS.md). 2**22 cycles (~1.4 ms)
# still bridges the gaps between the products of one pass (2**18 made the 12-token pass
# itself slower: its threads slept during each layer's attention and had to be woken).
OPENBLAS_THREAD_TIMEOUT = "22"


def set_openblas_thread_timeout() -> None:
    """Default OPENBLAS_THREAD_TIMEOUT for this process and its children; a value already set wins.
    Without effect once numpy has been imported."""
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT)


def set_compute_threads(threads: int | None) -> None:
    """--threads: the compiled kernels' (numba, OpenMP) and OpenBLAS's thread counts. Takes full
    effect only before numpy and numba load; later, numba's count can still be lowered."""
    if threads is None:
        return
    import sys
    for name in ("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ[name] = str(threads)
    if "numba" in sys.modules:
        import numba
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
