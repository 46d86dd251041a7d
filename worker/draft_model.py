"""A draft GGUF model run by the worker beside the target (speculative decoding, `--draft-model`).

The scheduler decides who drafts how many tokens; a chunk [last, -1 x k] with num_draft = k asks
this worker to fill the k drafted positions itself. The draft model proposes them greedily (its
argmax: a proposal that is deterministic given the context, so verifying it as a one-hot proposal
keeps the target's sampled distribution exact, worker/verification.py), batched over the step's
drafting sequences: one pass that brings each sequence's draft K/V up to its last token and
proposes d1, then k - 1 decode passes. The target verifies [last, d1..dk] in the step's forward.

The draft keeps its K/V in a pool of its own whose block ids mirror the target's (same block
size and number of blocks): the scheduler's block tables serve both, and no second block
manager exists. The draft catches up lazily: it remembers, per sequence, how many leading
positions of its pool hold K/V of the sequence's own tokens, and before proposing runs over the
tokens it has not seen (a whole prompt the first time, then the one or two tokens the last
verification kept, as decode passes). A chunk starting at position s means positions from s on
are (re)written, which cuts what the draft trusts, so rejected drafts' K/V is computed again. A
chunk that brings its prefix (prefix cache, preemption, restored checkpoints) may sit in blocks
this pool never wrote: each full block of the pool carries the chained key of the token prefix
whose draft K/V fills it, and the sequence trusts its leading blocks whose keys match its own.

`Drafter` is the interface the runner drives; a model's own draft heads (MTP / NextN layers
carried inside the target GGUF) can implement it later on the target's hidden states.
"""
from __future__ import annotations

import copy
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np

from kernels import AttentionMetadata
from shared.gguf_file import GGUFFile
from shared.model_config import ModelConfig
from shared.step import SeqChunk
from worker.kv_pool import KVCapacity, KVPool
from worker.models import ForwardInput, Model, model_class
from worker.weights import WeightLoader

log = logging.getLogger(__name__)

PLACEHOLDER = -1       # a drafted position the worker fills in
CATCH_UP_DECODE_ROWS = 4   # a draft catching up on at most this many tokens runs them as decode passes


class VocabularyMismatch(ValueError):
    """The draft model does not share the target's vocabulary (its token ids would mean other text)."""


def vocabulary_difference(target: GGUFFile, draft: GGUFFile) -> str | None:
    """What differs between the two models' vocabularies, in words, or None when they are the same
    (size, and every token's text; the tokens' hash when both lists are long)."""
    t_tokens = target.metadata.get("tokenizer.ggml.tokens")
    d_tokens = draft.metadata.get("tokenizer.ggml.tokens")
    t_size, d_size = ModelConfig.from_gguf(target).vocab_size, ModelConfig.from_gguf(draft).vocab_size
    if t_size != d_size:
        return f"vocabulary size {d_size} against the target's {t_size}"
    if t_tokens is None or d_tokens is None:
        return None if t_tokens is d_tokens else "one of the two has no tokenizer.ggml.tokens"
    if _hash(t_tokens) == _hash(d_tokens):
        return None
    if len(t_tokens) != len(d_tokens):
        return f"{len(d_tokens)} tokens against the target's {len(t_tokens)}"
    first = next(i for i, (a, b) in enumerate(zip(t_tokens, d_tokens)) if a != b)
    return f"token {first} is {d_tokens[first]!r} against the target's {t_tokens[first]!r}"


def _hash(tokens: Sequence[str]) -> str:
    h = hashlib.sha256()
    for t in tokens:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


def check_vocabulary(target: GGUFFile, draft: GGUFFile, target_name: str | None = None,
                     draft_name: str | None = None) -> None:
    """Raise VocabularyMismatch naming both models and what differs."""
    diff = vocabulary_difference(target, draft)
    if diff is not None:
        raise VocabularyMismatch(
            f"draft model {draft_name or draft.path.name} ({draft.architecture}) does not share the vocabulary "
            f"of the target {target_name or target.path.name} ({target.architecture}): {diff}; a draft must "
            "tokenize as the target does (e.g. `tensorserve make-draft --model TARGET --layers N --out FILE`)")


