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

from scheduler.block_format import BlockRejected, Geometry, KVBlock, decode, encode, holds_nonfinite
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
        kv = worker.export_blocks(list(block_ids))
        values = self.encode(kv, hashes, parents, token_ids)
        return sum(any([store.put(digest, value) for store in self.stores]) for digest, value in values)

    def encode(self, kv: np.ndarray, hashes: Sequence[bytes], parents: Sequence[bytes | None],
               token_ids: Sequence[Sequence[int]]) -> list[tuple[bytes, bytes]]:
        """(hash, stored value) of each exported block (`kv`: [blocks, layers, 2, kv_heads,
        block_size, width], as ExportBlocks gives them: block i's slice is its payload)."""
        values = []
        for i, digest in enumerate(hashes):
            block = KVBlock(self.geometry, digest, parents[i], tuple(int(t) for t in token_ids[i]),
                            np.ascontiguousarray(kv[i], dtype=self.geometry.dtype).reshape(-1).view(np.uint8).data)
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

    def restore(self, worker, block_ids: Sequence[int], blocks: Sequence[KVBlock],
                window_ids: Sequence[int] | None = None) -> None:
        """Imports found blocks into the given (free) blocks of `worker`'s pool: their stored
        payloads, back to back, are the block-major array ImportBlocks takes (`window_ids`: the
        windowed layers' blocks, -1 where not kept)."""
        if not blocks:
            return
        g = self.geometry
        worker.import_blocks(list(block_ids), [b.payload for b in blocks], g.dtype,
                             (len(blocks), g.n_layers, *g.layer_shape),
                             window_ids=list(window_ids) if window_ids is not None else None)

    def reject_nonfinite(self, found: Sequence[Found]) -> int:
        """After the worker refused found blocks: rejects (and removes from their store) those
        whose K/V are not finite; returns how many of the first blocks are usable."""
        usable = len(found)
        for i, f in enumerate(found):
            if holds_nonfinite(f.block):
                self._reject(self.stores[f.store], f.block.block_hash, "its K/V hold NaN or infinity")
                usable = min(usable, i)
        return usable

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
