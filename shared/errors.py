"""Error types that cross package boundaries; each message says what is wrong and what to do."""
from __future__ import annotations

from pathlib import Path


class TensorServeError(Exception):
    """Base class of errors reported to users."""


class GGUFError(TensorServeError, ValueError):
    """A GGUF file that cannot be used, with the file named in the message."""

    def __init__(self, path: str | Path, problem: str):
        self.path, self.problem = Path(path), problem
        super().__init__(f"{path}: {problem}")


class ModelNotFound(TensorServeError, LookupError):
    pass


class UnsupportedTensorType(GGUFError):
    pass
