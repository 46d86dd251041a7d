"""The scheduler's stats of one engine (its queues, KV blocks, prefix cache, checkpoints and
speculative decoding) as the `Stats` RPC answers them; the router turns them into /metrics."""
from __future__ import annotations

from protos.tensorserve.v1 import scheduler_pb2
from scheduler.checkpoint_tier import checkpoint_stats


def engine_stats(engine) -> scheduler_pb2.StatsResponse:
    """A snapshot of `engine` (a scheduler.engine.Engine, or None before a worker is connected)."""
    s = scheduler_pb2.StatsResponse()
    e = engine
    if e is not None:
        total, free = e.blocks.num_blocks, e.blocks.num_free
        s.running, s.waiting, s.preempted = len(e.running), len(e.waiting), len(e.preempted)
        s.kv_blocks_total, s.kv_blocks_free = total, free
        s.kv_blocks_cached = e.blocks.num_cached
        s.prefix_cache_queried_tokens = e.blocks.queried_tokens
        s.prefix_cache_hit_tokens = e.blocks.hit_tokens
        s.preemptions = e.num_preemptions
        s.kv_used_fraction = (total - free) / total if total else 0.0
        if e.window is not None:           # the windowed layers' own pool (scheduler/window_blocks.py)
            w_total, w_free = e.window.manager.num_blocks, e.window.num_free
            s.kv_window_blocks_total, s.kv_window_blocks_free = w_total, w_free
            s.kv_used_fraction = max(s.kv_used_fraction, (w_total - w_free) / w_total)
        s.block_size, s.max_context = e.blocks.block_size, e.max_context
        if e.checkpoints is not None:
            s.checkpoints.CopyFrom(checkpoint_stats(e))
        if e.speculative is not None:
            st = e.speculative.stats
            s.speculative.CopyFrom(scheduler_pb2.SpeculativeStats(
                method=e.speculative.method, drafts=st.drafts, draft_tokens=st.draft_tokens,
                accepted_tokens=st.accepted_tokens))
            if e.speculative.governor is not None:
                s.speculative.governed = True
                s.speculative.governor.extend(
                    scheduler_pb2.GovernorBucket(
                        batch_sizes=g.batch_sizes, state=g.state, drafting=g.drafting,
                        draft_seconds_per_token=g.draft_seconds_per_token,
                        plain_seconds_per_token=g.plain_seconds_per_token, pauses=g.pauses, probes=g.probes)
                    for g in e.speculative.governor.snapshot())
    return s
