"""KV block metadata: free blocks, reference counts and the prefix cache.

A block table is a list of physical block ids. A block held by several tables
(a shared prefix, a fork) has one reference per table. A *full* block whose K/V
has been computed is registered under its hash H(parent hash, its token ids,
model fingerprint), so a later sequence with the same tokens up to and
including that block can take it instead of recomputing it (vLLM's automatic
prefix caching). A block nobody references is free, but keeps its contents and
hash until it is handed out again: free blocks are evicted least recently used
first, blocks that hold no cached prefix before any that do.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from shared.prefix_hash import block_hash  # noqa: F401  (re-exported: scheduler/block_format.py)


class OutOfBlocks(RuntimeError):
    pass


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None       # set once the block is full, computed and registered
    parent: bytes | None = None     # with hash: the previous block's hash (None for a first block)
    token_ids: tuple[int, ...] = ()  # with hash: the tokens it holds


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, fingerprint: str = ""):
        self.num_blocks, self.block_size = num_blocks, block_size
        self._salt = fingerprint.encode()
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # front: evict first
        self._by_hash: dict[bytes, int] = {}
        self._children: dict[bytes | None, set[int]] = {}   # parent hash -> cached blocks that follow it
        self.queried_tokens = 0          # prompt tokens looked up in the prefix cache, since start
        self.hit_tokens = 0              # of those, tokens found cached
        self.journal = None              # a PrefixJournal (scheduler/prefix_journal.py) told of each change

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        """Blocks no table holds (cached ones included: they are reclaimable)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, held or not."""
        return len(self._by_hash)

    def blocks_needed(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    # ------------------------------------------------------------------ hashing
    def block_hash(self, parent: bytes | None, token_ids) -> bytes:
        return block_hash(self._salt, parent, token_ids)

    def extend_hashes(self, chain: list[bytes], tokens: list[int], n_blocks: int) -> list[bytes]:
        """Grow `chain` (the hashes of the first full blocks of `tokens`) to `n_blocks` entries."""
        bs = self.block_size
        for i in range(len(chain), n_blocks):
            chain.append(self.block_hash(chain[-1] if chain else None, tokens[i * bs:(i + 1) * bs]))
        return chain

    def lookup(self, chain: list[bytes]) -> list[int]:
        """Block ids of the longest prefix of `chain` that is cached (no references taken)."""
        hits = []
        for h in chain:
            block_id = self._by_hash.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def partial_lookup(self, parent: bytes | None, tokens: list[int]) -> tuple[int, int] | None:
        """(block id, n) of the cached block following the prefix `parent` whose first n tokens
        equal tokens[:n], for the largest n >= 1 (no reference taken), or None.

        A prompt that diverges from a cached prefix inside a block can start from a copy
        of that block's first n tokens instead of recomputing them (token-granular reuse,
        as llama.cpp's server and SGLang's radix cache do)."""
        best, best_n = None, 0
        for b in self._children.get(parent, ()):
            cached = self.blocks[b].token_ids
            n = 0
            for a, c in zip(cached, tokens):
                if a != c:
                    break
                n += 1
            if n > best_n:
                best, best_n = b, n
        return (best, best_n) if best is not None else None

    def count_unheld(self, block_ids: list[int]) -> int:
        """How many of these blocks sit in the free list (taking them uses up free blocks)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_count == 0)

    # ------------------------------------------------------------------ tables
    def acquire(self, table: list[int], block_ids: list[int]) -> None:
        """Append cached blocks to `table`, taking a reference on each."""
        for b in block_ids:
            block = self.blocks[b]
            if block.ref_count == 0:
                del self._free[b]
            block.ref_count += 1
            table.append(b)

    def can_grow(self, table: list[int], n_tokens: int) -> bool:
        return self.blocks_needed(n_tokens) - len(table) <= len(self._free)

    def grow(self, table: list[int], n_tokens: int) -> None:
        """Append fresh blocks to `table` until it holds `n_tokens` tokens."""
        missing = self.blocks_needed(n_tokens) - len(table)
        if missing > len(self._free):
            raise OutOfBlocks(f"need {missing} KV blocks, {len(self._free)} free")
        for _ in range(missing):
            b, _ = self._free.popitem(last=False)
            block = self.blocks[b]
            if block.hash is not None:                    # evict its cached prefix
                self._forget(block)
            block.ref_count = 1
            table.append(b)

    def fork(self, table: list[int], n_tokens: int) -> list[int]:
        """A new table sharing the full blocks of `table`'s first `n_tokens` tokens (the partial
        tail is not shared: the child recomputes it into a block of its own)."""
        child: list[int] = []
        self.acquire(child, table[:n_tokens // self.block_size])
        return child

    def commit(self, table: list[int], chain: list[bytes], start: int, end: int,
               tokens: list[int] | None = None) -> None:
        """Register blocks table[start:end], now full and computed, under chain[start:end]
        (`tokens`, the sequence's tokens, lets later prompts match inside these blocks too)."""
        bs = self.block_size
        for i in range(start, end):
            if table[i] < 0:                              # released (a window's table): nothing to register
                continue
            block = self.blocks[table[i]]
            if block.hash is None and chain[i] not in self._by_hash:
                block.hash = chain[i]
                self._by_hash[chain[i]] = block.block_id
                if self.journal is not None:
                    self.journal.added(chain[i])
                if tokens is not None:
                    block.parent = chain[i - 1] if i else None
                    block.token_ids = tuple(tokens[i * bs:(i + 1) * bs])
                    self._children.setdefault(block.parent, set()).add(block.block_id)

    def register(self, block_id: int, digest: bytes, parent: bytes | None, token_ids) -> bool:
        """Register one full, computed block under `digest` (a block restored from a prefix
        checkpoint); False when another block holds that prefix already."""
        block = self.blocks[block_id]
        if digest in self._by_hash or block.hash is not None:
            return False
        block.hash, block.parent, block.token_ids = digest, parent, tuple(token_ids)
        self._by_hash[digest] = block_id
        if self.journal is not None:
            self.journal.added(digest)
        self._children.setdefault(parent, set()).add(block_id)
        return True

    def _forget(self, block: Block) -> None:
        if self._by_hash.get(block.hash) == block.block_id:
            del self._by_hash[block.hash]
            if self.journal is not None:
                self.journal.removed(block.hash)
        siblings = self._children.get(block.parent)
        if siblings is not None:
            siblings.discard(block.block_id)
            if not siblings:
                del self._children[block.parent]
        block.hash, block.parent, block.token_ids = None, None, ()

    def free(self, table: list[int]) -> int:
        """Drop `table`'s references (entries below 0 hold none); returns how many blocks became free.
        The tail is released first, so under pressure a prefix's last blocks are evicted before its
        first."""
        released = 0
        for b in reversed(table):
            if b < 0:
                continue
            block = self.blocks[b]
            if block.ref_count <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            block.ref_count -= 1
            if block.ref_count == 0:
                released += 1
                self._free[b] = None
                if block.hash is None:                    # holds nothing reusable: hand it out first
                    self._free.move_to_end(b, last=False)
        table.clear()
        return released

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. after the worker lost its KV)."""
        for block in self.blocks:
            block.hash, block.parent, block.token_ids = None, None, ()
        self._by_hash.clear()
        self._children.clear()
        if self.journal is not None:
            self.journal.clear(self.block_size, self.journal.fingerprint)
