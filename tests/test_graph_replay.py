"""Decode passes replayed from a captured program (kernels/cpu/graph_capture.py, graph_replay.py)
give the logits and K/V of the same pass run kernel by kernel, bit for bit."""
import importlib.util
import inspect
import logging
from pathlib import Path

import numpy as np
import pytest

from conftest import MODELS, load_fixture
from kernels.cpu import graph_capture, graph_replay
from kernels.cpu.graph_capture import ATTENTION, MATMUL, Unsupported
from shared.step import SeqChunk

pytestmark = pytest.mark.skipif(not graph_replay.available(), reason="needs numba and a CPU with AVX2")


def prefill(runner, seq_id, tokens, first_block):
    """Prompt `tokens` into fresh blocks from `first_block` (kernel by kernel); returns the table."""
    bs = runner.capacity.block_size
    table = np.arange(first_block, first_block + -(-(len(tokens) + 8) // bs), dtype=np.int32)
    runner.forward_logits([SeqChunk(seq_id, np.asarray(tokens, np.int64), 0, table, len(tokens), sample=False)])
    return table


def smollm2_prefilled(engines, seq_id, first_block):
    """SmolLM2's runner with the first fixture prompt prefilled (kernel by kernel): (runner,
    prompt, block table); skips where its products are not in 8-bit integers."""
    runner = engines("smollm2-135m").runner
    if not runner.ops.int8_matmul:
        pytest.skip("the model's products are not in 8-bit integers here")
    prompt = load_fixture("smollm2-135m")["generate"][0]["prompt_tokens"]
    return runner, prompt, prefill(runner, seq_id, prompt, first_block)


def decode_chunks(sequences, step):
    return [SeqChunk(seq_id, np.array([token + step], np.int64), len(prompt) + step, table, len(prompt),
                     sample=False)
            for seq_id, prompt, table, token in sequences]


def kv_rows(runner, table, start, n):
    """Every layer's K and V at positions [start, start + n) of one block table."""
    bs = runner.capacity.block_size
    pos = np.arange(start, start + n)
    return [c[:, table[pos // bs], pos % bs].copy() for pair in runner.model.kv_caches for c in pair]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_replayed_decode_steps_equal_the_kernels(model, rows, engines):
    runner = engines(model).runner
    ops = runner.ops
    if not ops.int8_matmul:
        pytest.skip("the model's products are not in 8-bit integers here")
    prompts = [c["prompt_tokens"] for c in load_fixture(model)["generate"][:rows]]
    tables = [prefill(runner, 900 + i, p, 1 + 200 * i) for i, p in enumerate(prompts)]
    sequences = [(900 + i, p, t, 1000 + 7 * i) for i, (p, t) in enumerate(zip(prompts, tables))]
    for step in range(3):                    # several steps: each reads the K/V the last one stored
        chunks = decode_chunks(sequences, step)
        ops.graph_replay = True
        replayed = runner.forward_logits(chunks)
        replayed_kv = [kv_rows(runner, t, len(p) + step, 1) for _, p, t, _ in sequences]
        assert ops._replays, "the pass was not replayed"
        ops.graph_replay = False
        plain = runner.forward_logits(decode_chunks(sequences, step))    # rewrites the same K/V
        ops.graph_replay = True
        np.testing.assert_array_equal(replayed, plain)
        for (_, p, t, _), kv in zip(sequences, replayed_kv):
            for got, want in zip(kv, kv_rows(runner, t, len(p) + step, 1)):
                np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("model", MODELS)
def test_a_decode_rows_logits_do_not_depend_on_its_batch(model, engines):
    """A sequence's decode row gives the same logits and K/V, bit for bit, replayed alone and in a
    pass of 6 decode rows (more than a replay takes: kernel by kernel, in 8-bit products on AVX2
    too, where passes of more than 4 rows once went to sgemm's float32 and moved logits by ~1e-2)."""
    runner = engines(model).runner
    ops = runner.ops
    if not ops.decode_batches_in_int8:
        pytest.skip("the model's decode batches are not in 8-bit integers here")
    prompts = [c["prompt_tokens"] for c in load_fixture(model)["generate"] if len(c["prompt_tokens"]) < 100][:3]
    prompts = prompts + [p[:-1] for p in prompts]             # six sequences, six context lengths
    tables = [prefill(runner, 960 + i, p, 1 + 30 * i) for i, p in enumerate(prompts)]
    sequences = [(960 + i, p, t, 4000 + 13 * i) for i, (p, t) in enumerate(zip(prompts, tables))]
    assert len(sequences) > graph_replay_max_rows()
    ops.graph_replay = True
    alone = runner.forward_logits(decode_chunks(sequences[:1], 0))
    alone_kv = kv_rows(runner, tables[0], len(prompts[0]), 1)
    batch = runner.forward_logits(decode_chunks(sequences, 0))
    np.testing.assert_array_equal(batch[0], alone[0])
    for got, want in zip(kv_rows(runner, tables[0], len(prompts[0]), 1), alone_kv):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("model", MODELS)
def test_a_verification_chunk_replayed_as_decode_rows_gives_each_positions_plain_decode(model, engines):
    """Speculative decoding's verification pass: a sequence's last token and 5 drafts packed as 6
    decode rows of one sequence (each reading the K/V the rows before it store in the same pass),
    beside another sequence's decode row, is replayed as one program, and each row's logits and
    K/V are those of decoding the same tokens one step at a time, bit for bit."""
    runner = engines(model).runner
    ops = runner.ops
    if not ops.int8_matmul:
        pytest.skip("the model's products are not in 8-bit integers here")
    prompts = [c["prompt_tokens"] for c in load_fixture(model)["generate"][:2]]
    verified = prefill(runner, 940, prompts[0], 600)
    stepped = prefill(runner, 941, prompts[0], 700)
    other = prefill(runner, 942, prompts[1], 800)
    tokens = np.array([1000 + 37 * j for j in range(6)], np.int64)
    params = load_params()
    chunks = [SeqChunk(940, tokens, len(prompts[0]), verified, len(prompts[0]), params=params, num_draft=5),
              SeqChunk(942, tokens[:1], len(prompts[1]), other, len(prompts[1]), params=params)]
    ops.graph_replay = True
    inp, _ = runner._pack(chunks)
    assert inp.attention.rows_share_sequences and inp.attention.decode_pass and len(inp.token_ids) == 7
    ops.begin_pass(7, decode=True)
    logits, argmax = ops.run_logits(runner.model, inp)
    assert any(key[1] == 7 and replay is not None for key, replay in ops._replays.items()), "not replayed"
    verified_kv = kv_rows(runner, verified, len(prompts[0]), 6)
    for j in range(6):
        one = SeqChunk(941, tokens[j:j + 1], len(prompts[0]) + j, stepped, len(prompts[0]), sample=False)
        np.testing.assert_array_equal(logits[j], runner.forward_logits([one])[0])
    for got, want in zip(verified_kv, kv_rows(runner, stepped, len(prompts[0]), 6)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(argmax, np.argmax(logits, axis=1))
    ops.graph_replay = False                 # kernel by kernel: every row's K/V stored before attention
    try:
        ops.begin_pass(7, decode=True)
        plain, _ = ops.run_logits(runner.model, inp)
    finally:
        ops.graph_replay = True
    np.testing.assert_array_equal(plain, logits)


def load_params():
    from shared.sampling_params import SamplingParams
    return SamplingParams(max_tokens=8, temperature=0.0)


def graph_replay_max_rows() -> int:
    from kernels.cpu.backend import REPLAY_MAX_ROWS
    return REPLAY_MAX_ROWS


@pytest.mark.parametrize("model", MODELS)
def test_replayed_logits_bring_their_argmax_and_forwards_replay_alone(model, engines):
    """run_logits replays the forward and the logits product as one program and finds each row's
    argmax on the way; run_forward replays the forward alone (its own program): both give what
    the kernels give."""
    runner = engines(model).runner
    ops = runner.ops
    if not ops.int8_matmul:
        pytest.skip("the model's products are not in 8-bit integers here")
    prompts = [c["prompt_tokens"] for c in load_fixture(model)["generate"][:2]]
    tables = [prefill(runner, 920 + i, p, 450 + 120 * i) for i, p in enumerate(prompts)]
    sequences = [(920 + i, p, t, 2000 + 11 * i) for i, (p, t) in enumerate(zip(prompts, tables))]
    inp, _ = runner._pack(decode_chunks(sequences, 0))
    ops.graph_replay = True
    logits, argmax = ops.run_logits(runner.model, inp)
    hidden = ops.run_forward(runner.model, inp)
    kinds = {key[3] for key, replay in ops._replays.items() if key[1] == 2 and replay is not None}
    assert kinds == {False, True}, "the logits and the hidden states were not both replayed"
    ops.graph_replay = False
    ops.begin_pass(len(inp.token_ids), decode=True)      # as the runner does before a decode pass
    try:
        np.testing.assert_array_equal(hidden, ops.run_forward(runner.model, inp))
        plain_logits, no_argmax = ops.run_logits(runner.model, inp)
    finally:
        ops.graph_replay = True
    np.testing.assert_array_equal(logits, plain_logits)
    assert no_argmax is None
    np.testing.assert_array_equal(argmax, np.argmax(logits, axis=1))


def test_a_profiled_replay_stamps_every_operation_in_order_and_computes_the_same(engines):
    """With Replay.cycle_log set (loadtest/profile_decode.py), each thread stamps the time-stamp
    counter at every operation and meeting, in program order, and the pass's numbers do not change."""
    runner, prompt, table = smollm2_prefilled(engines, 940, 700)
    ops = runner.ops
    sequences = [(940, prompt, table, 3000)]
    ops.graph_replay = True
    plain = runner.forward_logits(decode_chunks(sequences, 0))
    replay = next(r for key, r in ops._replays.items() if key[1] == 1 and key[3] and r is not None)
    replay.cycle_log = []
    try:
        profiled = runner.forward_logits(decode_chunks(sequences, 0))     # rewrites the same K/V
    finally:
        log, replay.cycle_log = replay.cycle_log, None
    np.testing.assert_array_equal(profiled, plain)
    assert len(log) == 1
    stamps = log[0]
    n_ops = len(replay.program.ops)
    assert stamps.shape == (replay.n_threads, n_ops + 3, 2)
    meets = [i + 1 for i, op in enumerate(replay.program.ops) if op[0] in (MATMUL, ATTENTION)]
    for th in range(replay.n_threads):
        order = np.concatenate([[stamps[th, 0, 0]], stamps[th, 1:].reshape(-1)])
        assert np.all(order > 0)
        assert np.all(np.diff(order) >= 0), f"thread {th}'s stamps are out of order"
        assert np.all(stamps[th, meets, 1] - stamps[th, meets, 0] > 0), "a product or attention took no cycles"
    # loadtest/profile_decode.py's phases of each thread add up to its whole region, cycle for cycle
    spec = importlib.util.spec_from_file_location(
        "profile_decode", Path(__file__).resolve().parents[1] / "loadtest" / "profile_decode.py")
    profile_decode = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile_decode)
    labels, nbytes = profile_decode.op_labels(replay.program)
    products = [op for op in replay.program.ops if op[0] == MATMUL]
    assert sum(nbytes.values()) == sum(replay.program.matrices[op[5]].nbytes for op in products)
    assert set(nbytes) == {labels[i] for i, op in enumerate(replay.program.ops) if op[0] == MATMUL}
    assert [i + 1 for i, m in enumerate(profile_decode.meetings(replay.program)) if m] == meets
    for th, acc in enumerate(profile_decode.phases(stamps, labels, profile_decode.meetings(replay.program))):
        assert sum(v for k, v in acc.items() if k != "region") == acc["region"] == stamps[th, -1, 0] - stamps[th, 0, 0]
    # --host-alone's stand-in for the region call fills the call's own result and greedy arrays
    names = list(inspect.signature(graph_replay._replay.py_func).parameters)
    args = [None] * len(names)
    args[names.index("result")], args[names.index("greedy")] = np.ones((1, 8), np.float32), np.full(1, 7, np.int64)
    profile_decode.skipping_region(graph_replay._replay)(*args)
    assert not args[names.index("result")].any() and args[names.index("greedy")].tolist() == [0]


class _InputRows:
    """Stands in for the backend of a replay whose input table has no Q8_0 rows: it hands over the rows."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def embedding(self, table, ids):
        return self.rows


def test_replayed_argmax_is_numpys_first_maximum_and_flags_nan_and_inf():
    """The output of a one-operation logits program (x * 1.0): each row copied out bit for bit, and
    its argmax as numpy's (first maximum, -0.0 equal to 0.0) or -1 where a value is NaN or infinite;
    rows of 5000 split between the threads in blocks of 512 with a short last one."""
    from kernels import AttentionMetadata
    from kernels.cpu.graph_capture import PRIVATE, SCALE, SHARED
    from worker.models.base import ForwardInput
    rows, width = 4, 5000
    rng = np.random.default_rng(5)
    values = np.array([[SHARED, 0, width, 0, width], [PRIVATE, 0, width, 0, width]], np.int64)
    program = graph_capture.Program(rows, np.array([[SCALE, 1, 0, 0, 0, 0, 0, 0, 0]], np.int64),
                                    np.array([[1.0, 0.0]]), values, rows * width, rows * width, None, 1,
                                    (rows, width), logits=True)
    replay = graph_replay.Replay(program)
    meta = AttentionMetadata.for_decode(np.ones(rows, np.int64), np.zeros((rows, 1), np.int64),
                                        np.zeros(rows, np.int64))
    inp = ForwardInput(np.zeros(rows, np.int64), np.zeros(rows, np.int64), meta, np.arange(rows))

    def run(x):
        result, argmax = replay.run(inp, _InputRows(x))
        np.testing.assert_array_equal(result.view(np.int32), x.view(np.int32))
        return argmax

    x = rng.standard_normal((rows, width)).astype(np.float32)
    x[0, [700, 4100]] = 9.0                      # a tie across the threads' halves: the first
    x[1, [2600, 2601]] = 9.0                     # a tie in the second half
    x[2, width - 1] = 9.0                        # the last value of the short last block
    x[3] = -np.abs(x[3])
    x[3, [30, 3000]] = [-0.0, 0.0]               # maximum 0: -0.0 comes first, numpy picks it
    assert np.argmax(x, axis=1).tolist() == [700, 2600, width - 1, 30]
    assert run(x).tolist() == [700, 2600, width - 1, 30]
    x[0, 10], x[1, 4999], x[2, 2500] = np.inf, np.nan, -np.inf
    assert run(x).tolist() == [-1, -1, -1, 30]


def test_gemma_window_is_kept_in_replays(engines):
    """A decode at position > 512 on Gemma 3's sliding-window layers sees the last 512 keys only."""
    runner = engines("gemma3-270m").runner
    if not runner.ops.int8_matmul:
        pytest.skip("the model's products are not in 8-bit integers here")
    prompt = list(np.random.default_rng(3).integers(1000, 20000, 530))
    table = prefill(runner, 950, prompt, 300)
    chunks = lambda: decode_chunks([(950, prompt, table, 1234)], 0)   # noqa: E731
    runner.ops.graph_replay = True
    replayed = runner.forward_logits(chunks())
    runner.ops.graph_replay = False
    plain = runner.forward_logits(chunks())
    runner.ops.graph_replay = True
    np.testing.assert_array_equal(replayed, plain)


def test_capture_of_smollm2_holds_every_layer(engines):
    runner = engines("smollm2-135m").runner
    if not runner.ops.int8_matmul:
        pytest.skip("the model's products are not in 8-bit integers here")
    chunk = decode_chunks([(990, [5] * 20, np.arange(500, 503, dtype=np.int32), 7)], 0)[0]
    chunk.prefix_ids = np.full(20, 5, np.int64)
    inp, _ = runner._pack([chunk])
    program = graph_capture.capture(runner.model, inp)
    layers = runner.config.n_layers
    assert (program.ops[:, 0] == MATMUL).sum() == 4 * layers      # Q|K|V, output, gate|up, down
    assert (program.ops[:, 0] == ATTENTION).sum() == layers
    assert len(program.matrices) == 4 * layers and len(program.caches) == 2 * layers
    assert program.output_shape == (1, runner.config.d_model)
    # each product knows the matrix of the next, whose start it prefetches before the barrier
    replay = graph_replay.Replay(program)
    products = np.flatnonzero(program.ops[:, 0] == MATMUL)
    assert replay.next_matrix[products].tolist() == program.ops[products[1:], 5].tolist() + [-1]
    assert replay.prefetch_bytes == graph_replay.NEXT_PRODUCT_PREFETCH


def test_what_a_capture_cannot_replay_is_refused():
    rec = graph_capture.GraphRecorder(2, [])
    x = rec.buffer(graph_capture.SHARED, (2, 8))
    assert x[np.arange(2)] is x                       # every row: the identity
    with pytest.raises(Unsupported):
        x[np.array([1])]                              # some rows: not replayable
    with pytest.raises(Unsupported):
        x.reshape(1, 16)                              # mixes rows
    with pytest.raises(Unsupported):
        x * np.ones(8, np.float32)                    # only scalars scale
    with pytest.raises(Unsupported):
        rec.matmul(x, object())                       # a matrix without 8-bit codes


def test_threads_that_cannot_meet_fall_back_to_the_kernels(engines, monkeypatch, caplog):
    """A replay planned for one thread more than numba runs: two of its iterations share a thread,
    the first waits at the barrier for the second, gives up, and the pass runs kernel by kernel
    with the same result; replays then stay off."""
    runner, prompt, table = smollm2_prefilled(engines, 980, 650)
    ops = runner.ops
    sequences = [(980, prompt, table, 4321)]
    ops.graph_replay = True
    expected = runner.forward_logits(decode_chunks(sequences, 0))
    key, replay = next((k, r) for k, r in ops._replays.items() if k[1] == 1 and r is not None)
    threads = graph_replay.numba.get_num_threads()
    monkeypatch.setattr(graph_replay.numba, "get_num_threads", lambda: threads + 1)
    oversubscribed = graph_replay.Replay(replay.program)
    oversubscribed.spin_limit = 20_000
    monkeypatch.setitem(ops._replays, key, oversubscribed)
    try:
        with caplog.at_level(logging.WARNING):
            got = runner.forward_logits(decode_chunks(sequences, 0))
        assert not ops.graph_replay and "replays are off" in caplog.text
        np.testing.assert_array_equal(got, expected)
    finally:
        ops.graph_replay = True



def test_a_token_out_of_range_in_a_replay_is_an_index_error(engines):
    """The replay decodes its input rows itself (Q8_0 tables): an id past the vocabulary stops it
    before any thread reads a row, with the backend's IndexError; replays stay on."""
    runner, prompt, table = smollm2_prefilled(engines, 985, 700)
    ops = runner.ops
    vocab = runner.config.vocab_size
    ops.graph_replay = True
    good = runner.forward_logits(decode_chunks([(985, prompt, table, 17)], 0))
    assert any(r is not None and r.embedding.size for r in ops._replays.values()), "no replay decoded its rows"
    with pytest.raises(IndexError, match=str(vocab)):
        runner.forward_logits(decode_chunks([(985, prompt, table, vocab)], 0))
    assert ops.graph_replay
    np.testing.assert_array_equal(runner.forward_logits(decode_chunks([(985, prompt, table, 17)], 0)), good)

def test_replays_can_be_turned_off(monkeypatch):
    from kernels.cpu import CPUBackend
    monkeypatch.setenv("TS_GRAPH_REPLAY", "0")
    assert not CPUBackend().graph_replay
    monkeypatch.setenv("TS_GRAPH_REPLAY", "1")
    assert CPUBackend().graph_replay


def test_arena_places_copies_in_shared_aligned_chunks():
    from kernels.cpu.arena import ALIGN, HugePageArena
    arena = HugePageArena(chunk=1 << 16)
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 255, n).astype(np.uint8) for n in (100, 3000, 20000)] + \
             [rng.standard_normal((7, 9)).astype(np.float32), rng.standard_normal(50000).astype(np.float32)]
    placed = [arena.place(a) for a in arrays]
    for a, p in zip(arrays, placed):
        np.testing.assert_array_equal(p, a)
        assert p.dtype == a.dtype and p.shape == a.shape
    for p in placed[:4]:                       # small arrays: views into the arena, 64-byte aligned
        assert p.base is not None and p.ctypes.data % ALIGN == 0
    assert placed[4] is arrays[4]              # a chunk or more keeps its own allocation
    assert np.shares_memory(placed[0], placed[1].base)

