"""The cost governor of speculative decoding: drafting only where it pays.

A step with drafts is never launched ahead (its input token is not known until the step before
returns) and its verification rows make a bigger pass than a decode (run kernel by kernel, where a
decode of a few rows is replayed from its captured graph), so drafting costs time that only
accepted drafts pay back. Whether they
do depends on the text (copying pays, open-ended text mostly not) and on the batch: one sequence
leaves the cores idle between steps, 32 keep them busy, and there the extra rows cost nearly
what they weigh. The governor measures both ways of running, per range of batch sizes, and
pauses drafting (k = 0: the engine then schedules exactly as with speculation off, pipelining
included) in a range where drafting's time per emitted token is worse than plain decoding's.

Measurements. The engine reports every step that only decodes, and followed another such step
(the first after a prompt chunk was scheduled without launch-ahead, whatever the mode), with its
batch size (running sequences), whether it ran in drafting mode, the tokens it emitted (accepted
drafts + 1 per verifying sequence, 1 per plain decode, K per K-step decode) and its seconds: from
the previous step's result to its own, i.e. what a step costs the stream of results, overlap with
the step before included (a step launched ahead costs only what it adds to the pipeline). Steps
that carry prompt chunks are left out rather than normalised: their time is mostly the prompt's
(0.1-0.4 s against a decode's 10-50 ms) and would drown what drafting adds, and a steady decode
phase comes soon enough after them. Drafting mode counts every step that could draft, including
those where the proposer found nothing: their lost pipelining is drafting's cost too.

States per bucket of batch sizes (1, 2-3, 4-7, 8-15, 16-31, 32+):
  probing   measure plain steps, then drafting steps (after a warm-up step or two after each
            switch, which pays the switch's pipeline drain or refill); then drafting when its
            cost per token is below plain's, paused otherwise (a probe whose drafting is already
            far worse than plain after a few steps ends early).
  drafting  draft; pause once the drafting EWMA is worse than the plain one by `margin`;
            every `recheck_steps` drafting steps probe again (plain's cost moves with the context).
            Drafting's EWMA looks back further than plain's (`draft_alpha`): its cost per token
            follows the text (a stretch the output does not copy, then one it does), and a
            sequence whose drafts fail backs off by itself (sequence_backoff.py); what pauses a
            bucket is drafting that does not pay over many steps, not one such stretch.
  paused    decode plainly, keep plain's EWMA fresh; probe drafting again after `backoff_steps`
            plain steps or `backoff_s` seconds, both doubling after each probe that failed (up to
            the max), reset by one that succeeded; or sooner, once the text turns copyable: where
            proposals cost nothing (n-gram lookup) the controller still asks for one draft token
            a step and reports whether the model then produced it (`shadow`); when at least
            `shadow_rate` of the recent ones were (an EWMA over `shadow_samples` or more of them),
            drafting is probed at once, no earlier than `shadow_wait` paused steps, which doubles
            after each such probe that fails.
Deterministic to test: the clock is injected and `record` takes the measurements directly.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

# the lower edge of each bucket of batch sizes; the last one is open-ended
BUCKET_EDGES = (1, 2, 4, 8, 16, 32)

PROBING, DRAFTING, PAUSED = "probing", "drafting", "paused"


def bucket_label(i: int) -> str:
    lo = BUCKET_EDGES[i]
    if i + 1 == len(BUCKET_EDGES):
        return f"{lo}+"
    hi = BUCKET_EDGES[i + 1] - 1
    return str(lo) if hi == lo else f"{lo}-{hi}"


def bucket_of(batch_size: int) -> int:
    i = 0
    while i + 1 < len(BUCKET_EDGES) and batch_size >= BUCKET_EDGES[i + 1]:
        i += 1
    return i


class _Cost:
    """Seconds per emitted token: an EWMA of seconds and of tokens per step (their ratio weighs a
    step by its tokens, as the stream of results does)."""

    def __init__(self, alpha: float):
        self.alpha = alpha
        self.seconds = self.tokens = 0.0
        self.samples = 0

    def reset(self) -> None:
        self.seconds = self.tokens = 0.0
        self.samples = 0

    def add(self, seconds: float, tokens: int) -> None:
        if self.samples == 0:
            self.seconds, self.tokens = seconds, float(tokens)
        else:
            a = self.alpha
            self.seconds += a * (seconds - self.seconds)
            self.tokens += a * (tokens - self.tokens)
        self.samples += 1

    @property
    def per_token(self) -> float:
        return self.seconds / self.tokens if self.samples and self.tokens > 0 else 0.0


@dataclass
class _Bucket:
    label: str
    plain: _Cost
    draft: _Cost
    state: str = PROBING
    phase_drafting: bool = False     # probing: which mode is being measured
    phase_seconds: float = 0.0       # the probe phase's samples (a plain mean, not an EWMA)
    phase_tokens: int = 0
    phase_samples: int = 0
    run_mode: bool | None = None     # the mode of the samples just before (warm-up after a switch)
    run_length: int = 0
    steps_in_state: int = 0          # samples recorded since the state began
    since: float = 0.0               # when the state began (clock)
    backoff_steps: int = 0
    backoff_s: float = 0.0
    shadow_hits: float = 0.0         # paused: EWMA of whether a proposed token was the model's next
    shadow_count: int = 0            # such reports since the pause began
    shadow_wait: int = 0             # paused steps before the reports may start a probe
    pauses: int = 0                  # drafting stopped (a failed probe or a worse EWMA)
    probes: int = 0                  # measured again after the first probe
    history: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class BucketState:
    """What the stats and /metrics show of one bucket."""
    batch_sizes: str
    state: str
    drafting: bool                   # whether a step of this batch size drafts now
    draft_seconds_per_token: float
    plain_seconds_per_token: float
    pauses: int
    probes: int


class CostGovernor:
    def __init__(self, clock: Callable[[], float] = time.perf_counter, alpha: float = 0.15,
                 draft_alpha: float = 0.03, margin: float = 0.05, probe_steps: int = 6, warmup_steps: int = 1,
                 early_exit_steps: int = 2, early_exit_margin: float = 0.5, recheck_steps: int = 512,
                 backoff_steps: int = 256, max_backoff_steps: int = 8192, backoff_s: float = 30.0,
                 max_backoff_s: float = 600.0, shadow_rate: float = 0.5, shadow_samples: int = 8,
                 shadow_wait: int = 16):
        self.clock = clock
        self.shadow_rate, self.shadow_samples, self.initial_shadow_wait = shadow_rate, shadow_samples, shadow_wait
        self.margin = margin
        self.probe_steps = probe_steps
        self.warmup_steps = warmup_steps
        self.early_exit_steps = early_exit_steps
        self.early_exit_margin = early_exit_margin
        self.recheck_steps = recheck_steps
        self.initial_backoff = (backoff_steps, backoff_s)
        self.max_backoff = (max_backoff_steps, max_backoff_s)
        now = clock()
        self.buckets = [_Bucket(bucket_label(i), _Cost(alpha), _Cost(draft_alpha), since=now,
                                backoff_steps=backoff_steps, backoff_s=backoff_s, shadow_wait=shadow_wait)
                        for i in range(len(BUCKET_EDGES))]

    # ------------------------------------------------------------------ asked by the controller
    def allows(self, batch_size: int) -> bool:
        """Whether a step of `batch_size` running sequences drafts (otherwise it runs as with
        speculation off, launched ahead where it can be)."""
        b = self.buckets[bucket_of(batch_size)]
        if b.state == PROBING:
            return b.phase_drafting
        return b.state == DRAFTING

    def state(self, batch_size: int) -> str:
        return self.buckets[bucket_of(batch_size)].state

    def shadow(self, batch_size: int, hit: bool) -> None:
        """While drafting is paused for `batch_size`: a token proposed for free for some sequence
        was (`hit`) or was not the token the model produced next."""
        b = self.buckets[bucket_of(batch_size)]
        if b.state != PAUSED:
            return
        b.shadow_count += 1
        b.shadow_hits += (float(hit) - b.shadow_hits) / min(b.shadow_count, self.shadow_samples)
        if (b.shadow_count >= self.shadow_samples and b.shadow_hits >= self.shadow_rate
                and b.steps_in_state >= b.shadow_wait):
            self._probe(b, plain_first=False)

    # ------------------------------------------------------------------ fed by the engine
    def record(self, batch_size: int, drafting: bool, emitted: int, seconds: float) -> None:
        """One decode-only step's measurement: `drafting` is the mode it ran in."""
        if emitted <= 0 or seconds <= 0:
            return
        b = self.buckets[bucket_of(batch_size)]
        if b.run_mode is drafting:
            b.run_length += 1
        else:
            b.run_mode, b.run_length = drafting, 1
        if b.run_length <= self.warmup_steps:
            return                      # the step after a switch pays for the switch
        (b.draft if drafting else b.plain).add(seconds, emitted)
        b.steps_in_state += 1
        if b.state == PROBING:
            self._probe_sample(b, drafting, emitted, seconds)
        elif b.state == DRAFTING and drafting:
            if b.plain.samples and b.draft.per_token > b.plain.per_token * (1 + self.margin):
                self._pause(b)
            elif b.steps_in_state >= self.recheck_steps:
                self._probe(b, plain_first=True)
        elif b.state == PAUSED and not drafting:
            if b.steps_in_state >= b.backoff_steps or self.clock() - b.since >= b.backoff_s:
                self._probe(b, plain_first=False)

    # ------------------------------------------------------------------ transitions
    def _probe_sample(self, b: _Bucket, drafting: bool, emitted: int, seconds: float) -> None:
        if drafting != b.phase_drafting:
            return                      # a step scheduled before the phase began
        b.phase_seconds += seconds
        b.phase_tokens += emitted
        b.phase_samples += 1
        cost = b.phase_seconds / b.phase_tokens
        if not drafting:
            if b.phase_samples >= self.probe_steps:
                b.plain.reset()          # the fresh mean starts plain's EWMA
                b.plain.add(b.phase_seconds / b.phase_samples, b.phase_tokens / b.phase_samples)
                self._start_phase(b, drafting=True)
            return
        plain = b.plain.per_token
        early = b.phase_samples >= self.early_exit_steps and cost > plain * (1 + self.early_exit_margin)
        if b.phase_samples >= self.probe_steps or early:
            b.draft.reset()
            b.draft.add(b.phase_seconds / b.phase_samples, b.phase_tokens / b.phase_samples)
            if cost < plain:
                self._set(b, DRAFTING)
                b.backoff_steps, b.backoff_s = self.initial_backoff
                b.shadow_wait = self.initial_shadow_wait
            else:
                self._pause(b, failed_probe=True)

    def _probe(self, b: _Bucket, plain_first: bool) -> None:
        """Measure again: plain steps first when plain's cost is stale (after drafting), then
        drafting steps."""
        b.probes += 1
        self._set(b, PROBING)
        self._start_phase(b, drafting=not plain_first)

    def _start_phase(self, b: _Bucket, drafting: bool) -> None:
        b.phase_drafting = drafting
        b.phase_seconds, b.phase_tokens, b.phase_samples = 0.0, 0, 0

    def _pause(self, b: _Bucket, failed_probe: bool = False) -> None:
        if failed_probe and b.history[-1:] == [PAUSED]:
            # a re-probe that failed again: wait twice as long before the next one
            b.backoff_steps = min(b.backoff_steps * 2, self.max_backoff[0])
            b.backoff_s = min(b.backoff_s * 2, self.max_backoff[1])
        if failed_probe:
            b.shadow_wait = min(b.shadow_wait * 2, b.backoff_steps)
        b.pauses += 1
        self._set(b, PAUSED)

    def _set(self, b: _Bucket, state: str) -> None:
        b.history = (b.history + [b.state])[-4:]
        b.state = state
        b.steps_in_state = 0
        b.since = self.clock()
        b.shadow_hits, b.shadow_count = 0.0, 0

    # ------------------------------------------------------------------ shown
    def snapshot(self) -> list[BucketState]:
        return [BucketState(b.label, b.state, (b.phase_drafting if b.state == PROBING else b.state == DRAFTING),
                            b.draft.per_token, b.plain.per_token, b.pauses, b.probes)
                for b in self.buckets]
