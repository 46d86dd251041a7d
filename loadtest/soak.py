"""Soak test: locust against `tensorserve serve` for minutes, watching memory, /dev/shm and (optionally)
recovery from a worker killed with SIGKILL half-way (issue #27: the soak figure).

    python loadtest/soak.py --users 64 --spawn-rate 8 --duration 300 [--kill-worker-at 150] [--warmup 30]
                            --out DIR [--serve-args "--kv-memory 512MiB"] [--max-tokens N]
                            [--disconnect-share 0.1] [--long-share 0.25] [--stop-timeout 120]

What it does, in order:

  1. starts `tensorserve serve` on free ports (loadtest/run_locust.py's start_stack) and notes the
     /dev/shm segments (ts-<pid>-*) that were there before;
  2. runs locust headless (loadtest/locustfile.py, HTTP and gRPC users streaming) for --duration s
     with --disconnect-share of the requests leaving mid-stream and --long-share of them with a long
     prompt; CSV files DIR/locust_*.csv, every ended request as a JSON line in DIR/requests.jsonl;
  3. meanwhile: samples the RSS of router, scheduler and worker (the children of serve whose command
     line has router.main, scheduler.main, worker.main; the worker's pid changes when it is restarted)
     after --warmup s of load ("start") and every 5 s (DIR/rss.csv); polls the router's /health each
     second; with --kill-worker-at T, sends SIGKILL to the worker T s after locust started;
  4. when locust has ended (its users finish their request within --stop-timeout), samples RSS again
     ("end"), reads the restart counts from the router's /metrics, and lists /dev/shm: every ts-<pid>-*
     segment of a process of this stack must belong to one that is alive now;
  5. stops serve with SIGTERM and lists what of this stack is left in /dev/shm (nothing should be);
  6. prints one JSON summary and writes it to DIR/soak.json.

Times "into the run" count from locust's start. A failure was "in flight at the kill" when the request
started before the kill and ended after it (wall-clock times from DIR/requests.jsonl); failures of
requests that started after the kill, while /health said 503, are counted as "during the outage".
Segments in /dev/shm of processes that are not this stack's (other servers on the machine) are listed
as foreign and do not count.

Exit status 0 only when the targets are met: requests were made; no failure (with --kill-worker-at:
failures only among the requests in flight at the kill); RSS growth from start to end under
--rss-growth-limit % (5) for each of router, scheduler and worker; no segment in /dev/shm of a dead
process of this stack at the end, none of this stack left after it stopped; serve stopped cleanly.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from run_locust import (ROOT, clean_prefix, locust_command, read_stats, start_stack,  # noqa: E402
                        stop_stack, summarize)

ROLES = ("router", "scheduler", "worker")
SHM_DIR = Path("/dev/shm")
SHM_NAME = re.compile(r"^ts-(\d+)-")
RESTARTS = re.compile(r'^tensorserve_process_restarts_total\{process="([^"]+)"\}\s+(\S+)', re.M)
RSS_EVERY_S = 5.0
HEALTH_EVERY_S = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", "-u", type=int, default=64, help="concurrent users (default 64)")
    p.add_argument("--spawn-rate", "-r", type=float, default=8, help="users started per second (default 8)")
    p.add_argument("--duration", "-t", type=float, default=300, help="seconds of load (default 300)")
    p.add_argument("--warmup", type=float, default=30,
                   help="seconds of load before the 'start' RSS sample (default 30)")
    p.add_argument("--kill-worker-at", type=float, default=None, metavar="T",
                   help="send SIGKILL to the worker T seconds into the run (default: never)")
    p.add_argument("--out", required=True, help="folder for soak.json, locust's CSV files, logs")
    p.add_argument("--serve-args", default="", help="extra arguments of `tensorserve serve`, one shell string")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per request (locustfile's default 24)")
    p.add_argument("--disconnect-share", type=float, default=0.1,
                   help="share of requests whose client leaves mid-stream (default 0.1)")
    p.add_argument("--long-share", type=float, default=None,
                   help="share of requests with a long prompt (locustfile's default 0.25)")
    p.add_argument("--request-timeout", type=float, default=300, help="seconds a request may take (default 300)")
    p.add_argument("--stop-timeout", type=int, default=120,
                   help="seconds users get to finish their request when the time is up (default 120)")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds the stack may take to start")
    p.add_argument("--rss-growth-limit", type=float, default=5.0, help="target: RSS growth under this %% (5)")
    args = p.parse_args(argv)
    if args.warmup >= args.duration:
        p.error("--warmup must be shorter than --duration")
    if args.kill_worker_at is not None and not 0 < args.kill_worker_at < args.duration:
        p.error("--kill-worker-at must be within (0, --duration)")
    return args


# ------------------------------------------------------------------ processes of the stack
class Stack:
    """serve's process tree: the current router, scheduler and worker, and every pid seen in it."""

    def __init__(self, serve_pid: int, ready_pids: dict):
        self.serve = psutil.Process(serve_pid)
        self.known: dict[int, str] = {serve_pid: "serve"}      # every pid of this stack seen, and its role
        self.known.update({int(pid): role for role, pid in ready_pids.items()})
        self.worker_pids: list[int] = [int(ready_pids["worker"])]

    @staticmethod
    def _role(proc: psutil.Process) -> str | None:
        try:
            cmdline = proc.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return None
        for role in ROLES:
            if f"{role}.main" in cmdline:
                return role
        return None

    def current(self) -> dict[str, psutil.Process]:
        """role -> the live child of serve that plays it; also notes every descendant's pid."""
        found: dict[str, psutil.Process] = {}
        try:
            children = self.serve.children(recursive=True)
        except psutil.NoSuchProcess:
            return found
        for child in children:
            role = self._role(child)
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    continue
            except psutil.NoSuchProcess:
                continue
            self.known.setdefault(child.pid, role or "other")
            if role and child.ppid() == self.serve.pid:
                found[role] = child
                if role == "worker" and child.pid not in self.worker_pids:
                    self.worker_pids.append(child.pid)
        return found

    def live_pids(self) -> set[int]:
        pids = {p.pid for p in self.current().values()}
        if self.serve.is_running():
            pids.add(self.serve.pid)
        return pids

    def rss(self) -> dict[str, dict]:
        out = {}
        for role, proc in self.current().items():
            try:
                out[role] = {"pid": proc.pid, "rss": proc.memory_info().rss}
            except psutil.NoSuchProcess:
                pass
        return out


