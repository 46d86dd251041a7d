from kernels.cpu import isa  # noqa: F401  (first: TS_MAX_CPU_ISA caps numba before it compiles anything)
from kernels.cpu.backend import CPUBackend

__all__ = ["CPUBackend"]
