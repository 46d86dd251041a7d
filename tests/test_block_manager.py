"""The block manager: reference counts, the prefix-cache hash index and LRU eviction.

A hypothesis state machine drives random allocate / append / fork / free
sequences (with prefix-cache lookups) and checks after every step that no
block leaks, none is freed twice, and each block's reference count equals the
number of block tables that hold it.
"""
from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from scheduler.block_manager import BlockManager, OutOfBlocks

BS = 4
TOKENS = st.lists(st.integers(0, 2), min_size=1, max_size=14)   # a small alphabet: prefixes often repeat


class BlockManagerMachine(RuleBasedStateMachine):
    """Each live table has its token list; its first `computed` tokens count as computed."""

    @initialize(num_blocks=st.integers(4, 24))
    def setup(self, num_blocks):
        self.bm = BlockManager(num_blocks, BS, fingerprint="test-model")
        self.tables: list[dict] = []

    def _commit(self, t: dict) -> None:
        full = len(t["tokens"]) // BS
        self.bm.extend_hashes(t["chain"], t["tokens"], full)
        self.bm.commit(t["table"], t["chain"], t["committed"], full)
        t["committed"] = full

    @rule(tokens=TOKENS)
    def allocate(self, tokens):
        chain: list[bytes] = []
        n_blocks = (len(tokens) - 1) // BS
        self.bm.extend_hashes(chain, tokens, n_blocks)
        hits = self.bm.lookup(chain[:n_blocks])
        cost = self.bm.blocks_needed(len(tokens)) - len(hits) + self.bm.count_unheld(hits)
        table: list[int] = []
        if cost > self.bm.num_free:
            return
        self.bm.acquire(table, hits)
        self.bm.grow(table, len(tokens))
        t = {"table": table, "tokens": list(tokens), "chain": chain, "committed": len(hits)}
        self._commit(t)
        self.tables.append(t)

    @precondition(lambda self: self.tables)
    @rule(data=st.data(), extra=TOKENS)
    def append(self, data, extra):
        t = data.draw(st.sampled_from(self.tables))
        n = len(t["tokens"]) + len(extra)
        if not self.bm.can_grow(t["table"], n):
            with pytest.raises(OutOfBlocks):
                self.bm.grow(t["table"], n)
            return
        self.bm.grow(t["table"], n)
        t["tokens"] += extra
        self._commit(t)

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def fork(self, data):
        t = data.draw(st.sampled_from(self.tables))
        child = self.bm.fork(t["table"], len(t["tokens"]))
        full = len(child) * BS
        tokens = t["tokens"][:full]
        if not tokens:
            self.bm.free(child)
            return
        self.tables.append({"table": child, "tokens": tokens, "chain": list(t["chain"][:len(child)]),
                            "committed": min(t["committed"], len(child))})

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def free(self, data):
        t = self.tables.pop(data.draw(st.integers(0, len(self.tables) - 1)))
        held = list(t["table"])
        self.bm.free(t["table"])
        assert t["table"] == []
        for b in held:     # freeing those blocks again through a stale copy of the table is refused
            if self.bm.blocks[b].ref_count == 0:
                with pytest.raises(RuntimeError, match="freed twice"):
                    self.bm.free([b])
                break

    @invariant()
    def reference_counts_match_tables(self):
        holders = Counter(b for t in getattr(self, "tables", []) for b in t["table"])
        for block in getattr(self, "bm", BlockManager(0, BS)).blocks:
            assert block.ref_count == holders.get(block.block_id, 0)

    @invariant()
    def no_leak(self):
        if not hasattr(self, "bm"):
            return
        held = {b for t in self.tables for b in t["table"]}
        free = set(self.bm._free)
        assert free.isdisjoint(held)
        assert free | held == set(range(self.bm.num_blocks))
        for t in self.tables:
            assert len(set(t["table"])) == len(t["table"])
            assert len(t["table"]) == self.bm.blocks_needed(len(t["tokens"]))

    @invariant()
    def hash_index_is_consistent(self):
        if not hasattr(self, "bm"):
            return
        for h, b in self.bm._by_hash.items():
            assert self.bm.blocks[b].hash == h
        for t in self.tables:      # a registered block of a table holds that table's tokens
            for i, b in enumerate(t["table"][:t["committed"]]):
                h = self.bm.blocks[b].hash
                if h is not None:
                    assert h == t["chain"][i]


