"""The operations a forward pass needs, one implementation set per device type.

Model files (worker/models/*.py) call only the methods of `Backend`; arrays are
whatever the backend's array type is (numpy on the CPU, CuPy on CUDA) and
support the ordinary arithmetic operators, reshape and indexing.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

Array = Any  # numpy.ndarray on the CPU backend, cupy.ndarray on CUDA


@dataclass(frozen=True)
class AttentionMetadata:
    """How the packed tokens of one forward split into sequences.

    Tokens are packed sequence after sequence; sequence i owns
    `query_lens[i]` consecutive rows, its new tokens sit at the end of a
    context of `context_lens[i]` tokens whose K/V live in the blocks listed by
    `block_tables[i]`.
    """
    query_lens: np.ndarray       # int64 [n_seqs]
    context_lens: np.ndarray     # int64 [n_seqs]
    block_tables: np.ndarray     # int32 [n_seqs, max_blocks], padded with 0
    slot_mapping: np.ndarray     # int64 [n_tokens]: block * block_size + offset for each new K/V
    causal: bool = True
    # some "sequences" are consecutive positions of one sequence (a verification chunk packed as
    # decode rows): each row's K/V must be stored before any row attends
    rows_share_sequences: bool = False
    # the same rows in the sliding-window layers' own pool (worker/kv_pool.py), where it has one:
    # their block tables and slots; None: those layers read and write through these
    windowed: AttentionMetadata | None = None

    def for_layer(self, window: int) -> AttentionMetadata:
        """The metadata a layer with this window (0: none) reads and writes its K/V through."""
        return self.windowed if window > 0 and self.windowed is not None else self

    @classmethod
    def for_decode(cls, context_lens: np.ndarray, block_tables: np.ndarray, slot_mapping: np.ndarray,
                   rows: np.ndarray | None = None, query_lens: np.ndarray | None = None,
                   rows_share_sequences: bool = False, windowed: AttentionMetadata | None = None
                   ) -> AttentionMetadata:
        """One new causal token per sequence (a decode step; block_tables and context_lens as int64,
        as decode_tables holds them), its derived tables filled in at once:
        each numpy call after a step's weight streams runs cold (a 1-element add: 24-38 us).
        `rows` (0, 1, ...) and `query_lens` (ones), where the caller made them with its other arrays.
        `rows_share_sequences`: rows at consecutive positions of one sequence, each with the block
        table of its sequence and its own context length (position + 1)."""
        rows = np.arange(len(context_lens)) if rows is None else rows
        query_lens = np.ones(len(rows), np.int64) if query_lens is None else query_lens
        meta = cls(query_lens, context_lens, block_tables.astype(np.int32), slot_mapping,
                   rows_share_sequences=rows_share_sequences, windowed=windowed)
        meta.__dict__.update(all_decode=True, row_starts=rows, decode_seqs=rows,
                             decode_tables=(rows, block_tables, context_lens))
        return meta

    @functools.cached_property
    def all_decode(self) -> bool:
        return bool(np.all(self.query_lens == 1))

    @property
    def decode_pass(self) -> bool:
        """Every row is one sequence's next causal token (Backend.begin_pass's `decode`)."""
        return self.causal and self.all_decode

    # Derived once per forward and shared by every layer's attention (cached on the instance).
    @functools.cached_property
    def row_starts(self) -> np.ndarray:
        """int64 [n_seqs]: the first packed row of each sequence."""
        return np.cumsum(self.query_lens) - self.query_lens

    @functools.cached_property
    def decode_seqs(self) -> np.ndarray:
        """Sequences whose one new token is a causal decode row."""
        return np.flatnonzero((self.query_lens == 1) & self.causal)

    @functools.cached_property
    def decode_tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(rows, block tables as contiguous int64, context lengths as int64) of the decode sequences."""
        seqs = self.decode_seqs
        return (self.row_starts[seqs], np.ascontiguousarray(self.block_tables[seqs], dtype=np.int64),
                np.ascontiguousarray(self.context_lens[seqs], dtype=np.int64))

    @functools.cached_property
    def row_tables(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(block table as int64, context length as int64, sequence) of every packed row, causal:
        the row at position p of its sequence sees p + 1 tokens."""
        seq_of_row = np.repeat(np.arange(len(self.query_lens)), self.query_lens)
        rows_before_end = np.arange(len(seq_of_row)) - (self.row_starts + self.query_lens)[seq_of_row]
        return (np.ascontiguousarray(self.block_tables[seq_of_row], dtype=np.int64),
                (self.context_lens[seq_of_row] + 1 + rows_before_end).astype(np.int64), seq_of_row)


class Backend(Protocol):
    name: str

    def warm_up(self) -> None:
        """Prepare compiled kernels before the first request (a no-op where there are none)."""
    def plan_weights(self, ggml_types: set[int]) -> None:
        """The GGML types of every matrix the model will prepare, before the first: a backend may
        pick its kernels for the whole model here (a no-op where that choice does not arise)."""
    def begin_pass(self, num_tokens: int, decode: bool = False) -> None:
        """A forward of `num_tokens` rows follows (or, from the runner before sampling, the logits
        product of that many rows); `decode`: every row is one sequence's next token. A backend
        may pick its kernels for the whole pass here (a no-op where that choice does not arise)."""
    def run_forward(self, model: Any, inp: Any) -> Array:
        """model.forward(inp) (worker/models): a backend may capture the pass's graph once per
        shape and replay it compiled, as the CPU backend does for decode passes of a few rows."""
    def run_logits(self, model: Any, inp: Any) -> tuple[Array, np.ndarray | None]:
        """model.logits(model.forward(inp)) (every row of the pass an output row), and each row's
        argmax where the backend computed it on the way (-1: a row with a NaN or infinite logit),
        else None."""
    def run_greedy_steps(self, model: Any, inp: Any, steps: int) -> np.ndarray | None:
        """Optional (the runner asks with getattr): `steps` greedy decode passes in one call, each
        taking the tokens of the one before one position on; int64 [steps, rows] (-1 from a row's
        NaN or infinite logits on), or None where the backend does not do this for `inp`."""
    def asarray(self, x: np.ndarray) -> Array: ...
    def to_numpy(self, x: Array) -> np.ndarray: ...
    def prepare_weight(self, w: np.ndarray, encoded: list[tuple[np.ndarray, int, tuple[int, int]]] | None = None
                       ) -> Any:
        """Take a float32 [out_features, in_features] matrix into the layout `matmul` wants.

        `encoded` lists the GGUF tensors w was decoded from (raw bytes, GGML type,
        [out, in] shape; stacked along out), for backends that multiply the
        quantized encoding directly."""
    def matmul(self, x: Array, w: Any) -> Array:
        """x [n, in] times the prepared weight -> [n, out]."""
    def rowwise_weight(self, w: Any) -> Any | None:
        """Optional (models ask with getattr): the prepared weight as one whose `matmul` gives each
        row exactly the result it gets alone, whatever rows share the call, or None where the
        backend has no such product (text-diffusion canvases packed into one forward)."""
    def head_stats(self, x: Array, w: Any, need_sum: bool, need_second: bool, need_entropy: bool
                   ) -> tuple[np.ndarray, ...] | None:
        """Optional (asked with getattr): per row of the logits x @ w, (argmax, max, exp(runner-up -
        max), sum(exp(l - max)), sum(exp(l - max) * (l - max))) without materializing them, each row
        as alone; None where the backend cannot for w (text-diffusion samplers at temperature 0)."""
    def prepare_embedding(self, raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> Any:
        """Take a (possibly quantized) [vocab, d_model] table as stored in the GGUF."""
    def embedding(self, table: Any, ids: np.ndarray) -> Array:
        """Rows `ids` of a prepared embedding table, float32 [len(ids), d_model]."""
    def rms_norm(self, x: Array, weight: Array, eps: float) -> Array: ...
    def rope(self, x: Array, positions: np.ndarray, base: float, n_dims: int, neox: bool) -> Array:
        """Rotate x [n, heads, head_dim] in place of the first n_dims dims, normal (adjacent pairs) or NeoX (halves)."""
    def alloc_kv(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 codec: str = "f16") -> tuple[Array, Array]:
        """K and V caches of one layer, holding values in `codec` (f16, q8_0 or q4_0)."""
    def store_kv(self, k_cache: Array, v_cache: Array, k: Array, v: Array, slot_mapping: np.ndarray) -> None: ...
    def copy_blocks(self, k_cache: Array, v_cache: Array, src: np.ndarray, dst: np.ndarray) -> None:
        """Blocks dst[i] of both caches take the contents of blocks src[i]."""
    def paged_attention(self, q: Array, k_cache: Array, v_cache: Array, meta: AttentionMetadata,
                        scale: float, window: int = 0) -> Array:
        """q [n, heads, d] -> [n, heads, d]; keys k with p - window < k <= p when window > 0."""
    def dense_attention(self, q: Array, k: Array, v: Array, seq_lens: np.ndarray, scale: float,
                        rows: np.ndarray | None = None) -> Array:
        """Non-causal attention of each packed sequence over its own rows' K/V [n, kv_heads, d]
        (text-diffusion canvases: recomputed every step, never stored in the pool); `rows`
        (non-decreasing): only those query rows' outputs."""
    def swiglu(self, gate: Array, up: Array) -> Array: ...
    def gelu_tanh_gate(self, gate: Array, up: Array) -> Array: ...
    def log_softmax(self, x: Array) -> Array: ...
    def top_k(self, x: Array, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Best-first (ids, values) of each row of x, as numpy."""


def get_backend(name: str = "cpu", device: int = 0, capability: tuple[int, int] | None = None) -> Backend:
    """The backend `name` (cpu, or cuda on CuPy's device `device` with the kernel variant of its compute
    capability, asked of CuPy where not given). Choosing one for a host (--backend auto) is the
    worker's: worker/placement.py; "auto" here is the CPU."""
    if name in ("cpu", "auto"):
        from kernels.cpu import CPUBackend
        return CPUBackend()
    if name == "cuda":
        from kernels.cuda.backend import CUDABackend
        from kernels.cuda.variants import for_capability
        if capability is None:
            import cupy
            cc = str(cupy.cuda.Device(device).compute_capability)     # '90' for sm_90
            capability = (int(cc[:-1]), int(cc[-1]))
        return CUDABackend(device=device, variant=for_capability(*capability))
    raise ValueError(f"unknown kernels backend {name!r} (available: cpu, cuda)")