# ------------------------------------------------------------------ router's /health and /metrics
def http_get(url: str, timeout: float = 5) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")
    except Exception as exc:  # noqa: BLE001 - timeouts, refused connections
        return None, f"{type(exc).__name__}: {exc}"


class HealthWatch(threading.Thread):
    """Polls /health every second; keeps the changes of its status as (wall time, status)."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.url = f"{base}/health"
        self.changes: list[tuple[float, int | None]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        last = "unset"
        while not self.stopping.is_set():
            status, _ = http_get(self.url, timeout=HEALTH_EVERY_S * 3)
            if status != last:
                self.changes.append((time.time(), status))
                last = status
            self.stopping.wait(HEALTH_EVERY_S)

    def outage_after(self, t: float) -> tuple[float | None, float | None]:
        """(first time /health was not 200 at or after t, first 200 after that)."""
        down = up = None
        for when, status in self.changes:
            if down is None:
                if when >= t and status != 200:
                    down = when
            elif status == 200:
                up = when
                break
        return down, up


def restart_counts(base: str) -> dict[str, float] | str:
    status, text = http_get(f"{base}/metrics", timeout=10)
    if status != 200:
        return f"GET /metrics: {status}: {text[:200]}"
    return {name: float(value) for name, value in RESTARTS.findall(text)}


# ------------------------------------------------------------------ /dev/shm
def shm_segments() -> dict[str, int]:
    """ts-<pid>-* segment name -> pid."""
    out = {}
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return out
    for name in names:
        m = SHM_NAME.match(name)
        if m:
            out[name] = int(m.group(1))
    return out


def shm_report(stack: Stack, before: set[str], live: set[int]) -> dict:
    segments = shm_segments()
    ours, stale, foreign = {}, [], []
    for name, pid in sorted(segments.items()):
        if pid in stack.known:
            role = stack.known[pid]
            alive = pid in live
            entry = ours.setdefault(str(pid), {"role": role, "alive": alive, "segments": []})
            entry["segments"].append(name)
            if not alive:
                stale.append(name)
        else:
            foreign.append({"name": name, "pid": pid, "alive": psutil.pid_exists(pid), "there_before": name in before})
    return {"segments_of_this_stack": sum(len(e["segments"]) for e in ours.values()), "by_pid": ours,
            "stale": stale, "only_live_processes": not stale, "foreign": foreign}


# ------------------------------------------------------------------ analysis
def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)], 1)


def read_request_log(path: Path) -> list[dict]:
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass                                         # a line cut short
    return records


def per_api(records: list[dict]) -> dict:
    out = {}
    for api in ("http", "grpc"):
        mine = [r for r in records if r["api"] == api]
        ok = [r for r in mine if r["ok"]]
        ttft = [r["ttft_ms"] for r in ok if r.get("ttft_ms") is not None]
        itl = [g for r in ok for g in r.get("itl_ms", ())]
        out[api] = {"requests": len(mine), "failures": len(mine) - len(ok),
                    "left_early": sum(1 for r in ok if r.get("left_early")),
                    "ttft_ms": {"n": len(ttft), "p50": percentile(ttft, 50), "p99": percentile(ttft, 99)},
                    "itl_ms": {"n": len(itl), "p50": percentile(itl, 50), "p99": percentile(itl, 99)}}
    return out


def read_failures_csv(prefix: str) -> list[dict]:
    try:
        with open(f"{prefix}_failures.csv", newline="") as f:
            return [{"method": r.get("Method"), "name": r.get("Name"), "error": r.get("Error"),
                     "occurrences": int(r.get("Occurrences") or 0)} for r in csv.DictReader(f)]
    except FileNotFoundError:
        return []


def kill_analysis(records: list[dict], kill_wall: float, outage: tuple[float | None, float | None],
                  locust_failures: int) -> dict:
    failed = [r for r in records if not r["ok"]]
    in_flight = [r for r in records if r["start"] < kill_wall < r["end"]]
    down, up = outage
    during = [r for r in failed if down is not None and r["start"] >= kill_wall and (up is None or r["start"] < up)]
    in_flight_failed = [r for r in failed if r["start"] < kill_wall < r["end"]]
    other = [r for r in failed if r not in in_flight_failed and r not in during]
    return {"requests_in_flight": len(in_flight), "in_flight_failed": len(in_flight_failed),
            "in_flight_succeeded": len(in_flight) - len(in_flight_failed),
            "failures_started_during_outage": len(during),
            "failures_other": len(other),
            "failures_not_in_request_log": max(0, locust_failures - len(failed)),
            "examples_other": [{k: r[k] for k in ("api", "name", "start", "end", "error")}
                               for r in (during + other)[:5]]}


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"cpu_model": model, "cores": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0)),
            "memory_gib": round(psutil.virtual_memory().total / 2**30, 1), "python": platform.python_version(),
            "platform": platform.platform(), "commit": commit}


def mib(n: int | None) -> float | None:
    return None if n is None else round(n / 2**20, 1)


# ------------------------------------------------------------------ the run
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    prefix = str(out / "locust")
    clean_prefix(prefix)
    request_log = out / "requests.jsonl"
    request_log.unlink(missing_ok=True)
    rss_csv = out / "rss.csv"
    summary: dict = {"command": shlex.join([sys.executable, *sys.argv]) if argv is None
                     else shlex.join([sys.executable, __file__, *argv]),
                     "machine": machine(), "load_average_at_start": os.getloadavg(),
                     "config": {"users": args.users, "spawn_rate": args.spawn_rate, "duration_s": args.duration,
                                "warmup_s": args.warmup, "kill_worker_at_s": args.kill_worker_at,
                                "disconnect_share": args.disconnect_share, "long_share": args.long_share,
                                "max_tokens": args.max_tokens, "serve_args": args.serve_args,
                                "stop_timeout_s": args.stop_timeout}}
    shm_before = set(shm_segments())
    problems: list[str] = []

    with tempfile.TemporaryDirectory(prefix="tensorserve-soak-") as tmp:
        proc, info = start_stack(shlex.split(args.serve_args), Path(tmp), out / "serve.log", args.start_timeout)
        locust = None
        health = None
        try:
            base = f"http://{info['http']}"
            stack = Stack(proc.pid, info["pids"])
            summary["serve"] = {"http": info["http"], "grpc": info["grpc"], "pids_at_start": info["pids"]}
            extra = ["--disconnect-share", f"{args.disconnect_share:g}", "--request-log", str(request_log),
                     "--request-timeout", f"{args.request_timeout:g}"]
            if args.long_share is not None:
                extra += ["--long-share", f"{args.long_share:g}"]
            cmd = locust_command(base, info["grpc"], prefix, users=args.users, spawn_rate=args.spawn_rate,
                                 duration=f"{args.duration:g}s", stop_timeout=args.stop_timeout,
                                 max_tokens=args.max_tokens, extra=extra)
            summary["locust_command"] = shlex.join(cmd)
            print("running:", shlex.join(cmd), file=sys.stderr, flush=True)
            health = HealthWatch(base)
            health.start()
            t0 = time.time()
            with open(out / "locust.out", "wb") as locust_out:
                locust = subprocess.Popen(cmd, cwd=ROOT, stdout=locust_out, stderr=subprocess.STDOUT)
            deadline = t0 + args.duration + args.stop_timeout + 180
            rss_start = None
            kill: dict | None = None
            next_rss = t0
            shm_seen: set[str] = set()            # this stack's segments seen in the samples every 5 s
            shm_max = 0
            with open(rss_csv, "w", newline="") as f:
                rss_writer = csv.writer(f)
                rss_writer.writerow(["t_s", "role", "pid", "rss_mib"])
                while locust.poll() is None:
                    now = time.time()
                    if rss_start is None and now - t0 >= args.warmup:
                        rss_start = stack.rss()
                        print(f"soak: RSS at {now - t0:.0f} s: "
                              + ", ".join(f"{r} {mib(v['rss'])} MiB" for r, v in rss_start.items()),
                              file=sys.stderr, flush=True)
                    if args.kill_worker_at is not None and kill is None and now - t0 >= args.kill_worker_at:
                        worker = stack.current().get("worker")
                        if worker is None:
                            kill = {"at_s": round(now - t0, 2), "wall": now, "pid": None,
                                    "error": "no worker process to kill"}
                        else:
                            os.kill(worker.pid, signal.SIGKILL)
                            kill = {"at_s": round(time.time() - t0, 2), "wall": time.time(), "pid": worker.pid}
                            print(f"soak: SIGKILL to worker {worker.pid} at {kill['at_s']} s", file=sys.stderr,
                                  flush=True)
                    if kill is not None and kill.get("pid") and "new_pid" not in kill:
                        worker = stack.current().get("worker")
                        if worker is not None and worker.pid != kill["pid"]:
                            kill["new_pid"] = worker.pid
                            kill["new_worker_started_s"] = round(time.time() - t0, 2)
                    else:
                        stack.current()                             # note new pids
                    if now >= next_rss:
                        for role, v in stack.rss().items():
                            rss_writer.writerow([round(now - t0, 1), role, v["pid"], mib(v["rss"])])
                        f.flush()
                        next_rss += RSS_EVERY_S
                        ours = {name for name, pid in shm_segments().items() if pid in stack.known}
                        shm_seen |= ours
                        shm_max = max(shm_max, len(ours))
                    if now > deadline:
                        problems.append(f"locust did not end within {deadline - t0:.0f} s; stopped it")
                        locust.send_signal(signal.SIGTERM)
                        try:
                            locust.wait(30)
                        except subprocess.TimeoutExpired:
                            locust.kill()
                        break
                    time.sleep(0.5)
            locust_rc = locust.wait()
            load_s = time.time() - t0
            # the end of the load: nothing stopped yet
            rss_end = stack.rss()
            if rss_start is None:
                problems.append("the load ended before --warmup: no 'start' RSS sample")
            health.stopping.set()
            restarts = restart_counts(base)
            live = stack.live_pids()
            shm_end = shm_report(stack, shm_before, live)
            summary["load_average_at_end"] = os.getloadavg()
        finally:
            if locust is not None and locust.poll() is None:
                locust.kill()
                locust.wait()
            if health is not None:
                health.stopping.set()
            serve_rc = stop_stack(proc)
    leftovers = {name: pid for name, pid in shm_segments().items() if pid in stack.known}

    # ------------------------------------------------------------- figures
    stats = read_stats(prefix) if Path(f"{prefix}_stats.csv").exists() else []
    if not stats:
        problems.append(f"locust (exit code {locust_rc}) wrote no {prefix}_stats.csv; see {prefix}_locust.log")
    locust_summary = summarize(stats) if stats else {"requests": 0, "failures": 0, "entries": {}}
    records = read_request_log(request_log)
    summary.update(
        load_s=round(load_s, 1),
        requests=locust_summary["requests"], failures=locust_summary["failures"],
        left_early=sum(v["requests"] for k, v in locust_summary["entries"].items()
                       if k.endswith("(left early)") and not k.startswith(("TTFT ", "ITL "))),
        per_api=per_api(records), failure_messages=read_failures_csv(prefix))
    if kill is not None:
        outage = health.outage_after(kill["wall"])
        kill.update(health_not_ok_s=None if outage[0] is None else round(outage[0] - t0, 2),
                    health_ok_again_s=None if outage[1] is None else round(outage[1] - t0, 2))
        kill.update(kill_analysis(records, kill["wall"], outage, locust_summary["failures"]))
    summary["kill"] = kill
    summary["health_changes"] = [{"t_s": round(w - t0, 2), "status": s} for w, s in health.changes]

    rss = {}
    for role in ROLES:
        a, b = (rss_start or {}).get(role), rss_end.get(role)
        growth = None if not (a and b) else round((b["rss"] - a["rss"]) / a["rss"] * 100, 2)
        rss[role] = {"pid_start": a and a["pid"], "pid_end": b and b["pid"], "start_mib": mib(a and a["rss"]),
                     "end_mib": mib(b and b["rss"]), "growth_pct": growth}
        if a and b and a["pid"] != b["pid"]:
            rss[role]["note"] = "restarted between the samples: start and end are different processes"
    summary["rss"] = rss
    summary["rss_samples"] = str(rss_csv)
    summary["restarts"] = restarts
    summary["dev_shm"] = {"at_end": shm_end, "after_stop_of_this_stack": sorted(leftovers),
                          "during_run": {"distinct_segments_seen": len(shm_seen), "most_at_once": shm_max,
                                         "sampled_every_s": RSS_EVERY_S},
                          "worker_pids_seen": stack.worker_pids}
    summary["locust_exit_code"] = locust_rc
    summary["serve_exit_code"] = serve_rc
    summary["locust_entries"] = locust_summary["entries"]
    summary["files"] = {"dir": str(out), "locust_csv": f"{prefix}_stats.csv", "requests": str(request_log),
                        "serve_log": str(out / "serve.log"), "locust_log": f"{prefix}_locust.log"}

    # ------------------------------------------------------------- targets
    targets = {}
    if summary["requests"] == 0:
        problems.append("no request was made")
    if kill is None:
        targets["no_failures"] = summary["failures"] == 0
    else:
        targets["failures_only_in_flight_at_kill"] = (kill.get("pid") is not None and kill["failures_other"] == 0
                                                      and kill["failures_started_during_outage"] == 0
                                                      and kill["failures_not_in_request_log"] == 0)
        targets["worker_restarted"] = isinstance(restarts, dict) and restarts.get("worker", 0) >= 1
    limit = args.rss_growth_limit
    targets[f"rss_growth_under_{limit:g}_pct"] = all(
        v["growth_pct"] is not None and v["growth_pct"] < limit for v in rss.values())
    targets["dev_shm_only_live_processes"] = shm_end["only_live_processes"]
    targets["dev_shm_empty_after_stop"] = not leftovers
    targets["serve_stopped_cleanly"] = serve_rc == 0
    if locust_rc not in (0, 1):                 # 1: some request failed, judged above
        problems.append(f"locust exited with {locust_rc}")
    problems += [f"target not met: {name}" for name, met in targets.items() if not met]
    summary["targets"] = targets
    summary["problems"] = problems
    summary["ok"] = not problems
    text = json.dumps(summary, indent=1)
    (out / "soak.json").write_text(text + "\n")
    print(text)
    for problem in problems:
        print("soak:", problem, file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
