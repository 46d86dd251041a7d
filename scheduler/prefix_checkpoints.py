"""Prefix checkpoints: full KV blocks saved to the block stores (scheduler/block_stores) in the
block format (scheduler/block_format.py), and restored, longest prefix first, into a worker's
pool, so that a prefix computed once, by any process, before any restart, is not prefilled again
while its blocks live in a store.

This is the part that moves blocks between a worker and the stores; which blocks the engine saves
and when it restores them is the engine's (not wired into the engine loop yet).
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import Sequence

import numpy as np

from scheduler.block_format import BlockRejected, Geometry, KVBlock, decode, encode
from scheduler.block_stores.base import BlockStore

log = logging.getLogger(__name__)


def geometry_of(description) -> Geometry:
    """A worker's K/V geometry from its DescribeResponse."""
    return Geometry(fingerprint=description.fingerprint, codec=description.kv_cache_dtype or "f32",
                    block_size=description.block_size, n_layers=description.n_layers,
                    kv_heads=description.kv_heads, head_dim=description.head_dim)


class PrefixCheckpoints:
    def __init__(self, stores: Sequence[BlockStore], geometry: Geometry):
        self.stores = list(stores)           # looked up in this order (the local directory before Redis)
        self.geometry = geometry
        self.rejected: Counter[str] = Counter()   # by reason: counted for /metrics, logged once each

    def save(self, worker, block_ids: Sequence[int], hashes: Sequence[bytes], parents: Sequence[bytes | None],
             token_ids: Sequence[Sequence[int]]) -> int:
        """Exports the blocks from `worker` (a WorkerClient) and writes each to every store;
        returns how many blocks at least one store took."""
        layers = worker.export_blocks(list(block_ids))
        saved = 0
        for i, digest in enumerate(hashes):
            block = KVBlock(self.geometry, digest, parents[i], tuple(int(t) for t in token_ids[i]),
                            tuple(np.ascontiguousarray(a[:, :, i]) for a in layers))
            value = encode(block)
            saved += any([store.put(digest, value) for store in self.stores])
        return saved

    def find(self, hashes: Sequence[bytes]) -> list[KVBlock]:
        """The stored blocks of the longest prefix of `hashes` (each block from the first store that
        holds a valid one); a value that does not check out is a miss."""
        found: list[KVBlock] = []
        for digest in hashes:
            block = self._find_one(digest)
            if block is None:
                break
            found.append(block)
        return found

    def restore(self, worker, block_ids: Sequence[int], blocks: Sequence[KVBlock]) -> None:
        """Imports found blocks into the given (free) blocks of `worker`'s pool."""
        if not blocks:
            return
        layers = [np.stack([b.layers[layer] for b in blocks], axis=2) for layer in range(self.geometry.n_layers)]
        worker.import_blocks(list(block_ids), layers)

    def _find_one(self, digest: bytes) -> KVBlock | None:
        for store in self.stores:
            value = store.get(digest)
            if value is None:
                continue
            try:
                block = decode(value, self.geometry)
            except BlockRejected as exc:
                reason = str(exc)
                if not self.rejected[reason]:
                    log.warning("a stored KV block was ignored (%s store): %s", store.name, reason)
                self.rejected[reason] += 1
                continue
            if block.block_hash == digest:
                return block
            self.rejected["stored under another hash"] += 1
        return None
