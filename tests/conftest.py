import json
import os
import tempfile
from pathlib import Path

import pytest

from redis_server import redis_server  # noqa: F401  (a fixture for every test module)

FIXTURES = Path(__file__).parent / "fixtures"

# Servers the tests start write no prefix checkpoints unless a test turns them on (a block left by
# one test would be restored in another, whose cached_tokens would then differ), and never into
# the user's cache.
os.environ.setdefault("TS_PREFIX_CHECKPOINTS", "0")
os.environ.setdefault("TS_CHECKPOINT_DIR", tempfile.mkdtemp(prefix="tensorserve-test-checkpoints-"))
MODELS = ["smollm2-135m", "gemma3-270m"]
# the kernels backend of the shared engines: `make gpu-check` runs the agreement tests with cuda
BACKEND = os.environ.get("TS_TEST_BACKEND", "cpu")


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu skip, saying why, where no GPU is found or CuPy does not import."""
    marked = [item for item in items if "gpu" in item.keywords]
    if not marked:
        return
    from worker.devices import detect_gpus
    from worker.placement import cuda_problem
    detection = detect_gpus()
    problem = (None if detection.gpus else detection.describe()) or cuda_problem()
    for item in marked if problem else ():
        item.add_marker(pytest.mark.skip(reason=f"needs an NVIDIA GPU and CuPy: {problem}"))


def load_fixture(model: str) -> dict:
    return json.loads((FIXTURES / f"{model}.json").read_text())


@pytest.fixture(scope="session")
def engines():
    """One in-process engine per bundled model, loaded on first use and shared by the session."""
    from tensorserve.local import LocalEngine
    cache: dict[tuple[str, str], LocalEngine] = {}

    def get(model: str, kv_cache_dtype: str = "f16") -> "LocalEngine":
        key = (model, kv_cache_dtype)
        if key not in cache:    # another codec's pool: a smaller one (the default engine's is 512 MiB)
            cache[key] = LocalEngine(model, load_tokenizer=False, kv_cache_dtype=kv_cache_dtype, backend=BACKEND,
                                     **({} if kv_cache_dtype == "f16" else {"kv_memory": 64 * 2**20}))
        # tests also drive the shared runner directly (forward_logits, engines of their own), which
        # overwrites KV blocks this engine's prefix cache may still list: forget them
        cache[key].engine.blocks.reset_prefix_cache()
        return cache[key]
    return get


# the most tokens a test compares with a model's plain greedy continuations (greedy_references)
REFERENCE_TOKENS = {"smollm2-135m": 24, "gemma3-270m": 12}


@pytest.fixture(scope="session")
def greedy_references(engines):
    """Plain greedy continuations (ignore_eos, no speculation, no prefix caching) of a model's fixture
    prompts, run together in one engine on the session's runner: what the speculative tests
    (test_speculative_decoding.py, test_draft_model.py) compare their outputs with. Computed once a
    session per model for REFERENCE_TOKENS tokens; `get(model, n)` gives each prompt's first n (a
    greedy run's first n tokens are the n-token run's)."""
    from scheduler.engine import Engine
    from scheduler.sequence import Sequence
    from shared.sampling_params import SamplingParams
    cache: dict[str, list[list[int]]] = {}

    def get(model: str, n: int) -> list[list[int]]:
        assert n <= REFERENCE_TOKENS[model], f"{n} tokens: raise REFERENCE_TOKENS[{model!r}]"
        if model not in cache:
            runner = engines(model).runner
            cap = runner.capacity
            engine = Engine(runner.execute, cap.num_blocks, cap.block_size, cap.max_context,
                            fingerprint=runner.config.fingerprint, enable_prefix_caching=False)
            params = SamplingParams(max_tokens=REFERENCE_TOKENS[model], temperature=0.0, ignore_eos=True)
            seqs = [Sequence(list(c["prompt_tokens"]), params) for c in load_fixture(model)["generate"]]
            for s in seqs:
                engine.add(s)
            while engine.has_work():
                engine.step()
            cache[model] = [list(s.output) for s in seqs]
        return [out[:n] for out in cache[model]]
    return get
