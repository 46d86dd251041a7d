"""The instruction sets the CPU kernels may use: all the host has, or, with TS_MAX_CPU_ISA=avx2, none
of AVX-512 (as oneDNN's ONEDNN_MAX_CPU_ISA caps its own).

The cap lets one machine with AVX-512 VNNI test and time the kernels that AVX2-only CPUs (Zen 2/3,
VMs that hide AVX-512) run: int8_matmul then builds its AVX2 tiles, and numba compiles everything
for the host's CPU without its AVX-512 features, so its own loops are as wide as on such a CPU and
its cache keeps the two builds apart. It must be set before numba compiles anything in the process
(this module runs when kernels.cpu is first imported). OpenBLAS picks its kernels when numpy loads:
OPENBLAS_CORETYPE=Haswell makes prompts' sgemm match as well.
"""
from __future__ import annotations

from kernels import switches

MAX_CPU_ISA_ENV = switches.MAX_CPU_ISA
MAX_CPU_ISAS = ("avx512", "avx2")
_AVX512_PREFIXES = ("avx512", "avx10", "amx", "evex512")


def max_cpu_isa() -> str:
    value = switches.max_cpu_isa() or "avx512"
    if value not in MAX_CPU_ISAS:
        raise ValueError(f"{MAX_CPU_ISA_ENV}={value!r} is not one of {', '.join(MAX_CPU_ISAS)}: unset it to use "
                         f"every instruction set the CPU has, or set it to avx2 to leave AVX-512 out")
    return value


def host_features() -> dict[str, bool]:
    """The CPU features llvmlite reports for this host, less AVX-512's under the cap."""
    import llvmlite.binding as llvm
    features = dict(llvm.get_host_cpu_features())
    if max_cpu_isa() == "avx2":
        for name in features:
            if name.startswith(_AVX512_PREFIXES):
                features[name] = False
    return features


def has(*names: str) -> bool:
    features = host_features()
    return all(features.get(name, False) for name in names)


_AMD_CPU_NAMES = ("znver", "bdver", "btver", "amdfam")


def vendor_from(cpuinfo: str, llvm_cpu_name: str) -> str:
    """"amd", "intel" or "other", from /proc/cpuinfo's vendor_id where there is one, else from the
    CPU name LLVM gives the host (znver4, ...) where there is none."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "vendor_id":
            value = value.strip()
            return {"AuthenticAMD": "amd", "HygonGenuine": "amd", "GenuineIntel": "intel"}.get(value, "other")
    return "amd" if llvm_cpu_name.startswith(_AMD_CPU_NAMES) else "other"


def vendor() -> str:
    """The host CPU's maker: the 8-bit products prefetch their codes differently on AMD and Intel."""
    import llvmlite.binding as llvm
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read(65536)
    except OSError:
        cpuinfo = ""
    return vendor_from(cpuinfo, llvm.get_host_cpu_name())


def _cap_numba() -> None:
    if max_cpu_isa() == "avx512":
        return
    try:
        from numba.core import config
    except ImportError:  # pragma: no cover - exercised only where numba is missing
        return
    if config.CPU_FEATURES is None:
        config.CPU_FEATURES = ",".join(("+" if on else "-") + name for name, on in sorted(host_features().items()))


_cap_numba()
