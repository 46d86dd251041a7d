"""The operations of a replayed decode pass (kernels/cpu/graph_replay.py), each compiled
inline into the one parallel region that runs the whole pass.

Products split their output tiles between the threads (each thread's contiguous share
taken from the front, what is left of the others' from their back), attention its
(row, KV head) tasks; the other operations are each thread's own. The row functions
they call are the backend's (int8_matmul's tiles and input coding, decode attention,
elementwise rows), so a replayed pass gives the numbers the ordinary kernels give.
numba's cache of the region is keyed on graph_replay.py alone: after editing this file,
delete the `.nbi`/`.nbc` files under kernels/cpu/__pycache__.
"""
from __future__ import annotations

import numpy as np

from kernels.cpu import (addresses, decode_attention, elementwise, input_coding, int8_matmul, key_parts, kv_codecs,
                         row_argmax, row_tile_attention, spin_barrier)
from kernels.cpu.graph_capture import SHARED

try:
    from numba import njit
except ImportError:  # pragma: no cover - exercised only where numba is missing
    njit = None

SYNC_CLAIMS = 4     # sync[:3] is the barrier's (spin_barrier.py), sync[3] a token id out of range; then
                    # each product's tiles taken, per share
CLAIM = 4           # tiles a thread takes at a time: 72-256 KiB of codes (twice that for one row,
                    # whose claim is read as two streams of tiles at once: 1-2 % a SmolLM2 decode step on
                    # a Xeon whose cores each stream ~10 GB/s, in-process A/B; claims of 8 another ~1 %)

# columns of a replay's matrix table: each matrix's codes, scales and offsets (address, length) and layout
CODES, SCALE_AT, OFFSET_AT, BIAS, GROUP, N_TILES, IN_FEATURES, RUN = 0, 2, 4, 6, 7, 8, 9, 10
# columns of its cache table: each cache's bytes (address, then kv_heads, blocks, block_size, row bytes)
# and its codec (kv_codecs' number)
CACHE_CODEC = 5


