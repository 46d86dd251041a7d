"""Replay of a captured forward (kernels/cpu/graph_capture.py) in one numba parallel region.

Each of numba's threads walks the whole program. Products split their output
tiles between the threads, attention its (row, KV head) tasks; both write
buffers the threads share, and the threads meet (kernels/cpu/spin_barrier.py)
before anything reads them. Every other operation (norms, RoPE, residual adds,
gates) is cheap and computed by each thread for itself into its own arena,
which needs no meeting at all. Each operation calls the same compiled row
functions as the backend's kernels (the two-level input coding and VNNI tiles
of int8_matmul, elementwise's rows, decode attention's task), so a replayed
pass gives the numbers the ordinary kernels give.

The operations themselves, compiled inline into the region, are in
kernels/cpu/replay_ops.py (numba caches the region by this file alone: after editing
that one, or what it compiles in from the others (int8_matmul's tile kernels and ROWS,
elementwise's rows, decode attention's task), delete kernels/cpu/__pycache__'s .nbi/.nbc
files; a change to this file, as on 2026-12-03 when AVX2's ROWS went from 3 to 1 and on
2026-12-05 when AVX2's one-row products left the non-temporal hint and VNNI's on Intel took
both lines of a step, makes every checkout compile the region again).

A buffer is written once per replay (programs are small: 1.2 MB a row for
SmolLM2), so no thread can overwrite what the other still reads.

The region also decodes its input rows (Q8_0 embeddings: every thread the
same values), reads the RoPE angles of the pass's positions from the backend's
whole tables and copies the result out: each numpy call around a replay runs
with caches the weights just flushed, and the Python of Replay.run went from
171-186 us to 37-39 us a SmolLM2 step (the Zen 5 EPYC of docs/BENCHMARKS.md,
two runs each way in one slow phase of the host).
"""
from __future__ import annotations

import numpy as np

from kernels.cpu import addresses, elementwise, get_rows, int8_matmul, kv_codecs, spin_barrier
from kernels.cpu.graph_capture import (ADD, ATTENTION, GELU_TANH_GATE, MATMUL, RMS_NORM, ROPE, SCALE, SHARED,
                                       SWIGLU, Program, Unsupported)
# the tile claims' counters follow the barrier's words in a replay's sync array
from kernels.cpu.replay_ops import SYNC_CLAIMS

try:
    import numba
    from numba import njit, prange
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None


# A thread done with a product asks for the first 4 KiB of its share of the next one (and their
# scales) before it waits at the barrier: in-process A/Bs on a Zen 4 EPYC, Gemma 3 decode steps
# -3.6/-6.0/-5.0 %, SmolLM2 -5/-0.8 %; 8 KiB was as good for SmolLM2, 16 KiB worse.
NEXT_PRODUCT_PREFETCH = 4096
# A thread waiting at a meeting asks for up to this many bytes of its share of the next product
# (spin_barrier.meet): in-process A/Bs on a Zen 5 EPYC, SmolLM2 replays -2.6/-1.6/
# -0.9 %, Gemma 3 -0.0/-1.4/+0.3 % (128 KiB: SmolLM2 -2.0/-1.5, Gemma 3 -1.5/+0.8; 16-32 KiB less).
WAIT_PREFETCH = 65536


def available() -> bool:
    return njit is not None and int8_matmul.available()


def _address(a: np.ndarray) -> int:
    try:
        return addresses.address(a)
    except ValueError as e:
        raise Unsupported(str(e)) from None


def _table(rows: list[tuple[int, ...]], width: int) -> np.ndarray:
    return np.array(rows, np.int64).reshape(-1, width) if rows else np.zeros((1, width), np.int64)


def _matrix_table(matrices: list) -> np.ndarray:
    """int64 [matrices, 11]: the columns CODES.. of replay_ops."""
    return _table([(_address(m.codes), m.codes.size, _address(m.scale), m.scale.size, _address(m.offset),
                    m.offset.size, m.bias, m.group, m.n_tiles, m.in_features, m.run) for m in matrices], 11)


