"""Attention scores q . k of several queries against 16 keys at once, each from chains of FMAs
over the head's values in order: each quarter of the head's values one chain,
fma(q[d], k[d], ... fma(q[d0], k[d0], 0)), and the quarters' sums added first to last.

Every causal row (decode_attention's attend and attend_rows, replayed or not) takes its scores here,
so a score's float sum is the same whichever rows share the call: its order is the same whichever
vector lane holds it. Keys go 16 to a vector: `transpose_keys` turns 16 decoded key rows
[16, dim] into [dim, 16] (shuffles in registers), and `score_pairs` then runs the chains of each (query,
16 keys) with the key vector loaded once for up to 8 queries (a prompt chunk's rows times the KV
head's query heads; a decode row's query heads), storing only the lanes of keys the row sees.
The vectorized dot product it replaces summed each key across lanes and reduced them horizontally,
half of its work. `score_scalar` is the same sum a key at a time, for blocks of fewer than 16 keys.
"""
from __future__ import annotations

import numpy as np

from kernels.cpu import input_coding, isa, value_sums

# each score is PARTS chains over consecutive quarters of the head, added in turn: shorter chains
# round less (a chain over 256 values left ~2e-5 of a float64 softmax's output)
PARTS = 4
KEYS = 16          # keys a vector: a float32 vector of 64 bytes (AVX2 runs it as two halves)
# queries whose chains share each key vector load (AVX-512: 8 accumulators and the keys of 32
# registers; AVX2 holds each 16-float vector in two of its 16)
CHAINS = 8 if isa.has("avx512f") else 4

try:
    from llvmlite import ir
    from numba import njit, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None


def available() -> bool:
    return njit is not None


def _transpose_masks() -> list[tuple[int, list[int], list[int]]]:
    """(distance, mask of the lower row, mask of the upper) of each butterfly stage of a 16 x 16
    transpose: rows i and i + h swap the h-lane halves of their 2h-lane blocks."""
    stages = []
    for h in (8, 4, 2, 1):
        low = [lane if lane & h == 0 else KEYS + lane - h for lane in range(KEYS)]
        high = [lane + h if lane & h == 0 else KEYS + lane for lane in range(KEYS)]
        stages.append((h, low, high))
    return stages


