"""Compiled embedding-row decoding (llama.cpp's get_rows) for Q8_0 tables.

shared/dequant.py decodes any GGUF type in numpy: for the one or two rows of a
decode step that is ~15 array operations, each slow (a 1-element add: 24-38 us) when it runs
right after the step's weight streams have evicted the caches (the Gemma 3
embedding row: 184 us cold, 27 us in one compiled call). Both bundled models
keep their embedding in Q8_0: y = q * d, d a float16 scale per 32 codes,
computed in float32 exactly as dequant's numpy kernel does.
"""
from __future__ import annotations

import numpy as np

try:
    from numba import njit
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

Q8_0 = 8                    # GGMLQuantizationType.Q8_0
_BLOCK, _BLOCK_BYTES = 32, 34
# every float16 bit pattern as float32 (numpy's own conversion: subnormals, inf and NaN included)
F16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)


def supports(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> bool:
    return (njit is not None and int(ggml_type) == Q8_0 and len(shape) == 2 and shape[1] % _BLOCK == 0
            and isinstance(raw, np.ndarray) and raw.dtype == np.uint8 and raw.ndim == 1
            and raw.flags.c_contiguous and raw.size == shape[0] * shape[1] // _BLOCK * _BLOCK_BYTES)


def q8_0_rows(raw: np.ndarray, shape: tuple[int, int], ids: np.ndarray) -> np.ndarray | None:
    """Rows `ids` (any shape) of a Q8_0 table as float32 [*ids.shape, n_cols]; None when an id is
    out of range (the caller's general decoder then says which)."""
    flat = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    out = np.empty((flat.shape[0], shape[1]), np.float32)
    if _decode(raw, shape[0], flat, out, F16) >= 0:
        return None
    return out.reshape(tuple(np.shape(ids)) + (shape[1],))


if njit is not None:
    @njit(cache=True, nogil=True)
    def q8_0_row(raw, i, out, f16):  # pragma: no cover - compiled
        """out[:] = row i of the Q8_0 table raw (the caller checks i)."""
        n_blocks = out.shape[0] // _BLOCK
        base = i * n_blocks * _BLOCK_BYTES
        for b in range(n_blocks):
            at = base + b * _BLOCK_BYTES
            d = f16[np.int64(raw[at]) | (np.int64(raw[at + 1]) << 8)]
            for j in range(_BLOCK):
                q = np.int8(raw[at + 2 + j])
                out[b * _BLOCK + j] = np.float32(q) * d

    @njit(cache=True, nogil=True)
    def _decode(raw, n_rows, ids, out, f16):  # pragma: no cover - compiled
        """Fills out[r] with row ids[r]; returns the first r whose id is out of range, else -1."""
        for r in range(ids.shape[0]):
            if ids[r] < 0 or ids[r] >= n_rows:
                return r
            q8_0_row(raw, ids[r], out[r], f16)
        return -1


def warm_up() -> None:
    """Compile (or load from numba's cache) the decoder on a one-block table."""
    if njit is not None:
        raw = np.zeros(_BLOCK_BYTES, np.uint8)
        raw.flags.writeable = False                 # as a GGUF file's memory map is
        _decode(raw, 1, np.zeros(1, np.int64), np.empty((1, _BLOCK), np.float32), F16)