if njit is not None and int8_matmul.available():
    _tile_block, _tile_one = int8_matmul._tile_rows_block, int8_matmul._tile_rows1
    _tile_pair = int8_matmul._tile_pair1
    # Two tiles read at once only with VNNI: AVX2's kernel holds twice the accumulators (16-bit runs
    # beside the 32-bit sums), and paired it spills them: one thread over a 512x576 matrix in cache
    # multiplied 43-48 GB/s of 4-bit codes alone, 40-41 paired (Q8_0's signed codes: 31-33 and 27)
    _PAIR_TILES = int8_matmul.VNNI
    _quantize, _ROWS, _TILE = input_coding.quantize_two_levels, int8_matmul.ROWS, int8_matmul.TILE
    _meet, _round_to_half, _attend = spin_barrier.meet, elementwise.round_to_half, decode_attention.attend
    _attend_rows = row_tile_attention.attend_rows
    _attend_part, _merge_parts = decode_attention.attend_part, key_parts.merge_parts
    _split_point = key_parts.split_point
    _encode_row, _values_in = kv_codecs.encode_row, kv_codecs.values_in
    _atomic_add, _prefetch = spin_barrier.atomic_add, spin_barrier.prefetch_l2
    _u8, _f32, _u8_4d = addresses.u8, addresses.f32, addresses.u8_4d
    _copy_with_argmax = row_argmax.copy_with_argmax

    @njit(inline="always")
    def _row(values, v, r, shared, own):  # pragma: no cover - compiled
        start = values[v, 1] + r * values[v, 2] + values[v, 3]
        if values[v, 0] == SHARED:
            return shared[start:start + values[v, 4]]
        return own[start:start + values[v, 4]]

    @njit(inline="always")
    def _whole(values, v, rows, shared, own):  # pragma: no cover - compiled
        """The buffer under value v, [rows * row stride]."""
        start = values[v, 1]
        if values[v, 0] == SHARED:
            return shared[start:start + rows * values[v, 2]]
        return own[start:start + rows * values[v, 2]]

    @njit(inline="always")
    def _matmul(i, claims, ops, values, rows, th, n_threads, sync, shared, own, mats,
                x_s, qx_s, dx_s, sx_s, qsum_s, qbias_s):  # pragma: no cover - compiled
        """Operation i; `claims`: its row of tile counters in sync (i, or i + step * ops in a multi-step call)."""
        w = ops[i, 5]
        bias, group, n_tiles, k_in = mats[w, BIAS], mats[w, GROUP], mats[w, N_TILES], mats[w, IN_FEATURES]
        run = mats[w, RUN]
        groups = k_in // group
        x = x_s[th, :rows * k_in].reshape((rows, k_in))
        for r in range(rows):
            src = _row(values, ops[i, 2], r, shared, own)
            for j in range(k_in):
                x[r, j] = src[j]
        qx = qx_s[th, :2 * rows * k_in].reshape((2, rows, k_in))
        dx = dx_s[th, :rows * groups].reshape((rows, groups))
        sx = sx_s[th, :rows * groups].reshape((rows, groups))
        qsum = qsum_s[th, :rows * groups].reshape((rows, groups))
        qbias = qbias_s[th, :rows * groups].reshape((rows, groups))
        _quantize(x, group, qx, dx, sx, qsum)
        for r in range(rows):
            for g in range(groups):
                qbias[r, g] = qsum[r, g] * np.int32(bias)
        dst = ops[i, 1]
        out = shared[values[dst, 1]:values[dst, 1] + rows * values[dst, 2]].reshape((rows, values[dst, 2]))
        full = rows // _ROWS * _ROWS
        w_codes, w_scale, w_offset = _u8(mats, w, CODES), _f32(mats, w, SCALE_AT), _f32(mats, w, OFFSET_AT)
        # Each thread owns a contiguous share of the tiles and takes it from the front, CLAIM tiles
        # at a time; a thread done with its own takes what is left of the others' from their back.
        # sync[SYNC_CLAIMS + claims * n_threads + share] counts the tiles of a share taken from either end.
        for k in range(n_threads):
            share = (th + k) % n_threads
            lo, hi = n_tiles * share // n_threads, n_tiles * (share + 1) // n_threads
            counter = SYNC_CLAIMS + claims * n_threads + share
            taken_here = 0
            claim = 2 * CLAIM if rows == 1 else CLAIM
            while True:
                before = _atomic_add(sync, counter, claim)
                if before >= hi - lo:
                    break
                count = min(claim, hi - lo - before)
                first = lo + taken_here if k == 0 else hi - taken_here - count
                taken_here += count
                pairs = count // 2 if rows == 1 and _PAIR_TILES else 0     # one row: the claim read as two streams
                for j in range(pairs):
                    _tile_pair(w_codes, qx, dx, sx, qbias, w_scale, w_offset, out, first + j, first + pairs + j,
                               0, group, run)
                for t in range(first + 2 * pairs, first + count):
                    for r0 in range(0, full, _ROWS):
                        _tile_block(w_codes, qx, dx, sx, qbias, w_scale, w_offset, out, t, r0, group, run)
                    for r0 in range(full, rows):
                        _tile_one(w_codes, qx, dx, sx, qbias, w_scale, w_offset, out, t, r0, group, run)

    @njit(inline="always")
    def _attention(i, ops, params, values, rows, th, n_threads, shared, own, caches, tables, ctx,
                   slots, store, partials):  # pragma: no cover - compiled
        """Each thread takes a contiguous share of the (row, query head) pairs (split by KV heads,
        one thread did all of Gemma 3's attention: it has one) and, with `store`, stores the K/V
        its heads need in the pool's codec as the backend's stores code them (a KV head split
        between the threads is stored by both, each writing only the final values); the queries
        are rounded to float16 too, as the rowwise kernels do. Without `store` the rows' K/V were
        stored by _store_kv before a meeting (rows of one sequence read each other's), and the rows
        a thread takes whole go to attend_rows in runs whose block tables agree (a verification
        chunk's positions): each block decoded once for the run, each row's result attend's.
        With `store`, where a row sees enough keys to take them in two parts (decode_attention's
        split_point), its parts are tasks of their own, their states left in `partials` for
        _merge_attention after a meeting; returns whether it did so."""
        dst, q_v, k_v, v_v = ops[i, 1], ops[i, 2], ops[i, 3], ops[i, 4]
        k_cache, v_cache = _u8_4d(caches, 2 * ops[i, 5]), _u8_4d(caches, 2 * ops[i, 5] + 1)
        codec = caches[2 * ops[i, 5], CACHE_CODEC]
        n_kv, block_size, dim = k_cache.shape[0], k_cache.shape[2], _values_in(codec, k_cache.shape[3])
        q = _whole(values, q_v, rows, shared, own).reshape((rows, values[q_v, 2] // dim, dim))
        out = _whole(values, dst, rows, shared, own).reshape((rows, values[dst, 2] // dim, dim))
        n_heads = out.shape[1]
        group = n_heads // n_kv
        task, end = rows * n_heads * th // n_threads, rows * n_heads * (th + 1) // n_threads
        scale, window = np.float32(params[i, 0]), ops[i, 6]
        if store and _splits_any(rows, ctx, window, block_size):
            _attend_parts(th, n_threads, q, out, k_cache, v_cache, codec, tables, ctx, scale, window, rows, n_heads,
                          group, dim, block_size, slots, values, k_v, v_v, shared, own, partials)
            return True
        whole_lo = whole_hi = task                                   # the tasks of rows taken whole
        first, last = -(-task // n_heads), end // n_heads
        if not store and last - first > 1:
            whole_lo, whole_hi = first * n_heads, last * n_heads
            for b in range(first, last):
                for h in range(n_heads):
                    _round_to_half(q[b, h])
            b0 = first
            while b0 < last:
                b1, n_max = b0 + 1, ctx[b0]
                while b1 < last:
                    need = (max(n_max, ctx[b1]) + block_size - 1) // block_size
                    if not _same_blocks(tables, b0, b1, 0, need) or \
                            not _rows_same_blocks(tables, b0, b1, (n_max + block_size - 1) // block_size, need):
                        break
                    n_max = max(n_max, ctx[b1])
                    b1 += 1
                for kv in range(n_kv):
                    _attend_rows(q, k_cache, v_cache, codec, tables[b0], ctx, scale, window, True, out,
                                 b0, b1, kv, 0, group)
                b0 = b1
        for part in range(2):
            task, stop = (task, whole_lo) if part == 0 else (whole_hi, end)
            _attend_tasks(task, stop, q, out, k_cache, v_cache, codec, tables, ctx, scale, window, n_heads,
                          group, dim, block_size, store, slots, values, k_v, v_v, shared, own)
        return False

    @njit(inline="always")
    def _splits_any(rows, ctx, window, block_size):  # pragma: no cover - compiled
        for b in range(rows):
            if _split_point(ctx[b], window, block_size) >= 0:
                return True
        return False

    @njit(inline="always")
    def _attend_parts(th, n_threads, q, out, k_cache, v_cache, codec, tables, ctx, scale, window, rows, n_heads,
                      group, dim, block_size, slots, values, k_v, v_v, shared, own, partials):  # pragma: no cover
        """The tasks of a pass where some rows take their keys in two parts: (row, query head) for
        the others, (row, part, query head) for those, each thread a contiguous share. A part's
        state goes to partials[row]: [part, head, dim] weighted values, then [part, head] maxima,
        then [part, head] totals. Only a row's second part, which reads its own position, stores
        its K/V."""
        width = n_heads * dim
        n_tasks = 0
        for b in range(rows):
            n_tasks += n_heads * (1 if _split_point(ctx[b], window, block_size) < 0 else 2)
        task, end = n_tasks * th // n_threads, n_tasks * (th + 1) // n_threads
        offset = 0
        for b in range(rows):
            if offset >= end:
                break
            mid = _split_point(ctx[b], window, block_size)
            count = n_heads * (1 if mid < 0 else 2)
            t, t_end = max(task, offset) - offset, min(end, offset + count) - offset
            offset += count
            if t >= t_end:
                continue
            if mid < 0:
                _attend_tasks(b * n_heads + t, b * n_heads + t_end, q, out, k_cache, v_cache, codec, tables, ctx,
                              scale, window, n_heads, group, dim, block_size, True, slots, values, k_v, v_v,
                              shared, own)
                continue
            lo = max(0, ctx[b] - window) if window > 0 else 0
            while t < t_end:
                part, h = t // n_heads, t % n_heads
                kv = h // group
                run_end = min(t_end, part * n_heads + (kv + 1) * group)
                n_g = run_end - t
                if part == 1:
                    block, at = slots[b] // block_size, slots[b] % block_size
                    _encode_row(_row(values, k_v, b, shared, own)[kv * dim:(kv + 1) * dim],
                                k_cache[kv, block, at], codec)
                    _encode_row(_row(values, v_v, b, shared, own)[kv * dim:(kv + 1) * dim],
                                v_cache[kv, block, at], codec)
                for g in range(h, h + n_g):
                    _round_to_half(q[b, g])
                row = partials[b]
                acc = row[part * width + h * dim:part * width + (h + n_g) * dim].reshape((n_g, dim))
                maxes = row[2 * width + part * n_heads + h:2 * width + part * n_heads + h + n_g]
                totals = row[2 * width + (2 + part) * n_heads + h:2 * width + (2 + part) * n_heads + h + n_g]
                _attend_part(q, k_cache, v_cache, codec, tables[b], lo if part == 0 else mid,
                             mid if part == 0 else ctx[b], scale, True, b, kv, h, n_g, acc, maxes, totals)
                t = run_end

    @njit(inline="always")
    def _merge_attention(i, ops, values, rows, th, n_threads, shared, own, caches, ctx,
                         partials):  # pragma: no cover - compiled
        """The (row, query head) pairs of rows whose keys went in two parts (_attend_parts), each
        thread a contiguous share: their parts' states merged into the output."""
        dst, window = ops[i, 1], ops[i, 6]
        k_cache = _u8_4d(caches, 2 * ops[i, 5])
        dim, block_size = _values_in(caches[2 * ops[i, 5], CACHE_CODEC], k_cache.shape[3]), k_cache.shape[2]
        out = _whole(values, dst, rows, shared, own).reshape((rows, values[dst, 2] // dim, dim))
        n_heads = out.shape[1]
        width = n_heads * dim
        n_pairs = 0
        for b in range(rows):
            n_pairs += n_heads if _split_point(ctx[b], window, block_size) >= 0 else 0
        task, end = n_pairs * th // n_threads, n_pairs * (th + 1) // n_threads
        offset = 0
        for b in range(rows):
            if offset >= end or _split_point(ctx[b], window, block_size) < 0:
                continue
            row = partials[b]
            parts = row[:2 * width].reshape((2, width))
            for h in range(max(task, offset) - offset, min(end, offset + n_heads) - offset):
                _merge_parts(parts[:, h * dim:(h + 1) * dim], row[2 * width + h:2 * width + 2 * n_heads:n_heads],
                             row[2 * width + 2 * n_heads + h:2 * width + 4 * n_heads:n_heads], True, out[b, h])
            offset += n_heads

    @njit(inline="always")
    def _same_blocks(tables, b0, b, lo, hi):  # pragma: no cover - compiled
        for blk in range(lo, hi):
            if tables[b, blk] != tables[b0, blk]:
                return False
        return True

    @njit(inline="always")
    def _rows_same_blocks(tables, b0, b1, lo, hi):  # pragma: no cover - compiled
        """Rows b0 < b < b1 agree with b0 on blocks [lo, hi) too (a run grown to read them)."""
        for b in range(b0 + 1, b1):
            if not _same_blocks(tables, b0, b, lo, hi):
                return False
        return True

    @njit(inline="always")
    def _attend_tasks(task, end, q, out, k_cache, v_cache, codec, tables, ctx, scale, window, n_heads, group,
                      dim, block_size, store, slots, values, k_v, v_v, shared, own):  # pragma: no cover - compiled
        """The (row, query head) tasks [task, end), a call of attend per row and KV head they cover."""
        while task < end:
            b, h = task // n_heads, task % n_heads
            kv = h // group
            run_end = min(end, b * n_heads + (kv + 1) * group)      # this KV head's heads in row b
            if store:
                block, offset = slots[b] // block_size, slots[b] % block_size
                _encode_row(_row(values, k_v, b, shared, own)[kv * dim:(kv + 1) * dim],
                            k_cache[kv, block, offset], codec)
                _encode_row(_row(values, v_v, b, shared, own)[kv * dim:(kv + 1) * dim],
                            v_cache[kv, block, offset], codec)
            g0 = h - kv * group
            g1 = g0 + run_end - task
            for g in range(g0, g1):
                _round_to_half(q[b, kv * group + g])
            _attend(q, k_cache, v_cache, codec, tables[b], ctx[b], scale, window, True, out, b, kv, g0, g1)
            task = run_end

    @njit(inline="always")
    def _store_kv(i, ops, values, rows, th, n_threads, shared, own, caches, slots):  # pragma: no cover - compiled
        """The K/V rows of attention operation i, each (row, KV head) stored by one thread (its
        contiguous share of them): the first phase of a pass whose rows share a sequence (a
        verification chunk's drafted positions), whose attention then meets before reading them."""
        k_v, v_v = ops[i, 3], ops[i, 4]
        k_cache, v_cache = _u8_4d(caches, 2 * ops[i, 5]), _u8_4d(caches, 2 * ops[i, 5] + 1)
        codec = caches[2 * ops[i, 5], CACHE_CODEC]
        n_kv, block_size, dim = k_cache.shape[0], k_cache.shape[2], _values_in(codec, k_cache.shape[3])
        for task in range(rows * n_kv * th // n_threads, rows * n_kv * (th + 1) // n_threads):
            b, kv = task // n_kv, task % n_kv
            block, offset = slots[b] // block_size, slots[b] % block_size
            _encode_row(_row(values, k_v, b, shared, own)[kv * dim:(kv + 1) * dim], k_cache[kv, block, offset], codec)
            _encode_row(_row(values, v_v, b, shared, own)[kv * dim:(kv + 1) * dim], v_cache[kv, block, offset], codec)

    @njit(inline="always")
    def _rope(i, ops, values, rows, shared, own, rope_cos, rope_sin, positions):  # pragma: no cover - compiled
        base, n_dims, neox, head_dim = ops[i, 5], ops[i, 6], ops[i, 7], ops[i, 8]
        half = n_dims // 2
        for r in range(rows):
            src, dst = _row(values, ops[i, 2], r, shared, own), _row(values, ops[i, 1], r, shared, own)
            cos, sin = rope_cos[base, positions[r]], rope_sin[base, positions[r]]
            for h in range(src.shape[0] // head_dim):
                at = h * head_dim
                for j in range(half):
                    i0 = at + j if neox else at + 2 * j
                    i1 = i0 + half if neox else i0 + 1
                    x0, x1 = src[i0], src[i1]
                    dst[i0] = x0 * cos[j] - x1 * sin[j]
                    dst[i1] = x0 * sin[j] + x1 * cos[j]
                for j in range(n_dims, head_dim):
                    dst[at + j] = src[at + j]

    @njit(inline="always")
    def _prefetch_start(w, th, n_threads, mats, n_bytes):  # pragma: no cover - compiled
        """Ask for the first n_bytes of this thread's share of matrix w's codes (and its scales)."""
        n_tiles, k_in, group = mats[w, N_TILES], mats[w, IN_FEATURES], mats[w, GROUP]
        lo = n_tiles * th // n_threads
        w_codes, w_scale = _u8(mats, w, CODES), _f32(mats, w, SCALE_AT)
        start = lo * k_in * _TILE
        for at in range(start, min(start + n_bytes, w_codes.shape[0]), 64):
            _prefetch(w_codes, at)
        s0 = lo * (k_in // group) * _TILE
        for at in range(s0, min(s0 + n_bytes // 8, w_scale.shape[0]), 16):
            _prefetch(w_scale, at)

    @njit(inline="always")
    def _meet_ahead(sync, n_threads, met, w, th, mats, skip, n_bytes):  # pragma: no cover - compiled
        """Meeting number met, prefetching this thread's share of matrix w's codes from `skip` to
        `n_bytes` bytes into it while waiting (w < 0: a plain meeting)."""
        if w < 0 or n_bytes <= skip:
            return _meet(sync, n_threads, met, sync, 0, 0)
        n_tiles, k_in = mats[w, N_TILES], mats[w, IN_FEATURES]
        w_codes = _u8(mats, w, CODES)
        start = n_tiles * th // n_threads * k_in * _TILE
        end = min(start + n_bytes, n_tiles * (th + 1) // n_threads * k_in * _TILE)
        return _meet(sync, n_threads, met, w_codes, start + skip, end)

    @njit(inline="always")
    def _output(values, output, rows, th, n_threads, shared, own, result, best):  # pragma: no cover - compiled
        """This thread's share of the columns of the result rows, copied out; per row, best[th, r] =
        (its largest value, the first column that holds it, 1 if a value is NaN or infinite)."""
        width = values[output, 4]
        lo, hi = width * th // n_threads, width * (th + 1) // n_threads
        for r in range(rows):
            top, at, special = _copy_with_argmax(_row(values, output, r, shared, own)[lo:hi], result[r, lo:hi])
            best[th, r, 0], best[th, r, 1], best[th, r, 2] = top, lo + at, special
