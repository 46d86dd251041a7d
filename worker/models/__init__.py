"""Architecture registry: GGUF general.architecture -> model class."""
from __future__ import annotations

from pathlib import Path

from shared.errors import GGUFError
from worker.models.base import ForwardInput, Model
from worker.models.dream import DreamModel
from worker.models.gemma3 import Gemma3Model
from worker.models.llada import LladaModel
from worker.models.llama import LlamaModel

ARCHITECTURES: dict[str, type[Model]] = {
    "llama": LlamaModel,
    "gemma3": Gemma3Model,
    "llada": LladaModel,     # text diffusion
    "dream": DreamModel,     # text diffusion
}


def model_class(architecture: str, path: str | Path) -> type[Model]:
    cls = ARCHITECTURES.get(architecture)
    if not architecture:
        raise GGUFError(path, f"metadata has no general.architecture "
                              f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    if cls is None:
        raise GGUFError(path, f"unsupported architecture {architecture!r} "
                              f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return cls


__all__ = ["ARCHITECTURES", "ForwardInput", "Model", "model_class"]
