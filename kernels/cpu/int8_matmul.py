"""Matrix products in 8-bit integers (AVX-512 VNNI, or AVX2), accurate to float32's order.

The weights stay in their GGUF codes, biased to unsigned bytes when signed: the
block's code with its d (and minimum m) for the 32-weight types, each sub-block's
code with d * sc (and -dmin * m) for Q4_K/Q5_K, groups of 16 for Q6_K;
fl(scale * code) + offset must give back ggml's weight bit for bit, or the matrix
is not taken (kernels/cpu/int8_weights.py lays them out). Each input row is coded per group of 32 (16) inputs in two 8-bit
levels: first as ggml codes activations (quantize_row_q8_0: q0 = round(x * 127 / max|x|),
d = max|x| / 127), then what that leaves, x - d * q0, in steps of e = d / 254
(kernels/cpu/input_coding.py). Per output n and group g

    out[n] += (scale[n, g] * e[g]) * (254 * sum_k(code[n, k] * q0[k]) + sum_k(code[n, k] * q1[k]))
              + offset[n, g] * s[g]

with s[g] the float32 sum of the group's inputs: the two levels' integer sums meet before one
conversion to float (they stay below 2**28: 32 * 255 * 127 * 255). The integer sums are taken by
`vpdpbusd` (64 byte products an instruction), or on AVX2 by `vpmaddubsw` (codes of
4-6 bits stored unsigned and summed in 16 bits over several steps, see int8_weights.avx2_layout;
kernels/cpu/byte_dots.py), instead of float32 FMAs on weights four times the size.
One level, as llama.cpp multiplies, was 12-37 % faster (prefill, 32-sequence decode)
but left the input's 8-bit rounding in every product: one ulp of an RMSNorm scale moved
codes, and logits by more than 0.5, enough to flip the reference agreement test; with
two levels a product is within ~5e-5 of the float32 one (relative to its largest
output) and the same change moves nothing.

The inner kernel is written in LLVM IR through a numba intrinsic (numba has no
vector types): one tile of 32 outputs by 3 input rows (or 1), the tile's codes
laid out as [group, step, 32 outputs, 4 inputs] so that one 64-byte load feeds
16 outputs; each row is computed the same way whatever rows share its call.
Only built where the CPU has AVX-512 VNNI or AVX2 (llvmlite reports the host's features).
"""
from __future__ import annotations

import numpy as np

from kernels.cpu import byte_dots, input_coding, int8_weights, isa
from kernels.cpu.int8_weights import TILE, Int8Matrix

try:
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

LEVELS = 2         # 8-bit codings of each input: ggml's, then what it leaves in 1/254 of its step
# Passes of this many rows and more code their inputs in parallel; fewer (decode, the logits of a
# few rows) on the calling thread, without a second parallel region a product.
PARALLEL_CODING_ROWS = 8
VNNI = njit is not None and isa.has("avx512f", "avx512bw", "avx512vnni")  # TS_MAX_CPU_ISA=avx2: False
# Without VNNI (AVX2 CPUs: Zen 2/3, older Xeons) each 4-byte dot product is llama.cpp's AVX2
# sequence: vpmaddubsw needs an unsigned operand and saturates at 16 bits, so the codes are kept
# signed (no bias) and multiplied as |code| times q with the code's sign (128 * 127 * 2 < 2**15).
AVX2 = njit is not None and not VNNI and isa.has("avx2", "fma")
# The codes are prefetched into L2 PREFETCH_VECTORS 64-byte vectors ahead of the loads: the hardware
# prefetcher alone left one-row products well below what the memory streams. Both lines of each step
# 16 KiB ahead, except VNNI on AMD: every other line, 8 KiB ahead, the faster there (on Intel the
# other way round; measurements in docs/benchmarks-history.md).
ONE_LINE_IN_TWO = VNNI and isa.vendor() == "amd"
PREFETCH_VECTORS = 128 if ONE_LINE_IN_TWO else 256
PREFETCH_LINES = 1 if ONE_LINE_IN_TWO else 2
# One input row takes the same L2 hint: a non-temporal one (each code is read once) was no faster
# on AMD and much slower on an Intel Xeon capped to AVX2 (docs/benchmarks-history.md).
INTO_L2 = 2                          # llvm.prefetch locality: prefetcht1
# Input rows a micro-kernel call. With VNNI's 32 registers, 3 rows x 2 levels x 2 halves of
# accumulators fit (4 rows ran out). AVX2 has 16, and its 16-bit runs keep 8 accumulators a row:
# 3 rows spilled them to the stack every step, so one row at a time, rereading the tile's codes
# from L1, is the faster (the integer sums, and so the results, are the same).
ROWS = 3 if VNNI else 1


def available() -> bool:
    return VNNI or AVX2


