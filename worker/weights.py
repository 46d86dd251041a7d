"""Weights of one model: GGUF tensors checked against the shapes the architecture expects,
dequantized to float32 and handed to the kernels backend."""
from __future__ import annotations

import numpy as np

from kernels import Backend
from shared.dequant import SUPPORTED_TYPES, dequantize
from shared.errors import GGUFError, UnsupportedTensorType
from shared.gguf_file import GGUFFile, TensorInfo


class WeightLoader:
    def __init__(self, gguf: GGUFFile, ops: Backend):
        self.gguf, self.ops = gguf, ops

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def info(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        t = self.gguf.tensors.get(name)
        if t is None:
            raise GGUFError(self.gguf.path, f"missing tensor {name!r} (expected shape {shape}) for "
                                            f"architecture {self.gguf.architecture!r}; the file is incomplete "
                                            "or was converted for another architecture")
        if tuple(t.shape) != tuple(shape):
            raise GGUFError(self.gguf.path, f"tensor {name!r} has shape {t.shape}, expected {tuple(shape)} "
                                            "from the model's metadata")
        if t.ggml_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(_type_name(x) for x in SUPPORTED_TYPES))
            raise UnsupportedTensorType(self.gguf.path, f"tensor {name!r} has unsupported type {t.type_name}; "
                                                        f"supported: {supported}; re-quantize the model to one of them")
        return t

    def float32(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        t = self.info(name, shape)
        return dequantize(self.gguf.raw(name), t.ggml_type, t.shape)

    def embedding(self, name: str, shape: tuple[int, int]) -> object:
        t = self.info(name, shape)
        return self.ops.prepare_embedding(self.gguf.raw(name), t.ggml_type, t.shape)

    def vector(self, name: str, size: int) -> object:
        return self.ops.asarray(self.float32(name, (size,)))

    def linear(self, *parts: tuple[str, tuple[int, int]]) -> object:
        """One prepared matrix from one or more [out, in] tensors stacked along `out` (e.g. fused Q|K|V)."""
        infos = [(name, self.info(name, shape)) for name, shape in parts]   # the clear errors come first
        encoded = [(self.gguf.raw(name), t.ggml_type, tuple(t.shape)) for name, t in infos]
        mats = [dequantize(raw, ggml_type, shape) for raw, ggml_type, shape in encoded]
        w = mats[0] if len(mats) == 1 else np.concatenate(mats, axis=0)
        return self.ops.prepare_weight(w, encoded)


def _type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType(ggml_type).name
