"""Compiled CUDA modules of one backend: each kernels/cuda/*.cu compiled once by NVRTC through
cupy.RawModule with the device's variant (kernels/cuda/variants.py), on first use."""
from __future__ import annotations

from typing import Any

from kernels.cuda import sources


class Modules:
    def __init__(self, cp: Any, variant: dict) -> None:
        self.cp, self.variant = cp, variant
        self._modules: dict[str, Any] = {}
        self._functions: dict[tuple[str, str], Any] = {}
        # CuPy adds -arch for the current device itself (a second -arch would clash)
        self.options = tuple(o for o in sources.options(variant) if not o.startswith("-arch"))

    def function(self, module: str, name: str) -> Any:
        key = (module, name)
        fn = self._functions.get(key)
        if fn is None:
            mod = self._modules.get(module)
            if mod is None:
                mod = self._modules[module] = self.cp.RawModule(code=sources.source(module), options=self.options)
            fn = self._functions[key] = mod.get_function(name)
        return fn

    def compile_all(self) -> None:
        """Compile every module now (warm-up: NVRTC takes ~0.1-1 s a module the first time, then
        CuPy's on-disk cache)."""
        for module in sources.MODULES:
            if module not in self._modules:
                self._modules[module] = self.cp.RawModule(code=sources.source(module), options=self.options)
                self._modules[module].compile()


def grid_for(n: int, threads: int, cap: int = 65535 * 8) -> int:
    """Blocks for a grid-stride loop over n items."""
    return max(1, min(cap, -(-n // threads)))