if available():
    _F32 = ir.FloatType()
    _F32x16 = ir.VectorType(_F32, KEYS)
    _I32, _I64 = ir.IntType(32), ir.IntType(64)
    _MASK = ir.VectorType(ir.IntType(1), KEYS)

    _pointer, _splat = input_coding.data_pointer, input_coding.splat

    def _shape(context, builder, aryty, ary):
        return cgutils.unpack_tuple(builder, context.make_array(aryty)(context, builder, ary).shape)

    @intrinsic
    def transpose_keys(typingctx, keys, j0, keys_t):
        """keys_t[d, l] = keys[j0 + l, d] for l < 16 (keys float32 [>= j0 + 16, dim], dim a multiple
        of 16; keys_t float32 [dim, 16])."""
        def codegen(context, builder, signature, args):
            keys_a, j0_v, out_a = args
            at = signature.args
            dim = _shape(context, builder, at[0], keys_a)[1]
            src = _pointer(context, builder, at[0], keys_a, _F32)
            dst = _pointer(context, builder, at[2], out_a, _F32x16)
            row0 = builder.mul(j0_v, dim)
            stages = _transpose_masks()
            with cgutils.for_range(builder, builder.sdiv(dim, _I64(KEYS))) as loop:
                c = builder.mul(loop.index, _I64(KEYS))          # this 16 x 16 square's first value
                rows = []
                for lane in range(KEYS):
                    at_row = builder.add(builder.add(row0, builder.mul(dim, _I64(lane))), c)
                    ptr = builder.bitcast(builder.gep(src, [at_row]), _F32x16.as_pointer())
                    rows.append(builder.load(ptr, align=4))
                for h, low, high in stages:
                    nxt = list(rows)
                    for i in range(KEYS):
                        if i & h == 0:
                            a, b = rows[i], rows[i + h]
                            nxt[i] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, KEYS), low))
                            nxt[i + h] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, KEYS), high))
                    rows = nxt
                for lane in range(KEYS):
                    builder.store(rows[lane], builder.gep(dst, [builder.add(c, _I64(lane))]), align=4)
            return context.get_dummy_value()
        return types.void(keys, j0, keys_t), codegen

    @intrinsic
    def score_pairs(typingctx, qs, q_at, n_pairs, keys_t, out, out_at, out_stride, lane_lo, lane_hi):
        """out[out_at + p * out_stride + l] = the sum over d of qs[q_at + p * dim + d] * keys_t[d, l]
        for p < n_pairs and lane_lo <= l < lane_hi (other lanes untouched: out_at + l may lie outside
        out for them). qs and out are flat float32 arrays; keys_t float32 [dim, 16]."""
        def codegen(context, builder, signature, args):
            qs_a, q_at_v, n_v, kt_a, out_a, out_at_v, stride_v, lo_v, hi_v = args
            at = signature.args
            module = builder.module
            fma = cgutils.get_or_insert_function(module, ir.FunctionType(_F32x16, [_F32x16] * 3), "llvm.fma.v16f32")
            store = cgutils.get_or_insert_function(
                module, ir.FunctionType(ir.VoidType(), [_F32x16, _F32x16.as_pointer(), _I32, _MASK]),
                "llvm.masked.store.v16f32.p0v16f32")
            dim = _shape(context, builder, at[3], kt_a)[0]
            q_p = _pointer(context, builder, at[0], qs_a, _F32)
            kt_p = _pointer(context, builder, at[3], kt_a, _F32x16)
            out_p = _pointer(context, builder, at[4], out_a, _F32)
            lanes = ir.Constant(ir.VectorType(_I64, KEYS), list(range(KEYS)))
            lo = builder.insert_element(ir.Constant(ir.VectorType(_I64, KEYS), ir.Undefined), lo_v, _I32(0))
            hi = builder.insert_element(ir.Constant(ir.VectorType(_I64, KEYS), ir.Undefined), hi_v, _I32(0))
            zeros = ir.Constant(ir.VectorType(_I32, KEYS), [0] * KEYS)
            lo = builder.shuffle_vector(lo, lo, zeros)
            hi = builder.shuffle_vector(hi, hi, zeros)
            mask = builder.and_(builder.icmp_signed(">=", lanes, lo), builder.icmp_signed("<", lanes, hi))
            quarter = builder.sdiv(dim, _I64(PARTS))

            def chains(p0, count):
                """The pairs [p0, p0 + count): count chains sharing each key vector."""
                sums = [cgutils.alloca_once(builder, _F32x16) for _ in range(count)]
                accs = [cgutils.alloca_once(builder, _F32x16) for _ in range(count)]
                rows = [builder.add(q_at_v, builder.mul(builder.add(p0, _I64(c)), dim)) for c in range(count)]
                for part in range(PARTS):
                    for c in range(count):
                        builder.store(ir.Constant(_F32x16, None), accs[c])
                    d_lo, d_hi = builder.mul(quarter, _I64(part)), builder.mul(quarter, _I64(part + 1))
                    with cgutils.for_range_slice(builder, d_lo, d_hi, _I64(1)) as (d, _):
                        k = builder.load(builder.gep(kt_p, [d]), align=4)
                        for c in range(count):
                            q = _splat(builder, builder.load(builder.gep(q_p, [builder.add(rows[c], d)])), _F32x16)
                            builder.store(builder.call(fma, [q, k, builder.load(accs[c])]), accs[c])
                    for c in range(count):
                        acc = builder.load(accs[c])
                        builder.store(acc if part == 0 else builder.fadd(builder.load(sums[c]), acc), sums[c])
                for c in range(count):
                    o = builder.add(out_at_v, builder.mul(builder.add(p0, _I64(c)), stride_v))
                    ptr = builder.bitcast(builder.gep(out_p, [o]), _F32x16.as_pointer())
                    builder.call(store, [builder.load(sums[c]), ptr, _I32(4), mask])

            value_sums.in_chunks(builder, "pairs", n_v, CHAINS, 1, chains)
            return context.get_dummy_value()
        return types.void(qs, q_at, n_pairs, keys_t, out, out_at, out_stride, lane_lo, lane_hi), codegen

    @intrinsic
    def fma(typingctx, a, b, c):
        """a * b + c rounded once (llvm.fma.f32): never split or reordered, fastmath or not."""
        def codegen(context, builder, signature, args):
            f = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")
            return builder.call(f, list(args))
        return types.float32(types.float32, types.float32, types.float32), codegen

    @njit(cache=True, nogil=True)      # not inlined: a fastmath caller must not reorder its sums
    def score_scalar(qs, q_at, keys, j):  # pragma: no cover - numba
        """score_pairs' sum for one query (qs flat, from q_at) and the key row keys[j], a key at a
        time: the same float sum (lanes of an FMA are scalar FMAs)."""
        quarter = keys.shape[1] // PARTS
        total = np.float32(0.0)
        for part in range(PARTS):
            acc = np.float32(0.0)
            for d in range(part * quarter, (part + 1) * quarter):
                acc = fma(qs[q_at + d], keys[j, d], acc)
            total = acc if part == 0 else total + acc
        return total
else:  # pragma: no cover
    transpose_keys = score_pairs = score_scalar = fma = None
