"""SubmitEvents from a sequence's progress: tokens with their logprobs, prompt logprobs, usage."""
from __future__ import annotations

import math

from protos.tensorserve.v1 import common_pb2, scheduler_pb2
from scheduler.sequence import Sequence

FINISH = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "scored": common_pb2.FINISH_REASON_SCORED,
    "error": common_pb2.FINISH_REASON_ERROR,
}


def usage(seq: Sequence) -> common_pb2.Usage:
    p, c = len(seq.prompt), len(seq.output)
    return common_pb2.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                            cached_tokens=max(0, seq.num_cached_tokens))


def final_event(seq: Sequence, reason: str, code: str = "", message: str = "") -> scheduler_pb2.SubmitEvent:
    ev = scheduler_pb2.SubmitEvent(finish_reason=FINISH[reason], usage=usage(seq))
    if reason == "error":
        ev.error.code, ev.error.message = code, message
    return ev


def progress_event(seq: Sequence, handle) -> scheduler_pb2.SubmitEvent | None:
    """What `handle`'s client has not seen yet of `seq` (None when nothing); marks it sent."""
    ev = scheduler_pb2.SubmitEvent()
    if handle.prompt_logprobs is not None and not handle.prompt_sent \
            and len(seq.prompt_scores) >= len(seq.prompt):
        fill_prompt_logprobs(ev, seq, handle.prompt_logprobs)
        handle.prompt_sent = True
    n_top = seq.params.logprobs or 0
    for i in range(handle.emitted, len(seq.output)):
        t = ev.tokens.add(token_id=int(seq.output[i]), logprob=float(seq.logprobs[i]))
        if n_top > 0:
            ids, lps = seq.top_logprobs[i]
            if ids is not None:
                t.top_ids[:] = [int(x) for x in ids[:n_top]]
                t.top_logprobs[:] = [float(x) for x in lps[:n_top]]
    handle.emitted = len(seq.output)
    if seq.finish_reason:
        ev.finish_reason = FINISH.get(seq.finish_reason, common_pb2.FINISH_REASON_STOP)
        ev.usage.CopyFrom(usage(seq))
        handle.done = True
    if not ev.tokens and not ev.prompt_logprobs and not ev.finish_reason:
        return None
    return ev


def fill_prompt_logprobs(ev: scheduler_pb2.SubmitEvent, seq: Sequence, n: int) -> None:
    prompt = seq.prompt
    for p in range(1, len(prompt)):
        ids, lps, own = seq.prompt_scores[p - 1]
        tok = int(prompt[p])
        if own is not None and not math.isnan(own):
            lp = float(own)
        else:       # a worker that does not return the target's logprob: exact only within its top-k
            hit = [j for j in range(len(ids)) if int(ids[j]) == tok]
            lp = float(lps[hit[0]]) if hit else -math.inf
        t = ev.prompt_logprobs.add(token_id=tok, logprob=lp)
        if n > 0:
            t.top_ids[:] = [int(x) for x in ids[:n]]
            t.top_logprobs[:] = [float(x) for x in lps[:n]]
