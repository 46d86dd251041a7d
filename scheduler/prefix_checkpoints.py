"""Prefix checkpoints: full KV blocks saved to the block stores (scheduler/block_stores) in the
block format (scheduler/block_format.py), and restored, longest prefix first, into a worker's
pool, so that a prefix computed once, by any process, before any restart, is not prefilled again
while its blocks live in a store.

This is the part that moves blocks between a worker and the stores; when the engine saves and
restores them is scheduler/checkpoint_tier.py's.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Found:
    """A block read from a store, with its value (to copy it into the stores before that one)."""
    block: KVBlock
    value: bytes
    store: int              # index in PrefixCheckpoints.stores


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
        values = self.encode(layers, hashes, parents, token_ids)
        return sum(any([store.put(digest, value) for store in self.stores]) for digest, value in values)

    def encode(self, layers: Sequence[np.ndarray], hashes: Sequence[bytes], parents: Sequence[bytes | None],
               token_ids: Sequence[Sequence[int]]) -> list[tuple[bytes, bytes]]:
        """(hash, stored value) of each exported block (`layers`: one [2, kv_heads, blocks, ...]
        array a layer, as ExportBlocks gives them)."""
        values = []
        for i, digest in enumerate(hashes):
            block = KVBlock(self.geometry, digest, parents[i], tuple(int(t) for t in token_ids[i]),
                            tuple(np.ascontiguousarray(a[:, :, i]) for a in layers))
            values.append((digest, encode(block)))
        return values

    def find(self, hashes: Sequence[bytes]) -> list[KVBlock]:
        """The stored blocks of the longest prefix of `hashes` (each block from the first store that
        holds a valid one); a value that does not check out is a miss."""
        return [f.block for f in self.find_values(hashes)]

    def find_values(self, hashes: Sequence[bytes]) -> list[Found]:
        """As `find`, with each block's value and store: the stores are asked in order, each for
        the blocks the ones before it lacked."""
        found: list[Found] = []
        for index, store in enumerate(self.stores):
            wanted = list(hashes[len(found):])
            if not wanted:
                break
            for digest, value in zip(wanted, store.get_prefix(wanted)):
                block = self._check(store, digest, value)
                if block is None:
                    break
                found.append(Found(block, value, index))
        return found

    def restore(self, worker, block_ids: Sequence[int], blocks: Sequence[KVBlock]) -> None:
        """Imports found blocks into the given (free) blocks of `worker`'s pool."""
        if not blocks:
            return
        layers = [np.stack([b.layers[layer] for b in blocks], axis=2) for layer in range(self.geometry.n_layers)]
        worker.import_blocks(list(block_ids), layers)

    def _check(self, store: BlockStore, digest: bytes, value: bytes) -> KVBlock | None:
        try:
            block = decode(value, self.geometry)
        except BlockRejected as exc:
            self._reject(store, digest, str(exc))
            return None
        if block.block_hash != digest:
            self._reject(store, digest, "stored under another hash")
            return None
        return block

    def _reject(self, store: BlockStore, digest: bytes, reason: str) -> None:
        if not self.rejected[reason]:
            log.warning("a stored KV block was ignored and removed (%s store): %s; it is recomputed",
                        store.name, reason)
        self.rejected[reason] += 1
        store.discard(digest)
