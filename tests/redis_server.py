"""A private `redis-server` on a free port for the tests (skipped where the binary is missing)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from processes import free_port, wait_for


class RedisServer:
    def __init__(self, port: int, workdir):
        self.port, self.workdir, self.proc = port, workdir, None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)

        def up():
            try:
                return client.ping()
            except redis.RedisError:
                return False
        assert wait_for(up, 10), "redis-server did not start"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def redis_server(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed here: the Redis store's tests need a private one")
    server = RedisServer(free_port(), tmp_path)
    server.start()
    yield server
    if server.proc.poll() is None:
        server.kill()
