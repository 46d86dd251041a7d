"""The GPU plumbing without a GPU: device detection and its fake descriptions (TS_FAKE_GPUS), the
choice of kernels backend, the KV pool's size on a GPU and the --max-context refusal, serve --gpus,
and the bucket and padding logic of captured decode graphs (kernels/cuda/graphs.py)."""
import json
import sys
import types

import numpy as np
import pytest

from kernels.cuda import graphs
from shared.options import ConfigError, options_of, resolve, to_argv
from tensorserve import serve
from tensorserve.gpus import GpuList, select_gpus
from worker import config as worker_config
from worker import devices, placement
from worker.config import WorkerConfig
from worker.devices import GPU, Detection, detect_gpus, fake_detection
from worker.gpu_memory import GPU_RESERVE_BYTES, GpuBudget, check_fit
from worker.placement import BackendUnavailable, choose_backend, cuda_ordinal

H100 = {"name": "NVIDIA H100", "capability": [9, 0], "total": 85e9, "free": 80e9}
L4 = {"name": "NVIDIA L4", "capability": [8, 9], "total": 24e9, "free": 3 * 2**28}
NO_CUPY = "CuPy does not import (ModuleNotFoundError: No module named 'cupy'); pip install 'tensorserve[cuda]'"


@pytest.fixture
def gpus(monkeypatch):
    """Fake devices through TS_FAKE_GPUS, and CuPy importing (or not: `cupy(problem)`)."""
    def use(*described, cupy: str | None = None):
        monkeypatch.setenv("TS_FAKE_GPUS", json.dumps(list(described)))
        monkeypatch.setattr(devices, "cupy_error", lambda: cupy)
        monkeypatch.setattr(placement, "cuda_kernels_problem", lambda: None)     # kernels/cuda/ is another branch's
    return use


# ---- detection -----------------------------------------------------------------------------------

def test_fake_description_lists_devices_with_their_memory(monkeypatch):
    monkeypatch.setenv("TS_FAKE_GPUS", json.dumps([H100, {**L4, "index": 3}]))
    found = detect_gpus()
    assert found.gpus == (GPU(0, "NVIDIA H100", (9, 0), 85_000_000_000, 80_000_000_000),
                          GPU(3, "NVIDIA L4", (8, 9), 24_000_000_000, 3 * 2**28))
    assert found.by_index(3).name == "NVIDIA L4" and found.by_index(1) is None
    assert "GPU 0 (NVIDIA H100, sm_90, 74.5 of 79.2 GiB free)" in found.describe()
    assert detect_gpus(fake="[]").gpus == () and "lists no device" in detect_gpus(fake="[]").reason


def test_a_bad_fake_description_says_what_is_expected():
    with pytest.raises(ValueError, match="TS_FAKE_GPUS: not a device list.*capability"):
        fake_detection('[{"name": "x"}]')


def test_without_nvidia_ml_py_no_device_and_the_reason(monkeypatch):
    monkeypatch.delenv("TS_FAKE_GPUS", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)           # import pynvml raises ImportError
    found = detect_gpus()
    assert found.gpus == () and "nvidia-ml-py (pynvml) is not installed" in found.reason


def test_without_a_driver_no_device_and_nvmls_reason(monkeypatch):
    class NVMLError(Exception):
        pass

    def init():
        raise NVMLError("Driver Not Loaded")
    monkeypatch.delenv("TS_FAKE_GPUS", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=init))
    found = detect_gpus()
    assert found.gpus == () and "Driver Not Loaded" in found.reason and "no NVIDIA driver" in found.reason


