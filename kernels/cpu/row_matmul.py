"""A float32 product whose every output is computed the same way whatever rows share the call:
the text-diffusion forward packs several canvases into one product and each canvas must get
exactly the logits it gets alone (OpenBLAS's AVX2 sgemm moves a row's result by an ulp with the
call's row count, kernels/cpu/backend.py).

out[r, n] is one chain of fused multiply-adds over the inputs in order, from 0:
acc = fma(w[k, n], x[r, k], acc) for k = 0 .. in - 1. An FMA rounds once, so the chain gives the
same bits in a 16-lane vector, split in two on AVX2, or in the one-row tail; how the rows are
blocked, how many there are and how the tiles are spread over threads change nothing.

The weights are kept as tiles of 32 outputs, [n_tiles, in, 32] (the last tile padded with zero
columns, which are not stored: the output is [rows, out] exactly), so a tile is one contiguous stream that stays in L1 while every row of the call passes
over it. The micro-kernel (LLVM IR through a numba intrinsic, as kernels/cpu/int8_matmul.py's)
takes ROWS rows at a time, their 2 * ROWS accumulators of 16 lanes in registers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels.cpu import isa

try:
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

TILE = 32           # outputs per tile: two 16-lane vectors
AVX512 = njit is not None and isa.has("avx512f")
# Rows a micro-kernel call: 4 rows keep 8 accumulators of 16 lanes, 8 of AVX-512's 32 registers;
# on AVX2 each is two of its 16 registers, and 2 rows leave room for the tile's two vectors.
ROWS = 4 if AVX512 else 2
# A call's rows are cut into chunks of this many for the threads, as well as its tiles: a product
# of a few outputs (a narrow model's attention output) still keeps both cores busy.
ROW_CHUNK = 64


def available() -> bool:
    return njit is not None and isa.has("fma")


@dataclass(frozen=True)
class RowMatrix:
    """An [in, out] float32 matrix tiled by 32 outputs for `matmul`."""
    tiles: np.ndarray      # float32 [n_tiles, in, TILE]
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.tiles.nbytes


def from_dense(w: np.ndarray) -> RowMatrix:
    """w float32 [in, out] (the CPU backend's sgemm layout) as tiles."""
    k_in, n_out = w.shape
    n_tiles = -(-n_out // TILE)
    padded = np.zeros((k_in, n_tiles * TILE), np.float32)
    padded[:, :n_out] = w
    tiles = np.ascontiguousarray(padded.reshape(k_in, n_tiles, TILE).transpose(1, 0, 2))
    return RowMatrix(tiles, n_out, k_in)


if available():
    _F32x16 = ir.VectorType(ir.FloatType(), 16)

    def _ptr(context, builder, aryty, ary, elem):
        return builder.bitcast(context.make_array(aryty)(context, builder, ary).data, elem.as_pointer())

    def _splat(builder, value, vtype=_F32x16):
        undef = ir.Constant(vtype, ir.Undefined)
        v = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(ir.IntType(32), 16), [0] * 16))

    def _tile_kernel(n_rows: int):
        """An intrinsic computing out[r0 + r, t * TILE + j] for r < n_rows and the tile's 32 outputs
        (those below column `valid`)."""

        def codegen(context, builder, signature, args):
            at = signature.args
            tiles_a, x_a, out_a, t_v, r0_v, valid_v = args
            i64, f32 = ir.IntType(64), ir.FloatType()
            fma = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_F32x16, [_F32x16] * 3), "llvm.fma.v16f32")
            masked_store = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                ir.VoidType(), [_F32x16, _F32x16.as_pointer(), ir.IntType(32), ir.VectorType(ir.IntType(1), 16)]),
                "llvm.masked.store.v16f32.p0v16f32")
            x_shape = cgutils.unpack_tuple(builder, context.make_array(at[1])(context, builder, x_a).shape)
            out_shape = cgutils.unpack_tuple(builder, context.make_array(at[2])(context, builder, out_a).shape)
            k_in, n_out = x_shape[1], out_shape[1]         # n_out: out's row stride
            tiles_p = _ptr(context, builder, at[0], tiles_a, _F32x16)
            x_p = _ptr(context, builder, at[1], x_a, f32)
            out_p = _ptr(context, builder, at[2], out_a, f32)
            acc = [cgutils.alloca_once_value(builder, ir.Constant(_F32x16, None)) for _ in range(2 * n_rows)]
            w0 = builder.mul(builder.mul(t_v, k_in), i64(2))          # the tile's first vector
            x0 = builder.mul(r0_v, k_in)
            with cgutils.for_range(builder, k_in) as loop:
                k = loop.index
                w_at = builder.add(w0, builder.mul(k, i64(2)))
                w = [builder.load(builder.gep(tiles_p, [builder.add(w_at, i64(h))]), align=4) for h in range(2)]
                for r in range(n_rows):
                    x_at = builder.add(builder.add(x0, builder.mul(k_in, i64(r))), k)
                    xs = _splat(builder, builder.load(builder.gep(x_p, [x_at])))
                    for h in range(2):
                        a = acc[2 * r + h]
                        builder.store(builder.call(fma, [w[h], xs, builder.load(a)]), a)
            # columns from `valid` on (out's padding, the last tile's zero columns) are not stored
            lanes = ir.Constant(ir.VectorType(i64, 16), list(range(16)))
            for h in range(2):
                col = builder.add(builder.mul(t_v, i64(TILE)), i64(16 * h))
                left = builder.sub(valid_v, col)
                whole = builder.icmp_signed(">=", left, i64(16))
                mask = builder.icmp_signed("<", lanes, _splat(builder, left, ir.VectorType(i64, 16)))
                for r in range(n_rows):
                    at_out = builder.add(builder.mul(builder.add(r0_v, i64(r)), n_out), col)
                    dst = builder.bitcast(builder.gep(out_p, [at_out]), _F32x16.as_pointer())
                    value = builder.load(acc[2 * r + h])
                    with builder.if_else(whole) as (then, otherwise):
                        with then:
                            builder.store(value, dst, align=4)
                        with otherwise:
                            builder.call(masked_store, [value, dst, ir.Constant(ir.IntType(32), 4), mask])
            return context.get_dummy_value()

        @intrinsic
        def tile_rows(typingctx, tiles, x, out, t, r0, valid):
            return types.void(tiles, x, out, t, r0, valid), codegen
        return tile_rows

    _tile_rows_block = _tile_kernel(ROWS)
    _tile_rows1 = _tile_kernel(1)

    @njit(parallel=True, nogil=True, cache=True)
    def _kernel(x, tiles, out):  # pragma: no cover - compiled
        rows = x.shape[0]
        n_tiles = tiles.shape[0]
        n_chunks = (rows + ROW_CHUNK - 1) // ROW_CHUNK
        for i in prange(n_tiles * n_chunks):
            t = i // n_chunks
            start = (i % n_chunks) * ROW_CHUNK
            end = min(start + ROW_CHUNK, rows)
            full = start + (end - start) // ROWS * ROWS
            for r0 in range(start, full, ROWS):
                _tile_rows_block(tiles, x, out, t, r0, out.shape[1])
            for r0 in range(full, end):
                _tile_rows1(tiles, x, out, t, r0, out.shape[1])


def matmul(x: np.ndarray, w: RowMatrix) -> np.ndarray:
    """x float32 [m, in] times the matrix -> float32 [m, out], each row as it would be alone."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[1] != w.in_features:
        raise ValueError(f"product of {x.shape[1]} inputs with a matrix of {w.in_features}")
    out = np.empty((x.shape[0], w.out_features), np.float32)
    if x.shape[0]:
        _kernel(x, w.tiles, out)
    return out


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel."""
    if available():
        matmul(np.ones((ROWS + 1, 4), np.float32), from_dense(np.ones((4, TILE + 1), np.float32)))
