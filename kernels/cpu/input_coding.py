"""The two-level 8-bit coding of a product's input rows (kernels/cpu/int8_matmul.py), in LLVM IR.

Per group of 32 (or 16) inputs, with d = max|x| / 127 and inv = 127 / max|x| (both 0 for
a group whose max|x| is below 2**-100): level 0 q0 = round_half_even(x * inv), as ggml codes
activations (quantize_row_q8_0, but d kept in float32), and level 1 what that leaves in
steps of d / 254, q1 = round_half_even((x - d * q0) * (inv * 254)): the rest is at most
half a step of level 0 (and float32's rounding), so q1 stays within +-127 (clamped there
all the same). 254, not 256: with 256 every input within 1/256 of a tie of level 0's
rounding (0.4 % of them) would need 128 and lose a step. One step for both,
x ~ (d / 254) * (254 * q0 + q1), lets a product add the two levels' integer sums before
converting them once. Stored: the codes, the step d / 254, the code sum 254 * sum(q0) +
sum(q1), and s, the float32 sum of the group's inputs (summed as a tree of halves:
v[0:16] + v[16:32], then 8, 4, 2, 1 lanes). Every product codes its input with this, the
replayed decode pass too, so the two agree bit for bit.

Written as vectors (one or two 16-float registers a group) because numba compiled the same
loops to scalar code with a reference count per array view: on 2 cores of a Xeon
(Emerald Rapids) a 576-float row took 2.1-2.6 us that way and takes 0.44 us now (1536
floats: 5.3 -> 1.2 us); a decode step codes ~120 rows on each thread, ~0.35 ms of an
~8.5 ms SmolLM2 step before. LLVM splits the 16-lane vectors in two on AVX2.
"""
from __future__ import annotations

try:
    from llvmlite import ir
    from numba import njit, types
    from numba.core import cgutils
    from numba.core.errors import TypingError
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

LANES = 16
LEVEL_RATIO = 254          # level 1's step is level 0's over this
SMALLEST_MAX = 2.0 ** -100  # groups whose max|x| is below this are coded as zeros (127 / max overflows near 2**-126)


def available() -> bool:
    return njit is not None


