"""The Redis store: one key a block, `<prefix>:<fingerprint>:<hash>`, set whole with a TTL, and a
sorted set of the keys by last use so that the store stays under its byte cap (oldest first). A
Redis that is absent, stops or comes back is handled here: an operation that fails is a miss or
a failed put, and Redis is left alone for a moment before it is tried again, so no request waits
on it."""
from __future__ import annotations

import time

from scheduler.block_stores.base import Backoff, BlockStore

KEY_PREFIX = "tensorserve:kv"
READ_BATCH = 16          # keys a round trip when reading a prefix: few trips, little read past its end


class RedisStore(BlockStore):
    name = "redis"

    def __init__(self, namespace: str, url: str, ttl_s: int, max_bytes: int, timeout_s: float = 0.5):
        super().__init__(namespace)
        import redis
        self._redis_errors = (redis.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                           retry_on_timeout=False)
        self.url, self.ttl_s, self.max_bytes = url, ttl_s, max_bytes
        self.prefix = f"{KEY_PREFIX}:{namespace}"
        self._index = f"{self.prefix}:index"         # member: block key, score: last use (unix time)
        self._sizes = f"{self.prefix}:sizes"         # hash: block key -> bytes
        self._total = f"{self.prefix}:bytes"         # the sizes' sum, kept beside them
        self._backoff = Backoff()

    def _key(self, block_hash: bytes) -> str:
        return f"{self.prefix}:{block_hash.hex()}"

    def _call(self, what: str, fn, default):
        if not self._backoff.open():
            self.stats.errors += 1
            return default
        try:
            result = fn()
        except self._redis_errors as exc:
            self._backoff.trip()
            self._failed(what, exc)
            return default
        self._backoff.reset()
        self._succeeded()
        return result

    def get(self, block_hash: bytes) -> bytes | None:
        key = self._key(block_hash)

        def read():
            value = self.client.get(key)
            if value is not None:
                self.client.zadd(self._index, {key: time.time()})
            return value
        value = self._call("read", read, None)
        if value is None:
            self.stats.misses += 1
        else:
            self.stats.hits += 1
        return value

    def get_prefix(self, block_hashes: list[bytes]) -> list[bytes]:
        def read():
            values: list[bytes] = []
            for start in range(0, len(block_hashes), READ_BATCH):
                keys = [self._key(h) for h in block_hashes[start:start + READ_BATCH]]
                got = self.client.mget(keys)
                run = next((i for i, v in enumerate(got) if v is None), len(got))
                values += got[:run]
                if run:
                    self.client.zadd(self._index, {k: time.time() for k in keys[:run]})
                if run < len(got):
                    break
            return values
        values = self._call("read", read, [])
        self.stats.hits += len(values)
        self.stats.misses += len(values) < len(block_hashes)
        return values

    def discard(self, block_hash: bytes) -> None:
        key = self._key(block_hash)

        def delete():
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(key)
            pipe.zrem(self._index, key)
            pipe.hget(self._sizes, key)
            pipe.hdel(self._sizes, key)
            size = pipe.execute()[2]
            self.client.decrby(self._total, int(size or 0))
        self._call("delete", delete, None)

    def contains(self, block_hash: bytes) -> bool:
        return bool(self._call("read", lambda: self.client.exists(self._key(block_hash)), 0))

    def put(self, block_hash: bytes, value: bytes) -> bool:
        if len(value) > self.max_bytes:
            self.stats.put_failures += 1
            return False
        key = self._key(block_hash)

        def write():
            pipe = self.client.pipeline(transaction=True)
            pipe.set(key, value, ex=self.ttl_s)            # the value is one SET: whole or absent
            pipe.zadd(self._index, {key: time.time()})
            pipe.hset(self._sizes, key, len(value))
            pipe.incrby(self._total, len(value))
            total = pipe.execute()[-1]
            if total > self.max_bytes:
                self._evict(total)
            return True
        ok = self._call("write", write, False)
        if ok:
            self.stats.puts += 1
        else:
            self.stats.put_failures += 1
        return ok

    def _evict(self, total: int) -> None:
        """Removes least recently used blocks until the sizes' sum is under the cap (blocks that
        expired by their TTL are still in the index: removing them only corrects the sum)."""
        for raw in self.client.zrange(self._index, 0, -1):
            if total <= self.max_bytes:
                break
            key = raw.decode()
            size = int(self.client.hget(self._sizes, key) or 0)
            pipe = self.client.pipeline(transaction=True)
            pipe.delete(key)
            pipe.zrem(self._index, key)
            pipe.hdel(self._sizes, key)
            pipe.decrby(self._total, size)
            total = pipe.execute()[-1]
            self.stats.evictions += 1

    def close(self) -> None:
        try:
            self.client.close()
        except self._redis_errors:
            pass
