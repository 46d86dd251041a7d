"""scheduler/block_stores: the directory store (the SSD tier) and the Redis store keep one value a
block under the model's namespace, stay under their byte caps (least recently used out first),
and never raise: an unwritable folder, a Redis absent at start, killed mid-run and back again are
misses and failed puts until it works again. Redis is a private `redis-server` on a free port."""
from __future__ import annotations

import shutil
import time

import pytest

from processes import free_port, wait_for
from redis_server import RedisServer
from scheduler.block_format import BlockRejected, decode, encode
from scheduler.block_stores import DirectoryStore, RedisStore
from test_block_format import GEOMETRY, make_block

NS = GEOMETRY.fingerprint


def blocks(n: int):
    return [make_block(100 + i) for i in range(n)]


# ----------------------------------------------------------------------------- directory
def test_directory_round_trip_survives_a_restart_and_keeps_its_cap(tmp_path):
    b = blocks(3)
    values = [encode(x) for x in b]
    cap = 2 * max(map(len, values))            # two blocks fit, three do not (their headers differ by a few bytes)
    store = DirectoryStore(NS, tmp_path, max_bytes=cap)
    assert store.put(b[0].block_hash, values[0]) and store.put(b[1].block_hash, values[1])
    assert store.get(b[0].block_hash) == values[0]          # b[0] is now the most recently used
    assert store.put(b[2].block_hash, values[2])           # over the cap: b[1], least recently used, goes
    assert store.get(b[1].block_hash) is None and store.contains(b[0].block_hash) and store.contains(b[2].block_hash)
    assert store.stats.evictions == 1 and store.used_bytes <= store.max_bytes
    again = DirectoryStore(NS, tmp_path, max_bytes=cap)     # after a restart
    assert decode(again.get(b[2].block_hash), GEOMETRY).token_ids == b[2].token_ids
    assert again.used_bytes == len(values[0]) + len(values[2])
    assert DirectoryStore("another-model", tmp_path, max_bytes=10**6).get(b[2].block_hash) is None


def test_an_unwritable_directory_is_a_failed_put_not_an_error(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the folder should be")
    store = DirectoryStore(NS, blocker, max_bytes=10**6)
    block = make_block(1)
    assert store.put(block.block_hash, encode(block)) is False and store.get(block.block_hash) is None
    assert store.stats.put_failures == 1 and store.stats.errors >= 1


def test_a_flipped_byte_on_disk_is_rejected(tmp_path):
    block = make_block(2)
    store = DirectoryStore(NS, tmp_path, max_bytes=10**6)
    store.put(block.block_hash, encode(block))
    path = store._path(block.block_hash)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    with pytest.raises(BlockRejected, match="checksum"):
        decode(store.get(block.block_hash), GEOMETRY)


# ----------------------------------------------------------------------------- redis
def test_redis_round_trip_ttl_and_cap(redis_server):
    b = blocks(3)
    values = [encode(x) for x in b]
    store = RedisStore(NS, redis_server.url, ttl_s=600, max_bytes=2 * max(map(len, values)))
    assert store.put(b[0].block_hash, values[0]) and store.put(b[1].block_hash, values[1])
    time.sleep(0.01)
    assert store.get(b[0].block_hash) == values[0]
    assert store.put(b[2].block_hash, values[2])
    assert store.get(b[1].block_hash) is None and store.contains(b[0].block_hash)
    assert 0 < store.client.ttl(store._key(b[2].block_hash)) <= 600
    assert RedisStore("another-model", redis_server.url, 600, 10**6).get(b[0].block_hash) is None


def test_a_flipped_byte_in_redis_is_rejected(redis_server):
    block = make_block(3)
    store = RedisStore(NS, redis_server.url, ttl_s=600, max_bytes=10**6)
    value = bytearray(encode(block))
    value[-40] ^= 0x01
    store.client.set(store._key(block.block_hash), bytes(value))
    with pytest.raises(BlockRejected):
        decode(store.get(block.block_hash), GEOMETRY)


def test_redis_absent_killed_and_back_never_raises_and_resumes(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed here")
    server = RedisServer(free_port(), tmp_path)
    store = RedisStore(NS, server.url, ttl_s=600, max_bytes=10**6)
    block = make_block(4)
    t0 = time.monotonic()
    assert store.get(block.block_hash) is None and store.put(block.block_hash, encode(block)) is False
    assert time.monotonic() - t0 < 2.0, "an absent Redis must not hold requests up"
    server.start()
    try:
        assert wait_for(lambda: store.put(block.block_hash, encode(block)), 10)     # retried after its pause
        assert store.get(block.block_hash) == encode(block)
        server.kill()
        t0 = time.monotonic()
        assert store.get(block.block_hash) is None and time.monotonic() - t0 < 2.0
        server.start()                                             # back, empty (no persistence)
        assert wait_for(lambda: store.put(block.block_hash, encode(block)), 10)
        assert store.get(block.block_hash) == encode(block) and store.stats.errors >= 2
    finally:
        if server.proc.poll() is None:
            server.kill()


# ----------------------------------------------------------------------------- both
@pytest.fixture(params=["directory", "redis"])
def store(request, tmp_path):
    if request.param == "directory":
        yield DirectoryStore(NS, tmp_path, max_bytes=10**7)
    else:
        yield RedisStore(NS, request.getfixturevalue("redis_server").url, ttl_s=600, max_bytes=10**7)


def test_a_prefix_is_read_up_to_its_first_missing_block_and_a_discarded_value_is_gone(store):
    b = blocks(40)                                   # past the Redis store's read batch of 16
    values = [encode(x) for x in b]
    for x, value in zip(b[:35], values):
        assert store.put(x.block_hash, value)
    store.discard(b[30].block_hash)                  # a value that did not check out
    assert not store.contains(b[30].block_hash)
    got = store.get_prefix([x.block_hash for x in b])
    assert got == values[:30]
    assert store.stats.hits >= 30 and store.stats.misses >= 1
    assert store.get_prefix([b[36].block_hash, b[0].block_hash]) == []    # the first one is missing: nothing


def test_the_redis_byte_count_follows_puts_discards_and_evictions(redis_server):
    b = blocks(5)
    values = [encode(x) for x in b]
    store = RedisStore(NS, redis_server.url, ttl_s=600, max_bytes=3 * max(map(len, values)))
    for x, value in zip(b, values):
        store.put(x.block_hash, value)
        time.sleep(0.002)                            # distinct last-use times
    assert store.stats.evictions == 2
    assert int(store.client.get(store._total)) == sum(map(len, values[2:]))
    store.discard(b[3].block_hash)
    assert int(store.client.get(store._total)) == len(values[2]) + len(values[4])
    assert store.get_prefix([b[2].block_hash]) == [values[2]]
