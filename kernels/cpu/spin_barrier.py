"""A spinning barrier for the threads of one numba parallel region.

A replayed decode pass (kernels/cpu/graph_replay.py) runs on numba's threads as
one region, and its threads meet after each product instead of leaving and
re-entering a region per operation, as ggml's thread pool meets between graph
nodes. The barrier is a counter every thread increments once per meeting:
meeting k is passed when the counter reaches k * n_threads. A thread that
spins too long (its partner was never scheduled, as when numba's pool runs the
region's iterations one after another) raises the abort flag, every waiting
thread then gives up, and the caller falls back to the ordinary kernels.

sync: int64 [3] set before the region: [0] the counter and [1] the abort flag
zeroed, [2] how many spins make a thread give up (SPIN_LIMIT).
"""
from __future__ import annotations

try:
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

# ~0.2 s of `pause` (9.4 ns each, measured on the Xeon of docs/BENCHMARKS.md's 2026-12-01
# evening section): far beyond any step, short of a hung worker
SPIN_LIMIT = 20_000_000


def available() -> bool:
    return njit is not None


if available():
    def _slot(context, builder, aryty, ary, index):
        data = context.make_array(aryty)(context, builder, ary).data
        return builder.gep(data, [index])

    @intrinsic
    def atomic_add(typingctx, sync, index, value):
        """sync[index] += value atomically (sequentially consistent); returns the old value."""
        sig = types.int64(sync, index, value)

        def codegen(context, builder, signature, args):
            ptr = _slot(context, builder, signature.args[0], args[0], args[1])
            return builder.atomic_rmw("add", ptr, args[2], "seq_cst")

        return sig, codegen

    @intrinsic
    def atomic_load(typingctx, sync, index):
        """sync[index], read atomically (sequentially consistent)."""
        sig = types.int64(sync, index)

        def codegen(context, builder, signature, args):
            ptr = _slot(context, builder, signature.args[0], args[0], args[1])
            return builder.load_atomic(ptr, "seq_cst", 8)

        return sig, codegen

    @intrinsic
    def spin_pause(typingctx):
        """The x86 `pause` hint of a spin-wait loop."""
        sig = types.void()

        def codegen(context, builder, signature, args):
            fn = builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(fn, [])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def prefetch_l2(typingctx, array, index):
        """Hint that array[index]'s cache line be brought into L2."""
        sig = types.void(array, index)

        def codegen(context, builder, signature, args):
            ptr = _slot(context, builder, signature.args[0], args[0], args[1])
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = builder.module.declare_intrinsic("llvm.prefetch", fnty=ir.FunctionType(
                ir.VoidType(), [i8p, i32, i32, i32]))
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(2), i32(1)])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def cycle_counter(typingctx):
        """The CPU's time-stamp counter (rdtsc): cycles at a constant rate, for profiling a region."""
        sig = types.int64()

        def codegen(context, builder, signature, args):
            fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=ir.FunctionType(ir.IntType(64), []))
            return builder.call(fn, [])

        return sig, codegen

    @njit(inline="always")
    def meet(sync, n_threads, k, ahead, at, end):  # pragma: no cover - compiled
        """Meeting number k (1, 2, ...) of n_threads threads: True once all arrived, False if aborted.
        While it waits it asks for the bytes ahead[at:end] into L2, four lines a spin instead of a
        pause (at >= end: none): a thread that arrives first streams what it reads next."""
        if n_threads == 1:
            return True
        atomic_add(sync, 0, 1)
        target = k * n_threads
        spins = 0
        while atomic_load(sync, 0) < target:
            if atomic_load(sync, 1) != 0:
                return False
            spins += 1
            if spins > sync[2]:
                atomic_add(sync, 1, 1)
                return False
            if at < end:
                for _ in range(4):
                    if at < end:
                        prefetch_l2(ahead, at)
                    at += 64
            else:
                spin_pause()
        return True
