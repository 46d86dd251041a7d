"""CPU implementation of the kernels interface: numpy/OpenBLAS in float32, numba-compiled
products over the GGUF's integer codes (8-bit integer products, see kernels/cpu/int8_matmul.py:
every product with AVX-512 VNNI, passes of a few rows with AVX2; else float products of a few
rows) and decode attention."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np

from kernels import AttentionMetadata, switches
from kernels.cpu import (attention, decode_attention, elementwise, get_rows, graph_capture, graph_replay, int8_matmul,
                         int8_weights, kv_codecs, logit_stats, quantized, row_matmul)
from kernels.cpu.arena import HugePageArena, resident_zeros
from kernels.cpu.int8_weights import Int8Matrix
from kernels.cpu.quantized import QuantizedMatrix
from kernels.cpu.row_matmul import RowMatrix
from shared.dequant import dequantize_rows


# Row counts in [5, 16) that are not a multiple of 8 are padded to one for sgemm: the
# products of every SmolLM2 matrix took 49 ms at 16 rows against 51-62 ms at 10-15, and
# 43 ms at 8 against 45-49 at 5-6 (OpenBLAS 0.3.31, 2 threads, AVX-512; padding 17-23
# rows to 24 was slower, so it stops at 16).
SGEMM_PADDED_ROWS = (5, 16)

# Decode passes of at most this many rows replay their captured forward in one compiled call
# (kernels/cpu/graph_capture.py): the row counts measured (tests/test_graph_replay.py); a
# replay's buffers grow with its rows (~1.2 MB a row for SmolLM2), and larger batches spend
# their step in the products rather than between them.
REPLAY_MAX_ROWS = 4
# A verification pass (speculative decoding: a sequence's last token and its drafts, packed as
# decode rows) replays up to this many rows: its alternative is a chunk run kernel by kernel,
# ~150 compiled calls whose overhead is what drafting must win back.
VERIFY_REPLAY_MAX_ROWS = 8

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class QuantizedRows:
    """An embedding table left in its GGUF encoding."""
    raw: np.ndarray
    ggml_type: int
    shape: tuple[int, int]
    compiled: bool = False       # decoded by kernels/cpu/get_rows.py (Q8_0)


@dataclass(frozen=True)
class Linear:
    """A weight matrix prepared for `matmul`: its 8-bit codes for the VNNI kernel, which then takes
    every product; else float32 [in, out] for sgemm plus its integer codes for few-row products
    (8-bit codes with AVX2, whose byte products are no faster than sgemm on a prompt's rows); or,
    from `rowwise_weight`, float32 tiles whose products compute each row alone (text diffusion)."""
    dense: np.ndarray | None
    codes: QuantizedMatrix | None
    int8: Int8Matrix | None = None
    rows: RowMatrix | None = None


class CPUBackend:
    name = "cpu"

    def __init__(self, quantized_matmul: bool | None = None, int8: bool | None = None) -> None:
        if quantized_matmul is None:     # TS_QUANTIZED_MATMUL=0: every product in float32 (OpenBLAS)
            quantized_matmul = switches.enabled(switches.QUANTIZED_MATMUL)
        if int8 is None:                 # TS_INT8_MATMUL=0: no 8-bit products, even where the CPU has VNNI
            int8 = switches.enabled(switches.INT8_MATMUL)
        self.quantized_matmul = quantized_matmul and quantized.available()
        self.int8_allowed = self.quantized_matmul and int8 and int8_matmul.available()
        self.int8_matmul = False        # set by plan_weights for a model whose every matrix has byte codes
        # AVX2: code bytes of the matrices that take the sign trick (Q8_0's, mostly), and of all
        self._compiled_pass: bool | None = None     # set by begin_pass; None: decided per call
        self._rope_tables: dict[tuple[float, int], tuple[np.ndarray, np.ndarray]] = {}
        self._rope_rows_of: dict[tuple[float, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        # TS_GRAPH_REPLAY=0: every pass calls the kernels one at a time
        self.graph_replay = switches.enabled(switches.GRAPH_REPLAY) and graph_replay.available()
        self._replays: dict[tuple[int, int, int, bool], graph_replay.Replay | None] = {}
        self._arena = HugePageArena()
        self._rowwise_ready = False

    def warm_up(self) -> None:
        """Compile the numba kernels now (a few seconds the first time, then from numba's cache)."""
        elementwise.warm_up()           # RMSNorm and SwiGLU are compiled wherever numba is
        get_rows.warm_up()
        kv_codecs.warm_up()             # every pass stores and prompt chunks may gather through it
        if self.quantized_matmul:
            quantized.warm_up()
            decode_attention.warm_up()
        if self.int8_matmul:
            int8_matmul.warm_up()
            if self.graph_replay:
                graph_replay.warm_up()

    def plan_weights(self, ggml_types: set[int]) -> None:
        """8-bit products only for a model whose every matrix has byte codes: one matrix on
        OpenBLAS would put both thread pools in every pass, and its rows would stop being
        computed alone (on 2 cores Gemma 3's mixed types made batched decode 4x slower)."""
        self.int8_matmul = self.int8_allowed and bool(ggml_types) and ggml_types <= int8_weights.BYTE_CODE_TYPES

    @property
    def products(self) -> str:
        """How this backend multiplies, for the worker's log."""
        if self._int8_everywhere:
            return "8-bit integers (%s, TS_INT8_MATMUL=0 turns them off)" % (
                "AVX-512 VNNI" if int8_matmul.VNNI else "AVX2")
        if self.quantized_matmul:
            return "float32 sgemm (OpenBLAS), quantized codes for passes of <= %d rows" % quantized.COMPILED_MAX_ROWS
        return "float32 sgemm (OpenBLAS)"

    def begin_pass(self, num_tokens: int, decode: bool = False) -> None:
        """Decide once per forward whether its products and decode attention run compiled (numba's
        threads) or on OpenBLAS, by the pass's token count: the last layer's FFN sees fewer rows
        than the pass (only those that need logits), and switching between the two thread pools
        inside a pass costs milliseconds while the other pool's threads spin. The runner calls it
        again for the logits product, the pass's last, by the rows it samples. When every matrix
        has 8-bit codes (VNNI or AVX2) no product uses OpenBLAS, and every pass is compiled: each
        row is then computed the same way whatever rows share its pass, so a prompt prefilled in
        chunks, a prefix restored from a checkpoint and a batch of prompts get what one pass
        alone gives. OpenBLAS's AVX2 sgemm kernels are not row-invariant (a row moves by an ulp
        with the call's row count, and the float16 KV cache turns that into ~1e-3 in logits), so
        AVX2 prompts no longer take sgemm even though it multiplies them faster (BENCHMARKS).
        """
        self._compiled_pass = self._compiled_for(num_tokens, decode)

    @property
    def _int8_everywhere(self) -> bool:
        return self.int8_matmul

    @property
    def decode_batches_in_int8(self) -> bool:
        """Whether decode passes of any size take the 8-bit products (each row then computed the
        same way whatever its batch): wherever the model's matrices have them."""
        return self.int8_matmul

    def _compiled_for(self, rows: int, decode: bool) -> bool:
        few = rows <= quantized.COMPILED_MAX_ROWS and (decode or not self.int8_matmul)
        return self.quantized_matmul and (few or self._int8_everywhere)

    def _compiled(self, rows: int) -> bool:
        """The pass's choice; a call outside a pass decides by its own rows, as a prompt's."""
        return self._compiled_pass if self._compiled_pass is not None else self._compiled_for(rows, False)

    def run_forward(self, model, inp) -> np.ndarray:
        """model.forward(inp), replayed from its captured program for decode passes of a few rows
        when every product is in 8-bit integers (one compiled call instead of ~300 kernel calls)."""
        replayed = self._replayed(model, inp, logits=False)
        return replayed[0] if replayed is not None else model.forward(inp)

    def run_logits(self, model, inp) -> tuple[np.ndarray, np.ndarray | None]:
        """model.logits(model.forward(inp)) and, for replayed decode passes, each row's argmax (the
        logits product and its argmax are the program's last operations: no second call, no cold
        numpy argmax after the weight streams; -1 marks a row with a NaN or infinite logit)."""
        replayed = self._replayed(model, inp, logits=True)
        if replayed is not None:
            return replayed
        hidden = model.forward(inp)
        self.begin_pass(hidden.shape[0], inp.attention.decode_pass)   # the logits product: by its own rows
        return model.logits(hidden), None

    def run_greedy_steps(self, model, inp, steps: int) -> np.ndarray | None:
        """`steps` greedy decode passes in one replayed call, each taking the tokens of the one
        before one position on (inp's arrays advance in place): int64 [steps, rows], -1 from a row's
        NaN or infinite logits on; None where the pass is not replayed (nothing was computed, or
        what was is written again by the caller's passes)."""
        out = self._replayed(model, inp, True, steps)
        return None if out is None else out[1]

    def _replayed(self, model, inp, logits: bool, steps: int = 1) -> tuple[np.ndarray, np.ndarray | None] | None:
        replay = self._replay_for(model, inp, logits)
        if replay is None or (steps > 1 and not replay.runs_steps):
            return None
        out = replay.run(inp, self, steps)
        if out is None:
            log.warning("numba's threads did not run the replayed decode pass together (threading layer %s): "
                        "replays are off from now on", graph_replay.threading_layer())
            self.graph_replay = False
        return out

    def replays_decode_rows(self, rows: int, rows_share_sequences: bool) -> bool:
        """Whether a decode pass of `rows` rows would be replayed from a captured program (where
        capture works for the model)."""
        limit = VERIFY_REPLAY_MAX_ROWS if rows_share_sequences else REPLAY_MAX_ROWS
        return self.graph_replay and self.int8_matmul and rows <= limit

    def _replay_for(self, model, inp, logits: bool) -> graph_replay.Replay | None:
        rows, meta = len(inp.token_ids), inp.attention
        if not (self.replays_decode_rows(rows, meta.rows_share_sequences) and meta.decode_pass
                and len(inp.output_rows) == rows):
            return None
        key = (id(model), rows, id(model.kv_caches[0][0]) if model.kv_caches else 0, logits)
        if key not in self._replays:
            try:
                self._replays[key] = graph_replay.Replay(graph_capture.capture(model, inp, logits))
            except graph_capture.Unsupported as e:
                log.info("decode passes of %d rows run kernel by kernel: %s", rows, e)
                self._replays[key] = None
        return self._replays[key]

    # --- arrays -----------------------------------------------------------
    def asarray(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x, dtype=np.float32)

    def to_numpy(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x)

    # --- linear algebra ------------------------------------------------------
    def prepare_weight(self, w: np.ndarray, encoded: list[tuple[np.ndarray, int, tuple[int, int]]] | None = None
                       ) -> Linear:
        # Stored [in, out]: OpenBLAS's sgemm is 20-40 % faster on 32- and 512-row
        # inputs in this layout than with a transposed [out, in] operand, and
        # equal on single rows (loadtest measurements, docs/BENCHMARKS.md).
        int8 = int8_matmul.from_parts(encoded, w) if encoded and self.int8_matmul else None
        if int8 is not None:
            place = self._arena.place
            int8 = dataclasses.replace(int8, codes=place(int8.codes), scale=place(int8.scale),
                                       offset=place(int8.offset))
            return Linear(None, None, int8)      # the 8-bit kernel takes every product: no float32 copy

        codes = quantized.quantize_parts(encoded, w) if encoded and self.quantized_matmul else None
        return Linear(np.ascontiguousarray(w.T, dtype=np.float32), codes)

    def rowwise_weight(self, w: Linear) -> Linear | None:
        """The weight as one whose products give each row the result it gets alone, whatever rows
        share the call (several diffusion canvases in one product), or None where there is no such
        product here. The 8-bit products are so already; a float32 matrix becomes tiles for
        kernels/cpu/row_matmul.py (its sgemm copy and few-row codes are dropped: every product of
        the matrix then takes the tiles)."""
        if w.rows is not None or (w.int8 is not None and w.dense is None):
            return w
        if w.dense is None or not row_matmul.available():
            return None
        if not self._rowwise_ready:      # a text-diffusion model: compile (or load) its kernels now
            row_matmul.warm_up()
            logit_stats.warm_up()
            attention.warm_up_dense()
            self._rowwise_ready = True
        return Linear(None, None, None, row_matmul.from_dense(w.dense))

    def head_stats(self, x: np.ndarray, w: Linear, need_sum: bool, need_second: bool, need_entropy: bool
                   ) -> tuple[np.ndarray, ...] | None:
        """The statistics a text-diffusion sampler reads off each row of the logits x @ w
        (kernels/cpu/logit_stats.py: argmax, max, exp(runner-up - max), sum of exps, entropy moment),
        computed without writing the logits out, each row as alone; None where w is not row tiles."""
        if w.rows is None or not logit_stats.available():
            return None
        return logit_stats.head_stats(x, w.rows, need_sum, need_second, need_entropy)

    def matmul(self, x: np.ndarray, w: Linear) -> np.ndarray:
        if w.rows is not None:
            return row_matmul.matmul(x, w.rows)
        if w.int8 is not None and (w.dense is None or self._compiled(x.shape[0])):
            return int8_matmul.matmul(x, w.int8)
        if w.codes is not None and self._compiled(x.shape[0]):
            return quantized.matmul(x, w.codes)
        rows = x.shape[0]
        if SGEMM_PADDED_ROWS[0] <= rows < SGEMM_PADDED_ROWS[-1] and rows % 8:
            # OpenBLAS multiplies 8 or 16 rows faster than 9-15 (or 5-7): pad with zero rows
            padded = np.zeros((-(-rows // 8) * 8, x.shape[1]), np.float32)
            padded[:rows] = x
            return (padded @ w.dense)[:rows]
        return x @ w.dense

    def prepare_embedding(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> QuantizedRows:
        if isinstance(raw, np.ndarray):
            raw = np.asarray(raw)               # an np.memmap's buffer as a plain array, not a copy
        shape = tuple(shape)
        return QuantizedRows(raw, ggml_type, shape, get_rows.supports(raw, ggml_type, shape))

    def embedding(self, table: QuantizedRows, ids: np.ndarray) -> np.ndarray:
        # rows are decoded from the memory-mapped GGUF on demand, as llama.cpp's get_rows does
        if table.compiled:
            rows = get_rows.q8_0_rows(table.raw, table.shape, ids)
            if rows is not None:
                return rows
        return dequantize_rows(table.raw, table.ggml_type, table.shape, ids)

    # --- element-wise ----------------------------------------------------------
    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        if elementwise.available():     # one compiled call instead of five numpy passes
            return elementwise.rms_norm(x, weight, eps)
        ms = np.einsum("...i,...i->...", x, x)[..., None]
        ms *= 1.0 / x.shape[-1]
        ms += eps
        np.sqrt(ms, out=ms)
        out = x / ms
        out *= weight
        return out

    def rope_table(self, base: float, n_dims: int, max_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin [size, n_dims // 2] of the rotation angles of positions 0..size-1, size > max_pos."""
        key = (float(base), n_dims)
        table = self._rope_tables.get(key)
        if table is None or table[0].shape[0] <= max_pos:
            size = max(4096, 1 << int(max_pos).bit_length())
            inv_freq = base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)
            angles = np.arange(size, dtype=np.float64)[:, None] * inv_freq[None, :]
            table = (np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
            self._rope_tables[key] = table
        return table

    def _rope_rows(self, positions: np.ndarray, base: float, n_dims: int) -> tuple[np.ndarray, np.ndarray]:
        """cos/sin rows of `positions`, kept for the next call with the same array (every layer of a pass)."""
        key = (float(base), n_dims)
        held = self._rope_rows_of.get(key)
        if held is None or held[0] is not positions:
            cos_t, sin_t = self.rope_table(base, n_dims, int(positions.max(initial=0)))
            held = (positions, cos_t[positions][:, None, :], sin_t[positions][:, None, :])
            self._rope_rows_of[key] = held
        return held[1], held[2]

    def rope(self, x: np.ndarray, positions: np.ndarray, base: float, n_dims: int, neox: bool) -> np.ndarray:
        cos, sin = self._rope_rows(positions, base, n_dims)
        if elementwise.available() and x.ndim == 3:
            return elementwise.rope(x, cos[:, 0], sin[:, 0], n_dims, neox)
        if neox:
            half = n_dims // 2
            x0, x1 = x[..., :half], x[..., half:n_dims]
        else:
            x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        r0 = x0 * cos - x1 * sin
        r1 = x0 * sin + x1 * cos
        out = x.copy() if n_dims < x.shape[-1] else np.empty_like(x)
        if neox:
            out[..., :half], out[..., half:n_dims] = r0, r1
        else:
            out[..., 0:n_dims:2], out[..., 1:n_dims:2] = r0, r1
        return out

    def swiglu(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if elementwise.available():
            return elementwise.swiglu(gate, up)
        # silu(g) * u = g * u / (1 + exp(-g)); exp overflows to inf for g < -88, which gives the right 0
        denom = np.negative(gate)
        with np.errstate(over="ignore"):
            np.exp(denom, out=denom)
        denom += 1.0
        out = gate * up
        out /= denom
        return out

    def gelu_tanh_gate(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        if elementwise.available():
            return elementwise.gelu_tanh_gate(gate, up)
        # 0.5 * g * (1 + tanh(sqrt(2/pi) * (g + 0.044715 g^3))) * u
        inner = gate * gate
        inner *= 0.044715 * 0.7978845608028654
        inner += 0.7978845608028654
        inner *= gate
        np.tanh(inner, out=inner)
        inner += 1.0
        inner *= gate
        inner *= up
        inner *= 0.5
        return inner

    def log_softmax(self, x: np.ndarray) -> np.ndarray:
        m = x.max(axis=-1, keepdims=True)
        shifted = x - m
        lse = np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
        shifted -= lse
        return shifted

    def top_k(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        k = min(k, x.shape[-1])
        idx = np.argpartition(-x, k - 1, axis=-1)[..., :k]
        vals = np.take_along_axis(x, idx, axis=-1)
        order = np.argsort(-vals, axis=-1, kind="stable")
        return np.take_along_axis(idx, order, axis=-1), np.take_along_axis(vals, order, axis=-1)

    # --- KV cache and attention ------------------------------------------------
    def alloc_kv(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 codec: str = "f16") -> tuple[np.ndarray, np.ndarray]:
        # [kv_heads, blocks, block_size, units] of the codec's values or ggml blocks (kv_codecs):
        # a block table's run of consecutive ids is one contiguous stretch of each KV head's rows
        if codec != "f16" and not kv_codecs.available():
            raise ValueError(f"--kv-cache-dtype {codec} needs numba's compiled kernels; use f16")
        shape = kv_codecs.pool_shape(codec, num_blocks, block_size, n_kv_heads, head_dim)
        dtype = kv_codecs.DTYPES[kv_codecs.number(codec)]
        return resident_zeros(shape, dtype), resident_zeros(shape, dtype)

    def store_kv(self, k_cache: np.ndarray, v_cache: np.ndarray, k: np.ndarray, v: np.ndarray,
                 slot_mapping: np.ndarray) -> None:
        # every pass stores what the pool's codec holds (llama.cpp's f16 cache by default)
        if kv_codecs.available():
            kv_codecs.store(k_cache, v_cache, k, v, slot_mapping)
            return
        n_kv, n_blocks, block_size, dim = k_cache.shape
        k_cache.reshape(n_kv, n_blocks * block_size, dim)[:, slot_mapping] = k.transpose(1, 0, 2)
        v_cache.reshape(n_kv, n_blocks * block_size, dim)[:, slot_mapping] = v.transpose(1, 0, 2)

    def copy_blocks(self, k_cache: np.ndarray, v_cache: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        k_cache[:, dst] = k_cache[:, src]
        v_cache[:, dst] = v_cache[:, src]

    def paged_attention(self, q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                        meta: AttentionMetadata, scale: float, window: int = 0) -> np.ndarray:
        return attention.paged_attention(q, k_cache, v_cache, meta, scale, window,
                                         compiled=self._compiled(q.shape[0]), rowwise=self._rowwise(q.shape[0]))

    def dense_attention(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, seq_lens: np.ndarray,
                        scale: float, rows: np.ndarray | None = None) -> np.ndarray:
        return attention.dense_attention(q, k, v, seq_lens, scale, rows)

    def _rowwise(self, rows: int) -> bool:
        """Passes whose products code each row in 8 bits alone: each row attends alone, with
        llama.cpp's rounding (queries and softmax in float16), so a row's result does not depend on
        the rows packed with it."""
        return self.int8_matmul