def test_nvml_devices_are_read_with_pynvml(monkeypatch):
    memory = types.SimpleNamespace(total=80 * 2**30, free=70 * 2**30)
    nvml = types.SimpleNamespace(NVMLError=RuntimeError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
                                 nvmlDeviceGetCount=lambda: 2, nvmlDeviceGetHandleByIndex=lambda i: i,
                                 nvmlDeviceGetName=lambda h: b"NVIDIA H200" if h else "NVIDIA H100",
                                 nvmlDeviceGetMemoryInfo=lambda h: memory,
                                 nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0))
    monkeypatch.delenv("TS_FAKE_GPUS", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert [(g.index, g.name, g.capability, g.free) for g in detect_gpus().gpus] == \
        [(0, "NVIDIA H100", (9, 0), 70 * 2**30), (1, "NVIDIA H200", (9, 0), 70 * 2**30)]


# ---- backend choice ------------------------------------------------------------------------------

def test_auto_is_cuda_with_a_gpu_and_cupy(gpus):
    gpus(H100)
    choice = choose_backend("auto")
    assert choice.name == "cuda" and choice.gpu.name == "NVIDIA H100" and choice.capability == (9, 0)


def test_auto_is_cpu_without_a_gpu_or_cupy_and_says_why(gpus):
    gpus()
    choice = choose_backend("auto")
    assert (choice.name, choice.gpu) == ("cpu", None) and "found no NVIDIA GPU" in choice.why
    gpus(H100, cupy=NO_CUPY)
    choice = choose_backend("auto")
    assert choice.name == "cpu" and "found GPU 0 (NVIDIA H100" in choice.why and "CuPy does not import" in choice.why
    assert choose_backend("cpu").why == "--backend cpu"


def test_cuda_without_a_gpu_or_cupy_fails_saying_what_to_install(gpus):
    gpus()
    with pytest.raises(BackendUnavailable, match=r"found no NVIDIA GPU.*pip install 'tensorserve\[cuda\]'"):
        choose_backend("cuda")
    gpus(H100, cupy=NO_CUPY)
    with pytest.raises(BackendUnavailable, match=r"found GPU 0 \(NVIDIA H100.*but CuPy does not import.*pip install"):
        choose_backend("cuda")
    gpus(H100)
    with pytest.raises(BackendUnavailable, match=r"no GPU 2: found GPU 0 \(NVIDIA H100"):
        choose_backend("cuda", device=2)


def test_worker_refuses_cuda_at_start_naming_the_flag(gpus, tmp_path):
    gpus()
    resolved = resolve(options_of(WorkerConfig), {"backend": "cuda"}, environ={})
    with pytest.raises(ConfigError, match=r"^--backend cuda \(flag\): found no NVIDIA GPU .*tensorserve\[cuda\]"):
        worker_config.check(resolved)


def test_auto_needs_the_cuda_kernels_too(gpus, monkeypatch):
    gpus(H100)
    monkeypatch.setattr(placement, "cuda_kernels_problem", lambda: "this build has no CUDA kernels")
    assert choose_backend("auto").name == "cpu" and "no CUDA kernels" in choose_backend("auto").why


def test_cupys_device_number_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert cuda_ordinal(2) == 2
    assert cuda_ordinal(2, visible="2") == 0 and cuda_ordinal(3, visible="1, 3") == 1
    with pytest.raises(BackendUnavailable, match="not among CUDA_VISIBLE_DEVICES=1"):
        cuda_ordinal(0, visible="1")


def test_get_backend_cuda_takes_the_variant_of_the_devices_capability(monkeypatch):
    made = {}

    class CUDABackend:
        def __init__(self, device=0, variant=None):
            made.update(device=device, variant=variant)
    monkeypatch.setitem(sys.modules, "kernels.cuda.backend", types.SimpleNamespace(CUDABackend=CUDABackend))
    monkeypatch.setitem(sys.modules, "kernels.cuda.variants",
                        types.SimpleNamespace(for_capability=lambda major, minor: {"sm": f"{major}{minor}"}))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda i: types.SimpleNamespace(compute_capability="89"))))
    from kernels import get_backend
    assert isinstance(get_backend("cuda", device=1, capability=(9, 0)), CUDABackend)
    assert made == {"device": 1, "variant": {"sm": "90"}}
    get_backend("cuda", device=0)                  # the capability asked of CuPy
    assert made == {"device": 0, "variant": {"sm": "89"}}


