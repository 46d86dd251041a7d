"""The identity of a cached prompt prefix, block by block: the scheduler registers computed KV
blocks under it (scheduler/block_manager.py) and checks checkpointed blocks against it; the router
hashes a prompt the same way to find the replica that holds the longest prefix of it."""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def block_hash(salt: bytes, parent: bytes | None, token_ids) -> bytes:
    """H(parent hash, the block's token ids, the model fingerprint)."""
    h = hashlib.blake2b(parent or b"root", digest_size=16)
    h.update(salt)
    h.update(np.asarray(token_ids, np.int64).tobytes())
    return h.digest()


def prefix_hashes(salt: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chain of hashes of the full blocks of `token_ids`."""
    chain: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chain.append(block_hash(salt, chain[-1] if chain else None, token_ids[start:start + block_size]))
    return chain
