"""Kernel debugging switches: environment variables for developers (docs/kernels.md), read here
alone. They are not configuration options: a user never needs them, and they must be in the
environment before the kernels compile, i.e. before the worker or the in-process engine starts.

    TS_QUANTIZED_MATMUL=0   every product in float32 on OpenBLAS
    TS_INT8_MATMUL=0        no 8-bit products, even where the CPU has VNNI
    TS_GRAPH_REPLAY=0       decode passes call the kernels one at a time instead of a replayed graph
    TS_MAX_CPU_ISA=avx2     a CPU with AVX-512 takes the AVX2 kernels (kernels/cpu/isa.py)
"""
from __future__ import annotations

import os

QUANTIZED_MATMUL, INT8_MATMUL, GRAPH_REPLAY, MAX_CPU_ISA = (
    "TS_QUANTIZED_MATMUL", "TS_INT8_MATMUL", "TS_GRAPH_REPLAY", "TS_MAX_CPU_ISA")
SWITCHES = (QUANTIZED_MATMUL, INT8_MATMUL, GRAPH_REPLAY, MAX_CPU_ISA)


def enabled(name: str) -> bool:
    """An on/off switch, on unless set to 0, false or no."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no")


def max_cpu_isa() -> str:
    """TS_MAX_CPU_ISA as given, lower case; empty when unset."""
    return os.environ.get(MAX_CPU_ISA, "").strip().lower()