TestBlockManagerProperties = BlockManagerMachine.TestCase
TestBlockManagerProperties.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_hash_depends_on_parent_tokens_and_model():
    a, b = BlockManager(4, BS, "model-a"), BlockManager(4, BS, "model-b")
    assert a.block_hash(None, [1, 2, 3, 4]) == a.block_hash(None, [1, 2, 3, 4])
    assert a.block_hash(None, [1, 2, 3, 4]) != a.block_hash(None, [1, 2, 3, 5])
    assert a.block_hash(None, [1, 2, 3, 4]) != b.block_hash(None, [1, 2, 3, 4])
    parent = a.block_hash(None, [9, 9, 9, 9])
    assert a.block_hash(parent, [1, 2, 3, 4]) != a.block_hash(None, [1, 2, 3, 4])


def _fill(bm: BlockManager, tokens: list[int]) -> tuple[list[int], list[bytes]]:
    table: list[int] = []
    chain: list[bytes] = []
    bm.grow(table, len(tokens))
    full = len(tokens) // BS
    bm.extend_hashes(chain, tokens, full)
    bm.commit(table, chain, 0, full, tokens)
    return table, chain


def test_a_shared_prefix_is_found_and_reference_counted():
    bm = BlockManager(8, BS)
    first, chain = _fill(bm, list(range(10)))          # two full blocks + a partial one
    assert bm.num_cached == 2
    other: list[bytes] = []
    bm.extend_hashes(other, list(range(8)) + [50, 51, 52, 53], 3)
    hits = bm.lookup(other)
    assert hits == first[:2]                           # the third block differs
    second: list[int] = []
    bm.acquire(second, hits)
    assert [bm.blocks[b].ref_count for b in first] == [2, 2, 1]
    bm.free(first)
    assert [bm.blocks[b].ref_count for b in hits] == [1, 1] and bm.num_free == 8 - 2
    bm.free(second)
    assert bm.num_free == 8 and bm.num_cached == 2     # free, but still cached


def test_eviction_is_least_recently_used_and_uncached_blocks_go_first():
    bm = BlockManager(6, BS)
    old, old_chain = _fill(bm, [1] * 8)                # 2 cached blocks
    new, new_chain = _fill(bm, [2] * 8)                # 2 cached blocks
    scratch: list[int] = []
    bm.grow(scratch, 8)                                # 2 blocks never registered
    old_ids, new_ids = list(old), list(new)
    bm.free(old)
    bm.free(new)
    bm.free(scratch)
    taken: list[int] = []
    bm.grow(taken, 8)                                  # takes the unregistered blocks: both prefixes survive
    assert bm.lookup(old_chain) == old_ids and bm.lookup(new_chain) == new_ids
    bm.grow(taken, 16)                                 # two more: the least recently freed prefix goes
    assert bm.lookup(old_chain) == [] and bm.lookup(new_chain) == new_ids
    assert bm.num_cached == 2


def test_evicting_a_prefix_drops_its_tail_first():
    bm = BlockManager(3, BS)
    table, chain = _fill(bm, [7] * 12)
    ids = list(table)
    bm.free(table)
    taken: list[int] = []
    bm.grow(taken, 4)
    assert bm.lookup(chain) == ids[:2]              # the first two blocks still serve a shorter prefix


def test_out_of_blocks_changes_nothing():
    bm = BlockManager(2, BS)
    table: list[int] = []
    with pytest.raises(OutOfBlocks, match="need 3 KV blocks, 2 free"):
        bm.grow(table, 12)
    assert table == [] and bm.num_free == 2


def test_partial_lookup_finds_the_cached_block_sharing_the_most_leading_tokens():
    bm = BlockManager(12, BS)                             # BS = 4
    a, chain_a = _fill(bm, [7, 7, 7, 7, 1, 2, 3, 4])
    b, chain_b = _fill(bm, [7, 7, 7, 7, 1, 2, 9, 9])
    parent = chain_a[0]
    assert chain_b[0] == parent and bm.lookup(chain_b[:1]) == [a[0]]   # the first block is shared
    assert bm.partial_lookup(parent, [1, 2, 3]) == (a[1], 3)
    assert bm.partial_lookup(parent, [1, 2, 9]) == (b[1], 3)
    assert bm.partial_lookup(parent, [1, 5])[1] == 1
    assert bm.partial_lookup(parent, [8]) is None           # no cached block after it starts with 8
    assert bm.partial_lookup(chain_a[1], [5]) is None       # nothing cached after the second block
    # evicted blocks stop being candidates
    bm.free(a)
    bm.free(b)
    taken: list[int] = []
    bm.grow(taken, 4 * 12)
    assert bm.partial_lookup(parent, [1, 2, 3]) is None and not bm._children
