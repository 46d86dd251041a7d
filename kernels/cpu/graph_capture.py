"""Capture of a model's forward as a program the CPU backend replays in one compiled call.

A decode step of a small model is ~300 kernel calls, 123 of them products (SmolLM2),
each product and attention a numba region of its own: run one call at a time from
Python, SmolLM2's step took 8.5 ms, replayed 6.0-6.3 ms (2 cores of a Xeon). As llama.cpp builds a graph per batch shape and its thread
pool walks it, the architecture file's own `forward` is run once with a
`GraphRecorder` in place of the backend: every kernels call it makes is written
down as an operation on [rows, width] float32 buffers, and
kernels/cpu/graph_replay.py runs that program on numba's threads in a single
region. The architecture stays written once; what the capture cannot replay
raises `Unsupported`, and that pass shape keeps the ordinary kernels.

A program depends only on the model and the pass's row count: token ids,
positions, block tables, slots and context lengths are read when it is replayed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# operations: (code, dst, a, b, c, i0, i1, i2, i3) in Program.ops, float parameters in Program.params
SCALE, ADD, RMS_NORM, MATMUL, ROPE, ATTENTION, SWIGLU, GELU_TANH_GATE = range(8)
PRIVATE, SHARED = 0, 1     # a buffer each thread computes for itself, or one the threads fill together


class Unsupported(Exception):
    """The forward did something a captured program cannot replay."""


@dataclass
class Program:
    rows: int
    ops: np.ndarray                   # int64 [n_ops, 9]
    params: np.ndarray                # float64 [n_ops, 2]
    values: np.ndarray                # int64 [n_values, 5]: space, offset, row stride, first column, width
    private_size: int                 # floats of each thread's private arena
    shared_size: int
    embedding: object                 # the table whose rows are the program's input (value 0)
    output: int                       # value id of the forward's result
    output_shape: tuple[int, ...]
    matrices: list = field(default_factory=list)     # Int8Matrix, by MATMUL's i0
    norms: list = field(default_factory=list)        # float32 [heads, d], by RMS_NORM's i0
    caches: list = field(default_factory=list)       # K and V of each attention, by ATTENTION's i0 (K at 2i)
    rope_bases: list = field(default_factory=list)   # (base, n_dims), by ROPE's i0
    max_in_features: int = 0
    max_groups: int = 0
    logits: bool = False                             # the output is the logits (model.logits captured too)


class Value:
    """A [rows, *inner] float32 view of one buffer of the program: the columns
    [col0, col0 + width) of every row."""

    def __init__(self, rec: "GraphRecorder", buffer: int, col0: int, shape: tuple[int, ...]):
        self.rec, self.buffer, self.col0, self.shape = rec, buffer, col0, tuple(shape)

    @property
    def width(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def id(self) -> int:
        return self.rec.value_id(self)

    def reshape(self, *shape) -> "Value":
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else tuple(shape)
        if -1 in shape:
            known = math.prod(s for s in shape if s != -1)
            shape = tuple(self.shape[0] * self.width // known if s == -1 else s for s in shape)
        if shape[0] != self.shape[0] or math.prod(shape) != math.prod(self.shape):
            raise Unsupported(f"reshape {self.shape} -> {shape} mixes rows")
        return Value(self.rec, self.buffer, self.col0, shape)

    def __getitem__(self, key) -> "Value":
        if isinstance(key, np.ndarray):       # a row gather: only the identity (every row wanted)
            if np.array_equal(key, np.arange(self.shape[0])):
                return self
            raise Unsupported("a gather of some rows")
        if not (isinstance(key, tuple) and len(key) == 2 and key[0] == slice(None) and isinstance(key[1], slice)):
            raise Unsupported(f"indexing with {key!r}")
        start, stop, step = key[1].indices(self.shape[1])
        if step != 1:
            raise Unsupported("a strided slice")
        inner = math.prod(self.shape[2:])
        return Value(self.rec, self.buffer, self.col0 + start * inner, (self.shape[0], stop - start) + self.shape[2:])

    def __add__(self, other: "Value") -> "Value":
        if not isinstance(other, Value) or other.shape != self.shape:
            raise Unsupported("an addition of other than two values of one shape")
        return self.rec.emit(ADD, self.shape, self, other)

    def __mul__(self, factor) -> "Value":
        if not isinstance(factor, (float, np.floating)):
            raise Unsupported("a product with other than a scalar")
        return self.rec.emit(SCALE, self.shape, self, params=(float(np.float32(factor)),))

    __rmul__ = __mul__


class GraphRecorder:
    """Stands in for the CPU backend during one `forward`, writing its calls down."""
    name = "capture"

    def __init__(self, rows: int, kv_caches: list[tuple[np.ndarray, np.ndarray]], positions=None, meta=None):
        self.rows, self.positions, self.meta = rows, positions, meta   # the pass's: read again at each replay
        self.buffers: list[tuple[int, int]] = []        # (space, width)
        self.values: list[tuple[int, int, int]] = []    # (buffer, col0, width)
        self.ops: list[tuple[list[int], tuple[float, ...]]] = []
        self.matrices: list = []
        self.norms: list[np.ndarray] = []
        self.rope_bases: list[tuple[float, int]] = []
        self.caches: list[np.ndarray] = []
        self.cache_index = {id(k): i for i, (k, _) in enumerate(kv_caches)}
        self.kv_caches = kv_caches
        self.pending_kv: dict[int, tuple[Value, Value, np.ndarray]] = {}
        self.embedding_table = None

    # --- bookkeeping -------------------------------------------------------------
    def buffer(self, space: int, shape: tuple[int, ...]) -> Value:
        self.buffers.append((space, math.prod(shape[1:])))
        return Value(self, len(self.buffers) - 1, 0, shape)

    def value_id(self, v: Value) -> int:
        key = (v.buffer, v.col0, v.width)
        if key not in self.values:
            self.values.append(key)
        return self.values.index(key)

    def emit(self, code: int, shape: tuple[int, ...], *args: Value, ints: tuple[int, ...] = (),
             params: tuple[float, ...] = (), space: int = PRIVATE, out: Value | None = None) -> Value:
        out = out if out is not None else self.buffer(space, shape)
        ids = [out.id] + [a.id for a in args]
        self.ops.append(([code] + ids + [0] * (4 - len(ids)) + list(ints) + [0] * (4 - len(ints)), params))
        return out

    # --- the kernels interface ---------------------------------------------------------
    def begin_pass(self, num_tokens: int, decode: bool = False) -> None:
        pass

    def embedding(self, table, ids: np.ndarray) -> Value:
        if self.embedding_table is not None:
            raise Unsupported("a second embedding lookup")
        self.embedding_table = table
        rows = self.buffer(SHARED, (self.rows, table.shape[1]))
        assert rows.id == 0              # the program's input, filled before each replay
        return rows

    def rms_norm(self, x: Value, weight: np.ndarray, eps: float) -> Value:
        d = x.shape[-1]
        self.norms.append(np.ascontiguousarray(weight, dtype=np.float32).reshape(-1, d))
        return self.emit(RMS_NORM, x.shape, x, ints=(len(self.norms) - 1, d), params=(float(eps),))

    def matmul(self, x: Value, w) -> Value:
        if getattr(w, "int8", None) is None:
            raise Unsupported("a matrix without 8-bit codes")
        m = w.int8
        if x.width != m.in_features:
            raise Unsupported(f"a product of {x.width} inputs with a matrix of {m.in_features}")
        index = next((i for i, known in enumerate(self.matrices) if known is m), None)
        if index is None:
            self.matrices.append(m)
            index = len(self.matrices) - 1
        padded = self.buffer(SHARED, (self.rows, m.n_tiles * 32))
        self.emit(MATMUL, padded.shape, x, ints=(index,), out=padded)
        return padded[:, 0:m.out_features]

    def rope(self, x: Value, positions: np.ndarray, base: float, n_dims: int, neox: bool) -> Value:
        if positions is not self.positions or len(x.shape) != 3:
            raise Unsupported("RoPE on other positions than the pass's")
        key = (float(base), int(n_dims))
        if key not in self.rope_bases:
            self.rope_bases.append(key)
        return self.emit(ROPE, x.shape, x, ints=(self.rope_bases.index(key), n_dims, int(bool(neox)), x.shape[2]))

    def _pool_of(self, meta) -> int | None:
        """0: the pass's metadata, 1: its windowed layers' pool (AttentionMetadata.windowed), None: other."""
        if meta is self.meta:
            return 0
        return 1 if meta is not None and meta is self.meta.windowed else None

    def store_kv(self, k_cache: np.ndarray, v_cache: np.ndarray, k: Value, v: Value, slot_mapping) -> None:
        pool = 0 if slot_mapping is self.meta.slot_mapping else \
            1 if self.meta.windowed is not None and slot_mapping is self.meta.windowed.slot_mapping else None
        if id(k_cache) not in self.cache_index or pool is None:
            raise Unsupported("a store into an unknown cache or other slots")
        self.pending_kv[id(k_cache)] = (k, v, v_cache, pool)

    def paged_attention(self, q: Value, k_cache: np.ndarray, v_cache: np.ndarray, meta, scale: float,
                        window: int = 0) -> Value:
        stored = self.pending_kv.pop(id(k_cache), None)
        pool = self._pool_of(meta)
        if pool is None or stored is None or stored[2] is not v_cache or stored[3] != pool:
            raise Unsupported("attention over a cache this pass did not store into")
        k, v = stored[:2]
        if q.col0 != 0 or len(q.shape) != 3:
            raise Unsupported("queries that do not start their buffer's rows")
        self.caches += [k_cache, v_cache]
        # ints: the cache, the window, and 1 where the block tables and slots are the windowed pool's
        return self.emit(ATTENTION, q.shape, q, k, v, ints=(len(self.caches) // 2 - 1, int(window), pool),
                         params=(float(scale),), space=SHARED)

    def swiglu(self, gate: Value, up: Value) -> Value:
        return self.emit(SWIGLU, gate.shape, gate, up)

    def gelu_tanh_gate(self, gate: Value, up: Value) -> Value:
        return self.emit(GELU_TANH_GATE, gate.shape, gate, up)

    # --- the result ------------------------------------------------------------------------
    def program(self, result: Value, logits: bool = False) -> Program:
        if not isinstance(result, Value) or self.embedding_table is None:
            raise Unsupported("a forward that returned something else than a captured value")
        if self.pending_kv:
            raise Unsupported("K/V stored but never attended")
        result_id = result.id
        offsets, sizes = [], [0, 0]
        for space, width in self.buffers:
            offsets.append(sizes[space])
            sizes[space] += -(-width * self.rows // 16) * 16         # 64-byte aligned starts
        values = np.array([(self.buffers[b][0], offsets[b], self.buffers[b][1], col0, width)
                           for b, col0, width in self.values], np.int64)
        ops = np.array([o for o, _ in self.ops], np.int64).reshape(-1, 9)
        params = np.array([list(p) + [0.0] * (2 - len(p)) for _, p in self.ops], np.float64).reshape(-1, 2)
        return Program(self.rows, ops, params, values, sizes[PRIVATE], sizes[SHARED], self.embedding_table,
                       result_id, result.shape, self.matrices, self.norms, self.caches, self.rope_bases,
                       max((m.in_features for m in self.matrices), default=0),
                       max((m.in_features // m.group for m in self.matrices), default=0), logits)


def capture(model, inp, logits: bool = False) -> Program:
    """Run model.forward(inp) against a recorder and return its program (raises Unsupported);
    with `logits`, model.logits of its result too (the program's output is then the logits)."""
    rec = GraphRecorder(len(inp.token_ids), model.kv_caches, inp.positions, inp.attention)
    with model.using_ops(rec):
        result = model.forward(inp)
        if logits:
            result = model.logits(result)
    return rec.program(result, logits)
