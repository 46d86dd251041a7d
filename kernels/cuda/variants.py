"""Kernel variants by compute capability: launch shapes and compile-time sizes of the CUDA
kernels, chosen once per device (the worker's device detection calls `for_capability`).

Each entry's `defines` become `-D` options of every module (see kernels/cuda/sources.py), so one
set of sources serves every card; `arch` is NVRTC's target.
"""
from __future__ import annotations

# (major, minor) -> variant. Larger parts (more SMs, more registers in flight) take more warps
# per block in the decode GEMV and attention; the rows a GEMV call serves bound its accumulators.
KERNEL_VARIANTS: dict[tuple[int, int], dict] = {
    (7, 0): {"name": "volta", "gemv_warps": 4, "gemv_max_rows": 4, "attn_warps": 4, "norm_threads": 256,
             "prefill_min_rows": 16},
    (7, 5): {"name": "turing", "gemv_warps": 4, "gemv_max_rows": 4, "attn_warps": 4, "norm_threads": 256,
             "prefill_min_rows": 16},
    (8, 0): {"name": "ampere-a100", "gemv_warps": 4, "gemv_max_rows": 8, "attn_warps": 4, "norm_threads": 256,
             "prefill_min_rows": 9},
    (8, 6): {"name": "ampere", "gemv_warps": 4, "gemv_max_rows": 8, "attn_warps": 4, "norm_threads": 256,
             "prefill_min_rows": 9},
    (8, 9): {"name": "ada", "gemv_warps": 4, "gemv_max_rows": 8, "attn_warps": 4, "norm_threads": 256,
             "prefill_min_rows": 9},
    (9, 0): {"name": "hopper", "gemv_warps": 8, "gemv_max_rows": 8, "attn_warps": 8, "norm_threads": 256,
             "prefill_min_rows": 9},
    (10, 0): {"name": "blackwell", "gemv_warps": 8, "gemv_max_rows": 8, "attn_warps": 8, "norm_threads": 256,
              "prefill_min_rows": 9},
}
MIN_CAPABILITY = (7, 0)     # __shfl_xor_sync, cvt.f16 PTX and double atomics are all there


def for_capability(major: int, minor: int) -> dict:
    """The variant for a device of compute capability major.minor: the exact entry, else the
    nearest lower one (a newer minor revision runs its family's kernels). A new copy each call,
    with `arch` (NVRTC's -arch) and `defines` filled in. ValueError below sm_70."""
    cap = (int(major), int(minor))
    if cap < MIN_CAPABILITY:
        raise ValueError(f"compute capability {cap[0]}.{cap[1]} is below the {MIN_CAPABILITY[0]}."
                         f"{MIN_CAPABILITY[1]} the CUDA kernels need")
    key = max(k for k in KERNEL_VARIANTS if k <= cap)
    variant = dict(KERNEL_VARIANTS[key], capability=cap)
    variant["arch"] = f"compute_{cap[0]}{cap[1]}"
    variant["defines"] = {"TS_GEMV_WARPS": variant["gemv_warps"], "TS_MAX_ROWS": variant["gemv_max_rows"],
                          "TS_ATTN_WARPS": variant["attn_warps"], "TS_NORM_THREADS": variant["norm_threads"]}
    return variant
