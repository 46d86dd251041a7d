"""The in-process engine: tokenizer + scheduler engine loop + model runner in one process.

Used by the CLI (`generate`, `score`, `diffuse`), the tests and benchmarks; the served
stack splits the same pieces across processes. A text-diffusion model (causal False) gets the
scheduler's diffusion batcher instead of the autoregressive engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from scheduler.diffusion import DiffusionBatcher, DiffusionRequest
from scheduler.engine import Engine
from scheduler.sequence import Sequence
from scheduler.speculative import make_controller
from shared.diffusion_params import DiffusionParams
from shared.model_registry import resolve_model
from shared.sampling_params import SamplingParams
from worker.config import DEFAULT_KV_MEMORY
from worker.gpu_memory import DEFAULT_GPU_MEMORY_UTILIZATION
from worker.model_runner import ModelRunner


@dataclass
class Completion:
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None


class LocalEngine:
    def __init__(self, model: str | Path, kv_memory: int = DEFAULT_KV_MEMORY, block_size: int = 16,
                 max_num_batched_tokens: int = 256, max_num_seqs: int = 64, load_tokenizer: bool = True,
                 enable_prefix_caching: bool = True, num_decode_steps: int = 1, kv_cache_dtype: str = "f16",
                 speculative: str = "off", num_speculative_tokens: int = 5, prompt_lookup_min: int = 2,
                 prompt_lookup_max: int = 4, speculative_governor: bool = True,
                 draft_model: str | Path | None = None, backend: str = "cpu", device: int = 0,
                 gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION, swa_full: bool = False):
        """`backend`: cpu, cuda or auto (worker/placement.py), on NVML's GPU `device`. `swa_full`:
        sliding-window layers keep every position in the one pool (worker/kv_pool.py)."""
        self.path = resolve_model(str(model))
        self.runner = ModelRunner(self.path, kv_memory=kv_memory, block_size=block_size,
                                  kv_cache_dtype=kv_cache_dtype, backend=backend, device=device,
                                  gpu_memory_utilization=gpu_memory_utilization,
                                  draft_model=resolve_model(str(draft_model)) if draft_model else None,
                                  max_num_seqs=None if swa_full else max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens)
        cap = self.runner.capacity
        self.diffusion: DiffusionBatcher | None = None
        self.engine: Engine | None = None
        if not self.runner.config.causal:
            self.diffusion = DiffusionBatcher(self.runner.execute, max_num_seqs=max_num_seqs)
        else:
            self.engine = Engine(self.runner.execute, cap.num_blocks, cap.block_size, cap.max_context,
                                 max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                                 fingerprint=self.runner.config.fingerprint, enable_prefix_caching=enable_prefix_caching,
                                 num_decode_steps=num_decode_steps, num_window_blocks=cap.num_window_blocks,
                                 window=cap.window,
                                 speculative=make_controller(speculative, num_speculative_tokens, prompt_lookup_min,
                                                             prompt_lookup_max, speculative_governor))
        self.tokenizer = None
        if load_tokenizer:
            from router.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_metadata(self.runner.gguf.metadata)

    @property
    def is_diffusion(self) -> bool:
        return self.diffusion is not None

    def _autoregressive(self) -> Engine:
        if self.engine is None:
            raise ValueError(f"{self.path.name} is a text-diffusion model ({self.config.architecture}): generate "
                             "with `tensorserve diffuse` (--gen-length, --steps, --block-length, --algorithm)")
        return self.engine

    @property
    def config(self):
        return self.runner.config

    @property
    def eos_ids(self) -> frozenset[int]:
        return self.tokenizer.eos_ids if self.tokenizer is not None else frozenset()

    def stream(self, prompt: list[int], params: SamplingParams) -> Iterator[int]:
        """Generate for one prompt, yielding each token as it is sampled."""
        engine = self._autoregressive()
        params.validate()
        seq = Sequence(list(prompt), params, eos_ids=self.eos_ids)
        engine.add(seq)
        emitted = 0
        while seq.finish_reason is None:
            engine.step()
            while emitted < len(seq.output):
                yield seq.output[emitted]
                emitted += 1
        self.last_finish_reason = seq.finish_reason

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Completion]:
        """Generate for several prompts at once, batched together."""
        engine = self._autoregressive()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [Sequence(list(p), sp, eos_ids=self.eos_ids) for p, sp in zip(prompts, plist)]
        for s in seqs:
            s.params.validate()
            engine.add(s)
        while any(s.finish_reason is None for s in seqs):
            engine.step()
        return [Completion(s.output, s.logprobs, s.finish_reason) for s in seqs]

    def score(self, tokens: list[int], top_k: int = 8) -> list[dict]:
        """Teacher-forced top-k log-probabilities after each prefix tokens[0..i]; for a diffusion
        model, of each position's own logits after one non-causal pass over all of `tokens`."""
        if self.diffusion is not None:
            return self.diffusion.score(list(tokens), top_k)
        seq = Sequence(list(tokens), SamplingParams(max_tokens=1, temperature=0.0), score_top_k=top_k)
        self.engine.add(seq)
        while seq.finish_reason is None:
            self.engine.step()
        return [{"top_ids": [int(i) for i in ids], "top_logprobs": [float(v) for v in lps]}
                for ids, lps, _ in seq.prompt_scores]

    def diffusion_request(self, prompt: list[int], params: DiffusionParams, **callbacks) -> DiffusionRequest:
        """A request for the diffusion batcher (not yet added); `callbacks`: on_step, on_block."""
        if self.diffusion is None:
            raise ValueError(f"{self.path.name} ({self.config.architecture}) is not a text-diffusion model: "
                             "use `tensorserve generate`")
        total = len(prompt) + params.gen_length
        if total > self.config.context_length:
            raise ValueError(f"the prompt's {len(prompt)} tokens + --gen-length {params.gen_length} exceed the "
                             f"model's context of {self.config.context_length} tokens; lower --gen-length")
        return DiffusionRequest(list(prompt), params, self.config.mask_token_id, **callbacks)

    def diffuse(self, prompts: list[list[int]], params: DiffusionParams | list[DiffusionParams]) -> list[list[int]]:
        """Denoise a canvas for each prompt, batched together; each one's canvas after its prompt."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        requests = [self.diffusion_request(p, sp) for p, sp in zip(prompts, plist)]
        for r in requests:
            self.diffusion.add(r)
        while any(not r.finished for r in requests):
            self.diffusion.step()
        return [r.output for r in requests]
