"""Prefix checkpoints as the engine uses them: the stores are a tier below the worker's pool.

* **Restore** (at admission, on the engine loop): the blocks of a prompt's prefix that the pool
  lacks are looked up in the stores (the local directory, then Redis), longest prefix first; what
  is found is imported into free pool blocks before the step that reads them is sent, and from
  there on they are ordinary cached blocks. Blocks found only in a later store are copied into
  the earlier ones in the background (Redis → the local directory).
* **Save** (in the background): every full prompt block, once its K/V is computed, is written to
  every store that lacks it. The engine holds a reference on the blocks until the worker has
  exported them (the exported copy is then encoded and written while the engine goes on), so a
  block is never overwritten before it is read; blocks a store already holds are not exported.
  Writing through at prefill makes a checkpoint survive any stop, `kill -9` included, and makes
  the directory hold every evicted prompt block without a copy at eviction time (when the pool
  needs the block back at once); generated tokens' blocks are written when they come back as the
  next turn's prompt.

A store that is down, full or unwritable turns saves into counted failures and lookups into
misses; the engine never waits for it beyond the store's own short timeout.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass

import grpc

from protos.tensorserve.v1 import scheduler_pb2
from scheduler.block_format import KVBlock
from scheduler.block_manager import BlockManager
from scheduler.window_blocks import WindowBlocks
from scheduler.block_stores import BlockStore, DirectoryStore, RedisStore
from scheduler.prefix_checkpoints import Found, PrefixCheckpoints, geometry_of
from scheduler.sequence import Sequence
from scheduler.worker_client import WorkerFailure

log = logging.getLogger(__name__)

# the engine's references a save holds: on main-pool blocks, and on windowed-layer-pool blocks
# (scheduler/window_blocks.py; empty where the worker has one pool)
Held = tuple[list[int], list[int]]

MAX_PENDING_SAVES = 256          # save jobs queued for the writer; past it a save is dropped (counted)
MAX_KNOWN = 1 << 17              # hashes remembered as stored everywhere (skips a save's store queries)


@dataclass
class _Save:
    held: Held                              # the engine's references on the blocks, released after export
    block_ids: list[tuple[int, int]]        # (block, its windowed layers' block or -1 where none)
    hashes: list[bytes]
    parents: list[bytes | None]
    token_ids: list[tuple[int, ...]]


@dataclass
class _Promote:
    found: list[Found]


@dataclass
class TierStats:
    restored_blocks: int = 0
    restored_bytes: int = 0                 # stored values' bytes of the restored blocks
    restore_seconds: float = 0.0            # reading, checking and importing them
    saved_blocks: int = 0                   # blocks written to at least one store that lacked them
    exported_blocks: int = 0
    saves_dropped: int = 0                  # the writer's queue was full
    save_failures: int = 0                  # exports that failed (the worker was gone)


class CheckpointTier:
    def __init__(self, checkpoints: PrefixCheckpoints, worker):
        self.checkpoints = checkpoints
        self.worker = worker                 # a WorkerClient
        self.stats = TierStats()
        self._jobs: queue.Queue = queue.Queue(MAX_PENDING_SAVES)
        self._released: deque[Held] = deque()
        self._cond = threading.Condition()
        self._pending = 0                    # save jobs whose blocks the engine still holds
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._closed = False
        self._thread = threading.Thread(target=self._write_loop, name="checkpoint-writer", daemon=True)
        self._thread.start()

    @property
    def block_size(self) -> int:
        return self.checkpoints.geometry.block_size

    # ------------------------------------------------------------------ engine loop
    def restore_into_pool(self, manager: BlockManager, seq: Sequence, hits: list[int], n_blocks: int,
                          window: WindowBlocks | None = None) -> int:
        """Looks up `seq`'s blocks after its pool hits, up to `n_blocks`, in the stores and imports
        those found into free pool blocks, registered as cached prefix blocks (the engine's next
        lookup takes them); returns how many. Runs with no step in flight. With `window` (the
        windowed layers' own pool), the windowed layers of the blocks the window after the last
        restored one reads go into that pool, registered there too."""
        seq.stores_checked = True
        started = time.perf_counter()
        found = self.find(seq.block_hashes[len(hits):n_blocks])
        if not found:
            return 0
        hold: list[int] = []
        manager.acquire(hold, hits)                  # the hits are not evicted to make room
        table: list[int] = []
        try:
            found = found[:max(0, manager.num_free - 1)]
            if not found:
                return 0
            manager.grow(table, len(found) * manager.block_size)
            window_table = self._window_blocks(window, len(hits), found)
            found = self._import(manager, table, found, window, window_table)
            for i, (block_id, f) in enumerate(zip(table, found)):
                manager.register(block_id, f.block.block_hash, f.block.parent_hash, f.block.token_ids)
                if window is not None and window_table[i] >= 0:
                    window.manager.register(window_table[i], f.block.block_hash, f.block.parent_hash,
                                            f.block.token_ids)
            self.stats.restored_bytes += sum(len(f.value) for f in found)
            self.stats.restore_seconds += time.perf_counter() - started
            return len(found)
        finally:
            manager.free(table)
            manager.free(hold)
            if window is not None:
                window.manager.free(window_table)

    @staticmethod
    def _window_blocks(window: WindowBlocks | None, n_hits: int, found: list[Found]) -> list[int]:
        """Windowed-pool blocks for the restored blocks inside the window after the last of them (-1
        for the others); fewer when that pool is short, which only shortens the prefix used."""
        if window is None:
            return []
        first = window.first_needed((n_hits + len(found)) * window.block_size) - n_hits
        kept = min(len(found) - max(0, first), max(0, window.num_free - 1))
        fresh: list[int] = []
        window.manager.grow(fresh, kept * window.block_size)
        return [-1] * (len(found) - kept) + fresh

    def _import(self, manager: BlockManager, table: list[int], found: list[Found], window: WindowBlocks | None = None,
                window_table: list[int] | None = None) -> list[Found]:
        """Loads `found` into `table`'s blocks (and `window_table`'s); what the worker took (a block
        whose values are not finite is rejected and the blocks before it are loaded again; the rest
        is recomputed)."""
        for _ in range(2):
            try:
                self.load(table, found, window_table if window is not None else None)
                return found
            except WorkerFailure as exc:
                if exc.code != grpc.StatusCode.INVALID_ARGUMENT:
                    raise                            # the worker is gone: the engine loop handles it
                usable = self.checkpoints.reject_nonfinite(found)
                if usable == len(found):
                    log.warning("the worker refused restored KV blocks (%s); they are recomputed", exc)
                    usable = 0
                found = found[:usable]
                manager.free(table[usable:])
                del table[usable:]
                if window is not None:
                    window.manager.free(window_table[usable:])
                    del window_table[usable:]
                if not found:
                    return []
        return []

    def save_prompt_blocks(self, manager: BlockManager, seq: Sequence, full: int,
                           window: WindowBlocks | None = None) -> None:
        """Hands `seq`'s full prompt blocks computed so far (the first `full` blocks are) to the
        writer, holding them until they are exported. With `window` (the windowed layers' own pool),
        a block whose windowed layers have left that pool already is not saved (a window shorter
        than a prefill chunk), nor the blocks after it, which no lookup would reach."""
        bs = manager.block_size
        start, end = seq.num_saved_blocks, min(full, len(seq.prompt) // bs)
        if window is not None and seq.window_start > start:
            end = start                              # the chain of stored blocks breaks here
        if end <= start:
            seq.num_saved_blocks = max(seq.num_saved_blocks, end)
            return
        seq.num_saved_blocks = end
        chain = seq.block_hashes
        held: Held = ([], [])
        manager.acquire(held[0], seq.block_table[start:end])
        if window is not None:
            window.manager.acquire(held[1], seq.window_table[start:end])
        pairs = list(zip(held[0], held[1] if window is not None else [-1] * len(held[0])))
        if not self.save(held, pairs, chain[start:end], [chain[i - 1] if i else None for i in range(start, end)],
                         [tuple(seq.prompt[i * bs:(i + 1) * bs]) for i in range(start, end)]):
            manager.free(held[0])
            if window is not None:
                window.manager.free(held[1])

    def find(self, hashes: list[bytes]) -> list[Found]:
        """The stored blocks of the longest prefix of `hashes`."""
        if not hashes:
            return []
        return self.checkpoints.find_values(hashes)

    def load(self, block_ids: list[int], found: list[Found], window_ids: list[int] | None = None) -> None:
        """Imports found blocks into free pool blocks (before any step reads them)."""
        blocks: list[KVBlock] = [f.block for f in found]
        self.checkpoints.restore(self.worker, block_ids, blocks, window_ids)
        self.stats.restored_blocks += len(blocks)
        promote = [f for f in found if f.store > 0]
        if promote:
            try:
                self._jobs.put_nowait(_Promote(promote))
            except queue.Full:
                pass

    def save(self, held: Held, block_ids: list[tuple[int, int]], hashes: list[bytes], parents: list[bytes | None],
             token_ids: list[tuple[int, ...]]) -> bool:
        """Queues blocks for writing; the engine keeps `held` (its references on them) until
        `released()` hands the list back. False: nothing queued (all known stored, or the queue is
        full), release `held` at once."""
        keep = [i for i, h in enumerate(hashes) if h not in self._known]
        if not keep:
            return False
        job = _Save(held, [block_ids[i] for i in keep], [hashes[i] for i in keep], [parents[i] for i in keep],
                    [token_ids[i] for i in keep])
        with self._cond:
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                self.stats.saves_dropped += 1
                return False
            self._pending += 1
        return True

    def released(self) -> list[Held]:
        """Held block lists whose blocks have been exported (the engine frees them)."""
        out = []
        while self._released:
            out.append(self._released.popleft())
        return out

    def wait_for_release(self, timeout_s: float = 30.0) -> bool:
        """Blocks until no save holds pool blocks (the engine needs them); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending == 0, timeout_s)

    @property
    def holding(self) -> bool:
        return self._pending > 0

    def close(self) -> None:
        self._closed = True
        try:
            self._jobs.put_nowait(None)
        except queue.Full:
            pass

    # ------------------------------------------------------------------ writer thread
    def _write_loop(self) -> None:
        while not self._closed:
            job = self._jobs.get()
            if job is None or self._closed:   # a closed tier's engine is gone: its block ids mean nothing now
                break
            jobs, later = [job], []
            while isinstance(job, _Save):     # the saves queued meanwhile go in the same export
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                (jobs if isinstance(more, _Save) else later).append(more)
            try:
                if isinstance(job, _Save):
                    self._save(jobs)
                else:
                    self._promote(job)
                for other in later:
                    if other is None:
                        self._closed = True
                    else:
                        self._promote(other)
            except Exception:                 # a bug here must not stop later saves
                log.exception("writing prefix checkpoints failed")

    def _save(self, jobs: list[_Save]) -> None:
        """One export for every queued save: a batch's sequences each hand over their prompt
        blocks in the same step, and each export is a pause of the worker between steps."""
        stores = self.checkpoints.stores
        blocks: dict[bytes, tuple[int, bytes | None, tuple[int, ...]]] = {}
        for job in jobs:
            for h, b, p, t in zip(job.hashes, job.block_ids, job.parents, job.token_ids):
                blocks.setdefault(h, (b, p, t))          # two sequences may hand over one shared block
        hashes = list(blocks)
        try:
            lacking = [[s for s in stores if not s.contains(h)] for h in hashes]
            wanted = [i for i, missing in enumerate(lacking) if missing]
            for i, missing in enumerate(lacking):
                if not missing:
                    self._remember(hashes[i])
            kv = None
            if wanted:
                try:
                    pairs = [blocks[hashes[i]][0] for i in wanted]
                    windowed = [w for _, w in pairs] if pairs[0][1] >= 0 else None
                    kv = self.worker.export_blocks([b for b, _ in pairs], window_ids=windowed)
                except Exception as exc:       # the worker went away: the engine is being replaced
                    self.stats.save_failures += 1
                    log.debug("exporting blocks for a checkpoint failed: %s", exc)
                    return
                self.stats.exported_blocks += len(wanted)
        finally:
            for job in jobs:
                self._release(job.held)
        if kv is None or self._closed:
            return
        values = self.checkpoints.encode(kv, [hashes[i] for i in wanted], [blocks[hashes[i]][1] for i in wanted],
                                         [blocks[hashes[i]][2] for i in wanted])
        for i, (digest, value) in zip(wanted, values):
            results = [store.put(digest, value) for store in lacking[i]]
            if any(results):
                self.stats.saved_blocks += 1
            if all(results):
                self._remember(digest)

    def _promote(self, job: _Promote) -> None:
        stores = self.checkpoints.stores
        for f in job.found:
            if all([stores[i].put(f.block.block_hash, f.value) for i in range(f.store)]):
                self._remember(f.block.block_hash)

    def _release(self, held: Held) -> None:
        with self._cond:
            self._released.append(held)
            self._pending -= 1
            self._cond.notify_all()

    def _remember(self, digest: bytes) -> None:
        known = self._known
        known[digest] = None
        known.move_to_end(digest)
        while len(known) > MAX_KNOWN:
            known.popitem(last=False)


