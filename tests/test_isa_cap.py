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
