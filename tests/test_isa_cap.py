"""kernels/cpu/isa.py: TS_MAX_CPU_ISA=avx2 makes a CPU with AVX-512 take the kernels of AVX2-only CPUs
(`make test` runs the 8-bit product and replay tests again so where the host has AVX-512)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.cpu import isa

ROOT = Path(__file__).resolve().parents[1]
PROBE = """
import json
from kernels.cpu import int8_matmul
from numba import njit
from numba.core.registry import cpu_target
njit(lambda x: x + 1)(1)
features = cpu_target.target_context.codegen().magic_tuple()[2].split(",")
print(json.dumps({"vnni": int8_matmul.VNNI, "avx2": int8_matmul.AVX2, "rows": int8_matmul.ROWS,
                  "numba_avx512f": "+avx512f" in features}))
"""


def probe(cap: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (isa.MAX_CPU_ISA_ENV, "NUMBA_CPU_FEATURES")}
    if cap is not None:
        env[isa.MAX_CPU_ISA_ENV] = cap
    return subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.mark.skipif(not isa.has("avx2", "fma"), reason="needs a CPU with AVX2")
def test_the_avx2_cap_takes_the_avx2_kernels_and_numba_leaves_avx512_out():
    capped = probe("avx2")
    assert capped.returncode == 0, capped.stderr
    assert json.loads(capped.stdout) == {"vnni": False, "avx2": True, "rows": 1, "numba_avx512f": False}
    uncapped = probe(None)
    assert uncapped.returncode == 0, uncapped.stderr
    host_has_vnni = isa.has("avx512f", "avx512bw", "avx512vnni")
    assert json.loads(uncapped.stdout)["vnni"] == host_has_vnni
    assert json.loads(uncapped.stdout)["numba_avx512f"] == isa.has("avx512f")


def test_an_unknown_cap_is_a_clear_error():
    result = probe("sse9")
    assert result.returncode != 0
    assert "TS_MAX_CPU_ISA='sse9' is not one of avx512, avx2" in result.stderr


def test_the_cpu_vendor_comes_from_cpuinfo_or_else_llvms_cpu_name():
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\n"
    assert isa.vendor_from(intel, "znver4") == "intel"          # cpuinfo wins over the CPU name
    assert isa.vendor_from("vendor_id : AuthenticAMD\n", "generic") == "amd"
    assert isa.vendor_from("vendor_id\t: HygonGenuine\n", "") == "amd"
    assert isa.vendor_from("vendor_id\t: CentaurHauls\n", "") == "other"
    assert isa.vendor_from("", "znver3") == "amd"                  # no /proc/cpuinfo: LLVM's name
    assert isa.vendor_from("", "sapphirerapids") == "other"
    assert isa.vendor() in ("amd", "intel", "other")


def test_only_vnni_on_amd_prefetches_one_line_in_two():
    from kernels.cpu import int8_matmul
    if not int8_matmul.available():
        pytest.skip("no 8-bit products on this CPU")
    one_in_two = int8_matmul.VNNI and isa.vendor() == "amd"
    assert (int8_matmul.PREFETCH_VECTORS, int8_matmul.PREFETCH_LINES) == ((128, 1) if one_in_two else (256, 2))
