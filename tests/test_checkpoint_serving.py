"""Prefix checkpoints through `tensorserve serve`, as a user runs it: a long shared prefix computed
once is restored after a full restart of all three processes (from the checkpoint directory), by
a second stack sharing one Redis, and past corrupted values; the output always equals the cold
run's, tokens and log-probabilities. Redis absent, killed and back, and an unwritable directory
never stop serving."""
from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import httpx
import pytest

from processes import free_port, start_with_ready_file, stop, wait_for
from redis_server import RedisServer

START_TIMEOUT = 180
BLOCK = 16
# about 1500 tokens of text that SmolLM2's tokenizer does not compress into a few repeated pieces
PREFIX = " ".join(f"Clause {i}: the {['red', 'blue', 'green', 'amber'][i % 4]} ledger lists item {i * 7 % 113} "
                  f"beside {i * 13 % 97} others." for i in range(96))
QUESTION = " Summarize the ledger in one sentence:"


def start_stack(tmp: Path, name: str, checkpoint_dir: Path | str, *extra: str) -> tuple:
    ready = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "tensorserve", "serve", "--http-port", "0", "--grpc-port", "0",
           "--kv-memory", "96MiB", "--grace-period", "5", "--ready-file", str(ready),
           "--checkpoint-dir", str(checkpoint_dir), *extra]
    return start_with_ready_file(cmd, ready, tmp / f"{name}.log", timeout=START_TIMEOUT, name=name,
                                 env={"TS_PREFIX_CHECKPOINTS": "1"})