if available():
    _F32x16 = ir.VectorType(ir.FloatType(), LANES)
    _I32x16 = ir.VectorType(ir.IntType(32), LANES)
    _I8x16 = ir.VectorType(ir.IntType(8), LANES)

    def splat(builder, value, vtype):
        """value in every lane of a vtype vector."""
        undef = ir.Constant(vtype, ir.Undefined)
        v = builder.insert_element(undef, value, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(ir.IntType(32), vtype.count),
                                                            [0] * vtype.count))

    def data_pointer(context, builder, aryty, ary, elem: ir.Type):
        """The array's data as a pointer to elem."""
        data = context.make_array(aryty)(context, builder, ary).data
        return builder.bitcast(data, elem.as_pointer())

    class _Emitter:
        """IR for the pieces of one group's coding, on its one or two 16-float vectors."""

        def __init__(self, builder):
            self.b = builder
            module, i32 = builder.module, ir.IntType(32)

            def declare(name, result, *args):
                return cgutils.get_or_insert_function(module, ir.FunctionType(result, list(args)), name)
            self.smax = declare("llvm.smax.v16i32", _I32x16, _I32x16, _I32x16)
            self.reduce_smax = declare("llvm.vector.reduce.smax.v16i32", i32, _I32x16)
            self.reduce_add = declare("llvm.vector.reduce.add.v16i32", i32, _I32x16)
            self.rint = declare("llvm.rint.v16f32", _F32x16, _F32x16)
            self.smin = declare("llvm.smin.v16i32", _I32x16, _I32x16, _I32x16)

        def abs_max(self, vectors):
            """max |v| over the group (on the bits: non-negative floats order as their integers)."""
            b = self.b
            mask = ir.Constant(_I32x16, [0x7FFFFFFF] * LANES)
            m = None
            for v in vectors:
                a = b.and_(b.bitcast(v, _I32x16), mask)
                m = a if m is None else b.call(self.smax, [m, a])
            return b.bitcast(b.call(self.reduce_smax, [m]), ir.FloatType())

        def scales(self, amax):
            """(d, inv) = (amax / 127, 127 / amax), or zeros for a group whose amax is below SMALLEST_MAX."""
            b = self.b
            f32 = ir.FloatType()
            coded = b.fcmp_ordered(">=", amax, f32(SMALLEST_MAX))
            return (b.select(coded, b.fdiv(amax, f32(127.0)), f32(0.0)),
                    b.select(coded, b.fdiv(f32(127.0), amax), f32(0.0)))

        def level(self, vectors, inv, q_ptr, clamp=False):
            """q = rint(v * inv) (with clamp: within +-127) stored as bytes at q_ptr; returns (the q as
            floats, sum of q)."""
            b = self.b
            inv_v = splat(b, inv, _F32x16)
            total = None
            qs = []
            for i, v in enumerate(vectors):
                q = b.call(self.rint, [b.fmul(v, inv_v)])
                qi = b.fptosi(q, _I32x16)
                if clamp:
                    qi = b.call(self.smax, [b.call(self.smin, [qi, ir.Constant(_I32x16, [127] * LANES)]),
                                            ir.Constant(_I32x16, [-127] * LANES)])
                dst = b.bitcast(b.gep(q_ptr, [ir.Constant(ir.IntType(64), LANES * i)]), _I8x16.as_pointer())
                b.store(b.trunc(qi, _I8x16), dst, align=1)
                total = qi if total is None else b.add(total, qi)
                qs.append(q)
            return qs, b.call(self.reduce_add, [total])

        def tree_sum(self, vectors):
            b = self.b
            s = vectors[0]
            for v in vectors[1:]:
                s = b.fadd(s, v)
            width = LANES
            while width > 1:
                width //= 2
                lo = b.shuffle_vector(s, s, ir.Constant(ir.VectorType(ir.IntType(32), width), list(range(width))))
                hi = b.shuffle_vector(s, s, ir.Constant(ir.VectorType(ir.IntType(32), width),
                                                        list(range(width, 2 * width))))
                s = b.fadd(lo, hi)
            return b.extract_element(s, ir.Constant(ir.IntType(32), 0))

    @intrinsic
    def _code_rows(typingctx, x, qx, dx, sx, qsum, r0, r1, group):
        """Rows r0 <= r < r1 of x (float32 [rows, in], C order) coded into qx int8 [2, rows, in] (the
        levels' codes), dx float32 [rows, groups] (the step), sx float32 [rows, groups] (the sum),
        qsum int32 [rows, groups] (the combined code sum); group 16 or 32."""
        if any(a.layout != "C" for a in (x, qx, dx, sx, qsum)):
            raise TypingError("the input coding reads and writes C-contiguous arrays only")
        sig = types.void(x, qx, dx, sx, qsum, r0, r1, group)

        def codegen(context, builder, signature, args):
            at = signature.args
            x_a, qx_a, dx_a, sx_a, qs_a, r0_v, r1_v, group_v = args
            i64, f32 = ir.IntType(64), ir.FloatType()
            x_shape = cgutils.unpack_tuple(builder, context.make_array(at[0])(context, builder, x_a).shape)
            qx_shape = cgutils.unpack_tuple(builder, context.make_array(at[1])(context, builder, qx_a).shape)
            k_in, rows_total = x_shape[1], qx_shape[1]
            groups = builder.sdiv(k_in, group_v)
            x_p = data_pointer(context, builder, at[0], x_a, f32)
            qx_p = data_pointer(context, builder, at[1], qx_a, ir.IntType(8))
            dx_p = data_pointer(context, builder, at[2], dx_a, f32)
            sx_p = data_pointer(context, builder, at[3], sx_a, f32)
            qs_p = data_pointer(context, builder, at[4], qs_a, ir.IntType(32))
            q_level = builder.mul(rows_total, k_in)            # level stride of qx
            emit = _Emitter(builder)
            with cgutils.for_range_slice(builder, r0_v, r1_v, i64(1), inc=True) as (r, _):
                with cgutils.for_range(builder, groups) as g_loop:
                    g = g_loop.index
                    start = builder.add(builder.mul(r, k_in), builder.mul(g, group_v))
                    at_group = builder.add(builder.mul(r, groups), g)
                    with builder.if_else(builder.icmp_signed("==", group_v, i64(16))) as (one, two):
                        for branch, nv in ((one, 1), (two, 2)):
                            with branch:
                                vectors = [builder.load(builder.bitcast(
                                    builder.gep(x_p, [builder.add(start, i64(LANES * i))]), _F32x16.as_pointer()),
                                    align=4) for i in range(nv)]
                                d, inv = emit.scales(emit.abs_max(vectors))
                                q0, total0 = emit.level(vectors, inv, builder.gep(qx_p, [start]))
                                d_v = splat(builder, d, _F32x16)
                                rest = [builder.fsub(v, builder.fmul(d_v, q)) for v, q in zip(vectors, q0)]
                                _, total1 = emit.level(rest, builder.fmul(inv, f32(float(LEVEL_RATIO))),
                                                       builder.gep(qx_p, [builder.add(start, q_level)]), clamp=True)
                                total = builder.add(builder.mul(total0, ir.IntType(32)(LEVEL_RATIO)), total1)
                                builder.store(builder.fdiv(d, f32(float(LEVEL_RATIO))), builder.gep(dx_p, [at_group]))
                                builder.store(total, builder.gep(qs_p, [at_group]))
                                builder.store(emit.tree_sum(vectors), builder.gep(sx_p, [at_group]))
            return context.get_dummy_value()

        return sig, codegen

    @njit(nogil=True, cache=True)
    def quantize_row_range(x, group, qx, dx, sx, qsum, r0, r1):  # pragma: no cover - compiled
        """The two levels of rows r0 <= r < r1 (x, qx: C order; group 16 or 32): see _code_rows."""
        if group != 16 and group != 32:
            raise ValueError("groups of 16 or 32 inputs only")
        _code_rows(x, qx, dx, sx, qsum, r0, r1, group)

    @njit(nogil=True, cache=True)
    def quantize_two_levels(x, group, qx, dx, sx, qsum):  # pragma: no cover - compiled
        """Every row of x coded in two levels."""
        quantize_row_range(x, group, qx, dx, sx, qsum, 0, x.shape[0])
