"""Which replica of a model takes a request: the one holding the longest cached prefix of its
prompt, else the least loaded (prefix-aware), or the next in turn (round-robin, for comparison).

Each replica's cache is known from the block hashes its scheduler reports (router/replicas.py
watches them). Between a request being sent and its blocks being reported (a prefill, plus one
report interval) the router would not know that the replica is about to hold that prefix, and a
burst of requests with one new system prompt would scatter over the replicas; so the prefix of a
routed request counts as held there at once, for EXPECTED_TTL_S or until the scheduler reports it.
"""
from __future__ import annotations

import itertools
import time
from typing import Protocol, Sequence

from shared.prefix_hash import prefix_hashes

EXPECTED_TTL_S = 10.0


class PrefixView:
    """What the router believes one scheduler's prefix cache holds."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.expected: dict[bytes, float] = {}        # routed here, not reported yet: hash -> until when
        self.block_size = 0
        self.salt = b""

    def reset(self, block_size: int = 0, fingerprint: str = "") -> None:
        self.held.clear()
        self.expected.clear()
        self.block_size, self.salt = block_size, fingerprint.encode()

    def apply(self, added: Sequence[bytes], removed: Sequence[bytes]) -> None:
        self.held.difference_update(removed)
        self.held.update(added)
        for h in added:
            self.expected.pop(h, None)

    def expect(self, chain: Sequence[bytes]) -> None:
        until = time.monotonic() + EXPECTED_TTL_S
        for h in chain:
            if h not in self.held:
                self.expected[h] = until
        if len(self.expected) > 65536:          # an expectation never reported (evicted, aborted)
            now = time.monotonic()
            self.expected = {h: t for h, t in self.expected.items() if t > now}

    def longest_prefix(self, chain: Sequence[bytes]) -> int:
        """How many leading blocks of `chain` are (or are about to be) cached here."""
        now = time.monotonic()
        n = 0
        for h in chain:
            if h not in self.held and self.expected.get(h, 0.0) <= now:
                break
            n += 1
        return n


class Candidate(Protocol):
    view: PrefixView
    in_flight: int


def prompt_chain(view: PrefixView, prompt_ids: Sequence[int]) -> list[bytes]:
    """The hashes of the prompt's full blocks as `view`'s scheduler computes them; the last block
    is left out when it ends the prompt (the scheduler recomputes a prompt's last token)."""
    if not view.block_size:
        return []
    return prefix_hashes(view.salt, prompt_ids[:len(prompt_ids) - 1], view.block_size)


class PrefixAware:
    name = "prefix-aware"

    def choose(self, candidates: Sequence[Candidate], prompt_ids: Sequence[int]) -> tuple[Candidate, list[bytes]]:
        """The candidate with the longest cached prefix; among equals the fewest in flight, then the
        smallest cache (misses spread the prefixes over the replicas). Returns it with the prompt's
        chain of hashes (for `PrefixView.expect`)."""
        chains: dict[tuple[int, bytes], list[bytes]] = {}
        best, best_key, best_chain = None, None, []
        for c in candidates:
            key = (c.view.block_size, c.view.salt)
            chain = chains.get(key)
            if chain is None:
                chain = chains[key] = prompt_chain(c.view, prompt_ids)
            rank = (-c.view.longest_prefix(chain), c.in_flight, len(c.view.held) + len(c.view.expected))
            if best_key is None or rank < best_key:
                best, best_key, best_chain = c, rank, chain
        return best, best_chain


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Candidate], prompt_ids: Sequence[int]) -> tuple[Candidate, list[bytes]]:
        return candidates[next(self._turn) % len(candidates)], []


def policy(name: str) -> PrefixAware | RoundRobin:
    return RoundRobin() if name == "round-robin" else PrefixAware()