def complete(info: dict, prompt: str = PREFIX + QUESTION, max_tokens: int = 8) -> dict:
    r = httpx.post(f"http://{info['http']}/v1/completions", timeout=300, json={
        "model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    return {"text": choice["text"], "tokens": choice["logprobs"]["tokens"],
            "logprobs": choice["logprobs"]["token_logprobs"], "prompt_tokens": body["usage"]["prompt_tokens"],
            "cached": body["usage"]["prompt_tokens_details"]["cached_tokens"]}


def metric(info: dict, name: str, **labels: str) -> float:
    text = httpx.get(f"http://{info['http']}/metrics", timeout=10).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", line)
        if m and all(part in (m.group(1) or "") for part in want.split(",") if part):
            total += float(m.group(2))
    return total


def wait_saved(info: dict, store: str, blocks: int, timeout: float = 60) -> None:
    """Checkpoints are written in the background: wait until the store took the prompt's blocks."""
    def done():
        # the stats reach /metrics on the router's next poll of the scheduler
        return metric(info, "tensorserve_checkpoint_store_puts_total", store=store) >= blocks
    assert wait_for(done, timeout, interval=0.5), f"the {store} store did not receive {blocks} blocks"


def assert_same_output(warm: dict, cold: dict) -> None:
    assert warm["tokens"] == cold["tokens"]
    assert warm["logprobs"] == pytest.approx(cold["logprobs"], abs=2e-4)


@pytest.fixture
def redis(tmp_path):
    import shutil
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed here: the Redis store's tests need a private one")
    server = RedisServer(free_port(), tmp_path)
    yield server
    if server.proc is not None and server.proc.poll() is None:
        server.kill()


@pytest.fixture(scope="module")
def computed(tmp_path_factory):
    """Stack A computes the prefix cold once for the module, checkpointing its full blocks into its
    directory and into a Redis that outlives it (none where redis-server is missing), and stops
    cleanly. Each test restores from a copy of that directory (one of them corrupts files), and
    from the same Redis."""
    import shutil
    tmp = tmp_path_factory.mktemp("computed")
    server = RedisServer(free_port(), tmp) if shutil.which("redis-server") else None
    if server is not None:
        server.start()
    try:
        proc, info = start_stack(tmp, "stack-a", tmp / "dir-a", *(["--redis-url", server.url] if server else []))
        try:
            cold = complete(info)
            assert cold["prompt_tokens"] >= 1500 and cold["cached"] == 0
            full_blocks = (cold["prompt_tokens"] - 1) // BLOCK
            wait_saved(info, "directory", full_blocks)
            if server is not None:
                wait_saved(info, "redis", full_blocks)
        finally:
            assert stop(proc, timeout=60) == 0
        yield {"cold": cold, "full_blocks": full_blocks, "directory": tmp / "dir-a", "redis": server}
    finally:
        if server is not None and server.proc.poll() is None:
            server.kill()


def copy_of(directory: Path, to: Path) -> Path:
    import shutil
    return Path(shutil.copytree(directory, to))


def test_a_full_restart_restores_a_1500_token_prefix_from_the_directory(tmp_path, computed):
    cold, full_blocks = computed["cold"], computed["full_blocks"]
    checkpoints = copy_of(computed["directory"], tmp_path / "checkpoints")
    # every process new, the directory its only store: an empty pool
    proc, info = start_stack(tmp_path, "restarted", checkpoints)
    try:
        warm = complete(info)
        assert warm["cached"] == full_blocks * BLOCK
        assert_same_output(warm, cold)
        assert metric(info, "tensorserve_prefix_checkpoint_restored_tokens_total") == full_blocks * BLOCK
        # a different question after the same prefix: the prefix is in the pool now, the rest is computed
        other = complete(info, PREFIX + " List three items:")
        assert other["cached"] >= (full_blocks - 2) * BLOCK
    finally:
        stop(proc, timeout=60)


def test_a_second_stack_reuses_through_redis_and_corrupted_values_are_misses(tmp_path, computed):
    cold, full_blocks, redis = computed["cold"], computed["full_blocks"], computed["redis"]
    if redis is None:
        pytest.skip("redis-server is not installed here: the Redis store's tests need a private one")
    dir_a = copy_of(computed["directory"], tmp_path / "dir-a")
    second_proc, second = start_stack(tmp_path, "stack-b", tmp_path / "dir-b", "--redis-url", redis.url)
    try:
        warm = complete(second)
        assert warm["cached"] == full_blocks * BLOCK          # computed by stack A, read from Redis
        assert_same_output(warm, cold)
        assert metric(second, "tensorserve_checkpoint_store_hits_total", store="redis") == full_blocks
    finally:
        stop(second_proc, timeout=60)

    # flip one byte of block 10 in stack A's directory and of block 20 in Redis, then restart A:
    # blocks 0-9 come from the directory, 10-19 from Redis, and the rest is computed again
    files = {p.stem: p for p in dir_a.rglob("*.tskv")}
    import redis as redis_client
    client = redis_client.Redis.from_url(redis.url)
    keys = {key.decode().rsplit(":", 1)[1]: key for key in client.keys("tensorserve:kv:*")}
    assert len(files) >= full_blocks and len(keys) >= full_blocks
    hashes = _chain_from_files(files)
    corrupt = bytearray(files[hashes[10]].read_bytes())
    corrupt[len(corrupt) // 2] ^= 0x40
    files[hashes[10]].write_bytes(bytes(corrupt))
    value = bytearray(client.get(keys[hashes[20]]))
    value[len(value) // 3] ^= 0x01
    client.set(keys[hashes[20]], bytes(value))

    proc, info = start_stack(tmp_path, "stack-a-again", dir_a, "--redis-url", redis.url)
    try:
        warm = complete(info)
        assert warm["cached"] == 20 * BLOCK
        assert_same_output(warm, cold)
        assert metric(info, "tensorserve_prefix_checkpoint_rejected_total") == 2
        log = (tmp_path / "stack-a-again.log").read_text()
        assert "checksum mismatch" in log
    finally:
        stop(proc, timeout=60)


def _chain_from_files(files: dict[str, Path]) -> list[str]:
    """The stored blocks' hashes in prefix order (each header names its parent)."""
    import json
    import struct
    parent_of = {}
    for stem, path in files.items():
        data = path.read_bytes()
        _, _, header_len = struct.unpack_from("<4sHI", data)
        header = json.loads(data[10:10 + header_len])
        parent_of[stem] = header["parent"]
    chain, current = [], None
    children = {p: s for s, p in parent_of.items()}
    while current in children:
        current = children[current]
        chain.append(current)
    return chain


def test_redis_gone_at_start_killed_and_back_and_an_unwritable_directory_never_stop_serving(tmp_path, redis):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the checkpoint folder should be: every directory write fails")
    proc, info = start_stack(tmp_path, "faults", blocker, "--redis-url", redis.url)   # Redis not started yet
    try:
        def ask(i: int) -> dict:
            return complete(info, f"Note {i}: " + PREFIX[:1200] + QUESTION, max_tokens=4)
        assert ask(0)["tokens"]
        assert metric(info, "tensorserve_checkpoint_store_available", store="redis") == 0
        assert metric(info, "tensorserve_checkpoint_store_put_failures_total", store="directory") > 0
        redis.start()                                       # Redis comes up: checkpoints resume
        time.sleep(2.5)                                     # the store's back-off after a failure
        assert ask(1)["tokens"]
        wait_saved(info, "redis", 1)
        redis.kill()                                        # killed mid-run: serving goes on
        puts = metric(info, "tensorserve_checkpoint_store_puts_total", store="redis")
        assert ask(2)["tokens"]
        redis.start()
        time.sleep(2.5)
        assert ask(3)["tokens"]
        wait_saved(info, "redis", puts + 1)
        assert httpx.get(f"http://{info['http']}/health", timeout=10).status_code == 200
    finally:
        stop(proc, timeout=60)
