"""CUDA implementation of the kernels interface on CuPy (`kernels.cuda.backend.CUDABackend`).

CUDA C sources (`*.cu`, the shared numerics in `quant_blocks.cuh`) sit beside their Python
launchers and are compiled at run time by NVRTC through `cupy.RawModule`. Importing this package
needs neither CuPy nor a GPU (CI has neither): CuPy is imported when a backend is constructed.
"""
from __future__ import annotations

import importlib.util


def cupy_installed() -> bool:
    """Whether CuPy can be imported (without importing it)."""
    return importlib.util.find_spec("cupy") is not None