class Drafter(Protocol):
    """What the runner asks of a worker-side proposer."""
    name: str

    def before_step(self, chunks: list[SeqChunk], histories: dict[int, list[int]]) -> None:
        """Every chunk of a step, before the target's forward: fill the drafted positions (-1) of
        chunks that ask for them; `histories`: each sequence's tokens the worker knows."""

    def kept(self, seq_id: int, length: int) -> None:
        """After verification: the sequence keeps its tokens at positions [0, length)."""

    def forget(self, seq_id: int) -> None: ...


@dataclass
class _DraftSeq:
    valid: int = 0            # positions [0, valid) of the draft pool hold K/V of the sequence's own tokens
    keys: list = field(default_factory=list)   # chained key of each full block of its known tokens
    keyed: int = 0            # its leading blocks whose pool entries carry their key (block_keys)


class DraftModel:
    """A draft GGUF's model and K/V pool on the target's backend (see the module's docstring)."""
    name = "draft"

    def __init__(self, gguf: GGUFFile, ops, capacity: KVCapacity, kv_cache_dtype: str,
                 shared_model: Model | None = None):
        """`shared_model`: the target's model when the draft is the target's own file (its weights
        are used again, with this pool's K/V)."""
        self.gguf = gguf
        self.ops = ops
        self.config = ModelConfig.from_gguf(gguf)
        if shared_model is not None:
            self.model = copy.copy(shared_model)       # the same weights, its own K/V binding
        else:
            cls = model_class(gguf.architecture, gguf.path)
            self.model = cls(self.config, WeightLoader(gguf, ops), ops)
        self.kv = KVPool(self.config, capacity, ops, kv_cache_dtype)
        self.model.bind_kv(self.kv.caches)
        self.capacity = capacity
        self._seqs: dict[int, _DraftSeq] = {}
        # per block of the pool: the chained key of the token prefix whose draft K/V fills it (None:
        # not full, or unknown). A prompt that comes from the prefix cache (prefix_ids) trusts the
        # draft K/V of its leading blocks whose keys match its own, and computes the rest.
        self.block_keys: list = [None] * capacity.num_blocks
        self.draft_tokens_computed = 0

    @property
    def path(self) -> Path:
        return self.gguf.path

    # ------------------------------------------------------------------------
    def before_step(self, chunks: list[SeqChunk], histories: dict[int, list[int]]) -> None:
        bs = self.capacity.block_size
        for c in chunks:
            st = self._seqs.get(c.seq_id)
            if st is None:
                st = self._seqs[c.seq_id] = _DraftSeq()
            if c.prefix_ids is not None:          # its prefix may sit in blocks this pool never wrote
                st.keys = self._extend_keys([], [int(t) for t in c.prefix_ids], c.start_pos // bs)
                table = c.block_table
                n = 0
                while n < len(st.keys) and self.block_keys[int(table[n])] == st.keys[n]:
                    n += 1
                st.valid, st.keyed = n * bs, n
            elif c.start_pos == 0:
                st.valid, st.keyed, st.keys = 0, 0, []
            else:
                st.valid = min(st.valid, c.start_pos)
                st.keyed = min(st.keyed, st.valid // bs)
        wanted = [c for c in chunks if c.num_draft and int(c.token_ids[-1]) == PLACEHOLDER]
        if wanted:
            self._propose(wanted, histories)

    def kept(self, seq_id: int, length: int) -> None:
        st = self._seqs.get(seq_id)
        if st is not None:
            st.valid = min(st.valid, length)
            st.keyed = min(st.keyed, st.valid // self.capacity.block_size)

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def _extend_keys(self, keys: list, tokens: list[int], blocks: int) -> list:
        """`keys` extended to the first `blocks` full blocks of `tokens` (chained: a block's key
        names the whole prefix through it)."""
        bs = self.capacity.block_size
        for i in range(len(keys), blocks):
            keys.append(hash((keys[-1] if keys else 0, tuple(tokens[i * bs:(i + 1) * bs]))))
        return keys

    # ------------------------------------------------------------------------
    def _propose(self, chunks: list[SeqChunk], histories: dict[int, list[int]]) -> None:
        """Fill each chunk's last num_draft tokens with the draft model's greedy continuation."""
        bs = self.capacity.block_size
        catch_up: list[tuple[np.ndarray, int]] = []        # (tokens, first position) per chunk
        for c in chunks:
            first_draft = len(c.token_ids) - c.num_draft
            real = [int(t) for t in c.token_ids[:first_draft]]
            if any(t < 0 for t in real) or any(int(t) != PLACEHOLDER for t in c.token_ids[first_draft:]):
                raise ValueError(f"sequence {c.seq_id}: a chunk asking for drafts carries its real tokens, "
                                 f"then {c.num_draft} placeholders (-1)")
            history = ([int(t) for t in c.prefix_ids] if c.prefix_ids is not None
                       else list(histories.get(c.seq_id, ()))[:c.start_pos])
            if len(history) < c.start_pos:
                raise ValueError(f"sequence {c.seq_id} starts at position {c.start_pos} but the worker has seen "
                                 f"{len(history)} of its tokens: send prefix_ids")
            history = history[:c.start_pos] + real
            st = self._seqs[c.seq_id]
            catch_up.append((np.asarray(history[st.valid:], np.int64), st.valid))
            # the blocks pass 1 leaves full of the sequence's own tokens carry their keys from now on;
            # the one it leaves partial, and those the drafts are written in, none
            full = len(history) // bs
            del st.keys[full:]
            self._extend_keys(st.keys, history, full)
            for i in range(st.keyed, full):
                self.block_keys[int(c.block_table[i])] = st.keys[i]
            st.keyed = full
            for i in range(full, (len(history) + c.num_draft - 1) // bs + 1):
                if i < len(c.block_table):
                    self.block_keys[int(c.block_table[i])] = None
        # pass 1: every sequence's unseen tokens up to its last real one; the last row proposes d1
        tables = self._tables(chunks)
        context = np.array([s + len(t) for t, s in catch_up], np.int64)
        drafts: list[list[int]] = [[] for _ in chunks]
        longest = max(len(t) for t, _ in catch_up)
        if longest <= CATCH_UP_DECODE_ROWS:
            # the usual case (the one or two tokens the last verification kept): as decode passes, which
            # take the compiled products, where a pass of a few prompt rows may go to sgemm (on AVX2 a
            # 2-row SmolLM2 pass took ~57 ms against ~7 ms a decode pass)
            for j in range(longest):
                rows = [i for i, (t, _) in enumerate(catch_up) if len(t) > j]
                positions = np.array([catch_up[i][1] + j for i in rows], np.int64)
                tokens = np.array([catch_up[i][0][j] for i in rows], np.int64)
                nxt = self._run(self._decode_rows(rows, tokens, positions, tables))
                for r, i in enumerate(rows):
                    if len(catch_up[i][0]) == j + 1:
                        drafts[i].append(nxt[r])
                self.draft_tokens_computed += len(rows)
        else:
            tokens = np.concatenate([t for t, _ in catch_up])
            positions = np.concatenate([np.arange(s, s + len(t)) for t, s in catch_up])
            query_lens = np.array([len(t) for t, _ in catch_up], np.int64)
            nxt = self._greedy(tokens, positions, query_lens, context, tables, np.cumsum(query_lens) - 1)
            for i in range(len(chunks)):
                drafts[i].append(nxt[i])
            self.draft_tokens_computed += len(tokens)
        for i, c in enumerate(chunks):
            self._seqs[c.seq_id].valid = int(context[i])
        # passes 2..k: one decode row a sequence still drafting, its input the draft before
        while True:
            rows = [i for i, c in enumerate(chunks) if len(drafts[i]) < c.num_draft]
            if not rows:
                break
            left = {chunks[i].num_draft - len(drafts[i]) for i in rows}
            steps = self._run_steps(self._decode_input(rows, drafts, context, tables), left.pop()) if len(left) == 1 else None
            if steps is not None:       # up to a row's NaN logits (-1 from there on): the rest one by one
                bad = (steps < 0).any(axis=1)
                steps = steps[:int(np.argmax(bad)) if bad.any() else len(steps)].tolist()
            for nxt in steps if steps else [self._run(self._decode_input(rows, drafts, context, tables))]:
                for j, i in enumerate(rows):
                    drafts[i].append(int(nxt[j]))
                    context[i] += 1
                    self._seqs[chunks[i].seq_id].valid = int(context[i])
                self.draft_tokens_computed += len(rows)
        for c, d in zip(chunks, drafts):
            c.token_ids = np.concatenate([np.asarray(c.token_ids[:len(c.token_ids) - c.num_draft], np.int64),
                                          np.asarray(d, np.int64)])

    def _decode_input(self, rows: list[int], drafts: list[list[int]], context: np.ndarray,
                      tables: np.ndarray) -> ForwardInput:
        """One decode row for each of `rows`: its last draft at the position after its context (fresh
        arrays each time: a multi-step replay advances them in place)."""
        return self._decode_rows(rows, np.array([drafts[i][-1] for i in rows], np.int64),
                                 np.array([context[i] for i in rows], np.int64), tables)

    def _decode_rows(self, rows: list[int], tokens: np.ndarray, positions: np.ndarray,
                     tables: np.ndarray) -> ForwardInput:
        bs = self.capacity.block_size
        slots = np.array([tables[i, p // bs] * bs + p % bs for i, p in zip(rows, positions.tolist())], np.int64)
        meta = AttentionMetadata.for_decode(positions + 1, tables[rows].astype(np.int64), slots)
        return ForwardInput(tokens, positions, meta, np.arange(len(rows)))

    def _tables(self, chunks: list[SeqChunk]) -> np.ndarray:
        width = max(len(c.block_table) for c in chunks)
        tables = np.zeros((len(chunks), width), np.int32)
        for i, c in enumerate(chunks):
            tables[i, :len(c.block_table)] = c.block_table
        return tables

    def _greedy(self, tokens, positions, query_lens, context, tables, output_rows) -> list[int]:
        bs = self.capacity.block_size
        seq_index = np.repeat(np.arange(len(query_lens)), query_lens)
        slots = tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        meta = AttentionMetadata(query_lens, context, tables, slots, causal=True)
        return self._run(ForwardInput(tokens, positions, meta, np.asarray(output_rows, np.int64)))

    def _run_steps(self, inp: ForwardInput, steps: int) -> np.ndarray | None:
        """`steps` greedy decode passes in one call where the backend replays them ([steps, rows]
        tokens), else None and nothing was kept."""
        run_steps = getattr(self.ops, "run_greedy_steps", None)
        if steps < 2 or run_steps is None or not self.config.causal:
            return None
        self.ops.begin_pass(len(inp.token_ids), True)
        return run_steps(self.model, inp, steps)

    def _run(self, inp: ForwardInput) -> list[int]:
        """The argmax after each output row (the first maximum, as the greedy sampler takes)."""
        decode = inp.attention.decode_pass and len(inp.output_rows) == len(inp.token_ids)
        self.ops.begin_pass(len(inp.token_ids), inp.attention.decode_pass)
        if decode:
            logits, greedy = self.ops.run_logits(self.model, inp)
            if greedy is not None and (np.asarray(greedy) >= 0).all():
                return [int(t) for t in greedy]
            return [int(t) for t in np.argmax(self.ops.to_numpy(logits), axis=1)]
        hidden = self.ops.run_forward(self.model, inp)
        self.ops.begin_pass(len(inp.output_rows))
        logits = self.ops.to_numpy(self.model.logits(hidden))
        return [int(t) for t in np.argmax(logits, axis=1)]
