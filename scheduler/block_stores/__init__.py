"""Where prefix checkpoints live beyond the worker's pool: one interface (`base.BlockStore`), one
file per store, chosen by name (`open_store`)."""
from __future__ import annotations

from scheduler.block_stores.base import BlockStore, StoreStats
from scheduler.block_stores.directory import DirectoryStore
from scheduler.block_stores.redis_store import RedisStore

STORES = {"directory": DirectoryStore, "redis": RedisStore}

__all__ = ["BlockStore", "StoreStats", "DirectoryStore", "RedisStore", "STORES"]
