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
# pairs a tile of score_pairs' grouped form: 4 pairs x CHAINS / 4 groups, or 2 x CHAINS / 2 for 2 or fewer
GROUPED_PAIRS = 4

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

    def _transposed(builder, rows: list) -> list:
        """The 16 vectors of a 16 x 16 square transposed in registers (butterfly shuffles)."""
        for h, low, high in _transpose_masks():
            nxt = list(rows)
            for i in range(KEYS):
                if i & h == 0:
                    a, b = rows[i], rows[i + h]
                    nxt[i] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, KEYS), low))
                    nxt[i + h] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, KEYS), high))
            rows = nxt
        return rows

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
            with cgutils.for_range(builder, builder.sdiv(dim, _I64(KEYS))) as loop:
                c = builder.mul(loop.index, _I64(KEYS))          # this 16 x 16 square's first value
                rows = []
                for lane in range(KEYS):
                    at_row = builder.add(builder.add(row0, builder.mul(dim, _I64(lane))), c)
                    ptr = builder.bitcast(builder.gep(src, [at_row]), _F32x16.as_pointer())
                    rows.append(builder.load(ptr, align=4))
                rows = _transposed(builder, rows)
                for lane in range(KEYS):
                    builder.store(rows[lane], builder.gep(dst, [builder.add(c, _I64(lane))]), align=4)
            return context.get_dummy_value()
        return types.void(keys, j0, keys_t), codegen

    @intrinsic
    def transpose_half_keys(typingctx, cache, kv, block, j0, keys_t, g):
        """keys_t[g, d, l] = the float16 key in row j0 + l of block `block` of KV head kv, value d,
        for l < 16 (cache: an f16 pool's bytes, uint8 [n_kv, blocks, block_size, 2 * dim], rows
        j0 .. j0 + 15 inside the block; keys_t float32 [G, dim, 16], dim a multiple of 16): the
        keys converted as they are loaded, with no float32 copy of the block."""
        def codegen(context, builder, signature, args):
            cache_a, kv_v, block_v, j0_v, out_a, g_v = args
            at = signature.args
            cache = context.make_array(at[0])(context, builder, cache_a)
            strides = cgutils.unpack_tuple(builder, cache.strides)
            dim = _shape(context, builder, at[4], out_a)[1]
            i16x16 = ir.VectorType(ir.IntType(16), KEYS)
            f16x16 = ir.VectorType(ir.HalfType(), KEYS)
            src = builder.bitcast(cache.data, ir.IntType(8).as_pointer())
            first = builder.add(builder.add(builder.mul(kv_v, strides[0]), builder.mul(block_v, strides[1])),
                                builder.mul(j0_v, strides[2]))
            dst = _pointer(context, builder, at[4], out_a, _F32x16)
            dst_at = builder.mul(g_v, dim)
            with cgutils.for_range(builder, builder.sdiv(dim, _I64(KEYS))) as loop:
                c = builder.mul(loop.index, _I64(KEYS))          # this 16 x 16 square's first value
                rows = []
                for lane in range(KEYS):
                    at_row = builder.add(builder.add(first, builder.mul(strides[2], _I64(lane))),
                                         builder.mul(c, _I64(2)))
                    ptr = builder.bitcast(builder.gep(src, [at_row]), i16x16.as_pointer())
                    rows.append(builder.fpext(builder.bitcast(builder.load(ptr, align=1), f16x16), _F32x16))
                rows = _transposed(builder, rows)
                for lane in range(KEYS):
                    builder.store(rows[lane], builder.gep(dst, [builder.add(builder.add(dst_at, c), _I64(lane))]),
                                  align=4)
            return context.get_dummy_value()
        return types.void(cache, kv, block, j0, keys_t, g), codegen

    @intrinsic
    def score_pairs(typingctx, qs, q_at, n_pairs, keys_t, out, out_at, out_stride, lane_lo, lane_hi):
        """out[out_at + p * out_stride + l] = the sum over d of qs[q_at + p * dim + d] * keys_t[d, l]
        for p < n_pairs and lane_lo <= l < lane_hi (other lanes untouched: out_at + l may lie outside
        out for them). qs and out are flat float32 arrays; keys_t float32 [dim, 16], or [G, dim, 16]
        for G groups of 16 keys side by side (lane l of group g is out's l + 16 g, lane_lo and
        lane_hi then count over all G * 16): a decode row has only its few query heads, and each
        group adds their chains (the latency of one FMA chain would otherwise bound the call)."""
        def codegen(context, builder, signature, args):
            qs_a, q_at_v, n_v, kt_a, out_a, out_at_v, stride_v, lo_v, hi_v = args
            at = signature.args
            module = builder.module
            fma = cgutils.get_or_insert_function(module, ir.FunctionType(_F32x16, [_F32x16] * 3), "llvm.fma.v16f32")
            store = cgutils.get_or_insert_function(
                module, ir.FunctionType(ir.VoidType(), [_F32x16, _F32x16.as_pointer(), _I32, _MASK]),
                "llvm.masked.store.v16f32.p0v16f32")
            shape = _shape(context, builder, at[3], kt_a)
            grouped = at[3].ndim == 3
            dim = shape[1] if grouped else shape[0]
            n_groups = shape[0] if grouped else _I64(1)
            q_p = _pointer(context, builder, at[0], qs_a, _F32)
            kt_p = _pointer(context, builder, at[3], kt_a, _F32x16)
            out_p = _pointer(context, builder, at[4], out_a, _F32)
            lanes = ir.Constant(ir.VectorType(_I64, KEYS), list(range(KEYS)))
            zeros = ir.Constant(ir.VectorType(_I32, KEYS), [0] * KEYS)

            def splat_i64(v):
                one = builder.insert_element(ir.Constant(ir.VectorType(_I64, KEYS), ir.Undefined), v, _I32(0))
                return builder.shuffle_vector(one, one, zeros)

            lo, hi = splat_i64(lo_v), splat_i64(hi_v)
            quarter = builder.sdiv(dim, _I64(PARTS))

            def chains(p0, count, g0, groups):
                """The pairs [p0, p0 + count) against the groups [g0, g0 + groups): count x groups
                chains, each key vector loaded once for the pairs."""
                sums = [[cgutils.alloca_once(builder, _F32x16) for _ in range(groups)] for _ in range(count)]
                accs = [[cgutils.alloca_once(builder, _F32x16) for _ in range(groups)] for _ in range(count)]
                rows = [builder.add(q_at_v, builder.mul(builder.add(p0, _I64(c)), dim)) for c in range(count)]
                firsts = [builder.mul(builder.add(g0, _I64(g)), dim) for g in range(groups)]
                for part in range(PARTS):
                    for c in range(count):
                        for g in range(groups):
                            builder.store(ir.Constant(_F32x16, None), accs[c][g])
                    d_lo, d_hi = builder.mul(quarter, _I64(part)), builder.mul(quarter, _I64(part + 1))
                    with cgutils.for_range_slice(builder, d_lo, d_hi, _I64(1)) as (d, _):
                        ks = [builder.load(builder.gep(kt_p, [builder.add(firsts[g], d)]), align=4)
                              for g in range(groups)]
                        for c in range(count):
                            q = _splat(builder, builder.load(builder.gep(q_p, [builder.add(rows[c], d)])), _F32x16)
                            for g in range(groups):
                                builder.store(builder.call(fma, [q, ks[g], builder.load(accs[c][g])]), accs[c][g])
                    for c in range(count):
                        for g in range(groups):
                            acc = builder.load(accs[c][g])
                            builder.store(acc if part == 0 else builder.fadd(builder.load(sums[c][g]), acc), sums[c][g])
                for g in range(groups):
                    key0 = builder.mul(builder.add(g0, _I64(g)), _I64(KEYS))
                    seen = builder.add(lanes, splat_i64(key0))
                    mask = builder.and_(builder.icmp_signed(">=", seen, lo), builder.icmp_signed("<", seen, hi))
                    for c in range(count):
                        o = builder.add(builder.add(out_at_v, key0), builder.mul(builder.add(p0, _I64(c)), stride_v))
                        ptr = builder.bitcast(builder.gep(out_p, [o]), _F32x16.as_pointer())
                        builder.call(store, [builder.load(sums[c][g]), ptr, _I32(4), mask])

            def tiles(pair_units, group_units):
                value_sums.in_chunks(builder, "groups", n_groups, group_units, 1,
                                     lambda g0, groups: value_sums.in_chunks(
                                         builder, "pairs", n_v, pair_units, 1,
                                         lambda p0, count: chains(p0, count, g0, groups)))

            if not grouped:
                tiles(CHAINS, 1)
            else:   # few pairs (a decode row's heads): more groups a tile, CHAINS chains in all
                few = builder.icmp_signed("<=", n_v, _I64(GROUPED_PAIRS // 2))
                with builder.if_else(few) as (then, otherwise):
                    with then:
                        tiles(GROUPED_PAIRS // 2, CHAINS // (GROUPED_PAIRS // 2))
                    with otherwise:
                        tiles(GROUPED_PAIRS, CHAINS // GROUPED_PAIRS)
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
    transpose_keys = transpose_half_keys = score_pairs = score_scalar = fma = None
