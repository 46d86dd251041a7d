"""The bar against llama.cpp's reference fixtures (tests/fixtures/*.json), as the
reference README defines it, written for these tests:

* where llama.cpp's top-1 logit leads its top-2 by >= 0.5, our argmax must equal its argmax;
* over all positions of all of a model's cases merged, >= 94 % of argmaxes agree;
* on the top-8 ids both sides list, |logprob difference| <= 2.5 at every position,
  and the median over positions of the per-position largest difference <= 0.35.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median

STRONG_MARGIN = 0.5
MIN_ARGMAX_AGREEMENT = 0.94
MAX_LOGPROB_ERROR = 2.5
MAX_MEDIAN_LOGPROB_ERROR = 0.35


@dataclass
class Agreement:
    positions: int = 0
    argmax_equal: int = 0
    strong_misses: list[tuple[int, float, int, int]] = field(default_factory=list)
    position_errors: list[float] = field(default_factory=list)

    def add_case(self, reference_positions: list[dict], ours: list[dict]) -> "Agreement":
        if len(reference_positions) != len(ours):
            raise ValueError(f"{len(ours)} scored positions for {len(reference_positions)} reference positions")
        for pos, (ref, mine) in enumerate(zip(reference_positions, ours)):
            self.positions += 1
            ref_ids, ref_logits = ref["top_ids"], ref["top_logits"]
            margin = ref_logits[0] - ref_logits[1]
            if mine["top_ids"][0] == ref_ids[0]:
                self.argmax_equal += 1
            elif margin >= STRONG_MARGIN:
                self.strong_misses.append((pos, margin, ref_ids[0], mine["top_ids"][0]))
            ref_logprob = {t: l - ref["logsumexp"] for t, l in zip(ref_ids, ref_logits)}
            our_logprob = dict(zip(mine["top_ids"], mine["top_logprobs"]))
            common = ref_logprob.keys() & our_logprob.keys()
            self.position_errors.append(
                max(abs(ref_logprob[t] - our_logprob[t]) for t in common) if common else float("inf"))
        return self

    @property
    def rate(self) -> float:
        return self.argmax_equal / self.positions if self.positions else 0.0

    @property
    def passed(self) -> bool:
        return (self.positions > 0 and not self.strong_misses and self.rate >= MIN_ARGMAX_AGREEMENT
                and max(self.position_errors) <= MAX_LOGPROB_ERROR
                and median(self.position_errors) <= MAX_MEDIAN_LOGPROB_ERROR)

    def summary(self) -> str:
        return (f"positions={self.positions} argmax agreement={self.rate:.4f} "
                f"strong misses={self.strong_misses[:5]} max err={max(self.position_errors, default=0):.3f} "
                f"median err={median(self.position_errors or [0]):.3f}")


def greedy_prefix_to_check(case: dict) -> int:
    """How many continuation tokens must match: up to the first position whose reference top-2 margin < 0.5."""
    n_prompt = len(case["prompt_tokens"])
    continuation = case["greedy_continuation"]
    for j in range(len(continuation)):
        ref = case["teacher_forced"][n_prompt - 1 + j]
        if ref["top_logits"][0] - ref["top_logits"][1] < STRONG_MARGIN:
            return j
    return len(continuation)