# ---- KV pool sizing on a GPU ---------------------------------------------------------------------

def test_kv_budget_is_free_memory_times_utilization_less_weights_and_reserve():
    gpu = fake_detection([H100]).gpus[0]
    budget = GpuBudget(gpu, 0.9, weights=10 * 2**30)
    assert budget.usable == 72_000_000_000
    assert budget.kv_bytes == 72_000_000_000 - 10 * 2**30 - GPU_RESERVE_BYTES
    assert GpuBudget(gpu, 0.1, weights=10 * 2**30).kv_bytes == 0
    text = budget.describe()
    assert "GPU 0 (NVIDIA H100) has 74.51 GiB free; × --gpu-memory-utilization 0.9 = 67.06 GiB" in text
    assert "less the weights' 10.00 GiB and 0.50 GiB reserved, leaves 56.56 GiB for the KV pool" in text


def test_fit_rule_is_the_cpus():
    gpu = GPU(0, "NVIDIA L4", (8, 9), 24 * 2**30, 2**30)
    budget = GpuBudget(gpu, 1.0, weights=0, reserve=0)     # 1 GiB: 1024 blocks of 1 MiB, 16 tokens each
    per_block, bs = 2**20, 16
    assert check_fit(budget, per_block, bs, None, "m", 100_000) is None
    assert check_fit(budget, per_block, bs, 1024 * 16, "m", 100_000) is None
    assert "holds 16384 tokens of m's KV at block size 16; lower the context or raise --gpu-memory-utilization" \
        in check_fit(budget, per_block, bs, 1024 * 16 + 1, "m", 100_000)
    assert "exceeds the trained context of m, 8192 tokens" in check_fit(budget, per_block, bs, 9000, "m", 8192)
    assert "holds no KV block of m" in check_fit(GpuBudget(gpu, 0.9, 2**30), per_block, bs, None, "m", 8192)


def test_worker_refuses_a_max_context_the_gpu_cannot_hold_with_the_numbers(gpus):
    gpus(L4)                                           # 0.75 GiB free
    flags = {"backend": "cuda", "max_context": "8192", "gpu_memory_utilization": "0.9"}
    with pytest.raises(ConfigError) as refused:
        worker_config.check(resolve(options_of(WorkerConfig), flags, environ={}))
    message = str(refused.value)
    assert message.startswith("--max-context 8192 (flag): GPU 0 (NVIDIA L4) has 0.75 GiB free; "
                              "× --gpu-memory-utilization 0.9 = 0.67 GiB, less the weights' ")
    assert "0.50 GiB reserved, leaves" in message and "tokens of smollm2-135m's KV at block size 16" in message
    worker_config.check(resolve(options_of(WorkerConfig), {**flags, "max_context": "1024"}, environ={}))
    gpus(H100)
    worker_config.check(resolve(options_of(WorkerConfig), flags, environ={}))


def test_gpu_memory_utilization_is_a_fraction():
    with pytest.raises(ConfigError, match=r"--gpu-memory-utilization takes a number > 0 and <= 1"):
        resolve(options_of(WorkerConfig), {"gpu_memory_utilization": "1.5"}, environ={})


# ---- serve --gpus --------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [("all", "all"), ("ALL", "all"), ("0", "0"), (" 1, 0 ", "1,0")])
def test_gpu_lists_parse(text, value):
    assert GpuList().parse(text) == value
    assert GpuList().from_yaml([0, 1]) == "0,1"


@pytest.mark.parametrize("text", ["0,0", "-1", "one", "0,,1", ""])
def test_bad_gpu_lists_are_refused(text):
    with pytest.raises(ValueError):
        GpuList().parse(text)


