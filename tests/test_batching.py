"""Packed batches: sequences sharing one forward get the logits they get alone."""
import numpy as np
import pytest

from conftest import MODELS, load_fixture
from shared.step import SeqChunk

TOLERANCE = 1e-3

class Blocks:
    """Hands out distinct physical blocks for hand-built block tables."""
    def __init__(self, runner):
        self.block_size = runner.capacity.block_size
        self.next = 0

    def table(self, n_tokens: int) -> np.ndarray:
        n = -(-n_tokens // self.block_size)
        table = np.arange(self.next, self.next + n, dtype=np.int32)[::-1].copy()  # non-contiguous order
        self.next += n
        return table

def all_logits(runner, seq_id, tokens, table):
    return runner.forward_logits([SeqChunk(seq_id, np.asarray(tokens, np.int64), 0, table, len(tokens),
                                           sample=False, score_top_k=1)])

@pytest.mark.parametrize("model", MODELS)
def test_batch_of_four_prompts_matches_each_alone(model, engines):
    runner = engines(model).runner
    prompts = [c["prompt_tokens"] for c in load_fixture(model)["generate"][:4]]
    blocks = Blocks(runner)
    alone = [all_logits(runner, 100 + i, p, blocks.table(len(p))) for i, p in enumerate(prompts)]

    tables = [blocks.table(len(p)) for p in prompts]
    a, b, c, d = prompts
    def piece(i, start, end, last_only=False):
        tokens = np.asarray(prompts[i][start:end], np.int64)
        return SeqChunk(200 + i, tokens, start, tables[i], len(prompts[i]), sample=False,
                        score_top_k=0 if last_only else 1)

    # step 1: A whole, B's first 7 tokens, C and D all but their last token
    step1 = [piece(0, 0, len(a)), piece(1, 0, 7), piece(2, 0, len(c) - 1), piece(3, 0, len(d) - 1)]
    out1 = runner.forward_logits(step1)
    # step 2: C and D decode one token each, B's remaining prefill as one chunk
    step2 = [piece(2, len(c) - 1, len(c), last_only=True), piece(3, len(d) - 1, len(d), last_only=True),
             piece(1, 7, len(b))]
    out2 = runner.forward_logits(step2)

    rows1 = np.cumsum([len(a), 7, len(c) - 1, len(d) - 1])
    np.testing.assert_allclose(out1[:rows1[0]], alone[0], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(out1[rows1[0]:rows1[1]], alone[1][:7], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(out1[rows1[1]:rows1[2]], alone[2][:-1], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(out1[rows1[2]:rows1[3]], alone[3][:-1], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(out2[0], alone[2][-1], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(out2[1], alone[3][-1], atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(out2[2:], alone[1][7:], atol=TOLERANCE, rtol=0)

@pytest.mark.parametrize("model", MODELS)
def test_prefill_in_chunks_of_seven_matches_one_pass(model, engines):
    runner = engines(model).runner
    prompt = load_fixture(model)["generate"][3]["prompt_tokens"]
    blocks = Blocks(runner)
    whole = all_logits(runner, 300, prompt, blocks.table(len(prompt)))
    table = blocks.table(len(prompt))
    pieces = []
    for start in range(0, len(prompt), 7):
        tokens = np.asarray(prompt[start:start + 7], np.int64)
        pieces.append(runner.forward_logits([SeqChunk(301, tokens, start, table, len(prompt), sample=False,
                                                      score_top_k=1)]))
    chunked = np.concatenate(pieces)
    assert chunked.shape == whole.shape and len(pieces) > 3
    np.testing.assert_allclose(chunked, whole, atol=TOLERANCE, rtol=0)

def test_sliding_window_chunks_past_the_window_match_one_pass(engines):
    """Gemma 3's 512-token window: a 1100+ token prompt in chunks of 300 equals one pass."""
    runner = engines("gemma3-270m").runner
    prompt = load_fixture("gemma3-270m")["generate"][5]["prompt_tokens"]
    assert len(prompt) > 2 * runner.config.sliding_window
    blocks = Blocks(runner)
    whole_table, table = blocks.table(len(prompt)), blocks.table(len(prompt))
    last = runner.forward_logits([SeqChunk(400, np.asarray(prompt, np.int64), 0, whole_table, len(prompt),
                                           sample=False)])
    for start in range(0, len(prompt), 300):
        out = runner.forward_logits([SeqChunk(401, np.asarray(prompt[start:start + 300], np.int64), start,
                                              table, len(prompt), sample=False)])
    np.testing.assert_allclose(out, last, atol=TOLERANCE, rtol=0)


def test_decode_steps_pack_as_the_general_packing_does(engines):
    """One token a chunk takes step_packing.pack_decode: the same arrays as pack_chunks, with the
    metadata's derived tables filled in equal to what they compute, and the same error."""
    from kernels import AttentionMetadata
    from worker import step_packing
    runner = engines(MODELS[0]).runner
    bs = runner.capacity.block_size

    def pack_chunks(chunks):
        return step_packing.pack_chunks(chunks, bs, runner.config.causal, runner.capacity.num_window_blocks > 0)
    chunks = [SeqChunk(300, np.array([11]), 0, np.array([4], np.int32), 1, sample=False),
              SeqChunk(301, np.array([12]), bs + 3, np.array([9, 2, 7], np.int32), 40, sample=False,
                       prefix_ids=np.arange(bs + 3)),
              SeqChunk(302, np.array([13]), 2 * bs, np.array([5, 6, 8], np.int32), 5, sample=False,
                       prefix_ids=np.arange(2 * bs))]
    fast, fast_rows = runner._pack(chunks)
    slow, slow_rows = pack_chunks(chunks)
    for got, want in ((fast.token_ids, slow.token_ids), (fast.positions, slow.positions),
                      (fast.output_rows, slow.output_rows), (fast_rows, slow_rows)):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype
    a, b = fast.attention, slow.attention
    fresh = AttentionMetadata(a.query_lens, a.context_lens, a.block_tables, a.slot_mapping, a.causal)
    for name in ("query_lens", "context_lens", "block_tables", "slot_mapping"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
    assert a.causal == b.causal and a.all_decode is fresh.all_decode is True
    np.testing.assert_array_equal(a.row_starts, fresh.row_starts)
    np.testing.assert_array_equal(a.decode_seqs, fresh.decode_seqs)
    for got, want in zip(a.decode_tables, fresh.decode_tables):
        np.testing.assert_array_equal(got, want)
        assert got.dtype == want.dtype and got.flags.c_contiguous
    short = [SeqChunk(303, np.array([1]), 2 * bs, np.array([1, 2], np.int32), 3, sample=False,
                      prefix_ids=np.arange(2 * bs))]
    for pack in (runner._pack, pack_chunks):
        with pytest.raises(ValueError, match="block table has 2 blocks, 3 needed"):
            pack(short)
