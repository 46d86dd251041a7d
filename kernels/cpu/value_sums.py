"""Softmax-weighted sums of value rows for several queries at once: acc[p] = fma(w[p, j], v[j], acc[p])
for each key j in order, the accumulators held in registers across a block's keys.

Each lane's sum is one chain of FMAs in key order, as decode_attention's weigh loops took it (their
compiled form fused each `acc += w * v` into an FMA), so a row's result is the same whichever rows
share the call. Up to CHAINS queries (a prompt chunk's rows times the KV head's query heads) share
each load of a value row, and the head's values go DIM_VECTORS vectors of 16 at a time.
"""
from __future__ import annotations

from kernels.cpu import input_coding, isa

LANES = 16
# registers: CHAINS x DIM_VECTORS accumulators and DIM_VECTORS values (AVX-512: 32 of 64 bytes;
# AVX2 splits each 16-float vector into two of its 16 registers)
WIDE = isa.has("avx512f")
CHAINS = 6 if WIDE else 2
DIM_VECTORS = 4 if WIDE else 2

try:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised only where numba is missing
    intrinsic = None


def available() -> bool:
    return intrinsic is not None


def _powers_of_two_below(n: int) -> list[int]:
    """The powers of two below n, largest first: any count under n is a sum of distinct ones."""
    return [1 << k for k in range(n.bit_length() - 1, -1, -1) if 1 << k < n]


