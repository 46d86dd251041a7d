"""Runs steps on one device: weights, KV pool, the packed forward and sampling.

The runner executes exactly what a StepRequest says; which sequences run, and
where their K/V lives, is decided by the caller (the scheduler).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from kernels import get_backend
from shared.gguf_file import GGUFFile
from shared.model_config import ModelConfig
from shared.sampling_params import SamplingParams
from shared.step import SeqChunk, SeqResult, StepRequest, StepResult
from worker.config import DEFAULT_KV_MEMORY
from worker.diffusion.canvas_step import CanvasStep
from worker.draft_model import DraftModel, check_vocabulary
from worker import step_packing
from worker.gpu_memory import DEFAULT_GPU_MEMORY_UTILIZATION, GpuBudget, weight_bytes
from worker.kv_pool import DEFAULT_CODEC, KVCapacity, KVPool, plan_capacity
from worker.models import ForwardInput, model_class
from worker.placement import choose_backend, cuda_ordinal
from worker.sampling import Sampler, make_generator
from worker.verification import verify_drafts
from worker.weights import WeightLoader

log = logging.getLogger(__name__)

LOGITS_ROWS_PER_SLICE = 64   # bounds the [rows, vocab] logits buffer when scoring long prompts


@dataclass
class _SeqState:
    """What the worker remembers of a sequence between steps: its tokens (for penalties) and RNG."""
    tokens: list[int]
    prompt_len: int
    generator: np.random.Generator | None = None
    params: SamplingParams | None = field(default=None)
    last_sampled: int | None = None        # stands in for a decode chunk's placeholder token (-1)


class ModelRunner:
    def __init__(self, model_path: str | Path, backend: str = "cpu", kv_memory: int = DEFAULT_KV_MEMORY,
                 block_size: int = 16, max_context: int | None = None, kv_cache_dtype: str = DEFAULT_CODEC,
                 draft_model: str | Path | None = None, device: int = 0,
                 gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int = 256):
        """`draft_model`: a draft GGUF run beside the target for speculative decoding (its own K/V
        pool, block ids mirroring the target's; worker/draft_model.py); it must share the
        target's vocabulary. `backend`: auto, cpu or cuda (worker/placement.py), `device` the GPU
        (NVML's index) of a cuda one, whose KV pool is sized from its free memory ×
        `gpu_memory_utilization` less the weights (worker/gpu_memory.py) instead of `kv_memory`.
        `max_num_seqs` (with `max_num_batched_tokens`): size a pool of their own for the sliding-window
        layers of a model that mixes them with full ones (worker/kv_pool.py); None: one pool."""
        t0 = time.perf_counter()
        self.gguf = GGUFFile(model_path)
        # the architecture first: another architecture's file lacks the metadata keys a config reads
        cls = model_class(self.gguf.architecture, self.gguf.path)
        self.config = ModelConfig.from_gguf(self.gguf)
        draft_gguf = None
        if draft_model is not None:
            draft_gguf = GGUFFile(draft_model)
            model_class(draft_gguf.architecture, draft_gguf.path)
            check_vocabulary(self.gguf, draft_gguf)
        self.placement = choose_backend(backend, device)
        log.info("kernels backend %s (%s)", self.placement.name, self.placement.why)
        if self.placement.gpu is not None:
            gpu = self.placement.gpu
            weights = weight_bytes(self.gguf) + (weight_bytes(draft_gguf) if draft_gguf is not None and
                                                 draft_gguf.path.resolve() != self.gguf.path.resolve() else 0)
            budget = GpuBudget(gpu, gpu_memory_utilization, weights)
            log.info("KV pool on the GPU: %s", budget.describe())
            kv_memory = budget.kv_bytes
            max_num_seqs = None      # the windowed layers' own pool is the CPU kernels' for now
            self.ops = get_backend("cuda", device=cuda_ordinal(gpu.index), capability=gpu.capability)
        else:
            self.ops = get_backend("cpu")
        # one plan for both models' matrices: the backend picks its products once
        self.ops.plan_weights({t.ggml_type for g in (self.gguf, draft_gguf) if g is not None
                               for t in g.tensors.values() if len(t.shape) == 2})
        self.ops.warm_up()
        self.model = cls(self.config, WeightLoader(self.gguf, self.ops), self.ops)
        if not self.config.causal:     # diffusion canvases keep no K/V: one block keeps the pool's shape
            # a canvas is bounded by the model's context (or --max-context), not by the K/V memory
            self.capacity = KVCapacity(1, block_size, min(self.config.context_length,
                                                          max_context or self.config.context_length))
        else:
            self.capacity = plan_capacity(self.config, kv_memory, block_size, max_context, kv_cache_dtype,
                                          max_num_seqs, max_num_batched_tokens)
        self.kv = KVPool(self.config, self.capacity, self.ops, kv_cache_dtype)
        # the rotation tables for every position the pool can hold, made now (as vLLM's rotary
        # cos/sin cache is): grown by the first step past a power of two instead, a request's
        # first step at 16k positions stalled 0.67 s (Gemma 3's two bases, a 2-vCPU Zen 3)
        if self.config.causal and hasattr(self.ops, "rope_table"):
            for base in {self.config.layer_rope_base(il) for il in range(self.config.n_layers)}:
                self.ops.rope_table(base, self.config.rope_dims, self.capacity.max_context)
        self.model.bind_kv(self.kv.caches)
        self.drafter: DraftModel | None = None
        if draft_gguf is not None:
            same = draft_gguf.path.resolve() == self.gguf.path.resolve()
            # its windowed layers (if any) keep every position, in blocks mirroring the full layers'
            self.drafter = DraftModel(draft_gguf, self.ops, replace(self.capacity, num_window_blocks=0, window=0),
                                      kv_cache_dtype,
                                      shared_model=self.model if same else None)
            log.info("draft model %s (%s, %d layers%s) beside the target, its K/V in %d blocks of its own",
                     draft_gguf.path.name, self.drafter.config.architecture, self.drafter.config.n_layers,
                     ", the target's own weights" if same else "", self.capacity.num_blocks)
        self.sampler = Sampler()
        # a text-diffusion model runs canvases (worker/diffusion/), not the paged AR steps below
        self.canvas = CanvasStep(self.model, self.ops, self.config) if not self.config.causal else None
        self._seqs: dict[int, _SeqState] = {}
        self.tokens_computed = 0
        log.info("loaded %s (%s, %d layers) in %.1fs; products: %s", self.gguf.path.name,
                 self.config.architecture, self.config.n_layers, time.perf_counter() - t0,
                 getattr(self.ops, "products", self.ops.name))

    # ------------------------------------------------------------------------
    def execute(self, request: StepRequest) -> StepResult:
        for seq_id in request.finished:
            self._seqs.pop(seq_id, None)
            if self.drafter is not None:
                self.drafter.forget(seq_id)
            if self.canvas is not None:
                self.canvas.forget(seq_id)
        self.kv.copy_blocks(request.copy_blocks, request.copy_window_blocks)
        chunks = request.chunks
        if not chunks:
            return StepResult([], 0)
        if self.canvas is not None:
            return self.canvas.execute(chunks)
        if any(c.diffusion is not None for c in chunks):
            raise ValueError(f"{self.gguf.path.name} ({self.config.architecture}) is not a text-diffusion model: "
                             "it cannot run diffusion canvases")
        for c in chunks:
            if len(c.token_ids) == 1 and int(c.token_ids[0]) == -1:
                state = self._seqs.get(c.seq_id)
                if state is None or state.last_sampled is None:
                    raise ValueError(f"sequence {c.seq_id}: placeholder token -1 but this worker has sampled "
                                     "no token for it")
                c.token_ids = np.array([state.last_sampled], np.int64)
        if self.drafter is not None:        # fills the drafted positions (-1) a chunk asks it for
            self.drafter.before_step(chunks, {c.seq_id: self._seqs[c.seq_id].tokens for c in chunks
                                              if c.seq_id in self._seqs})
        elif any(c.num_draft and int(c.token_ids[-1]) == -1 for c in chunks):
            raise ValueError("a chunk asks this worker to draft tokens but it has no draft model "
                             "(start it with --draft-model)")
        if request.num_steps > 1:
            return self._execute_steps(chunks, request.num_steps)
        result = self._execute_chunks(chunks)
        if self.drafter is not None:
            for c, r in zip(chunks, result.results):
                if c.num_draft:
                    self.drafter.kept(c.seq_id, c.start_pos + len(c.token_ids) - c.num_draft + len(r.accepted_ids))
        return result

    def _execute_chunks(self, chunks: list[SeqChunk]) -> StepResult:
        inp, score_rows = self._pack(chunks)
        self.ops.begin_pass(len(inp.token_ids), inp.attention.decode_pass)
        results = [SeqResult(c.seq_id) for c in chunks]
        if inp.attention.decode_pass and all(c.sample and not c.score_top_k for c in chunks):
            # one sampled row a chunk, or a verification's rows packed as decode rows
            logits, greedy = self.ops.run_logits(self.model, inp)
            logits = self.ops.to_numpy(logits)
            if inp.attention.rows_share_sequences:
                self._sample_and_verify(chunks, logits, results, greedy)
            else:
                self._sample(chunks, logits, results, greedy)
            self.tokens_computed += len(inp.token_ids)
            return StepResult(results, len(inp.token_ids))
        hidden = self.ops.run_forward(self.model, inp)

        # rows of `hidden`: per chunk its last token, all of its tokens when scoring, or its last
        # num_draft + 1 when verifying drafts
        offset = 0
        sample_idx, sample_rows = [], []
        plain_at: list[int] = []                       # each sample_idx chunk's row in the logits below
        verify: list[tuple[int, int]] = []             # (chunk, its first row in the logits below)
        for i, c in enumerate(chunks):
            n_rows = len(c.token_ids) if c.score_top_k else 1 + c.num_draft
            if c.score_top_k:
                ids, lps, target_lps = self._score(hidden[offset:offset + n_rows], c.score_top_k, c.score_targets)
                results[i].score_ids, results[i].score_logprobs = ids, lps
                results[i].score_target_logprobs = target_lps
            if c.sample and c.num_draft:
                verify.append((i, len(sample_rows)))
                sample_rows.extend(range(offset, offset + n_rows))
            elif c.sample:
                sample_idx.append(i)
                plain_at.append(len(sample_rows))
                sample_rows.append(offset + n_rows - 1)
            offset += n_rows
        if sample_rows:
            # the logits product goes where its own row count says: a prompt chunk's one sampled row
            # reads the output matrix's codes (a quarter of its float32 bytes), not OpenBLAS's gemv
            self.ops.begin_pass(len(sample_rows))
            logits = self.ops.to_numpy(self.model.logits(hidden[np.array(sample_rows)]))
            if sample_idx:
                self._sample([chunks[i] for i in sample_idx], logits[np.array(plain_at)] if verify else logits,
                             [results[i] for i in sample_idx])
            for i, first in verify:
                self._verify(chunks[i], logits[first:first + chunks[i].num_draft + 1], results[i])
        self.tokens_computed += len(inp.token_ids)
        return StepResult(results, len(inp.token_ids))

    def _execute_steps(self, chunks: list[SeqChunk], steps: int) -> StepResult:
        """`steps` decode steps in a row, each chunk's input the token sampled for it in the step
        before: greedy rows without penalties or logprobs in one replayed call where the backend
        can, otherwise (and from a step whose logits were not finite on) one step at a time."""
        for c in chunks:
            if len(c.token_ids) != 1 or not c.sample or c.score_top_k:
                raise ValueError(f"sequence {c.seq_id}: a request of {steps} steps takes one decode token a "
                                 "chunk that samples (no prompt chunks, no scoring)")
        per_step: list[list[SeqResult]] = []
        computed = 0
        run_steps = getattr(self.ops, "run_greedy_steps", None)
        if run_steps is not None and self.config.causal and all(
                c.params is not None and c.params.plain_greedy for c in chunks):
            inp, _ = self._pack(chunks)
            self.ops.begin_pass(len(chunks), True)
            tokens = run_steps(self.model, inp, steps)
            if tokens is not None:
                ended = (tokens < 0).any(axis=1)          # from a row's NaN logits on: step by step
                done = int(np.argmax(ended)) if ended.any() else steps
                for row in tokens[:done].tolist():
                    per_step.append([SeqResult(c.seq_id, token_id=t, logprob=float("nan")) for c, t in zip(chunks, row)])
                for c, state_tokens in zip(chunks, tokens[:done].T.tolist()):
                    state = self._seqs[c.seq_id]
                    state.tokens.extend(state_tokens[:-1])      # each step's input; the last one's is next
                    if state_tokens:
                        state.last_sampled = state_tokens[-1]
                computed = done * len(chunks)
                self.tokens_computed += computed
        while len(per_step) < steps:
            step = chunks if not per_step else [
                replace(c, token_ids=np.array([r.token_id], np.int64), start_pos=c.start_pos + len(per_step),
                        prefix_ids=None) for c, r in zip(chunks, per_step[-1])]
            result = self._execute_chunks(step)
            per_step.append(result.results)
            computed += result.tokens_computed
        return StepResult(per_step[0], computed, later=per_step[1:])

    def forward_logits(self, chunks: list[SeqChunk]) -> np.ndarray:
        """Raw logits of the rows a step would read (each chunk's last token, or all of its tokens
        when score_top_k is set), without sampling: for tests and debugging."""
        inp, _ = self._pack(chunks)
        self.ops.begin_pass(len(inp.token_ids), inp.attention.decode_pass)
        return self.ops.to_numpy(self.ops.run_logits(self.model, inp)[0])

    def _sample_and_verify(self, chunks: list[SeqChunk], logits: np.ndarray, results: list[SeqResult],
                           greedy: np.ndarray | None) -> None:
        """A pass packed by step_packing.pack_decode with verification chunks: each chunk's rows in order."""
        plain, plain_rows = [], []
        row = 0
        for i, c in enumerate(chunks):
            n = len(c.token_ids)
            if c.num_draft:
                self._verify(c, logits[row:row + n], results[i])
            else:
                plain.append(i)
                plain_rows.append(row)
            row += n
        if plain:
            at = np.array(plain_rows)
            self._sample([chunks[i] for i in plain], logits[at], [results[i] for i in plain],
                         greedy[at] if greedy is not None else None)

    def _pack(self, chunks: list[SeqChunk]) -> tuple[ForwardInput, np.ndarray]:
        """The forward's input for `chunks` (worker/step_packing.py) and the rows whose logits are
        read; the runner then remembers each chunk's tokens."""
        inp, rows = step_packing.pack(chunks, self.capacity.block_size, self.config.causal,
                                      self.capacity.num_window_blocks > 0,
                                      getattr(self.ops, "replays_decode_rows", None))
        for c in chunks:
            self._remember(c)
        return inp, rows

    def _remember(self, c: SeqChunk) -> None:
        state = self._seqs.get(c.seq_id)
        if state is None:
            state = _SeqState(tokens=[], prompt_len=c.prompt_len)
            self._seqs[c.seq_id] = state
        if c.params is not None and state.params is None:
            state.params = c.params
            state.generator = make_generator(c.params.seed)
        if c.prefix_ids is not None:
            if len(c.prefix_ids) != c.start_pos:
                raise ValueError(f"sequence {c.seq_id}: prefix_ids holds {len(c.prefix_ids)} tokens, "
                                 f"start_pos is {c.start_pos}")
            state.tokens[:] = (int(t) for t in c.prefix_ids)
        elif len(state.tokens) < c.start_pos:
            raise ValueError(f"sequence {c.seq_id} starts at position {c.start_pos} but the worker has seen "
                             f"{len(state.tokens)} of its tokens: send prefix_ids")
        del state.tokens[c.start_pos:]
        state.tokens.extend(int(t) for t in c.token_ids)
        state.prompt_len = c.prompt_len

    def _sample(self, chunks: list[SeqChunk], logits: np.ndarray, results: list[SeqResult],
                greedy: np.ndarray | None = None) -> None:
        """`greedy`: each row's argmax, where the backend computed it with the logits (-1: not usable)."""
        states = [self._seqs[c.seq_id] for c in chunks]
        params = []
        for c, s in zip(chunks, states):
            if s.params is None:
                raise ValueError(f"sequence {c.seq_id} asks for a token but no sampling parameters were sent")
            params.append(s.params)
        # only penalties read the tokens: no copies of long contexts for the other rows
        out = self.sampler.sample(logits, params,
                                  [s.tokens[:s.prompt_len] if p.has_penalties else () for s, p in zip(states, params)],
                                  [s.tokens[s.prompt_len:] if p.has_penalties else () for s, p in zip(states, params)],
                                  [s.generator for s in states], greedy)
        token_ids, logprobs = out.token_ids.tolist(), out.logprobs.tolist()
        for i, r in enumerate(results):
            r.token_id, r.logprob = token_ids[i], logprobs[i]
            states[i].last_sampled = r.token_id
            r.top_ids, r.top_logprobs = out.top_ids[i], out.top_logprobs[i]

    def _verify(self, c: SeqChunk, logits: np.ndarray, result: SeqResult) -> None:
        """Accept a prefix of the chunk's drafted tokens and choose the token after it
        (worker/verification.py); the worker's history keeps only the inputs whose tokens stay."""
        if c.score_top_k:
            raise ValueError(f"sequence {c.seq_id}: a chunk with drafted tokens cannot also score its positions")
        state = self._seqs[c.seq_id]
        if state.params is None:
            raise ValueError(f"sequence {c.seq_id} asks for a token but no sampling parameters were sent")
        first_draft = c.start_pos + len(c.token_ids) - c.num_draft      # position of d1
        p = state.params
        accepted, token = verify_drafts(
            logits, state.tokens[first_draft:first_draft + c.num_draft], p,
            state.tokens[:state.prompt_len] if p.has_penalties else (),
            state.tokens[state.prompt_len:first_draft] if p.has_penalties else (),
            state.generator if state.generator is not None else self.sampler._fallback)
        del state.tokens[first_draft + len(accepted):]    # rejected drafts were never the sequence's
        state.last_sampled = token
        result.token_id, result.logprob = token, float("nan")
        result.accepted_ids, result.accepted_logprobs = accepted, [float("nan")] * len(accepted)

    def _score(self, hidden: np.ndarray, k: int,
               targets: np.ndarray | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        ids, lps, target_lps = [], [], []
        for s in range(0, hidden.shape[0], LOGITS_ROWS_PER_SLICE):
            logprobs = self.ops.log_softmax(self.model.logits(hidden[s:s + LOGITS_ROWS_PER_SLICE]))
            i, v = self.ops.top_k(logprobs, k)
            ids.append(i)
            lps.append(v)
            if targets is not None:
                t = np.asarray(targets[s:s + logprobs.shape[0]], np.int64)
                picked = self.ops.to_numpy(logprobs[np.arange(len(t)), np.clip(t, 0, logprobs.shape[1] - 1)])
                picked = picked.astype(np.float32)
                target_lps.append(np.where(t >= 0, picked, np.float32(np.nan)))
        return (np.concatenate(ids), np.concatenate(lps),
                np.concatenate(target_lps) if targets is not None else None)
