"""On a GPU (`make gpu-check`, `pytest -m gpu`): greedy decoding on the CUDA backend gives the CPU
backend's tokens for the fixtures' prompts of both bundled models. Skipped without a GPU and CuPy."""
import pytest

from conftest import MODELS, load_fixture
from shared.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu
TOKENS = 32


@pytest.mark.parametrize("model", MODELS)
def test_greedy_on_cuda_equals_the_cpu(model):
    from tensorserve.local import LocalEngine
    prompts = [c["prompt_tokens"] for c in load_fixture(model)["generate"]]
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    outputs = {backend: [c.tokens for c in LocalEngine(model, load_tokenizer=False, backend=backend)
                         .generate(prompts, params)] for backend in ("cpu", "cuda")}
    for i, (cpu, cuda) in enumerate(zip(outputs["cpu"], outputs["cuda"])):
        first = next((j for j, (a, b) in enumerate(zip(cpu, cuda)) if a != b), None)
        assert first is None, f"{model} prompt {i}: CUDA leaves the CPU's tokens at {first}: {cpu} vs {cuda}"