if available():
    _F32 = ir.FloatType()
    _F32x16 = ir.VectorType(_F32, LANES)
    _I32, _I64 = ir.IntType(32), ir.IntType(64)

    _pointer, _splat = input_coding.data_pointer, input_coding.splat

    def in_chunks(builder, name: str, total, units: int, unit: int, emit) -> None:
        """emit(start, units) for start = 0, units * unit, ... while a whole chunk fits in `total` (a
        runtime loop), then emit(start, k) once for each smaller power of two k whose k * unit still
        fits: any remainder is a sum of distinct ones."""
        done = cgutils.alloca_once_value(builder, _I64(0))
        cond = builder.append_basic_block(f"{name}.cond")
        body = builder.append_basic_block(f"{name}.body")
        after = builder.append_basic_block(f"{name}.after")
        builder.branch(cond)
        builder.position_at_end(cond)
        start = builder.load(done)
        builder.cbranch(builder.icmp_signed("<=", builder.add(start, _I64(units * unit)), total), body, after)
        builder.position_at_end(body)
        emit(start, units)
        builder.store(builder.add(start, _I64(units * unit)), done)
        builder.branch(cond)
        builder.position_at_end(after)
        start = builder.load(done)
        for k in _powers_of_two_below(units):
            fits = builder.icmp_signed(">=", builder.sub(total, start), _I64(k * unit))
            with builder.if_then(fits):
                emit(start, k)
            start = builder.select(fits, builder.add(start, _I64(k * unit)), start)

    def _weigh_codegen(builder, w_p, w_at_v, w_stride_v, n_v, dim, load_values, j0_v, j1_v, acc_p, acc_at_v):
        """acc[acc_at + p * dim + d] += w[w_at + p * w_stride + j] * value(j, d) for p < n_pairs, each
        lane a chain of FMAs over j0 <= j < j1; load_values(j, d0, k) gives the 16 values from d0 + 16 k
        of row j as a float32 vector."""
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32x16, [_F32x16] * 3),
                                             "llvm.fma.v16f32")

        def vector_at(base, at_):
            return builder.bitcast(builder.gep(base, [at_]), _F32x16.as_pointer())

        def block(p0, count, d0, vectors):
            """Pairs [p0, p0 + count) times the values [d0, d0 + 16 vectors)."""
            acc_at_p = [builder.add(acc_at_v, builder.add(builder.mul(builder.add(p0, _I64(c)), dim), d0))
                        for c in range(count)]
            regs = [[cgutils.alloca_once(builder, _F32x16) for _ in range(vectors)] for _ in range(count)]
            for c in range(count):
                for k in range(vectors):
                    builder.store(builder.load(vector_at(acc_p, builder.add(acc_at_p[c], _I64(LANES * k))),
                                               align=4), regs[c][k])
            w_rows = [builder.add(w_at_v, builder.mul(builder.add(p0, _I64(c)), w_stride_v)) for c in range(count)]
            with cgutils.for_range_slice(builder, j0_v, j1_v, _I64(1)) as (j, _):
                vs = [load_values(j, d0, k) for k in range(vectors)]
                for c in range(count):
                    w = _splat(builder, builder.load(builder.gep(w_p, [builder.add(w_rows[c], j)])), _F32x16)
                    for k in range(vectors):
                        builder.store(builder.call(fma, [w, vs[k], builder.load(regs[c][k])]), regs[c][k])
            for c in range(count):
                for k in range(vectors):
                    builder.store(builder.load(regs[c][k]),
                                  vector_at(acc_p, builder.add(acc_at_p[c], _I64(LANES * k))), align=4)

        in_chunks(builder, "dims", dim, DIM_VECTORS, LANES,
                  lambda d0, vectors: in_chunks(builder, "pairs", n_v, CHAINS, 1,
                                                lambda p0, count: block(p0, count, d0, vectors)))

    @intrinsic
    def weigh_pairs(typingctx, weights, w_at, w_stride, n_pairs, values, j0, j1, acc, acc_at):
        """acc[acc_at + p * dim + d] += weights[w_at + p * w_stride + j] * values[j, d] for p < n_pairs,
        each lane a chain of FMAs over j0 <= j < j1 in order (weights and acc flat float32 arrays,
        values float32 [>= j1, dim], dim a multiple of 16)."""
        def codegen(context, builder, signature, args):
            w_a, w_at_v, w_stride_v, n_v, v_a, j0_v, j1_v, acc_a, acc_at_v = args
            at = signature.args
            dim = cgutils.unpack_tuple(builder, context.make_array(at[4])(context, builder, v_a).shape)[1]
            v_p = _pointer(context, builder, at[4], v_a, _F32)

            def load_values(j, d0, k):
                at_ = builder.add(builder.add(builder.mul(j, dim), d0), _I64(LANES * k))
                return builder.load(builder.bitcast(builder.gep(v_p, [at_]), _F32x16.as_pointer()), align=4)

            _weigh_codegen(builder, _pointer(context, builder, at[0], w_a, _F32), w_at_v, w_stride_v, n_v, dim,
                           load_values, j0_v, j1_v, _pointer(context, builder, at[7], acc_a, _F32), acc_at_v)
            return context.get_dummy_value()
        return types.void(weights, w_at, w_stride, n_pairs, values, j0, j1, acc, acc_at), codegen

    @intrinsic
    def weigh_half_pairs(typingctx, weights, w_at, w_stride, n_pairs, cache, kv, block, j0, j1, acc, acc_at):
        """weigh_pairs over the float16 value rows j0 <= j < j1 of block `block` of KV head kv, read
        from an f16 pool's bytes (cache uint8 [n_kv, blocks, block_size, 2 * dim]) and converted as
        they are loaded: the same sums as weigh_pairs over those rows decoded."""
        def codegen(context, builder, signature, args):
            w_a, w_at_v, w_stride_v, n_v, cache_a, kv_v, block_v, j0_v, j1_v, acc_a, acc_at_v = args
            at = signature.args
            cache = context.make_array(at[4])(context, builder, cache_a)
            strides = cgutils.unpack_tuple(builder, cache.strides)
            dim = builder.sdiv(cgutils.unpack_tuple(builder, cache.shape)[3], _I64(2))
            src = builder.bitcast(cache.data, ir.IntType(8).as_pointer())
            first = builder.add(builder.mul(kv_v, strides[0]), builder.mul(block_v, strides[1]))
            i16x16, f16x16 = ir.VectorType(ir.IntType(16), LANES), ir.VectorType(ir.HalfType(), LANES)

            def load_values(j, d0, k):
                at_ = builder.add(builder.add(first, builder.mul(j, strides[2])),
                                  builder.mul(builder.add(d0, _I64(LANES * k)), _I64(2)))
                ptr = builder.bitcast(builder.gep(src, [at_]), i16x16.as_pointer())
                return builder.fpext(builder.bitcast(builder.load(ptr, align=1), f16x16), _F32x16)

            _weigh_codegen(builder, _pointer(context, builder, at[0], w_a, _F32), w_at_v, w_stride_v, n_v, dim,
                           load_values, j0_v, j1_v, _pointer(context, builder, at[9], acc_a, _F32), acc_at_v)
            return context.get_dummy_value()
        return types.void(weights, w_at, w_stride, n_pairs, cache, kv, block, j0, j1, acc, acc_at), codegen
else:  # pragma: no cover
    weigh_pairs = weigh_half_pairs = None
