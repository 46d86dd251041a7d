"""Shared-memory tensors: round trips, segment reuse, inline mode, and cleanup after exit, SIGTERM and SIGKILL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from shared import shm
from shared.shm import SHM_DIR, ShmArena, ShmReader, TensorRef, sweep_stale_segments
from shared.tensor_codec import TensorCodec, is_local_address, resolve_transport

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")

ARRAYS = [
    np.arange(12, dtype=np.float32).reshape(3, 4),
    np.arange(10, dtype=np.int64)[::2],                      # not contiguous
    np.asfortranarray(np.arange(6, dtype=np.int32).reshape(2, 3)),
    np.array(3.5, dtype=np.float16),                         # 0-d
    np.zeros((0, 7), dtype=np.float64),                      # empty
    np.array([True, False, True]),
    np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
    np.arange(5, dtype=">i4"),                               # big-endian kept as such
    np.array([1 + 2j, -3j], dtype=np.complex64),
]


def _segments_of(pid: int) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"ts-{pid}-"))


def _check(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def test_round_trip_dtypes_and_shapes():
    reader = ShmReader()
    with ShmArena(initial_bytes=256) as arena:
        refs = [arena.put(a) for a in ARRAYS]                # grows past 256 bytes mid-message
        assert all(r.offset % shm.ALIGN == 0 for r in refs)
        for a, r in zip(ARRAYS, refs):
            got = reader.get(r)
            _check(a, got)
            assert got.flags.writeable
            view = reader.get(r, copy=False)
            _check(a, view)
            assert not view.flags.writeable
    reader.close()


def test_segments_are_reused_across_messages():
    mine = os.getpid()
    before = _segments_of(mine)
    reader = ShmReader()
    rng = np.random.default_rng(0)
    with ShmArena(initial_bytes=1 << 16) as arena:
        arena.put(np.zeros(1 << 17, np.uint8))               # larger than initial_bytes: sized to fit
        arena.reset()
        names = arena.segment_names
        assert len(names) == 1 and arena.capacity >= 1 << 17
        counts = set()
        for step in range(200):
            arena.reset()
            arrays = [rng.standard_normal((step % 7 + 1, 64)).astype(np.float32), np.arange(step + 1)]
            refs = [arena.put(a) for a in arrays]
            for a, r in zip(arrays, refs):
                _check(a, reader.get(r))
            assert arena.segment_names == names
            counts.add(len(_segments_of(mine)))
        assert counts == {len(before) + 1}
        assert reader.mapped == names
    assert _segments_of(mine) == before
    reader.close()


def test_outgrown_segment_lives_until_reset_and_reader_forgets_it():
    reader = ShmReader()
    with ShmArena(initial_bytes=4096) as arena:
        small = np.arange(100, dtype=np.int64)
        r1 = arena.put(small)
        r2 = arena.put(np.ones(10_000, np.float32))          # does not fit: a second segment
        assert r1.shm_name != r2.shm_name and len(arena.segment_names) == 2
        _check(small, reader.get(r1))                        # the first is still valid in this message
        arena.reset()
        assert arena.segment_names == [r2.shm_name]
        assert not (SHM_DIR / r1.shm_name).exists()
        with pytest.raises(FileNotFoundError, match="gone"):
            ShmReader().get(r1)
        r3 = arena.put(np.full((50, 50), 7, np.int16))
        reader.get(r3)
        assert r1.shm_name not in reader.mapped               # pruned on the next miss
    reader.close()


def test_reader_rejects_bad_refs():
    reader = ShmReader()
    with ShmArena(initial_bytes=4096) as arena:
        r = arena.put(np.arange(10, dtype=np.int64))
        with pytest.raises(ValueError, match="do not fit"):
            reader.get(TensorRef(r.shm_name, 4000, "<i8", (100,)))
        with pytest.raises(ValueError, match="not a TensorServe"):
            reader.get(TensorRef("PostgreSQL.1", 0, "<i8", (1,)))    # only our own segments are readable
    with pytest.raises(TypeError):
        ShmArena(sweep=False).put(np.array([object()]))


def test_inline_mode():
    codec = TensorCodec("inline")
    for a in ARRAYS:
        msg = codec.encode(a)
        assert msg.WhichOneof("storage") == "inline_tensor"
        _check(a, codec.decode(type(msg).FromString(msg.SerializeToString())))
    big = codec.encode(np.zeros(1 << 16, np.float32))
    assert big.WhichOneof("storage") == "inline_tensor"
    bad = codec.encode(np.arange(4, dtype=np.int32))
    bad.inline_tensor.data = bad.inline_tensor.data[:-1]
    with pytest.raises(ValueError, match="needs 16 bytes"):
        codec.decode(bad)


def test_shm_codec_sends_small_arrays_inline():
    with ShmArena() as arena:
        codec = TensorCodec("shm", arena=arena, shm_min_bytes=4096)
        assert codec.encode(np.arange(4)).WhichOneof("storage") == "inline_tensor"
        msg = codec.encode(np.arange(4096))
        assert msg.WhichOneof("storage") == "ref"
        _check(np.arange(4096), codec.decode(msg))
        codec.close()


def test_transport_setting():
    assert resolve_transport(None, "127.0.0.1:50052") == "shm"
    assert resolve_transport(None, "worker:50052") == "inline"
    assert resolve_transport("inline", "localhost:1") == "inline"
    assert resolve_transport("auto", "[::1]:50052") == "shm"
    with pytest.raises(ValueError, match="shm, inline or auto"):
        resolve_transport("rdma")
    assert all(is_local_address(a) for a in ("localhost:5", "[::1]:5", "127.0.0.2:5", "unix:/tmp/s", "::1"))
    assert not any(is_local_address(a) for a in ("10.0.0.2:5", "example.com:5", "", None))


# ----------------------------------------------------------------- cleanup across processes
CHILD = textwrap.dedent("""
    import sys, time
    import numpy as np
    from shared.shm import ShmArena
    arena = ShmArena(initial_bytes=4096)
    arena.put(np.zeros(100, np.float32))
    arena.put(np.zeros(10_000, np.float32))       # outgrows the first segment: two are live
    other = ShmArena(initial_bytes=4096)
    other.put(np.ones(10, np.int64))
    print(" ".join(arena.segment_names + other.segment_names), flush=True)
    if sys.argv[1] == "exit":
        sys.exit(0)
    time.sleep(60)
