"""Which kernels backend a worker runs on, and on which GPU (`--backend auto|cpu|cuda`, `--device`).

auto: cuda when NVML finds the GPU and CuPy imports, else cpu, with the reason logged; cuda: the
same, but a missing GPU or CuPy is an error at start naming what was found and what to install.
"""
from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Callable

from shared.options import env_value
from worker import devices
from worker.devices import GPU, NEEDS, Detection

log = logging.getLogger(__name__)


class BackendUnavailable(ValueError):
    """--backend cuda (or serve --gpus) where it cannot run; the message says what was found."""


@dataclass(frozen=True)
class BackendChoice:
    name: str                 # "cpu" or "cuda"
    gpu: GPU | None           # the device of a cuda worker
    why: str

    @property
    def capability(self) -> tuple[int, int] | None:
        return self.gpu.capability if self.gpu else None


def choose_backend(requested: str, device: int = 0, detection: Detection | None = None,
                   cupy_problem: Callable[[], str | None] | None = None) -> BackendChoice:
    """The backend for `requested` (auto, cpu, cuda) on NVML's device `device` (`detection`: default
    worker/devices.py's); CuPy is imported (`cupy_problem`: default `cuda_problem`) only where a
    GPU was found."""
    if requested == "cpu":
        return BackendChoice("cpu", None, "--backend cpu")
    detection = detection if detection is not None else devices.detect_gpus()
    cupy_problem = cupy_problem or cuda_problem
    gpu = detection.by_index(device)
    if gpu is None:
        if not detection.gpus:
            if requested == "auto":
                return BackendChoice("cpu", None, f"--backend auto: found {detection.describe()}")
            raise BackendUnavailable(f"found {detection.describe()}; {NEEDS}")
        raise BackendUnavailable(f"no GPU {device}: found {detection.describe()}")
    problem = cupy_problem()
    if problem is not None:
        if requested == "auto":
            return BackendChoice("cpu", None, f"--backend auto: found {gpu.describe()} but {problem}")
        raise BackendUnavailable(f"found {gpu.describe()} but {problem}")
    return BackendChoice("cuda", gpu, f"--backend {requested}: {gpu.describe()}, CuPy imports")


def cuda_problem() -> str | None:
    """Why a CUDA worker cannot start on this installation (CuPy, or the CUDA kernels, missing), or None."""
    return devices.cupy_error() or cuda_kernels_problem()


def cuda_kernels_problem() -> str | None:
    if importlib.util.find_spec("kernels.cuda.backend") is None:
        return "this build has no CUDA kernels (kernels/cuda/backend.py)"
    return None


def cuda_ordinal(nvml_index: int, visible: str | None = None) -> int:
    """CuPy's number for NVML's device `nvml_index`: its position in CUDA_VISIBLE_DEVICES where that
    is set (serve gives each worker one device so), else the index itself (serve and the worker set
    CUDA_DEVICE_ORDER=PCI_BUS_ID, NVML's order)."""
    visible = env_value("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is None:
        return nvml_index
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if str(nvml_index) in listed:
        return listed.index(str(nvml_index))
    raise BackendUnavailable(f"GPU {nvml_index} is not among CUDA_VISIBLE_DEVICES={visible}")
