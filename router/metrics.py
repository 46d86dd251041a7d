"""The router's Prometheus metrics, in a registry of its own (one per router instance).

Counters and histograms are updated as requests run; the scheduler gauges
(queue length, running, KV usage) are polled from the scheduler's Stats when
/metrics is scraped.
"""
from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["RouterMetrics", "CONTENT_TYPE_LATEST", "read_supervisor_status"]


def read_supervisor_status(path: str | None) -> dict[str, dict]:
    """What `tensorserve serve` last wrote of its children (tensorserve/supervisor.py), or {}."""
    if not path:
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


class _SupervisorCollector:
    """Restart counts and states of serve's children, read at each scrape."""

    def __init__(self, path: str):
        self.path = path

    def collect(self):
        restarts = CounterMetricFamily("tensorserve_process_restarts", "Restarts of a child process by "
                                       "tensorserve serve after it died", labels=["process"])
        up = GaugeMetricFamily("tensorserve_process_up", "1 while the child process runs and is ready",
                               labels=["process"])
        for name, status in read_supervisor_status(self.path).items():
            restarts.add_metric([name], status.get("restarts", 0))
            up.add_metric([name], 1.0 if status.get("state") == "running" else 0.0)
        yield restarts
        yield up

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class RouterMetrics:
    def __init__(self, model: str, supervisor_status: str | None = None):
        self.registry = r = CollectorRegistry()
        self.model = model
        self.supervisor_status = supervisor_status
        if supervisor_status:
            r.register(_SupervisorCollector(supervisor_status))
        self.requests = Counter("tensorserve_requests", "Requests finished, by endpoint and HTTP/gRPC status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("tensorserve_prompt_tokens", "Prompt tokens sent to the scheduler",
                                     registry=r)
        self.generation_tokens = Counter("tensorserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("tensorserve_time_to_first_token_seconds",
                              "Time from request receipt to the first generated token", buckets=_TTFT_BUCKETS,
                              registry=r)
        self.itl = Histogram("tensorserve_inter_token_latency_seconds",
                             "Time between consecutive generated tokens of a request", buckets=_ITL_BUCKETS,
                             registry=r)
        self.e2e = Histogram("tensorserve_e2e_request_latency_seconds", "Request time from receipt to finish",
                             buckets=_E2E_BUCKETS, registry=r)
        self.waiting = Gauge("tensorserve_num_requests_waiting", "Sequences waiting in the scheduler (queue length)",
                             registry=r)
        self.running = Gauge("tensorserve_num_requests_running", "Sequences running in the scheduler", registry=r)
        self.kv_usage = Gauge("tensorserve_kv_cache_usage_ratio", "Fraction of KV blocks in use (0..1)", registry=r)
        self.kv_blocks_total = Gauge("tensorserve_kv_blocks_total", "KV blocks in the worker's pool", registry=r)
        self.kv_blocks_free = Gauge("tensorserve_kv_blocks_free", "KV blocks free", registry=r)
        self.kv_window_blocks_total = Gauge("tensorserve_kv_window_blocks_total", "KV blocks in the sliding-window "
                                            "layers' own pool (0: the worker keeps one pool)", registry=r)
        self.kv_window_blocks_free = Gauge("tensorserve_kv_window_blocks_free",
                                           "KV blocks free in the sliding-window layers' own pool", registry=r)
        self.preempted = Gauge("tensorserve_num_requests_preempted",
                               "Sequences preempted and waiting to be recomputed", registry=r)
        self.kv_blocks_cached = Gauge("tensorserve_kv_blocks_cached",
                                      "KV blocks holding a cached prefix (in use or reclaimable)", registry=r)
        # polled totals, turned into counters (a scheduler restart starts them again from zero)
        self._totals: dict = {}
        self.totals = {
            "prefix_cache_queried_tokens": Counter("tensorserve_prefix_cache_queries",
                                                   "Prompt tokens looked up in the prefix cache", registry=r),
            "prefix_cache_hit_tokens": Counter("tensorserve_prefix_cache_hits",
                                               "Prompt tokens whose KV came from the prefix cache", registry=r),
            "preemptions": Counter("tensorserve_num_preemptions", "Sequences preempted for recompute", registry=r),
            "tokens_computed": Counter("tensorserve_tokens_computed",
                                       "Tokens the worker computed (prompt chunks and decodes)", registry=r),
        }
        self.checkpoint_totals = {
            "restored_tokens": Counter("tensorserve_prefix_checkpoint_restored_tokens",
                                       "Prompt tokens whose KV was restored from a checkpoint store", registry=r),
            "saved_blocks": Counter("tensorserve_prefix_checkpoint_saved_blocks",
                                    "KV blocks written to a checkpoint store", registry=r),
            "restored_bytes": Counter("tensorserve_prefix_checkpoint_restored_bytes",
                                      "Stored bytes of the KV blocks restored from checkpoint stores", registry=r),
            "restore_seconds": Counter("tensorserve_prefix_checkpoint_restore_seconds",
                                       "Time spent reading, checking and importing restored KV blocks", registry=r),
            "saves_dropped": Counter("tensorserve_prefix_checkpoint_saves_dropped",
                                     "KV blocks not written because the checkpoint writer was behind", registry=r),
        }
        self.checkpoint_rejected = Counter(
            "tensorserve_prefix_checkpoint_rejected", "Stored KV blocks ignored as misses (other model, codec or "
            "version, truncated, checksum or hash mismatch), by reason", ["reason"], registry=r)
        self.store_totals = {name: Counter(f"tensorserve_checkpoint_store_{name}", text, ["store"], registry=r)
                             for name, text in (("hits", "KV blocks read from the store"),
                                                ("misses", "Lookups that ended at a block the store lacked"),
                                                ("puts", "KV blocks written to the store"),
                                                ("put_failures", "KV blocks the store could not take"),
                                                ("errors", "Store operations that failed (store down or broken)"),
                                                ("evictions", "KV blocks removed to keep the store under its cap"))}
        self.store_available = Gauge("tensorserve_checkpoint_store_available",
                                     "1 while the checkpoint store works, 0 while it fails", ["store"], registry=r)
        # speculative decoding (vLLM's spec_decode names), present while the scheduler speculates
        self.spec_totals = {
            "drafts": Counter("tensorserve_spec_decode_num_drafts", "Sequence-steps that carried drafted tokens "
                              "to verify", registry=r),
            "draft_tokens": Counter("tensorserve_spec_decode_num_draft_tokens", "Drafted tokens verified by the "
                                    "model", registry=r),
            "accepted_tokens": Counter("tensorserve_spec_decode_num_accepted_tokens", "Drafted tokens the model "
                                       "accepted", registry=r),
        }
        self.spec_mean_length = Gauge("tensorserve_spec_decode_mean_acceptance_length", "Tokens emitted per "
                                      "verification since the scheduler started (accepted drafts + the model's "
                                      "own), 0 before the first", registry=r)
        # the cost governor (scheduler/speculative/governor.py), per range of batch sizes
        self.spec_governor_drafting = Gauge(
            "tensorserve_spec_decode_governor_drafting", "1 while steps of this range of batch sizes draft, 0 "
            "while the cost governor has paused drafting there (or is measuring plain steps)", ["batch_size_range"],
            registry=r)
        self.spec_governor_state = Gauge(
            "tensorserve_spec_decode_governor_state", "1 for the cost governor's state of this range of batch "
            "sizes (probing, drafting, paused), 0 for the others", ["batch_size_range", "state"], registry=r)
        self.spec_governor_cost = Gauge(
            "tensorserve_spec_decode_governor_seconds_per_token", "The cost governor's EWMA of a step's seconds "
            "per emitted token, with drafts (mode=draft) and without (mode=plain); 0 before a measurement",
            ["batch_size_range", "mode"], registry=r)
        self.spec_governor_totals = {
            "pauses": Counter("tensorserve_spec_decode_governor_pauses", "Times the cost governor paused "
                              "drafting for this range of batch sizes", ["batch_size_range"], registry=r),
            "probes": Counter("tensorserve_spec_decode_governor_probes", "Times the cost governor measured "
                              "drafting again for this range of batch sizes", ["batch_size_range"], registry=r),
        }
        self.scheduler_up = Gauge("tensorserve_scheduler_up", "1 when the last Stats call to the scheduler succeeded",
                                  registry=r)
        # per scheduler replica (model, replica): routing and each group's own state
        labels = ["model", "replica"]
        self.routed_requests = Counter("tensorserve_routed_requests", "Requests sent to a scheduler replica, by "
                                       "whether the router knew it to hold a prefix of the prompt (prefix=hit)",
                                       [*labels, "prefix"], registry=r)
        self.replica_in_flight = Gauge("tensorserve_replica_requests_in_flight", "Requests this router has in "
                                       "flight at the replica", labels, registry=r)
        self.replica_up = Gauge("tensorserve_replica_up", "1 when the replica's last Stats said it serves",
                                labels, registry=r)
        self.replica_gauges = {name: Gauge(f"tensorserve_replica_{name}", text, labels, registry=r) for name, text in (
            ("num_requests_running", "Sequences running in the replica's scheduler"),
            ("num_requests_waiting", "Sequences waiting in the replica's scheduler"),
            ("kv_cache_usage_ratio", "Fraction of the replica's KV blocks in use (0..1)"),
            ("kv_blocks_cached", "KV blocks holding a cached prefix in the replica"),
            ("prefix_cache_queried_tokens", "Prompt tokens looked up in the replica's prefix cache since its "
                                            "scheduler started"),
            ("prefix_cache_hit_tokens", "Of those, tokens whose KV came from its prefix cache"))}

    def routed(self, replica, prefix_hit: bool) -> None:
        self.routed_requests.labels(model=replica.model, replica=str(replica.index),
                                    prefix="hit" if prefix_hit else "miss").inc()

    def set_replica(self, replica, stats) -> None:
        """A replica's Stats (None: it did not answer) and the router's count of its requests."""
        labels = dict(model=replica.model, replica=str(replica.index))
        self.replica_in_flight.labels(**labels).set(replica.in_flight)
        self.replica_up.labels(**labels).set(1 if stats is not None and stats.status == 1 else 0)
        if stats is None:
            return
        for name, value in (("num_requests_running", stats.running), ("num_requests_waiting", stats.waiting),
                            ("kv_cache_usage_ratio", stats.kv_used_fraction),
                            ("kv_blocks_cached", stats.kv_blocks_cached),
                            ("prefix_cache_queried_tokens", stats.prefix_cache_queried_tokens),
                            ("prefix_cache_hit_tokens", stats.prefix_cache_hit_tokens)):
            self.replica_gauges[name].labels(**labels).set(value)

    def count(self, endpoint: str, status: int | str) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def set_stats(self, stats) -> None:
        if stats is None:
            self.scheduler_up.set(0)
            return
        self.scheduler_up.set(1)
        self.waiting.set(stats.waiting)
        self.running.set(stats.running)
        self.kv_usage.set(stats.kv_used_fraction)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.kv_blocks_free.set(stats.kv_blocks_free)
        self.kv_window_blocks_total.set(stats.kv_window_blocks_total)
        self.kv_window_blocks_free.set(stats.kv_window_blocks_free)
        self.preempted.set(stats.preempted)
        self.kv_blocks_cached.set(stats.kv_blocks_cached)
        for name, counter in self.totals.items():
            self._advance(name, counter, getattr(stats, name))
        if stats.HasField("checkpoints"):
            c = stats.checkpoints
            for name, counter in self.checkpoint_totals.items():
                self._advance(name, counter, getattr(c, name))
            for reason, total in c.rejected.items():
                self._advance(("rejected", reason), self.checkpoint_rejected.labels(reason=reason), total)
            for store in c.stores:
                for name, counter in self.store_totals.items():
                    self._advance((store.name, name), counter.labels(store=store.name), getattr(store, name))
                self.store_available.labels(store=store.name).set(1 if store.available else 0)
        if stats.HasField("speculative"):
            sp = stats.speculative
            for name, counter in self.spec_totals.items():
                self._advance(("speculative", name), counter, getattr(sp, name))
            self.spec_mean_length.set(1 + sp.accepted_tokens / sp.drafts if sp.drafts else 0.0)
            for g in sp.governor:
                label = g.batch_sizes
                self.spec_governor_drafting.labels(batch_size_range=label).set(1 if g.drafting else 0)
                for state in ("probing", "drafting", "paused"):
                    self.spec_governor_state.labels(batch_size_range=label, state=state).set(
                        1 if g.state == state else 0)
                self.spec_governor_cost.labels(batch_size_range=label, mode="draft").set(g.draft_seconds_per_token)
                self.spec_governor_cost.labels(batch_size_range=label, mode="plain").set(g.plain_seconds_per_token)
                for name, counter in self.spec_governor_totals.items():
                    self._advance(("governor", label, name), counter.labels(batch_size_range=label),
                                  getattr(g, name))

    def _advance(self, key, counter, total) -> None:
        """Move a counter to a polled total (a total that went down started again from zero)."""
        total = float(total)
        last = self._totals.get(key, 0.0)
        counter.inc(total - last if total >= last else total)
        self._totals[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
