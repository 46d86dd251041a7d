"""scheduler/prefix_checkpoints.py with real workers: a prompt's full blocks saved from one worker
into a directory store and a Redis store, that worker stopped, a new worker started (an empty
pool: a restart), the blocks found by their hashes and imported: the rest of the prompt computed
on them samples the cold run's token with the same log-probability. A corrupted value is a miss."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from processes import free_port, stop
from redis_server import RedisServer
from scheduler.block_manager import block_hash
from scheduler.block_stores import DirectoryStore, RedisStore
from scheduler.prefix_checkpoints import PrefixCheckpoints, geometry_of
from scheduler.worker_client import WorkerClient
from shared.step import StepRequest
from test_worker_process import chunk, start_worker

PROMPT = list(range(500, 500 + 16 * 3 + 5))      # three full blocks of 16, then 5 tokens


def _first_token(client: WorkerClient, request: StepRequest):
    return client.step(request).results[0]


def _store(kind: str, geometry, folder, redis_url: str | None):
    if kind == "directory":
        return DirectoryStore(geometry.fingerprint, folder, max_bytes=2**30)
    return RedisStore(geometry.fingerprint, redis_url, ttl_s=600, max_bytes=2**30)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One worker computes PROMPT cold and saves its three full blocks into a directory store and
    into a Redis store (a private redis-server kept for the module; none where it is missing), then
    stops: what each restore starts from."""
    tmp = tmp_path_factory.mktemp("saved")
    redis = RedisServer(free_port(), tmp) if shutil.which("redis-server") else None
    if redis is not None:
        redis.start()
    try:
        proc, address = start_worker(tmp, name="before")
        client = WorkerClient(address)
        try:
            geometry = geometry_of(client.describe())
            cold = _first_token(client, StepRequest([chunk(1, PROMPT, 0, [0, 1, 2, 3], len(PROMPT))]))
            salt = geometry.fingerprint.encode()
            hashes, parents, tokens, parent = [], [], [], None
            for i in range(3):
                piece = PROMPT[16 * i:16 * (i + 1)]
                parent_of_this = parent
                parent = block_hash(salt, parent, piece)
                hashes.append(parent)
                parents.append(parent_of_this)
                tokens.append(piece)
            info = {"geometry": geometry, "cold": cold, "hashes": hashes, "folder": tmp / "checkpoints",
                    "redis_url": redis.url if redis is not None else None}
            for kind in ("directory", "redis") if redis is not None else ("directory",):
                store = _store(kind, geometry, info["folder"], info["redis_url"])
                assert PrefixCheckpoints([store], geometry).save(client, [0, 1, 2], hashes, parents, tokens) == 3
        finally:
            client.close()
            assert stop(proc) == 0
        yield info
    finally:
        if redis is not None and redis.proc.poll() is None:
            redis.kill()


@pytest.fixture(scope="module")
def restarted(saved, tmp_path_factory):
    """A new worker process, started after the one that computed PROMPT stopped: its pool never
    held PROMPT's K/V. Each restore below writes blocks of its own."""
    proc, address = start_worker(tmp_path_factory.mktemp("restarted"), name="after")
    client = WorkerClient(address)
    yield client
    client.close()
    assert stop(proc) == 0


@pytest.mark.parametrize("store_kind,first_block", [("directory", 7), ("redis", 17)])
def test_blocks_saved_before_a_restart_continue_the_prompt_exactly(saved, restarted, store_kind, first_block):
    if store_kind == "redis" and saved["redis_url"] is None:
        pytest.skip("redis-server is not installed here: the Redis store's tests need a private one")
    geometry, hashes, client = saved["geometry"], saved["hashes"], restarted
    assert geometry_of(client.describe()) == geometry
    checkpoints = PrefixCheckpoints([_store(store_kind, geometry, saved["folder"], saved["redis_url"])], geometry)
    found = checkpoints.find(hashes + [b"\x00" * 16])             # the 4th is not stored: the prefix ends
    assert [b.block_hash for b in found] == hashes
    blocks = [first_block + i for i in range(4)]
    checkpoints.restore(client, blocks[:3], found)
    rest = chunk(first_block, PROMPT[48:], 48, blocks, len(PROMPT))
    rest.prefix_ids = np.asarray(PROMPT[:48], np.int64)
    warm = _first_token(client, StepRequest([rest]))
    assert warm.token_id == saved["cold"].token_id and warm.logprob == saved["cold"].logprob


def test_a_corrupted_stored_block_is_a_miss(tmp_path):
    from test_block_format import GEOMETRY, make_block
    from scheduler.block_format import encode
    store = DirectoryStore(GEOMETRY.fingerprint, tmp_path, max_bytes=2**20)
    good, bad = make_block(1), make_block(2)
    bad = type(bad)(bad.geometry, bad.block_hash, good.block_hash, bad.token_ids, bad.payload)
    store.put(good.block_hash, encode(good))
    value = bytearray(encode(bad))
    value[100] ^= 0xFF
    store.put(bad.block_hash, bytes(value))
    checkpoints = PrefixCheckpoints([store], GEOMETRY)
    assert [b.block_hash for b in checkpoints.find([good.block_hash, bad.block_hash])] == [good.block_hash]
    assert sum(checkpoints.rejected.values()) == 1


def test_a_stored_block_whose_values_are_not_finite_is_rejected_at_import(tmp_path, restarted):
    """A value that checks out (checksum, hash, geometry) but carries NaN K/V, as a pass that
    overflowed would have saved it: the worker refuses the import, the tier rejects that block,
    removes it from its store and restores the blocks before it; the rest is recomputed."""
    import dataclasses

    from scheduler.block_format import encode
    from scheduler.block_manager import BlockManager
    from scheduler.checkpoint_tier import CheckpointTier
    from scheduler.sequence import Sequence
    from shared.sampling_params import SamplingParams
    client = restarted              # a worker of the module's; this test's sequence and blocks are its own
    tier = None
    try:
        geometry = geometry_of(client.describe())
        store = DirectoryStore(geometry.fingerprint, tmp_path / "checkpoints", max_bytes=2**30)
        _first_token(client, StepRequest([chunk(1, PROMPT, 0, [0, 1, 2, 3], len(PROMPT))]))
        manager = BlockManager(64, geometry.block_size, fingerprint=geometry.fingerprint)
        seq = Sequence(list(PROMPT), SamplingParams())
        hashes = manager.extend_hashes(seq.block_hashes, seq.tokens, 3)
        checkpoints = PrefixCheckpoints([store], geometry)
        pieces = [PROMPT[16 * i:16 * (i + 1)] for i in range(3)]
        assert checkpoints.save(client, [0, 1, 2], hashes, [None, hashes[0], hashes[1]], pieces) == 3
        second = checkpoints.find(hashes)[1]
        payload = np.frombuffer(second.payload, np.uint8).copy()
        payload.view(geometry.dtype)[5] = np.nan
        store.discard(second.block_hash)
        assert store.put(second.block_hash, encode(dataclasses.replace(second, payload=payload.data)))
        assert len(checkpoints.find(hashes)) == 3              # it checks out: only the worker can tell

        tier = CheckpointTier(checkpoints, client)
        assert tier.restore_into_pool(manager, seq, [], 3) == 1
        assert checkpoints.rejected == {"its K/V hold NaN or infinity": 1}
        assert not store.contains(hashes[1]) and store.contains(hashes[0]) and store.contains(hashes[2])
        assert manager.lookup(hashes) == manager.lookup(hashes[:1]) and len(manager.lookup(hashes)) == 1
    finally:
        if tier is not None:
            tier.close()