def from_parts(parts: list[tuple[np.ndarray, int, tuple[int, int]]], dense: np.ndarray | None = None
               ) -> Int8Matrix | None:
    """int8_weights.from_parts laid out for this CPU's kernel."""
    return int8_weights.from_parts(parts, dense, vnni=VNNI)


if available():
    _I32x16 = ir.VectorType(ir.IntType(32), 16)
    _F32x16 = ir.VectorType(ir.FloatType(), 16)

    _ptr, _splat = input_coding.data_pointer, input_coding.splat

    def _tile_kernel(n_rows: int, levels: int, n_tiles: int = 1):
        """An intrinsic computing out[r0 + r, t * TILE + j] for r < n_rows and the tile's 32 outputs j,
        from `levels` 8-bit codings of the input (qx, dx, qbias: [levels, rows, ...]). With n_tiles=2
        it takes a second tile u and reads both at once, step by step: two streams of codes keep more
        lines in flight than one (on a Xeon whose cores each read ~10 GB/s, one stream of 64-byte
        loads reached ~0.9 of two); each tile's sums are taken in the same order as alone."""

        def codegen_for(tile_args):
            def codegen(context, builder, signature, args):
                at = signature.args
                codes_a, qx_a, dx_a, sx_a, qb_a, scale_a, offset_a, out_a = args[:8]
                tiles_v = [args[k] for k in tile_args]
                r0_v, group_v, run_v = args[-3], args[-2], args[-1]
                i32, i64, f32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
                module = builder.module
                prepare, dot = (byte_dots.dot_vnni if VNNI else byte_dots.dot_avx2)(module)
                fma = cgutils.get_or_insert_function(
                    module, ir.FunctionType(_F32x16, [_F32x16] * 3), "llvm.fma.v16f32")
                i8p = ir.IntType(8).as_pointer()
                prefetch = cgutils.get_or_insert_function(    # (address, read, locality, data)
                    module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8")
                qx_shape = cgutils.unpack_tuple(builder, context.make_array(at[1])(context, builder, qx_a).shape)
                out_shape = cgutils.unpack_tuple(builder, context.make_array(at[7])(context, builder, out_a).shape)
                rows_total, k_in, n_out = qx_shape[1], qx_shape[2], out_shape[1]
                steps = builder.sdiv(group_v, i64(4))
                groups = builder.sdiv(k_in, group_v)
                codes_p = _ptr(context, builder, at[0], codes_a, _I32x16)     # 64-byte vectors
                qx_p = _ptr(context, builder, at[1], qx_a, i32)                # 4 bytes of q at a time
                dx_p = _ptr(context, builder, at[2], dx_a, f32)
                sx_p = _ptr(context, builder, at[3], sx_a, f32)
                qb_p = _ptr(context, builder, at[4], qb_a, i32)
                scale_p = _ptr(context, builder, at[5], scale_a, _F32x16)
                offset_p = _ptr(context, builder, at[6], offset_a, _F32x16)
                out_p = _ptr(context, builder, at[7], out_a, f32)
                offset_size = cgutils.unpack_tuple(
                    builder, context.make_array(at[6])(context, builder, offset_a).shape)[0]
                has_off = builder.icmp_signed("!=", offset_size, i64(0))
                ratio = ir.Constant(_I32x16, [input_coding.LEVEL_RATIO] * 16)
                n_acc = 2 * n_rows
                facc = [[cgutils.alloca_once_value(builder, ir.Constant(_F32x16, None)) for _ in range(n_acc)]
                        for _ in tiles_v]
                iacc = [[[cgutils.alloca_once(builder, _I32x16) for _ in range(n_acc)] for _ in range(levels)]
                        for _ in tiles_v]
                acc16 = [[cgutils.alloca_once(builder, byte_dots.I16x16) for _ in range(levels * n_rows * 4)]
                         for _ in tiles_v]
                k4 = builder.sdiv(k_in, i64(4))                                # qx row stride in dwords
                qx_level = builder.mul(rows_total, k4)                         # level strides
                q_row0 = builder.mul(r0_v, k4)
                x_row0 = builder.mul(r0_v, groups)                             # dx/sx/qbias row start
                tile_vectors = builder.mul(builder.mul(groups, steps), i64(2))
                c0 = [builder.mul(t_v, tile_vectors) for t_v in tiles_v]
                s0 = [builder.mul(builder.mul(t_v, groups), i64(2)) for t_v in tiles_v]
                # AVX2's runs: at most a group's steps, and a step for signed codes (run 0), which take
                # the other path; divided once here, not in the loop (a 64-bit division is ~40 cycles)
                run = builder.select(builder.icmp_signed("<", run_v, steps), run_v, steps)
                run = builder.select(builder.icmp_signed("<", run, i64(1)), i64(1), run)
                n_runs = builder.sdiv(steps, run)
                with cgutils.for_range(builder, groups) as g_loop:
                    g = g_loop.index
                    for tile_acc in iacc:
                        for level in tile_acc:
                            for a in level:
                                builder.store(ir.Constant(_I32x16, None), a)

                    def step_inputs(step):
                        xs = {}
                        for lv in range(levels):
                            for r in range(n_rows):
                                x_at = builder.add(builder.add(q_row0, builder.mul(k4, i64(r))), step)
                                x_at = builder.add(x_at, builder.mul(qx_level, i64(lv)))
                                xs[lv, r] = builder.load(builder.gep(qx_p, [x_at]), align=1)
                        return xs

                    def step_codes(k, step):
                        w_at = builder.add(c0[k], builder.mul(step, i64(2)))
                        w = [builder.load(builder.gep(codes_p, [builder.add(w_at, i64(h))]), align=4)
                             for h in range(2)]
                        for h in range(PREFETCH_LINES):     # see PREFETCH_VECTORS
                            ahead = builder.gep(codes_p, [builder.add(w_at, i64(PREFETCH_VECTORS + h))])
                            builder.call(prefetch, [builder.bitcast(ahead, i8p), i32(0), i32(INTO_L2), i32(1)])
                        return w

                    def sums():
                        """(tile, level, row, h): each 16-output vector of sums the tiles keep."""
                        return [(k, lv, r, h) for k in range(len(tiles_v)) for lv in range(levels)
                                for r in range(n_rows) for h in range(2)]

                    def signed_steps():
                        with cgutils.for_range(builder, steps) as s_loop:
                            step = builder.add(builder.mul(g, steps), s_loop.index)
                            xs = step_inputs(step)
                            w = [[prepare(builder, v) for v in step_codes(k, step)] for k in range(len(tiles_v))]
                            for k, lv, r, h in sums():
                                a = iacc[k][lv][2 * r + h]
                                builder.store(dot(builder, builder.load(a), w[k][h], xs[lv, r]), a)

                    def unsigned_runs():
                        """AVX2, unsigned codes: runs of `run` steps summed in 16 bits, then widened."""
                        halves, add16, widen = byte_dots.run_avx2(module)
                        with cgutils.for_range(builder, n_runs) as c_loop:
                            for k in range(len(tiles_v)):
                                for a in acc16[k]:
                                    builder.store(ir.Constant(byte_dots.I16x16, None), a)
                            with cgutils.for_range(builder, run) as s_loop:
                                step = builder.add(builder.mul(g, steps),
                                                   builder.add(builder.mul(c_loop.index, run), s_loop.index))
                                xs = step_inputs(step)
                                w = [[halves(builder, v) for v in step_codes(k, step)] for k in range(len(tiles_v))]
                                for k, lv, r, h in sums():
                                    for half in range(2):
                                        a = acc16[k][((lv * n_rows + r) * 2 + h) * 2 + half]
                                        builder.store(add16(builder, builder.load(a), w[k][h][half], xs[lv, r]), a)
                            for k, lv, r, h in sums():
                                at = ((lv * n_rows + r) * 2 + h) * 2
                                pair = [builder.load(acc16[k][at + half]) for half in range(2)]
                                a = iacc[k][lv][2 * r + h]
                                builder.store(widen(builder, builder.load(a), pair), a)

                    if VNNI:
                        signed_steps()
                    else:
                        with builder.if_else(builder.icmp_signed("==", run_v, i64(0))) as (then, otherwise):
                            with then:
                                signed_steps()
                            with otherwise:
                                unsigned_runs()
                    for k in range(len(tiles_v)):
                        sc_at = builder.add(s0[k], builder.mul(g, i64(2)))
                        sc = [builder.load(builder.gep(scale_p, [builder.add(sc_at, i64(h))]), align=4)
                              for h in range(2)]
                        for r in range(n_rows):
                            xg = builder.add(builder.add(x_row0, builder.mul(groups, i64(r))), g)
                            d = _splat(builder, builder.load(builder.gep(dx_p, [xg])), _F32x16)
                            qb = _splat(builder, builder.load(builder.gep(qb_p, [xg])), _I32x16)
                            for h in range(2):
                                # both levels' sums in level 1's steps, converted once
                                total = builder.load(iacc[k][0][2 * r + h])
                                for lv in range(1, levels):
                                    total = builder.add(builder.mul(total, ratio), builder.load(iacc[k][lv][2 * r + h]))
                                f = builder.sitofp(builder.sub(total, qb), _F32x16)
                                acc = builder.call(fma, [f, builder.fmul(sc[h], d), builder.load(facc[k][2 * r + h])])
                                builder.store(acc, facc[k][2 * r + h])
                        with builder.if_then(has_off):
                            off = [builder.load(builder.gep(offset_p, [builder.add(sc_at, i64(h))]), align=4)
                                   for h in range(2)]
                            for r in range(n_rows):
                                xg = builder.add(builder.add(x_row0, builder.mul(groups, i64(r))), g)
                                s = _splat(builder, builder.load(builder.gep(sx_p, [xg])), _F32x16)
                                for h in range(2):
                                    acc = builder.call(fma, [off[h], s, builder.load(facc[k][2 * r + h])])
                                    builder.store(acc, facc[k][2 * r + h])
                for k, t_v in enumerate(tiles_v):
                    for r in range(n_rows):
                        row_at = builder.mul(builder.add(r0_v, i64(r)), n_out)
                        for h in range(2):
                            at_out = builder.add(row_at, builder.add(builder.mul(t_v, i64(TILE)), i64(16 * h)))
                            dst = builder.bitcast(builder.gep(out_p, [at_out]), _F32x16.as_pointer())
                            builder.store(builder.load(facc[k][2 * r + h]), dst, align=4)
                return context.get_dummy_value()
            return codegen

        if n_tiles == 1:
            @intrinsic
            def tile_rows(typingctx, codes, qx, dx, sx, qbias, scale, offset, out, t, r0, group, run):
                return types.void(codes, qx, dx, sx, qbias, scale, offset, out, t, r0, group, run), codegen_for([8])
            return tile_rows

        @intrinsic
        def tile_pair_rows(typingctx, codes, qx, dx, sx, qbias, scale, offset, out, t, u, r0, group, run):
            return (types.void(codes, qx, dx, sx, qbias, scale, offset, out, t, u, r0, group, run),
                    codegen_for([8, 9]))
        return tile_pair_rows

    _tile_rows_block = _tile_kernel(ROWS, LEVELS)
    _tile_rows1 = _tile_kernel(1, LEVELS)
    _tile_pair1 = _tile_kernel(1, LEVELS, 2)     # two tiles of one row at once
    _quantize_row_range = input_coding.quantize_row_range

    @njit(parallel=True, nogil=True, cache=True)
    def _kernel(x, codes, scale, offset, bias, group, run, out):  # pragma: no cover - compiled
        rows, k_in = x.shape
        groups = k_in // group
        qx = np.empty((LEVELS, rows, k_in), np.int8)
        dx = np.empty((rows, groups), np.float32)
        sx = np.empty((rows, groups), np.float32)
        qsum = np.empty((rows, groups), np.int32)
        if rows >= PARALLEL_CODING_ROWS:       # a prompt's rows: coded on every thread
            for r in prange(rows):
                _quantize_row_range(x, group, qx, dx, sx, qsum, r, r + 1)
        else:
            _quantize_row_range(x, group, qx, dx, sx, qsum, 0, rows)
        qbias = qsum * np.int32(bias)
        full = rows // ROWS * ROWS
        for t in prange(out.shape[1] // TILE):
            for r0 in range(0, full, ROWS):
                _tile_rows_block(codes, qx, dx, sx, qbias, scale, offset, out, t, r0, group, run)
            for r0 in range(full, rows):
                _tile_rows1(codes, qx, dx, sx, qbias, scale, offset, out, t, r0, group, run)


def quantize_rows(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's coding of x's rows (kernels/cpu/input_coding.py): q int8 [2, rows, in] (the two
    levels' codes), d float32 [rows, groups] (level 1's step, level 0's / 256), s the float32 sum of
    each group, and int32 [rows, groups] 256 * sum(q0) + sum(q1)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, groups = x.shape[0], x.shape[1] // group
    q = np.empty((LEVELS, *x.shape), np.int8)
    d, s = np.empty((rows, groups), np.float32), np.empty((rows, groups), np.float32)
    qsum = np.empty((rows, groups), np.int32)
    input_coding.quantize_two_levels(x, group, q, d, s, qsum)
    return q, d, s, qsum


def matmul(x: np.ndarray, w: Int8Matrix) -> np.ndarray:
    """x float32 [m, in] times the matrix -> float32 [m, out]."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty((x.shape[0], w.n_tiles * TILE), np.float32)
    _kernel(x, w.codes, w.scale, w.offset, w.bias, w.group, w.run, out)
    return out[:, :w.out_features] if out.shape[1] != w.out_features else out


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel for both row counts."""
    if not available():
        return
    m = Int8Matrix(np.ones(TILE * 32, np.uint8), np.ones(TILE, np.float32), np.ones(TILE, np.float32), 128,
                   TILE, 32, 32)
    matmul(np.ones((ROWS + 1, 32), np.float32), m)
    quantize_rows(np.ones((1, 32), np.float32), 32)