def test_select_gpus_names_what_was_found():
    two = fake_detection([H100, H100])
    assert [g.index for g in select_gpus("all", two)] == [0, 1]
    assert [g.index for g in select_gpus("1", two)] == [1]
    with pytest.raises(BackendUnavailable, match=r"no GPU 2, 5: found GPU 0 \(NVIDIA H100.*GPU 1 \(NVIDIA H100"):
        select_gpus("0,2,5", two)
    with pytest.raises(BackendUnavailable, match=r"found no NVIDIA GPU \(NVML lists no device\).*tensorserve\[cuda\]"):
        select_gpus("all", Detection((), "NVML lists no device"))


def test_serve_gpus_is_one_cuda_worker_per_gpu(gpus):
    gpus(H100, H100)
    resolved = resolve(serve.OPTIONS, {"gpus": "all"}, environ={})
    assert serve.gpu_devices(resolved) == [0, 1]
    serve._check(resolved)                     # each GPU's worker fits
    worker_cfg = resolved.build(WorkerConfig)
    import dataclasses
    argv, _ = to_argv(options_of(WorkerConfig), dataclasses.replace(worker_cfg, backend="cuda", device=1))
    assert argv[argv.index("--backend") + 1] == "cuda" and argv[argv.index("--device") + 1] == "1"


def test_serve_gpus_is_refused_without_a_gpu_or_cupy_naming_what_was_found(gpus):
    gpus()
    with pytest.raises(ConfigError, match=r"^--gpus all \(flag\): found no NVIDIA GPU"):
        serve.gpu_devices(resolve(serve.OPTIONS, {"gpus": "all"}, environ={}))
    gpus(H100, cupy=NO_CUPY)
    with pytest.raises(ConfigError, match=r"^--gpus 0 \(flag\): found GPU 0 \(NVIDIA H100.*but CuPy does not import"):
        serve.gpu_devices(resolve(serve.OPTIONS, {"gpus": "0"}, environ={}))
    with pytest.raises(ConfigError, match=r"the workers would run on the CPU \(--backend cpu \(flag\)\)"):
        serve.gpu_devices(resolve(serve.OPTIONS, {"gpus": "0", "backend": "cpu"}, environ={}))
    with pytest.raises(ConfigError, match="leave --replicas at 1"):
        serve.gpu_devices(resolve(serve.OPTIONS, {"gpus": "0", "replicas": "2"}, environ={}))


def test_serve_refuses_workers_sharing_one_gpu(gpus):
    gpus(H100)
    with pytest.raises(ConfigError, match=r"2 workers \(models × --replicas\) would share GPU 0"):
        serve._check(resolve(serve.OPTIONS, {"replicas": "2"}, environ={}))


def test_serve_gpus_help_says_the_layer_split_is_not_implemented():
    option = next(o for o in serve.OPTIONS if o.name == "gpus")
    assert "Splitting a model's layers across GPUs is not implemented yet" in option.spec.help


# ---- captured decode graphs: buckets and padding -------------------------------------------------

