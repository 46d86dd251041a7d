"""The byte dot products of kernels/cpu/int8_matmul.py's tile kernel, as LLVM IR builders.

Each takes 64-byte vectors of weight codes, [16 outputs, 4 inputs], and four input codes
(signed bytes, |q| <= 127) splat to every output, and sums per output the four byte products:

* VNNI: one `vpdpbusd` (unsigned codes) into 32-bit sums.
* AVX2, signed codes (Q8_0's): llama.cpp's sequence on each 32-byte half,
  vpmaddubsw(|code|, q * sign(code)) summed in pairs by vpmaddwd with ones.
* AVX2, unsigned codes: vpmaddubsw(code, q) added in 16 bits over a run of steps, then
  widened once by vpmaddwd (int8_weights.avx2_layout picks the run that cannot overflow).

The sums are exact integers whichever way they are taken.
"""
from __future__ import annotations

try:
    from llvmlite import ir
    from numba.core import cgutils
except ImportError:  # pragma: no cover - exercised only where numba is missing
    ir = None

if ir is not None:
    from kernels.cpu.input_coding import splat as _splat

    _I32x16 = ir.VectorType(ir.IntType(32), 16)
    _I8x32 = ir.VectorType(ir.IntType(8), 32)
    I16x16 = ir.VectorType(ir.IntType(16), 16)
    _I32x8 = ir.VectorType(ir.IntType(32), 8)

    def dot_vnni(module):
        """acc + per lane sum_k w[4 lane + k] * x[k] (w unsigned bytes, x signed): one vpdpbusd."""
        dpbusd = cgutils.get_or_insert_function(
            module, ir.FunctionType(_I32x16, [_I32x16] * 3), "llvm.x86.avx512.vpdpbusd.512")

        def prepare(builder, w):
            return w

        def dot(builder, acc, w, x4):
            return builder.call(dpbusd, [acc, w, _splat(builder, x4, _I32x16)])
        return prepare, dot

    def _avx2_ops(module):
        """vpmaddubsw, vpmaddwd, the ones vpmaddwd sums pairs with, and two helpers: a 64-byte
        vector's two 32-byte halves, and two 8 x i32 sums joined into one 16-lane vector."""
        maddubs = cgutils.get_or_insert_function(
            module, ir.FunctionType(I16x16, [_I8x32] * 2), "llvm.x86.avx2.pmadd.ub.sw")
        maddwd = cgutils.get_or_insert_function(
            module, ir.FunctionType(_I32x8, [I16x16] * 2), "llvm.x86.avx2.pmadd.wd")
        ones = ir.Constant(I16x16, [1] * 16)
        i32 = ir.IntType(32)

        def halves(builder, w):
            b = builder.bitcast(w, ir.VectorType(ir.IntType(8), 64))
            return [builder.shuffle_vector(b, b, ir.Constant(ir.VectorType(i32, 32), list(range(o, o + 32))))
                    for o in (0, 32)]

        def joined(builder, sums):
            return builder.shuffle_vector(sums[0], sums[1], ir.Constant(ir.VectorType(i32, 16), list(range(16))))
        return maddubs, maddwd, ones, halves, joined

    def _input_bytes(builder, x4):
        """Four input codes (one i32) in every 4-byte lane of a 32-byte vector."""
        return builder.bitcast(_splat(builder, x4, _I32x8), _I8x32)

    def dot_avx2(module):
        """The same sum with w signed, on two 32-byte halves: vpmaddubsw(|w|, x * sign(w)) summed in
        pairs by vpmaddwd (llama.cpp's mul_sum_i8_pairs)."""
        psign = cgutils.get_or_insert_function(module, ir.FunctionType(_I8x32, [_I8x32] * 2), "llvm.x86.avx2.psign.b")
        maddubs, maddwd, ones, halves, joined = _avx2_ops(module)

        def prepare(builder, w):
            """w's two halves as bytes, each with its absolute value (|-128| reads as 128 unsigned)."""
            return [(h, builder.call(psign, [h, h])) for h in halves(builder, w)]

        def dot(builder, acc, w, x4):
            x = _input_bytes(builder, x4)
            sums = [builder.call(maddwd, [builder.call(maddubs, [a, builder.call(psign, [x, h])]), ones])
                    for h, a in w]
            return builder.add(acc, joined(builder, sums))
        return prepare, dot

    def run_avx2(module):
        """For unsigned codes: each step's vpmaddubsw pair sums added in 16 bits (vpaddw) over a run of
        steps, widened once a run by vpmaddwd with ones; Int8Matrix.run keeps the sums in range."""
        maddubs, maddwd, ones, halves, joined = _avx2_ops(module)

        def add16(builder, acc16, half, x4):
            return builder.add(acc16, builder.call(maddubs, [half, _input_bytes(builder, x4)]))

        def widen(builder, acc, pair16):
            return builder.add(acc, joined(builder, [builder.call(maddwd, [a, ones]) for a in pair16]))
        return halves, add16, widen
