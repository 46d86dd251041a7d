"""/health and the scheduler side of /metrics over every model's replicas: each replica's Stats,
asked for together, with serve's view of its processes (their states and restarts)."""
from __future__ import annotations

import asyncio

import grpc

from protos.tensorserve.v1 import common_pb2, scheduler_pb2
from router.metrics import RouterMetrics, read_supervisor_status
from router.model_table import ModelTable


def group_label(models: ModelTable, model: str, index: int) -> str | None:
    """How serve names a replica's processes: plain 'scheduler'/'worker' when there is one group,
    else 'scheduler/<model>/<replica>' (tensorserve/serve.py)."""
    if len(models) == 1 and len(models.default.replicas or ()) <= 1:
        return None
    return f"{model}/{index}"


async def health_report(models: ModelTable, supervisor_status: str | None) -> tuple[bool, dict]:
    """(serving, the /health body): serving while every model has a replica that serves."""
    supervised = read_supervisor_status(supervisor_status)
    ok, messages, comps = True, [], []
    for f in models:
        if f.replicas is None:
            ok = False
            messages.append(f"{f.served_model_name}: the router has no scheduler configured (--scheduler)")
            continue
        results = await asyncio.gather(*(f.replica_health(r) for r in f.replicas.replicas))
        ok = ok and any(serving for serving, _, _ in results)
        messages += [m for serving, m, _ in results if not serving and m]
        for replica, (_, _, components) in zip(f.replicas.replicas, results):
            label = group_label(models, f.served_model_name, replica.index)
            mine = [{"name": c.name, "status": "ok" if c.status == 1 else "unavailable", "message": c.message}
                    for c in components]
            if label is not None:
                for c in mine:
                    c.update(model=f.served_model_name, replica=replica.index)
            if supervised:      # under `tensorserve serve`: each child's state and restarts, also when unreachable
                by_name = {c["name"].split("-")[0]: c for c in mine}
                for kind in ("scheduler", "worker"):
                    key = kind if label is None else f"{kind}/{label}"
                    if key not in supervised:
                        continue
                    entry = by_name.get(kind)
                    if entry is None:
                        entry = {"name": "worker-0" if kind == "worker" else kind, "status": "unavailable",
                                 "message": f"the {kind} is {supervised[key]['state']}"}
                        if label is not None:
                            entry.update(model=f.served_model_name, replica=replica.index)
                        mine.append(entry)
                    entry.update(restarts=supervised[key]["restarts"], process=supervised[key]["state"])
            comps += mine
    if ok:
        return True, {"status": "ok", "components": comps}
    message = "; ".join(messages) or "not serving"
    return False, {"status": "unavailable", "message": message, "components": comps,
                   "error": {"message": message, "type": "service_unavailable", "param": None,
                             "code": "unavailable"}}


async def _stats(client):
    try:
        return await client.stats()
    except grpc.RpcError:
        return None


async def scrape_stats(models: ModelTable, metrics: RouterMetrics) -> None:
    """Every replica's Stats into the metrics: per replica (model, replica labels), and summed into
    the unlabeled scheduler metrics (one group's own, as before, when there is one)."""
    replicas = [(f, r) for f in models for r in (f.replicas.replicas if f.replicas else ())]
    stats = await asyncio.gather(*(_stats(r.client) for _, r in replicas))
    for (f, r), s in zip(replicas, stats):
        if s is not None:
            f.note_stats(s)
        metrics.set_replica(r, s)
    live = [s for s in stats if s is not None]
    if len(replicas) == 1 or not live:
        metrics.set_stats(stats[0] if len(replicas) == 1 else None)
    else:
        metrics.set_stats(merged(live))


def merged(stats: list[scheduler_pb2.StatsResponse]) -> scheduler_pb2.StatsResponse:
    """Several schedulers' Stats as one (sums; the KV fraction of the summed blocks)."""
    out = scheduler_pb2.StatsResponse()
    for name in ("running", "waiting", "preempted", "kv_blocks_total", "kv_blocks_free", "kv_blocks_cached",
                 "tokens_computed", "steps", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens",
                 "preemptions"):
        setattr(out, name, sum(getattr(s, name) for s in stats))
    if out.kv_blocks_total:
        out.kv_used_fraction = (out.kv_blocks_total - out.kv_blocks_free) / out.kv_blocks_total
    out.status = (common_pb2.SERVING_STATUS_SERVING if any(s.status == common_pb2.SERVING_STATUS_SERVING
                                                           for s in stats) else common_pb2.SERVING_STATUS_NOT_SERVING)
    return out
