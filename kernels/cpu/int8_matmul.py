"""Matrix products in 8-bit integers (AVX-512 VNNI, or AVX2), accurate to float32's order.

The weights stay in their GGUF codes, biased to unsigned bytes when signed: the
block's code with its d (and minimum m) for the 32-weight types, each sub-block's
code with d * sc (and -dmin * m) for Q4_K/Q5_K, groups of 16 for Q6_K;
fl(scale * code) + offset must give back ggml's weight bit for bit, or the matrix
is not taken. Each input row is coded per group of 32 (16) inputs in two 8-bit
levels: first as ggml codes activations (quantize_row_q8_0: q0 = round(x * 127 / max|x|),
d = max|x| / 127), then what that leaves, x - d * q0, in steps of e = d / 254
(kernels/cpu/input_coding.py). Per output n and group g

    out[n] += (scale[n, g] * e[g]) * (254 * sum_k(code[n, k] * q0[k]) + sum_k(code[n, k] * q1[k]))
              + offset[n, g] * s[g]

with s[g] the float32 sum of the group's inputs: the two levels' integer sums meet before one
conversion to float (they stay below 2**28: 32 * 255 * 127 * 255). The integer sums are taken by
`vpdpbusd` (64 byte products an instruction), or on AVX2 by `vpmaddubsw` (codes of
4-6 bits stored unsigned and summed in 16 bits over several steps, see avx2_layout;
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

from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as gguf_quants

from kernels.cpu import byte_dots, input_coding, isa, quantized
from shared.dequant import dequantize

try:
    from llvmlite import ir
    from numba import njit, prange, types
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

TILE = 32           # outputs per tile: two 16-lane vectors
LEVELS = 2         # 8-bit codings of each input: ggml's, then what it leaves in 1/254 of its step
BYTE_CODE_TYPES = frozenset(int(t) for t in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K))
# Passes of this many rows and more code their inputs in parallel; fewer (decode, the logits of a
# few rows) on the calling thread, without a second parallel region a product.
PARALLEL_CODING_ROWS = 8
VNNI = njit is not None and isa.has("avx512f", "avx512bw", "avx512vnni")  # TS_MAX_CPU_ISA=avx2: False
# Without VNNI (AVX2 CPUs: Zen 2/3, older Xeons) each 4-byte dot product is llama.cpp's AVX2
# sequence: vpmaddubsw needs an unsigned operand and saturates at 16 bits, so the codes are kept
# signed (no bias) and multiplied as |code| times q with the code's sign (128 * 127 * 2 < 2**15).
AVX2 = njit is not None and not VNNI and isa.has("avx2", "fma")
# The codes are prefetched into L2 PREFETCH_VECTORS 64-byte vectors ahead of the loads: both lines
# of each step 16 KiB ahead, except VNNI on AMD: every other line, 8 KiB ahead. On a Xeon the
# hardware prefetcher alone kept one-row products of every SmolLM2 matrix at ~22-24 GB/s on 2
# cores whose OpenBLAS sgemv streams ~29; 8 KiB ahead, every other line, gave 25-28. On a Zen 3
# EPYC (AVX2) one thread over a 210 MB matrix read 10.8 GB/s with no hint (sgemv: 21); both lines,
# 16 KiB ahead: 19-27 (2 threads 25-40, as the host's memory moved); 8, 24 or 32 KiB were no better,
# nor was prefetching the scales and offsets as well. On a Zen 4 EPYC (VNNI) both lines 16 KiB
# ahead were the slower: SmolLM2 decode products 31.2 GB/s against 32.5 every other line 8 KiB
# ahead, steps 6.62 against 6.24 ms (three rounds of make profile-decode, each variant in its own
# process). On an Intel Xeon (2026-12-05, VNNI) it was the other way: decode steps with both lines
# took 0.91 of the time of every other line (SmolLM2 and Gemma 3, in-process A/B in random order,
# 10-12 rounds, A/A 0.98-1.00); 8 to 24 KiB ahead were within 1 %, 32 KiB 3 % slower
# (docs/BENCHMARKS.md).
ONE_LINE_IN_TWO = VNNI and isa.vendor() == "amd"
PREFETCH_VECTORS = 128 if ONE_LINE_IN_TWO else 256
PREFETCH_LINES = 1 if ONE_LINE_IN_TWO else 2
# One input row on AVX2 (a decode step's products) once asked for its codes non-temporally instead
# (prefetchnta, both lines of a step, 2 KiB ahead: each code is read once). On a Zen 3 EPYC one
# 151 MB product ran 1.11x as fast, but decode steps only 0.99 of the time (in-process A/B, within
# what an A/A run moves); on an Intel Xeon capped to AVX2 (TS_MAX_CPU_ISA=avx2) SmolLM2's decode
# steps took 1.81x the time of the L2 hint (12.4 against 6.8 ms, 12 rounds in random order), and
# on a Zen 4 so capped the L2 hint was as fast. One row takes the L2 hint everywhere now.
INTO_L2 = 2                          # llvm.prefetch locality: prefetcht1
# Input rows a micro-kernel call. With VNNI's 32 registers, 3 rows x 2 levels x 2 halves of
# accumulators fit (4 rows ran out). AVX2 has 16, and its 16-bit runs keep 8 accumulators a row:
# 3 rows spilled them to the stack every step. One row at a time reads the tile's codes again
# from L1 for each row, and was the faster: 32 rows of SmolLM2's products took 0.62-0.83 of the
# time (Zen 3 EPYC; the integer sums, and so the results, are the same).
ROWS = 3 if VNNI else 1


def available() -> bool:
    return VNNI or AVX2


@dataclass(frozen=True)
class Int8Matrix:
    """An [out, in] matrix as unsigned byte codes with per-group scale and offset, tiled by outputs."""
    codes: np.ndarray      # uint8 [n_tiles, groups, group // 4, TILE, 4], flattened
    scale: np.ndarray      # float32 [n_tiles, groups, TILE], flattened
    offset: np.ndarray     # float32 [n_tiles, groups, TILE], flattened; empty when every offset is 0
    bias: int              # what was added to the codes to store them unsigned (VNNI: 128 if signed)
    out_features: int
    in_features: int
    group: int
    run: int = 0           # AVX2: steps of 4 inputs summed in 16 bits before widening; 0: signed codes

    @property
    def n_tiles(self) -> int:
        return -(-self.out_features // TILE)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.offset.nbytes


def from_parts(parts: list[tuple[np.ndarray, int, tuple[int, int]]], dense: np.ndarray | None = None
               ) -> Int8Matrix | None:
    """One matrix for this kernel from [out, in] GGUF tensors stacked along `out` (`dense`: their
    stacked float32 decoding, when the caller has it), or None when a part's type has no byte codes
    or its codes do not give back ggml's weights bit for bit."""
    n_in = parts[0][2][1]
    codes, scales, offsets, groups = [], [], [], []
    first_row = 0
    for raw, ggml_type, (n_out, part_in) in parts:
        if part_in != n_in or n_in % 32:
            return None
        raw = np.asarray(raw, dtype=np.uint8).reshape(n_out, -1)
        for r0 in range(0, n_out, _CHUNK_ROWS):
            rows = raw[r0:r0 + _CHUNK_ROWS]
            weight = dense[first_row + r0:first_row + r0 + rows.shape[0]] if dense is not None else None
            split = _byte_split(rows.reshape(-1), int(ggml_type), (rows.shape[0], n_in), weight)
            if split is None:
                return None
            for out, value in zip((codes, scales, offsets, groups), split):
                out.append(value)
        first_row += n_out
    group = min(groups)             # 16 when a part has sub-blocks of 16 (Q6_K): the others repeat theirs
    scale = np.concatenate([np.repeat(s, g // group, axis=1) for s, g in zip(scales, groups)])
    offset = np.concatenate([np.repeat(o, g // group, axis=1) for o, g in zip(offsets, groups)])
    lo = min(int(c.min(initial=0)) for c in codes)
    hi = max(int(c.max(initial=0)) for c in codes)
    if VNNI:
        (bias, run), stored = (128 if lo < 0 else 0, 0), (0, 255)
    else:
        bias, run = avx2_layout(lo, hi)
        stored = (0, 129) if run else (-128, 127)      # signed codes: their bytes, for the sign trick
    if lo + bias < stored[0] or hi + bias > stored[1]:
        return None
    n_out = scale.shape[0]
    n_tiles = -(-n_out // TILE)
    padded = np.zeros((n_tiles * TILE, n_in), np.uint8)
    row = 0
    for c in codes:
        padded[row:row + c.shape[0]] = (c + bias) & 0xFF        # int16 codes: AVX2's negative ones as bytes
        row += c.shape[0]
    # [tile, out, group, step, 4] -> [tile, group, step, out, 4]: one 64-byte load feeds 16 outputs
    tiled = padded.reshape(n_tiles, TILE, n_in // group, group // 4, 4).transpose(0, 2, 3, 1, 4)
    return Int8Matrix(np.ascontiguousarray(tiled).reshape(-1), _tile_groups(scale, n_tiles),
                      _tile_groups(offset, n_tiles) if np.any(offset) else np.zeros(0, np.float32),
                      bias, n_out, n_in, group, run)


def avx2_layout(lo: int, hi: int) -> tuple[int, int]:
    """(bias, run) for codes in [lo, hi] on AVX2. vpmaddubsw multiplies unsigned bytes by signed ones
    and saturates each pair's sum at 16 bits: codes spanning at most 129 values are stored unsigned
    (code - lo), so 2 * 129 * 127 < 2**15 and no sign trick is needed, and a run of steps whose pair
    sums still fit in 16 bits is added with vpaddw before one vpmaddwd widens it (4-bit codes: 8
    steps, a whole group of 32). Wider codes (Q8_0's 256 values) stay signed: run 0."""
    bias = max(0, -lo)
    largest = hi + bias
    if largest > 129:
        return 0, 0
    run = 8
    while run > 1 and run * 2 * largest * 127 > 2 ** 15 - 1:
        run //= 2
    return bias, run


_CHUNK_ROWS = 8192


def _tile_groups(a: np.ndarray, n_tiles: int) -> np.ndarray:
    """[out, groups] -> [tile, groups, TILE] flattened, zero-padded."""
    padded = np.zeros((n_tiles * TILE, a.shape[1]), np.float32)
    padded[:a.shape[0]] = a
    return np.ascontiguousarray(padded.reshape(n_tiles, TILE, -1).transpose(0, 2, 1)).reshape(-1)


def _byte_split(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], weight: np.ndarray | None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int] | None:
    """(codes int16 [out, in], scale and offset float32 [out, in // group], group) such that
    fl(scale * code) + offset is ggml's weight exactly: the block's d (and minimum m) for the 32-weight
    types, and for the k-quants each sub-block's d * sc (and -dmin * m), as ggml decodes them."""
    if ggml_type in (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0):
        split = quantized.split_codes(raw, ggml_type, shape, weight)
        return None if split is None else (split[0], split[1], split[2][:, ::2].copy(), 32)
    n_out, n_in = shape
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[T(ggml_type)][1])
    if ggml_type in (T.Q4_K, T.Q5_K):                  # y = (d * sc) * q - dmin * m, sub-blocks of 32
        sc, m = gguf_quants.Q4_K.get_scale_min(blocks[:, 4:16])
        scale = quantized._f16(blocks, 0)[:, None] * sc.astype(np.float32)
        offset = -(quantized._f16(blocks, 2)[:, None] * m.astype(np.float32))
        group = 32
    elif ggml_type == T.Q6_K:                          # y = (d * sc) * (q - 32), sub-blocks of 16
        scale = quantized._f16(blocks, 208)[:, None] * blocks[:, 192:208].view(np.int8).astype(np.float32)
        offset = np.zeros_like(scale)
        group = 16
    else:
        return None
    scale, offset = scale.reshape(n_out, -1), offset.reshape(n_out, -1)
    if weight is None:
        weight = dequantize(raw, ggml_type, shape)
    codes = np.empty(shape, np.int16)
    if not quantized._encode(np.ascontiguousarray(weight, dtype=np.float32), scale,
                             np.repeat(offset, group // 16, axis=1), group, codes):
        return None
    return codes, scale, offset, group


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