def test_buckets_are_powers_of_two_up_to_the_largest_batch():
    assert graphs.buckets_up_to(128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert graphs.buckets_up_to(100)[-1] == 128 and graphs.buckets_up_to(1) == (1,)
    buckets = graphs.buckets_up_to(128)
    assert [graphs.bucket_for(n, buckets) for n in (1, 2, 3, 5, 17, 64, 65, 128)] == [1, 2, 4, 8, 32, 64, 128, 128]
    assert graphs.bucket_for(129, buckets) is None
    with pytest.raises(ValueError):
        graphs.bucket_for(0, buckets)


def test_padding_rows_write_nowhere_and_read_block_zero():
    padded = graphs.pad_batch({"token_ids": np.array([5, 6, 7]), "positions": np.array([9, 3, 4]),
                               "context_lens": np.array([10, 4, 5]), "slot_mapping": np.array([41, 52, 63]),
                               "block_tables": np.array([[1, 2], [3, 0], [4, 0]]), "seeds": np.array([1, 2, 3])}, 4)
    assert padded["token_ids"].tolist() == [5, 6, 7, 0] and padded["positions"].tolist() == [9, 3, 4, 0]
    assert padded["context_lens"].tolist() == [10, 4, 5, 1] and padded["slot_mapping"].tolist() == [41, 52, 63, -1]
    assert padded["block_tables"].tolist() == [[1, 2], [3, 0], [4, 0], [0, 0]] and padded["seeds"][3] == 0
    assert graphs.pad_to(np.array([[1], [2]]), (3, 4)).tolist() == [[1, 0, 0, 0], [2, 0, 0, 0], [0, 0, 0, 0]]
    with pytest.raises(ValueError):
        graphs.pad_rows(np.zeros(5), 4)


class _DeviceArray(np.ndarray):
    def set(self, host, stream=None):
        self[...] = host


class _FakeCupy:
    """CuPy's few names DecodeGraphs uses: a stream whose capture records the step, a graph whose
    launch reruns it into the captured output (as a replay writes the same buffers)."""
    captures = 0

    @staticmethod
    def asarray(a):
        return np.array(a).view(_DeviceArray)

    class cuda:
        class Stream:
            current = None

            def __init__(self, non_blocking=False):
                self.capturing, self.recorded = False, []
                _FakeCupy.cuda.Stream.current = self

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def synchronize(self):
                pass

            def begin_capture(self):
                self.capturing, self.recorded = True, []
                _FakeCupy.captures += 1

            def end_capture(self):
                self.capturing = False
                return types.SimpleNamespace(launch=lambda stream=None, work=self.recorded: [w() for w in work])


def _step(inputs):
    """A stand-in decode step: row i's output is token * 10 + position, and a padded row's slot < 0."""
    def compute():
        return inputs["token_ids"] * 10 + inputs["positions"]
    out = compute().view(_DeviceArray)
    stream = _FakeCupy.cuda.Stream.current
    if stream.capturing:
        stream.recorded.append(lambda: out.set(compute()))
    return out


def test_decode_graphs_capture_a_bucket_once_and_replay_it_padded():
    _FakeCupy.captures = 0
    g = graphs.DecodeGraphs(_step, buckets=graphs.buckets_up_to(4), xp=_FakeCupy)
    batch = lambda tokens, width=2: {"token_ids": np.array(tokens), "positions": np.arange(len(tokens)),  # noqa: E731
                                     "slot_mapping": np.arange(len(tokens)),
                                     "block_tables": np.ones((len(tokens), width), np.int32)}
    assert g.run(batch([1, 2, 3])).tolist() == [10, 21, 32]
    assert set(g.graphs) == {4} and _FakeCupy.captures == 1
    assert g.graphs[4].inputs["slot_mapping"].tolist() == [0, 1, 2, -1]
    assert g.run(batch([7, 8, 9])).tolist() == [70, 81, 92]              # replayed, new inputs
    assert _FakeCupy.captures == 1 and g.replays == 2
    assert g.run(batch([4, 5])).tolist() == [40, 51] and set(g.graphs) == {2, 4}
    assert g.run(batch([1, 2, 3], width=3)).tolist() == [10, 21, 32] and g.eager == 1    # wider table: eager
    assert g.run(batch([1] * 5)).tolist() == [10, 11, 12, 13, 14] and g.eager == 2       # above the buckets


def test_decode_graphs_warm_up_captures_every_bucket():
    _FakeCupy.captures = 0
    g = graphs.DecodeGraphs(_step, buckets=(1, 2, 4, 8), xp=_FakeCupy)
    g.warm_up({"token_ids": np.array([3]), "positions": np.array([0])})
    assert sorted(g.graphs) == [1, 2, 4, 8] and _FakeCupy.captures == 4
    assert g.run({"token_ids": np.array([1, 2, 3, 4, 5]), "positions": np.zeros(5, np.int64)}).tolist() == \
        [10, 20, 30, 40, 50]
    assert _FakeCupy.captures == 4