""")


def _start_child(mode: str) -> tuple[subprocess.Popen, list[str]]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, mode], cwd=REPO, stdout=subprocess.PIPE, text=True)
    names = proc.stdout.readline().split()
    assert len(names) == 3, names
    return proc, names


@pytest.mark.parametrize("mode", ["exit", "sigterm"])
def test_segments_are_unlinked_when_the_process_ends(mode: str):
    proc, names = _start_child(mode)
    if mode == "sigterm":
        assert all((SHM_DIR / n).exists() for n in names)
        proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
    assert rc == (0 if mode == "exit" else -signal.SIGTERM)
    assert _segments_of(proc.pid) == []


def test_sweep_after_kill_9_leaves_nothing_of_the_dead_process():
    proc, names = _start_child("sleep")
    try:
        proc.kill()                                      # SIGKILL: no handler runs
    finally:
        proc.wait(timeout=30)
    assert _segments_of(proc.pid) == sorted(names)       # the crash left them behind
    # a restarted worker sweeps at start
    out = subprocess.run([sys.executable, "-c", "from shared.shm import sweep_stale_segments as s; print(' '.join(s()))"],
                         cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert set(names) <= set(out.stdout.split())
    assert _segments_of(proc.pid) == []


def test_sweep_spares_live_processes():
    proc, names = _start_child("sleep")
    try:
        assert not set(sweep_stale_segments()) & set(names)
        assert all((SHM_DIR / n).exists() for n in names)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    sweep_stale_segments()
    assert _segments_of(proc.pid) == []
