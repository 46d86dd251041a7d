"""Long prompts (issue #35 item 6): a prompt that fills the context exactly, a cached prefix
followed by a long suffix, and greedy tokens that do not depend on how a prompt is chunked."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from conftest import MODELS
from shared.sampling_params import SamplingParams
from shared.step import SeqChunk
from tiny_models import write_tiny_llama

LOGPROB_TOLERANCE = 2e-2        # well inside the agreement bar (tests/agreement.py: 2.5)
CHUNKINGS = (1, 7, 48, 256, 512)
PROMPT_TOKENS = 600             # past Gemma 3's 512-token window
GREEDY_TOKENS = 4


def prefill_in_chunks(runner, seq_id: int, prompt: np.ndarray, table: np.ndarray, chunk: int) -> np.ndarray:
    """The prompt's last row's logits, the prompt sent `chunk` tokens a forward."""
    for start in range(0, len(prompt), chunk):
        logits = runner.forward_logits([SeqChunk(seq_id, prompt[start:start + chunk], start, table, len(prompt),
                                                 sample=False)])
    return logits[-1]


def greedy_after(runner, seq_id: int, prompt: np.ndarray, table: np.ndarray, logits: np.ndarray
                 ) -> tuple[list[int], list[float]]:
    """GREEDY_TOKENS greedy tokens after the prompt, one decode row a forward, with their log-probabilities."""
    tokens, logprobs = [], []
    for step in range(GREEDY_TOKENS):
        shifted = logits.astype(np.float64) - logits.max()
        token = int(np.argmax(logits))
        tokens.append(token)
        logprobs.append(float(shifted[token] - np.log(np.exp(shifted).sum())))
        logits = runner.forward_logits([SeqChunk(seq_id, np.array([token], np.int64), len(prompt) + step, table,
                                                 len(prompt), sample=False)])[-1]
    return tokens, logprobs


@pytest.mark.parametrize("model", MODELS)
def test_greedy_tokens_do_not_depend_on_how_the_prompt_is_chunked(model, engines):
    runner = engines(model).runner
    bs = runner.capacity.block_size
    rng = np.random.default_rng(11)
    prompt = rng.integers(1000, runner.config.vocab_size - 1000, PROMPT_TOKENS).astype(np.int64)
    n_blocks = -(-(PROMPT_TOKENS + GREEDY_TOKENS) // bs)
    runs = []
    for i, chunk in enumerate(CHUNKINGS):
        table = np.arange(i * n_blocks, (i + 1) * n_blocks, dtype=np.int32)
        last = prefill_in_chunks(runner, 500 + i, prompt, table, chunk)
        runs.append(greedy_after(runner, 500 + i, prompt, table, last))
    tokens, logprobs = runs[-1]
    for chunk, (got_tokens, got_logprobs) in zip(CHUNKINGS, runs):
        assert got_tokens == tokens, f"chunks of {chunk}"
        np.testing.assert_allclose(got_logprobs, logprobs, atol=LOGPROB_TOLERANCE, rtol=0, err_msg=f"chunks of {chunk}")


def test_a_cached_prefix_followed_by_a_long_suffix_gives_the_cold_tokens(engines):
    local = engines("smollm2-135m")
    engine = local.engine
    rng = np.random.default_rng(5)
    prefix = rng.integers(1000, 40000, 160).tolist()
    suffix = rng.integers(1000, 40000, 700).tolist()
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    cold = local.generate([prefix + suffix], params)[0]
    engine.blocks.reset_prefix_cache()
    local.generate([prefix], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    hits_before = engine.blocks.hit_tokens
    warm = local.generate([prefix + suffix], params)[0]
    assert engine.blocks.hit_tokens - hits_before >= 160 // engine.blocks.block_size * engine.blocks.block_size
    assert warm.tokens == cold.tokens
    np.testing.assert_allclose(warm.logprobs, cold.logprobs, atol=LOGPROB_TOLERANCE, rtol=0)


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    """A tiny random llama with 8-bit products and a 256-token context."""
    from tensorserve.local import LocalEngine
    path = write_tiny_llama(tmp_path_factory.mktemp("ctx") / "tiny-256.gguf", context_length=256, vocab=96,
                            d_model=64, n_heads=4, n_kv_heads=2, default_matrix_type=T.Q8_0)
    return LocalEngine(path, load_tokenizer=False, kv_memory=8 * 2**20, max_num_batched_tokens=48)


def test_a_prompt_that_fills_the_context_exactly(tiny_engine):
    context = tiny_engine.engine.max_context
    assert context == 256
    rng = np.random.default_rng(2)
    prompt = rng.integers(3, 90, context).tolist()
    scores = tiny_engine.score(prompt, top_k=1)            # every position of the context, in chunks of 48
    runner = tiny_engine.runner
    table = np.arange(context // runner.capacity.block_size, dtype=np.int32)
    whole = runner.forward_logits([SeqChunk(900, np.asarray(prompt, np.int64), 0, table, context, sample=False)])[-1]
    assert int(np.argmax(whole)) == scores[-1]["top_ids"][0]
    out = tiny_engine.generate([prompt[:-1]], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.tokens) == 1 and out.finish_reason == "length"    # the context's last position
    with pytest.raises(ValueError, match="context holds 256"):
        tiny_engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
