#!/usr/bin/env bash
# Builds llama.cpp's llama-bench (the peer of `bench_forward.py --depths`, issue #35) from the
# llama.cpp sources vendored in the llama-cpp-python sdist, natively for this CPU.
#   loadtest/build_llama_bench.sh [OUT_DIR]     (default /work/peer-bench; ~10 min on 2 cores)
# then: LLAMA_BENCH=OUT_DIR/build/bin/llama-bench python loadtest/bench_forward.py --depths ...
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${1:-/work/peer-bench}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
if [ ! -d "$OUT/src" ]; then
  "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$OUT/sdist"
  mkdir -p "$OUT/src"
  tar -xzf "$OUT"/sdist/llama_cpp_python-*.tar.gz -C "$OUT/src" --strip-components=1
fi
source "$HERE/native_flags.sh"
cmake -S "$OUT/src/vendor/llama.cpp" -B "$OUT/build" -DCMAKE_BUILD_TYPE=Release "${NATIVE_FLAGS[@]}" \
  -DGGML_BLAS=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=OFF
cmake --build "$OUT/build" --target llama-bench -j"$(nproc)"
echo "built $OUT/build/bin/llama-bench"