def open_tier(config, description, worker, stores_by_model: dict[str, list[BlockStore]]) -> CheckpointTier | None:
    """The checkpoint tier for a worker's model (a SchedulerConfig's options), or None when
    checkpoints are off. Stores are opened once per model and kept across worker restarts."""
    if not config.prefix_checkpoints:
        return None
    geometry = geometry_of(description)
    namespace = geometry.namespace
    stores = stores_by_model.get(namespace)
    if stores is None:
        stores = [DirectoryStore(namespace, config.checkpoint_dir, config.checkpoint_dir_max_bytes)]
        if config.redis_url:
            stores.append(RedisStore(namespace, config.redis_url, config.redis_ttl, config.redis_max_bytes))
        stores_by_model[namespace] = stores
        log.info("prefix checkpoints: %s", ", ".join(
            f"{s.name} {getattr(s, 'folder', None) or getattr(s, 'url', '')}" for s in stores))
    return CheckpointTier(PrefixCheckpoints(stores, geometry), worker)


def checkpoint_stats(engine) -> scheduler_pb2.PrefixCheckpointStats:
    tier = engine.checkpoints
    out = scheduler_pb2.PrefixCheckpointStats(
        restored_tokens=engine.restored_tokens, saved_blocks=tier.stats.saved_blocks,
        saves_dropped=tier.stats.saves_dropped, rejected=dict(tier.checkpoints.rejected),
        restored_bytes=tier.stats.restored_bytes, restore_seconds=tier.stats.restore_seconds)
    for store in tier.checkpoints.stores:
        st = store.stats
        out.stores.add(name=store.name, hits=st.hits, misses=st.misses, puts=st.puts, put_failures=st.put_failures,
                       errors=st.errors, evictions=st.evictions, available=store.available)
    return out
