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
