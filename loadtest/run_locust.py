"""Run loadtest/locustfile.py headless against a TensorServe stack started here, as `make loadtest` does.

Starts `tensorserve serve` on free ports (HTTP and gRPC), waits for its ready file, runs locust
with both users (or those --tags selects), stops the stack with SIGTERM, prints a summary of
locust's CSV (requests, failures, TTFT and ITL percentiles per API) and exits non-zero when any
request failed, none was made, or locust or the server did not end cleanly.

    python loadtest/run_locust.py [--users 8] [--spawn-rate 4] [--duration 60s] [--tags http,grpc]
                                  [--csv /tmp/tensorserve-locust/locust] [--serve-args "--kv-memory 256MiB"]
                                  [--json] [-- EXTRA LOCUST ARGS]

Locust writes PREFIX_stats.csv, PREFIX_stats_history.csv, PREFIX_failures.csv and
PREFIX_exceptions.csv; the server's log goes to PREFIX_serve.log and locust's to PREFIX_locust.log.
With --host the stack is not started: locust runs against that HTTP base URL and --grpc-target.

loadtest/soak.py imports start_stack, stop_stack, locust_command, clean_prefix, read_stats and
summarize from here.
"""
from __future__ import annotations

import argparse
import csv
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"
DEFAULT_CSV = "/tmp/tensorserve-locust/locust"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", "-u", type=int, default=8, help="concurrent users (default 8)")
    p.add_argument("--spawn-rate", "-r", type=float, default=4, help="users started per second (default 4)")
    p.add_argument("--duration", "-t", default="60s", help="run time, locust's syntax: 20s, 2m (default 60s)")
    p.add_argument("--tags", default="", help="comma- or space-separated: http, grpc (default: both)")
    p.add_argument("--csv", default=DEFAULT_CSV, help=f"locust's CSV prefix (default {DEFAULT_CSV})")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (locustfile's default 24)")
    p.add_argument("--serve-args", default="", help="extra arguments of `tensorserve serve`, one shell string")
    p.add_argument("--start-timeout", type=float, default=300, help="seconds the stack may take to start")
    p.add_argument("--stop-timeout", type=int, default=30,
                   help="seconds users get to finish their request at the end (locust --stop-timeout)")
    p.add_argument("--host", default="", help="run against this HTTP base URL instead of starting a stack")
    p.add_argument("--grpc-target", default="", help="with --host: the gRPC address")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("locust_args", nargs="*", help="after --: more locust arguments")
    return p.parse_args(argv)


def start_stack(serve_args: list[str], workdir: Path, log: Path, timeout: float) -> tuple[subprocess.Popen, dict]:
    ready = workdir / "serve.json"
    cmd = [sys.executable, "-m", "tensorserve", "serve", "--http-port", "0", "--grpc-port", "0",
           *serve_args, "--ready-file", str(ready)]
    print("starting:", shlex.join(cmd), file=sys.stderr, flush=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while True:
        if ready.exists():
            try:
                return proc, json.loads(ready.read_text())
            except json.JSONDecodeError:
                pass                                  # being written
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_stack(proc)
            why = f"exited with {proc.returncode}" if proc.returncode is not None else f"not ready in {timeout:.0f} s"
            raise SystemExit(f"tensorserve serve {why}; its log ({log}):\n"
                             + log.read_text(errors="replace")[-4000:])
        time.sleep(0.1)


def clean_prefix(prefix: str) -> None:
    """Makes the CSV prefix's folder and removes an earlier run's files (locust appends to its log)."""
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    for old in [*Path(prefix).parent.glob(Path(prefix).name + "_*.csv"), Path(f"{prefix}_locust.log")]:
        old.unlink(missing_ok=True)


def locust_command(host: str, grpc_target: str, prefix: str, *, users: int, spawn_rate: float, duration: str,
                   stop_timeout: int, max_tokens: int | None = None, tags: list[str] | None = None,
                   extra: list[str] | None = None) -> list[str]:
    """locust headless with loadtest/locustfile.py, CSV files and log under `prefix`."""
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
           "-u", str(users), "-r", f"{spawn_rate:g}", "-t", duration,
           "--stop-timeout", str(stop_timeout), "--host", host, "--csv", prefix,
           "--logfile", f"{prefix}_locust.log"]
    if grpc_target:
        cmd += ["--grpc-target", grpc_target]
    if max_tokens is not None:
        cmd += ["--max-tokens", str(max_tokens)]
    if tags:
        cmd += ["--tags", *tags]
    return cmd + list(extra or ())


def stop_stack(proc: subprocess.Popen, timeout: float = 60) -> int | None:
    """SIGTERM, then SIGKILL after `timeout` s; the exit code, None when it needed SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


def read_stats(prefix: str) -> list[dict]:
    with open(f"{prefix}_stats.csv", newline="") as f:
        return list(csv.DictReader(f))


def _num(row: dict, key: str) -> float | None:
    value = row.get(key, "")
    try:
        return float(value)
    except ValueError:
        return None                                    # "N/A"


def summarize(rows: list[dict]) -> dict:
    """Totals and, per (Type, Name) entry, count, failures and p50/p90/p99 in ms."""
    entries = {}
    for row in rows:
        if row["Name"] == "Aggregated":
            continue
        entries[f"{row['Type']} {row['Name']}"] = {
            "requests": int(row["Request Count"]), "failures": int(row["Failure Count"]),
            "p50_ms": _num(row, "50%"), "p90_ms": _num(row, "90%"), "p99_ms": _num(row, "99%"),
            "avg_ms": _num(row, "Average Response Time")}
    # requests proper: the whole streamed calls, not their TTFT/ITL entries
    calls = {k: v for k, v in entries.items() if not k.startswith(("TTFT ", "ITL "))}
    return {"requests": sum(v["requests"] for v in calls.values()),
            "failures": sum(v["failures"] for v in entries.values()),
            "entries": entries}


def print_summary(summary: dict) -> None:
    print(f"\n{'entry':34} {'count':>7} {'fails':>6} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    for name, e in sorted(summary["entries"].items(), key=lambda kv: (kv[0].split()[0] in ("TTFT", "ITL"), kv[0])):
        fmt = lambda x: "-" if x is None else f"{x:.0f}"  # noqa: E731
        print(f"{name:34} {e['requests']:>7} {e['failures']:>6} {fmt(e['p50_ms']):>8} {fmt(e['p90_ms']):>8} "
              f"{fmt(e['p99_ms']):>8}")
    print(f"\nrequests {summary['requests']}, failures {summary['failures']}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prefix = str(Path(args.csv).resolve())
    clean_prefix(prefix)
    tags = args.tags.replace(",", " ").split()

    proc = None
    serve_rc = 0
    with tempfile.TemporaryDirectory(prefix="tensorserve-locust-") as tmp:
        if args.host:
            host, grpc_target = args.host, args.grpc_target
        else:
            proc, info = start_stack(shlex.split(args.serve_args), Path(tmp), Path(f"{prefix}_serve.log"),
                                     args.start_timeout)
            host, grpc_target = f"http://{info['http']}", info["grpc"]
        cmd = locust_command(host, grpc_target, prefix, users=args.users, spawn_rate=args.spawn_rate,
                             duration=args.duration, stop_timeout=args.stop_timeout, max_tokens=args.max_tokens,
                             tags=tags, extra=args.locust_args)
        print("running:", shlex.join(cmd), file=sys.stderr, flush=True)
        try:
            locust_rc = subprocess.call(cmd, cwd=ROOT, stdout=sys.stderr if args.json else None)
        finally:
            if proc is not None:
                serve_rc = stop_stack(proc)

    if not Path(f"{prefix}_stats.csv").exists():
        print(f"loadtest: locust (exit code {locust_rc}) wrote no {prefix}_stats.csv; see its messages above "
              f"and {prefix}_locust.log", file=sys.stderr)
        return 1
    summary = summarize(read_stats(prefix))
    summary.update(csv_prefix=prefix, locust_exit_code=locust_rc, serve_exit_code=serve_rc)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print_summary(summary)
        print(f"CSV: {prefix}_stats.csv (and _stats_history, _failures, _exceptions)")
    problems = []
    if summary["failures"]:
        problems.append(f"{summary['failures']} failure(s): see {prefix}_failures.csv")
    if not summary["requests"]:
        problems.append("no request was made")
    if locust_rc:
        problems.append(f"locust exited with {locust_rc}")
    if serve_rc != 0:
        problems.append(f"tensorserve serve exited with {serve_rc} (None: it needed SIGKILL)")
    for problem in problems:
        print("loadtest:", problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