if available():
    _meet, _cycles, _embedding_row = spin_barrier.meet, spin_barrier.cycle_counter, get_rows.q8_0_row
    _rms_norm_row, _swiglu_row = elementwise.rms_norm_row, elementwise.swiglu_row
    _gelu_row = elementwise.gelu_tanh_gate_row
    _f32_2d = addresses.f32_2d
    from kernels.cpu.replay_ops import (_attention, _matmul, _meet_ahead, _merge_attention, _output,
                                        _prefetch_start, _rope, _row, _store_kv)

    @njit(parallel=True, cache=True, nogil=True)
    def _replay(ops, params, values, rows, n_threads, shared, private, sync, mats,
                norms, caches, rope_cos, rope_sin, tables, ctx, slots, window_tables, window_slots,
                x_s, qx_s, dx_s, sx_s, qsum_s, qbias_s, bits_s, next_matrix, prefetch_bytes,
                positions, token_ids, embedding, f16, output, result, wait_prefetch, greedy, best,
                stamps, steps, rows_share, partials):  # pragma: no cover
        """One decode pass, or with steps (int64 [n, rows], n > 1) n passes in a row: after each, the
        rows' greedy tokens are written to steps[s] and become the next pass's input one position on
        (its K/V slot from the block tables); a NaN or infinite logit (-1) ends the passes there.
        `rows_share`: some rows are positions of one sequence (a verification chunk's), each reading
        the K/V of those before it, so every attention stores all rows' K/V and meets first.
        `window_tables`, `window_slots`: the block tables and slots of the sliding-window layers' own
        pool, for the attentions marked so (ops[i, 7]); `tables` and `slots` where it has none.
        `partials`: float32 [rows, 4 * widest attention output], the states of rows whose keys an
        attention takes in two parts, merged after a meeting."""
        timed = stamps.shape[0] > 0     # stamps[th, 1 + i]: (op i starts, its meeting starts); see Replay.cycle_log
        n_steps = max(1, steps.shape[0])
        block_size = caches[0, 3] if caches.shape[0] > 0 and n_steps > 1 else 1
        for th in prange(n_threads):
            if timed:
                stamps[th, 0, 0] = _cycles()
            own = private[th]
            bits = bits_s[th]
            met = 0
            for s in range(n_steps):
                # the input rows from the Q8_0 table, decoded by every thread (the same values); an id
                # out of range is seen by all threads before any meeting, and all leave
                bad = False
                if embedding.shape[0] > 0:
                    n_rows = embedding.shape[0] // (values[0, 4] // 32 * 34)
                    for r in range(rows):
                        bad = bad or token_ids[r] < 0 or token_ids[r] >= n_rows
                    if bad:
                        sync[3] = 1
                    else:
                        for r in range(rows):
                            _embedding_row(embedding, token_ids[r], _row(values, 0, r, shared, own), f16)
                for i in range(0 if bad else ops.shape[0]):
                    code, dst, a, b = ops[i, 0], ops[i, 1], ops[i, 2], ops[i, 3]
                    if timed:
                        stamps[th, i + 1, 0] = stamps[th, i + 1, 1] = _cycles()
                    if code == MATMUL:
                        _matmul(i, i + s * ops.shape[0], ops, values, rows, th, n_threads, sync, shared, own, mats,
                                x_s, qx_s, dx_s, sx_s, qsum_s, qbias_s)
                        if prefetch_bytes > 0 and next_matrix[i] >= 0:
                            _prefetch_start(next_matrix[i], th, n_threads, mats, prefetch_bytes)
                        met += 1
                        if timed:
                            stamps[th, i + 1, 1] = _cycles()
                        if not _meet_ahead(sync, n_threads, met, next_matrix[i], th, mats, prefetch_bytes,
                                           wait_prefetch):
                            break
                    elif code == ATTENTION:
                        at_tables, at_slots = (window_tables, window_slots) if ops[i, 7] else (tables, slots)
                        if rows_share:
                            _store_kv(i, ops, values, rows, th, n_threads, shared, own, caches, at_slots)
                            met += 1
                            if not _meet(sync, n_threads, met, sync, 0, 0):
                                break
                        if _attention(i, ops, params, values, rows, th, n_threads, shared, own, caches,
                                      at_tables, ctx, at_slots, not rows_share, partials):
                            met += 1
                            if not _meet(sync, n_threads, met, sync, 0, 0):
                                break
                            _merge_attention(i, ops, values, rows, th, n_threads, shared, own, caches, ctx,
                                             partials)
                        met += 1
                        if timed:
                            stamps[th, i + 1, 1] = _cycles()
                        if not _meet_ahead(sync, n_threads, met, next_matrix[i], th, mats, 0, wait_prefetch):
                            break
                    elif code == ROPE:
                        _rope(i, ops, values, rows, shared, own, rope_cos, rope_sin, positions)
                    elif code == RMS_NORM:
                        weight, d = _f32_2d(norms, ops[i, 5]), ops[i, 6]
                        for r in range(rows):
                            src, out = _row(values, a, r, shared, own), _row(values, dst, r, shared, own)
                            for h in range(src.shape[0] // d):
                                _rms_norm_row(src[h * d:(h + 1) * d], weight[h % weight.shape[0]], params[i, 0],
                                              out[h * d:(h + 1) * d])
                    else:
                        for r in range(rows):
                            src, out = _row(values, a, r, shared, own), _row(values, dst, r, shared, own)
                            if code == SCALE:
                                factor = np.float32(params[i, 0])
                                for j in range(out.shape[0]):
                                    out[j] = src[j] * factor
                            elif code == ADD:
                                other = _row(values, b, r, shared, own)
                                for j in range(out.shape[0]):
                                    out[j] = src[j] + other[j]
                            elif code == SWIGLU:
                                _swiglu_row(src, _row(values, b, r, shared, own), out, bits)
                            elif code == GELU_TANH_GATE:
                                _gelu_row(src, _row(values, b, r, shared, own), out, bits)
                if timed:
                    stamps[th, ops.shape[0] + 1, 0] = stamps[th, ops.shape[0] + 1, 1] = _cycles()
                if bad or sync[1] != 0:
                    break
                _output(values, output, rows, th, n_threads, shared, own, result, best)
                met += 1
                if greedy.shape[0] > 0 and _meet(sync, n_threads, met, sync, 0, 0) and th == 0:
                    for r in range(rows):       # the row's first maximum (a lower share wins a tie)
                        pick, special = 0, best[0, r, 2]
                        for t in range(1, n_threads):
                            special = max(special, best[t, r, 2])
                            if best[t, r, 0] > best[pick, r, 0]:
                                pick = t
                        greedy[r] = -1 if special else int(best[pick, r, 1])
                    if n_steps > 1:             # the next pass's input: this one's tokens, one position on
                        for r in range(rows):
                            steps[s, r] = greedy[r]
                            token_ids[r] = greedy[r]
                            positions[r] += 1
                            ctx[r] += 1
                            slots[r] = tables[r, positions[r] // block_size] * block_size + positions[r] % block_size
                            window_slots[r] = (window_tables[r, positions[r] // block_size] * block_size
                                               + positions[r] % block_size)   # the same arrays where no pool
                if timed:
                    stamps[th, ops.shape[0] + 2, 0] = stamps[th, ops.shape[0] + 2, 1] = _cycles()
                if s + 1 < n_steps:
                    met += 1
                    if not _meet(sync, n_threads, met, sync, 0, 0):
                        break
                    stop = False
                    for r in range(rows):
                        stop = stop or steps[s, r] < 0
                    if stop:
                        break


class Replay:
    """A captured program with the buffers and weight lists its replays use."""

    def __init__(self, program: Program):
        p = self.program = program
        self.n_threads = numba.get_num_threads()
        rows, n = p.rows, self.n_threads
        self.shared = np.zeros(p.shared_size, np.float32)
        self.private = np.zeros((n, p.private_size), np.float32)
        self.sync = np.zeros(SYNC_CLAIMS + len(p.ops) * self.n_threads, np.int64)
        self.spin_limit = spin_barrier.SPIN_LIMIT
        k, groups = p.max_in_features, p.max_groups
        self.scratch = (np.zeros((n, rows * k), np.float32), np.zeros((n, 2 * rows * k), np.int8),
                        np.zeros((n, rows * groups), np.float32), np.zeros((n, rows * groups), np.float32),
                        np.zeros((n, rows * groups), np.int32), np.zeros((n, rows * groups), np.int32),
                        np.zeros((n, int(p.values[:, 4].max())), np.int32))
        attention_widths = [int(p.values[op[1], 4]) for op in p.ops if op[0] == ATTENTION]
        self.partials = np.zeros((rows, 4 * max(attention_widths, default=0)), np.float32)
        self.mats = _matrix_table(p.matrices)
        self.norms = _table([(_address(w), *w.shape) for w in p.norms], 3)
        self.caches = _table([(_address(kv_codecs.raw(c)), *kv_codecs.raw(c).shape, kv_codecs.codec_of(c))
                              for c in p.caches], 6)
        # for each product, the matrix of the next one (-1: none)
        self.next_matrix = np.full(len(p.ops), -1, np.int64)
        upcoming = -1
        for i in range(len(p.ops) - 1, -1, -1):
            self.next_matrix[i] = upcoming
            if p.ops[i, 0] == MATMUL:
                upcoming = p.ops[i, 5]
        self.prefetch_bytes = NEXT_PRODUCT_PREFETCH
        self.wait_prefetch = WAIT_PREFETCH
        table = p.embedding
        compiled = getattr(table, "compiled", False) and get_rows.supports(table.raw, table.ggml_type, table.shape)
        # Q8_0 rows: decoded in the replay
        self.embedding = _read_only(table.raw if compiled else np.zeros(0, np.uint8))
        self.result_shape = (rows, int(p.values[p.output, 4]))
        self.best = np.zeros((n, rows, 3), np.float64)      # each thread's (largest, where, NaN/inf) per row
        self.no_greedy = np.zeros(0, np.int64)
        self.no_stamps = np.zeros((0, 0, 2), np.int64)
        self.no_steps = np.zeros((0, 0), np.int64)
        # set to a list to profile: each run appends its cycle stamps (int64 [threads, ops + 3, 2]:
        # [th, 0] the region entered, [th, 1 + i] = (op i starts, its meeting starts: the op's end
        # for a product or attention, else its start), [th, ops + 1] the result's copy starts,
        # [th, ops + 2] the region's work ends); loadtest/profile_decode.py reads them
        self.cycle_log: list[np.ndarray] | None = None
        self.rope_cos = self.rope_sin = np.zeros((1, 1, 1), np.float32)
        self._rope_of: list[np.ndarray] = []

    @property
    def runs_steps(self) -> bool:
        """Whether run(steps > 1) is possible: a logits program that decodes its input rows itself."""
        return self.program.logits and self.embedding.shape[0] > 0

    def run(self, inp, backend, steps: int = 1) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The forward's result for `inp` and, for a program whose output is the logits, each row's
        first largest logit (-1 for a row with a NaN or infinite logit; else None); or None when the
        threads could not meet (the caller then runs the ordinary kernels, which write the same K/V
        again). With steps > 1 (runs_steps): `steps` greedy passes in one call, each taking the
        tokens of the one before, one position on (inp's arrays are advanced in place; block tables
        must cover every position); the second value is then int64 [steps, rows], each step's
        tokens, -1 from a row's NaN or infinite logits on (for every row after that step)."""
        p = self.program
        rows = p.rows
        step_tokens = self.no_steps
        rows_share = inp.attention.rows_share_sequences
        if steps > 1:
            if rows_share:
                raise ValueError("several steps in one call take one row a sequence")
            if not self.runs_steps:
                raise ValueError("this replayed program cannot run several steps in one call")
            need = SYNC_CLAIMS + steps * len(p.ops) * self.n_threads
            if self.sync.shape[0] < need:
                self.sync = np.zeros(need, np.int64)
            step_tokens = np.full((steps, rows), -1, np.int64)
        if self.embedding.shape[0] == 0:            # not Q8_0: the backend decodes the input rows
            start, width = int(p.values[0, 1]), int(p.values[0, 4])
            self.shared[start:start + rows * width] = backend.embedding(p.embedding, inp.token_ids).reshape(-1)
        meta = inp.attention
        tables, ctx = meta.decode_tables[1:]
        window_tables, window_slots = (meta.windowed.decode_tables[1], meta.windowed.slot_mapping) \
            if meta.windowed is not None else (tables, meta.slot_mapping)
        if p.rope_bases and p.caches:
            # a position is below its row's blocks * block size; the angles held serve every position below their size
            max_pos = tables.shape[1] * p.caches[0].shape[2]
            if max_pos >= self.rope_cos.shape[1]:
                self._rope_for(backend, max_pos)
        self.sync[:] = 0
        self.sync[2] = self.spin_limit
        result = np.empty(self.result_shape, np.float32)
        greedy = np.empty(rows, np.int64) if p.logits else self.no_greedy
        stamps = self.no_stamps
        if self.cycle_log is not None:
            stamps = np.zeros((self.n_threads, len(p.ops) + 3, 2), np.int64)
            self.cycle_log.append(stamps)
        _replay(p.ops, p.params, p.values, rows, self.n_threads, self.shared, self.private, self.sync,
                self.mats, self.norms, self.caches,
                self.rope_cos, self.rope_sin, tables, ctx, meta.slot_mapping, window_tables, window_slots,
                *self.scratch,
                self.next_matrix, self.prefetch_bytes, inp.positions, inp.token_ids, self.embedding, get_rows.F16,
                p.output, result, self.wait_prefetch, greedy, self.best, stamps, step_tokens, rows_share,
                self.partials)
        if self.sync[3]:
            backend.embedding(p.embedding, inp.token_ids)           # raises the IndexError that names the id
            raise IndexError(f"a token id of {inp.token_ids.tolist()} is out of the embedding's range")
        if self.sync[1]:
            return None
        if self.result_shape != p.output_shape:
            result = result.reshape(p.output_shape)
        if steps > 1:
            return result, step_tokens
        return result, (greedy if p.logits else None)

    def _rope_for(self, backend, max_pos: int) -> None:
        """self.rope_cos/sin: [base, position, n_dims // 2] for positions up to max_pos (the backend's
        tables, which it grows for longer contexts, stacked)."""
        tables = [backend.rope_table(base, n_dims, max_pos) for base, n_dims in self.program.rope_bases]
        if len(tables) != len(self._rope_of) or any(t[0] is not held for t, held in zip(tables, self._rope_of)):
            size = min(t[0].shape[0] for t in tables)
            self.rope_cos = np.ascontiguousarray(np.stack([t[0][:size] for t in tables]))
            self.rope_sin = np.ascontiguousarray(np.stack([t[1][:size] for t in tables]))
            self._rope_of = [t[0] for t in tables]


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view, as a GGUF file's memory map is: the region is compiled for one signature
    (warmed up with a writeable table, it was compiled again in a fresh checkout's first request: that
    request's prompt and decode step took 45.9 s on a Zen 3 EPYC)."""
    view = a.view()
    view.flags.writeable = False
    return view


def threading_layer() -> str:
    try:
        return numba.threading_layer()
    except ValueError:          # no parallel region has run yet
        return "unknown"


def warm_up() -> None:
    """Compile (or load from numba's cache) the replay kernel on a one-operation program (its
    tables of matrices, norms and caches: placeholder rows that the program never reads)."""
    if not available():
        return
    from kernels.cpu.graph_capture import PRIVATE
    n = numba.get_num_threads()
    ops = np.array([[SCALE, 1, 0, 0, 0, 0, 0, 0, 0]], np.int64)
    values = np.array([[SHARED, 0, 16, 0, 16], [PRIVATE, 0, 16, 0, 16]], np.int64)
    f32, i32 = np.zeros((n, 16), np.float32), np.zeros((n, 16), np.int32)
    tables = (np.zeros((1, 10), np.int64), np.zeros((1, 3), np.int64), np.zeros((1, 6), np.int64))
    rope = (np.zeros((1, 1, 8), np.float32), np.zeros((1, 1, 8), np.float32))
    attention = (np.zeros((1, 1), np.int64), np.ones(1, np.int64), np.zeros(1, np.int64))
    scratch = (f32, np.zeros((n, 16), np.int8), f32, f32, i32, i32, i32)
    sync = np.zeros(SYNC_CLAIMS + n, np.int64)
    sync[2] = spin_barrier.SPIN_LIMIT
    _replay(ops, np.ones((1, 2)), values, 1, n, np.ones(16, np.float32), np.zeros((n, 16), np.float32), sync,
            *tables, *rope, *attention, attention[0], attention[2], *scratch, np.full(1, -1, np.int64), 0,
            np.zeros(1, np.int64), np.zeros(1, np.int64), _read_only(np.zeros(0, np.uint8)), get_rows.F16, 1,
            np.zeros((1, 16), np.float32), 0, np.zeros(0, np.int64), np.zeros((n, 1, 3), np.float64),
            np.zeros((0, 0, 2), np.int64), np.zeros((0, 0), np.int64), False, np.zeros((1, 0), np.float32))
