"""The engine's side of prefix sharing: which cached blocks a new prompt starts from (in the pool,
or restored from the prefix checkpoint stores first), and registering the blocks a step fills so
later prompts can share them (and handing full prompt blocks to the checkpoint stores)."""
from __future__ import annotations

from scheduler.checkpoint_tier import CheckpointTier
from scheduler.kv_tables import KVTables
from scheduler.sequence import Sequence


class PrefixCache:
    def __init__(self, tables: KVTables, enabled: bool, checkpoints: CheckpointTier | None = None):
        self.tables = tables
        self.blocks, self.window = tables.blocks, tables.window
        self.enabled = enabled
        self.checkpoints = checkpoints if enabled else None
        self.restored_tokens = 0                       # since start: prompt tokens restored from the stores

    def lookup(self, seq: Sequence) -> tuple[list[int], tuple[int, int] | None]:
        """Cached blocks a new sequence can start from, leaving at least one token to compute (its
        logits are needed): its leading full blocks, and (block id, n) of a cached block after them
        whose first n tokens it shares. Nothing when every prompt position must be scored. The
        partial match is only sought after a full one: the first blocks of unrelated prompts share
        little more than a chat template's opening tokens."""
        if not self.enabled or seq.score_top_k:
            return [], None
        bs = self.blocks.block_size
        n_blocks = (seq.num_tokens - 1) // bs
        self.blocks.extend_hashes(seq.block_hashes, seq.token_view, n_blocks)
        hits = self.blocks.lookup(seq.block_hashes[:n_blocks])
        if self.checkpoints is not None and len(hits) < n_blocks and not seq.stores_checked:
            restored = self.checkpoints.restore_into_pool(self.blocks, seq, hits, n_blocks, self.window)
            if restored:
                self.restored_tokens += restored * bs
                hits = self.blocks.lookup(seq.block_hashes[:n_blocks])
        hits = self.tables.usable_hits(seq, hits)
        partial = None
        start = len(hits) * bs
        limit = min(bs - 1, seq.num_tokens - 1 - start)
        if hits and limit > 0:
            partial = self.tables.partial_usable(
                self.blocks.partial_lookup(seq.block_hashes[len(hits) - 1], seq.token_slice(start, start + limit)))
        return hits, partial

    def commit(self, seq: Sequence, computed: int) -> None:
        """Register the blocks filled by a step that computed up to `computed`, so later prompts
        can share them."""
        full = computed // self.blocks.block_size
        if full > seq.num_committed_blocks and self.enabled:
            self.blocks.extend_hashes(seq.block_hashes, seq.token_view, full)
            self.tables.commit(seq, full)
            seq.num_committed_blocks = full
            if self.checkpoints is not None:
                self.checkpoints.save_prompt_blocks(self.blocks, seq, full, self.window)

    def release_exported(self) -> None:
        """Drop the references held on blocks a checkpoint has finished exporting."""
        if self.checkpoints is not None:
            for held, window_held in self.checkpoints.released():
                self.blocks.free(held)
                if self.window is not None:
                    self.window.manager.free(window_held)
