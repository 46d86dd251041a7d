"""A step's chunks packed into the forward's input: token ids, positions, the attention's block
tables and slots (the windowed layers' own where the model has them), and the rows whose logits
are read. Decode steps, the common case, take a path of a few numpy calls."""
from __future__ import annotations

from typing import Callable

import numpy as np

from kernels import AttentionMetadata
from shared.step import SeqChunk
from worker import window_tables
from worker.models import ForwardInput


def pack(chunks: list[SeqChunk], block_size: int, causal: bool, windowed: bool,
         replays_decode_rows: Callable[[int, bool], bool] | None = None) -> tuple[ForwardInput, np.ndarray]:
    """The forward's input for a step's chunks and the rows whose logits are read. `windowed`: the
    model's sliding-window layers have a pool (and block tables) of their own;
    `replays_decode_rows(rows, verify)`: whether the backend replays a decode pass of that many rows."""
    if causal and not any(c.score_top_k for c in chunks):
        if all(len(c.token_ids) == 1 for c in chunks):
            return pack_decode(chunks, block_size, windowed)
        # drafts to verify: one decode row a position, when the backend replays such a pass
        # (kernel by kernel, the chunk is faster as a chunk)
        rows = sum(len(c.token_ids) for c in chunks)
        if (replays_decode_rows is not None and replays_decode_rows(rows, True)
                and all(len(c.token_ids) == 1 + c.num_draft and c.sample for c in chunks)):
            return pack_decode(chunks, block_size, windowed)
    return pack_chunks(chunks, block_size, causal, windowed)


def pack_chunks(chunks: list[SeqChunk], block_size: int, causal: bool,
                windowed: bool) -> tuple[ForwardInput, np.ndarray]:
    """Any chunks: prompt chunks, scored prompts, verifications, decodes."""
    bs = block_size
    token_ids = np.concatenate([np.asarray(c.token_ids, np.int64) for c in chunks])
    positions = np.concatenate([np.arange(c.start_pos, c.start_pos + len(c.token_ids)) for c in chunks])
    query_lens = np.array([len(c.token_ids) for c in chunks], np.int64)
    context_lens = np.array([c.start_pos + len(c.token_ids) for c in chunks], np.int64)
    max_blocks = max(len(c.block_table) for c in chunks)
    tables = np.zeros((len(chunks), max_blocks), np.int32)
    for i, c in enumerate(chunks):
        needed = -(-int(context_lens[i]) // bs)
        if len(c.block_table) < needed:
            raise ValueError(f"sequence {c.seq_id}: block table has {len(c.block_table)} blocks, "
                             f"{needed} needed for {context_lens[i]} tokens")
        tables[i, :len(c.block_table)] = c.block_table
    seq_index = np.repeat(np.arange(len(chunks)), query_lens)
    slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
    starts = np.cumsum(query_lens) - query_lens
    output_rows = np.concatenate([
        np.arange(s, s + q) if c.score_top_k else np.arange(s + q - 1 - c.num_draft, s + q)
        for c, s, q in zip(chunks, starts, query_lens)])
    window_meta = window_tables.chunks_meta(chunks, bs, query_lens, context_lens, positions, causal) \
        if windowed else None
    meta = AttentionMetadata(query_lens, context_lens, tables, slots, causal=causal, windowed=window_meta)
    return ForwardInput(token_ids, positions, meta, output_rows), output_rows


def pack_decode(chunks: list[SeqChunk], block_size: int, windowed: bool) -> tuple[ForwardInput, np.ndarray]:
    """pack for one token a chunk (the same arrays) in a few numpy calls: each runs cold after
    a step's weight streams (a 1-element add: 24-38 us), so the per-row columns are Python lists
    until one array holds them all, while block tables stay arrays (a list of a deep sequence's
    table would cost the host a step more the longer its context). A chunk of several tokens (a
    verification: its last token and drafts) becomes one decode row a position, each with its
    sequence's block table and its own context: the pass is then marked rows_share_sequences."""
    bs = block_size
    tables, columns, windows = [], [], []
    shared = False
    for c in chunks:
        table = np.asarray(c.block_table)
        end = c.start_pos + len(c.token_ids)
        if len(table) * bs < end:
            raise ValueError(f"sequence {c.seq_id}: block table has {len(table)} blocks, "
                             f"{-(-end // bs)} needed for {end} tokens")
        window = window_tables.window_table(c, bs, end) if windowed else None
        tokens = [int(t) for t in c.token_ids]
        shared = shared or len(tokens) > 1
        for j, token in enumerate(tokens):
            pos = c.start_pos + j
            block, offset = divmod(pos, bs)
            tables.append(table)
            if window is not None:
                windows.append(window)
            columns.append((pos, pos + 1, int(table[block]) * bs + offset, token, 1, len(columns)))
    tables = window_tables.stack_tables(tables)
    positions, context_lens, slots, token_ids, ones, rows = np.array(list(zip(*columns)), np.int64)
    meta = AttentionMetadata.for_decode(
        context_lens, tables, slots, rows=rows, query_lens=ones, rows_share_sequences=shared,
        windowed=window_tables.decode_meta(windows, positions, context_lens, rows, ones, bs, shared)
        if windows else None)
    return ForwardInput(token_ids, positions, meta, rows), rows
