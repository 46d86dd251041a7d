from kernels.cpu.backend import CPUBackend

__all__ = ["CPUBackend"]
