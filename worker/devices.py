"""The NVIDIA GPUs of this host, as nvidia-ml-py (`pynvml`) reports them, and whether CuPy imports.

`detect_gpus()` never raises: without pynvml, without a driver, or with no GPU it returns no
devices and the reason, which `--backend auto` logs and `--backend cuda` and `serve --gpus` put
in their errors.

Testing hook: the variable TS_FAKE_GPUS (a JSON list such as
`[{"name": "NVIDIA H100", "capability": [9, 0], "total": 85e9, "free": 80e9}]`, `index` optional)
stands in for NVML, so that backend selection and memory sizing can be tested on a host without a
GPU; `detect_gpus(fake=...)` takes the same list. It describes devices, it does not make any.
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from typing import Any

from shared.options import env_value

FAKE_VARIABLE = "TS_FAKE_GPUS"
INSTALL_HINT = "pip install 'tensorserve[cuda]' (CuPy for CUDA 12 and nvidia-ml-py)"
NEEDS = f"a CUDA worker needs an NVIDIA GPU with its driver, and {INSTALL_HINT}"


@dataclass(frozen=True)
class GPU:
    index: int                    # NVML's index: nvidia-smi's numbering (PCI bus order)
    name: str
    capability: tuple[int, int]   # compute capability (9, 0) = sm_90
    total: int                    # bytes of device memory
    free: int                     # bytes free when detected

    def describe(self) -> str:
        return (f"GPU {self.index} ({self.name}, sm_{self.capability[0]}{self.capability[1]}, "
                f"{self.free / 2**30:.1f} of {self.total / 2**30:.1f} GiB free)")


@dataclass(frozen=True)
class Detection:
    gpus: tuple[GPU, ...]
    reason: str                   # why there are none, or where the list came from

    def describe(self) -> str:
        if not self.gpus:
            return f"no NVIDIA GPU ({self.reason})"
        return "; ".join(g.describe() for g in self.gpus)

    def by_index(self, index: int) -> GPU | None:
        return next((g for g in self.gpus if g.index == index), None)


def detect_gpus(fake: str | list | None = None) -> Detection:
    """The GPUs NVML lists (or `fake` / TS_FAKE_GPUS), each with its free memory now."""
    fake = fake if fake is not None else env_value(FAKE_VARIABLE)
    if fake is not None:
        return fake_detection(fake)
    try:
        import pynvml
    except ImportError:
        return Detection((), "nvidia-ml-py (pynvml) is not installed")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return Detection((), f"NVML did not start: {exc} (no NVIDIA driver?)")
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            memory = pynvml.nvmlDeviceGetMemoryInfo(h)
            gpus.append(GPU(i, name.decode() if isinstance(name, bytes) else str(name),
                            tuple(pynvml.nvmlDeviceGetCudaComputeCapability(h)), int(memory.total),
                            int(memory.free)))
    except pynvml.NVMLError as exc:
        return Detection((), f"NVML failed listing the devices: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
    return Detection(tuple(gpus), "NVML" if gpus else "NVML lists no device")


def fake_detection(description: str | list) -> Detection:
    """A Detection from a fake description (TS_FAKE_GPUS' JSON, or its list)."""
    try:
        items: Any = json.loads(description) if isinstance(description, str) else description
        if not isinstance(items, list):
            raise ValueError("expected a JSON list of devices")
        gpus = tuple(GPU(int(d.get("index", i)), str(d["name"]), (int(d["capability"][0]), int(d["capability"][1])),
                         int(d["total"]), int(d["free"])) for i, d in enumerate(items))
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"{FAKE_VARIABLE}: not a device list ({exc}); e.g. "
                         '[{"name": "NVIDIA H100", "capability": [9, 0], "total": 85e9, "free": 80e9}]') from None
    return Detection(gpus, f"{FAKE_VARIABLE} (fake devices)" if gpus else f"{FAKE_VARIABLE} lists no device")


def cupy_error() -> str | None:
    """None when CuPy imports, else why not (with what to install)."""
    try:
        importlib.import_module("cupy")
    except Exception as exc:          # ImportError, or a CuPy built for another CUDA failing to load
        return f"CuPy does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); " \
               f"{INSTALL_HINT}"
    return None


def memory_bandwidth(index: int) -> float | None:
    """Peak memory bandwidth of NVML's device `index` in bytes/s (2 transfers a clock × bus width), or
    None where NVML cannot tell."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            h = pynvml.nvmlDeviceGetHandleByIndex(index)
            clock_mhz = pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)
            bus_bits = pynvml.nvmlDeviceGetMemoryBusWidth(h)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None
    return 2.0 * clock_mhz * 1e6 * bus_bits / 8
