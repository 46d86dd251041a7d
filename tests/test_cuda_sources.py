"""Every CUDA source of kernels/cuda compiles with nvcc for sm_80 and sm_90, as written (nvcc
finds the local headers) and as NVRTC is given it (headers inlined, the variant's options); and
the package imports, and refuses to build a backend, clearly, without CuPy or a GPU."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from kernels.cuda import cupy_installed, sources, variants

NVCC = shutil.which("nvcc")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed: the CUDA sources were not compiled")
ARCHS = ("80", "90")


def _nvcc(args: list[str]) -> None:
    r = subprocess.run([NVCC, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"nvcc {' '.join(args)} failed:\n{r.stderr}"
    assert "warning" not in r.stderr.lower(), r.stderr


def test_every_module_has_its_source():
    assert sorted(p.stem for p in sources.cu_files()) == sorted(sources.MODULES)


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", sources.cu_files(), ids=lambda p: p.name)
def test_source_compiles_standalone(path, arch, tmp_path):
    _nvcc([f"-arch=sm_{arch}", "-c", "-x", "cu", "-o", str(tmp_path / "out.o"), str(path)])


@needs_nvcc
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("module", sources.MODULES)
def test_nvrtc_text_compiles_with_the_variant_options(module, arch, tmp_path):
    """The inlined text RawModule receives, with the defines of the variant for sm_<arch>, to PTX
    (no local include may survive the inlining)."""
    text = sources.source(module)
    assert '#include "' not in text
    src = tmp_path / f"{module}.cu"
    src.write_text(text)
    variant = variants.for_capability(int(arch[0]), int(arch[1]))
    defines = [o for o in sources.options(variant) if o.startswith("-D")]
    _nvcc([f"-arch=sm_{arch}", "--ptx", "-o", str(tmp_path / "out.ptx"), *defines, str(src)])


def test_variants_by_capability():
    assert variants.for_capability(9, 0)["name"] == "hopper"
    assert variants.for_capability(8, 0)["arch"] == "compute_80"
    assert variants.for_capability(8, 7)["name"] == "ampere"       # nearest lower entry (8, 6)
    assert variants.for_capability(12, 0)["capability"] == (12, 0)
    v = variants.for_capability(9, 0)
    v["gemv_warps"] = 1                                            # each call a fresh copy
    assert variants.for_capability(9, 0)["gemv_warps"] == 8
    with pytest.raises(ValueError, match="6.1"):
        variants.for_capability(6, 1)


def test_backend_without_cupy_or_gpu_says_what_is_missing():
    from kernels.cuda.backend import CUDABackend
    if cupy_installed():
        import cupy
        try:
            if cupy.cuda.runtime.getDeviceCount() > 0:
                pytest.skip("a GPU is present: the backend constructs")
        except cupy.cuda.runtime.CUDARuntimeError:
            pass
    with pytest.raises(RuntimeError, match="CuPy|GPU|CUDA"):
        CUDABackend()
