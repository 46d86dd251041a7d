"""Per-request parameters of text-diffusion generation, shared by scheduler and worker.

The scheduler reads the schedule's part (gen_length, steps, block_length, algorithm); the worker
the sampler's part (algorithm, temperature, top_k, top_p, seed, threshold, gamma). Names follow
llama.cpp's `llama-diffusion-cli` (`--diffusion-steps`, `--diffusion-block-length`,
`--diffusion-algorithm`) and SGLang's dLLM algorithms (`threshold`, and `gamma` for the
entropy bound). Each error names the CLI flag and what to do, since `tensorserve diffuse`
shows them as they are.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

__all__ = ["DiffusionParams", "diffusion_flags", "LLAMA_CPP_ALGORITHMS", "THRESHOLD_ALGORITHMS", "ALGORITHMS"]

# llama.cpp's block schedule: each step commits a count fixed by the schedule
LLAMA_CPP_ALGORITHMS = ("confidence", "entropy", "margin", "random", "origin")
# SGLang-style: each step commits what clears a bound, a block ends when it has no mask left
THRESHOLD_ALGORITHMS = ("low_confidence", "entropy_bound")
ALGORITHMS = LLAMA_CPP_ALGORITHMS + THRESHOLD_ALGORITHMS


@dataclass(frozen=True)
class DiffusionParams:
    # each field's help is the `tensorserve diffuse` flag's (--gen-length, ...): defined once here
    gen_length: int = field(default=64, metadata={"help": "canvas tokens to generate after the prompt; with the "
                            "prompt, a multiple of --block-length (llama.cpp: -ub = prompt + gen-length)"})
    steps: int = field(default=64, metadata={"help": "denoising steps in all, a multiple of the number of blocks "
                       "(each block gets steps / blocks); ignored by low_confidence and entropy_bound"})
    block_length: int = field(default=32, metadata={"help": "tokens per block; blocks are denoised one after "
                              "another, the first starting after the prompt"})
    algorithm: str = field(default="confidence", metadata={"help": "which masked positions a step commits: "
                           "confidence, entropy, margin, random, origin (llama.cpp), low_confidence (p >= "
                           "--threshold), entropy_bound (summed entropy <= --gamma)"})
    temperature: float = field(default=0.0, metadata={"help": "0 takes each position's argmax (default); > 0 "
                               "samples as llama-diffusion-cli's --temp"})
    top_k: int = field(default=0, metadata={"help": "keep the k best tokens of a position, 0 = off"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus mass of a position's candidates, 1 = off"})
    seed: int = field(default=0, metadata={"help": "seed of the sampling and of the random/origin algorithms"})
    threshold: float = field(default=0.9, metadata={"help": "low_confidence: commit the masked positions whose "
                             "token probability is >= this, in (0, 1]"})
    gamma: float = field(default=1.0, metadata={"help": "entropy_bound: commit the lowest-entropy positions "
                         "while their summed entropy is <= this"})

    @property
    def fixed_counts(self) -> bool:
        """True for llama.cpp's algorithms: the schedule says how many tokens each step commits."""
        return self.algorithm in LLAMA_CPP_ALGORITHMS

    def validate(self, n_prompt: int | None = None) -> None:
        """Raise ValueError naming the flag at fault; `n_prompt` also checks the block layout."""
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--algorithm {self.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
        if self.gen_length <= 0:
            raise ValueError(f"--gen-length must be > 0 (got {self.gen_length}): the number of tokens to generate")
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1 (got {self.steps})")
        if self.block_length <= 0:
            raise ValueError(f"--block-length must be > 0 (got {self.block_length})")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (got {self.temperature}); 0 takes each position's argmax")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0 (got {self.top_k}); 0 turns it off")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p must be in (0, 1] (got {self.top_p}); 1 turns it off")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"--threshold must be in (0, 1] (got {self.threshold}): the probability at which "
                             "low_confidence commits a position")
        if self.gamma < 0:
            raise ValueError(f"--gamma must be >= 0 (got {self.gamma}): the entropy budget of one entropy_bound step")
        if n_prompt is not None:
            self.blocks(n_prompt)

    def blocks(self, n_prompt: int) -> int:
        """Number of blocks of llama.cpp's layout: the whole canvas, prompt included, in blocks of
        block_length, the first starting after the prompt (so late blocks may be short or empty)."""
        total = n_prompt + self.gen_length
        if total % self.block_length:
            raise ValueError(f"--block-length {self.block_length} must divide the prompt's {n_prompt} tokens + "
                             f"--gen-length {self.gen_length} = {total} (llama.cpp's block schedule); "
                             f"e.g. --gen-length {self.gen_length + (-total) % self.block_length}")
        n_blocks = total // self.block_length
        if self.fixed_counts and self.steps % n_blocks:
            suggestion = n_blocks * max(1, self.steps // n_blocks)
            raise ValueError(f"--steps {self.steps} must be a multiple of the {n_blocks} blocks "
                             f"((prompt + --gen-length) / --block-length), e.g. --steps {suggestion}")
        return n_blocks


def diffusion_flags() -> list[tuple[str, str, type, object, str]]:
    """(flag, field name, type, default, help) of every field, for the CLI."""
    return [("--" + f.name.replace("_", "-"), f.name, type(f.default), f.default, f.metadata["help"])
            for f in fields(DiffusionParams)]
