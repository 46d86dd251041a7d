"""Decode rows deep enough that attention takes their keys in two parts, one per thread
(kernels/cpu/key_parts.py split_point, replay_ops.py _attend_parts), replayed: the same
logits and K/V as the kernels, alone and batched, bit for bit."""
import numpy as np
import pytest

from conftest import MODELS
from kernels.cpu import graph_replay
from shared.step import SeqChunk
from test_graph_replay import kv_rows, load_params

pytestmark = pytest.mark.skipif(not graph_replay.available(), reason="needs numba and a CPU with AVX2")


def fill_blocks(runner, table, rng):
    """Random K/V (as a prefill would leave: every layer's pool) in the blocks of `table`."""
    from kernels.cpu import kv_codecs
    bs = runner.capacity.block_size
    slots = (table[:, None] * bs + np.arange(bs)).reshape(-1)
    for k, v in runner.model.kv_caches:
        n_kv, dim = k.shape[0], kv_codecs.values_in(kv_codecs.codec_of(k), kv_codecs.raw(k).shape[3])
        kv_codecs.store(k, v, rng.standard_normal((len(slots), n_kv, dim)).astype(np.float32),
                        rng.standard_normal((len(slots), n_kv, dim)).astype(np.float32), slots)


@pytest.mark.parametrize("model", MODELS)
def test_rows_whose_keys_go_in_two_parts_replay_as_the_kernels_alone_and_batched(model, engines):
    """Decode rows deep enough that each attention takes their keys in two parts on two threads
    (key_parts.split_point; Gemma 3's global layers), beside a row that does not: the
    replayed logits and K/V are the kernels', a row's the same alone and batched, and a
    verification chunk crossing SPLIT_KEYS gives each position's plain decode, bit for bit."""
    from kernels.cpu.key_parts import SPLIT_KEYS
    runner = engines(model).runner
    ops = runner.ops
    if not ops.int8_matmul or runner.model.kv_caches[0][0].dtype != np.float16:
        pytest.skip("the model's products are not in 8-bit integers here")
    bs = runner.capacity.block_size
    rng = np.random.default_rng(11)
    lengths = [SPLIT_KEYS + 100, 300, SPLIT_KEYS]
    tables, first = [], 1
    for n in lengths:
        tables.append(np.arange(first, first + -(-(n + 8) // bs), dtype=np.int32))
        fill_blocks(runner, tables[-1], rng)
        first += len(tables[-1])

    def decode_rows(count):                  # the worker has not seen the tokens of filled blocks
        return [SeqChunk(980 + i, np.array([3000 + 17 * i], np.int64), n, t, n, sample=False,
                         prefix_ids=np.zeros(n, np.int64))
                for i, (n, t) in enumerate(zip(lengths[:count], tables))]
    ops.graph_replay = True
    alone = runner.forward_logits(decode_rows(1))
    alone_kv = kv_rows(runner, tables[0], lengths[0], 1)
    replayed = runner.forward_logits(decode_rows(3))
    assert any(key[1] == 3 and replay is not None for key, replay in ops._replays.items()), "not replayed"
    replayed_kv = [kv_rows(runner, t, n, 1) for n, t in zip(lengths, tables)]
    ops.graph_replay = False
    try:
        plain = runner.forward_logits(decode_rows(3))
    finally:
        ops.graph_replay = True
    np.testing.assert_array_equal(replayed, plain)
    np.testing.assert_array_equal(replayed[0], alone[0])
    for got, want in zip(replayed_kv[0], alone_kv):
        np.testing.assert_array_equal(got, want)
    for (n, t), kv in zip(zip(lengths, tables), replayed_kv):
        for got, want in zip(kv, kv_rows(runner, t, n, 1)):
            np.testing.assert_array_equal(got, want)
    # verification rows at SPLIT_KEYS - 3 .. SPLIT_KEYS + 2: one part, then two, in one chunk
    start = SPLIT_KEYS - 3
    verified = np.arange(first, first + -(-(start + 16) // bs), dtype=np.int32)
    stepped = verified + len(verified)
    for t in (verified, stepped):
        fill_blocks(runner, t, np.random.default_rng(5))
    tokens = np.array([1000 + 37 * j for j in range(6)], np.int64)
    params = load_params()
    inp, _ = runner._pack([SeqChunk(990, tokens, start, verified, start, params=params, num_draft=5,
                                    prefix_ids=np.zeros(start, np.int64))])
    assert inp.attention.rows_share_sequences
    ops.begin_pass(6, decode=True)
    logits, _ = ops.run_logits(runner.model, inp)
    for j in range(6):
        one = SeqChunk(991, tokens[j:j + 1], start + j, stepped, start, sample=False,
                       prefix_ids=np.concatenate([np.zeros(start, np.int64), tokens[:j]]))
        np.testing.assert_array_equal(logits[j], runner.forward_logits([one])[0])
