"""The sliding-window layers' own block tables (worker/kv_pool.py: a pool of their own where the model
mixes windowed and full layers): a step's chunks carry them beside the full layers' tables, and the
forward reads and writes those layers through the AttentionMetadata built here (its `windowed`)."""
from __future__ import annotations

import numpy as np

from kernels import AttentionMetadata
from shared.step import SeqChunk


def window_table(c: SeqChunk, block_size: int, end: int) -> np.ndarray:
    """The chunk's windowed-pool table covering `end` positions; blocks that have left the window (-1)
    read as block 0, which the attention never reaches (it starts at the window)."""
    if c.window_table is None:
        raise ValueError(f"sequence {c.seq_id}: the worker keeps its sliding-window layers in a pool of their "
                         "own and the chunk has no window_block_table")
    table = np.maximum(np.asarray(c.window_table), 0)
    if len(table) * block_size < end:
        raise ValueError(f"sequence {c.seq_id}: window block table has {len(table)} blocks, "
                         f"{-(-end // block_size)} needed for {end} tokens")
    return table


def chunks_meta(chunks: list[SeqChunk], block_size: int, query_lens: np.ndarray, context_lens: np.ndarray,
                positions: np.ndarray, causal: bool) -> AttentionMetadata:
    """A packed prefill-or-mixed pass's metadata in the windowed pool."""
    lists = [window_table(c, block_size, int(n)) for c, n in zip(chunks, context_lens)]
    tables = np.zeros((len(chunks), max(len(t) for t in lists)), np.int32)
    for i, t in enumerate(lists):
        tables[i, :len(t)] = t
    seq_index = np.repeat(np.arange(len(chunks)), query_lens)
    slots = tables[seq_index, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return AttentionMetadata(query_lens, context_lens, tables, slots, causal=causal)


def stack_tables(tables: list[np.ndarray]) -> np.ndarray:
    """Block tables, one per row, as one int64 array padded with block 0 (never read: past each
    row's context)."""
    if len(tables) == 1:
        return tables[0].astype(np.int64)[None]
    packed = np.zeros((len(tables), max(len(t) for t in tables)), np.int64)
    for i, t in enumerate(tables):
        packed[i, :len(t)] = t
    return packed


def decode_meta(tables: list[np.ndarray], positions: np.ndarray, context_lens: np.ndarray, rows: np.ndarray,
                ones: np.ndarray, block_size: int, rows_share_sequences: bool) -> AttentionMetadata:
    """A decode pass's metadata in the windowed pool: `tables`, one per row."""
    packed = stack_tables(tables)
    slots = packed[rows, positions // block_size] * block_size + positions % block_size
    return AttentionMetadata.for_decode(context_lens, packed, slots, rows=rows, query_lens=ones,
                                        rows_share_sequences=rows_share_sequences)
