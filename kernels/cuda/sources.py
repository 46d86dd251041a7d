"""The CUDA C sources of kernels/cuda as NVRTC compiles them: each `.cu` with its local
`#include "x.cuh"` lines replaced by the header's text, and the options a variant gives.

Headers are inlined rather than found through `-I`: CuPy caches compiled modules by their source
text and options, so an edited header must change the text it is given."""
from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).parent
MODULES = ("matmul", "embedding", "norm_rope", "activations", "kv_store", "attention", "sampling")
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.M)


def cu_files() -> list[Path]:
    """Every CUDA source of the package (what tests/test_cuda_sources.py compiles)."""
    return sorted(HERE.glob("*.cu"))


def source(module: str) -> str:
    """The text of `module`.cu with its local headers inlined (each once, `#pragma once` aside)."""
    seen: set[str] = set()

    def expand(path: Path) -> str:
        def include(m: re.Match) -> str:
            name = m.group(1)
            if name in seen:
                return ""
            seen.add(name)
            return expand(HERE / name)
        return _INCLUDE.sub(include, path.read_text().replace("#pragma once", ""))
    return expand(HERE / f"{module}.cu")


def options(variant: dict) -> tuple[str, ...]:
    """NVRTC options for a variant (kernels.cuda.variants.for_capability)."""
    defines = tuple(f"-D{k}={v}" for k, v in sorted(variant.get("defines", {}).items()))
    return ("-std=c++14", f"-arch={variant['arch']}") + defines
