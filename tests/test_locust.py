"""The locust load test (loadtest/locustfile.py, through loadtest/run_locust.py): 8 users streaming over
HTTP and gRPC for 10 s against `tensorserve serve` make requests, none of which fails, and report time
to first token and inter-token latency of both APIs as entries of their own in locust's CSV."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from processes import REPO, start_with_ready_file, stop

START_TIMEOUT = 180      # the first start compiles the kernels
USERS, DURATION_S = 8, 10      # every user's request in flight at the end finishes within --stop-timeout
# few tokens a request: with a busy CPU (a 2-core runner shared with other work) a decode step of 5-8
# sequences took up to ~3 s, and a user's request must end within --stop-timeout to be counted
MAX_TOKENS = 8


def test_locust_http_and_grpc_users_stream_without_failures(tmp_path: Path):
    ready = tmp_path / "serve.json"
    proc, info = start_with_ready_file(
        [sys.executable, "-m", "tensorserve", "serve", "--http-port", "0", "--grpc-port", "0",
         "--kv-memory", "256MiB", "--grace-period", "5", "--ready-file", str(ready)],
        ready, tmp_path / "serve.log", timeout=START_TIMEOUT, name="serve", log_chars=4000)
    prefix = tmp_path / "locust"
    try:
        run = subprocess.run(
            [sys.executable, str(REPO / "loadtest" / "run_locust.py"), "--host", f"http://{info['http']}",
             "--grpc-target", info["grpc"], "--users", str(USERS), "--spawn-rate", str(USERS),
             "--duration", f"{DURATION_S}s", "--stop-timeout", "30", "--max-tokens", str(MAX_TOKENS),
             "--csv", str(prefix), "--json"],
            cwd=REPO, capture_output=True, text=True, timeout=DURATION_S + 90)
    finally:
        serve_rc = stop(proc, timeout=30)
    locust_log = Path(f"{prefix}_locust.log")
    context = (f"run_locust.py exited {run.returncode}\nstdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"
               + (f"\nlocust log:\n{locust_log.read_text(errors='replace')[-3000:]}" if locust_log.exists() else ""))

    assert Path(f"{prefix}_stats.csv").exists(), f"locust wrote no CSV\n{context}"
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    with open(f"{prefix}_failures.csv", newline="") as f:
        failures = list(csv.DictReader(f))
    print(f"\nlocust, {USERS} users for {DURATION_S} s over HTTP and gRPC (times in ms):")
    for (kind, name), r in sorted(rows.items()):
        print(f"  {kind:5} {name:22} n={r['Request Count']:>4} fails={r['Failure Count']} "
              f"p50={r['50%']} p99={r['99%']}")

    total = rows.pop(("", "Aggregated"))
    assert int(total["Failure Count"]) == 0 and not failures, f"failures: {failures}\n{context}"

    def count(kind: str, name_prefix: str) -> int:
        return sum(int(r["Request Count"]) for (t, name), r in rows.items() if t == kind and name.startswith(name_prefix))
    assert count("POST", "/v1/") > 0, f"no streamed HTTP request ended in {sorted(rows)}\n{context}"
    assert count("grpc", "Generate") > 0, f"no streamed gRPC call ended in {sorted(rows)}\n{context}"
    for api in ("http", "grpc"):
        for kind in ("TTFT", "ITL"):
            assert count(kind, api) > 0, f"no {kind} entry for {api} in {sorted(rows)}\n{context}"
    assert run.returncode == 0, context
    assert json.loads(run.stdout)["failures"] == 0
    assert serve_rc == 0, f"tensorserve serve exited with {serve_rc} after SIGTERM (None: needed SIGKILL)"
