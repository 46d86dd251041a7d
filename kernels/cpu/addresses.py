"""Arrays that compiled code reaches through their addresses instead of receiving them.

A replayed decode pass (kernels/cpu/graph_replay.py) reads ~120 matrices, their
norms and ~60 K/V caches (as their bytes, kernels/cpu/kv_codecs.py). Passed as numba typed lists, each list cost ~4 us to
check and unbox at every call with the caches the step's weight streams left
cold; a table of int64 addresses and extents is one array. The views made from it
hold no reference: whoever builds the table keeps the arrays alive (the replay's
program does), and every array must be C-contiguous.
"""
from __future__ import annotations

import numpy as np

try:
    from numba import carray, njit, types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None


def address(a: np.ndarray) -> int:
    """The address of a C-contiguous array's first element."""
    if not a.flags.c_contiguous:
        raise ValueError(f"an array of shape {a.shape} is not C-contiguous")
    return a.__array_interface__["data"][0]


if njit is not None:
    def _pointer_intrinsic(dtype):
        @intrinsic
        def pointer(typingctx, at):
            sig = types.CPointer(dtype)(types.int64)

            def codegen(context, builder, signature, args):
                return builder.inttoptr(args[0], context.get_value_type(types.CPointer(dtype)))

            return sig, codegen
        return pointer

    _u8_at, _f32_at = _pointer_intrinsic(types.uint8), _pointer_intrinsic(types.float32)

    @njit(inline="always")
    def u8(table, row, col):  # pragma: no cover - compiled
        """uint8 [table[row, col + 1]] at address table[row, col]."""
        return carray(_u8_at(table[row, col]), table[row, col + 1])

    @njit(inline="always")
    def f32(table, row, col):  # pragma: no cover - compiled
        """float32 [table[row, col + 1]] at address table[row, col]."""
        return carray(_f32_at(table[row, col]), table[row, col + 1])

    @njit(inline="always")
    def f32_2d(table, row):  # pragma: no cover - compiled
        """float32 [table[row, 1], table[row, 2]] at address table[row, 0]."""
        return carray(_f32_at(table[row, 0]), (table[row, 1], table[row, 2]))

    @njit(inline="always")
    def u8_4d(table, row):  # pragma: no cover - compiled
        """uint8 [table[row, 1:5]] at address table[row, 0]."""
        return carray(_u8_at(table[row, 0]), (table[row, 1], table[row, 2], table[row, 3], table[row, 4]))
