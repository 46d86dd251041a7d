"""Per-request sampling parameters, shared by router, scheduler and worker.

Ranges follow the OpenAI API where OpenAI defines the parameter (``temperature``
in [0, 2], ``presence_penalty`` / ``frequency_penalty`` in [-2, 2], ``top_p`` in
(0, 1], ``logprobs`` / ``top_logprobs`` in [0, 20]) and vLLM for the extensions
(``top_k`` 0 or -1 disables it, ``min_p`` in [0, 1], ``repetition_penalty`` in [0.01, 10]: logits are divided by it in float32).
vLLM itself accepts any ``temperature >= 0``; we keep OpenAI's upper bound of 2
because higher values only produce noise and OpenAI clients expect the error.

A temperature below ``GREEDY_EPSILON`` (1e-5, vLLM's ``_SAMPLING_EPS``) is
treated as greedy decoding: top-k/top-p/min-p and the seed are then irrelevant.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["SamplingParams", "GREEDY_EPSILON", "MAX_LOGPROBS", "MAX_TEMPERATURE"]

GREEDY_EPSILON = 1e-5
MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20
_PENALTY_RANGE = (-2.0, 2.0)
_REPETITION_RANGE = (0.01, 10.0)     # 5e-324 is 0 in float32: the division made +inf logits
_INT32_MAX, _INT64_MAX = 2**31 - 1, 2**63 - 1      # the wire's field widths (common.proto)


def _is_int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 => greedy
    top_k: int = 0                    # 0 or -1 => disabled
    top_p: float = 1.0
    min_p: float = 0.0
    # > 1 penalizes tokens seen in prompt + output (vLLM semantics: divide
    # positive logits, multiply negative ones).
    repetition_penalty: float = 1.0
    # OpenAI semantics over *generated* tokens only:
    #   logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Number of top logprobs returned per generated token (0 = only the chosen
    # token's logprob, None = no logprobs at all).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # Accept any iterable for stop_token_ids but keep the dataclass hashable.
        if not isinstance(self.stop_token_ids, tuple):
            try:
                object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
            except TypeError:
                pass  # reported by validate()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise ``ValueError`` naming the offending parameter if out of range."""
        def fail(name: str, rule: str, value: object) -> None:
            raise ValueError(f"{name} must be {rule}, got {value!r}")

        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= _INT64_MAX:
            fail("max_tokens", "an integer >= 1", self.max_tokens)

        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or not 0.0 <= t <= MAX_TEMPERATURE:
            fail("temperature", f"a number in [0, {MAX_TEMPERATURE:g}]", t)

        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k not in (0, -1)) or self.top_k > _INT32_MAX:
            fail("top_k", f"an integer in [1, {_INT32_MAX}], or 0 / -1 to disable it", self.top_k)

        p = self.top_p
        if not _is_real(p) or not math.isfinite(p) or not 0.0 < p <= 1.0:
            fail("top_p", "a number in (0, 1]", p)

        m = self.min_p
        if not _is_real(m) or not math.isfinite(m) or not 0.0 <= m <= 1.0:
            fail("min_p", "a number in [0, 1]", m)

        r = self.repetition_penalty
        lo, hi = _REPETITION_RANGE
        if not _is_real(r) or not math.isfinite(r) or not lo <= r <= hi:
            fail("repetition_penalty", f"a number in [{lo:g}, {hi:g}]", r)

        lo, hi = _PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or not lo <= v <= hi:
                fail(name, f"a number in [{lo:g}, {hi:g}]", v)

        if self.seed is not None and (not _is_int(self.seed) or not -_INT64_MAX - 1 <= self.seed <= _INT64_MAX):
            fail("seed", "a 64-bit integer or None", self.seed)

        if not isinstance(self.stop_token_ids, tuple) or not all(
            _is_int(x) and 0 <= x <= _INT64_MAX for x in self.stop_token_ids
        ):
            fail("stop_token_ids", "a sequence of non-negative integers", self.stop_token_ids)

        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos", "a bool", self.ignore_eos)

        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            fail("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]", self.logprobs)

    # --------------------------------------------------------------- helpers
    @property
    def greedy(self) -> bool:
        """True when decoding is argmax (temperature 0, or below 1e-5)."""
        return self.temperature < GREEDY_EPSILON

    @property
    def top_k_enabled(self) -> bool:
        return self.top_k > 0

    @property
    def plain_greedy(self) -> bool:
        """Greedy with nothing else to compute (no penalties, no logprobs): the argmax is the answer."""
        return self.temperature < GREEDY_EPSILON and self.logprobs is None and not self.has_penalties

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
