"""The router's replica choice against the scheduler's own prefix cache, in one process: the
journal a block manager keeps, diffed for a watcher, is what the router's view holds; the router's
prompt hashes are the scheduler's; the longest cached prefix wins, then the least loaded."""
from __future__ import annotations

from router.prefix_routing import PrefixAware, PrefixView, RoundRobin, prompt_chain
from scheduler.block_manager import BlockManager
from scheduler.prefix_journal import PrefixJournal
from shared.prefix_hash import prefix_hashes

BS = 4


class FakeReplica:
    def __init__(self) -> None:
        self.view = PrefixView()
        self.view.reset(BS, "fp")
        self.in_flight = 0


def _cached(manager: BlockManager, tokens: list[int]) -> list[int]:
    """Computes and registers `tokens`' full blocks, then frees them (cached, reclaimable)."""
    n = len(tokens) // BS
    chain = manager.extend_hashes([], tokens, n)
    table: list[int] = []
    manager.grow(table, len(tokens))
    manager.commit(table, chain, 0, n, tokens)
    manager.free(table)
    return chain


def test_the_journal_follows_the_prefix_cache_and_the_router_hashes_alike():
    manager, journal = BlockManager(6, BS, "fp"), PrefixJournal()
    journal.clear(BS, "fp")
    manager.journal = journal
    prompt = list(range(100, 113))
    chain = _cached(manager, prompt)
    assert chain == prefix_hashes(b"fp", prompt, BS)
    sent: set[bytes] = set()
    added, removed = journal.changes_since(sent)
    assert set(added) == set(chain) and removed == []
    assert journal.changes_since(sent) == ([], [])
    # 4 blocks into a pool of 6: the first prompt's unhashed tail block and two free ones are
    # handed out first, then its least recently freed cached block is evicted
    other = _cached(manager, list(range(200, 216)))
    added, removed = journal.changes_since(sent)
    assert set(added) == set(other) and removed == [chain[2]] and sent == set(manager._by_hash)
    manager.reset_prefix_cache()
    assert journal.changes_since(sent)[1] and sent == set()


def test_longest_cached_prefix_wins_then_the_least_loaded():
    a, b = FakeReplica(), FakeReplica()
    system = list(range(40))
    chain = prompt_chain(a.view, system + [7, 8, 9])
    assert len(chain) == (len(system) + 3 - 1) // BS
    b.view.apply(chain[:5], [])
    a.view.apply(chain[:2], [])
    policy = PrefixAware()
    assert policy.choose([a, b], system + [1, 2, 3])[0] is b
    b.in_flight = 5                                      # load does not outweigh a longer prefix
    assert policy.choose([a, b], system + [1, 2, 3])[0] is b
    assert policy.choose([a, b], [999] * 30)[0] is a     # a miss: the least loaded
    b.view.apply([], chain[:5])                          # evicted there
    assert policy.choose([a, b], system + [1, 2, 3])[0] is a


def test_a_routed_prefix_counts_as_held_until_reported():
    a, b = FakeReplica(), FakeReplica()
    policy = PrefixAware()
    prompt = list(range(50))
    first, chain = policy.choose([a, b], prompt)
    first.view.expect(chain)
    other = b if first is a else a
    first.in_flight = 3
    assert policy.choose([a, b], prompt)[0] is first     # not yet reported, but on its way
    first.view.reset(BS, "fp")                          # a restarted scheduler: nothing held
    assert policy.choose([a, b], prompt)[0] is other


def test_round_robin_takes_turns():
    replicas = [FakeReplica(), FakeReplica()]
    policy = RoundRobin()
    assert [policy.choose(replicas, [1] * 20)[0] for _ in range(4)] == replicas * 2
